"""The published target families on MLX: plain and speculative greedy output equal transformers'
plain greedy on the same folder, token for token (float32), with prompts shorter and longer than
the sliding window (16), and with verify blocks rejected at position 0, partway and accepted whole.

Two drafters: a random DFlash draft (real drafting, almost every block rejected at position 0)
and an oracle drafter registered here that proposes transformers' own continuation with a wrong
token at position 0 or halfway in two cycles out of three, so every run rolls back at every
depth (the test checks that it did). Lossless output is asserted against transformers, so a
rollback that keeps a wrong state, or a model that ignores its config, fails.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import speculant
from speculant.core.interfaces import Drafter, DrafterFactory
from speculant.core.types import Capture, Draft, DrafterInfo, ProposalKind, TargetInfo
from speculant.plugins import hookimpl
from speculant.testing.tiny_families import FAMILIES, HYBRID

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

NEW = 64
WINDOW = 16
BLOCK = 8
PROMPTS = {"short": 8, "long": 40}  # tokens: under and over the sliding window


# -- the oracle drafter ----------------------------------------------------------------------------

class Oracle(Drafter):
    """Proposes ``reference`` (prompt + expected continuation) from the anchor on; cycle ``c`` is
    exact when ``c % 3 == 0``, wrong at position 0 when 1, wrong halfway when 2."""

    def __init__(self, info, backend) -> None:
        self.info, self.backend = info, backend
        self.reference: list[int] = []
        self.cycle = 0

    def prefill(self, prompt_ids, output, first_token_id) -> None:
        self.cycle = 0

    def propose(self, request) -> Draft:
        start = request.position + 1
        ids = (self.reference[start:start + request.num_tokens] + [0] * request.num_tokens)[:request.num_tokens]
        wrong = {0: None, 1: 0, 2: len(ids) // 2}[self.cycle % 3]
        if wrong is not None:
            ids[wrong] = (ids[wrong] + 1) % 300
        self.cycle += 1
        return Draft(token_ids=self.backend.int_array(ids), num_tokens=len(ids))

    def commit(self, output, num_rows, token_ids) -> None:
        pass


class OracleFactory(DrafterFactory):
    name = "oracle"
    backends = ("mlx",)

    def describe(self, config, target, backend):
        return DrafterInfo(kind=self.name, uses_target_embedding=False, uses_target_lm_head=False,
                           trained_block_size=BLOCK, max_block_size=BLOCK, backends=self.backends,
                           proposal_kinds=(ProposalKind.ONE_HOT,)), []

    def load(self, config, info, backend, target) -> Oracle:
        return Oracle(info, backend)


class OraclePlugin:
    @hookimpl
    def register_drafters(self, register):
        register(OracleFactory())


@pytest.fixture(scope="module")
def registry():
    from speculant.plugins.manager import Registry

    reg = Registry().load()
    reg.add_plugin(OraclePlugin(), "oracle (tests)")
    return reg


# -- checkpoints and references --------------------------------------------------------------------

def prompts(vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(1)
    return {name: [int(t) for t in rng.integers(5, min(vocab, 300), n)] for name, n in PROMPTS.items()}


def transformers_greedy(path, prompt_list: list[list[int]]) -> list[list[int]]:
    """transformers' plain greedy continuation (no EOS stop, none suppressed) of each prompt."""
    import torch
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = []
    for prompt in prompt_list:
        ids = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    embedding = model.get_input_embeddings()
    ids = torch.tensor(prompt_list[0])
    with torch.no_grad():  # the module's rows (Gemma's scale, Muse Glimmer's norm), and the table's
        embedded = {False: embedding(ids).float().numpy(), True: embedding.weight[ids].float().numpy()}
    return out, embedded


@pytest.fixture(scope="module")
def family(request, tmp_path_factory, torch_threads):
    """One family's checkpoint, a random DFlash draft for it and transformers' references."""
    from speculant.testing.tiny import build_tiny_dflash
    from speculant.testing.tiny_families import build_tiny_family

    name = request.param
    root = tmp_path_factory.mktemp(name)
    target = build_tiny_family(root / "target", name, sliding_window=WINDOW)
    draft = build_tiny_dflash(root / "draft", target, seed=7, block_size=BLOCK)
    ps = prompts(320)
    continuations, embedded = transformers_greedy(target, list(ps.values()))
    return {"name": name, "target": target, "draft": draft, "prompts": ps, "refs": dict(zip(ps, continuations)),
            "embedded": embedded}


def config(target, **drafter) -> dict:
    cfg = {"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if drafter:
        cfg["drafter"] = drafter
    return cfg


def watch_blocks(engine) -> list[tuple[int, int]]:
    """(verify width, positions kept) per forward of ``engine``'s target, filled as it runs."""
    target, seen = engine.target, []
    forward, crop = target.forward, target.crop

    def watched_forward(ids, *args, **kwargs):
        seen.append([int(ids.shape[0]), target.cache_length])
        return forward(ids, *args, **kwargs)

    def watched_crop(length):
        seen[-1][1] = length - seen[-1][1]
        return crop(length)

    target.forward, target.crop = watched_forward, watched_crop
    return seen


def kinds(blocks) -> set[str]:
    found = set()
    for width, kept in blocks:
        if width > 1:
            found.add("rejected at 0" if kept == 1 else "whole" if kept == width else "partway")
    return found


def run(engine, prompt) -> list[int]:
    return engine.run(prompt_ids=prompt, max_new_tokens=NEW, ignore_eos=True).token_ids


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def oracle_run(engine, fam) -> tuple[dict, set]:
    blocks = watch_blocks(engine)
    diffs, seen = {}, set()
    for name, prompt in fam["prompts"].items():
        engine.drafter.reference = prompt + fam["refs"][name]
        blocks.clear()
        diffs[name] = first_difference(run(engine, prompt), fam["refs"][name])
        seen |= kinds(blocks)
    return diffs, seen


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_family_greedy_equals_transformers(family, registry):
    engine = speculant.load_engine(config(family["target"], kind="oracle", block_size=BLOCK), registry)
    plain = engine.without_drafter()
    for name, prompt in family["prompts"].items():
        assert first_difference(run(plain, prompt), family["refs"][name]) is None, f"plain, {name} prompt"
    diffs, seen = oracle_run(engine, family)
    assert diffs == {name: None for name in PROMPTS}, "first differing token of the speculative output"
    assert seen == {"rejected at 0", "partway", "whole"}

    # what a drafter sharing the target's embedding and head sees: transformers' embedding rows,
    # and the logits the target itself gives for its final hidden state
    target, prompt = engine.target, family["prompts"]["short"]
    for raw in (False, True):  # MTP heads read the module's rows, DFlash drafts the table's
        embedded = np.array(target.embed(engine.backend.int_array(prompt), raw=raw))
        np.testing.assert_allclose(embedded, family["embedded"][raw], rtol=1e-5, atol=1e-6)
    target.reset()
    out = target.prefill(prompt, Capture(final_hidden="post_norm"))
    np.testing.assert_allclose(np.array(target.lm_head(out.final_hidden[-1:])), np.array(out.logits[-1:]),
                               rtol=1e-5, atol=1e-5)

    dflash = speculant.load_engine(config(family["target"], kind="dflash", path=str(family["draft"])))
    blocks = watch_blocks(dflash)
    assert first_difference(run(dflash, family["prompts"]["long"]), family["refs"]["long"]) is None
    assert "rejected at 0" in kinds(blocks)


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_family_with_transposed_weights_gives_the_same_tokens(family, registry, monkeypatch):
    """The CPU's weight layout (backends/mlx/layout.py) on every family, taken as paying here
    (whether it pays is timed at load): the same plain and speculative tokens as the layers as loaded."""
    from speculant.backends.mlx import layout

    monkeypatch.setattr(layout, "measured_speedup", lambda pairs: 2.0)
    transposed = speculant.load_engine({**config(family["target"], kind="oracle", block_size=BLOCK),
                                        "backend": {"kind": "mlx", "device": "cpu", "dtype": "float32",
                                                    "compile": "auto"}}, registry)
    assert transposed.target.transposed, transposed.target.fast_path
    assert "stored transposed" in transposed.target.fast_path
    assert first_difference(run(transposed.without_drafter(), family["prompts"]["long"]), family["refs"]["long"]) is None
    diffs, seen = oracle_run(transposed, family)
    assert diffs == {name: None for name in PROMPTS} and "partway" in seen


@pytest.mark.parametrize("family", ["qwen3_5"], indirect=True)
def test_keeping_the_blocks_recurrent_state_is_caught(family, registry, monkeypatch):
    """A rollback that restores the conv state but keeps the recurrent state after the whole block."""
    from speculant.backends.mlx.caches import DeltaCache

    def keeps_block_state(self, n):
        if n <= 0 or not self.recorded:
            self.forget()
            return 0
        kept, rows = self.recorded - n, self.conv_input.shape[1] - self.recorded
        self[0] = self.conv_input[:, kept:kept + rows, :]
        self[1] = self.states[-1]  # wrong: the state after the rejected positions too
        self.forget()
        return n

    monkeypatch.setattr(DeltaCache, "trim", keeps_block_state)
    engine = speculant.load_engine(config(family["target"], kind="oracle", block_size=BLOCK), registry)
    diffs, seen = oracle_run(engine, family)
    assert seen & {"rejected at 0", "partway"}  # it rolled back, and then decoded differently
    assert any(d is not None for d in diffs.values())


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_a_model_ignoring_the_window_is_refused(family, monkeypatch):
    """Without switching mlx-lm's Llama layers to the config's window, the load is refused."""
    from speculant.backends.mlx import families

    monkeypatch.setattr(families, "honour_window", lambda model, info: None)
    with pytest.raises(families.FamilyError, match=r"mistral.*layer_types says sliding_attention"):
        speculant.load_engine(config(family["target"]))


def info(model_type, layer_types, raw_type=None) -> TargetInfo:
    return TargetInfo(path=".", model_type=model_type, vocab_size=8, hidden_size=8,
                      num_hidden_layers=len(layer_types), layer_types=tuple(layer_types),
                      raw={"model_type": raw_type or model_type})


def test_rollback_problem_names_the_layer_type_and_family():
    from speculant.backends.mlx.backend import MLXBackend

    hybrid = ["linear_attention"] * 3 + ["full_attention"]
    assert MLXBackend.rollback_problem(info("qwen3_5_text", hybrid, "qwen3_5")) is None
    assert MLXBackend.rollback_problem(info("qwen3_next", hybrid)) is None
    assert MLXBackend.rollback_problem(info("gemma3_text", ["sliding_attention", "full_attention"])) is None
    message = MLXBackend.rollback_problem(info("qwen4_exp", ["linear_attention", "indexed_attention"]))
    assert "linear_attention" in message and "indexed_attention" in message and "'qwen4_exp'" in message
    assert "mlx backend cannot roll back" in message
    assert "kimi_linear" in MLXBackend.rollback_problem(info("kimi_linear", hybrid))


def test_hybrid_families_are_the_ones_recorded():
    from speculant.backends.mlx.families import DELTA_FAMILIES

    assert set(HYBRID) <= set(DELTA_FAMILIES)


def test_a_family_mlx_lm_lacks_is_refused_before_weights_load(tmp_path):
    from speculant.backends.mlx import families
    from speculant.core.validator import read_target_info

    cfg = {"model_type": "made_up", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")  # never read
    with pytest.raises(families.FamilyError, match="mlx-lm has no model for the 'made_up' family") as caught:
        families.load(tmp_path, read_target_info(tmp_path))
    assert caught.value.field == "target.path"
