"""The prefix cache on PyTorch and MLX (eager, and MLX's compiled whole forwards over static
buffers): a request resumed from a stored prefix gives a cold request's tokens, on every cache
kind, and the checks fail when a restored cache is wrong.

Targets (``build_tiny_family``, sliding window 16): Llama (full attention only, so a snapshot is
cut at any token), Gemma 3 (sliding windows) and Qwen3.5 (Gated DeltaNet 3 : 1), whose snapshots
are restored only at the length they were taken at. A planted drafter proposes the cold
continuation with mistakes at chosen block positions, so after the restore blocks are rejected at
position 0 and partway, rolled back and extended. DFlash (its pending context features) and MTP
(its cache, rebuilt from the stored final hidden states) resume their drafts exactly: the same
acceptance per cycle as cold.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.core.prefix_cache import PrefixStore  # noqa: E402
from speculant.core.types import Capture  # noqa: E402
from speculant.testing.planted_drafter import registry_with_planted  # noqa: E402
from speculant.testing.tiny_families import FAMILIES as TINY_FAMILIES, build_tiny_family  # noqa: E402

NEW = 64
BLOCK = 8
BACKEND = {"kind": "torch", "device": "cpu", "dtype": "float32"}
HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
_MLX = pytest.mark.skipif(not HAS_MLX, reason="needs mlx and mlx-lm")
BACKENDS = {
    "torch": BACKEND,
    "mlx": {"kind": "mlx", "device": "cpu", "dtype": "float32", "compile": "off"},
    "mlx-compiled": {"kind": "mlx", "device": "cpu", "dtype": "float32", "compile": "on"},
    "torch-compiled": {**BACKEND, "compile": "on"},  # the static cache, as on CUDA by default
}
# the compiled graphs traced and functionalized, run without inductor (conftest.py): what is tested is
# the static cache's snapshots and restores around them; inductor's code is test_fast_path_torch.py's
TRACED = pytest.mark.compiler("aot_eager")
_MARKS = {"mlx": [_MLX, pytest.mark.mlx], "mlx-compiled": [_MLX, pytest.mark.mlx],
          "torch-compiled": [pytest.mark.slow, TRACED]}
ON = [pytest.param(b, marks=_MARKS.get(b, [])) for b in BACKENDS]
FAMILIES = ("llama", "gemma3_text", "qwen3_5")
MISTAKES = [0, 3, -1, 1, 5, -1, 2]
TAIL = [7, 8, 9, 10, 11, 12, 13, 14, 15]
# (prefix length, tail length): the prefix ends inside the second sliding window, exactly at a
# block (and window) boundary, and one token short of the prompt
CASES = {"inside a window": (40, 8), "at a block boundary": (48, 8), "one token short": (40, 1)}


def prefix_of(length: int) -> list[int]:
    return list(range(20, 20 + length))


@pytest.fixture(scope="module")
def family(tmp_path_factory, torch_threads):
    root, built = tmp_path_factory.mktemp("prefix_families"), {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny_family(root / name, name)
        return built[name]

    return get


def planted(path, script=(), backend="torch", **extra):
    drafter = {"kind": "planted", "options": {"script": list(script), "mistakes": MISTAKES}, "block_size": BLOCK}
    config = {"backend": BACKENDS[backend] if isinstance(backend, str) else backend, "target": {"path": str(path)}, "drafter": drafter, **extra}
    return load_engine(config, registry=registry_with_planted())


def run(engine, ids, new=NEW):
    return engine.run(prompt_ids=ids, max_new_tokens=new, ignore_eos=True)


def cold(engine, ids):
    engine.prefix_store.clear()
    result = run(engine, ids)
    assert result.stats.cached_tokens == 0
    engine.prefix_store.clear()
    return result


def run_recorded(engine, ids):
    """``(result, kinds of rollback seen)``: after each forward, how many of its rows were cropped."""
    target, cycles = engine.target, []
    forward, crop = target.forward, target.crop

    def recording_forward(token_ids, capture=Capture()):
        cycles.append([int(token_ids.shape[0]), target.cache_length + 0])
        return forward(token_ids, capture)

    def recording_crop(length):
        if cycles and len(cycles[-1]) == 2:
            cycles[-1].append(cycles[-1][1] + cycles[-1][0] - length)
        crop(length)

    target.forward, target.crop = recording_forward, recording_crop
    try:
        result = run(engine, ids)
    finally:
        del target.forward, target.crop
    seen = {"whole" if removed == 0 else "position 0" if removed == width - 1 else "partway"
            for width, _, removed in cycles if width >= 2}
    return result, seen


@pytest.fixture(scope="module")
def engines(family):
    """Per family and backend: a planted engine scripted with every case's cold continuation, and
    those, its prefix store emptied. One engine per pair: a compiled one costs a compile per width.
    Prompts outside the script get the unscripted drafts (``anchor + 1, + 2, ...``)."""
    done = {}

    def get(name: str, backend: str = "torch"):
        if (name, backend) not in done:
            engine = planted(family(name), backend=backend)
            prompts = [prefix_of(n) + TAIL[:t] for n, t in CASES.values()]
            expected = {tuple(p): cold(engine, p).token_ids for p in prompts}  # before any script
            engine.drafter.scripts.update(expected)
            done[name, backend] = engine, expected
        engine, expected = done[name, backend]
        engine.prefix_store.clear()
        return engine, expected

    return get


# every other family docs/families.md lists, one case each (the three above run every case)
OTHER_FAMILIES = tuple(f for f in TINY_FAMILIES if f not in FAMILIES)


@pytest.mark.parametrize("name", OTHER_FAMILIES)
@pytest.mark.parametrize("backend", [b for b in ON if b.values[0] in ("torch", "mlx")])
def test_every_family_resumes_with_the_cold_tokens(engines, backend, name):
    engine, expected = engines(name, backend)
    length, tail = CASES["inside a window"]
    prompt = prefix_of(length) + TAIL[:tail]
    run(engine, prefix_of(length), new=1)
    result = run(engine, prompt)
    assert result.stats.cached_tokens == length
    assert result.token_ids == expected[tuple(prompt)], name


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("backend", ON)
def test_a_resumed_request_gives_the_cold_tokens_through_rollbacks(engines, backend, name, case):
    engine, expected = engines(name, backend)
    length, tail = CASES[case]
    prompt = prefix_of(length) + TAIL[:tail]
    assert cold(engine, prompt).token_ids == expected[tuple(prompt)]
    run(engine, prefix_of(length), new=1)  # stores the prefix
    result, seen = run_recorded(engine, prompt)
    assert result.stats.cached_tokens == length
    assert result.token_ids == expected[tuple(prompt)], f"{name}, {case}"
    assert {"position 0", "partway"} <= seen  # restored, then rolled back by rejected blocks, then extended


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("backend", ON)
def test_the_next_turn_resumes_where_the_last_output_ended(engines, backend, name):
    """The second turn's prompt is the first's, its output and a new part: it resumes from the
    snapshot stored when the first request ended (after its rollbacks), and gives cold tokens."""
    engine = engines(name, backend)[0]
    first = run(engine, prefix_of(40), new=24)
    turn = prefix_of(40) + first.token_ids + TAIL
    want = cold(engine, turn).token_ids
    run(engine, prefix_of(40), new=24)
    result = run(engine, turn)
    assert result.stats.cached_tokens == 40 + 24 - 1  # the last output token was never run through the target
    assert result.token_ids == want


def corrupt_first_layer(caches) -> None:
    """Change one restored tensor of the first layer: a full or sliding attention layer's keys,
    a Gated DeltaNet layer's recurrent state (PyTorch's and MLX's caches alike)."""
    layer = caches[0]
    if getattr(layer, "recurrent_states", None):  # transformers' linear attention layer
        layer.recurrent_states[0] = layer.recurrent_states[0] + 0.5
    elif getattr(layer, "keys", None) is not None:
        layer.keys = layer.keys + 0.5
    else:  # MLX's DeltaCache: [conv state, recurrent state]
        layer[1] = layer[1] + 0.5


def corrupting(monkeypatch, backend: str) -> None:
    """Corrupt the caches after every restore."""
    if backend == "torch-compiled":
        from speculant.backends.torch import prefix

        restore_static = prefix.restore_static

        def corrupted_static(static, snapshot, at):
            done = restore_static(static, snapshot, at)
            layer = static.cache.layers[0]  # in place: the compiled graphs read the buffers where they are
            with torch.inference_mode():
                (layer.recurrent_states[0] if getattr(layer, "recurrent_states", None) else layer.keys).add_(0.5)
            return done

        monkeypatch.setattr(prefix, "restore_static", corrupted_static)
    elif backend == "torch":
        from speculant.backends.torch import prefix

        restored = prefix.restored_cache

        def corrupted(snapshot, at):
            cache = restored(snapshot, at)
            corrupt_first_layer(cache.layers)
            return cache

        monkeypatch.setattr(prefix, "restored_cache", corrupted)
    else:
        from speculant.backends.mlx import prefix

        restore = prefix.restore_caches

        def corrupted(caches, snapshot, at):
            restore(caches, snapshot, at)
            corrupt_first_layer(caches)

        monkeypatch.setattr(prefix, "restore_caches", corrupted)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("backend", ON)
def test_the_equality_check_fails_when_a_restored_cache_is_wrong(engines, backend, name, monkeypatch):
    engine, expected = engines(name, backend)
    length, tail = CASES["inside a window"]
    prompt = prefix_of(length) + TAIL[:tail]
    engine.prefix_store.clear()
    run(engine, prefix_of(length), new=1)
    corrupting(monkeypatch, backend)
    result = run(engine, prompt)
    assert result.stats.cached_tokens == length
    assert result.token_ids != expected[tuple(prompt)]


def test_eviction_under_a_tiny_budget_keeps_outputs_cold(engines):
    engine, expected = engines("gemma3_text")
    prompt = prefix_of(40) + TAIL[:8]
    engine.prefix_store.clear()
    run(engine, prefix_of(40), new=1)
    one = engine.prefix_store.bytes
    assert len(engine.prefix_store) == 1
    engine.prefix_store = PrefixStore(one + one // 2)  # room for one snapshot
    try:
        run(engine, prefix_of(40), new=1)
        run(engine, list(range(100, 140)), new=1)  # as large: evicts the first
        store = engine.prefix_store
        assert store.stats.evicted >= 1 and store.bytes <= store.max_bytes and len(store) == 1
        result = run(engine, prompt)
        assert result.stats.cached_tokens == 0 and result.token_ids == expected[tuple(prompt)]
    finally:
        engine.prefix_store = PrefixStore(engine.config.prefix_cache.max_bytes)


def test_other_targets_and_dtypes_never_share_entries(family):
    llama = planted(family("llama"))
    others = [planted(family("gemma3_text")), planted(family("llama"), backend={**BACKEND, "dtype": "bfloat16"})]
    if HAS_MLX:  # the same folder on another backend
        others.append(planted(family("llama"), backend="mlx"))
    for other in others:
        other.prefix_store = llama.prefix_store
    run(llama, prefix_of(40), new=1)
    assert run(llama, prefix_of(41), new=2).stats.cached_tokens == 40
    for other in others:
        assert run(other, prefix_of(41), new=2).stats.cached_tokens == 0


@pytest.mark.parametrize("backend", ON)
def test_full_attention_snapshots_are_cut_at_any_token(engines, backend):
    """Llama's snapshot of a longer prompt serves a prompt that diverges inside it (cut at the
    divergence) and the same prompt again (cut one token short): cold tokens both times."""
    engine, expected = engines("llama", backend)
    prompt = prefix_of(48) + TAIL[:8]
    engine.prefix_store.clear()
    run(engine, prefix_of(52), new=1)  # shares 48 tokens with the prompt
    result, seen = run_recorded(engine, prompt)
    assert result.stats.cached_tokens == 48 and result.token_ids == expected[tuple(prompt)]
    result = run(engine, prompt)  # its own snapshot, cut one token short
    assert result.stats.cached_tokens == len(prompt) - 1 and result.token_ids == expected[tuple(prompt)]


@pytest.mark.parametrize("backend", ON)
def test_plain_decoding_resumes_after_its_pipelined_steps(family, backend):
    """Without a drafter, greedy requests run the target's pipelined steps (MLX, and PyTorch
    compiled) a step ahead; the end-of-output snapshot is taken after that step is taken back."""
    from speculant.api import load_engine as load

    config = BACKENDS[backend]
    engine = load({"backend": config, "target": {"path": str(family("qwen3_5"))}})
    session = engine.session()
    session.extend(prefix_of(40), max_new_tokens=20, ignore_eos=True)
    ids = session.token_ids + TAIL
    second = session.extend(TAIL, max_new_tokens=NEW, ignore_eos=True)
    assert second.stats.cached_tokens == 40 + 20 - 1
    assert second.token_ids == cold(engine, ids).token_ids


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_5"])
@pytest.mark.parametrize("backend", ON)
def test_prompts_sharing_a_system_prefix_get_a_checkpoint_there(engines, backend, name):
    """Sliding and hybrid snapshots serve only prompts extending their whole tokens, so a second
    prompt that shares just a system prefix with the first misses; its prefill then stops at the
    shared prefix's end to store a snapshot, and a third prompt sharing it resumes there."""
    engine = engines(name, backend)[0]
    system, users = prefix_of(40), [[7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18]]
    want = cold(engine, system + users[2]).token_ids
    first, second = (run(engine, system + u, new=8) for u in users[:2])
    # PyTorch's compiled path lays sliding layers out whole: its snapshots are cut, no checkpoint needed
    cut = backend == "torch-compiled" and name == "gemma3_text"
    assert first.stats.cached_tokens == 0 and second.stats.cached_tokens == (len(system) if cut else 0)
    third = run(engine, system + users[2])
    assert third.stats.cached_tokens == len(system)
    assert third.token_ids == want


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_sampling_from_a_restored_prefix_follows_the_target(family, name):
    """The first two sampled tokens after a restored prefix (hybrid state included) follow the
    target's own two-token law at temperature 1 (chi-square over many seeded requests); a request
    that restored the wrong state would follow another law."""
    from speculant.core.sampling import target_probs
    from speculant.core.types import SamplingParams
    from stats_helpers import gof_pvalue

    engine = planted(family(name), script=[], prefix_cache={"max_bytes": 1 << 30}, sampling={"temperature": 1.0})
    prompt = prefix_of(40) + TAIL[:4]
    sampling, ops = SamplingParams(temperature=1.0), engine.backend.ops

    def next_probs(ids):
        engine.target.reset()
        logits = engine.target.prefill(ids).logits[-1:]
        return ops.to_numpy(target_probs(ops, logits, sampling))[0].astype(np.float64)

    first = next_probs(prompt)
    top = np.argsort(-first)[:6]  # the second token's law after each likely first token
    second = {int(a): next_probs(prompt + [int(a)]) for a in top}
    engine.prefix_store.clear()
    run(engine, prefix_of(40), new=1)  # stores the prefix every request below restores
    firsts, pairs = [], []
    for seed in range(1500):
        result = engine.run(prompt_ids=prompt, max_new_tokens=2, ignore_eos=True, seed=seed)
        assert result.stats.cached_tokens >= 40  # the prefix, or (full attention) the prompt a run before stored
        a, b = result.token_ids[:2]
        firsts.append(a)
        if a == int(top[0]):
            pairs.append(b)
    assert gof_pvalue(np.array(firsts), first) > 1e-3
    assert len(pairs) > 50 and gof_pvalue(np.array(pairs), second[int(top[0])]) > 1e-3
