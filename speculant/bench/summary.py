"""The summary of a benchmark run: a pydantic schema, its construction from the raw runs, and
the Markdown table."""

from __future__ import annotations

import datetime as _dt
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict

from speculant.bench import stats as S
from speculant.bench.matrix import Cell

SCHEMA_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RoleSummary(_Strict):
    """Medians over the runs of one side (plain or speculative) of a cell."""

    runs: int
    ttft_s: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    tpot_s: float | None
    total_s: float | None
    new_tokens: float | None
    verify_steps: float | None
    peak_memory_bytes: int | None
    stop_reasons: dict[str, int]
    mean_acceptance_length: float | None = None
    per_position_acceptance: list[float] = []
    submitted_per_position: list[int] = []
    accepted_per_position: list[int] = []


class ColumnSummary(_Strict):
    """An extra implementation run on the same weights and prompts (reference, transformers)."""

    status: Literal["ok", "unavailable", "not_applicable", "failed"]
    reason: str | None = None
    runs: int = 0
    decode_tokens_per_s: float | None = None
    mean_acceptance_length: float | None = None
    ratio: float | None = None  # speculant speculative decode tok/s / this column's decode tok/s
    token_match: bool | None = None  # greedy: its output equals speculant's plain output, all prompts
    token_match_rate: float | None = None


class CellSummary(_Strict):
    key: str
    label: str
    status: Literal["ok", "skipped", "failed", "pending"]
    reason: str | None = None
    params: Cell
    block_size_used: int | None = None
    plain: RoleSummary | None = None
    spec: RoleSummary | None = None
    speedup: float | None = None  # median over repeats of plain TPOT / speculative TPOT
    speedup_per_repeat: list[float] = []
    e2e_speedup: float | None = None  # the same with end-to-end time (prefill included)
    token_match: bool | None = None  # greedy only: every speculative run equals its plain run
    token_match_rate: float | None = None
    reference: ColumnSummary | None = None
    transformers: ColumnSummary | None = None
    attempt: str | None = None


class Series(_Strict):
    label: str
    x: list[float | int | str]
    y: list[float | None]
    panel: str | None = None


class PlotSummary(_Strict):
    name: str
    file: str
    title: str
    x_label: str
    y_label: str
    series: list[Series]


class BenchSummary(_Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    created: str
    out: str
    complete: bool
    config: dict[str, Any]
    conditions: dict[str, Any]
    sessions: list[dict[str, Any]]
    notes: list[str]
    totals: dict[str, int]
    cells: list[CellSummary]
    plots: list[PlotSummary] = []


def role_summary(runs: Sequence[dict]) -> RoleSummary | None:
    if not runs:
        return None
    submitted, accepted = S.pooled_positions(runs)
    peaks = [r["peak_memory_bytes"] for r in runs if r.get("peak_memory_bytes") is not None]
    return RoleSummary(
        runs=len(runs),
        ttft_s=S.median(r["ttft_s"] for r in runs),
        prefill_tokens_per_s=S.repeat_median(runs, S.prefill_tokens_per_s),
        decode_tokens_per_s=S.repeat_median(runs, S.decode_tokens_per_s),
        tpot_s=S.repeat_median(runs, S.pooled_tpot),
        total_s=S.median(r["total_s"] for r in runs),
        new_tokens=S.median(r["new_tokens"] for r in runs),
        verify_steps=S.median(r["verify_steps"] for r in runs),
        peak_memory_bytes=max(peaks) if peaks else None,
        stop_reasons=S.stop_reasons(runs),
        mean_acceptance_length=S.mean_acceptance_length(runs),
        per_position_acceptance=S.rates(submitted, accepted),
        submitted_per_position=submitted,
        accepted_per_position=accepted,
    )


def cell_summary(cell: Cell, state: dict | None, runs: Sequence[dict]) -> CellSummary:
    """``state``: the cell's line in cells.jsonl (None: not run yet); ``runs``: its attempt's runs."""
    if state is None:
        return CellSummary(key=cell.key, label=cell.label, status="pending", params=cell)
    if state["status"] != "ok":
        return CellSummary(key=cell.key, label=cell.label, status=state["status"], reason=state.get("reason"),
                           params=cell, attempt=state.get("attempt"))
    plain = [r for r in runs if r["role"] == "plain"]
    spec = [r for r in runs if r["role"] == "spec"]
    per_repeat = S.speedups_per_repeat(plain, spec)
    matches = [r["token_match"] for r in spec if r.get("token_match") is not None]
    columns = state.get("columns", {})
    return CellSummary(
        key=cell.key, label=cell.label, status="ok", params=cell, attempt=state.get("attempt"),
        block_size_used=spec[0].get("block_size_used") if spec else None,
        plain=role_summary(plain), spec=role_summary(spec),
        speedup=S.median(per_repeat), speedup_per_repeat=per_repeat,
        e2e_speedup=S.median(S.speedups_per_repeat(plain, spec, field="total")),
        token_match=all(matches) if matches else None,
        token_match_rate=sum(matches) / len(matches) if matches else None,
        reference=column_summary(columns.get("reference"), [r for r in runs if r["role"] == "reference"], spec),
        transformers=column_summary(columns.get("transformers"), [], spec),
    )


def column_summary(state: dict | None, runs: Sequence[dict], spec: Sequence[dict]) -> ColumnSummary | None:
    if state is None:
        return None
    if state["status"] != "ok":
        return ColumnSummary(status=state["status"], reason=state.get("reason"))
    ours = S.repeat_median(spec, S.decode_tokens_per_s)
    theirs = S.decode_tokens_per_s(runs)
    matches = [r["token_match"] for r in runs if r.get("token_match") is not None]
    return ColumnSummary(
        status="ok", reason=state.get("reason"), runs=len(runs), decode_tokens_per_s=theirs,
        mean_acceptance_length=S.mean_acceptance_length(runs),
        ratio=ours / theirs if ours and theirs else None,
        token_match=all(matches) if matches else None,
        token_match_rate=sum(matches) / len(matches) if matches else None,
    )


def build_summary(out: str, config: dict, sessions: list[dict], notes: list[str], cells: Sequence[Cell],
                  states: dict[str, dict], runs_by_cell: dict[str, list[dict]]) -> BenchSummary:
    summaries = [cell_summary(c, states.get(c.key), runs_by_cell.get(c.key, [])) for c in cells]
    totals = {status: sum(1 for s in summaries if s.status == status) for status in ("ok", "skipped", "failed", "pending")}
    totals["runs"] = sum(len(runs_by_cell.get(c.key, [])) for c in cells if c.key in states)
    return BenchSummary(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), out=out,
        complete=totals["pending"] == 0, config=config, conditions=sessions[0] if sessions else {},
        sessions=sessions, notes=notes, totals=totals, cells=summaries,
    )


# -- Markdown ------------------------------------------------------------------------------
def _f(value: float | None, fmt: str = ".1f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _match(value: bool | None, rate: float | None) -> str:
    if value is None:
        return "–"
    return "yes" if value else f"no ({rate:.0%})"


def _column(col: ColumnSummary | None) -> str:
    if col is None:
        return "–"
    if col.status != "ok":
        return col.status.replace("_", " ")
    match = "" if col.token_match is None else (", match" if col.token_match else ", MISMATCH")
    return f"{_f(col.ratio, '.2f', '×')} (τ {_f(col.mean_acceptance_length, '.2f')}{match})"


def _pairs(data: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (data or {}).items())


def _peak(cell: CellSummary) -> float | None:
    peaks = [r.peak_memory_bytes for r in (cell.plain, cell.spec) if r is not None and r.peak_memory_bytes]
    return max(peaks) / 2**20 if peaks else None


def markdown(summary: BenchSummary) -> str:
    c = summary.conditions
    lines = ["# speculant bench", ""]
    packages = ", ".join(f"{k} {v}" for k, v in c.get("packages", {}).items())
    machine = c.get("machine", {})
    lines += [f"- packages: {packages}",
              f"- machine: {machine.get('processor') or machine.get('machine')}, {machine.get('cpu_count')} CPUs, "
              f"{machine.get('system')} {machine.get('release')}, Python {machine.get('python')}",
              f"- threads: {_pairs(c.get('threads')) or 'default'}; devices: {_pairs(c.get('devices')) or '–'}"]
    for path, digest in (c.get("models") or {}).items():
        lines.append(f"- model {path}: sha256 {str(digest)[:16]}… (config + safetensors headers)")
    s = summary.config
    lines += [f"- protocol: {s.get('warmup')} warm-up, {s.get('repeats')} repeats (medians), plain and speculative "
              f"interleaved in one process; ignore_eos={s.get('ignore_eos')}",
              "- speed-up = plain decode time per token / speculative decode time per token (TTFT excluded); "
              "e2e = the same ratio of end-to-end times; τ = mean acceptance length (tokens per verify step); "
              "peak memory: the device's peak per run on CUDA, the process's peak RSS so far on CPU", ""]
    if summary.notes:
        lines += [f"> {n}" for n in summary.notes] + [""]
    multi_target = len({cell.params.target for cell in summary.cells}) > 1
    head = (["target"] if multi_target else []) + [
        "workload", "drafter", "block", "verifier", "quant", "sampling", "ctx", "new", "backend", "plain tok/s",
        "spec tok/s", "speed-up", "e2e", "τ", "TTFT ms", "peak MiB", "match", "reference", "status"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in summary.cells:
        p = cell.params
        plain_only = p.is_plain
        row = ([p.target_name] if multi_target else []) + [
            p.workload, "none" if plain_only else p.drafter,
            "–" if plain_only else str(cell.block_size_used or p.block_size or "trained"),
            "–" if plain_only else p.verifier, "–" if plain_only else p.quantization, p.sampling.label,
            str(p.context_tokens), str(p.max_new_tokens), p.backend.label,
            _f(cell.plain.decode_tokens_per_s if cell.plain else None),
            _f(cell.spec.decode_tokens_per_s if cell.spec else None),
            _f(cell.speedup, ".2f", "×"), _f(cell.e2e_speedup, ".2f", "×"),
            _f(cell.spec.mean_acceptance_length if cell.spec else None, ".2f"),
            _f((cell.spec or cell.plain).ttft_s * 1000 if (cell.spec or cell.plain) else None, ".0f"),
            _f(_peak(cell), ".0f"),
            _match(cell.token_match, cell.token_match_rate), _column(cell.reference),
            cell.status if not cell.reason else f"{cell.status}: {cell.reason[:80]}",
        ]
        lines.append("| " + " | ".join(r.replace("|", "/") for r in row) + " |")
    if summary.plots:
        lines += ["", "## Plots", ""] + [f"![{p.title}]({p.file})" for p in summary.plots]
    lines.append("")
    return "\n".join(lines)
