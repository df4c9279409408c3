"""convgrad against LIBXSMM-DNN's own convolution driver: same layers, same threads.

    python -m benchmarks.libxsmm --driver PATH/libxsmm-dnn/tests/conv/layer_example
                                 [--set resnet50] [--layers A,B] [--ops fwd,data,weights]
                                 [--threads 1] [--batch 8] [--data-format NXC|NCX]
                                 [--rounds 3] [--min-time 0.3] [--physical-pads]
                                 [--block 64] [--isa avx2|avx512|avx512bf16] [--out DIR]

LIBXSMM-DNN (github.com/libxsmm/libxsmm-dnn, with LIBXSMM as its submodule) is built
from source beside this checkout; nothing of it is in this repository:

    git clone --recursive https://github.com/libxsmm/libxsmm-dnn
    make -C libxsmm-dnn/libxsmm -j STATIC=1 BLAS=0
    make -C libxsmm-dnn -j STATIC=1
    make -C libxsmm-dnn/tests/conv -j STATIC=1

Its driver, tests/conv/layer_example, runs one layer's forward (FP: convgrad's "fwd"),
backward data (BP: "data") and weight update (WU: "weights") passes in LIBXSMM's
blocked layouts (channel blocks of --block, 64 as in its run_convs.sh), checks each
against its own naive reference, and prints the mean time of its timed calls
(PERFDUMP lines). It has no data pass for a layer of fewer than 16 input channels
(ResNet-50's conv1). By default its tensors carry no physical padding, as convgrad's
do not (its padding_mode 0); --physical-pads gives it padded buffers (its mode 1, what
run_convs.sh measures), which spares it the borders' work. --isa puts both on one path:
convgrad's (CONVGRAD_ISA) and LIBXSMM's JIT target (LIBXSMM_TARGET: hsw, skx or cpx).

Every round runs each layer's driver process (pinned to the first T CPUs this process
may use, OMP_NUM_THREADS=T) and then convgrad's calls on the same layer in this process,
pinned the same way, timed alone (benchmarks.timing.timed_calls) between two short
measurements of the FMA peak. The ratio is convgrad's mean time over LIBXSMM's (the
driver's own statistic; above 1 means convgrad is faster); a row gives also convgrad's
median and fastest call and both libraries' shares of the peak. Rows are the medians
over the rounds. Writes table.txt, results.csv and results.json to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import convgrad
from benchmarks.cases import layer_inputs
from benchmarks.machine import Peak, cpu_info, environment, pinned
from benchmarks.reports import columns, fmt, settings, write_results
from benchmarks.shapes import DEFAULT_SHAPES_DIR, OPS, SETS, load_sets
from benchmarks.timing import geomean, int_list, median_present, timed_calls
from convgrad import api
from convgrad.codegen.layers import ConvShape, conv_layers
from convgrad.cpu import available_isas, selected_isa

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "libxsmm"
PASSES = {"fwd": "FP", "data": "BP", "weights": "WU"}  # convgrad's op: the driver's pass
LIBXSMM_TARGETS = {"avx2": "hsw", "avx512": "skx", "avx512bf16": "cpx"}  # its names of them
# PERFDUMP,<pass>,<version>,threads,N,C,K,W,H,S,R,stride,padw,padh,seconds,GFLOP/s,
# l1_ref,l1_tst,l2_abs,l2_rel,linf_abs,linf_rel,normf_rel
_PERFDUMP = re.compile(r"^PERFDUMP,(FP|BP|WU),([^,]*),(.*)$", re.MULTILINE)


@dataclass
class Row:
    """One (layer, op, threads) comparison; the CSV columns."""

    shape_set: str
    layer: str
    op: str
    threads: int
    batch: int
    data_format: str
    flops: int
    ours_mean_ms: float | None = None
    ours_median_ms: float | None = None
    ours_best_ms: float | None = None
    ours_gflops: float | None = None  # from the mean, as the driver's
    ours_best_gflops: float | None = None
    ours_calls: int = 0
    libxsmm_ms: float | None = None  # the driver's mean time per call
    libxsmm_gflops: float | None = None
    libxsmm_calls: int = 0
    libxsmm_normf_rel: float | None = None  # its own check against its naive reference
    ratio: float | None = None  # convgrad GFLOP/s / LIBXSMM GFLOP/s, both from means
    peak_gflops: float | None = None  # FMA peak per core next to convgrad's timing
    ours_pct_peak: float | None = None
    ours_best_pct_peak: float | None = None
    libxsmm_pct_peak: float | None = None
    note: str = ""


def driver_arguments(conv: ConvShape, batch: int, iterations: int, physical_pads: bool,
                     block: int) -> list[str] | None:
    """layer_example's arguments for a layer (all three passes, f32), or None where
    the driver cannot express it (one stride and one pad per side, no dilation, no
    groups, 2D)."""
    if (len(conv.kernel) != 2 or conv.groups != 1 or set(conv.dilations) != {1}
            or len(set(conv.strides)) != 1):
        return None
    (pad_h, pad_w), stride = conv.pads_begin, conv.strides[0]
    (src_h, src_w), (k_h, k_w) = conv.src, conv.kernel
    # its output: (src + 2 pad - k) / stride + 1 on each side; it must be this layer's
    if tuple((x + 2 * p - k) // stride + 1 for x, p, k in zip(
            conv.src, conv.pads_begin, conv.kernel, strict=True)) != tuple(conv.dst):
        return None
    return [str(v) for v in (iterations, src_w, src_h, batch, conv.in_channels,
                             conv.out_channels, k_w, k_h, pad_w, pad_h, stride)] + [
        "A", "L", "1" if physical_pads else "0", "0", str(block), str(block), "4"]


def parse_perfdump(text: str) -> dict[str, dict]:
    """The driver's PERFDUMP lines by pass: seconds per call, GFLOP/s, its check's
    relative Frobenius-norm error and LIBXSMM's version."""
    results = {}
    for kind, version, rest in _PERFDUMP.findall(text):
        values = rest.split(",")
        results[kind] = {"seconds": float(values[11]), "gflops": float(values[12]),
                         "normf_rel": float(values[19]), "version": version}
    return results


def run_driver(driver: Path, arguments: list[str], threads: int) -> tuple[dict, str]:
    """One driver process on the first `threads` CPUs this process may use: its
    PERFDUMP results and LIBXSMM's target (its LIBXSMM_VERBOSE line)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "true",
           "CHECK": "1", "LIBXSMM_VERBOSE": "1"}  # its FP pass is timed only when checked
    done = subprocess.run([str(driver), *arguments], env=env, capture_output=True,
                          text=True, timeout=600, preexec_fn=lambda: os.sched_setaffinity(
                              0, cpus), check=False)
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"{driver} {' '.join(arguments)} exited with "
                           f"{done.returncode}: {' / '.join(tail)}")
    target = re.search(r"LIBXSMM_TARGET:\s*(\S+)", done.stdout + done.stderr)
    return parse_perfdump(done.stdout), target.group(1) if target else "?"


def time_convgrad(conv: ConvShape, op: str, args: argparse.Namespace, threads: int,
                  peak: Peak, rng: np.random.Generator) -> tuple[list[float], float]:
    """Seconds of convgrad's timed calls of one layer alone (after a first call),
    pinned to `threads` CPUs, and the FMA peak per core measured around them."""
    (layer,) = conv_layers(conv, (OPS[op],), batch=args.batch, dtype="f32",
                           data_format=args.data_format)
    inputs = layer_inputs(layer, rng)

    def call() -> object:
        return api.execute(layer.op, inputs, layer.attrs, num_threads=threads)

    convgrad.set_num_threads(threads)
    with pinned(threads):
        call()
        before = peak.measure(0.01, 3)
        (seconds,) = timed_calls([call], args.min_time)
        return seconds, max(before, peak.measure(0.01, 3))


def measure_round(shapes: Sequence[tuple[str, ConvShape]], args: argparse.Namespace,
                  peak: Peak, rng: np.random.Generator, info: dict) -> list[Row]:
    """One round: every layer's driver process, then convgrad's ops on it, per thread
    count."""
    rows = []
    for (shape_set, conv), threads in ((s, t) for s in shapes for t in args.threads):
        sized = replace(conv, batch=args.batch)
        # iterations for about --min-time seconds at 80 % of the peak
        per_call = sized.flops / (0.8 * info["peak_f32_gflops_per_core"] * 1e9 * threads)
        iterations = min(1000, max(5, math.ceil(args.min_time / per_call)))
        arguments = driver_arguments(conv, args.batch, iterations, args.physical_pads,
                                     args.block)
        theirs = {}
        if arguments is not None:
            theirs, info["libxsmm_target"] = run_driver(args.driver, arguments, threads)
            info["libxsmm_version"] = next(iter(theirs.values()), {}).get(
                "version", info.get("libxsmm_version"))
        for op in args.ops:
            row = Row(shape_set, conv.name, op, threads, args.batch, args.data_format,
                      sized.flops)
            seconds, row.peak_gflops = time_convgrad(conv, op, args, threads, peak, rng)
            row.ours_mean_ms = statistics.fmean(seconds) * 1e3
            row.ours_median_ms = statistics.median(seconds) * 1e3
            row.ours_best_ms = min(seconds) * 1e3
            row.ours_calls = len(seconds)
            if arguments is None:
                row.note = "LIBXSMM's driver cannot express this layer"
            elif PASSES[op] not in theirs:
                row.note = f"LIBXSMM's driver ran no {PASSES[op]} pass"
            else:
                result = theirs[PASSES[op]]
                row.libxsmm_ms = result["seconds"] * 1e3
                row.libxsmm_calls = iterations
                row.libxsmm_normf_rel = result["normf_rel"]
            rows.append(finish(row))
            print(f"  {row.layer} {op} x{threads}: convgrad {fmt(row.ours_gflops, 1)}, "
                  f"LIBXSMM {fmt(row.libxsmm_gflops, 1)} GFLOP/s; peak "
                  f"{fmt(row.peak_gflops, 1)}", file=sys.stderr, flush=True)
    return rows


def finish(row: Row) -> Row:
    """A row's GFLOP/s, shares of the peak and ratio from its times."""
    def gflops(ms: float | None) -> float | None:
        return row.flops / ms / 1e6 if ms else None

    capacity = (row.peak_gflops or math.nan) * row.threads
    row.ours_gflops, row.ours_best_gflops = gflops(row.ours_mean_ms), gflops(row.ours_best_ms)
    row.libxsmm_gflops = gflops(row.libxsmm_ms)
    for name in ("ours", "ours_best", "libxsmm"):
        value = getattr(row, f"{name}_gflops")
        setattr(row, f"{name}_pct_peak", 100 * value / capacity if value else None)
    row.ratio = row.ours_gflops / row.libxsmm_gflops if row.libxsmm_gflops else None
    return row


def merge(rounds: list[list[Row]]) -> list[Row]:
    """One row per (layer, op, threads): each library's median time over the rounds,
    the fastest call of all, the median peak, and the median of the rounds' ratios."""
    merged = []
    for same in zip(*rounds, strict=True):
        row = replace(same[0])
        for name in ("ours_mean_ms", "ours_median_ms", "libxsmm_ms", "peak_gflops",
                     "libxsmm_normf_rel"):
            setattr(row, name, median_present([getattr(r, name) for r in same]))
        row.ours_best_ms = min(r.ours_best_ms for r in same)
        row.ours_calls = sum(r.ours_calls for r in same)
        row.libxsmm_calls = sum(r.libxsmm_calls for r in same)
        row = finish(row)
        row.ratio = median_present([r.ratio for r in same])
        merged.append(row)
    return merged


def report(rows: list[Row], info: dict, args: argparse.Namespace) -> str:
    """The table and the geometric means per op and thread count."""
    header = ["layer", "op", "threads", "convgrad GFLOP/s", "fastest", "LIBXSMM GFLOP/s",
              "ratio", "convgrad % peak", "fastest % peak", "LIBXSMM % peak", "note"]
    lines = [[r.layer, r.op, str(r.threads), fmt(r.ours_gflops, 1), fmt(r.ours_best_gflops, 1),
              fmt(r.libxsmm_gflops, 1), fmt(r.ratio, 3), fmt(r.ours_pct_peak, 1),
              fmt(r.ours_best_pct_peak, 1), fmt(r.libxsmm_pct_peak, 1), r.note] for r in rows]
    peaks = [r.peak_gflops for r in rows if r.peak_gflops]
    text = [f"{info['cpu']}; convgrad {info['isa']} ({info['convgrad_generator']}), "
            f"LIBXSMM {info.get('libxsmm_version', '?')} (target "
            f"{info.get('libxsmm_target', '?')}); batch {args.batch}, f32, convgrad "
            f"{args.data_format} / LIBXSMM blocked ({args.block}), "
            f"{'padded' if args.physical_pads else 'unpadded'} buffers; {args.rounds} "
            f"round(s), medians; ratio = convgrad GFLOP/s / LIBXSMM GFLOP/s (mean times)",
            "", columns(header, lines), ""]
    if peaks:
        text.append(f"FMA peak next to the rows: {min(peaks):.1f}-{max(peaks):.1f} "
                    "GFLOP/s per core")
    text.append("geometric means (convgrad / LIBXSMM; shares of the peak):")
    for op, threads in dict.fromkeys((r.op, r.threads) for r in rows):
        paired = [r for r in rows if r.op == op and r.threads == threads and r.ratio]
        worst = min(paired, key=lambda r: r.ratio, default=None)
        text.append(
            f"  {op:8} {threads} thread(s): {fmt(geomean([r.ratio for r in paired]), 3)} "
            f"over {len(paired)} layers (lowest {fmt(worst and worst.ratio, 3)}"
            f"{f' {worst.layer}' if worst else ''}); on those, convgrad "
            f"{fmt(geomean([r.ours_pct_peak for r in paired]), 1)} %, LIBXSMM "
            f"{fmt(geomean([r.libxsmm_pct_peak for r in paired]), 1)} %")
    return "\n".join(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.libxsmm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--driver", type=Path, required=True,
                        help="LIBXSMM-DNN's tests/conv/layer_example, built as above")
    parser.add_argument("--set", default="resnet50", choices=list(SETS))
    parser.add_argument("--layers", default=None,
                        help="comma-separated substrings: only the layers whose name "
                             "contains one")
    parser.add_argument("--ops", default="fwd,data,weights",
                        help="comma-separated subset of fwd, data, weights (default all)")
    parser.add_argument("--threads", type=int_list, default=[1],
                        help="comma-separated thread counts (default 1)")
    parser.add_argument("--batch", type=int, default=8, help="batch (default 8)")
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"],
                        help="convgrad's data layout (default NXC)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="seconds of calls per timing of each library (default 0.3)")
    parser.add_argument("--physical-pads", action="store_true",
                        help="give LIBXSMM padded buffers (its padding_mode 1)")
    parser.add_argument("--block", type=int, default=64,
                        help="LIBXSMM's channel block (default 64)")
    parser.add_argument("--isa", default=None, choices=list(LIBXSMM_TARGETS),
                        help="convgrad's path and LIBXSMM's target (default: the best each "
                             "finds on this CPU)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N layers")
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not args.ops or any(o not in PASSES for o in args.ops):
        parser.error(f"--ops: expected a comma-separated subset of {list(PASSES)}")
    if not os.access(args.driver, os.X_OK):
        parser.error(f"--driver {args.driver}: not an executable; build it as "
                     "`python -m benchmarks.libxsmm --help` says")
    if min(args.batch, args.rounds, args.block) < 1 or args.min_time < 0:
        parser.error("--batch, --rounds and --block must be positive")
    if args.isa and args.isa not in available_isas():
        parser.error(f"--isa {args.isa}: this CPU runs {list(available_isas())}")
    args.layers = [p.strip() for p in (args.layers or "").split(",") if p.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = load_sets([args.set], args.shapes_dir, args.limit, args.layers)
    if not shapes:
        print("no shapes to run", file=sys.stderr)
        return 1
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="convgrad-libxsmm-"))
        updates = {"CONVGRAD_AOT_PATH": "", "CONVGRAD_CACHE_DIR": cache}
        if args.isa:
            updates.update(CONVGRAD_ISA=args.isa, LIBXSMM_TARGET=LIBXSMM_TARGETS[args.isa])
        stack.enter_context(environment(updates))
        stack.callback(convgrad.set_num_threads, None)
        peak = Peak(selected_isa())
        info = cpu_info(peak.measure())
        rng = np.random.default_rng(0)
        rounds = [measure_round(shapes, args, peak, rng, info) for _ in range(args.rounds)]
    rows = merge(rounds)
    text = report(rows, info, args)
    print(text)
    command = "python -m benchmarks.libxsmm " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])
    write_results(args.out, command, text, rows, Row, machine=info, settings=settings(args))
    print(f"\nwrote table.txt, results.csv, results.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
