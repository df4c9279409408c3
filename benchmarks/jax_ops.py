"""convgrad.jax against XLA's own convolutions (jax.lax) per layer: the forward
convolution, its input gradient and its weight gradient, jitted, on the same arrays.

    python -m benchmarks.jax_ops [--set resnet50|mobilenet_v2|resnext50|resnet18_112|
                                        mobilenet_dw|dilated|1d|3d|resnext101|gconv|all]
                                 [--ops fwd,data,weights] [--dtype f32|bf16]
                                 [--layout nhwc|nchw] [--threads 1,2] [--batch 8]
                                 [--min-time 0.3] [--max-lax-seconds 1] [--limit N]
                                 [--layers a,b] [--pin] [--keep-cache] [--aot] [--out DIR]

The cases (benchmarks.jax_cases): the layers are benchmarks.shapes' benchdnn-derived sets
(ResNet-50's bundled list at 224x224, MobileNetV2's distinct layers at 112x112, ...),
plus `resnext50`: ResNeXt-50 (32x4d)'s distinct layers at 224x224 (shapes.JAX_SETS;
bench.py has the 3-D ResNeXt-101 only). Each layer runs at --batch (default 8), in NHWC
data with HWIO weights or NCHW with OIHW (`--layout`; NWC/WIO and NDHWC/DHWIO for 1-D and 3-D sets),
through `jax.lax.conv_general_dilated` and `convgrad.jax.conv_general_dilated` with the
same arguments (explicit pads, rhs_dilation, feature_group_count):
- fwd: jit(conv)(x, w);
- data: jit(lambda x, w, g: vjp(lambda x: conv(x, w), x)[1](g)[0]), the input gradient
  alone;
- weights: jit(lambda x, w, g: vjp(lambda w: conv(x, w), w)[1](g)[0]), the weight
  gradient alone.
On convgrad's side each is one kernel: the optimized HLO of every function is checked to
hold exactly one convgrad custom call and no XLA convolution, and the row's path says
which kernel (`convgrad.jax.explain` for the layout, the kernel from the trace), or
why lax ran instead. All kernels are built first (`convgrad.jax.compile_kernels`, in
parallel), and every function is compiled ahead of time (jit(...).lower(...).compile()):
no compile is timed.

Threads (benchmarks.xla): convgrad's come from convgrad.set_num_threads(n), read when a
function is traced. XLA's CPU client sizes its intra-op (Eigen) thread pool once, when
it is created, from the environment variable PJRT_NPROC (else NPROC, else every CPU this
process may run on); XLA_FLAGS=--xla_cpu_multi_thread_eigen=false does not make it use
one thread (its pool threads still run convolutions) and intra_op_parallelism_threads is
a TensorFlow option, not an XLA flag. So each thread count runs in a process of its own,
started with PJRT_NPROC=n (--pin also restricts that process to n CPUs, as taskset
does).

Timing: after one untimed call of each, the two libraries take turns in blocks of calls
(benchmarks.timing.timed_pair: the first call of a block is not counted) until each ran --min-time
seconds and 3 calls; each call ends with block_until_ready; medians are reported. Where
lax's first call (its executable compiled before) takes longer than --max-lax-seconds
(XLA's grouped weight gradients take seconds to a minute), that one call is lax's time,
convgrad is timed alone, and the row says so.

Outputs: a table (layer, op, threads, lax ms, convgrad ms, ratio = lax ms / convgrad ms
(above 1: convgrad is faster), the largest |convgrad - lax| relative to the largest
|lax|, the path) and the geometric mean of the ratios per op and thread count over the
rows that ran convgrad's kernel, on stdout; results.csv and results.json (with the
machine: CPU model, jax version, threads, dtype, layout) and table.txt (the command and
what it printed) in --out.
"""


from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import xla
from benchmarks.jax_cases import DTYPES, OPS, Row, make_case, run_case
from benchmarks.reports import columns, fmt, settings, write_results
from benchmarks.shapes import DEFAULT_SHAPES_DIR, JAX_SETS, load_set
from benchmarks.timing import geomean

SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results" / "jax_ops"


def load_shapes(name: str, args: argparse.Namespace):
    """A set's forward convolutions, --layers and --limit applied; None when its shape
    file is missing."""
    return load_set(name, args.shapes_dir, args.limit, args.layers)


def worker(args: argparse.Namespace) -> int:
    """One thread count, in this process: kernels built, then every case timed."""
    threads = xla.start_worker(args)
    import jax

    import convgrad.jax as cj

    shapes = [(name, conv) for name in args.sets for conv in load_shapes(name, args) or ()]
    cases = [make_case(conv, op, name, args) for name, conv in shapes for op in args.ops]
    print(f"{threads} thread(s): {len(shapes)} layers x {len(args.ops)} ops; "
          f"{jax.devices()[0].device_kind} XLA, PJRT_NPROC={os.environ['PJRT_NPROC']}",
          file=sys.stderr, flush=True)

    def everything(*flat):
        outs, i = [], 0
        for case in cases:
            outs.append(case.convgrad_fn(*flat[i:i + len(case.args)]))
            i += len(case.args)
        return outs

    begin = time.perf_counter()
    calls = cj.compile_kernels(everything, *[s for case in cases for s in case.args],
                               progress=False)
    kernels_s = time.perf_counter() - begin
    print(f"  {calls} kernel calls ready in {kernels_s:.1f} s", file=sys.stderr, flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for case in cases:
        rows.append(run_case(case, args, rng))
        r = rows[-1]
        print(f"  {r.layer} {r.op} x{threads}: lax {r.lax_ms:.3f} ms, convgrad "
              f"{r.convgrad_ms:.3f} ms ({r.path})", file=sys.stderr, flush=True)
    return xla.finish_worker(args, rows, kernel_calls=calls, kernels_s=round(kernels_s, 2))


# --------------------------------------------------------------------------- reports

def table(rows: list[Row]) -> str:
    header = ["layer", "op", "threads", "lax ms", "convgrad ms", "ratio", "rel diff", "path",
              "note"]
    return columns(header, [[r.layer, r.op, str(r.threads), fmt(r.lax_ms, 3),
                             fmt(r.convgrad_ms, 3), fmt(r.ratio, 3), fmt(r.max_rel_diff, 1, "e"),
                             r.path, r.note] for r in rows])


def geomeans(rows: list[Row]) -> list[dict]:
    """Geometric mean of the ratios per (op, threads), over the rows convgrad ran."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        if row.ratio and row.ran_convgrad:
            groups.setdefault((row.op, row.threads), []).append(row)
    order = {op: i for i, op in enumerate(OPS)}
    return [{"op": op, "threads": threads, "layers": len(group),
             "lax_timed_once": sum(r.lax_capped for r in group),
             "geomean_ratio": round(geomean([r.ratio for r in group]), 4)}
            for (op, threads), group in sorted(groups.items(),
                                               key=lambda kv: (order[kv[0][0]], kv[0][1]))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.jax_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="resnet50",
                        help=f"comma-separated shape sets: {', '.join(JAX_SETS)}, or all "
                             "(default resnet50)")
    parser.add_argument("--ops", default="fwd,data,weights",
                        help="comma-separated: fwd (the forward convolution), data (its "
                             "input gradient), weights (its weight gradient); default all")
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("--layout", default="nhwc", choices=["nhwc", "nchw"],
                        help="nhwc: NHWC data, HWIO weights; nchw: NCHW, OIHW (default nhwc)")
    xla.add_worker_arguments(parser)  # --threads, --pin, --keep-cache, --aot
    parser.add_argument("--batch", type=int, default=8, help="batch (default 8)")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="seconds of calls per timing, at least 3 calls (default 0.3)")
    parser.add_argument("--max-lax-seconds", type=float, default=1.0,
                        help="a lax call slower than this is timed once (default 1)")
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N layers of each set")
    parser.add_argument("--layers", default=None,
                        help="comma-separated substrings: only the layers whose name "
                             "contains one")
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR,
                        help=f"benchdnn shape files (default {DEFAULT_SHAPES_DIR})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.set.split(",") if s.strip()]
    args.sets = list(JAX_SETS) if names == ["all"] else names
    if not args.sets or any(s not in JAX_SETS for s in args.sets):
        parser.error(f"--set {args.set!r}: expected a comma-separated subset of "
                     f"{list(JAX_SETS)}")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or any(o not in OPS for o in ops):
        parser.error(f"--ops {args.ops!r}: expected a comma-separated subset of {list(OPS)}")
    args.ops = list(dict.fromkeys(ops))
    args.layers = [p.strip() for p in (args.layers or "").split(",") if p.strip()]
    if args.batch < 1 or (args.limit is not None and args.limit < 1) or args.min_time < 0 \
            or args.max_lax_seconds <= 0:
        parser.error("--batch, --limit and --max-lax-seconds must be positive, --min-time "
                     "not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    missing = [s for s in args.sets if load_shapes(s, args) is None]
    for name in missing:
        print(f"skipping set {name}: {args.shapes_dir / JAX_SETS[name][0]} not found",
              file=sys.stderr)
    if not any(load_shapes(s, args) for s in args.sets if s not in missing):
        print("no layers to run", file=sys.stderr)
        return 1
    command = "python -m benchmarks.jax_ops " + " ".join(argv)
    results = xla.run_workers("benchmarks.jax_ops", argv, args)
    if results is None:
        return 1
    rows = xla.rows_of(results, Row)
    machine = results[0]["machine"]
    means = geomeans(rows)
    report = [xla.machine_line(machine),
              f"batch {args.batch}, {args.dtype}, {args.layout}; ratio = lax ms / convgrad ms "
              "(above 1: convgrad is faster); rel diff = max |convgrad - lax| / max |lax|", "",
              table(rows), "",
              "geometric mean of ratios (lax ms / convgrad ms), rows that ran convgrad:"]
    for m in means:
        once = f" ({m['lax_timed_once']} with lax timed once)" if m["lax_timed_once"] else ""
        report.append(f"  {m['op']:8} {m['threads']} thread(s): {m['geomean_ratio']:.3f} over "
                      f"{m['layers']} layers{once}")
    others = [r for r in rows if not r.ran_convgrad]
    if others:
        report.append(f"{len(others)} rows did not run convgrad's kernel (left out of the "
                      "means)")
    print("\n".join(report))
    write_results(args.out, command, "\n".join(report), rows, Row, machine=machine,
                  settings=settings(args), threads=[r["threads"] for r in results],
                  kernels=[{"threads": r["threads"]["threads"], "calls": r["kernel_calls"],
                            "seconds": r["kernels_s"]} for r in results],
                  geomean=means)
    print(f"\nwrote table.txt, results.csv, results.json to {args.out}")
    mismatches = [r for r in rows if r.note.startswith("MISMATCH")]
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
