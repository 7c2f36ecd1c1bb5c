"""speculant serve on the batch scheduler (issue #39, "The server uses it"): concurrent clients
through the official openai client are verified together, and each gets exactly the output it
gets alone; a client that leaves frees its slot; the queue, 429 and bad settings keep working."""

from __future__ import annotations

import concurrent.futures as futures
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from speculant.serve import create_app  # noqa: E402
from speculant.serve.background import serving  # noqa: E402

TIMEOUT = 120
PROMPTS = ["def fibonacci(n):", "import os\n", "class Point:\n", "for i in range(10):\n", "def add(a, b):\n",
           "while True:\n", "x = [", "print("]
CLIENTS = 16


@pytest.fixture(scope="module")
def engine(torch_threads):
    from speculant import embedded
    from speculant.api import load_engine

    config = embedded.engine_config(backend="torch")
    config["backend"]["dtype"] = "float32"  # identity with the solo run is promised in float32
    return load_engine(config)


def metrics(url: str) -> dict[str, float]:
    """Every unlabelled sample of /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def wait_for(condition, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.01)


def ask(url: str, prompt: str, max_tokens: int, stream: bool) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0) as client:
        kwargs = {"model": "speculant", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(e.choices[0].text for e in client.completions.create(stream=True, **kwargs) if e.choices)


def test_sixteen_concurrent_clients_are_batched_and_equal_their_solo_outputs(engine):
    jobs = [(PROMPTS[c % len(PROMPTS)], 4 + (c * 7) % 29, c % 2 == 0) for c in range(CLIENTS)]
    solo = {(p, n): engine.run(p, max_new_tokens=n, temperature=0).text for p, n, _ in jobs}
    app = create_app(engine, max_queue=CLIENTS, timeout=TIMEOUT, max_batch=8)
    with serving(app) as url:
        start = threading.Barrier(CLIENTS)

        def client(job):
            start.wait(TIMEOUT)
            return ask(url, *job)

        with futures.ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(client, jobs, timeout=TIMEOUT))
        seen = metrics(url)
    wrong = [(p, n, got, solo[p, n]) for (p, n, _), got in zip(jobs, answers) if got != solo[p, n]]
    assert not wrong, wrong[:3]
    assert 1 < seen["speculant_batch_size_max"] <= 8  # requests were verified together, never more than max_batch
    assert seen["speculant_batched_cycles_total"] > 0
    assert seen["speculant_batch_size"] == 0  # every request left the scheduler
    assert seen["speculant_request_acceptance_length_count"] == CLIENTS
    assert seen["speculant_request_acceptance_length_sum"] >= CLIENTS  # at least one token per verify step


def test_a_client_that_leaves_frees_its_slot_others_unchanged_and_a_full_queue_is_a_429(engine):
    """Two slots: a long stream and a 300-token request fill them, a third request waits, a
    fourth gets a 429 at once; the stream's client leaves, the third takes its slot, and both
    others get exactly their solo outputs."""
    beside = engine.run(PROMPTS[1], max_new_tokens=300, temperature=0).text
    queued = engine.run(PROMPTS[2], max_new_tokens=12, temperature=0).text
    app = create_app(engine, max_queue=1, timeout=TIMEOUT, max_batch=2)
    results = {}
    with serving(app) as url:
        body = {"model": "speculant", "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as reply:
            lines = reply.iter_lines()
            assert [line for line, _ in zip(lines, range(4)) if line.startswith("data:")]
            threads = [threading.Thread(target=lambda k=k, p=p, n=n: results.__setitem__(k, ask(url, p, n, False)))
                       for k, p, n in (("beside", PROMPTS[1], 300), ("queued", PROMPTS[2], 12))]
            threads[0].start()
            wait_for(lambda: metrics(url)["speculant_batch_size"] == 2, "the second request joining the batch")
            threads[1].start()
            wait_for(lambda: httpx.get(url + "/health", timeout=TIMEOUT).json()["queue_depth"] == 1,
                     "the third request queueing")
            t = time.monotonic()
            refused = httpx.post(url + "/v1/completions", timeout=TIMEOUT,
                                 json={"model": "speculant", "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
            assert time.monotonic() - t < 2
            assert "beside" not in results and "queued" not in results  # both still waiting on the stream's slot
        for thread in threads:  # the stream's client left: its slot goes to the queued request
            thread.join(TIMEOUT)
        seen = metrics(url)
        text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    assert results == {"beside": beside, "queued": queued}
    assert 'speculant_requests_total{endpoint="completions",status="499"} 1.0' in text
    assert seen["speculant_generated_tokens_total"] < 1500 + 300 + 12  # the stream stopped when its client left
    assert seen["speculant_queue_depth"] == 0 and seen["speculant_batch_size_max"] == 2
    # the stream ended when its client left (else it would still hold the engine, 1500 tokens long)
    assert not engine._busy.locked() and engine.last_stats.stop_reason in ("max_new_tokens", "eos")


def test_bad_settings_are_a_400_beside_a_running_batch(engine):
    app = create_app(engine, timeout=TIMEOUT, max_batch=4)
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        body = {"model": "speculant", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as reply:
            assert next(line for line in reply.iter_lines() if line.startswith("data:"))
            with pytest.raises(openai.BadRequestError) as bad_seed:
                client.completions.create(model="speculant", prompt="x", max_tokens=2, seed=-1)
            with pytest.raises(openai.BadRequestError) as bad_ids:
                client.completions.create(model="speculant", prompt=[10**9], max_tokens=2)
        assert bad_seed.value.body["param"] == "seed" and bad_ids.value.body["param"] == "prompt_ids"
        good = client.completions.create(model="speculant", prompt=PROMPTS[3], max_tokens=6, temperature=0)
    assert good.choices[0].text == engine.run(PROMPTS[3], max_new_tokens=6, temperature=0).text



def test_a_batch_that_fails_fails_its_requests_with_a_logged_500_and_the_server_goes_on(engine, monkeypatch,
                                                                                        caplog):
    """A batched forward that raises (a bug, a device fault) fails the requests in that batch with
    a typed 500, logs the traceback for the operator, and the next request is served as before."""
    from speculant.backends.torch.batch import TorchBatch

    verify, failed = TorchBatch.verify, []

    def failing(self, *args, **kwargs):
        if not failed:
            failed.append(True)
            raise RuntimeError("the device went away")
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(TorchBatch, "verify", failing)
    app = create_app(engine, timeout=TIMEOUT, max_batch=2)
    with serving(app) as url:
        start = threading.Barrier(2)

        def client(prompt):
            start.wait(TIMEOUT)
            return httpx.post(url + "/v1/completions", timeout=TIMEOUT,
                              json={"model": "speculant", "prompt": prompt, "max_tokens": 400, "temperature": 0})

        with futures.ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(client, PROMPTS[:2], timeout=TIMEOUT))
        after = ask(url, PROMPTS[3], 6, False)
    assert failed and 500 in [r.status_code for r in replies]
    for reply in replies:
        if reply.status_code == 500:
            assert reply.json()["error"] == {"message": "internal error: RuntimeError: the device went away",
                                             "type": "server_error", "param": None, "code": "internal_error"}
    assert any("the batch failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert after == engine.run(PROMPTS[3], max_new_tokens=6, temperature=0).text

@pytest.mark.parametrize("value", [0, -3, True, 2.5])
def test_max_batch_must_be_a_whole_number_of_at_least_one(engine, value):
    with pytest.raises(ValueError, match="max_batch"):
        create_app(engine, max_batch=value)


def test_the_command_refuses_max_batch_zero_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "speculant", "serve", "--max-batch", "0"], capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 2
    assert "--max-batch 0: give 1 or more" in proc.stderr and "Traceback" not in proc.stderr
