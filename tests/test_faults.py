"""Faults and bad input: interrupts in every phase, damaged targets, a shared engine, bad per-call
overrides, and errors that used to pass ``validate`` and then crash ``generate``.

The SIGINT-to-a-subprocess test is in test_faults_sigint.py; the property-based test of random
configs and overrides is in test_faults_property.py.
"""

from __future__ import annotations

import gc
import math
import shutil
import sys
import threading
from pathlib import Path

import pytest

import speculant
from speculant.cli import main
from speculant.core.errors import CheckpointError, EngineBusyError, SettingError, ValidationFailed
from speculant.api import validate

PROMPT = "def add(a, b):"
N = 40


def config(target: Path, draft: Path | None = None, backend: str = "torch", **sections) -> dict:
    data = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if draft is not None:
        data["drafter"] = {"kind": "dflash", "path": str(draft)}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


@pytest.fixture(autouse=True)
def builtins_only(monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")
    monkeypatch.delenv("SPECULANT_DEBUG", raising=False)


@pytest.fixture(scope="module")
def torch_spec(planted_pair):
    return speculant.load_engine(config(planted_pair["target"], planted_pair["draft"]))


@pytest.fixture(scope="module")
def mlx_spec(planted_pair):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    return speculant.load_engine(config(planted_pair["target"], planted_pair["draft"], backend="mlx"))


@pytest.fixture(scope="module")
def reference(torch_spec):
    return torch_spec.run(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids


# -- 1. an interrupt in any phase ends the request and leaves the engine usable ---------------------
class _Interrupter:
    """Raises KeyboardInterrupt on the ``at``-th call, where Ctrl-C would land."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def tick(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


def _interrupt_inside_the_target(target, at: int):
    """Ctrl-C inside the target's forward: at the start of its first decoder layer, so the layers
    whose hidden states the drafter reads have not run yet. Returns an undo function."""
    stop = _Interrupter(at)
    if type(target).__module__.startswith("speculant.backends.torch"):
        from speculant.backends.torch.target import decoder_parts

        handle = decoder_parts(target.model)[1][0].register_forward_pre_hook(lambda *_: stop.tick())
        return handle.remove
    if target.compiles_whole:  # no Python runs inside a compiled forward: Ctrl-C lands at its call
        return _interrupt_the_compiled_forward(target, stop)
    import mlx.nn as nn

    from speculant.backends.mlx.target import text_model

    layers = text_model(target.model).layers
    first = layers[0]

    class Interrupting(nn.Module):
        def __init__(self, module) -> None:
            super().__init__()
            self.module = module

        def __call__(self, *args, **kwargs):
            stop.tick()
            return self.module(*args, **kwargs)

        def __getattr__(self, key):
            try:
                return super().__getattr__(key)
            except AttributeError:
                return getattr(self.get("module"), key)

    layers[0] = Interrupting(first)

    def undo() -> None:
        layers[0] = first

    return undo


def _interrupt_the_compiled_forward(target, stop: _Interrupter):
    compiled = target._static

    class Interrupting:
        def __call__(self, *args, **kwargs):
            stop.tick()
            return compiled(*args, **kwargs)

        def __getattr__(self, key):
            return getattr(compiled, key)

    target._static = Interrupting()
    return lambda: setattr(target, "_static", compiled)


def _interrupt_in_the_drafter(engine, method: str, at: int, after: bool):
    stop = _Interrupter(at)
    real = getattr(engine.drafter, method)

    def interrupted(*args, **kwargs):
        if not after:
            stop.tick()
        result = real(*args, **kwargs)
        if after:
            stop.tick()
        return result

    setattr(engine.drafter, method, interrupted)
    return lambda: delattr(engine.drafter, method)


PHASES = {
    "prefill": lambda e: _interrupt_inside_the_target(e.target, 1),
    "verify": lambda e: _interrupt_inside_the_target(e.target, 6),
    "draft": lambda e: _interrupt_in_the_drafter(e, "propose", 3, after=True),
    "commit": lambda e: _interrupt_in_the_drafter(e, "commit", 3, after=False),
}


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_interrupt_in_any_phase_keeps_what_was_produced(request, backend, phase, reference):
    engine = request.getfixturevalue(f"{backend}_spec")
    undo = PHASES[phase](engine)
    try:
        result = engine.run(PROMPT, max_new_tokens=N, ignore_eos=True)
    finally:
        undo()
    assert result.stats.stop_reason == "interrupted"
    assert result.token_ids == reference[: len(result.token_ids)] and len(result.token_ids) < N
    assert (len(result.token_ids) == 0) == (phase == "prefill")
    # the engine is usable again, and still lossless
    assert engine.run(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids == reference


def test_interrupt_inside_the_target_forward_on_the_command_line(capsys, planted_pair, monkeypatch):
    """The reported case: the CLI's run ends with exit 130 and stats, not a KeyError traceback."""
    from speculant.backends.torch import target as torch_target

    real_load = torch_target.TorchTarget.load

    def load(cls, *args, **kwargs):
        loaded = real_load(*args, **kwargs)
        _interrupt_inside_the_target(loaded, 5)
        return loaded

    monkeypatch.setattr(torch_target.TorchTarget, "load", classmethod(load))
    code = main(["generate", "--target", str(planted_pair["target"]), "--draft", str(planted_pair["draft"]),
                 "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "60", PROMPT])
    err = capsys.readouterr().err
    assert code == 130 and "stop: interrupted" in err and "Traceback" not in err


# -- 2. a damaged target is refused: at load time strictly, and by validate from its headers ----------
def _damaged(tmp_path: Path, target: Path, name: str, edit) -> Path:
    from safetensors.torch import load_file, save_file

    path = tmp_path / name
    shutil.copytree(target, path)
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_target_missing_a_tensor_is_refused_before_decoding(tmp_path, tiny_target, backend):
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    path = _damaged(tmp_path, tiny_target, "no_norm", lambda w: w.pop("model.norm.weight"))
    with pytest.raises(ValidationFailed, match=r"missing tensor model\.norm\.weight"):  # from the headers
        speculant.load_engine(config(path, backend=backend))
    # and the backend's strict load refuses it too, for what headers alone cannot show
    from speculant.core.config import BackendConfig
    from speculant.plugins.manager import get_registry

    backend_obj = get_registry().backends[backend](BackendConfig(kind=backend, device="cpu", dtype="float32"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        backend_obj.load_target(str(path), validate(config(path, backend=backend)).target)


def test_target_with_an_unexpected_tensor_is_refused(tmp_path, tiny_target):
    import torch

    path = _damaged(tmp_path, tiny_target, "extra", lambda w: w.__setitem__("model.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.extra\.weight"):
        speculant.load_engine(config(path))


def _layer_tensor(weights) -> str:
    return next(n for n in weights if n.startswith("model.layers.1.") and n.endswith("up_proj.weight"))


def _widen(weights) -> None:
    import torch

    name = _layer_tensor(weights)
    rows, cols = weights[name].shape
    weights[name] = torch.zeros(rows, cols + 1)


DAMAGE = {
    "missing": (lambda w: w.pop(_layer_tensor(w)), r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"),
    "mis-shaped": (_widen, r"model\.layers\.1\.mlp\.up_proj\.weight has shape \[\d+, \d+\]"),
    "missing-final-norm": (lambda w: w.pop("model.norm.weight"), r"missing tensor model\.norm\.weight"),
    "missing-lm-head": (lambda w: w.pop("lm_head.weight"), r"missing tensor lm_head\.weight"),
}
LOAD_NAMES = {"missing-final-norm": r"model\.norm\.weight", "missing-lm-head": r"lm_head\.weight"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_validate_and_load_name_a_damaged_layer_tensor(tmp_path, tiny_target, damage):
    edit, message = DAMAGE[damage]
    path = _damaged(tmp_path, tiny_target, damage, edit)
    report = validate(config(path))
    assert [p.field for p in report.errors] == ["target.path"] and any(
        __import__("re").search(message, p.message) for p in report.errors), report.errors
    from speculant.backends.torch.backend import TorchBackend
    from speculant.backends.torch.target import TorchTarget
    from speculant.core.config import BackendConfig

    with pytest.raises(CheckpointError, match=LOAD_NAMES.get(damage, r"model\.layers\.1\.mlp\.up_proj\.weight")):
        TorchTarget.load(str(path), report.target, TorchBackend(BackendConfig(device="cpu", dtype="float32")))


def test_truncated_target_is_caught_by_validate_not_at_generate_time(capsys, tmp_path, tiny_target):
    path = tmp_path / "truncated"
    shutil.copytree(tiny_target, path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-4096])
    problems = validate(config(path)).errors
    assert [p.field for p in problems] == ["target.path"] and "truncated" in problems[0].message
    code = main(["generate", "--target", str(path), "--device", "cpu", "--dtype", "float32", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "truncated" in err and "Traceback" not in err and "SafetensorError" not in err


def test_shipped_pair_and_tiny_families_load_strictly(tmp_path):
    """No false alarm on checkpoints that hold tied heads, composite names or vision towers."""
    from speculant import embedded
    from speculant.testing.tiny_families import build_tiny_family

    paths = [embedded.PAIR_DIR / "target"]
    for family in ("qwen3_5", "muse_glimmer"):  # model.language_model.* names; a vision tower
        paths.append(build_tiny_family(tmp_path / family, family) or tmp_path / family)
    for path in paths:
        report = validate(config(path, backend="torch"))
        assert report.ok, report.errors
        speculant.load_engine(config(path))


# -- 3. one engine, one request at a time -------------------------------------------------------------
def test_second_generator_while_one_is_open_is_refused(torch_spec, reference):
    first = torch_spec.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    got = list(next(first).token_ids)
    with pytest.raises(EngineBusyError, match="already generating"):
        torch_spec.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    with pytest.raises(EngineBusyError):
        torch_spec.without_drafter().run(PROMPT, max_new_tokens=4)  # the same target underneath
    got += [t for chunk in first for t in chunk.token_ids]
    assert got == reference  # the first request was not disturbed
    assert torch_spec.run(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids == reference


def test_closed_or_abandoned_generator_releases_the_engine(torch_spec, reference):
    first = torch_spec.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    next(first)
    first.close()
    assert torch_spec.last_stats.stop_reason == "interrupted"
    assert torch_spec.run(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids == reference
    second = torch_spec.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
    next(second)
    del second
    gc.collect()
    assert torch_spec.run(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids == reference


def test_two_threads_on_one_engine_get_a_clear_error_or_the_right_tokens(torch_spec, reference):
    started, checked = threading.Event(), threading.Event()
    outcomes: dict[str, object] = {}

    def first() -> None:
        chunks = torch_spec.generate(PROMPT, max_new_tokens=N, ignore_eos=True)
        ids = list(next(chunks).token_ids)
        started.set()
        checked.wait(30)
        outcomes["first"] = ids + [t for c in chunks for t in c.token_ids]

    def second() -> None:
        started.wait(30)
        try:
            outcomes["second"] = torch_spec.run(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids
        except Exception as exc:  # noqa: BLE001 - the test inspects whatever came out
            outcomes["second"] = exc
        checked.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes["first"] == reference
    assert isinstance(outcomes["second"], EngineBusyError), outcomes["second"]

    # free-running threads: each request either runs to the fresh engine's output or is refused
    results: list[object] = []

    def worker() -> None:
        for _ in range(3):
            try:
                results.append(torch_spec.run(PROMPT, max_new_tokens=N, ignore_eos=True).token_ids)
            except EngineBusyError as exc:
                results.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 6 and all(r == reference or isinstance(r, EngineBusyError) for r in results), results
    assert any(r == reference for r in results)


# -- 4. per-call overrides go through the config's checks ---------------------------------------------
BAD_OVERRIDES = [
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"temperature": math.inf}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_k": -1}, "sampling.top_k"),
    ({"seed": -5}, "sampling.seed"),
    ({"block_size": 0}, "drafter.block_size"),
    ({"block_size": 1}, "drafter.block_size"),
    ({"block_size": 99}, "drafter.block_size"),
    ({"block_size": "x"}, "drafter.block_size"),
    ({"max_new_tokens": 0}, "generation.max_new_tokens"),
    ({"max_new_tokens": "many"}, "generation.max_new_tokens"),
    ({"prompt_ids": [1.5]}, "prompt_ids"),
    ({"prompt_ids": [True]}, "prompt_ids"),
    ({"prompt_ids": "abc"}, "prompt_ids"),
    ({"prompt_ids": []}, "prompt_ids"),
    ({"tempreature": 0.5}, "tempreature"),
    # taken as written (issue 37): no bool for a number, no string for an integer, no float for a count
    ({"temperature": True}, "sampling.temperature"),
    ({"temperature": 5e-324}, "sampling.temperature"),
    ({"seed": "7"}, "sampling.seed"),
    ({"seed": False}, "sampling.seed"),
    ({"block_size": "4"}, "drafter.block_size"),
    ({"max_new_tokens": 2.0}, "generation.max_new_tokens"),
    ({"max_new_tokens": True}, "generation.max_new_tokens"),
    ({"ignore_eos": "no"}, "generation.ignore_eos"),
    ({"stop_token_ids": [True, 1.0]}, "generation.stop_token_ids.0"),
    ({"stop_token_ids": [5, 10**6]}, "generation.stop_token_ids"),
    ({"prompt_ids": {5, 6, 7}}, "prompt_ids"),
    ({"prompt_ids": {5: "a", 6: "b"}}, "prompt_ids"),
]


@pytest.mark.parametrize("overrides,field", BAD_OVERRIDES, ids=[f for _, f in BAD_OVERRIDES])
def test_bad_per_call_override_names_the_field(torch_spec, overrides, field):
    kwargs = {"prompt_ids": [5, 6, 7], "max_new_tokens": 4, **overrides}
    with pytest.raises(SettingError) as info:
        torch_spec.run(**kwargs)
    assert info.value.field == field
    key = next(part for part in reversed(field.split(".")) if not part.isdigit())
    assert key in str(info.value) and "https://" not in str(info.value)
    assert isinstance(info.value, ValueError)  # what callers caught before


def test_per_call_overrides_match_the_config_messages(torch_spec, planted_pair):
    with pytest.raises(SettingError) as call:
        torch_spec.run(prompt_ids=[5, 6], max_new_tokens=4, top_p=0.0)
    problem = validate(config(planted_pair["target"], planted_pair["draft"], sampling={"top_p": 0.0})).errors[0]
    assert str(problem) in str(call.value)


# -- 5. errors that used to pass validate and crash generate --------------------------------------------
CONFIG_FAULTS = [
    ({"sampling": {"temperature": 5e-324}}, "sampling.temperature"),
    ({"sampling": {"seed": -5}}, "sampling.seed"),
    ({"backend": {"device": "tpu"}}, "backend.device"),
    ({"backend": {"device": "cuda:7"}}, "backend.device"),
    ({"drafter": {"options": {"widht": 3}}}, "drafter.options"),
    ({"verifier": {"kind": "greedy", "options": {"x": 1}}}, "verifier.options"),
    ({"verifier": {"options": {"x": 1}}}, "verifier.options"),
]


@pytest.mark.parametrize("sections,field", CONFIG_FAULTS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(CONFIG_FAULTS)])
def test_config_faults_are_validator_problems(capsys, tmp_path, planted_pair, sections, field):
    if "cuda:7" in str(sections):
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available() and torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")
    data = config(planted_pair["target"], planted_pair["draft"])
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    report = validate(data)
    assert [p.field for p in report.errors] == [field], report.errors
    with pytest.raises(ValidationFailed):
        speculant.load_engine(data)
    path = tmp_path / "engine.json"
    path.write_text(__import__("json").dumps(data))
    assert main(["validate", str(path)]) == 1
    assert f"error: {field}:" in capsys.readouterr().out
    code = main(["generate", "--config", str(path), "hi"])
    err = capsys.readouterr().err
    assert code == 2 and field in err and "Traceback" not in err


def test_plugin_that_fails_to_import_is_an_error(capsys, tmp_path, planted_pair):
    path = tmp_path / "engine.json"
    path.write_text(__import__("json").dumps(config(planted_pair["target"], planted_pair["draft"])))
    assert main(["validate", "-p", "speculant_no_such_plugin", str(path)]) == 1
    out = capsys.readouterr().out
    assert "error: plugins: plugin command line (speculant_no_such_plugin) failed to load" in out
    code = main(["generate", "-p", "speculant_no_such_plugin", "--config", str(path), "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "speculant_no_such_plugin" in err and "Traceback" not in err


BROKEN_DESCRIBE = '''
from speculant.core.interfaces import DrafterFactory
from speculant.plugins.hookspecs import hookimpl


class Broken(DrafterFactory):
    name = "broken_describe"
    backends = ("torch",)

    def describe(self, config, target, backend):
        raise ZeroDivisionError("plugin bug")

    def load(self, config, info, backend, target):
        raise NotImplementedError


@hookimpl
def register_drafters(register):
    register(Broken())
'''


def test_plugin_whose_describe_raises_is_a_problem(capsys, tmp_path, monkeypatch, tiny_target):
    (tmp_path / "speculant_broken_describe.py").write_text(BROKEN_DESCRIBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "speculant_broken_describe", raising=False)
    path = tmp_path / "engine.json"
    path.write_text(__import__("json").dumps(config(tiny_target, drafter={"kind": "broken_describe"})))
    assert main(["validate", "-p", "speculant_broken_describe", str(path)]) == 1
    out = capsys.readouterr().out
    assert "error: drafter.kind: the broken_describe drafter" in out and "raised ZeroDivisionError" in out
    assert "Traceback" not in out


def test_unexpected_errors_are_one_line_unless_debug(capsys, monkeypatch, tiny_target):
    from speculant import api

    def explode(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(api, "load_engine", explode)
    argv = ["generate", "--target", str(tiny_target), "--device", "cpu", "hi"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "OSError: disk on fire" in err and "--debug" in err
    with pytest.raises(OSError):
        main(["--debug", *argv])
    with pytest.raises(OSError):
        main([*argv[:1], "--debug", *argv[1:]])
