"""How convgrad and PyTorch scale with threads, layer by layer.

    python -m benchmarks.scaling [--sets resnet50,mobilenet_v2] [--ops data,weights,fwd]
                                 [--threads 1,2,4,...] [--batch 8] [--dtype f32]
                                 [--data-format NXC] [--min-time 0.2] [--limit N]
                                 [--layers A,B] [--out DIR]

Every layer of the sets (benchmarks.shapes) and every op is timed as bench.py times it
(benchmarks.cases: convgrad's call and PyTorch's on the same data, in turns), at each
thread count: 1, 2, 4, ... up to the CPUs this process may run on (the default), with
PyTorch at the same count. A row gives each library's GFLOP/s and its parallel
efficiency, GFLOP/s per thread against its own 1-thread GFLOP/s (1.0: perfect
scaling), and the summary the geometric mean of the efficiencies per op and thread
count. Writes scaling.csv and scaling.json (with the machine) to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import convgrad
from benchmarks.cases import Row, prepare, run_case
from benchmarks.machine import Peak, environment, machine_info
from benchmarks.reports import fmt
from benchmarks.shapes import DEFAULT_SHAPES_DIR, DTYPES, OPS, SETS, load_sets
from benchmarks.tensors import torch
from benchmarks.timing import geomean, int_list
from convgrad.cpu import selected_isa

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "scaling"


def default_threads() -> list[int]:
    """1, 2, 4, ... up to the CPUs this process may run on, that count last."""
    most = len(os.sched_getaffinity(0))
    counts = [1 << i for i in range(most.bit_length()) if 1 << i < most]
    return [*counts, most]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="resnet50,mobilenet_v2",
                        help="comma-separated shape sets (default resnet50,mobilenet_v2)")
    parser.add_argument("--ops", default="data,weights,fwd",
                        help=f"comma-separated subset of {list(OPS)} (default data,weights,fwd)")
    parser.add_argument("--threads", type=int_list, default=None,
                        help="comma-separated thread counts (default 1, 2, 4, ... and the "
                             "CPUs this process may run on)")
    parser.add_argument("--batch", type=int, default=8, help="batch (default 8)")
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"])
    parser.add_argument("--min-time", type=float, default=0.2,
                        help="seconds of calls per timing, at least 3 calls (default 0.2)")
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N shapes of each set")
    parser.add_argument("--layers", default=None,
                        help="comma-separated substrings: only the layers whose name has one")
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    args.sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not args.sets or any(s not in SETS for s in args.sets):
        parser.error(f"--sets {','.join(args.sets)}: expected a subset of {list(SETS)}")
    if not args.ops or any(o not in OPS for o in args.ops):
        parser.error(f"--ops {','.join(args.ops)}: expected a subset of {list(OPS)}")
    args.threads = sorted(set(args.threads or default_threads()))
    if 1 not in args.threads:
        args.threads.insert(0, 1)  # the efficiencies' base
    args.layers = [p.strip() for p in (args.layers or "").split(",") if p.strip()]
    if torch is None:
        parser.error("PyTorch is not installed: pip install -e '.[bench]'")
    # what benchmarks.cases reads besides
    args.weights_format, args.no_torch, args.tune, args.alone = None, False, False, False
    return args


def efficiencies(rows: list[Row]) -> list[dict]:
    """Each row with its library's GFLOP/s per thread over its 1-thread GFLOP/s."""
    base = {(r.shape_set, r.layer, r.op): r for r in rows if r.threads == 1}
    out = []
    for r in rows:
        one = base[(r.shape_set, r.layer, r.op)]
        record = {"set": r.shape_set, "layer": r.layer, "op": r.op, "threads": r.threads,
                  "ours_gflops": r.ours_gflops, "torch_gflops": r.torch_gflops,
                  "ratio": r.ratio, "ours_pct_peak": r.ours_pct_peak,
                  "ours_efficiency": None, "torch_efficiency": None}
        for name in ("ours", "torch"):
            single, now = getattr(one, f"{name}_gflops"), getattr(r, f"{name}_gflops")
            if single and now:
                record[f"{name}_efficiency"] = now / r.threads / single
        out.append(record)
    return out


def summary(records: list[dict]) -> list[dict]:
    """Geometric means per (op, threads) of both libraries' efficiencies and the ratios."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["op"], record["threads"]), []).append(record)
    return [{"op": op, "threads": threads, "layers": len(group),
             **{key: geomean([r[key] for r in group if r[key]])
                for key in ("ours_efficiency", "torch_efficiency", "ratio")}}
            for (op, threads), group in sorted(groups.items())]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = load_sets(args.sets, args.shapes_dir, args.limit, args.layers)
    if not shapes:
        print("no shapes to run", file=sys.stderr)
        return 1
    saved_torch_threads = torch.get_num_threads()
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(environment({
            "CONVGRAD_AOT_PATH": "", "CONVGRAD_CACHE_DIR": stack.enter_context(
                tempfile.TemporaryDirectory(prefix="convgrad-scaling-cache-"))}))
        stack.callback(convgrad.set_num_threads, None)
        stack.callback(torch.set_num_threads, saved_torch_threads)
        peak = Peak(selected_isa(), amx=args.dtype == "bf16")
        machine = machine_info(peak.measure())
        print(f"{machine['cpu']}, {len(os.sched_getaffinity(0))} CPUs for this process; "
              f"convgrad {machine['isa']}, torch {machine['torch']}; threads "
              f"{','.join(map(str, args.threads))}; batch {args.batch}, {args.dtype}, "
              f"{args.data_format}", flush=True)
        rng = np.random.default_rng(0)
        for (shape_set, conv), op in itertools.product(shapes, args.ops):
            case = prepare(conv, op, shape_set, args, rng)
            rows += run_case(case, args.threads, args, peak)
            print(f"  {conv.name} {op}: " + ", ".join(
                f"x{r.threads} {fmt(r.ours_gflops, 1)}/{fmt(r.torch_gflops, 1)}"
                for r in rows[-len(args.threads):]) + " GFLOP/s (convgrad/torch)",
                file=sys.stderr, flush=True)
    records = efficiencies(rows)
    means = summary(records)
    print(f"\n{'op':8} {'threads':>7} {'layers':>6} {'convgrad eff':>12} {'torch eff':>9} "
          f"{'ratio':>6}")
    for m in means:
        print(f"{m['op']:8} {m['threads']:>7} {m['layers']:>6} "
              f"{fmt(m['ours_efficiency'], 3):>12} {fmt(m['torch_efficiency'], 3):>9} "
              f"{fmt(m['ratio'], 3):>6}")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "scaling.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "scaling.json").write_text(json.dumps(
        {"machine": machine, "settings": settings, "summary": means, "rows": records},
        indent=1))
    print(f"\nwrote scaling.csv, scaling.json to {args.out}")
    return 1 if any(r.note.startswith("MISMATCH") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
