"""Ctrl-C (SIGINT) sent to a real ``speculant generate`` process at several points of a long
speculative run of the shipped pair, on both backends: exit 130, the statistics line, and the
text printed so far a prefix of the uninterrupted output.

All processes start at once (loading dominates on a small machine), and each is interrupted a
fixed time after its first byte of text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from speculant import embedded

PROMPT = "import os"
# seconds after the first byte of text: at once, then some cycles later. More points on torch,
# where a Ctrl-C inside the target forward lost the run (tests/test_faults.py pins that case down).
DELAYS = {"torch": (0.0, 0.5, 1.0), "mlx": (0.0, 0.8)}
REFERENCE_TOKENS = 200

pytestmark = pytest.mark.skipif(not embedded.available(), reason="the shipped pair is not in this install")


def _start(backend: str, max_new_tokens: int) -> subprocess.Popen:
    env = {**os.environ, "SPECULANT_LOAD_PLUGINS": "", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECULANT_DEBUG", None)
    argv = [sys.executable, "-m", "speculant", "generate", "--backend", backend, "--json",
            "--max-new-tokens", str(max_new_tokens), PROMPT]
    # a SIGINT ignored by whoever started the tests (a background job) would be inherited: Python
    # then installs no KeyboardInterrupt handler, so reset it to the default for the child
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _interrupt_after_first_byte(process: subprocess.Popen, delay: float) -> tuple[bytes, bytes]:
    first = process.stdout.read(1)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    return first + out, err


def _installed(backend: str) -> bool:
    needed = ("torch", "transformers") if backend == "torch" else ("mlx", "mlx_lm")
    return all(importlib.util.find_spec(m) is not None for m in needed)


@pytest.mark.slow
def test_sigint_ends_a_speculative_run_with_its_text_and_stats():
    backends = [b for b in ("torch", "mlx") if _installed(b)]
    references = {b: _start(b, REFERENCE_TOKENS) for b in backends}
    runs = [(b, delay, _start(b, 100_000)) for b in backends for delay in DELAYS[b]]
    with ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(lambda run: _interrupt_after_first_byte(run[2], run[1]), runs))
    full = {}
    for backend, process in references.items():
        full[backend], err = process.communicate(timeout=300)
        assert process.returncode == 0, err.decode()[-2000:]

    for (backend, delay, process), (out, err) in zip(runs, results):
        text = err.decode()
        assert process.returncode == 130, (backend, delay, text[-2000:])
        assert "Traceback" not in text, text[-2000:]
        stats = json.loads(text.strip().splitlines()[-1])
        assert stats["stop_reason"] == "interrupted" and stats["new_tokens"] >= 1, stats
        reference = full[backend]
        longer = stats["new_tokens"] > REFERENCE_TOKENS  # then the reference is the prefix
        assert out and (reference.startswith(out) or longer and out.startswith(reference)), \
            (backend, delay, out[-200:], reference[: len(out)][-200:])
