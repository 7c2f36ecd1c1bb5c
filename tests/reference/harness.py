"""Run the official reference ``dflash`` 0.1.0 from speculant's tests.

The reference needs transformers 5.15 (speculant runs on a newer one), so it lives in its own
virtual environment, built by ``scripts/make_reference_venv.sh``; this module only starts
``run_reference.py`` under that venv's interpreter and parses its JSON.

    from reference.harness import run_reference   # tests/ is on sys.path under pytest
    out = run_reference("torch", target_dir, draft_dir, [1, 2, 3], max_new_tokens=16,
                        block_size=4)
    out["tokens"], out["acceptance_lengths"], out["proposals"]

Venv location: ``$SPECULANT_REF_VENV`` or ``<repo>/.ref-venv``. With
``SPECULANT_BUILD_REF_VENV=1``, ``ensure_reference_venv()`` builds it when missing (CI);
otherwise tests that need it are skipped with the reason.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
RUNNER = HERE / "run_reference.py"
BUILD_SCRIPT = REPO_ROOT / "scripts" / "make_reference_venv.sh"
MARKER_NAME = ".speculant-ref-complete"
DEFAULT_TIMEOUT_S = 600.0


class ReferenceUnavailable(RuntimeError):
    """The reference venv is missing or incomplete."""


class ReferenceRunError(RuntimeError):
    """The reference run failed; the message carries its stderr tail."""


def reference_venv_dir() -> Path:
    return Path(os.environ.get("SPECULANT_REF_VENV") or REPO_ROOT / ".ref-venv")


def reference_python() -> Path:
    return reference_venv_dir() / "bin" / "python"


def reference_venv_problem() -> str | None:
    """None when the venv is complete, else a human-readable reason."""
    venv = reference_venv_dir()
    if not reference_python().exists():
        return (f"reference venv not found at {venv}; build it with "
                f"scripts/make_reference_venv.sh or set SPECULANT_BUILD_REF_VENV=1")
    if not (venv / MARKER_NAME).exists():
        return f"reference venv at {venv} is incomplete (no {MARKER_NAME}); rerun the build script"
    return None


def ensure_reference_venv(build: bool | None = None, timeout_s: float = 1800.0) -> Path:
    """Return the venv's python; build the venv first if ``build`` (default: the env var
    ``SPECULANT_BUILD_REF_VENV=1``) and it is missing. Raises ReferenceUnavailable otherwise."""
    if build is None:
        build = os.environ.get("SPECULANT_BUILD_REF_VENV") == "1"
    if build:
        # The script is idempotent and returns at once when the marker matches its spec.
        result = subprocess.run(
            ["bash", str(BUILD_SCRIPT), str(reference_venv_dir())],
            capture_output=True, text=True, timeout=timeout_s,
        )
        if result.returncode != 0:
            raise ReferenceUnavailable(
                f"building the reference venv failed (rc {result.returncode}):\n"
                f"{result.stderr[-4000:]}"
            )
    problem = reference_venv_problem()
    if problem:
        raise ReferenceUnavailable(problem)
    return reference_python()


def _csv(ids: Sequence[int]) -> str:
    return ",".join(str(int(i)) for i in ids)


def reference_argv(
    backend: str,
    target_dir: str | Path,
    draft_dir: str | Path,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    *,
    baseline: bool = False,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    capture_logits: bool = False,
    mlx_temporal_rotating_cache: bool = False,
    timing: bool = False,
) -> list[str]:
    """The runner's argument list for one run (same parameters as ``run_reference``)."""
    if backend not in ("torch", "mlx"):
        raise ValueError(f"backend must be 'torch' or 'mlx', got {backend!r}")
    argv = [
        "--backend", backend,
        "--target", str(target_dir),
        "--draft", str(draft_dir),
        "--prompt-ids", _csv(prompt_ids),
        "--max-new-tokens", str(int(max_new_tokens)),
        "--block-size", str(int(block_size)),
        "--temperature", repr(float(temperature)),
        "--top-p", repr(float(top_p)),
        "--top-k", str(int(top_k)),
        "--seed", str(int(seed)),
    ]
    if stop_token_ids:
        argv += ["--stop-token-ids", _csv(stop_token_ids)]
    if baseline:
        argv.append("--baseline")
    if capture_logits:
        argv.append("--capture-logits")
    if mlx_temporal_rotating_cache:
        argv.append("--mlx-temporal-rotating-cache")
    if timing:
        argv.append("--timing")
    return argv


def run_reference(
    backend: str,
    target_dir: str | Path,
    draft_dir: str | Path,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **options: Any,
) -> dict[str, Any]:
    """Run the reference generation loop once and return its JSON record.

    Options (keyword-only): ``baseline`` (torch: ``dflash_generate`` at block 1; MLX: stock
    ``mlx_lm`` ``generate_step``), ``top_p``, ``top_k``, ``seed``, ``stop_token_ids`` (default
    none: runs to ``max_new_tokens``), ``capture_logits``, ``mlx_temporal_rotating_cache``
    (an opt-in correction of an MLX reference quirk; not reference behaviour), ``timing``
    (MLX: no recording wrapper around the target, so the loop runs as shipped; ``proposals``
    is None).

    Keys: ``tokens`` (new tokens only), ``acceptance_lengths`` (per cycle, accepted + 1),
    ``proposals`` (per cycle, drafted tokens before verification; ``[]`` per cycle for the
    baseline), ``wall_s``, ``decode_s``, ``ttft_s``, ``block_size``, ``architecture``,
    ``backend``, ``temperature``, ``baseline``, ``num_input_tokens``, ``versions``, and
    ``draft_logits`` (per draft call, rows x vocab) when ``capture_logits``.
    """
    argv = reference_argv(backend, target_dir, draft_dir, prompt_ids, max_new_tokens,
                          block_size, temperature, **options)
    python = ensure_reference_venv()
    return _run_json([str(python), str(RUNNER), *argv], timeout_s)


def run_reference_in_process(backend: str, *args: Any, **options: Any) -> dict[str, Any]:
    """``run_reference`` in this interpreter, for timing next to speculant in one process state.

    MLX only: the reference venv's ``dflash`` package is imported from its folder (nothing else
    from that venv), on this interpreter's mlx and mlx-lm, which must be the versions the
    reference venv holds. Runs with ``timing`` on, so ``proposals`` is None."""
    if backend != "mlx":
        raise ValueError("only the MLX reference runs in process (the torch one needs transformers 5.15)")
    runner = _reference_runner_module()
    argv = reference_argv(backend, *args, **{**options, "timing": True})
    return runner.run_one(runner.parse_args(argv))


@functools.lru_cache(maxsize=None)
def _reference_runner_module():
    """run_reference.py as a module, loaded once (each benchmark repeat calls it twice)."""
    import importlib.util

    if "dflash" not in sys.modules:
        _import_reference_package()
    spec = importlib.util.spec_from_file_location("_speculant_run_reference", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_reference_package() -> None:
    import importlib.metadata as metadata
    import importlib.util

    problem = reference_venv_problem()
    if problem:
        raise ReferenceUnavailable(problem)
    sites = sorted((reference_venv_dir() / "lib").glob("python*/site-packages"))
    if not sites or not (sites[0] / "dflash" / "__init__.py").is_file():
        raise ReferenceUnavailable(f"no dflash package under {reference_venv_dir() / 'lib'}")
    site = sites[0]
    for dist in ("mlx", "mlx_lm"):
        theirs = sorted(p.name[len(dist) + 1 : -len(".dist-info")] for p in site.glob(f"{dist}-*.dist-info"))
        try:
            ours = metadata.version(dist.replace("_", "-"))
        except metadata.PackageNotFoundError:
            ours = None
        if theirs != [ours]:
            raise ReferenceUnavailable(f"the reference venv has {dist} {theirs}, this interpreter {ours}; "
                                       "the in-process reference needs the same version")
    package = site / "dflash"
    spec = importlib.util.spec_from_file_location("dflash", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["dflash"] = module
    spec.loader.exec_module(module)


def run_reference_batch(
    jobs: Sequence[Mapping[str, Any]], timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Several runs in one reference process (one interpreter start and one import of torch,
    transformers and MLX). Each job holds ``run_reference``'s parameters by name; results come
    back in order. Raises ReferenceRunError if any run failed."""
    return _run_batch([reference_argv(**job) for job in jobs], timeout_s)


def reference_load_info(draft_dir: str | Path, timeout_s: float = 300.0) -> dict[str, Any]:
    """Load a draft with the reference classes and report its keys (see reference_load_infos)."""
    return reference_load_infos([draft_dir], timeout_s)[0]


def reference_load_infos(
    draft_dirs: Sequence[str | Path], timeout_s: float = 300.0
) -> list[dict[str, Any]]:
    """For each draft: ``{"architecture", "torch": {missing_keys, unexpected_keys,
    mismatched_keys, error_msgs}, "mlx_parameters"}`` from the reference torch class's
    ``from_pretrained(output_loading_info=True)`` and the MLX ``load_draft`` (strict: it
    raises on any missing or unexpected tensor), all in one reference process."""
    return _run_batch([["--load-info", "--draft", str(d)] for d in draft_dirs], timeout_s)


def _run_batch(argvs: list[list[str]], timeout_s: float) -> list[dict[str, Any]]:
    python = ensure_reference_venv()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(argvs, f)
    try:
        results = _run_json([str(python), str(RUNNER), "--batch", f.name], timeout_s)
    finally:
        os.unlink(f.name)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise ReferenceRunError(f"{len(errors)} of {len(results)} reference runs failed; "
                                f"first:\n{errors[0]}")
    return results


def _run_json(cmd: list[str], timeout_s: float) -> Any:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    env.pop("PYTHONPATH", None)  # keep speculant's interpreter paths out of the reference venv
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if result.returncode != 0:
        raise ReferenceRunError(
            f"reference run failed (rc {result.returncode}): {' '.join(cmd)}\n"
            f"{result.stderr[-6000:]}"
        )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if not lines:
        raise ReferenceRunError(f"reference run printed nothing: {' '.join(cmd)}\n"
                                f"{result.stderr[-6000:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":  # tiny CLI: python tests/reference/harness.py --ensure
    if sys.argv[1:] == ["--ensure"]:
        print(ensure_reference_venv(build=True))
    else:
        print(reference_venv_problem() or f"ok: {reference_python()}")
