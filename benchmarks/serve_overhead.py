"""speculant serve vs the library on a pair: TTFT and decode tok/s seen by a streaming client
against the same engine called in-process, then throughput and p50/p95 latency at 1, 4 and 16
concurrent clients (each level sends 16 requests in all).

    python benchmarks/serve_overhead.py [--repeats 3] [--max-new-tokens 64] [--threads 2]
        [--pair tiny|smollm2] [--max-batch N] [--clients 1,4,16] [--no-overhead] [--out FILE]

``--pair`` (default: the shipped tiny pair, which docs/serve.md's figures used) is passed to the
server and loads the library engine alike. ``--max-batch 1`` serves one request at a time (the
server before batching), to compare with the batched default.

The server is a ``speculant serve`` process of its own (as users run it), the library engine
lives in this process; their runs alternate, each engine seeing the same sequence of requests
(the adaptive verifier learns across requests). Client-side times include HTTP, JSON and SSE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Point:\n    def __init__(self, x, y):\n",
           "for i in range(10):\n"]


def library_run(engine, prompt: str, n: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = last = None
    for chunk in engine.generate(prompt, max_new_tokens=n, temperature=0):
        if chunk.token_ids:
            last = time.perf_counter()
            first = first or last
    tokens = engine.last_stats.new_tokens
    return first - t0, _rate(tokens, first, last), tokens


def server_run(http, url: str, prompt: str, n: int) -> tuple[float, float, int]:
    body = {"model": "speculant", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with http.stream("POST", url + "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    return first - t0, _rate(tokens, first, last), tokens


def _rate(tokens: int, first: float, last: float) -> float:
    return (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")


def overhead(engine, url: str, repeats: int, n: int) -> None:
    import httpx

    rows = {"library": [], "server": []}
    with httpx.Client(timeout=300) as http:
        server_run(http, url, PROMPTS[0], 8)  # warm-up
        library_run(engine, PROMPTS[0], 8)
        for _ in range(repeats):
            for prompt in PROMPTS:
                rows["library"].append(library_run(engine, prompt, n))
                rows["server"].append(server_run(http, url, prompt, n))
    print(f"{'':8} {'TTFT ms (median)':>17} {'decode tok/s (median)':>22}")
    medians = {}
    for side, runs in rows.items():
        ttft = statistics.median(r[0] for r in runs) * 1000
        rate = statistics.median(r[1] for r in runs if r[1] == r[1])
        medians[side] = (ttft, rate)
        print(f"{side:8} {ttft:17.1f} {rate:22.1f}")
    (lt, lr), (st, sr) = medians["library"], medians["server"]
    print(f"server overhead: TTFT {st - lt:+.1f} ms ({(st / lt - 1) * 100:+.1f} %), "
          f"decode {(sr / lr - 1) * 100:+.1f} %")


def load(url: str, clients: int, per_client: int, n: int) -> dict:
    import httpx

    def session(c: int) -> list[tuple[float, int]]:
        out = []
        with httpx.Client(timeout=600) as http:
            for r in range(per_client):
                t = time.perf_counter()
                reply = http.post(url + "/v1/completions", json={"model": "speculant", "prompt": PROMPTS[(c + r) % 4],
                                                                 "max_tokens": n, "temperature": 0})
                out.append((time.perf_counter() - t, reply.json()["usage"]["completion_tokens"]))
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for s in pool.map(session, range(clients)) for x in s]
    wall = time.perf_counter() - t0
    latencies = sorted(r[0] for r in results)
    p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]
    row = {"clients": clients, "tok_s": sum(r[1] for r in results) / wall, "req_s": len(results) / wall,
           "p50_s": statistics.median(latencies), "p95_s": p95}
    print(f"{clients:3} clients: {row['tok_s']:7.1f} tok/s, {row['req_s']:5.2f} req/s, "
          f"latency p50 {row['p50_s']:6.2f} s, p95 {p95:6.2f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=None, help="the server's --max-batch (default: its own)")
    parser.add_argument("--pair", default="tiny", help="the pair served and loaded (default: tiny)")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated concurrent client counts")
    parser.add_argument("--no-overhead", action="store_true", help="skip the library-vs-server comparison")
    parser.add_argument("--out", metavar="FILE", help="write the load rows as JSON here")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",") if c]
    # Two processes on the same cores: OpenMP threads that spin after a forward would steal the
    # other process's time, so both wait passively.
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    import torch

    from speculant.api import load_engine
    from speculant.pairs import engine_config

    torch.set_num_threads(args.threads)
    with server_process(args.threads, args.max_batch, args.pair) as url:
        if not args.no_overhead:
            overhead(load_engine(engine_config(args.pair, backend="torch")), url, args.repeats, args.max_new_tokens)
        rows = [load(url, clients, max(1, 16 // clients), args.max_new_tokens) for clients in levels]
    if args.out:
        Path(args.out).write_text(json.dumps({"pair": args.pair, "max_batch": args.max_batch, "threads": args.threads,
                                              "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1))


@contextlib.contextmanager
def server_process(threads: int, max_batch: int | None = None, pair: str = "tiny"):
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen([sys.executable, "-m", "speculant", "serve", "--port", str(port), "--backend", "torch", "--pair", pair,
                             "--max-queue", "64", *([] if max_batch is None else ["--max-batch", str(max_batch)])],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("speculant serve did not start")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
