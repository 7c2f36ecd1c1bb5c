"""speculant serve: the official openai client against a real server on a free loopback port.

The model is the shipped pair (DFlash2 + prompt lookup), its target copied with a chat template
added, so chat and text completions both run speculatively; every greedy answer is compared with
what ``engine.generate`` gives offline for the same request.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from speculant.serve import create_app  # noqa: E402
from speculant.serve.background import serving  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n"]
TIMEOUT = 60


@pytest.fixture(scope="module")
def engine(tmp_path_factory, torch_threads):
    from speculant import embedded
    from speculant.api import load_engine

    target = tmp_path_factory.mktemp("serve") / "target"
    shutil.copytree(embedded.PAIR_DIR / "target", target)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    config = embedded.engine_config(backend="torch")
    config["target"]["path"] = str(target)
    config["backend"]["dtype"] = "float32"  # bfloat16 near-ties may flip with the verify width (test_serve_load.py)
    return load_engine(config)


@pytest.fixture(scope="module")
def server(engine):
    with serving(create_app(engine, max_queue=32, timeout=TIMEOUT)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def offline(engine, prompt, chat=False, **kwargs):
    if chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                    tokenize=False)
        return engine.run(text, add_special_tokens=False, **kwargs)
    return engine.run(prompt, **kwargs)


def metric(url, name):
    """The value of one unlabelled sample in the server's /metrics."""
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


def wait_for(condition, seconds=10.0, what="the condition"):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.02)


def wait_idle(app_or_engine, seconds=10.0):
    deadline = time.monotonic() + seconds
    while app_or_engine._busy.locked():
        assert time.monotonic() < deadline, "the engine stayed busy"
        time.sleep(0.01)


# -- the happy path -----------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_streamed_and_not_equal_offline(engine, client, prompt):
    expected = offline(engine, prompt, max_new_tokens=20, temperature=0)
    whole = client.completions.create(model="speculant", prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    assert whole.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert whole.choices[0].finish_reason == ("length" if len(expected.token_ids) == 20 else "stop")
    extra = whole.model_extra["speculant"]
    # the adaptive verifier learns across requests: the steps differ from the offline run, the tokens do not
    assert extra["engine"] == "speculative" and 0 < extra["verify_steps"] <= len(expected.token_ids)
    assert extra["accepted_tokens"] <= extra["drafted_tokens"]
    events = list(client.completions.create(model="speculant", prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(e.choices[0].text for e in events if e.choices) == expected.text
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == len(expected.token_ids)
    assert "speculant" in events[-2].model_extra and events[-2].choices[0].finish_reason is not None


def test_chat_streamed_and_not_equal_offline(engine, client):
    prompt = PROMPTS[0]
    expected = offline(engine, prompt, chat=True, max_new_tokens=16, temperature=0)
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model="speculant", messages=messages, max_completion_tokens=16,
                                           temperature=0)
    assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == len(expected.token_ids)
    events = list(client.chat.completions.create(model="speculant", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected.text
    assert events[0].choices[0].delta.role == "assistant"
    assert events[-1].usage.completion_tokens == len(expected.token_ids)


def test_sampling_fields_stop_seed_top_k(engine, client):
    expected = offline(engine, PROMPTS[0], max_new_tokens=20, temperature=0, stop_strings=["(", "\n"])
    got = client.completions.create(model="speculant", prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                    stop=["(", "\n"])
    assert got.choices[0].text == expected.text and got.choices[0].finish_reason == "stop"
    # top_k=1 (a vLLM extra field) samples the argmax only: the greedy text at any temperature and seed
    greedy = offline(engine, PROMPTS[1], max_new_tokens=12, temperature=0).text
    for seed in (1, 2):
        got = client.completions.create(model="speculant", prompt=PROMPTS[1], max_tokens=12, temperature=1.5,
                                        top_p=0.95, seed=seed, extra_body={"top_k": 1})
        assert got.choices[0].text == greedy


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["speculant"]
    assert httpx.get(server + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    assert httpx.head(server + "/health", timeout=TIMEOUT).status_code == 200  # what load balancers send
    client.completions.create(model="speculant", prompt="x = ", max_tokens=4, temperature=0)
    text = httpx.get(server + "/metrics", timeout=TIMEOUT).text
    for name in ("speculant_requests_total", "speculant_queue_depth", "speculant_generated_tokens_total",
                 "speculant_time_to_first_token_seconds_bucket", "speculant_decode_tokens_per_second_bucket",
                 "speculant_acceptance_length_bucket", "speculant_drafted_tokens_total",
                 "speculant_accepted_tokens_total", "speculant_plain_fallback_requests_total"):
        assert name in text
    assert 'speculant_requests_total{endpoint="completions",status="200"}' in text


# -- bad input ----------------------------------------------------------------------------------
GOOD = {"model": "speculant", "prompt": "x", "max_tokens": 2}
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {**GOOD, "stop": 3}, 400, "stop"),
    ("/v1/completions", {**GOOD, "n": 2}, 400, "n"),
    ("/v1/completions", {**GOOD, "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "prompt": [10**9]}, 400, "prompt_ids"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {**GOOD, "prompt": [5] * 2048}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "speculant", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "speculant", "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": "speculant", "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True}, 400, "logprobs"),
    # strict types: no bool for a number, no string for an int, no int for a bool, no NaN
    ("/v1/completions", {**GOOD, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": "16"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 16.0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "prompt": [True, False]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**GOOD, "temperature": True}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "seed": "7"}, 400, "seed"),
    ("/v1/completions", b'{"model": "speculant", "prompt": "x", "temperature": NaN}', 400, None),
    ("/v1/completions", b'{"model": "speculant", "prompt": "x", "top_p": 1e999}', 400, "top_p"),
    ("/v1/completions", {**GOOD, "temperature": 1e-320}, 400, "temperature"),  # logits / 1e-320 overflow
    ("/v1/chat/completions", {"model": "speculant", "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(server + path, content=content, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert httpx.post(server + "/v1/completions", json=GOOD, timeout=TIMEOUT).status_code == 200


def test_body_size_limit_and_unknown_route(server):
    huge = json.dumps({**GOOD, "prompt": "x" * (2 << 20)})
    reply = httpx.post(server + "/v1/completions", content=huge, timeout=TIMEOUT)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server + "/v1/nothing", timeout=TIMEOUT).json()["error"]["code"] == "not_found"


def test_chat_without_template_is_a_clear_400(engine):
    app = create_app(engine)
    app.state.server.prompts.tokenizer.chat_template = None  # the server's own copy of the tokenizer
    with serving(app) as url:
        reply = httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT,
                           json={"model": "speculant", "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 400 and "chat template" in reply.json()["error"]["message"]


def test_api_key(engine):
    with serving(create_app(engine, api_key="s3cret")) as url:
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        two = [[("Authorization", "Bearer wrong"), ("Authorization", "Bearer s3cret")],
               [("Authorization", "Bearer s3cret"), ("Authorization", "Bearer wrong")]]  # one of them lies
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, *two):
            for path in ("/v1/models", "/metrics"):
                reply = httpx.get(url + path, headers=headers, timeout=TIMEOUT)
                assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=TIMEOUT)
        assert good.completions.create(model="speculant", prompt="x", max_tokens=2).choices[0].text is not None


# -- the queue ----------------------------------------------------------------------------------
def block_worker(app):
    """Hold the engine, as a library call on it would, until the returned event is set: the
    server's requests wait in its queue meanwhile."""
    engine, release, held = app.state.server.engine, threading.Event(), threading.Event()

    def hold():
        with engine._busy:
            held.set()
            release.wait(TIMEOUT)

    threading.Thread(target=hold, daemon=True).start()
    held.wait(TIMEOUT)
    return release


def test_full_queue_answers_429_at_once_and_nothing_is_lost(engine):
    expected = offline(engine, PROMPTS[0], max_new_tokens=8, temperature=0).text
    app = create_app(engine, max_queue=1, timeout=TIMEOUT)
    with serving(app) as url:
        release = block_worker(app)
        results = {}

        def ask(name):
            results[name] = httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
                "model": "speculant", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})

        deadline = time.monotonic() + 10
        queued = threading.Thread(target=ask, args=("queued",))
        queued.start()
        while app.state.server.worker.waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t = time.monotonic()
        refused = httpx.post(url + "/v1/completions", json=GOOD, timeout=TIMEOUT)
        assert refused.status_code == 429 and time.monotonic() - t < 2
        assert refused.json()["error"]["code"] == "queue_full"
        assert "speculant_queue_depth 1.0" in httpx.get(url + "/metrics", timeout=TIMEOUT).text
        release.set()
        queued.join(TIMEOUT)
    assert results["queued"].json()["choices"][0]["text"] == expected


def test_waiting_past_the_timeout_is_a_503(engine):
    app = create_app(engine, timeout=0.5)
    with serving(app) as url:
        release = block_worker(app)
        first = threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                 kwargs={"json": GOOD, "timeout": TIMEOUT})
        first.start()
        time.sleep(0.2)
        reply = httpx.post(url + "/v1/completions", json=GOOD, timeout=TIMEOUT)
        release.set()
        first.join(TIMEOUT)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "timeout"


def test_a_client_that_leaves_the_queue_is_dropped_before_it_runs(engine):
    """A queued client that gives up leaves the queue within a poll or two, is counted as 499, and
    never reaches the engine: only the request that held the turn generates."""
    app = create_app(engine, max_queue=4, timeout=TIMEOUT)
    worker = app.state.server.worker
    with serving(app) as url:
        release = block_worker(app)
        first = threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                 kwargs={"json": GOOD, "timeout": TIMEOUT})
        first.start()
        deadline = time.monotonic() + 10
        while worker.waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(httpx.TimeoutException):  # the client gives up while queued
            httpx.post(url + "/v1/completions", json=GOOD, timeout=0.5)
        while worker.waiting > 1:  # the engine is still held: only the poll can notice
            assert time.monotonic() < deadline, "the queued client's disconnect was not noticed"
            time.sleep(0.02)
        release.set()
        first.join(TIMEOUT)
        wait_idle(engine)
        text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    assert 'speculant_requests_total{endpoint="completions",status="499"} 1.0' in text
    assert 'speculant_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert f"speculant_generated_tokens_total {float(GOOD['max_tokens'])}" in text  # the first request's only


def test_disconnect_mid_stream_cancels_generation_and_the_next_request_runs(engine, server, client):
    body = {"model": "speculant", "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "stream": True}
    generated = metric(server, "speculant_generated_tokens_total")
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=TIMEOUT) as reply:
        lines = reply.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
    t = time.monotonic()
    time.sleep(0.05)
    wait_idle(engine)
    stats = engine.last_stats
    assert stats.stop_reason == "cancelled" and stats.new_tokens < 1500
    assert time.monotonic() - t < 5
    # the abandoned stream's tokens were generated all the same: they count
    wait_for(lambda: metric(server, "speculant_generated_tokens_total") == generated + stats.new_tokens,
             what="counting the abandoned stream's tokens")
    assert 'speculant_requests_total{endpoint="completions",status="499"}' in httpx.get(server + "/metrics").text
    expected = offline(engine, PROMPTS[1], max_new_tokens=8, temperature=0).text
    assert client.completions.create(model="speculant", prompt=PROMPTS[1], max_tokens=8,
                                     temperature=0).choices[0].text == expected


# -- a failing model ----------------------------------------------------------------------------
def test_non_finite_logits_end_the_request_with_an_error_event(tmp_path, tiny_target):
    from safetensors.torch import load_file, save_file

    from speculant.api import load_engine

    def make(path):
        return load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                   "target": {"path": str(path)}})

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    prompt = [5, 6, 7]
    good = make(target).run(prompt_ids=prompt, max_new_tokens=30).token_ids
    index = next(i for i in range(2, len(good)) if good[i] not in good[:i] and good[i] not in prompt)
    state = load_file(str(target / "model.safetensors"))
    state["model.embed_tokens.weight"][good[index]] = float("nan")
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    with serving(create_app(make(target))) as url:
        body = {"model": "speculant", "prompt": prompt, "max_tokens": 30, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as reply:
            events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "NonFiniteLogitsError" and "generation failed" in error["message"]
        whole = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=TIMEOUT)
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "NonFiniteLogitsError"
        metrics = httpx.get(url + "/metrics", timeout=TIMEOUT).text
        assert 'speculant_requests_total{endpoint="completions",status="500"} 2.0' in metrics
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200


def test_generation_past_the_timeout_ends_with_an_error(engine):
    with serving(create_app(engine, timeout=0.3)) as url:
        body = {"model": "speculant", "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as reply:
            events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
        text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
        generated = metric(url, "speculant_generated_tokens_total")
    assert engine.last_stats.new_tokens < 1500
    assert generated > engine.last_stats.new_tokens > 0  # both timed-out requests' tokens count
    # the stream's 200 header went out before the timeout: its outcome is counted when it ends
    assert 'speculant_requests_total{endpoint="completions",status="504"} 2.0' in text
    assert 'status="200"' not in text


# -- the command ----------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_speculant_serve_command_binds_loopback_and_takes_the_key_from_the_environment(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    env = {**os.environ, "SPECULANT_API_KEY": "k3y"}
    proc = subprocess.Popen([sys.executable, "-m", "speculant", "serve", "--port", str(port), "--drafter", "dflash",
                             "--backend", "torch"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "speculant serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=TIMEOUT).status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=TIMEOUT)
        assert client.completions.create(model="speculant", prompt="x = ", max_tokens=3).usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    assert f"serving 'speculant' on http://127.0.0.1:{port}/v1" in proc.stdout.read().decode()
