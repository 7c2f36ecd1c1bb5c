"""The ``speculant`` command: generate, validate, plugins, and its error handling."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speculant.cli import apply_chat_template, build_config, build_parser, main
from speculant.core.errors import ConfigError
from speculant.core.metrics import PUBLIC_FIELDS

ROOT = Path(__file__).resolve().parents[1]
CPU = ["--device", "cpu", "--dtype", "float32"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}{% endif %}"
)


@pytest.fixture(autouse=True)
def builtins_only(monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")
    monkeypatch.delenv("SPECULANT_DEBUG", raising=False)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def engine_for(target: Path, **generation):
    import speculant

    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if generation:
        config["generation"] = generation
    return speculant.load_engine(config)


@pytest.fixture(scope="module")
def chat_target(tiny_target, tmp_path_factory):
    """The tiny target with a chat template that shows the system turn and enable_thinking."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_target, path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


# -- entry points -----------------------------------------------------------------------------
def test_python_dash_m_and_version():
    run = subprocess.run([sys.executable, "-m", "speculant", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().startswith("speculant ")
    helptext = subprocess.run([sys.executable, "-m", "speculant", "generate", "--help"], capture_output=True, text=True, timeout=120)
    for flag in ("--target", "--draft", "--drafter", "--block-size", "--temperature", "--top-p", "--top-k", "--seed",
                 "--max-new-tokens", "--stop", "--chat", "--system", "--thinking", "--no-thinking", "--json"):
        assert flag in helptext.stdout


def test_console_script_is_installed():
    script = shutil.which("speculant", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if script is None:
        pytest.skip("the speculant console script is not installed (pip install -e .)")
    run = subprocess.run([script, "plugins", "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "verifiers" in {row["name"] for row in json.loads(run.stdout)}


# -- configuration from flags -----------------------------------------------------------------
def parse(*argv: str):
    return build_parser().parse_args(["generate", *argv])


def test_flags_override_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "engine.toml").write_text(
        '[target]\npath = "models/t"\n[drafter]\nkind = "dflash"\npath = "models/d"\nblock_size = 8\n'
        '[sampling]\ntemperature = 0.5\n[generation]\nmax_new_tokens = 100\n'
    )
    monkeypatch.chdir(tmp_path)
    config = build_config(parse("--config", "engine.toml", "--block-size", "4", "--temperature", "0", "--top-p", "0.9",
                                "--top-k", "5", "--seed", "7", "--max-new-tokens", "9", "--stop", "\n\n", "--stop", "END",
                                "--backend", "torch", "--device", "cpu", "--dtype", "float32", "--verifier", "greedy"))
    assert config.target.path == tmp_path.resolve() / "models/t"  # relative to the config file
    assert config.drafter.path == tmp_path.resolve() / "models/d"
    assert (config.drafter.kind, config.drafter.block_size) == ("dflash", 4)
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.top_k, config.sampling.seed) == (0, 0.9, 5, 7)
    assert config.generation.max_new_tokens == 9 and config.generation.stop_strings == ["\n\n", "END"]
    assert (config.backend.device, config.backend.dtype, config.verifier.kind) == ("cpu", "float32", "greedy")


def test_lookup_flag_switches_prompt_lookup_and_keeps_its_settings(tmp_path, monkeypatch):
    (tmp_path / "engine.toml").write_text('[target]\npath = "t"\n[drafter]\nkind = "dflash"\npath = "d"\n'
                                          '[drafter.lookup]\nmin_match = 2\nmax_match = 5\n')
    monkeypatch.chdir(tmp_path)
    assert not build_config(parse("--config", "engine.toml")).drafter.lookup.enabled
    lookup = build_config(parse("--config", "engine.toml", "--lookup")).drafter.lookup
    assert (lookup.enabled, lookup.min_match, lookup.max_match) == (True, 2, 5)
    assert build_config(parse("--target", "t", "--draft", "d", "--lookup")).drafter.lookup.enabled
    assert not build_config(parse("--target", "t", "--draft", "d", "--no-lookup")).drafter.lookup.enabled


def test_flags_without_a_config_file():
    config = build_config(parse("--target", "t", "--draft", "d"))
    assert str(config.target.path) == "t" and config.drafter.kind == "dflash"  # --draft implies dflash
    assert build_config(parse("--target", "t", "--draft", "d", "--drafter", "toy")).drafter.kind == "toy"
    assert not build_config(parse("--target", "t")).drafter.enabled


def test_bad_flag_values_name_the_field():
    with pytest.raises(ConfigError, match="generation.max_new_tokens"):
        build_config(parse("--target", "t", "--max-new-tokens", "0"))


# -- errors -----------------------------------------------------------------------------------
def test_no_model_and_no_shipped_pair_is_a_clear_error(capsys, monkeypatch, tmp_path):
    from speculant import embedded

    monkeypatch.setattr(embedded, "PAIR_DIR", tmp_path / "absent")
    code, out, err = cli(capsys, "generate", "hello")
    assert code == 2 and out == ""
    assert err.startswith("speculant: error: no model given and the shipped model pair is missing") and "--config" in err
    assert "Traceback" not in err


def test_missing_config_file(capsys, tmp_path):
    code, _, err = cli(capsys, "generate", "--config", str(tmp_path / "nope.toml"), "hi")
    assert code == 2 and "config file not found" in err and err.count("\n") == 1


def test_debug_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULANT_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(["generate", "--config", str(tmp_path / "nope.toml"), "hi"])


def test_validation_failure_exits_2_without_traceback(capsys, tiny_target, tmp_path):
    code, _, err = cli(capsys, "generate", "--target", str(tiny_target), "--draft", str(tmp_path / "missing"), *CPU, "hi")
    assert code == 2 and "drafter.path" in err and "Traceback" not in err


def test_context_too_long(capsys, tiny_target):
    code, out, err = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "x " * 600)
    assert code == 2 and "context window is 512" in err and "Traceback" not in err


def test_system_needs_chat(capsys):
    code, _, err = cli(capsys, "generate", "--target", "t", "--system", "be brief", "hi")
    assert code == 2 and "need --chat" in err


def test_missing_prompt(capsys, tiny_target):
    code, _, err = cli(capsys, "generate", "--target", str(tiny_target))
    assert code == 2 and "no prompt" in err


# -- generate ---------------------------------------------------------------------------------
def test_generate_streams_the_engines_text_and_prints_stats(capsys, tiny_target):
    expected = engine_for(tiny_target).run("def add(a, b):", max_new_tokens=12)
    code, out, err = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "12", "def add(a, b):")
    assert code == 0
    assert out == expected.text  # nothing else on stdout (not a terminal: no trailing newline added)
    assert f"{expected.stats.new_tokens} tokens" in err and "stop:" in err


def test_generate_json_stats_are_exactly_the_public_fields(capsys, tiny_target):
    code, out, err = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "7", "--json", "for i")
    assert code == 0
    stats = json.loads(err)
    assert list(stats) == list(PUBLIC_FIELDS)
    assert stats["new_tokens"] <= 7 and stats["stop_reason"] in ("max_new_tokens", "eos")


def test_generate_from_a_config_file_with_overrides(capsys, tiny_target, tmp_path):
    (tmp_path / "engine.yaml").write_text(
        f"backend:\n  device: cpu\n  dtype: float32\ntarget:\n  path: {tiny_target}\n"
        "generation:\n  max_new_tokens: 50\n  ignore_eos: true\n"
    )
    code, out, err = cli(capsys, "generate", "--config", str(tmp_path / "engine.yaml"), "--max-new-tokens", "5", "--json", "x = 1")
    assert code == 0 and json.loads(err)["new_tokens"] == 5
    assert out == engine_for(tiny_target, ignore_eos=True).run("x = 1", max_new_tokens=5).text


def test_prompt_from_stdin(capsys, monkeypatch, tiny_target):
    monkeypatch.setattr(sys, "stdin", io.StringIO("import os\n"))
    code, out, _ = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "6", "-")
    assert code == 0 and out == engine_for(tiny_target).run("import os\n", max_new_tokens=6).text


def test_sampling_flags_and_seed(capsys, tiny_target):
    args = ["generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "16", "--temperature", "1.5",
            "--top-k", "50", "--top-p", "0.95", "--json", "def"]
    runs = [cli(capsys, *args, "--seed", "11") for _ in range(2)]
    assert runs[0][0] == 0 and runs[0][1] == runs[1][1]  # same seed, same text
    greedy = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "16", "def")[1]
    others = {cli(capsys, *args, "--seed", str(s))[1] for s in range(3)}
    assert others != {greedy}  # sampling really sampled


def test_stop_string_flag(capsys, tiny_target):
    full = engine_for(tiny_target, ignore_eos=True).run("def", max_new_tokens=40).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string here")
    code, out, err = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "40",
                         "--stop", stop, "--json", "def")
    assert code == 0 and stop not in out and full.startswith(out)
    assert json.loads(err)["stop_reason"] in ("stop_string", "eos")


def test_chat_template_with_system_and_thinking(chat_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_target))
    text = apply_chat_template(tokenizer, "hi", "be brief", False)
    assert text == "<|system|>be brief\n<|user|>hi\n<|assistant|>[no-think]"
    assert apply_chat_template(tokenizer, "hi", None, None) == "<|user|>hi\n<|assistant|>"
    assert apply_chat_template(tokenizer, "hi", None, True) == "<|user|>hi\n<|assistant|>"


def test_generate_chat(capsys, chat_target):
    templated = "<|system|>be brief\n<|user|>hi\n<|assistant|>[no-think]"
    expected = engine_for(chat_target).run(templated, max_new_tokens=10).text
    code, out, _ = cli(capsys, "generate", "--target", str(chat_target), *CPU, "--max-new-tokens", "10",
                       "--chat", "--system", "be brief", "--no-thinking", "hi")
    assert code == 0 and out == expected
    plain = engine_for(chat_target).run("hi", max_new_tokens=10).text
    assert cli(capsys, "generate", "--target", str(chat_target), *CPU, "--max-new-tokens", "10", "hi")[1] == plain


def test_chat_without_a_template_is_a_clear_error(capsys, tiny_target):
    code, _, err = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "--chat", "hi")
    assert code == 2 and "no chat template" in err


class InterruptingStdout(io.StringIO):
    """Stands in for a terminal where the user presses Ctrl-C after ``after`` writes."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def write(self, text: str) -> int:
        if self.after == 0:
            raise KeyboardInterrupt
        self.after -= 1
        return super().write(text)


def test_ctrl_c_keeps_the_output_and_prints_stats(capsys, monkeypatch, tiny_target):
    fake = InterruptingStdout(after=2)
    monkeypatch.setattr(sys, "stdout", fake)
    code = main(["generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "60", "--json", "def add(a, b):"])
    err = capsys.readouterr().err
    assert code == 130
    stats = json.loads(err)
    assert stats["stop_reason"] == "interrupted" and 0 < stats["new_tokens"] < 60
    full = engine_for(tiny_target).run("def add(a, b):", max_new_tokens=60).text
    assert fake.getvalue() and full.startswith(fake.getvalue())


# -- validate ---------------------------------------------------------------------------------
def write_engine(tmp_path: Path, target: Path, **extra: str) -> Path:
    text = f'[backend]\ndevice = "cpu"\n\n[target]\npath = {json.dumps(str(target))}\n'
    for section, body in extra.items():
        text += f"\n[{section}]\n{body}\n"
    path = tmp_path / "engine.toml"
    path.write_text(text)
    return path


def test_validate_ok(capsys, tiny_target, tmp_path):
    code, out, _ = cli(capsys, "validate", str(write_engine(tmp_path, tiny_target)))
    assert code == 0 and "ok: no problems found" in out


def test_validate_prints_every_problem_with_its_fix(capsys, tiny_target, tmp_path):
    config = write_engine(tmp_path, tiny_target, sampling="temperature = -1.0\ntop_p = 3.0",
                          verifier='kind = "nonesuch"', drafter='kind = "dflash"\npath = "no-draft-here"')
    code, out, _ = cli(capsys, "validate", str(config))
    assert code == 1
    for field in ("sampling.temperature", "sampling.top_p", "verifier.kind", "drafter.path"):
        assert f"error: {field}: " in out
    assert out.count("    fix: ") >= 4 and "error(s)" in out


def test_validate_json(capsys, tiny_target, tmp_path):
    config = write_engine(tmp_path, tiny_target, sampling="top_k = -2")
    code, out, _ = cli(capsys, "validate", "--json", str(config))
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert [(p["field"], p["severity"]) for p in data["problems"]] == [("sampling.top_k", "error")]
    assert data["problems"][0]["fix"]


def test_validate_json_when_clean(capsys, tiny_target, tmp_path):
    config = write_engine(tmp_path, tiny_target)
    code, out, _ = cli(capsys, "validate", "--json", str(config))
    assert code == 0 and json.loads(out) == {"config": str(config), "ok": True, "problems": []}


def test_validate_unknown_key_is_a_config_error(capsys, tiny_target, tmp_path):
    config = write_engine(tmp_path, tiny_target, drafter="blok_size = 4")
    code, _, err = cli(capsys, "validate", str(config))
    assert code == 2 and "drafter.blok_size: unknown key" in err


# -- plugins ----------------------------------------------------------------------------------
def test_plugins_lists_the_builtins(capsys):
    code, out, _ = cli(capsys, "plugins", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0
    assert rows["torch"]["registered"] == {"backends": ["torch"]} and rows["torch"]["distribution"] == "builtin"
    assert "register_drafters" in rows["dflash"]["hooks"] and rows["dflash"]["registered"] == {"drafters": ["dflash"]}
    assert set(rows["verifiers"]["registered"]["verifiers"]) >= {"greedy", "speculative_sampling"}
    code, out, _ = cli(capsys, "plugins")
    assert "torch (builtin " in out and "backends: torch" in out


def test_compare_reports_plain_and_speculative_rates_with_identical_tokens(capsys, planted_pair):
    code, out, err = cli(capsys, "generate", "--target", str(planted_pair["target"]), "--draft", str(planted_pair["draft"]),
                         *CPU, "--max-new-tokens", "24", "--compare", "--json", "--", "abc")
    assert code == 0, err
    stats, comparison = (json.loads(line) for line in err.strip().splitlines()[-2:])
    assert comparison["identical_tokens"] == comparison["new_tokens"] == stats["new_tokens"]
    assert comparison["speculative_decode_tokens_per_s"] == stats["decode_tokens_per_s"]
    assert comparison["speed_up"] == pytest.approx(stats["decode_tokens_per_s"] / comparison["plain_decode_tokens_per_s"])


def test_compare_without_a_drafter_is_refused_before_generating(capsys, tiny_target):
    code, out, err = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "--compare", "abc")
    assert code == 2 and out == ""
    assert "--compare needs a drafter" in err


# -- bad input that is not a bug (issue 37) -------------------------------------------------------
def test_invalid_utf8_on_stdin_is_a_one_line_usage_error(capsys, monkeypatch, tiny_target):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def f():\n  \xff\xfe return 1\n"), encoding="utf-8"))
    code, out, err = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "-")
    assert code == 2 and out == ""
    assert err.startswith("speculant: error: stdin: the prompt is not valid UTF-8 (byte 0xff at offset 11)")
    assert err.count("\n") == 1 and "please report" not in err


def test_invalid_utf8_in_a_prompts_file_names_the_file(tmp_path):
    from speculant.check import _prompt_file
    from speculant.cli_settings import UsageError

    path = tmp_path / "prompts.txt"
    path.write_bytes(b"first prompt\nsecond \xc3\x28 prompt\n")
    with pytest.raises(UsageError, match=rf"--prompts: {path} is not valid UTF-8 \(byte 0xc3 at offset 20\)"):
        _prompt_file(path)
    bad_json = tmp_path / "prompts.jsonl"
    bad_json.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(UsageError, match=rf"--prompts: cannot parse {bad_json} as JSONL"):
        _prompt_file(bad_json)


@pytest.mark.parametrize("flags, named", [
    (["--temperature", "5e-324"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "inf"], "--top-p"),
])
def test_float_flags_are_range_checked_on_the_flag(capsys, flags, named):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--target", "/nonexistent", *flags, "hi"])
    last = capsys.readouterr().err.splitlines()[-1]
    assert info.value.code == 2 and f"error: argument {named}: " in last and "dtype" not in last, last


def test_the_smallest_temperature_flag_generates(capsys, tiny_target):
    code, out, _ = cli(capsys, "generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "4",
                       "--temperature", "1e-4", "--seed", "1", "hi")
    assert code == 0 and out


@pytest.fixture(scope="module")
def no_system_target(tiny_target, tmp_path_factory):
    """A chat template that refuses the system role, as Gemma's and Mistral's do."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("no_system") / "target"
    shutil.copytree(tiny_target, path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}" + CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(path))
    return path


def test_a_chat_template_that_refuses_the_system_role_names_system(capsys, no_system_target):
    code, out, err = cli(capsys, "generate", "--target", str(no_system_target), *CPU, "--max-new-tokens", "3",
                         "--chat", "--system", "be brief", "hi")
    assert code == 2 and out == ""
    assert "--system" in err and "System role not supported" in err and err.count("\n") == 1
    assert "please report" not in err
    assert cli(capsys, "generate", "--target", str(no_system_target), *CPU, "--max-new-tokens", "3", "--chat", "hi")[0] == 0


class FailingStdout(io.StringIO):
    """A stdout whose writes fail after ``after`` of them, as a pipe or a full disk does."""

    def __init__(self, error: OSError, after: int = 0) -> None:
        super().__init__()
        self.error, self.after = error, after

    def write(self, text: str) -> int:
        if self.after == 0:
            raise self.error
        self.after -= 1
        return super().write(text)


def test_a_reader_that_leaves_ends_generate_quietly(capsys, monkeypatch, tiny_target):
    monkeypatch.setattr(sys, "stdout", FailingStdout(BrokenPipeError(32, "Broken pipe"), after=1))
    code = main(["generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "30", "def add(a, b):"])
    assert code == 141 and capsys.readouterr().err == ""


def test_a_full_stdout_is_one_line(capsys, monkeypatch, tiny_target):
    import errno

    monkeypatch.setattr(sys, "stdout", FailingStdout(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    code = main(["generate", "--target", str(tiny_target), *CPU, "--max-new-tokens", "30", "def add(a, b):"])
    assert code == 1
    assert capsys.readouterr().err == "speculant: error: cannot write to stdout: No space left on device\n"


@pytest.mark.parametrize("redirect, code, err", [
    (">/dev/full", 1, "speculant: error: cannot write to stdout: No space left on device\n"),
    (">&-", 1, "speculant: error: cannot write to stdout: Bad file descriptor\n"),
    ("| true", 141, ""),
])
def test_stdout_that_cannot_be_written_from_a_shell(redirect, code, err):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECULANT_LOAD_PLUGINS": ""}
    # `| true` leaves before reading; the sleep makes sure it has gone before the first write
    script = f"(sleep 0.5; exec {sys.executable} -m speculant plugins) {redirect}; echo rc=${{PIPESTATUS[0]}} >&2"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.stderr == f"{err}rc={code}\n", done.stderr
