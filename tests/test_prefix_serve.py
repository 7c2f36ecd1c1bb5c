"""``speculant serve`` with the prefix cache: two requests sharing a long prefix, the second
resumed from the cache (``usage.prompt_tokens_details.cached_tokens``, streamed too), with the
text of a server whose cache is off; /metrics counts the hits and the bytes held."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from speculant.api import load_engine  # noqa: E402
from speculant.serve import create_app  # noqa: E402
from speculant.serve.background import serving  # noqa: E402

SYSTEM = "You are a careful assistant. Answer in one line. " * 6
QUESTIONS = ["What is two plus two?", "Name a colour."]


def answers(target, max_bytes: int) -> list:
    """Completions of SYSTEM + each question from a fresh server: whole, then streamed with usage."""
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
              "prefix_cache": {"max_bytes": max_bytes}}
    with serving(create_app(load_engine(config), timeout=60)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
        out = []
        for question in QUESTIONS:
            whole = client.completions.create(model="speculant", prompt=SYSTEM + question, max_tokens=24, temperature=0)
            events = list(client.completions.create(model="speculant", prompt=SYSTEM + question, max_tokens=24,
                                                    temperature=0, stream=True, stream_options={"include_usage": True}))
            streamed = "".join(e.choices[0].text for e in events if e.choices)
            out.append((whole.choices[0].text, whole.usage.prompt_tokens_details.cached_tokens,
                        streamed, events[-1].usage.prompt_tokens_details.cached_tokens))
        metrics = httpx.get(url + "/metrics", timeout=60).text
    return out, metrics


def metric(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_shared_prefix_is_served_from_the_cache_with_cold_text(tiny_target):
    cached, metrics = answers(tiny_target, 1 << 26)
    cold, cold_metrics = answers(tiny_target, 0)
    assert [(c[0], c[2]) for c in cached] == [(c[0], c[2]) for c in cold]
    assert cached[0][1] == 0  # the first request found nothing
    assert cached[1][1] > 20 and cached[1][3] > 20  # the second shares the system text with the first
    assert cached[0][3] > 20  # the stream repeats a prompt just served
    assert all(c[1] == c[3] == 0 for c in cold)
    assert metric(metrics, "speculant_prefix_cache_hits_total") == 3
    assert metric(metrics, "speculant_prefix_cache_bytes") > 0
    assert metric(cold_metrics, "speculant_prefix_cache_bytes") == 0
