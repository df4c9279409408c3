"""The benchmarks' outputs: aligned text tables, the CSV of a list of rows and the files
of a run (table.txt, results.csv, results.json); bench.py's table, geometric means per
op and thread count, and plot. Imports neither PyTorch nor jax."""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.timing import geomean

if TYPE_CHECKING:
    from benchmarks.cases import Row


def fmt(value: float | None, digits: int, kind: str = "f") -> str:
    """`value` with `digits` digits after the point (kind "e": in exponent notation);
    "-" for None."""
    return "-" if value is None else f"{value:.{digits}{kind}}"


def columns(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """A text table: each column as wide as its widest cell, a rule under the header."""
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
    text = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            for line in [header, *lines]]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def table(rows: list[Row]) -> str:
    tuned = any(r.tuned_gflops for r in rows)
    amx = any(r.amx_peak_gflops for r in rows)
    header = ["layer", "op", "threads", "ours GFLOP/s", "torch GFLOP/s", "ratio",
              "ours % peak", "fastest % peak", "torch % peak", "faults/call",
              "first call ms"]
    header += ["ours % AMX", "fastest % AMX", "torch % AMX"] if amx else []
    header += ["tuned GFLOP/s", "tuned ratio", "tuned gain", "tuned plan"] if tuned else []
    lines = [[r.layer, r.op, str(r.threads), fmt(r.ours_gflops, 2), fmt(r.torch_gflops, 2),
              fmt(r.ratio, 3), fmt(r.ours_pct_peak, 1), fmt(r.ours_best_pct_peak, 1),
              fmt(r.torch_pct_peak, 1), fmt(r.ours_faults_per_call, 0),
              fmt(r.first_call_ms, 0)]
             + ([fmt(r.ours_pct_amx_peak, 1), fmt(r.ours_best_pct_amx_peak, 1),
                 fmt(r.torch_pct_amx_peak, 1)] if amx else [])
             + ([fmt(r.tuned_gflops, 2), fmt(r.tuned_ratio, 3), fmt(r.tuned_gain, 3),
                 r.tuned_plan] if tuned else [])
             for r in rows]
    header.append("note")
    for line, r in zip(lines, rows, strict=True):
        line.append(r.note)
    return columns(header, lines)


def geomeans(rows: list[Row]) -> list[dict]:
    """Geometric means per (op, threads): of the ratios to PyTorch, of convgrad's shares
    of the peak (median and fastest call), and with --tune of the tuned plans' ratios to
    PyTorch and their gains over the rules' plans."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        if row.ours_gflops or row.tuned_gain:
            groups.setdefault((row.op, row.threads), []).append(row)
    means = []
    for (op, threads), group in sorted(groups.items()):
        ratios = [r.ratio for r in group if r.ratio]
        mean = {"op": op, "threads": threads, "layers": len(ratios),
                "geomean_ratio": geomean(ratios),
                "pct_peak": geomean([r.ours_pct_peak for r in group if r.ours_pct_peak]),
                "best_pct_peak": geomean([r.ours_best_pct_peak for r in group
                                          if r.ours_best_pct_peak])}
        if any(r.ours_pct_amx_peak for r in group):
            mean["pct_amx_peak"] = geomean([r.ours_pct_amx_peak for r in group
                                            if r.ours_pct_amx_peak])
            mean["torch_pct_amx_peak"] = geomean([r.torch_pct_amx_peak for r in group
                                                  if r.torch_pct_amx_peak])
        if any(r.tuned_gain for r in group):
            mean["tuned_geomean_ratio"] = geomean([r.tuned_ratio for r in group
                                                    if r.tuned_ratio])
            mean["tuned_geomean_gain"] = geomean([r.tuned_gain for r in group
                                                   if r.tuned_gain])
        means.append(mean)
    return means


def write_csv(rows: Sequence, path: Path, row_type: type | None = None) -> None:
    """Dataclass rows as a CSV, a column per field of `row_type` (by default the rows')."""
    row_type = row_type or type(rows[0])
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(row_type)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def settings(args: argparse.Namespace) -> dict:
    """A run's options for its JSON record (paths as text; a worker's file left out)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k != "worker"}


def write_results(out: Path, command: str, report: str, rows: Sequence, row_type: type,
                  **record) -> None:
    """A run's files in `out`: table.txt (the command and the report it printed),
    results.csv (the rows) and results.json ({"command", **record, "rows"})."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.txt").write_text(f"{command}\n\n{report}\n")
    write_csv(rows, out / "results.csv", row_type)
    (out / "results.json").write_text(json.dumps(
        {"command": command, **record, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")


def plot(rows: list[Row], means: list[dict], path: Path, title: str) -> bool:
    """Ratio per layer, one bar per (op, threads), log scale, a line at 1.0.
    False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    layers = list(dict.fromkeys((r.shape_set, r.layer) for r in rows))
    series = list(dict.fromkeys((r.op, r.threads) for r in rows))
    mean_of = {(m["op"], m["threads"]): m["geomean_ratio"] for m in means}
    width = 0.8 / max(1, len(series))
    figure, axes = plt.subplots(figsize=(max(8.0, 0.5 * len(layers) * max(1, len(series))
                                             ** 0.5 + 2), 5.5))
    for s, (op, threads) in enumerate(series):
        ratio = {(r.shape_set, r.layer): r.ratio for r in rows
                 if (r.op, r.threads) == (op, threads) and r.ratio}
        xs = [i + (s - (len(series) - 1) / 2) * width
              for i, key in enumerate(layers) if key in ratio]
        ys = [ratio[key] for key in layers if key in ratio]
        mean = mean_of.get((op, threads))
        label = f"{op}, {threads} thread{'s' if threads > 1 else ''}" + (
            f" (geomean {mean:.3g})" if mean else "")
        axes.bar(xs, ys, width=width, label=label)
    axes.axhline(1.0, color="black", linewidth=1)
    axes.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.yaxis.set_major_formatter(plain)
    axes.yaxis.set_minor_formatter(plain)
    axes.set_xticks(range(len(layers)))
    axes.set_xticklabels([name for _, name in layers], rotation=60, ha="right", fontsize=8)
    axes.set_ylabel("convgrad GFLOP/s / PyTorch GFLOP/s")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
