"""The published target families on PyTorch: loading, and exact rollback after rejected blocks.

Each family's tiny random checkpoint (``speculant.testing.tiny_families``) decodes speculatively
through ``Engine.from_config`` and must give transformers' own plain greedy output (``generate`` on
the model loaded directly) token for token, with prompts shorter and longer than the sliding
window (16). Two drafts: the planted drafter proposes the target's continuation with a mistake at a
chosen block position each cycle (rejections at position 0, partway, and whole blocks accepted on
any target), and a random DFlash draft (mostly rejected at position 0). Every cycle's block width
and rolled-back rows are recorded, so a test cannot pass without rolling back. Keeping the Gated
DeltaNet state after the whole block (``ROLLBACK.keep_whole_block``) must break greedy equality
and the sampling law.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from speculant.backends.torch import rollback  # noqa: E402
from speculant.backends.torch.backend import TorchBackend  # noqa: E402
from speculant.core.config import BackendConfig  # noqa: E402
from speculant.api import load_engine
from speculant.core.types import Capture  # noqa: E402
from speculant.core.validator import read_target_info  # noqa: E402
from speculant.testing.planted_drafter import registry_with_planted  # noqa: E402
from speculant.testing.tiny_families import FAMILIES, HYBRID, build_tiny_family  # noqa: E402

NEW = 64
WINDOW = 16
PROMPTS = {"short": list(range(5, 15)), "long": list(range(20, 60))}  # 10 and 40 tokens
MISTAKES = [0, 3, -1, 1, 5, -1, 2]  # spoiled block position per cycle; -1: the whole block is right
BACKEND = {"kind": "torch", "device": "cpu", "dtype": "float32"}
# the compiled tests check what speculant puts in the graphs (static cache, recorded states, rollback)
# for every family; inductor's code for them is the subject of test_fast_path_torch.py and, for the
# Gated DeltaNet recording, of the hybrid's plain decoding test below
pytestmark = pytest.mark.compiler("aot_eager")


@pytest.fixture(scope="module")
def family(tmp_path_factory, torch_threads):
    """``family(name)``: the tiny checkpoint folder, built once per module."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny_family(root / name, name)
        return built[name]

    return get


@pytest.fixture(scope="module")
def reference(family):
    """``reference(name)``: {prompt name: transformers' plain greedy continuation}."""
    done = {}

    def get(name: str) -> dict[str, list[int]]:
        if name not in done:
            model = direct_model(family(name))
            model.generation_config.eos_token_id = None  # ignore_eos, without suppressing EOS as min_new_tokens would
            done[name] = {key: greedy(model, ids) for key, ids in PROMPTS.items()}
        return done[name]

    return get


@pytest.fixture(scope="module")
def compiled_engine(family, reference):
    """``compiled_engine(name)``: a planted engine on the compiled path (``backend.compile: on``),
    block 6, scripted with transformers' continuations; one per family for the module, as each
    costs a compile per width."""
    done = {}

    def get(name: str):
        if name not in done:
            expected = reference(name)
            done[name] = planted_engine(family(name), [(PROMPTS[k], expected[k]) for k in PROMPTS], block_size=6,
                                        backend={**BACKEND, "compile": "on"})
        return done[name]

    return get


def direct_model(path):
    """The checkpoint loaded with the transformers class its config.json names."""
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, architecture).from_pretrained(str(path), dtype=torch.float32).eval()


def greedy(model, ids) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    return out[0, len(ids):].tolist()


def planted_engine(path, script, mistakes=MISTAKES, block_size=None, **extra):
    options = {"script": script, "mistakes": mistakes}
    drafter = {"kind": "planted", "options": options, **({"block_size": block_size} if block_size else {})}
    config = {"backend": BACKEND, "target": {"path": str(path)}, "drafter": drafter}
    return load_engine({**config, **extra}, registry=registry_with_planted())


def run_recorded(engine, ids, **kwargs):
    """``(result, cycles)``; a cycle is (block width, cache length after the forward, rows rolled back)."""
    target, cycles = engine.target, []
    forward, crop = target.forward, target.crop

    def recording_forward(token_ids, capture=Capture()):
        out = forward(token_ids, capture)
        cycles.append([int(token_ids.shape[0]), target.cache_length])
        return out

    def recording_crop(length):
        if cycles and len(cycles[-1]) == 2:
            cycles[-1].append(target.cache_length - length)
        crop(length)

    target.forward, target.crop = recording_forward, recording_crop
    try:
        result = engine.run(prompt_ids=ids, max_new_tokens=kwargs.pop("max_new_tokens", NEW), ignore_eos=True, **kwargs)
    finally:
        del target.forward, target.crop
    return result, [tuple(c) for c in cycles]


def kinds(cycles) -> set[str]:
    seen = set()
    for width, _, removed in cycles:
        if width >= 2:
            seen.add("whole" if removed == 0 else "position 0" if removed == width - 1 else "partway")
    return seen


# -- loading ------------------------------------------------------------------------------------
def test_targets_load_without_hub_kernels(family):
    """transformers >= 5.25 kernelizes a model by default with kernels fetched from the Hub: code
    from outside the checkpoint, which a target must not run unasked (and a kernel that keeps the
    convolution state itself would slip past the rollback's recording)."""
    from speculant.backends.torch.loading import load_causal_lm

    model, _ = load_causal_lm(str(family("qwen3_5")), torch.float32)
    assert getattr(model, "use_kernels", False) is False


@pytest.mark.parametrize("name", FAMILIES)
def test_target_logits_and_head_equal_transformers(family, name):
    """Prefill and a one-token step give the logits of the model loaded directly (Muse Glimmer
    and Qwen3.5: their composite class, text only), and ``lm_head`` of the final hidden state
    gives exactly the forward's logits (soft-capping and multipliers included)."""
    path = family(name)
    backend = TorchBackend(BackendConfig(**BACKEND))
    target = backend.load_target(str(path), read_target_info(path))
    ids = PROMPTS["long"]
    with torch.no_grad():
        expected = direct_model(path)(input_ids=torch.tensor([ids])).logits[0]
    first = target.prefill(ids[:-1]).logits[-1]
    step = target.forward(backend.int_array(ids[-1:]), Capture(final_hidden="post_norm"))
    torch.testing.assert_close(first, expected[-2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step.logits[-1], expected[-1], rtol=1e-4, atol=1e-4)
    assert torch.equal(target.lm_head(step.final_hidden), step.logits)
    if name == "muse_glimmer":
        assert type(target.model).__name__ == "MuseGlimmerForConditionalGeneration"
        assert target.model.model.vision_tower is None  # the text model only
        assert target._logit_transform is not None  # output_multiplier and final_logit_softcapping
    if name == "qwen3_next":  # rope_theta / partial_rotary_factor at the top level, as on the Hub
        raw = json.loads((path / "config.json").read_text())
        rope = target.model.config.rope_parameters
        assert "rope_parameters" not in raw
        assert (rope["rope_theta"], rope["partial_rotary_factor"]) == (raw["rope_theta"], raw["partial_rotary_factor"])


# -- greedy losslessness ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_speculation_equals_transformers(family, reference, name):
    path, expected = family(name), reference(name)
    engine = planted_engine(path, [(PROMPTS[k], expected[k]) for k in PROMPTS])
    seen, deep = set(), 0
    for key, ids in PROMPTS.items():
        result, cycles = run_recorded(engine, ids)
        assert result.token_ids == expected[key], f"{name}, {key} prompt"
        assert 1 + sum(result.stats.acceptance_lengths) == NEW
        seen |= kinds(cycles)
        deep += sum(1 for width, length, removed in cycles if removed and length - width >= WINDOW)
    assert seen == {"position 0", "partway", "whole"}
    assert deep > 0  # rolled back after the sliding window had filled


SLIDING = ["gemma3_text", "mistral", "gpt_oss", "muse_glimmer"]  # sliding-window layers, no recurrent ones


@pytest.mark.slow
@pytest.mark.parametrize("name", SLIDING + list(HYBRID))
def test_families_run_compiled_and_equal_transformers(compiled_engine, reference, name):
    """``backend.compile: on`` for every family. Sliding-window layers: the static cache keeps every
    row (laid out as full attention), and the model masks each sliding layer itself. Gated
    DeltaNet layers: their states are recorded inside the graphs and put back by a crop
    (recording_static.py). Greedy speculation with rejections at every position, rolled back after
    the window has filled, gives transformers' tokens, and no graph is compiled twice. Blocks of 6
    run the graph of width 8, so every forward's padding is taken back."""
    engine, expected = compiled_engine(name), reference(name)
    assert engine.target.fast_path.startswith("compiled: widths"), engine.target.fast_path
    seen, deep = set(), 0
    for key, ids in PROMPTS.items():
        result, cycles = run_recorded(engine, ids)
        assert result.token_ids == expected[key], f"{name}, {key} prompt"
        seen |= kinds(cycles)
        deep += sum(1 for width, length, removed in cycles if removed and length - width >= WINDOW)
    assert seen == {"position 0", "partway", "whole"} and deep > 0
    assert engine.target._steps.recompiles == 0 and engine.target._on_static


@pytest.mark.slow
@pytest.mark.compiler("inductor")
def test_hybrid_plain_decoding_runs_compiled_and_takes_its_step_ahead_back(family, reference):
    """Plain greedy decoding of a Gated DeltaNet hybrid on the compiled path runs the width-1 graph a
    step ahead. It gives transformers' tokens for both prompts on one engine (a new request starts
    from zeroed states), and the crop at the end puts back the states from before the step run
    ahead: they equal an eager prefill's of everything up to the last token."""
    path, expected = family("qwen3_5"), reference("qwen3_5")
    engine = load_engine({"backend": {**BACKEND, "compile": "on"}, "target": {"path": str(path)}})
    target = engine.target
    assert target.fast_path.startswith("compiled: widths 1;"), target.fast_path
    eager = load_engine({"backend": BACKEND, "target": {"path": str(path)}}).target
    for key, ids in PROMPTS.items():
        result = engine.run(prompt_ids=ids, max_new_tokens=NEW, ignore_eos=True)
        assert result.token_ids == expected[key], key
        context = ids + result.token_ids[:-1]
        assert target.cache_length == len(context)
        eager.reset()
        eager.prefill(context)
        linear = [i for i, kind in enumerate(target.info.layer_types) if kind == "linear_attention"]
        for index in linear:
            compiled_layer, eager_layer = target._static.cache.layers[index], eager.cache.layers[index]
            kernel = compiled_layer.conv_states[0].shape[-1]
            for got, want in ((compiled_layer.recurrent_states[0], eager_layer.recurrent_states[0]),
                              (compiled_layer.conv_states[0], eager_layer.conv_states[0][..., -kernel:])):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert target._steps.recompiles == 0


@pytest.mark.slow
def test_a_hybrid_grows_its_static_cache_and_finishes_eager_when_a_compile_fails(family, reference, monkeypatch):
    """A static cache of 16 rows grows as the request goes (its states copied to the larger one);
    the first growth's compile is refused, so the request finishes eagerly over the static cache,
    recording through the eager path. Tokens stay transformers', and the next request runs on the
    eager RollbackCache."""
    from speculant.backends.torch import compiled

    path, expected = family("qwen3_5"), reference("qwen3_5")
    monkeypatch.setattr(compiled, "CPU_STATIC_ROWS", 16)
    engine = planted_engine(path, [(PROMPTS[k], expected[k]) for k in PROMPTS], block_size=6,
                            backend={**BACKEND, "compile": "on"})

    def refused(*args, **kwargs):
        def graph(*args, **kwargs):
            raise RuntimeError("refused by the test")
        return graph

    monkeypatch.setattr(compiled.torch, "compile", refused)
    result, cycles = run_recorded(engine, PROMPTS["short"])
    assert result.token_ids == expected["short"]
    assert engine.target.fast_path.startswith("eager: compiling failed (RuntimeError: refused by the test)")
    assert engine.target._static.rows >= len(PROMPTS["short"]) + NEW and {"position 0", "partway"} <= kinds(cycles)
    assert engine.run(prompt_ids=PROMPTS["long"], max_new_tokens=NEW, ignore_eos=True).token_ids == expected["long"]
    assert not engine.target._on_static


@pytest.mark.slow
def test_a_compiled_crop_deeper_than_the_last_forward_is_refused(compiled_engine):
    engine = compiled_engine("qwen3_5")
    target, backend = engine.target, engine.backend
    target.reset()
    target.prefill(PROMPTS["long"])
    target.forward(backend.int_array([1, 2, 3]))
    with pytest.raises(RuntimeError, match="recorded for the last forward only"):
        target.crop(len(PROMPTS["long"]) - 1)
    target.crop(len(PROMPTS["long"]))  # back to before the block: allowed


@pytest.mark.parametrize("name", FAMILIES)
def test_random_dflash_draft_is_lossless(family, reference, tmp_path, name):
    """A random DFlash draft: almost every block rejected at position 0, on the DFlash path
    (target layers captured, shared embedding and head)."""
    from speculant.testing.tiny import build_tiny_dflash

    path, expected = family(name), reference(name)
    draft = build_tiny_dflash(tmp_path / "draft", path, seed=5, block_size=8)
    engine = load_engine({"backend": BACKEND, "target": {"path": str(path)},
                                 "drafter": {"kind": "dflash", "path": str(draft)}})
    result, cycles = run_recorded(engine, PROMPTS["long"], max_new_tokens=32)
    assert result.token_ids == expected["long"][:32]
    assert "position 0" in kinds(cycles)


@pytest.mark.slow
def test_dflash_on_a_compiled_hybrid_drafts_as_on_the_eager_one(family, reference, tmp_path):
    """DFlash over a compiled Qwen3.5 target: the captured target layers come out of the graphs
    that record the Gated DeltaNet states, and the draft step compiles with the target. Every
    cycle's proposals and acceptance lengths equal the eager engine's, and the tokens are
    transformers'."""
    from speculant.testing.tiny import build_tiny_dflash

    path, expected = family("qwen3_5"), reference("qwen3_5")
    draft = build_tiny_dflash(tmp_path / "draft", path, seed=5, block_size=8)
    runs = []
    for compile in ("on", "off"):
        engine = load_engine({"backend": {**BACKEND, "compile": compile}, "target": {"path": str(path)},
                              "drafter": {"kind": "dflash", "path": str(draft)}})
        proposals, propose = [], engine.drafter.propose

        def recording(request, propose=propose, proposals=proposals, ops=engine.backend.ops):
            out = propose(request)
            proposals.append(ops.to_list(out.token_ids))
            return out

        engine.drafter.propose = recording
        result = engine.run(prompt_ids=PROMPTS["long"], max_new_tokens=32, ignore_eos=True)
        assert result.token_ids == expected["long"][:32], compile
        runs.append((proposals, result.stats.acceptance_lengths, engine.target.fast_path, engine.drafter.fast_path))
    (compiled, accepted, target_path, draft_path), (eager, eager_accepted, *_) = runs
    assert target_path.startswith("compiled: widths") and draft_path.startswith("compiled"), (target_path, draft_path)
    assert compiled == eager and accepted == eager_accepted and len(compiled) > 5


@pytest.mark.parametrize("name", HYBRID)
def test_keeping_the_whole_block_recurrent_state_breaks_equality(family, reference, monkeypatch, name):
    """The recurrent-state rollback is what makes hybrids exact: keeping the state after the
    whole block (convolution and attention still rolled back) changes the output."""
    path, expected = family(name), reference(name)
    engine = planted_engine(path, [(PROMPTS["short"], expected["short"])])
    monkeypatch.setattr(rollback.ROLLBACK, "keep_whole_block", True)
    result, cycles = run_recorded(engine, PROMPTS["short"])
    assert {"position 0", "partway"} & kinds(cycles[:2])  # rolled back before any difference
    assert result.token_ids != expected["short"]


def test_a_crop_deeper_than_the_last_block_is_refused(family):
    engine = planted_engine(family("qwen3_5"), [])
    target, backend = engine.target, engine.backend
    target.prefill(PROMPTS["long"])
    target.forward(backend.int_array([1, 2, 3]))
    with pytest.raises(RuntimeError, match="only the last 3"):
        target.crop(len(PROMPTS["long"]) - 1)


# -- sampling ---------------------------------------------------------------------------------------
def test_sampling_on_a_hybrid_follows_the_target(family, monkeypatch):
    """Speculative sampling (temperature 1, top-k 2) with proposals the target almost always
    rejects at position 0, so the first cycle rolls its proposal back and the third token is the
    first one read from a rolled-back state. The law of the first three tokens must be the
    target's (chi-square); with the whole-block recurrent state kept it must not be."""
    from speculant.core.types import SamplingParams
    from speculant.core.sampling import target_probs

    chisquare = pytest.importorskip("scipy.stats").chisquare
    sampling = SamplingParams(temperature=1.0, top_k=2)
    engine = planted_engine(family("qwen3_5"), [], verifier={"kind": "speculative_sampling"},
                            sampling={"temperature": 1.0, "top_k": 2})
    ops, prompt = engine.backend.ops, PROMPTS["short"]

    def next_probs(ids):
        engine.target.reset()
        probs = target_probs(ops, engine.target.prefill(ids).logits[-1:], sampling)
        return ops.to_numpy(probs)[0].astype(np.float64)

    law = {(): 1.0}
    for _ in range(3):
        law = {seq + (int(t),): p * q for seq, p in law.items() for t, q in enumerate(next_probs(prompt + list(seq))) if q > 0}
    cells = sorted(law)
    expected = np.array([law[c] for c in cells])
    expected /= expected.sum()

    def pvalue(runs: int) -> float:
        seen = [tuple(engine.run(prompt_ids=prompt, max_new_tokens=3, seed=s, ignore_eos=True).token_ids)
                for s in range(runs)]
        observed = np.array([seen.count(c) for c in cells], dtype=float)
        if observed.sum() < runs:  # a sequence outside the target's support
            return 0.0
        return chisquare(observed, expected * runs).pvalue

    _, cycles = run_recorded(engine, prompt, max_new_tokens=3, seed=0)
    assert cycles[0][0] == 2 and cycles[0][2] == 1  # the first block's proposal was rolled back
    assert pvalue(200) > 1e-3
    monkeypatch.setattr(rollback.ROLLBACK, "keep_whole_block", True)
    assert pvalue(200) < 1e-3


# -- what the torch backend refuses ---------------------------------------------------------------
def test_rollback_problem_names_the_layer_kind_and_family(family):
    for name in FAMILIES:
        assert TorchBackend.rollback_problem(read_target_info(family(name))) is None
    info = read_target_info(family("qwen3_5"))
    unknown = dataclasses.replace(info, model_type="qwen4_exp", layer_types=("linear_attention", "indexed_attention"))
    message = TorchBackend.rollback_problem(unknown)
    assert "linear_attention" in message and "indexed_attention" in message and "qwen4_exp" in message
    assert "torch backend cannot roll back" in message
    sliding = dataclasses.replace(info, model_type="llama4_text", layer_types=("chunked_attention", "full_attention"))
    assert "chunked_attention" in TorchBackend.rollback_problem(sliding)


# -- the original full-attention families keep working --------------------------------------------
def _qwen3_moe(path):
    from speculant.testing.tiny import build_tokenizer

    return _save(path, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, build_tokenizer(path),
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)


def _deepseek_v3(path):
    from speculant.testing.tiny_mtp_families import build_family_target

    return build_family_target(path, "deepseek_v3")  # MLA, a dense first layer, then MoE


def _save(path, config_cls, model_cls, tokenizer, **extra):
    config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None,
                        tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = model_cls(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 2.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_full_attention_families_still_decode_losslessly(tmp_path, torch_threads, name):
    from speculant.testing.tiny import build_tiny_target

    path = tmp_path / name
    {"qwen3": build_tiny_target, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}[name](path)
    model = direct_model(path)
    model.generation_config.eos_token_id = None
    ids = PROMPTS["long"]
    expected = greedy(model, ids)[:32]
    result, cycles = run_recorded(planted_engine(path, [(ids, expected)]), ids, max_new_tokens=32)
    assert result.token_ids == expected
    assert {"position 0", "partway", "whole"} <= kinds(cycles)


# -- the pieces --------------------------------------------------------------------------------------
def test_recorded_recurrence_is_transformers_step_for_step(torch_threads):
    """``recurrent_with_states`` gives bit for bit transformers' recurrent delta rule, and its
    state after row i is the rule's final state over the first i + 1 rows."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    reference = getattr(qwen.torch_recurrent_gated_delta_rule, "__wrapped__", qwen.torch_recurrent_gated_delta_rule)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 6, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(1, 6, 4, 16, generator=gen)
    g, beta = -torch.rand(1, 6, 4, generator=gen), torch.rand(1, 6, 4, generator=gen)
    state = torch.randn(1, 4, 16, 16, generator=gen)
    out, states = rollback.recurrent_with_states(q, k, v, g, beta, state, True, qwen.l2norm)
    expected, final = reference(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, expected) and torch.equal(states[-1], final)
    for i in (0, 2):
        _, prefix = reference(q[:, :i + 1], k[:, :i + 1], v[:, :i + 1], g=g[:, :i + 1], beta=beta[:, :i + 1],
                              initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.equal(states[i], prefix)


def test_buffers_go_back_to_the_window_after_every_forward(family):
    """Past recording keeps a block's rows only until the crop that follows every forward
    (prefill included): sliding layers hold window - 1 rows, convolution states the kernel."""
    for name, index in (("gemma3_text", 0), ("qwen3_5", 0)):
        engine = planted_engine(family(name), [])
        target, backend = engine.target, engine.backend
        layer = target.cache.layers[index]
        width = (lambda: layer.keys.shape[-2]) if name == "gemma3_text" else (lambda: layer.conv_states[0].shape[-1])
        settled = WINDOW - 1 if name == "gemma3_text" else 4  # linear_conv_kernel_dim
        target.prefill(PROMPTS["long"])
        assert width() == settled
        target.forward(backend.int_array([1, 2, 3, 4, 5]))
        assert width() == settled + 5
        target.crop(len(PROMPTS["long"]) + 2)
        assert width() == settled and target.cache_length == len(PROMPTS["long"]) + 2


def test_closed_form_recording_equals_the_token_loop(family, reference, monkeypatch):
    """The closed form (the default on accelerators) gives the loop's outputs and states up to
    float rounding, and greedy output stays transformers' on the hybrids."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 8, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(1, 8, 4, 16, generator=gen)
    g, beta = -2 * torch.rand(1, 8, 4, generator=gen), torch.rand(1, 8, 4, generator=gen)
    state = torch.randn(1, 4, 16, 16, generator=gen)
    loop_out, loop_states = rollback.recurrent_with_states(q, k, v, g, beta, state, True)
    out, states = rollback.closed_form_with_states(q, k, v, g, beta, state, True)
    torch.testing.assert_close(out, loop_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(states), torch.stack(loop_states), rtol=1e-5, atol=1e-5)
    assert not rollback.ROLLBACK.uses_closed_form(torch.device("cpu"))
    assert rollback.ROLLBACK.uses_closed_form(torch.device("cuda"))
    monkeypatch.setattr(rollback.ROLLBACK, "closed_form", True)
    for name in HYBRID:
        expected = reference(name)["long"]
        result, cycles = run_recorded(planted_engine(family(name), [(PROMPTS["long"], expected)]), PROMPTS["long"])
        assert result.token_ids == expected, name
        assert {"position 0", "partway", "whole"} <= kinds(cycles)
