"""The DFlash drafting lifecycle is written once (speculant.drafters.dflash.drafter) over a
per-backend network: PyTorch and MLX drafters on the same weights propose the same whole
blocks, cycle after cycle of real runs with rejections, and leave the same context cache behind;
skipping context rows no layer can see (every layer slides) changes no proposal."""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.drafters.dflash.drafter import DFlashDrafter

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

PROMPT = [5, 6, 7]  # drafts with rejections and whole acceptances on the planted pair


def engine(kind, pair, draft):
    """A PyTorch engine (eager on a CPU under auto), an MLX one with the eager draft step whose
    context cache the tests read, or (``mlx compiled``) the MLX draft step compiled."""
    compile = "auto" if kind == "mlx compiled" else "off" if kind == "mlx" else "auto"
    kind = kind.split()[0]
    return speculant.load_engine({"backend": {"kind": kind, "device": "cpu", "dtype": "float32", "compile": compile},
                                  "target": {"path": str(pair["target"])},
                                  "drafter": {"kind": "dflash", "path": str(pair[draft])}})


@pytest.fixture(scope="module")
def engines(planted_pair):
    return {(kind, draft): engine(kind, planted_pair, draft)
            for kind in ("torch", "mlx", "mlx compiled") for draft in ("draft", "draft_swa")}


def recording(eng, **kwargs):
    """Run, keeping every proposal (all of its tokens) and the draft hidden rows behind it (which,
    unlike this planted draft's tokens, depend on every context row the draft attends to)."""
    proposals, hidden = [], []
    drafter, ops = eng.drafter, eng.backend.ops
    propose, take_hidden = drafter.propose, drafter.hidden

    def record(request):
        draft = propose(request)
        proposals.append(ops.to_list(draft.token_ids))
        return draft

    def record_hidden(request, *anchor):
        rows = take_hidden(request, *anchor)
        hidden.append(ops.to_numpy(ops.float32(rows)))
        return rows

    drafter.propose, drafter.hidden = record, record_hidden
    try:
        return eng.run(**kwargs), proposals, hidden
    finally:
        del drafter.propose, drafter.hidden


@pytest.mark.parametrize("draft", ["draft", "draft_swa"])
def test_torch_and_mlx_propose_the_same_blocks_and_keep_the_same_context(engines, draft):
    kwargs = dict(prompt_ids=PROMPT, max_new_tokens=48, block_size=16, ignore_eos=True)
    on_torch, torch_props, torch_hidden = recording(engines["torch", draft], **kwargs)
    on_mlx, mlx_props, mlx_hidden = recording(engines["mlx", draft], **kwargs)
    committed = on_torch.stats.acceptance_lengths  # accepted drafts + the target's own token
    assert any(n <= len(p) for n, p in zip(committed, torch_props))  # a rejection, with rows drafted past it
    assert max(committed) > 8  # a commit of more rows than a sliding layer keeps
    assert mlx_props == torch_props
    assert len(mlx_hidden) == len(torch_hidden)
    for m_rows, t_rows in zip(mlx_hidden, torch_hidden):
        np.testing.assert_allclose(m_rows, t_rows, rtol=1e-4, atol=1e-4)
    assert on_mlx.token_ids == on_torch.token_ids
    t, m = engines["torch", draft].drafter, engines["mlx", draft].drafter
    assert type(t) is type(m) is DFlashDrafter
    assert (t.context_length, t.max_context) == (m.context_length, m.max_context)
    layers = range(len(t.net.windows))
    assert [t.net.cache.starts[i] for i in layers] == [m.net.cache.starts[i] for i in layers]
    assert [t.net.cache.length(i) for i in layers] == [m.net.cache.length(i) for i in layers]
    compiled = engines["mlx compiled", draft]
    assert compiled.drafter.net.compiled is not None
    on_compiled, compiled_props, compiled_hidden = recording(compiled, **kwargs)
    assert compiled_props == torch_props and on_compiled.token_ids == on_torch.token_ids
    for c_rows, t_rows in zip(compiled_hidden, torch_hidden, strict=True):
        np.testing.assert_allclose(c_rows, t_rows, rtol=1e-4, atol=1e-4)


def test_skipping_rows_no_layer_sees_changes_no_proposal(engines, planted_pair):
    """Every layer of draft_swa slides (window 8): only the last 7 context rows are projected;
    commits of more rows than that skip some, and the cache keeps the right positions."""
    trimmed = engines["torch", "draft_swa"]
    assert trimmed.drafter.max_context == 7
    everything = engine("torch", planted_pair, "draft_swa")
    everything.drafter.max_context = None  # project every row, as if some layer attended globally
    kwargs = dict(prompt_ids=PROMPT, max_new_tokens=48, block_size=16, ignore_eos=True)
    result, props, hidden = recording(trimmed, **kwargs)
    assert max(result.stats.acceptance_lengths) > 7  # some commit skips rows
    _, all_props, all_hidden = recording(everything, **kwargs)
    assert all_props == props
    for rows, all_rows in zip(hidden, all_hidden, strict=True):
        np.testing.assert_allclose(rows, all_rows, rtol=1e-5, atol=1e-5)
