"""speculant export: launch commands / settings for vLLM, SGLang, llama.cpp and oMLX use the option
names those projects document, and what an engine cannot run is refused with the reason."""

from __future__ import annotations

import json
import shlex

import pytest

from speculant.cli import main
from speculant.core.config import EngineConfig
from speculant.serve.export import ExportError, export

# The option names as the projects document them (families-and-serving reference, section 4;
# oMLX: dflash2 reference, section 5.1), plus each launcher's own model flag.
DOCUMENTED = {
    "vllm": {"--speculative-config"},
    "sglang": {"--model-path", "--speculative-algorithm", "--speculative-draft-model-path",
               "--speculative-num-draft-tokens", "--speculative-dflash-draft-window-size"},
    "llama.cpp": {"-m", "-md", "--spec-type", "--draft-max", "--draft-min"},
}
VLLM_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "draft_tensor_parallel_size", "max_model_len"}
OMLX_KEYS = {"dflash_enabled", "dflash_draft_model", "dflash_draft_quant_enabled", "dflash_draft_quant_weight_bits",
             "dflash_block_size", "dflash_max_ctx", "dflash_verify_mode"}


def config(tmp_path, kind="dflash", block=None, lookup=False, quantization=None):
    draft = tmp_path / kind
    draft.mkdir(exist_ok=True)
    cfg = {"mtp": {"mtp_num_hidden_layers": 2}}.get(kind, {"dflash_config": {"block_size": 16}})
    (draft / "config.json").write_text(json.dumps(cfg))
    drafter = {"kind": kind, "path": str(draft), "block_size": block, "lookup": lookup, "quantization": quantization}
    if kind == "none":
        drafter = {"kind": "none", "lookup": lookup}
    return EngineConfig.load({"target": {"path": str(tmp_path / "target")}, "drafter": drafter,
                              "verifier": {"kind": "adaptive"}})


def flags(command: str) -> list[str]:
    words = shlex.split(command.replace("python -m sglang.launch_server", "sglang.launch_server"))
    return [w for w in words if w.startswith("-")]


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
def test_commands_use_only_documented_flags(tmp_path, engine):
    text, _ = export(config(tmp_path, "dflash"), engine)
    assert flags(text) and set(flags(text)) <= DOCUMENTED[engine], text


def test_vllm_counts_proposals_sglang_the_whole_block(tmp_path):
    vllm, _ = export(config(tmp_path, "dflash", block=6), "vllm")
    words = shlex.split(vllm)
    assert words[:3] == ["vllm", "serve", str(tmp_path / "target")]
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(tmp_path / "dflash"), "num_speculative_tokens": 5}
    assert set(spec) <= VLLM_KEYS
    sglang = shlex.split(export(config(tmp_path, "dflash"), "sglang")[0])  # trained block 16 from config.json
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "16"
    assert sglang[sglang.index("--speculative-algorithm") + 1] == "DFLASH"
    llama = shlex.split(export(config(tmp_path, "mtp"), "llama.cpp")[0])
    assert llama[llama.index("--spec-type") + 1] == "draft-mtp" and llama[llama.index("--draft-max") + 1] == "2"


def test_lookup_alone_is_vllm_ngram_with_its_match_lengths(tmp_path):
    spec = json.loads(shlex.split(export(config(tmp_path, "none", lookup=True), "vllm")[0])[-1])
    assert spec["method"] == "ngram" and set(spec) <= VLLM_KEYS
    assert (spec["prompt_lookup_min"], spec["prompt_lookup_max"]) == (4, 8)
    assert shlex.split(export(config(tmp_path, "none"), "vllm")[0]) == ["vllm", "serve", str(tmp_path / "target")]


def test_omlx_settings_use_documented_keys_and_cap_dflash2(tmp_path):
    text, notes = export(config(tmp_path, "dflash2", quantization="w4"), "omlx")
    settings = json.loads(text)
    assert set(settings) <= OMLX_KEYS
    assert settings["dflash_block_size"] == 5 and settings["dflash_verify_mode"] == "adaptive"
    assert settings["dflash_draft_quant_weight_bits"] == 4
    assert any("caps DFlash 2" in n for n in notes)


@pytest.mark.parametrize("engine,kind,lookup,reason", [
    ("sglang", "dflash2", False, "DFLASH"),
    ("sglang", "mtp", False, "mtp"),
    ("llama.cpp", "dflash2", False, "DFlash 2"),
    ("llama.cpp", "none", True, "ngram"),
    ("omlx", "mtp", False, "MTP"),
    ("omlx", "none", True, "prompt-lookup"),
])
def test_refusals_name_the_reason(tmp_path, engine, kind, lookup, reason):
    with pytest.raises(ExportError, match=reason):
        export(config(tmp_path, kind, lookup=lookup), engine)


def test_cli_exports_the_shipped_pair_and_refuses_with_exit_2(capsys):
    from speculant import embedded

    if not embedded.available():
        pytest.skip("the shipped pair is not installed")
    assert main(["export", "--to", "vllm"]) == 0
    out, err = capsys.readouterr()
    assert '"method": "dflash"' in out and "prompt lookup is not carried over" in err
    assert main(["export", "--to", "sglang"]) == 2
    assert "SGLang cannot run a dflash2 draft" in capsys.readouterr().err
