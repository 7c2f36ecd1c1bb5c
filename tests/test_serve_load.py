"""A bounded load test: 16 concurrent clients x 4 greedy requests each on the shipped pair; every
answer, streamed or not, must be exactly the offline ``engine.generate`` output."""

from __future__ import annotations

import concurrent.futures as futures

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from speculant.serve import create_app  # noqa: E402
from speculant.serve.background import serving  # noqa: E402

CLIENTS, REQUESTS, MAX_TOKENS, TIMEOUT = 16, 4, 10, 120
PROMPTS = ["def fibonacci(n):", "import os\n", "class Point:\n", "for i in range(10):\n", "def add(a, b):\n",
           "while True:\n", "x = [", "print("]


@pytest.fixture(scope="module")
def engine(torch_threads):
    from speculant import Engine, embedded

    return Engine.from_config(embedded.engine_config(backend="torch"))


def ask(client, prompt: str, stream: bool) -> str:
    kwargs = {"model": "speculant", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(e.choices[0].text for e in client.completions.create(stream=True, **kwargs) if e.choices)


def test_sixteen_concurrent_clients_get_exactly_the_offline_tokens(engine):
    expected = {p: engine.run(p, max_new_tokens=MAX_TOKENS, temperature=0).text for p in PROMPTS}
    app = create_app(engine, max_queue=CLIENTS, timeout=TIMEOUT)
    with serving(app) as url:
        def client_session(c: int) -> list[tuple[str, str]]:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
            out = []
            for r in range(REQUESTS):
                prompt = PROMPTS[(c + r) % len(PROMPTS)]
                out.append((prompt, ask(client, prompt, stream=(c + r) % 2 == 0)))
            return out

        with futures.ThreadPoolExecutor(CLIENTS) as pool:
            results = [f.result(timeout=TIMEOUT) for f in [pool.submit(client_session, c) for c in range(CLIENTS)]]
        metrics = __import__("httpx").get(url + "/metrics", timeout=TIMEOUT).text
    answers = [pair for session in results for pair in session]
    assert len(answers) == CLIENTS * REQUESTS
    wrong = [(p, got, expected[p]) for p, got in answers if got != expected[p]]
    assert not wrong, wrong[:3]
    assert f'speculant_requests_total{{endpoint="completions",status="200"}} {CLIENTS * REQUESTS}.0' in metrics
    assert app.state.server.worker.waiting == 0
