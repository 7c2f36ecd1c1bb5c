"""Shared fixtures: tiny real checkpoints built once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("SPECULANT_TIMINGS", "off")  # and per test: _timings below
# commands given no model run the shipped tiny pair (no download); tests of the real default
# (SmolLM2) delete this with monkeypatch
os.environ["SPECULANT_PAIR"] = "tiny"

# The modules that ran longest (wall seconds on the 2-core AVX2 CI-class machine, full suite,
# 2026-12-05: 530, 486, 304, 210, 208, 189, 164, 144, 136, 130, 130). ``--dist loadscope`` hands
# whole modules to the workers in collection order, so these go first: collected last, one of
# them kept a worker busy for minutes after the other had run out of work.
LONGEST_MODULES = ("test_real_pair_lossless.py", "test_families_torch.py", "test_prefix_cache.py",
                   "test_sampling_model.py", "test_batch_prefix.py", "test_scheduler.py", "test_tree_engine.py",
                   "test_mtp_sampling.py", "test_benchmark_scripts.py", "test_draft_ahead.py",
                   "test_tree_compiled_torch.py")


def pytest_collection_modifyitems(items):
    """Longest modules first; every module's own tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep theirs


@pytest.fixture(autouse=True)
def _compiler(request):
    """``@pytest.mark.compiler("aot_eager")`` (on a test or a whole module): the graphs that
    ``torch.compile`` builds in the test are traced by dynamo as in production (``fullgraph``,
    guards, recompiles) and functionalized by AOTAutograd, then run by its eager backend instead of
    inductor's generated C++. A cold inductor compile of a tiny hybrid's verify widths took 230 s
    on a 2-core CI-class machine against 58 s so (docs/history/test-suite-time.md). Tests whose
    subject is the compiled code itself (test_fast_path_torch.py, the transposed and packed
    weights, one graph per layer kind) keep inductor: ``compiler("inductor")`` or no marker."""
    marker = request.node.get_closest_marker("compiler")
    if marker is None or marker.args[0] == "inductor":
        yield
        return
    import functools

    torch = pytest.importorskip("torch")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "compile", functools.partial(torch.compile, backend=marker.args[0]))
        yield


@pytest.fixture(autouse=True)
def _timings(request, tmp_path_factory):
    """Weight layouts timed at every load (``SPECULANT_TIMINGS=off``), as tests that patch or check
    the measurement expect: a remembered timing (core/timing.py) would skip it. A test marked
    ``remembered_timings`` reads and fills one file shared with the run's other such tests, as a
    user's loads do. Set per test, so that no test's setting can reach another's."""
    marked = request.node.get_closest_marker("remembered_timings") is not None
    value = str(tmp_path_factory.getbasetemp() / "timings.json") if marked else "off"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECULANT_TIMINGS", value)
        yield


@pytest.fixture
def fixed_loop_clock(monkeypatch):
    """The engine loop's clock ticks 1 ms a reading, so choices made from measured costs (the tree
    verifier's, the adaptive verifier's) are fixed by the tokens, not by this machine's load."""
    import itertools
    import types

    from speculant.core import loop

    ticks = itertools.count()
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))


@pytest.fixture(scope="session")
def torch_threads():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)  # tiny models: one thread is faster and leaves a core free
    return torch


@pytest.fixture(scope="session")
def sliding_families(tmp_path_factory, torch_threads):
    """``get(name)``: a tiny checkpoint of that family (speculant/testing/tiny_families.py), its
    sliding layers 16 wide, built once per session."""
    from speculant.testing.tiny_families import build_tiny_family

    root, built = tmp_path_factory.mktemp("sliding_families"), {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny_family(root / name, name, sliding_window=16)
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_targets(sliding_families, tmp_path_factory):
    """``get(name)``: "qwen3", the dense tiny target (speculant/testing/tiny.py), or a tiny
    checkpoint of that family with 16-wide sliding layers; built once per session."""
    from speculant.testing.tiny import build_tiny_target

    dense = {}

    def get(name: str):
        if name != "qwen3":
            return sliding_families(name)
        if not dense:
            dense[name] = build_tiny_target(tmp_path_factory.mktemp("tiny_targets") / name)
        return dense[name]

    return get


@pytest.fixture(scope="session")
def reference_venv():
    """The official dflash 0.1.0 reference venv's python; skips the test when it is unavailable
    (or builds it first when SPECULANT_BUILD_REF_VENV=1)."""
    from reference.harness import ReferenceUnavailable, ensure_reference_venv

    try:
        return ensure_reference_venv()
    except ReferenceUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, torch_threads):
    """A random Qwen3 target (no planted bias)."""
    from speculant.testing.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target", seed=0)


@pytest.fixture(scope="session")
def planted_pair(tmp_path_factory, torch_threads):
    """Target and DFlash draft (trained block 16) sharing a planted bias: partial acceptance."""
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target

    root = tmp_path_factory.mktemp("planted")
    target = build_tiny_target(root / "target", seed=0, planted=7.5)
    draft = build_tiny_dflash(root / "draft", target, seed=7, block_size=16)
    sliding = build_tiny_dflash(root / "draft_swa", target, seed=7, block_size=16, sliding_window=8)
    return {"target": target, "draft": draft, "draft_swa": sliding}


@pytest.fixture(scope="session")
def random_pair(tmp_path_factory, torch_threads):
    """Target and an untrained DFlash draft: drafts are almost never accepted."""
    from speculant.testing.tiny import build_tiny_pair

    target, draft = build_tiny_pair(tmp_path_factory.mktemp("random"), seed=3, block_size=8)
    return {"target": target, "draft": draft}
