"""Batched verify (core/batch.py; backends/torch/batch.py, backends/mlx/batch.py; issue #39): several sequences of
different prompt lengths in one forward a cycle, each with its own acceptance pattern, joining and
leaving at different cycles; each must equal its solo plain-greedy run token for token."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.core.batch import batch_problem  # noqa: E402
from speculant.core.prefix_cache import CacheSnapshot  # noqa: E402
from speculant.core.tree import DraftTree  # noqa: E402
from speculant.core.types import Capture, TargetInfo  # noqa: E402

BACKEND = {"kind": "torch", "device": "cpu", "dtype": "float32"}
# the default backend.compile: the batch runs the model eagerly over its own cache beside the
# target's fast path (transposed / packed weights on the CPU) and must agree with that path's solo run
BACKENDS = {"torch": BACKEND, "mlx": {**BACKEND, "kind": "mlx"}}
BACKEND_PARAMS = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]
NEW = 40  # crosses the sliding window (16) of the sliding families
# (prompt, the cycle it joins at, its drafting pattern); prompt lengths all differ
SEQUENCES = {
    "whole": (list(range(5, 12)), 0, "whole"),  # drafts the true continuation: always accepted whole
    "never": (list(range(30, 50)), 0, "never"),  # its first draft is always wrong: rejected at 0
    "mixed": (list(range(60, 63)), 0, "mixed"),  # right up to a point that moves each cycle
    "late": (list(range(90, 103)), 2, "mixed"),  # joins at the third cycle
}
CAPTURE = Capture(layer_ids=(1, 2), final_hidden="post_norm")
# dense; all sliding; sliding + full (Gemma 3; gpt-oss with sinks; Muse Glimmer without rope on full layers);
# Gated DeltaNet + full (Qwen3.5; Qwen3-Next with MoE and partial rope)
TARGETS = ("qwen3", "llama", "mistral", "gemma3_text", "gpt_oss", "muse_glimmer", "qwen3_5", "qwen3_next")
HYBRIDS = ("qwen3_5", "qwen3_next")


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return tiny_targets


def engine_for(path, backend="torch"):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        pytest.importorskip("mlx_lm")
    return load_engine({"backend": BACKENDS[backend], "target": {"path": str(path)}})


def batch_class(backend: str):
    if backend == "mlx":
        from speculant.backends.mlx.batch import MLXBatch

        return MLXBatch
    from speculant.backends.torch.batch import TorchBatch

    return TorchBatch


def solo_tokens(engine, prompt) -> list[int]:
    return engine.run(prompt_ids=prompt, max_new_tokens=NEW, ignore_eos=True).token_ids


def drafts_for(pattern: str, truth: list[int], cycle: int, vocab: int) -> list[int]:
    """Drafts after the anchor: ``truth`` is the solo run's continuation from here."""
    width = {"whole": 5, "never": 3, "mixed": 1 + cycle % 6}[pattern]
    drafts = list(truth[:width])
    if pattern == "never" and drafts:
        drafts[0] = (drafts[0] + 1) % vocab
    if pattern == "mixed" and drafts:
        wrong = cycle % (width + 1)  # sometimes past the end: all right
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % vocab
    return drafts


def batched_greedy(batch, solo: dict, check=None, together: bool = False, sequences: dict | None = None,
                   join_many: bool = False) -> tuple[dict, dict]:
    """Run every sequence of ``sequences`` (SEQUENCES) through ``batch`` with greedy acceptance; returns each one's
    tokens and how many drafts it had accepted each cycle. ``check(key, context, block, out)``
    sees each verified row: the sequence's tokens so far (not the anchor), its block, its output.
    ``together``: sequences with their tokens wait (decoding on) until two can leave at once.
    ``join_many``: the sequences joining at one cycle join in one call."""
    SEQUENCES = sequences or globals()["SEQUENCES"]
    emitted = {key: [] for key in SEQUENCES}
    accepted = {key: [] for key in SEQUENCES}
    left_together: list[int] = []
    cycle = 0
    while batch.keys or cycle <= max(joins_at for _, joins_at, _ in SEQUENCES.values()):
        joining = [(key, prompt, None) for key, (prompt, joins_at, _) in SEQUENCES.items() if joins_at == cycle]
        outs = batch.join_many(joining, CAPTURE) if join_many else [batch.join(*join[:2], CAPTURE) for join in joining]
        for (key, prompt, _), out in zip(joining, outs):
            assert out.features.shape[0] == len(prompt)
            vocab = int(out.logits.shape[-1])
            emitted[key].append(int(np.asarray(out.logits[-1]).argmax()))
        blocks = []
        for key in batch.keys:
            tokens = emitted[key]
            blocks.append([tokens[-1]] + drafts_for(SEQUENCES[key][2], solo[key][len(tokens):], cycle, vocab))
        outs = batch.verify(blocks, CAPTURE)
        lengths = []
        for key, block, out, before in zip(batch.keys, blocks, outs, batch.lengths_before_block()):
            # the captured final hidden state is this sequence's own: its head gives its logits
            head = np.asarray(batch.target.lm_head(out.final_hidden))
            assert np.allclose(head, np.asarray(out.logits), atol=1e-4)
            assert tuple(out.features.shape) == (len(block), 2 * out.final_hidden.shape[-1])
            if check is not None:
                check(key, SEQUENCES[key][0] + emitted[key][:-1], block, out)
            choices = np.asarray(out.logits).argmax(axis=-1).tolist()
            taken = 0
            while taken < len(block) - 1 and block[1 + taken] == choices[taken]:
                taken += 1
            accepted[key].append(taken)
            emitted[key].extend(block[1: 1 + taken] + [choices[taken]])
            lengths.append(before + 1 + taken)
        batch.crop(lengths)
        ended = [key for key in batch.keys if len(emitted[key]) >= NEW]
        if not together:
            for key in ended:
                batch.leave(key)
        elif len(ended) >= min(2, len(batch.keys)):
            left_together.append(len(ended))
            batch.leave_many(ended)
        cycle += 1
    assert not together or max(left_together) >= 2, left_together
    return {key: tokens[:NEW] for key, tokens in emitted.items()}, accepted


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize(("name", "compact_at"), [(name, 0.25) for name in TARGETS]
                         + [(name, at) for name in ("qwen3", "mistral") for at in (0.0, 1.0)])
def test_each_batched_sequence_equals_its_solo_greedy_run(targets, name, compact_at, backend, monkeypatch):
    engine = engine_for(targets(name), backend)
    solo = {key: solo_tokens(engine, prompt) for key, (prompt, _, _) in SEQUENCES.items()}
    cls = batch_class(backend)
    monkeypatch.setattr(cls, "compact_at", compact_at)
    monkeypatch.setattr(cls, "join_tokens", 6)  # prompts of 3 .. 20 tokens join in chunks of 6
    assert_each_equals_its_solo_run(cls(engine.target), solo)


def assert_each_equals_its_solo_run(batch, solo):
    got, accepted = batched_greedy(batch, solo)
    assert all(a == 5 for a in accepted["whole"][:-1]), accepted["whole"]
    assert set(accepted["never"]) == {0}
    assert len(set(accepted["mixed"])) > 2  # the acceptance patterns really differ
    for key in SEQUENCES:
        assert got[key] == solo[key], key
    assert batch.keys == [] and batch.book.columns == 0


@pytest.mark.parametrize(("name", "compact_at"), [(name, 0.25) for name in TARGETS if name not in HYBRIDS]
                         + [("qwen3", 0.0), ("mistral", 1.0)])
def test_the_flattened_layout_equals_each_solo_run(targets, name, compact_at, monkeypatch):
    """Every sequence's tokens end to end in one cache row (backends/torch/flat_batch.py): each
    token must read only its own sequence's columns, at its own positions, within its window."""
    from speculant.backends.torch.flat_batch import TorchFlatBatch

    engine = engine_for(targets(name))
    solo = {key: solo_tokens(engine, prompt) for key, (prompt, _, _) in SEQUENCES.items()}
    monkeypatch.setattr(TorchFlatBatch, "compact_at", compact_at)
    assert_each_equals_its_solo_run(engine.target.new_batch("flat"), solo)


@pytest.mark.parametrize("layout", ["padded", pytest.param("mlx", marks=pytest.mark.mlx), "flat"])
@pytest.mark.parametrize(("name", "compact_at"), [("qwen3", 0.0), ("qwen3", 1.0), ("gemma3_text", 0.25), ("qwen3_5", 0.25)])
def test_sequences_leaving_together_leave_the_others_as_they_were(targets, name, compact_at, layout, monkeypatch):
    """``leave_many``: the rows of several sequences dropped at once (one copy of the caches),
    compacted or not; those left go on as before, on each cache kind."""
    if layout == "flat" and name in HYBRIDS:
        pytest.skip("the flattened layout holds no Gated DeltaNet rows")
    engine = engine_for(targets(name), "mlx" if layout == "mlx" else "torch")
    solo = {key: solo_tokens(engine, prompt) for key, (prompt, _, _) in SEQUENCES.items()}
    batch = engine.target.new_batch("flat") if layout == "flat" else batch_class(layout)(engine.target)
    monkeypatch.setattr(type(batch), "compact_at", compact_at)
    monkeypatch.setattr(batch.book, "compact_at", compact_at)
    got, _ = batched_greedy(batch, solo, together=True)
    assert got == solo


# joining in one call: two prompts of one length (a hybrid's group: padding would move its recurrent
# state) beside a shorter one, and one joining later alone
TOGETHER = {
    "whole": (list(range(5, 12)), 0, "whole"),
    "never": (list(range(30, 37)), 0, "never"),
    "mixed": (list(range(60, 63)), 0, "mixed"),
    "late": (list(range(90, 103)), 2, "mixed"),
}


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "qwen3_5"])
def test_sequences_joining_together_equal_their_solo_runs(targets, name, backend, monkeypatch):
    """``join_many``: prompts of different lengths prefilled as rows of one right-padded forward
    (their chunks, then their last tokens); each row's first token, captured states and every
    later cycle equal the sequence's solo run, on dense, sliding and Gated DeltaNet targets."""
    engine = engine_for(targets(name), backend)
    solo = {key: solo_tokens(engine, prompt) for key, (prompt, _, _) in TOGETHER.items()}
    cls, grouped = batch_class(backend), []
    join_rows = cls._join_rows
    monkeypatch.setattr(cls, "_join_rows", lambda self, prompts, capture, restored=None:
                        grouped.append(sorted(map(len, prompts))) or join_rows(self, prompts, capture, restored))
    batch = cls(engine.target)
    got, accepted = batched_greedy(batch, solo, sequences=TOGETHER, join_many=True)
    assert got == solo
    assert set(accepted["never"]) == {0} and accepted["whole"][0] == 5
    # (MLX prefills a sequence joining alone through the same path: a group of one)
    assert [g for g in grouped if len(g) > 1] == ([[7, 7]] if name in HYBRIDS else [[3, 7, 7]])


def test_the_flattened_layout_refuses_gated_deltanet_layers(targets):
    engine = engine_for(targets("qwen3_5"))
    with pytest.raises(ValueError, match="flattened batch layout holds no per-sequence Gated DeltaNet"):
        engine.target.new_batch("flat")
    with pytest.raises(ValueError, match="batch layout 'paged'"):
        engine.target.new_batch("paged")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "qwen3_5"])
def test_each_rows_logits_and_states_equal_a_solo_forward(targets, name, backend):
    """Sampling reads the whole distribution, not its argmax: each row's logits and captured
    states equal those of the same block verified alone after the same tokens (float32)."""
    engine = engine_for(targets(name), backend)
    solo = {key: solo_tokens(engine, prompt) for key, (prompt, _, _) in SEQUENCES.items()}
    target, ops = engine.target, engine.backend
    compared = []
    # a hybrid's solo reference prefills the context in one chunked delta-rule pass, where the
    # batch walked it block by block: the same states up to float rounding, not bit for bit
    atol = 1e-3 if name == "qwen3_5" else 2e-4

    def check(key, context, block, out):
        target.reset()
        target.prefill(context, CAPTURE)
        alone = target.forward(ops.int_array(block), CAPTURE)
        for got, want in ((out.logits, alone.logits), (out.features, alone.features),
                          (out.final_hidden, alone.final_hidden)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=1e-4)
        compared.append(key)

    batched_greedy(target.new_batch(), solo, check)
    assert set(compared) == set(SEQUENCES)


# per row: its prompt, its tree (node 0 the anchor; None: a chain) and the accepted path (node indices)
TREE_ROWS = {
    "tree": (list(range(5, 27)), DraftTree((40, 41, 42, 43, 44, 45, 46), (-1, 0, 0, 1, 2, 3, 1)), (0, 2, 4)),
    "chain": (list(range(30, 37)), None, (0, 1)),
    "deep": (list(range(60, 90)), DraftTree((50, 51, 52, 53, 54), (-1, 0, 1, 1, 3)), (0, 1, 3, 4)),
}


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
def test_tree_rows_equal_their_solo_tree_forward_and_commit(targets, name, backend):
    """Rows verifying trees beside a chain row: each tree row's logits and captured states equal
    the target's own ``forward_tree`` after the same prompt; after the crop keeps each row's path,
    the next block of every row equals the target's after ``commit_tree`` of that path (dense, and
    sliding windows crossed by the longer prompts)."""
    engine = engine_for(targets(name), backend)
    target, ops = engine.target, engine.backend
    batch = target.new_batch()
    assert batch.tree_problem() is None
    for key, (prompt, _, _) in TREE_ROWS.items():
        batch.join(key, prompt, CAPTURE)
    blocks = [list(tree.tokens) if tree else [7, 8, 9] for _, tree, _ in TREE_ROWS.values()]
    outs = batch.verify(blocks, CAPTURE, [tree for _, tree, _ in TREE_ROWS.values()])
    batch.crop([len(p) + len(path) for p, _, path in TREE_ROWS.values()], [path if tree else None
                                                                        for _, tree, path in TREE_ROWS.values()])
    after = batch.verify([[11, 12, 13]] * len(TREE_ROWS), CAPTURE)
    for (prompt, tree, path), block, out, next_out in zip(TREE_ROWS.values(), blocks, outs, after):
        target.reset()
        target.prefill(prompt, CAPTURE)
        if tree is None:
            alone = target.forward(ops.int_array(block), CAPTURE)
            target.crop(len(prompt) + len(path))
        else:
            alone = target.forward_tree(tree, CAPTURE)
            target.commit_tree(len(prompt), path)
        for got, want in ((out.logits, alone.logits), (out.features, alone.features), (next_out.logits,
                          target.forward(ops.int_array([11, 12, 13]), CAPTURE).logits)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=1e-4)


def test_a_crop_that_keeps_another_rows_length_breaks_identity(targets, monkeypatch):
    """The test above sees per-sequence state leak: every row cropped to the first row's accepted count."""
    from speculant.backends.torch.batch import TorchBatch

    engine = engine_for(targets("qwen3"))
    solo = {key: solo_tokens(engine, prompt) for key, (prompt, _, _) in SEQUENCES.items()}
    crop = TorchBatch.crop

    def shared_crop(self, lengths):
        before = self.lengths_before_block()
        taken = lengths[0] - before[0]
        crop(self, [b + min(taken, w) for b, w in zip(before, self.book.block[1])])

    monkeypatch.setattr(TorchBatch, "crop", shared_crop)
    got, _ = batched_greedy(TorchBatch(engine.target), solo)
    assert any(got[key] != solo[key] for key in SEQUENCES)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_gated_deltanet_crop_that_keeps_another_rows_count_breaks_identity(targets, backend, monkeypatch):
    """The scenario sees Gated DeltaNet state leak between rows: each row's recurrent state and
    convolution window taken at the first row's accepted count (attention cropped right)."""
    engine = engine_for(targets("qwen3_5"), backend)
    solo = {key: solo_tokens(engine, prompt) for key, (prompt, _, _) in SEQUENCES.items()}
    if backend == "mlx":
        from speculant.backends.mlx.caches import DeltaCache

        keep = DeltaCache.keep_rows
        monkeypatch.setattr(DeltaCache, "keep_rows", lambda self, kept: keep(self, [kept[0]] * len(kept)))
    else:
        import speculant.backends.torch.batch as torch_batch

        keep = torch_batch._keep_linear
        monkeypatch.setattr(torch_batch, "_keep_linear",
                            lambda cache, kept, width: keep(cache, [kept[0]] * len(kept), width))
    got, _ = batched_greedy(engine.target.new_batch(), solo)
    assert any(got[key] != solo[key] for key in SEQUENCES)


def test_hybrid_rows_recorded_by_the_closed_form_equal_their_solo_runs(targets, monkeypatch):
    """What an accelerator runs: every row's per-position states from the delta rule's closed form."""
    from speculant.backends.torch.rollback import ROLLBACK

    engine = engine_for(targets("qwen3_5"))
    solo = {key: solo_tokens(engine, prompt) for key, (prompt, _, _) in SEQUENCES.items()}
    monkeypatch.setattr(ROLLBACK, "closed_form", True)
    got, _ = batched_greedy(engine.target.new_batch(), solo)
    assert got == solo


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_hybrid_row_cropped_to_before_its_block_reads_as_if_it_never_ran(targets, backend):
    """A crop may keep none of a row's block: its Gated DeltaNet states go back to those before it."""
    target = engine_for(targets("qwen3_5"), backend).target
    batch, fresh = target.new_batch(), target.new_batch()
    for rows in (batch, fresh):
        rows.join("a", [5, 6, 7])
        rows.join("b", [8, 9])
    batch.verify([[11, 12, 13], [14]])
    batch.crop([3, 3])  # a keeps none of its block, b its one token
    got = batch.verify([[21, 22], [23]])
    want = fresh.verify([[21, 22], [14, 23]])
    np.testing.assert_allclose(np.asarray(got[0].logits), np.asarray(want[0].logits), atol=1e-4)
    np.testing.assert_allclose(np.asarray(got[1].logits), np.asarray(want[1].logits[1:]), atol=1e-4)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_bad_calls_say_what_to_do(targets, backend):
    batch = engine_for(targets("qwen3"), backend).target.new_batch()
    batch.join("a", [5, 6, 7])
    with pytest.raises(ValueError, match="already in the batch"):
        batch.join("a", [5])
    foreign = CacheSnapshot(state=object(), length=3, nbytes=0, cuttable=True)  # no target of this backend took it
    with pytest.raises(ValueError, match="already in the batch"):
        batch.join_snapshot("a", foreign)
    assert batch.join_snapshot("b", foreign) is False and batch.keys == ["a"]  # nothing added
    with pytest.raises(ValueError, match="needs its anchor"):
        batch.verify([[]])
    with pytest.raises(RuntimeError, match="no block was verified"):
        batch.crop([3])
    batch.verify([[8, 9]])
    with pytest.raises(ValueError, match="outside its last block"):
        batch.crop([6])
    with pytest.raises(RuntimeError, match="crop the last verified block first"):
        batch.join("b", [5])


def test_layers_of_an_unknown_kind_are_refused_by_name():
    info = TargetInfo(path="x", model_type="falcon_h1", vocab_size=8, hidden_size=8, num_hidden_layers=2,
                      layer_types=("linear_attention", "mamba"))
    assert "mamba" in batch_problem(info) and "falcon_h1" in batch_problem(info)
    assert batch_problem(replace(info, layer_types=("linear_attention", "full_attention"))) is None


def test_a_verify_writes_into_the_caches_spare_room(targets):
    """The batch's attention layers append each forward's keys and values after the held ones in
    spare room (backends/torch/growing.py), not by concatenating the whole cache every cycle."""
    batch = engine_for(targets("qwen3")).target.new_batch()
    batch.join("a", list(range(5, 12)))
    batch.join("b", list(range(30, 33)))
    layer = batch.cache.layers[0]
    held = layer.keys.clone()
    batch.verify([[1, 2], [3]])
    storage = layer.keys.data_ptr()
    batch.crop([8, 4])
    batch.verify([[4], [5]])
    assert layer.keys.data_ptr() == storage  # the same buffer: nothing copied
    batch.crop([9, 5])
    assert layer.keys.shape[2] == 10 and torch.equal(layer.keys[:, :, :7], held)
