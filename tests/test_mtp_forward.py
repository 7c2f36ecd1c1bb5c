"""The MTP forward against independent references: a float64 NumPy rendering of the formula
(mtp-and-verification.md §1.1) and transformers' own Qwen3-Next decoder layer; concat order,
norm conventions and recursion are checked through outputs, never mocks."""

from __future__ import annotations

import numpy as np
import pytest

from speculant.core.types import DraftRequest, SamplingParams
from speculant.testing.tiny_mtp import canonical_mtp, copy_target, mtp_tensors, target_config, write_mtp

torch = pytest.importorskip("torch")

PROMPT = [17, 4, 99, 250, 3, 61, 8]
FIRST = 42


@pytest.fixture(scope="module")
def base(tmp_path_factory, torch_threads):
    from speculant.testing.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("mtp_fwd") / "base", seed=5)


def make_engine(target, folder=None, compile="auto", **options):
    import speculant

    drafter = {"kind": "mtp", "options": options}
    if folder is not None:
        drafter["path"] = str(folder)
    return speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32", "compile": compile},
                                         "target": {"path": str(target)}, "drafter": drafter})


def write(base, tmp_path, canonical, layout, name, separate=False, shifted=False, updates=None):
    target = copy_target(base, tmp_path / f"{name}_target")
    first = target_config(target)["num_hidden_layers"]
    tensors = mtp_tensors(canonical, layout, first, shifted)
    folder = tmp_path / f"{name}_mtp" if separate else None
    write_mtp(target, tensors, layout, len(canonical["blocks"]), folder, shifted, updates)
    return target, folder


def draft_probs(engine, prompt=PROMPT, first=FIRST, k=3, seed=0):
    """Prefill target and drafter, then draft k tokens at temperature 1: q = softmax(logits)."""
    capture = engine.drafter.info.capture
    engine.target.reset()
    out = engine.target.prefill(prompt, capture)
    engine.drafter.prefill(prompt, out, first)
    request = DraftRequest(first, len(prompt), k, SamplingParams(temperature=1.0), np.random.default_rng(seed))
    draft = engine.drafter.propose(request)
    return draft, out


# -- an independent float64 reference ---------------------------------------------------------
class Reference:
    """The MTP formula in NumPy float64 from canonical weights (effective norm gains)."""

    def __init__(self, canonical, tcfg, weights, recycle="post_norm", gated=False, partial=1.0):
        self.c, self.t, self.recycle, self.gated = canonical, tcfg, recycle, gated
        self.emb = weights["model.embed_tokens.weight"].astype(np.float64)
        self.head = weights["lm_head.weight"].astype(np.float64)
        self.eps = tcfg.get("rms_norm_eps", 1e-6)
        hd = tcfg["head_dim"]
        dim = int(hd * partial)
        self.inv_freq = 1.0 / (10000.0 ** (np.arange(0, dim, 2) / dim))

    def norm(self, x, g):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + self.eps) * g

    def rope(self, x, pos):  # x [n, heads, hd]
        dim = 2 * len(self.inv_freq)
        ang = np.asarray(pos, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        r, rest = x[..., :dim], x[..., dim:]
        rot = np.concatenate([-r[..., dim // 2:], r[..., : dim // 2]], -1)
        return np.concatenate([r * cos + rot * sin, rest], -1)

    def block(self, b, x, pos):
        t = self.t
        nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        n = x.shape[0]
        W = {k: v.astype(np.float64) for k, v in b.items()}
        y = self.norm(x, W["input_layernorm"])
        q = y @ W["self_attn.q_proj"].T
        gate = None
        if self.gated:
            q = q.reshape(n, nh, 2 * hd)
            q, gate = q[..., :hd], q[..., hd:].reshape(n, nh * hd)
        q = self.norm(q.reshape(n, nh, hd), W["self_attn.q_norm"])
        k = self.norm((y @ W["self_attn.k_proj"].T).reshape(n, nkv, hd), W["self_attn.k_norm"])
        v = (y @ W["self_attn.v_proj"].T).reshape(n, nkv, hd)
        q, k = self.rope(q, pos), self.rope(k, pos)
        out = np.zeros((n, nh, hd))
        for h in range(nh):
            g = h // (nh // nkv)
            s = q[:, h] @ k[:, g].T / np.sqrt(hd)
            s = np.where(np.asarray(pos)[None, :] <= np.asarray(pos)[:, None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
        out = out.reshape(n, nh * hd)
        if gate is not None:
            out = out / (1.0 + np.exp(-gate)) * 1.0
        x = x + out @ W["self_attn.o_proj"].T
        y = self.norm(x, W["post_attention_layernorm"])
        silu = lambda z: z / (1.0 + np.exp(-z))  # noqa: E731
        return x + (silu(y @ W["mlp.gate_proj"].T) * (y @ W["mlp.up_proj"].T)) @ W["mlp.down_proj"].T

    def layer(self, j, hidden, tokens, pos):
        head = self.c["heads"][j % len(self.c["heads"])]
        H = {k: v.astype(np.float64) for k, v in head.items()}
        x = np.concatenate([self.norm(self.emb[tokens], H["enorm"]), self.norm(hidden, H["hnorm"])], -1) @ H["proj"].T
        pre = self.block(self.c["blocks"][j], x, pos)
        post = self.norm(pre, H["norm"])
        return pre, post, (pre if self.recycle == "pre_norm" else post)

    def drafts(self, target_hidden, prompt, first, drafted):
        """Logits of every draft step after prefilling (h_i, x_{i+1}) pairs, recomputing every layer
        over all its entries (teacher-forced chain for layers > 0)."""
        n = len(self.c["blocks"])
        tokens = list(prompt[1:]) + [first]
        b = len(prompt) - 1
        entries = [[] for _ in range(n)]  # per layer: (hidden row, token, position)
        below = {p: target_hidden[p] for p in range(b + 1)}
        for j in range(n):
            entries[j] = [(below[q - 1] if j else below[q], tokens[q], q) for q in range(j, b + 1)]
            hid, tok, pos = map(list, zip(*entries[j])) if entries[j] else ([], [], [])
            if not entries[j]:
                break
            pre, post, rec = self.layer(j, np.stack(hid), tok, pos)
            below = {p: rec[i] for i, p in enumerate(pos)}
            if j == 0:
                last_post, last_rec = post[-1], rec[-1]
        logits = [last_post @ self.head.T]
        h = last_rec
        for k in range(1, len(drafted)):
            j = k % n
            entries[j].append((h, drafted[k - 1], b + k))  # speculative entries stay for later steps
            hid, tok, pos = map(list, zip(*entries[j]))
            _, post, rec = self.layer(j, np.stack(hid), tok, pos)
            logits.append(post[-1] @ self.head.T)
            h = rec[-1]
        return np.stack(logits)


def softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def target_weights(target):
    from safetensors.numpy import load_file

    return load_file(str(target / "model.safetensors"))


@pytest.mark.parametrize("layout,layers,recycle", [
    ("qwen", 1, None), ("qwen", 2, None), ("deepseek", 1, None), ("deepseek", 2, None),
    ("deepseek", 2, "post_norm"), ("qwen", 2, "pre_norm"),
])
def test_forward_equals_float64_reference(base, tmp_path, layout, layers, recycle):
    heads = 1 if layout == "qwen" else layers
    canonical = canonical_mtp(base, layers, seed=11, num_heads=heads)
    target, folder = write(base, tmp_path, canonical, layout, "ref")
    options = {"recycle_hidden": recycle} if recycle else {}
    engine = make_engine(target, folder, sample_drafts=True, **options)
    draft, out = draft_probs(engine, k=4)
    tap = engine.drafter.cfg.recycle_hidden
    ref = Reference(canonical, target_config(target), target_weights(target), recycle=tap)
    drafted = [int(t) for t in draft.token_ids.tolist()]
    expected = softmax(ref.drafts(out.final_hidden.double().numpy(), PROMPT, FIRST, drafted))
    np.testing.assert_allclose(draft.draft_probs.numpy(), expected, atol=1e-5, rtol=0)


def test_gated_partial_rotary_attention_equals_reference(base, tmp_path):
    canonical = canonical_mtp(base, 1, seed=12, gated=True)
    target, folder = write(base, tmp_path, canonical, "qwen", "gated", separate=True,
                           updates={"attn_output_gate": True, "partial_rotary_factor": 0.25})
    engine = make_engine(target, folder, sample_drafts=True)
    assert engine.drafter.cfg.attn_output_gate and engine.drafter.cfg.partial_rotary_factor == 0.25
    draft, out = draft_probs(engine, k=3)
    ref = Reference(canonical, target_config(target), target_weights(target), gated=True, partial=0.25)
    drafted = [int(t) for t in draft.token_ids.tolist()]
    expected = softmax(ref.drafts(out.final_hidden.double().numpy(), PROMPT, FIRST, drafted))
    np.testing.assert_allclose(draft.draft_probs.numpy(), expected, atol=1e-5, rtol=0)


def test_block_equals_transformers_qwen3_next_layer(base, tmp_path):
    """Our gated (1 + w) block against transformers' Qwen3NextDecoderLayer on the same raw weights."""
    from safetensors.numpy import load_file
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRotaryEmbedding

    from speculant.drafters.mtp.torch import LayerCache, rope_tables

    canonical = canonical_mtp(base, 1, seed=13, gated=True)
    target, folder = write(base, tmp_path, canonical, "qwen", "hf", separate=True,
                           updates={"attn_output_gate": True, "partial_rotary_factor": 0.25})
    engine = make_engine(target, folder)
    model = engine.drafter.net.model
    t = target_config(target)
    hf_cfg = Qwen3NextConfig(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_attention_heads=t["num_attention_heads"],
                             num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"], num_hidden_layers=1,
                             layer_types=["full_attention"], num_experts=0, rms_norm_eps=t["rms_norm_eps"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    hf_cfg._attn_implementation = "eager"
    layer = Qwen3NextDecoderLayer(hf_cfg, 0).float().eval()
    stored = load_file(str(folder / "model.safetensors"))
    state = {k[len("mtp.layers.0."):]: torch.from_numpy(v) for k, v in stored.items() if k.startswith("mtp.layers.0.")}
    layer.load_state_dict(state, strict=True)
    x = torch.randn(6, t["hidden_size"], generator=torch.Generator().manual_seed(0))
    pos = torch.arange(3, 9)
    mask = torch.full((6, 6), -torch.inf).triu(1)[None, None]
    with torch.no_grad():
        cos, sin = Qwen3NextRotaryEmbedding(hf_cfg)(x[None], pos[None])
        expected = layer(x[None], (cos, sin), attention_mask=mask, position_ids=pos[None])[0]
        ours = model.blocks[0](x, *rope_tables(model.inv_freq, pos, x.dtype), pos, LayerCache())
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


# -- concat order ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["qwen", "deepseek"])
def test_concat_order_embedding_half_first(base, tmp_path, layout):
    H = target_config(base)["hidden_size"]
    canonical = canonical_mtp(base, 1, seed=14)
    eye, zero = np.eye(H, dtype=np.float32), np.zeros((H, H), dtype=np.float32)
    runs = {}
    for name, proj in (("embedding", np.concatenate([eye, zero], 1)), ("hidden", np.concatenate([zero, eye], 1))):
        canonical["heads"][0]["proj"] = proj
        target, _ = write(base, tmp_path, canonical, layout, f"concat_{name}")
        net = make_engine(target).drafter.net
        g = torch.Generator().manual_seed(1)
        h1, h2 = torch.randn(1, H, generator=g), torch.randn(1, H, generator=g)
        outs = {}
        for label, hidden, token in (("a", h1, 7), ("b", h2, 7), ("c", h1, 9)):
            net.reset()
            outs[label] = net.run(0, hidden, torch.tensor([token]), [0])[1]
        runs[name] = outs
    e, h = runs["embedding"], runs["hidden"]
    torch.testing.assert_close(e["a"], e["b"], rtol=0, atol=0)  # hidden changed: no effect
    assert not torch.allclose(e["a"], e["c"], atol=1e-3)  # token changed: output changes
    torch.testing.assert_close(h["a"], h["c"], rtol=0, atol=0)
    assert not torch.allclose(h["a"], h["b"], atol=1e-3)


# -- norm conventions ----------------------------------------------------------------------------
def test_same_weights_in_every_layout_give_the_same_drafter(base, tmp_path):
    """Raw Qwen (x̂·(1+w), stored g-1), MLX pre-shifted Qwen (stored g) and DeepSeek (x̂·w,
    stored g) hold the same effective weights, so they must draft identically."""
    canonical = canonical_mtp(base, 1, seed=15)
    probs = {}
    for name, layout, separate, shifted in (("raw", "qwen", False, False), ("shifted", "qwen", True, True),
                                            ("deepseek", "deepseek", False, False)):
        target, folder = write(base, tmp_path, canonical, layout, name, separate, shifted)
        # the same recycle tap everywhere (the family defaults differ)
        probs[name] = draft_probs(make_engine(target, folder, sample_drafts=True, recycle_hidden="post_norm"))[0].draft_probs
    torch.testing.assert_close(probs["raw"], probs["deepseek"], atol=1e-6, rtol=0)
    torch.testing.assert_close(probs["shifted"], probs["deepseek"], atol=1e-6, rtol=0)
    # declaring the shifted folder raw shifts a second time, and the drafter changes
    target, folder = write(base, tmp_path, canonical, "qwen", "shifted", True, True)
    twice = draft_probs(make_engine(target, folder, sample_drafts=True, norm_shifted=False, recycle_hidden="post_norm"))[0].draft_probs
    assert (twice - probs["deepseek"]).abs().max() > 1e-3


def test_zero_norm_weights(base, tmp_path):
    """All stored norm weights 0: the Qwen (1 + w) norm is plain x̂, the DeepSeek one outputs zeros."""
    canonical = canonical_mtp(base, 1, seed=16)
    ones = canonical_mtp(base, 1, seed=16, norm_jitter=0.0)  # every gain exactly 1
    zero_q = mtp_tensors(ones, "qwen")
    assert all(not v.any() for k, v in zero_q.items() if k.endswith("norm.weight") or "norm_" in k)
    logits = {}
    for name, tensors, layout in (("qwen_zero", zero_q, "qwen"),
                                  ("deepseek_one", mtp_tensors(ones, "deepseek", 4), "deepseek"),
                                  ("deepseek_zero", {k: (v * 0 if "norm" in k else v) for k, v in mtp_tensors(canonical, "deepseek", 4).items()}, "deepseek")):
        target = copy_target(base, tmp_path / name)
        write_mtp(target, tensors, layout, 1)
        engine = make_engine(target, compile="off")  # exact: the fast path picks kernels by timing them
        draft_probs(engine, k=1)
        logits[name] = engine.drafter.net.logits(engine.drafter._head)
    torch.testing.assert_close(logits["qwen_zero"], logits["deepseek_one"], atol=1e-6, rtol=0)
    assert not logits["deepseek_zero"].any()


# -- recursion -----------------------------------------------------------------------------------
def test_recursion_reuses_layers_and_recycles_the_configured_hidden(base, tmp_path):
    """With 2 distinct layers, K = 4 runs layers 0, 1, 0, 1 (checked by the reference above); here:
    the recycle tap and the step-1 tap are observable in the drafts."""
    canonical = canonical_mtp(base, 2, seed=17, num_heads=2)
    target, _ = write(base, tmp_path, canonical, "deepseek", "recycle")
    # compile off: the fast path picks its kernels by timing them, and under load two engines may
    # pick differently, which moves the last bit (a failure seen once in a full parallel run)
    pre = draft_probs(make_engine(target, compile="off", sample_drafts=True, recycle_hidden="pre_norm"), k=3)[0].draft_probs
    post = draft_probs(make_engine(target, compile="off", sample_drafts=True, recycle_hidden="post_norm"), k=3)[0].draft_probs
    torch.testing.assert_close(pre[0], post[0], atol=0, rtol=0)  # step 1 uses the target hidden only
    assert (pre[1:] - post[1:]).abs().max() > 1e-4
    # the tap is observable only if the target's final norm is more than a scale (tiny targets init it to ones)
    from safetensors.numpy import load_file, save_file

    state = load_file(str(target / "model.safetensors"))
    state["model.norm.weight"] = (1.0 + 0.5 * np.random.default_rng(0).standard_normal(state["model.norm.weight"].shape)).astype(np.float32)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    tap_pre, out_pre = draft_probs(make_engine(target, sample_drafts=True, hidden_tap="pre_norm"), k=1)
    tap_post, out_post = draft_probs(make_engine(target, sample_drafts=True, hidden_tap="post_norm"), k=1)
    assert (out_pre.final_hidden - out_post.final_hidden).abs().max() > 1e-3
    assert (tap_pre.draft_probs - tap_post.draft_probs).abs().max() > 1e-3
