"""A fast CBLAS under MLX's CPU backend (speculant/backends/mlx/blas.py). Each case runs in a fresh
interpreter: which BLAS ``libmlx.so`` binds is decided once, when mlx is first imported.

Which library a product ran on is read from ``/proc/self/maps``: MKL's runtime library loads its
CPU kernels (``libmkl_def``, ``libmkl_avx2``, ...) only when a product first reaches it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = [pytest.mark.mlx, pytest.mark.skipif(sys.platform != "linux", reason="MLX's reference BLAS is Linux's")]

MAPS = """
import json, sys
def mkl():
    return sorted({line.rsplit("/", 1)[-1].strip() for line in open("/proc/self/maps") if "libmkl" in line})
"""
KERNELS = ("libmkl_def", "libmkl_avx", "libmkl_mc")  # the CPU's kernels: loaded at MKL's first product


def ran_on_mkl(libraries: list[str]) -> bool:
    return any(name.startswith(KERNELS) for name in libraries)


def has_mkl() -> bool:
    try:
        importlib.metadata.distribution("mkl")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_mkl = pytest.mark.skipif(not has_mkl(), reason="the mkl package is not installed")


def run(script: str, blas: str | None = None, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECULANT_MLX_BLAS", "MKL_NUM_THREADS")} | extra
    if blas is not None:
        env["SPECULANT_MLX_BLAS"] = blas
    done = subprocess.run([sys.executable, "-c", MAPS + textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_mkl
def test_mkl_takes_the_reference_blas_place_under_mlx_and_torch_keeps_its_own():
    seen = run("""
        from speculant.backends.mlx import blas
        note = blas.preload()
        import torch
        a = torch.randn(256, 256)
        (a @ a).sum()
        after_torch = mkl()
        import mlx.core as mx
        mx.eval(mx.ones((16, 64)) @ mx.ones((64, 32)))
        print(json.dumps({"note": note, "in_use": blas.in_use(), "after_torch": after_torch, "after_mlx": mkl()}))
    """)
    assert seen["note"].startswith("BLAS: libmkl_rt") and seen["in_use"].startswith("libmkl_rt")
    assert not ran_on_mkl(seen["after_torch"]), seen  # torch's products stay on its own BLAS
    assert ran_on_mkl(seen["after_mlx"]), seen  # MLX's reach MKL


@needs_mkl
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one usable core: MKL runs sequentially")
def test_mkl_spreads_a_product_over_the_cores_through_libgomp_unless_capped():
    script = """
        from speculant.backends.mlx import blas
        note = blas.preload()
        import mlx.core as mx
        mx.eval(mx.ones((16, 64)) @ mx.ones((64, 32)))
        print(json.dumps({"note": note, "after_mlx": mkl()}))
    """
    cores = len(os.sched_getaffinity(0))
    threaded = run(script)
    assert threaded["note"].endswith(f", {cores} threads") and "libmkl_gnu_thread.so.3" in threaded["after_mlx"], threaded
    capped = run(script, MKL_NUM_THREADS="1")
    assert capped["note"].endswith(", 1 thread") and "libmkl_sequential.so.3" in capped["after_mlx"], capped


def test_off_or_mlx_imported_first_keeps_mlx_own_blas():
    product = """
        import mlx.core as mx
        mx.eval(mx.ones((16, 64)) @ mx.ones((64, 32)))
        print(json.dumps({"note": note, "in_use": blas.in_use(), "after_mlx": mkl()}))
    """
    off = run("from speculant.backends.mlx import blas\nnote = blas.preload()\n" + textwrap.dedent(product), blas="off")
    assert off == {"note": "MLX's own BLAS", "in_use": "mlx", "after_mlx": []}
    late = run("import mlx.core\nfrom speculant.backends.mlx import blas\nnote = blas.preload()\n" + textwrap.dedent(product))
    assert "mlx was imported before speculant" in late["note"] and late["after_mlx"] == [], late


def test_a_library_that_cannot_serve_as_blas_is_a_clear_error_naming_the_way_out(tmp_path):
    missing = tmp_path / "libnothing.so"
    seen = run(f"""
        import speculant
        from speculant.embedded import PAIR_DIR
        try:
            speculant.load_engine({{"backend": {{"kind": "mlx", "device": "cpu"}}, "target": {{"path": str(PAIR_DIR / "target")}},
                                   "drafter": {{"kind": "none"}}}})
        except Exception as exc:
            print(json.dumps({{"error": str(exc)}}))
    """, blas=str(missing))
    assert f"SPECULANT_MLX_BLAS='{missing}'" in seen["error"] and "SPECULANT_MLX_BLAS=off" in seen["error"], seen


@needs_mkl
def test_on_mkl_speculative_and_batched_greedy_output_equals_plain_decoding():
    seen = run("""
        import speculant
        from speculant.embedded import PAIR_DIR
        engine = speculant.load_engine({"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32"},
                                        "target": {"path": str(PAIR_DIR / "target")},
                                        "drafter": {"kind": "dflash", "path": str(PAIR_DIR / "dflash"), "block_size": 8}})
        plain = engine.without_drafter()
        prompts = ["def parse_args(argv):", "class Stack:", "import os\\n\\ndef walk(", "for i in range("]
        settings = dict(max_new_tokens=40, temperature=0.0)
        spec = [engine.run(p, **settings).token_ids for p in prompts]
        alone = [plain.run(p, **settings).token_ids for p in prompts]
        batched = [r.token_ids for r in engine.run_many(prompts, max_batch=4, **settings)]
        print(json.dumps({"fast_path": engine.target.fast_path, "spec": spec, "plain": alone, "batched": batched,
                          "after": mkl()}))
    """)
    assert "BLAS: libmkl_rt" in seen["fast_path"] and ran_on_mkl(seen["after"]), seen["fast_path"]
    assert seen["spec"] == seen["plain"]
    assert seen["batched"] == seen["plain"]
