"""The DFlash2 network on PyTorch: the grouped dynamic convolution, and identity
initialisation reducing DFlash2 to DFlash v1 with the same shared weights."""

from __future__ import annotations

import pytest

import speculant

torch = pytest.importorskip("torch")


def conv(hidden=32, kernel=2, group=8, seed=0, identity=False):
    from speculant.drafters.dflash2.torch import GroupedDynamicConv

    torch.manual_seed(seed)
    module = GroupedDynamicConv(hidden, kernel, group)
    with torch.no_grad():
        if identity:
            module.kernel_projection.weight.zero_()
        else:
            module.base_kernel.normal_()
            module.kernel_projection.weight.normal_()
    return module


def reference_conv(module, x, side, dynamic_source):
    """y[t, c] = sum_j (base[side, j, c] + delta_t[side, j, c // group]) * x[t - j, c], zeros before row 0."""
    n, H = x.shape
    K, group = module.kernel_size, module.group_size
    delta = (dynamic_source.double() @ module.kernel_projection.weight.double().T).view(n, 2, K, H // group)
    base = module.base_kernel.double()
    y = torch.zeros(n, H, dtype=torch.float64)
    for t in range(n):
        for j in range(K):
            if t - j < 0:
                continue
            coeff = base[side, j] + delta[t, side, j].repeat_interleave(group)
            y[t] += coeff * x[t - j].double()
    return y


@torch.no_grad()
def test_convolution_matches_the_formula_on_both_sides():
    module = conv(kernel=3)
    x, y_in = torch.randn(5, 32), torch.randn(5, 32)
    prepared, taps = module.prepare(x)
    torch.testing.assert_close(prepared.double(), reference_conv(module, x, 0, x), rtol=1e-5, atol=1e-5)
    finished = module.finish(y_in, taps)
    # side 1 convolves the sublayer output with corrections predicted from the sublayer input
    torch.testing.assert_close(finished.double(), reference_conv(module, y_in, 1, x), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_identity_initialisation_passes_rows_through():
    module = conv(identity=True)
    x = torch.randn(6, 32)
    prepared, taps = module.prepare(x)
    assert torch.equal(prepared, x)
    assert torch.equal(module.finish(x * 3, taps), x * 3)


@torch.no_grad()
def test_anchor_row_reads_zeros_and_row_one_reads_the_anchor():
    module = conv()
    x = torch.randn(4, 32)
    out, _ = module.prepare(x)
    later = x.clone()
    later[1:] += 10.0
    assert torch.equal(module.prepare(later)[0][0], out[0])  # row 0 sees no other row
    alone, _ = module.prepare(x[:1])
    torch.testing.assert_close(alone[0], out[0], rtol=1e-6, atol=1e-6)  # nothing before the anchor: zeros
    anchor = x.clone()
    anchor[0] += 1.0
    changed = module.prepare(anchor)[0]
    assert not torch.allclose(changed[1], out[1])  # tap 1 of row 1 is the anchor
    assert torch.equal(changed[2:], out[2:])  # two taps: row 2 reads rows 1 and 2 only


@pytest.fixture(scope="module")
def identity_pair(tmp_path_factory, torch_threads):
    from speculant.testing.tiny import build_tiny_dflash
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2, build_tiny_dflash2_pair

    root = tmp_path_factory.mktemp("dflash2_identity")
    target, _ = build_tiny_dflash2_pair(root, sliding_window=8)
    kwargs = dict(seed=7, block_size=8, sliding_window=8)
    return {
        "target": target,
        "dflash": build_tiny_dflash(root / "v1", target, extra_config={"is_causal": False}, **kwargs),
        "identity": build_tiny_dflash2(root / "identity", target, identity=True, **kwargs),
        "trained": build_tiny_dflash2(root / "trained", target, **kwargs),
    }


def engine(pair, name):
    kind = "dflash" if name == "dflash" else "dflash2"
    return speculant.load_engine({
        # compile off: 'auto' picks weight layouts by timing, which a loaded machine can flip
        # between two loads, and the tensor-by-tensor comparison below would see two layouts
        "backend": {"kind": "torch", "device": "cpu", "dtype": "float32", "compile": "off"},
        "target": {"path": str(pair["target"])},
        "drafter": {"kind": kind, "path": str(pair[name])},
    })


def first_round_hidden(eng, prompt, k=7):
    from speculant.core.types import DraftRequest

    capture = eng.drafter.info.capture
    eng.target.reset()
    out = eng.target.prefill(prompt, capture)
    first = int(out.logits[-1].argmax())
    eng.drafter.prefill(prompt, out, first)
    return eng.drafter.hidden(DraftRequest(first, len(prompt), k))


@pytest.mark.parametrize("prompt", [[5], list(range(20, 52))], ids=["one_token", "longer_than_window"])
def test_identity_dflash2_equals_dflash(identity_pair, prompt):
    v1, identity, trained = (engine(identity_pair, n) for n in ("dflash", "identity", "trained"))
    h1 = first_round_hidden(v1, prompt)
    assert torch.equal(first_round_hidden(identity, prompt), h1)
    assert not torch.allclose(first_round_hidden(trained, prompt), h1)  # the convolutions do act
    a = v1.run(prompt_ids=prompt, max_new_tokens=30, ignore_eos=True)
    b = identity.run(prompt_ids=prompt, max_new_tokens=30, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.stats.acceptance_lengths == b.stats.acceptance_lengths  # same proposals every round


def test_identity_shares_every_v1_tensor(identity_pair):
    v1, identity = engine(identity_pair, "dflash"), engine(identity_pair, "identity")
    own = identity.drafter.model.state_dict()
    for name, tensor in v1.drafter.model.state_dict().items():
        assert torch.equal(own[name], tensor), name
