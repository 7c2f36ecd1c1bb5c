"""Running a benchmark matrix into an output folder, resumably.

The folder holds:

- ``runs.jsonl``: one line per measured run, appended as soon as it finishes;
- ``cells.jsonl``: one line per cell outcome (ok / skipped / failed) with the attempt id whose
  runs count; a cell is finished once it has an ``ok`` line, and a rerun skips it;
- ``manifest.json``: the config and the fixed conditions of every session that wrote here;
- ``summary.json`` (validated by :class:`~speculant.bench.summary.BenchSummary`), ``summary.md``
  and ``plots/*.png``, rewritten at the end of every session (also an interrupted one).

Runs of an attempt that did not finish (interrupted, or a run failed) stay in runs.jsonl but
are ignored; the cell is measured again from the start.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from speculant.api import plugin_registry
from speculant.bench import conditions as C
from speculant.bench.config import BenchConfig, WorkloadSpec
from speculant.bench.engines import CellSkipped, EnginePool
from speculant.bench.matrix import Cell, expand
from speculant.bench.measure import PromptCase, measure_cell, run_seed, tokens_digest, warm_up
from speculant.bench.reference import find_reference_runner, reference_applicability, transformers_status
from speculant.bench.summary import BenchSummary, build_summary, markdown
from speculant.bench.workloads import build_prompt_ids, load_workload
from speculant.core.errors import SpeculantError

FILES = ("runs.jsonl", "cells.jsonl", "manifest.json", "summary.json", "summary.md")


class BenchInterrupted(SpeculantError):
    """The run stopped early on purpose (``stop_after_runs``); finished cells are kept."""


class OutputFolder:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def clear(self) -> None:
        for name in FILES:
            (self.path / name).unlink(missing_ok=True)
        for png in (self.path / "plots").glob("*.png") if (self.path / "plots").is_dir() else []:
            png.unlink()

    def read_lines(self, name: str) -> list[dict]:
        f = self.path / name
        if not f.is_file():
            return []
        out = []
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut short by a crash
                continue
        return out

    def append(self, name: str, record: dict) -> None:
        with (self.path / name).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    def finished(self) -> dict[str, dict]:
        """Cell key -> its latest ``ok`` line."""
        return {s["cell"]: s for s in self.read_lines("cells.jsonl") if s.get("status") == "ok"}

    def runs_by_cell(self, states: dict[str, dict]) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for r in self.read_lines("runs.jsonl"):
            state = states.get(r.get("cell"))
            if state is not None and r.get("attempt") == state.get("attempt"):
                out.setdefault(r["cell"], []).append(r)
        return out

    def manifest(self) -> dict:
        f = self.path / "manifest.json"
        return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}

    def write(self, name: str, text: str) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(self.path / name)


class _Session:
    """One invocation: engines, counters, progress and the run limit."""

    def __init__(self, config: BenchConfig, folder: OutputFolder, pool: EnginePool, progress: Any,
                 stop_after_runs: int | None, on_run: Callable[[dict], None] | None) -> None:
        self.config, self.folder, self.pool, self.progress = config, folder, pool, progress
        self.stop_after_runs, self.on_run = stop_after_runs, on_run
        self.runs = 0
        self.task = None
        self.workloads: dict[str, WorkloadSpec] = {w.name: w for w in config.matrix.workloads}
        self._prompt_cache: dict[tuple, list[PromptCase]] = {}
        self._reference: tuple | None = None
        self._transformers: dict[str | None, dict] = {}

    def emit(self, record: dict) -> None:
        self.folder.append("runs.jsonl", record)
        self.runs += 1
        if self.progress is not None:
            self.progress.advance(self.task)
        if self.on_run is not None:
            self.on_run(record)
        if self.stop_after_runs is not None and self.runs >= self.stop_after_runs:
            raise BenchInterrupted(f"stopped after {self.runs} runs as asked; rerun the same command to continue")

    def prompt_texts(self, workload: str) -> list[str]:
        w = self.workloads[workload]
        texts = load_workload(w.name, w.path, w.prompts)
        return texts[: self.config.prompts_per_workload] if self.config.prompts_per_workload else texts

    def prompts(self, cell: Cell, tokenizer: Any) -> list[PromptCase]:
        key = (cell.target, cell.workload, cell.context_tokens)
        if key not in self._prompt_cache:
            chat = self.workloads[cell.workload].chat_template
            self._prompt_cache[key] = [PromptCase(i, build_prompt_ids(tokenizer, text, cell.context_tokens, chat))
                                       for i, text in enumerate(self.prompt_texts(cell.workload))]
        return self._prompt_cache[key]

    def runs_per_cell(self, cell: Cell) -> int:
        return self.config.repeats * len(self.prompt_texts(cell.workload)) * (1 if cell.is_plain else 2)

    # -- one cell ------------------------------------------------------------------------
    def run_cell(self, cell: Cell) -> dict:
        attempt = uuid.uuid4().hex[:12]
        state = {"type": "cell", "cell": cell.key, "attempt": attempt, "label": cell.label}
        start = self.runs
        try:
            plain, spec = self.pool.engines(cell)
            prompts = self.prompts(cell, plain.tokenizer)
            warm_up(cell, self.config, prompts, plain, spec)
            plain_tokens = measure_cell(cell, self.config, prompts, plain, spec, attempt, self.emit)
        except CellSkipped as exc:
            return {**state, "status": "skipped", "reason": str(exc)}
        except (BenchInterrupted, KeyboardInterrupt):
            raise
        except Exception as exc:  # one broken cell must not end the matrix; the reason is reported
            self._advance(self.runs_per_cell(cell) - (self.runs - start))
            return {**state, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        columns = {}
        if self.config.reference and spec is not None:
            columns["reference"] = self.reference_column(cell, prompts, plain_tokens, spec, attempt)
            columns["transformers"] = self.transformers_column(cell)
        return {**state, "status": "ok", "columns": columns}

    def _advance(self, n: int) -> None:
        if self.progress is not None and n > 0:
            self.progress.advance(self.task, n)

    # -- extra columns -------------------------------------------------------------------
    def reference_column(self, cell: Cell, prompts: list[PromptCase], plain_tokens: dict[int, list[int]], spec,
                         attempt: str) -> dict:
        why_not = reference_applicability(cell)
        if why_not:
            return {"status": "not_applicable", "reason": why_not}
        if self._reference is None:
            self._reference = find_reference_runner()
        runner, description = self._reference
        if runner is None:
            return {"status": "unavailable", "reason": description}
        eos = [] if self.config.ignore_eos else sorted(spec.target.info.eos_token_ids)
        jobs = [{"backend": cell.backend.kind, "target_dir": cell.target, "draft_dir": cell.draft_path,
                 "prompt_ids": list(p.ids), "max_new_tokens": cell.max_new_tokens,
                 "block_size": cell.block_size or spec.block_size, "temperature": cell.sampling.temperature,
                 "top_p": cell.sampling.top_p, "top_k": cell.sampling.top_k,
                 "seed": run_seed(self.config, 0, p.index), "stop_token_ids": eos} for p in prompts]
        try:
            results = runner(jobs)
        except (BenchInterrupted, KeyboardInterrupt):
            raise
        except Exception as exc:
            return {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        for prompt, job, out in zip(prompts, jobs, results):
            self.folder.append("runs.jsonl", reference_record(cell, attempt, prompt, job["seed"], out,
                                                              plain_tokens.get(prompt.index)))
        return {"status": "ok", "reason": description}

    def transformers_column(self, cell: Cell) -> dict:
        if cell.draft_path not in self._transformers:
            try:
                _, reason = transformers_status(cell.draft_path)
            except Exception as exc:  # an unexpected transformers layout: report, do not fail the cell
                reason = f"cannot check transformers: {type(exc).__name__}: {exc}"
            self._transformers[cell.draft_path] = {"status": "unavailable", "reason": reason}
        return self._transformers[cell.draft_path]


def reference_record(cell: Cell, attempt: str, prompt: PromptCase, seed: int, out: dict,
                     plain_tokens: list[int] | None) -> dict:
    tokens = [int(t) for t in out.get("tokens", [])]
    acceptance = [int(a) for a in out.get("acceptance_lengths", [])]
    ttft = float(out.get("ttft_s") or 0.0)
    decode = float(out.get("decode_s") or 0.0)
    return {
        "type": "run", "cell": cell.key, "attempt": attempt, "role": "reference", "repeat": 0,
        "prompt_index": prompt.index, "order": 2, "seed": seed, "prompt_tokens": len(prompt.ids),
        "ttft_s": ttft, "prefill_s": ttft, "decode_s": decode, "total_s": float(out.get("wall_s") or ttft + decode),
        "new_tokens": len(tokens), "acceptance_lengths": acceptance, "verify_steps": len(acceptance),
        "submitted_per_position": [], "accepted_per_position": [], "peak_memory_bytes": None,
        "stop_reason": "reference", "tokens_sha": tokens_digest(tokens),
        "token_match": (tokens == plain_tokens) if cell.sampling.is_greedy and plain_tokens is not None else None,
        "versions": out.get("versions"),
    }


# -- entry point ---------------------------------------------------------------------------
def run_bench(config: BenchConfig | dict | str | Path, *, registry: Any = None, progress: bool = True,
              fresh: bool = False, stop_after_runs: int | None = None, on_run: Callable[[dict], None] | None = None,
              console: Any = None) -> BenchSummary:
    """Run (or continue) the matrix; returns the summary also written to ``config.out``.

    ``stop_after_runs`` raises :class:`BenchInterrupted` after that many measured runs in this
    session (the reports are written first), for partial runs and resume tests. ``on_run`` sees
    each run record as it is written.
    """
    config = BenchConfig.load(config)
    openmp_note = quiet_openmp(config)
    if registry is None:
        registry = plugin_registry()
    folder = OutputFolder(config.out)
    if fresh:
        folder.clear()
    paths = [str(t.path) for t in config.targets] + sorted({str(config.drafter_path(d)) for d in config.matrix.drafters
                                                             if d.enabled and config.drafter_path(d) is not None})
    fingerprints = {p: C.folder_fingerprint(p) for p in paths}
    cells, notes = expand(config, fingerprints)
    notes += [openmp_note] if openmp_note else []
    manifest = folder.manifest()
    sessions = manifest.get("sessions", [])
    session = C.collect(fingerprints, config.model_dump(mode="json"))
    if sessions and C.comparable(sessions[0]) != C.comparable(session):
        notes.append("this run was resumed under different conditions (packages, machine or models changed "
                     "between sessions; see sessions in summary.json)")
    sessions.append(session)
    done = folder.finished()
    pending = [c for c in cells if c.key not in done]
    pool = EnginePool(registry, config.threads)
    bar = _progress(progress, console)
    s = _Session(config, folder, pool, bar, stop_after_runs, on_run)
    interrupted: BaseException | None = None
    try:
        with bar if bar is not None else nullcontext():
            if bar is not None:
                s.task = bar.add_task("starting", total=sum(s.runs_per_cell(c) for c in pending))
            for i, cell in enumerate(pending, 1):
                if bar is not None:
                    bar.update(s.task, description=f"cell {i}/{len(pending)} {_short(cell)}")
                state = s.run_cell(cell)
                folder.append("cells.jsonl", state)
                if state["status"] != "ok":
                    if state["status"] == "skipped":
                        s._advance(s.runs_per_cell(cell))
                    _say(bar, console, f"{state['status']}: {cell.label}: {state['reason']}")
    except (BenchInterrupted, KeyboardInterrupt) as exc:
        interrupted = exc
    session.update(threads=C.threads(), devices=pool.devices, runs=s.runs,
                   interrupted=None if interrupted is None else str(interrupted) or "KeyboardInterrupt")
    folder.write("manifest.json", json.dumps({"config": config.model_dump(mode="json"), "sessions": sessions},
                                             indent=2, default=str))
    summary = write_reports(config, folder, cells, notes, sessions)
    if interrupted is not None:
        raise interrupted
    return summary


def quiet_openmp(config: BenchConfig) -> str | None:
    """Ask PyTorch's OpenMP workers to sleep between ops when MLX cells share the process; a note
    when that came too late.

    They spin by default, and on a small CPU the spinners take the cores MLX runs on: measured
    on 2 cores, MLX plain decoding ran 20 % slower after a PyTorch cell. OpenMP reads the
    setting once, when torch is imported.
    """
    if not any(b.kind == "mlx" for b in config.matrix.backends) or "OMP_WAIT_POLICY" in os.environ:
        return None
    if "torch" in sys.modules:
        return ("torch was imported before the benchmark started, so its OpenMP workers may spin and slow the "
                "MLX cells; set OMP_WAIT_POLICY=PASSIVE before starting to avoid that")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return None


def write_reports(config: BenchConfig, folder: OutputFolder, cells: list[Cell], notes: list[str],
                  sessions: list[dict]) -> BenchSummary:
    states = folder.finished()
    failed = {}
    for line in folder.read_lines("cells.jsonl"):
        if line.get("status") in ("skipped", "failed") and line["cell"] not in states:
            failed[line["cell"]] = line
    runs = folder.runs_by_cell(states)
    notes = list(notes)
    for state in states.values():
        col = state.get("columns", {}).get("transformers")
        if col and col["status"] != "ok":
            text = f"transformers column: {col['status']}: {col['reason']}"
            if text not in notes:
                notes.append(text)
    summary = build_summary(str(folder.path), config.model_dump(mode="json"), sessions, notes, cells,
                            {**failed, **states}, runs)
    if config.plots:
        from speculant.bench.plots import write_plots

        summary.plots = write_plots(summary, folder.path)
    summary = BenchSummary.model_validate(summary.model_dump())  # the file always matches the schema
    folder.write("summary.json", summary.model_dump_json(indent=2))
    folder.write("summary.md", markdown(summary))
    return summary


def _progress(enabled: bool, console: Any):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(bar_width=16), MofNCompleteColumn(),
                    TextColumn("runs"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=console or Console(stderr=True))


def _short(cell: Cell) -> str:
    """The cell for the progress line: what varies most, in few characters."""
    head = "plain" if cell.is_plain else f"{cell.drafter} b{cell.block_size or 'T'}"
    return f"{cell.workload} {head} {cell.sampling.label} ctx{cell.context_tokens} n{cell.max_new_tokens}"


def _say(bar: Any, console: Any, text: str) -> None:
    if bar is not None:
        bar.console.print(text, markup=False, highlight=False)
    elif console is not None:
        console.print(text, markup=False, highlight=False)
