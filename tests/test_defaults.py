"""Defaults a user can trust: float32 on a CPU (exact), the dtype and target named in the
statistics, the same greedy text on every request, and no third-party chatter on the terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import speculant
from speculant import embedded
from speculant.core.metrics import target_name

shipped = pytest.mark.skipif(not embedded.available(), reason="the shipped pair is not in this checkout")
PROMPT = "def parse_args(argv):"
LONG = 256  # tokens: long enough for bfloat16 near-ties to part speculative from plain output
# transformers and huggingface_hub read these at import: the test environment sets them (conftest),
# a user's shell does not
QUIET_ENV = ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")


def speculant_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    return subprocess.run([sys.executable, "-m", "speculant", *argv], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})


def foreign_lines(stderr: str) -> list[str]:
    """stderr lines that are not speculant's own statistics line."""
    return [line for line in stderr.splitlines() if line.strip() and " tokens, TTFT " not in line]


@shipped
def test_shipped_pair_runs_in_float32_on_a_cpu_and_says_why():
    proc = speculant_cli("generate", PROMPT, "--max-new-tokens", "4", "--backend", "torch", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert (stats["dtype"], stats["dtype_reason"]) == ("float32", "auto: CPU")
    assert stats["target"] == "speculant shipped pair (qwen3)"


@shipped
def test_generate_on_the_shipped_pair_prints_only_speculants_lines():
    proc = speculant_cli("generate", PROMPT, "--max-new-tokens", "4", "--backend", "torch")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert foreign_lines(proc.stderr) == []
    assert proc.stderr.strip().endswith("dtype float32 (auto: CPU)")


def test_a_hybrid_target_prints_only_speculants_lines_and_verbose_shows_the_rest(tmp_path, torch_threads):
    from speculant.testing.tiny_families import build_tiny_family

    target = build_tiny_family(tmp_path / "hybrid", "qwen3_5")  # Gated DeltaNet: transformers' fallback notes
    argv = ("generate", "def f(x):", "--target", str(target), "--lookup", "--device", "cpu", "--max-new-tokens", "4")
    quiet = speculant_cli(*argv)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert foreign_lines(quiet.stderr) == []
    verbose = speculant_cli("-v", *argv)
    assert verbose.returncode == 0, verbose.stderr[-2000:]
    assert any(line.startswith("[transformers]") for line in foreign_lines(verbose.stderr)), verbose.stderr


@pytest.fixture(scope="module")
def default_engine(torch_threads):
    if not embedded.available():
        pytest.skip("the shipped pair is not in this checkout")
    config = embedded.engine_config(backend="torch")  # the shipped default: DFlash2, adaptive widths, lookup
    config["backend"]["device"] = "cpu"
    return speculant.load_engine(config)


@pytest.fixture(scope="module")
def plain_text(default_engine):
    return default_engine.without_drafter().run(PROMPT, max_new_tokens=LONG).text


def test_the_default_engine_gives_plain_decodings_text_every_time(default_engine, plain_text):
    assert default_engine.backend.dtype_name == "float32"
    texts = ["".join(chunk.text for chunk in default_engine.generate(PROMPT, max_new_tokens=LONG))
             for _ in range(3)]
    assert texts == [plain_text] * 3  # in bfloat16 they part at token 36 (issue 36)


def test_the_server_gives_the_same_greedy_text_every_time(default_engine, plain_text):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from speculant.serve import create_app
    from speculant.serve.background import serving

    body = {"model": "speculant", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0}
    with serving(create_app(default_engine, max_queue=4, timeout=120)) as url:
        texts = [httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                 for _ in range(2)]
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        texts.append("".join(event["choices"][0]["text"] for event in events))
    assert texts == [plain_text] * 3


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_stats_name_the_dtype_the_backend_chose(kind, tiny_target):
    if kind == "mlx":
        pytest.importorskip("mlx_lm")
    for dtype, expected in [("auto", ("float32", "auto: CPU")), ("bfloat16", ("bfloat16", "set by backend.dtype"))]:
        engine = speculant.load_engine({"backend": {"kind": kind, "device": "cpu", "dtype": dtype},
                                        "target": {"path": str(tiny_target)}})
        stats = engine.run("def f(x):", max_new_tokens=2).stats
        assert (stats.dtype, stats.dtype_reason) == expected
        assert stats.target == tiny_target.name and f"dtype {expected[0]} ({expected[1]})" in str(stats)


def test_target_name_of_a_hub_snapshot_is_its_repository_id(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abcd"
    assert target_name(snapshot) == "Qwen/Qwen3-8B"
    assert target_name(tmp_path / "my-model") == "my-model"
