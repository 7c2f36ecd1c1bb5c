"""PNG plots of a benchmark summary (matplotlib, object API: no pyplot, no global backend).

Each plot is built from :class:`Series` first, which go into the summary JSON, so what a
figure shows is also machine-readable. Cells are grouped by the settings that label a series;
values of cells that differ only in other axes (e.g. workloads) are combined by the median,
per-position acceptance by pooling the counts.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from speculant.bench import stats as S
from speculant.bench.summary import BenchSummary, CellSummary, PlotSummary, Series


def _spec_label(cell: CellSummary, with_block: bool = True) -> str:
    p = cell.params
    parts = [p.drafter]
    if with_block:
        parts.append(f"b{cell.block_size_used or p.block_size}")
    if p.verifier != "auto":
        parts.append(p.verifier)
    if p.quantization != "off":
        parts.append(p.quantization)
    parts.append(p.sampling.label)
    return " ".join(parts)


def _with_backend(summary: BenchSummary) -> Callable[[CellSummary, str], str]:
    many = len({c.params.backend.label for c in summary.cells}) > 1

    def label(cell: CellSummary, text: str) -> str:
        return f"{text} [{cell.params.backend.label}]" if many else text

    return label


def _ok(summary: BenchSummary, spec: bool = True) -> list[CellSummary]:
    return [c for c in summary.cells if c.status == "ok" and (c.spec is not None) == spec]


def acceptance_series(summary: BenchSummary) -> list[Series]:
    label = _with_backend(summary)
    groups: dict[str, list[CellSummary]] = defaultdict(list)
    for cell in _ok(summary):
        groups[label(cell, _spec_label(cell))].append(cell)
    out = []
    for name, cells in groups.items():
        submitted = [0] * max(len(c.spec.submitted_per_position) for c in cells)
        accepted = list(submitted)
        for c in cells:
            for j, (s, a) in enumerate(zip(c.spec.submitted_per_position, c.spec.accepted_per_position)):
                submitted[j] += s
                accepted[j] += a
        rates = S.rates(submitted, accepted)
        out.append(Series(label=name, x=list(range(1, len(rates) + 1)), y=rates))
    return out


def _median_by(cells: Sequence[CellSummary], key: Callable[[CellSummary], str], x: Callable[[CellSummary], float | int],
               y: Callable[[CellSummary], float | None], panel: str | None = None) -> list[Series]:
    groups: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    for cell in cells:
        groups[key(cell)][x(cell)].append(y(cell))
    return [Series(label=name, x=sorted(points), y=[S.median(points[k]) for k in sorted(points)], panel=panel)
            for name, points in groups.items()]


def speedup_series(summary: BenchSummary) -> list[Series]:
    label = _with_backend(summary)
    return _median_by(_ok(summary), lambda c: label(c, _spec_label(c, with_block=False)),
                      lambda c: c.block_size_used or 0, lambda c: c.speedup)


def context_series(summary: BenchSummary) -> list[Series]:
    label = _with_backend(summary)
    spec = _ok(summary)
    with_plain = [c for c in summary.cells if c.status == "ok" and c.plain is not None]
    speed = _median_by(with_plain, lambda c: label(c, f"plain {c.params.sampling.label}"),
                       lambda c: c.params.context_tokens, lambda c: c.plain.decode_tokens_per_s, "decode tok/s")
    speed += _median_by(spec, lambda c: label(c, _spec_label(c)), lambda c: c.params.context_tokens,
                        lambda c: c.spec.decode_tokens_per_s, "decode tok/s")
    accept = _median_by(spec, lambda c: label(c, _spec_label(c)), lambda c: c.params.context_tokens,
                        lambda c: c.spec.mean_acceptance_length, "mean acceptance length")
    return speed + accept


def workload_series(summary: BenchSummary) -> list[Series]:
    label = _with_backend(summary)
    with_plain = [c for c in summary.cells if c.status == "ok" and c.plain is not None]
    workloads = sorted({c.params.workload for c in with_plain})
    out = []
    plain = _median_by(with_plain, lambda c: label(c, "plain"), lambda c: c.params.workload,
                       lambda c: c.plain.decode_tokens_per_s)
    spec = _median_by(_ok(summary), lambda c: label(c, _spec_label(c)), lambda c: c.params.workload,
                      lambda c: c.spec.decode_tokens_per_s)
    for series in plain + spec:  # one value per workload (None where a series has no cell)
        values = dict(zip(series.x, series.y))
        out.append(Series(label=series.label, x=workloads, y=[values.get(w) for w in workloads]))
    return out


PLOTS = (
    ("acceptance_by_position", "Acceptance rate by block position", "block position (1 = first proposal)",
     "acceptance rate", acceptance_series),
    ("speedup_vs_block_size", "Decode speed-up vs block size", "block size", "speed-up (plain / spec TPOT)",
     speedup_series),
    ("context_length", "Decode speed and acceptance vs context length", "context length (tokens)", "",
     context_series),
    ("workloads", "Speculative vs plain decode speed per workload", "workload", "decode tok/s", workload_series),
)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _style(labels: Sequence[str]) -> dict[str, dict]:
    """A colour per series (tab10, tab20 beyond ten), a marker per drafter kind, dashes for plain."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    kinds = list(dict.fromkeys(label.split()[0] for label in labels))
    return {label: {"color": cmap(i % cmap.N), "marker": MARKERS[kinds.index(label.split()[0]) % len(MARKERS)],
                    "linestyle": "--" if label.startswith("plain") else "-"}
            for i, label in enumerate(labels)}


def build_figures(summary: BenchSummary, folder: str = "plots") -> list[tuple[object, PlotSummary]]:
    """(matplotlib Figure, its PlotSummary) for every plot; figures are not yet saved."""
    from matplotlib.figure import Figure

    out = []
    for name, title, x_label, y_label, series_fn in PLOTS:
        series = series_fn(summary)
        panels = list(dict.fromkeys(s.panel for s in series)) or [None]
        style = _style(list(dict.fromkeys(s.label for s in series)))
        widest = max((sum(1 for s in series if s.panel == p) for p in panels), default=0)
        legend_width = 0.0 if widest <= 4 else (3.2 if widest <= 18 else 6.0)
        fig = Figure(figsize=(6.5 * len(panels) + legend_width * len(panels), 4.8), dpi=110, layout="constrained")
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, panel in zip(axes, panels):
            members = [s for s in series if s.panel == panel]
            if name == "workloads":
                _bars(ax, members, style)
            else:
                for s in members:
                    pts = [(x, y) for x, y in zip(s.x, s.y) if y is not None]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=s.label, **style[s.label])
            ax.set_xlabel(x_label)
            ax.set_ylabel(panel or y_label)
            ax.grid(True, alpha=0.3)
            if name == "speedup_vs_block_size":
                ax.axhline(1.0, color="grey", linewidth=1, linestyle=":")
            if name == "acceptance_by_position":
                ax.set_ylim(0, 1.05)
            if members and legend_width:
                ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                          ncols=1 if len(members) <= 18 else 2)
            elif members:
                ax.legend(fontsize="small")
            else:
                ax.text(0.5, 0.5, "no finished cells to plot", ha="center", va="center", transform=ax.transAxes)
        fig.suptitle(title)
        out.append((fig, PlotSummary(name=name, file=f"{folder}/{name}.png", title=title, x_label=x_label,
                                     y_label=y_label, series=series)))
    return out


def _bars(ax, series: Sequence[Series], style: dict[str, dict]) -> None:
    if not series:
        return
    groups = list(series[0].x)
    width = 0.8 / len(series)
    for i, s in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0.0 for v in s.y], width=width, label=s.label,
               color=style[s.label]["color"], hatch="//" if s.label.startswith("plain") else None)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])


def write_plots(summary: BenchSummary, out: Path) -> list[PlotSummary]:
    (out / "plots").mkdir(parents=True, exist_ok=True)
    infos = []
    for fig, info in build_figures(summary):
        fig.savefig(out / info.file)
        infos.append(info)
    return infos
