"""DFlash and DFlash2 drafts on hybrid (Gated DeltaNet 3 : 1) and sliding-window targets.

Tiny targets of the families the published drafts pair with (``build_tiny_family``: Qwen3.5 as
its composite checkpoint, Qwen3-Next, Gemma 3, gpt-oss; sliding window 16, so 64 new tokens cross
it), a planted bias shared through the embedding and LM head (both drafts accept some blocks and
reject others), and DFlash / DFlash2 drafts shaped from the target's ``text_config``:

- greedy speculative output equals plain greedy output over 64 new tokens, PyTorch and MLX, and
  plain MLX equals plain PyTorch;
- the features a drafter receives (prefill and every commit, through rollbacks) equal the
  target's hidden states at ``target_layer_ids`` as transformers computes them with
  ``output_hidden_states=True``, and differ from a neighbouring layer's (so a wrong tap fails);
- ``target.embed`` gives the drafters the rows the target's first layer reads (Gemma scales its
  embedding by sqrt(hidden_size)), on both backends.
"""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.api import validate
from speculant.testing.tiny import build_tiny_dflash, plant_checkpoint
from speculant.testing.tiny_dflash2 import build_tiny_dflash2
from speculant.testing.tiny_families import build_tiny_family

torch = pytest.importorskip("torch")

# planted strength per family: a mix of accepted and rejected drafts at 64 tokens
FAMILIES = {"qwen3_5": 1.0, "qwen3_next": 1.0, "gemma3_text": 0.3, "gpt_oss": 1.0}
KINDS = ("dflash", "dflash2")
LAYER_IDS = [0, 2]
BLOCK = 8  # both drafts' trained block, on both backends (DFlash2's MLX default would be 5)
PROMPT = [5, 6, 7, 8, 9]
NEW_TOKENS = 64


def config(backend, target, kind=None, draft=None):
    out = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if kind is not None:
        out["drafter"] = {"kind": kind, "path": str(draft)}
    return out


def engine(backend, target, kind=None, draft=None):
    return speculant.load_engine(config(backend, target, kind, draft))


def declare_embedding_scale(draft, target) -> None:
    """A Gemma draft sees its block's embedding rows at Gemma's sqrt(hidden_size) scale only if its
    config says so (DFlash drafts take the table's bare rows times ``input_embedding_scale``)."""
    import json

    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    config = json.loads((draft / "config.json").read_text())
    config["dflash_config"]["input_embedding_scale"] = hidden ** 0.5
    (draft / "config.json").write_text(json.dumps(config, indent=2))


class Families:
    """Planted targets with a DFlash and a DFlash2 draft each, built on first use; plain greedy
    tokens per (backend, family) computed once."""

    def __init__(self, root) -> None:
        self.root, self.built, self.plain, self.spec = root, {}, {}, {}

    def __getitem__(self, family):
        if family not in self.built:
            folder = self.root / family
            target = build_tiny_family(folder / "target", family)
            plant_checkpoint(target, strength=FAMILIES[family])
            self.built[family] = {
                "target": target,
                "dflash": build_tiny_dflash(folder / "dflash", target, seed=7, target_layer_ids=LAYER_IDS),
                # convolutions near the identity, so DFlash2 also gets drafts accepted on every family
                "dflash2": build_tiny_dflash2(folder / "dflash2", target, seed=7, target_layer_ids=LAYER_IDS, conv_scale=0.1),
            }
            if family.startswith("gemma"):
                for kind in KINDS:
                    declare_embedding_scale(self.built[family][kind], target)
        return self.built[family]

    def speculative(self, backend, family, kind):
        if (backend, family, kind) not in self.spec:
            pair = self[family]
            report = validate(config(backend, pair["target"], kind, pair[kind]))
            assert report.ok, [str(p) for p in report.errors]
            self.spec[backend, family, kind] = engine(backend, pair["target"], kind, pair[kind]).run(
                prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, block_size=BLOCK)
        return self.spec[backend, family, kind]

    def plain_tokens(self, backend, family):
        if (backend, family) not in self.plain:
            result = engine(backend, self[family]["target"]).run(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            self.plain[backend, family] = result.token_ids
        return self.plain[backend, family]


@pytest.fixture(scope="module")
def families(tmp_path_factory, torch_threads):
    return Families(tmp_path_factory.mktemp("drafter_families"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_plain_on_torch(families, family, kind):
    result = families.speculative("torch", family, kind)
    assert result.token_ids == families.plain_tokens("torch", family)
    lengths = result.stats.acceptance_lengths
    assert min(lengths) == 1 and max(lengths) > 1, lengths  # rejected drafts (rollbacks) and accepted ones


@pytest.mark.mlx
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_plain_on_mlx(families, family, kind):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    plain = families.plain_tokens("mlx", family)
    assert plain == families.plain_tokens("torch", family)
    result = families.speculative("mlx", family, kind)
    assert result.token_ids == plain
    assert min(result.stats.acceptance_lengths) == 1, result.stats.acceptance_lengths
    # the drafts themselves agree across backends, cycle for cycle
    assert result.stats.acceptance_lengths == families.speculative("torch", family, kind).stats.acceptance_lengths


# -- what the drafter reads from the target ---------------------------------------------------------
def record_features(drafter):
    """Wrap the drafter's prefill/commit to keep the feature rows it is given (committed rows only)."""
    rows = []
    prefill, commit = drafter.prefill, drafter.commit

    def recording_prefill(prompt_ids, output, first_token_id):
        rows.append(output.features.clone())
        return prefill(prompt_ids, output, first_token_id)

    def recording_commit(output, num_rows, token_ids):
        rows.append(output.features[:num_rows].clone())
        return commit(output, num_rows, token_ids)

    drafter.prefill, drafter.commit = recording_prefill, recording_commit
    return rows


def transformers_hidden_states(target, token_ids):
    """Every hidden state of the checkpoint's published class over ``token_ids``
    (index 0: embeddings, index i + 1: output of decoder layer i)."""
    import json

    import transformers

    arch = json.loads((target / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_features_are_the_target_hidden_states_at_the_tapped_layers(families, family):
    pair = families[family]
    spec = engine("torch", pair["target"], "dflash", pair["dflash"])
    rows = record_features(spec.drafter)
    result = spec.run(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert min(result.stats.acceptance_lengths) == 1 and max(result.stats.acceptance_lengths) > 1
    features = torch.cat(rows)
    committed = (PROMPT + result.token_ids)[: features.shape[0]]
    assert features.shape[0] >= len(PROMPT) + NEW_TOKENS - 8  # every cycle's committed rows
    hidden = transformers_hidden_states(pair["target"], committed)
    H = hidden[0].shape[-1]
    for slot, layer in enumerate(LAYER_IDS):
        torch.testing.assert_close(features[:, slot * H:(slot + 1) * H], hidden[layer + 1][0], atol=1e-4, rtol=1e-4)
        wrong = hidden[layer + 2][0]  # the next layer's output: a tap one layer off
        assert (features[:, slot * H:(slot + 1) * H] - wrong).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5"])
def test_embed_gives_the_rows_the_first_layer_reads(families, family, backend):
    """MTP heads embed their tokens with ``target.embed``; for Gemma that includes the
    sqrt(hidden_size) scale transformers' scaled embedding applies. (DFlash drafts take the bare
    rows, ``raw=True``: tests/test_dflash_embedding_reference.py.)"""
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        pytest.importorskip("mlx_lm")
    pair = families[family]
    target = engine(backend, pair["target"]).target
    rows = target.embed(target.backend.int_array(PROMPT))
    rows = rows.numpy() if backend == "torch" else np.array(rows)
    expected = transformers_hidden_states(pair["target"], PROMPT)[0][0].numpy()
    np.testing.assert_allclose(rows, expected, atol=1e-4, rtol=1e-4)


# -- the drafts' own logit transform ---------------------------------------------------------------
CAP, MULTIPLIER = 2.0, 0.5


@pytest.fixture(scope="module")
def softcapped(tmp_path_factory, torch_threads):
    """A Muse Glimmer target (its forward multiplies and soft-caps its logits, on both backends)
    and DFlash / DFlash2 drafts whose configs carry their own multiplier and soft-cap, as the
    published DFlash2 for Muse Glimmer does."""
    import json

    root = tmp_path_factory.mktemp("softcapped")
    out = {"target": build_tiny_family(root / "target", "muse_glimmer")}
    out["dflash"] = build_tiny_dflash(root / "dflash", out["target"], seed=7, target_layer_ids=LAYER_IDS)
    out["dflash2"] = build_tiny_dflash2(root / "dflash2", out["target"], seed=7, target_layer_ids=LAYER_IDS)
    for kind in KINDS:
        draft = json.loads((out[kind] / "config.json").read_text())
        draft["dflash_config"].update(final_logit_softcapping=CAP, output_multiplier=MULTIPLIER)
        (out[kind] / "config.json").write_text(json.dumps(draft))
    return out


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
@pytest.mark.parametrize("kind", KINDS)
def test_drafts_transform_the_bare_head_once(softcapped, kind, backend):
    """Published drafts compute ``cap * tanh(head(h) * output_multiplier / cap)`` from the target's
    bare output projection (as the trainer does); the target's own transform, which
    ``target.lm_head`` includes, must not come first."""
    from safetensors.numpy import load_file

    if backend == "mlx":
        mx = pytest.importorskip("mlx.core")
    spec = engine(backend, softcapped["target"], kind, softcapped[kind])
    head = load_file(str(softcapped["target"] / "model.safetensors"))["lm_head.weight"]
    hidden = np.random.default_rng(0).standard_normal((3, head.shape[1])).astype(np.float32) * 4
    expected = CAP * np.tanh(hidden @ head.T * MULTIPLIER / CAP)
    rows = torch.from_numpy(hidden) if backend == "torch" else mx.array(hidden)
    got = spec.drafter.logits(rows)
    got = got.numpy() if backend == "torch" else np.array(got)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
