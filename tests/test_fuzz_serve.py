"""Fuzzing speculant serve's request reader (issue 37, "Keep it so"): random JSON values, random
fields and random bytes against a real server in this process, on a tiny real target with a
64-token window (every generation ends within milliseconds).

Each answer must be a typed OpenAI-shaped error or a success: never a 500, a logged traceback,
a hang, or a non-finite setting reaching the engine. Requests also go several at once, some
clients leaving after the first line, beside a greedy request that must get its text alone.
"""

from __future__ import annotations

import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from speculant.serve import create_app  # noqa: E402
from speculant.serve.background import serving  # noqa: E402

WINDOW = 64
REQUEST_S = 20  # a reply slower than this is a hang
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "user", "presence_penalty", "frequency_penalty",
          "logprobs", "top_logprobs", "echo"]
STATUSES = {200, 400, 404, 408, 413, 429, 503, 504}  # 500 is a bug, whatever the input


class WatchedEngine:
    """The real engine, with every setting a request hands it checked on the way in."""

    def __init__(self, engine):
        self.engine, self.non_finite = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def request(self, prompt_ids, max_new_tokens=None, **kwargs):
        for key, value in kwargs.items():
            if isinstance(value, float) and not math.isfinite(value):
                self.non_finite.append((key, value))
        return self.engine.request(prompt_ids, max_new_tokens, **kwargs)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, torch_threads):
    from speculant.api import load_engine
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target

    root = tmp_path_factory.mktemp("fuzz")
    target = build_tiny_target(root / "target", seed=0, max_position_embeddings=WINDOW)
    config_file = target / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TEMPLATE}))
    draft = build_tiny_dflash(root / "draft", target, seed=1, block_size=4)
    engine = WatchedEngine(load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                        "target": {"path": str(target)},
                                        "drafter": {"kind": "dflash", "path": str(draft)}}))
    with serving(create_app(engine, max_queue=4, timeout=REQUEST_S / 2, body_timeout=REQUEST_S / 2)) as url:
        errors = LogErrors()
        with errors:
            yield url, engine, errors


class LogErrors(logging.Handler):
    """Collects every error (or traceback) the server's loggers emit while it is installed."""

    NAMES = ("uvicorn.error", "uvicorn", "speculant", "")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(f"{record.name}: {record.getMessage()}")

    def __enter__(self):
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)


# -- what is sent ---------------------------------------------------------------------------------
# text with control characters, lone UTF-16 surrogates (JSON carries them as \ud800 escapes) and the like
odd_text = st.text(st.characters(codec=None, categories=["Cs", "Cc", "Cf", "Zs", "Lo", "So"]), min_size=1, max_size=6)
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-3, 70) | st.floats()
           | st.sampled_from([0.0, -0.0, 1e-320, 1e308, 2.0, 2.0000001]) | st.text(max_size=12) | odd_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
deep_json = st.builds(lambda opener, n: opener * n, st.sampled_from([b"[", b'{"a":', b'[{"b":']),
                      st.integers(100, 20_000))
TINY = [5e-324, 1e-320, 1e-45, 1e-7]  # subnormal and tiny floats: a temperature that overflows logits
plausible = {  # values near what each field takes, so that requests get past the first check
    "model": st.sampled_from(["speculant", "gpt-4o"]),
    "max_tokens": st.integers(-2, 200) | st.integers(),
    "temperature": st.floats(-1, 3) | st.integers(-1, 3) | st.sampled_from(TINY),
    "top_p": st.floats(-0.5, 1.5) | st.sampled_from(TINY),
    "top_k": st.integers(-3, 400) | st.integers(),
    "seed": st.integers(),
    "stop": st.text(max_size=3) | odd_text | st.lists(st.text(max_size=3), max_size=5),
    "max_completion_tokens": st.integers(-2, 200),
    "n": st.integers(0, 2),
    "user": st.text(max_size=5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "prompt": st.text(max_size=40) | odd_text | st.lists(st.integers(-2, 400), max_size=8),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]),
         "content": st.text(max_size=20) | odd_text | st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}), max_size=2)}),
        max_size=3),
}


@st.composite
def changes(draw, fields):
    """A few fields set: mostly to values near what they take, so that many requests reach the
    engine; sometimes to any JSON value, or an unknown field."""
    out = {}
    for _ in range(draw(st.integers(0, 3))):
        anything = st.sampled_from(FIELDS) | st.text(max_size=6)  # another endpoint's field, or none at all
        key = draw(st.sampled_from(fields) if draw(st.integers(0, 9)) else anything)
        near = key in plausible and draw(st.integers(0, 5)) > 0
        out[key] = draw(plausible[key] if near else json_values)
    return out


COMMON = [f for f in FIELDS if f not in ("prompt", "messages", "echo", "max_completion_tokens", "top_logprobs")]
ENDPOINTS = [
    ("/v1/completions", {"model": "speculant", "prompt": "def f(x):", "max_tokens": 4}, COMMON + ["prompt", "echo"]),
    ("/v1/chat/completions", {"model": "speculant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
     COMMON + ["messages", "max_completion_tokens", "top_logprobs"]),
]


@st.composite
def requests(draw):
    """(path, body bytes): a valid request with fields changed, a JSON value, or raw bytes."""
    path, body, fields = draw(st.sampled_from(ENDPOINTS))
    kind = draw(st.sampled_from(["fields"] * 7 + ["value", "bytes", "deep", "cut"]))
    if kind == "value":
        return path, json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "deep":
        return path, draw(deep_json)
    whole = json.dumps({**body, **draw(changes(fields))}).encode()
    return path, whole if kind == "fields" else whole[:draw(st.integers(0, len(whole)))]


# -- what comes back ------------------------------------------------------------------------------
def check_error(error):
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    assert error["param"] is None or isinstance(error["param"], str)


def check_reply(reply):
    assert reply.status_code in STATUSES, (reply.status_code, reply.text[:500])
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", reply.text[-500:]
        for event in map(json.loads, events[:-1]):
            if "error" in event:
                check_error(event["error"])
            else:
                assert event["object"] in ("text_completion", "chat.completion.chunk"), event
        return
    body = reply.json()
    if reply.status_code == 200:
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0, body
    else:
        check_error(body["error"])


@settings(max_examples=200, deadline=timedelta(seconds=REQUEST_S), database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests())
# what a campaign of hand-made bad inputs found (issue 37), always tried first
@example(request=("/v1/completions", rb'{"model": "speculant", "prompt": "def f(x):\ud800"}'))
@example(request=("/v1/chat/completions",
                  rb'{"model": "speculant", "messages": [{"role": "user", "content": "\udc00"}]}'))
@example(request=("/v1/completions", b"[" * 10_000))
@example(request=("/v1/completions", b'{"model": "speculant", "prompt": "x", "temperature": 1e-320}'))
@example(request=("/v1/completions", b'{"model": "speculant", "prompt": "x", "temperature": NaN}'))
@example(request=("/v1/completions", b'{"model": "speculant", "prompt": [true, false], "max_tokens": true}'))
def test_any_request_gets_a_typed_answer(fuzzed, request):
    url, engine, errors = fuzzed
    path, content = request
    reply = httpx.post(url + path, content=content, headers={"content-type": "application/json"},
                       timeout=REQUEST_S)
    check_reply(reply)
    assert engine.non_finite == [] and errors.records == []


# -- many at once ---------------------------------------------------------------------------------
CANARY = ("/v1/completions", {"model": "speculant", "prompt": "def f(x):", "max_tokens": 24, "temperature": 0})


def send(url: str, path: str, content: bytes, leave: bool):
    """The reply to one request, or None where its client reads one line of it and leaves."""
    headers = {"content-type": "application/json"}
    if not leave:
        return httpx.post(url + path, content=content, headers=headers, timeout=REQUEST_S)
    with httpx.stream("POST", url + path, content=content, headers=headers, timeout=REQUEST_S) as reply:
        next(reply.iter_lines(), None)
    return None


@settings(max_examples=20, deadline=timedelta(seconds=3 * REQUEST_S), database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(st.tuples(requests(), st.booleans()), min_size=1, max_size=5))
def test_requests_at_once_get_typed_answers_and_a_greedy_one_its_output_alone(fuzzed, batch):
    """Random requests sent together (some clients leaving after one line) share the server's
    batch with a greedy request: each answer is typed, and the greedy one's text is what it is
    when it runs alone (a request cancelled as it joined once failed its whole batch)."""
    url, engine, errors = fuzzed
    path, body = CANARY
    alone = send(url, path, json.dumps(body).encode(), False)
    with ThreadPoolExecutor(len(batch) + 1) as pool:
        beside = pool.submit(send, url, path, json.dumps(body).encode(), False)
        replies = list(pool.map(lambda job: send(url, *job[0], job[1]), batch))
    for reply in replies:
        if reply is not None:
            check_reply(reply)
    assert alone.status_code == 200, alone.text[:500]
    reply = beside.result()
    check_reply(reply)
    if reply.status_code != 429:  # the queue may be full
        assert reply.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert engine.non_finite == [] and errors.records == []
