"""convgrad.jax against XLA's own convolutions (jax.lax) per layer: the forward
convolution, its input gradient and its weight gradient, jitted, on the same arrays.

    python -m benchmarks.jax_ops [--set resnet50|mobilenet_v2|resnext50|resnet18_112|
                                        mobilenet_dw|dilated|1d|3d|resnext101|gconv|all]
                                 [--ops fwd,data,weights] [--dtype f32|bf16]
                                 [--layout nhwc|nchw] [--threads 1,2] [--batch 8]
                                 [--min-time 0.3] [--max-lax-seconds 1] [--limit N]
                                 [--layers a,b] [--pin] [--keep-cache] [--aot] [--out DIR]

The layers are benchmarks.shapes' benchdnn-derived sets (ResNet-50's bundled list at 224x224,
MobileNetV2's distinct layers at 112x112, ...), plus `resnext50`: ResNeXt-50 (32x4d)'s
distinct layers at 224x224, written here in benchdnn's syntax (bench.py has the 3-D
ResNeXt-101 only). Each layer runs at --batch (default 8), in NHWC data with HWIO
weights or NCHW with OIHW (`--layout`; NWC/WIO and NDHWC/DHWIO for 1-D and 3-D sets),
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

Threads: convgrad's come from convgrad.set_num_threads(n), read when a function is
traced. XLA's CPU client sizes its intra-op (Eigen) thread pool once, when it is created,
from the environment variable PJRT_NPROC (else NPROC, else every CPU this process may
run on); XLA_FLAGS=--xla_cpu_multi_thread_eigen=false does not make it use one thread
(its pool threads still run convolutions) and intra_op_parallelism_threads is a
TensorFlow option, not an XLA flag. So each thread count runs in a process of its own,
started with PJRT_NPROC=n (--pin also restricts that process to n CPUs, as taskset does).

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
import contextlib
import csv
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import convgrad
from benchmarks.shapes import DEFAULT_SHAPES_DIR, ROOT, SETS, load_set
from benchmarks.timing import geomean, int_list, timed_pair
from convgrad.codegen import generator_version
from convgrad.codegen.layers import ConvShape, parse_benchdnn
from convgrad.compiler import compiler_identity
from convgrad.cpu import cpu_model, selected_isa

SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results" / "jax_ops"
OPS = ("fwd", "data", "weights")
DTYPES = ("f32", "bf16")
# Largest |convgrad - lax| / max |lax| still reported as the same result
# (benchmarks.cases.TOLERANCE's).
TOLERANCE = {"f32": 1e-3, "bf16": 5e-2}

# ResNeXt-50 (32x4d, torchvision's: the stride on the grouped 3x3) at 224x224: its
# distinct layers, the grouped 3x3 ones with 4-32 channels per group.
RESNEXT50 = " ".join(
    f'mb8_g{g}ic{ic}oc{oc}_ih{i}oh{o}kh{k}sh{s}dh0ph{k // 2}_iw{i}ow{o}kw{k}sw{s}dw0pw{k // 2}'
    f'_n"resnext50:{name}"' for name, g, ic, oc, i, o, k, s in (
        ("conv1", 1, 3, 64, 224, 112, 7, 2),
        ("l1.0.conv1", 1, 64, 128, 56, 56, 1, 1), ("l1.conv2", 32, 128, 128, 56, 56, 3, 1),
        ("l1.conv3", 1, 128, 256, 56, 56, 1, 1), ("l1.0.down", 1, 64, 256, 56, 56, 1, 1),
        ("l1.conv1", 1, 256, 128, 56, 56, 1, 1),
        ("l2.0.conv1", 1, 256, 256, 56, 56, 1, 1), ("l2.0.conv2", 32, 256, 256, 56, 28, 3, 2),
        ("l2.conv3", 1, 256, 512, 28, 28, 1, 1), ("l2.0.down", 1, 256, 512, 56, 28, 1, 2),
        ("l2.conv1", 1, 512, 256, 28, 28, 1, 1), ("l2.conv2", 32, 256, 256, 28, 28, 3, 1),
        ("l3.0.conv1", 1, 512, 512, 28, 28, 1, 1), ("l3.0.conv2", 32, 512, 512, 28, 14, 3, 2),
        ("l3.conv3", 1, 512, 1024, 14, 14, 1, 1), ("l3.0.down", 1, 512, 1024, 28, 14, 1, 2),
        ("l3.conv1", 1, 1024, 512, 14, 14, 1, 1), ("l3.conv2", 32, 512, 512, 14, 14, 3, 1),
        ("l4.0.conv1", 1, 1024, 1024, 14, 14, 1, 1),
        ("l4.0.conv2", 32, 1024, 1024, 14, 7, 3, 2),
        ("l4.conv3", 1, 1024, 2048, 7, 7, 1, 1), ("l4.0.down", 1, 1024, 2048, 14, 7, 1, 2),
        ("l4.conv1", 1, 2048, 1024, 7, 7, 1, 1), ("l4.conv2", 32, 1024, 1024, 7, 7, 3, 1)))
ALL_SETS = [*SETS, "resnext50"]


def load_shapes(name: str, args: argparse.Namespace) -> list[ConvShape] | None:
    """A set's forward convolutions (benchmarks.shapes.load_set's, or ResNeXt-50's), --layers and
    --limit applied; None when its shape file is missing."""
    if name != "resnext50":
        return load_set(name, args.shapes_dir, args.limit, args.layers)
    convs = parse_benchdnn(RESNEXT50)
    if args.layers:
        convs = [c for c in convs if any(part in c.name for part in args.layers)]
    return convs[:args.limit] if args.limit else convs


# --------------------------------------------------------------------------- processes

def thread_env(threads: int) -> dict[str, str]:
    """What a process needs in its environment to run XLA's CPU client on `threads`
    threads (read once, when jax creates the client)."""
    return {"PJRT_NPROC": str(threads)}


def check_thread_env(threads: int) -> None:
    """Refuses to run a worker whose XLA would not run on `threads` threads."""
    given = os.environ.get("PJRT_NPROC")
    if given != str(threads):
        raise SystemExit(f"worker for {threads} thread(s) started with PJRT_NPROC={given!r}; "
                         "run the script without --worker")
    if "jax" in sys.modules and _backend_started():
        raise SystemExit("jax's CPU client was created before PJRT_NPROC was set")


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def pin(threads: int) -> list[int]:
    """Restricts this process to the first `threads` CPUs it may run on (taskset)."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    return cpus


def run_workers(module: str, argv: Sequence[str], threads: Sequence[int],
                env: dict[str, str]) -> list[dict] | None:
    """Runs `python -m module argv --threads n --worker FILE` once per thread count, each
    in a process with XLA's thread count set (and the repository's root on PYTHONPATH, so
    that the benchmarks package imports from any folder); the JSON each wrote, None if
    one failed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    results = []
    with tempfile.TemporaryDirectory(prefix="convgrad-jax-bench-") as tmp:
        for count in threads:
            out = Path(tmp) / f"worker_{count}.json"
            command = [sys.executable, "-m", module, *argv, "--threads", str(count),
                       "--worker", str(out)]
            status = subprocess.run(command, env={**os.environ, **env, **thread_env(count),
                                         "PYTHONPATH": path},
                                    check=False).returncode
            if status != 0 or not out.is_file():
                print(f"the {count}-thread run failed (exit status {status})", file=sys.stderr)
                return None
            results.append(json.loads(out.read_text()))
    return results


def kernel_environment(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict:
    """The workers' convgrad settings: no AOT kernels unless --aot, a new kernel cache
    (shared by the thread counts' processes) unless --keep-cache."""
    env = {} if args.aot else {"CONVGRAD_AOT_PATH": ""}
    if not args.keep_cache:
        env["CONVGRAD_CACHE_DIR"] = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="convgrad-jax-bench-cache-"))
    return env


def machine_info() -> dict:
    """The machine and the software, in a worker (jax imported)."""
    import jax
    import jaxlib

    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "isa": selected_isa(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "convgrad_generator": generator_version(),
        "compiler": compiler_identity().splitlines()[0],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def thread_info(threads: int) -> dict:
    """How many threads each library was given in this worker."""
    return {"threads": threads, "pjrt_nproc": os.environ.get("PJRT_NPROC"),
            "convgrad_threads": convgrad.get_num_threads(),
            "cpus_allowed": len(os.sched_getaffinity(0))}


def hlo_summary(compiled) -> dict:
    """What the optimized HLO runs: convgrad's custom calls and XLA's convolutions
    anywhere (inside fusions too), and the entry computation's fusions by kind and
    convolutions left unfused (XLA's runtime, Eigen, runs those)."""
    text = compiled.as_text()
    entry = text[text.find("\nENTRY"):]
    summary = {"convgrad_calls": entry.count('custom_call_target="convgrad_conv"'),
               "convolutions": len(re.findall(r"= \S+ convolution\(", text)),
               "ops": {}}
    for line in entry.splitlines():
        if " fusion(" in line:
            kind = re.search(r'"kind":"(\w+)"', line) or re.search(r"kind=k(\w+)", line)
            name = kind.group(1).strip("_").lower() if kind else "fusion"
            name = name if name.endswith("fusion") else f"{name} fusion"
        elif re.search(r"= \S+ convolution\(", line):
            name = "convolution"
        else:
            continue
        summary["ops"][name] = summary["ops"].get(name, 0) + 1
    return summary


def hlo_text(summary: dict) -> str:
    parts = [f"{count} {name}" for name, count in sorted(summary["ops"].items())]
    if summary["convgrad_calls"]:
        parts.insert(0, f"{summary['convgrad_calls']} convgrad")
    return ", ".join(parts)


def rel_diff(ours, theirs) -> float:
    """Largest |ours - theirs| relative to the largest |theirs|, in float64."""
    a = np.asarray(ours).astype(np.float64)
    b = np.asarray(theirs).astype(np.float64)
    if a.shape != b.shape:
        return math.inf
    scale = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a - b))) / scale


# --------------------------------------------------------------------------- cases

@dataclass
class Row:
    """One (layer, op, threads) measurement; the CSV columns."""

    shape_set: str
    layer: str
    op: str
    threads: int
    batch: int
    dtype: str
    layout: str
    flops: int
    lax_ms: float | None = None
    convgrad_ms: float | None = None
    ratio: float | None = None  # lax ms / convgrad ms
    lax_gflops: float | None = None
    convgrad_gflops: float | None = None
    lax_calls: int = 0
    convgrad_calls: int = 0
    lax_capped: bool = False  # lax's first call took over --max-lax-seconds: timed once
    max_rel_diff: float | None = None  # |convgrad - lax| max / |lax| max
    path: str = ""  # "convgrad <kernel> (...)" or "lax...: reason"
    convgrad_hlo: str = ""  # the optimized HLO of convgrad's function
    lax_hlo: str = ""  # and of lax's
    lax_compile_s: float | None = None  # jit(...).lower().compile() of lax's function
    convgrad_compile_s: float | None = None  # the same of convgrad's (kernels built)
    shapes: str = ""  # x, w, g
    note: str = ""

    @property
    def ran_convgrad(self) -> bool:
        return self.path.startswith("convgrad ")


def specs(rank: int, layout: str) -> tuple[str, str, str]:
    """lax's dimension numbers of a layout: NHWC/HWIO/NHWC or NCHW/OIHW/NCHW (rank 2)."""
    sp = "DHW"[3 - rank:]
    if layout == "nhwc":
        return f"N{sp}C", f"{sp}IO", f"N{sp}C"
    return f"NC{sp}", f"OI{sp}", f"NC{sp}"


def operand_shapes(conv: ConvShape, layout: str, batch: int):
    """x, w and the output gradient g of a layer in a layout."""
    ci, co, g = conv.in_channels, conv.out_channels, conv.groups
    if layout == "nhwc":
        return ((batch, *conv.src, ci), (*conv.kernel, ci // g, co), (batch, *conv.dst, co))
    return ((batch, ci, *conv.src), (co, ci // g, *conv.kernel), (batch, co, *conv.dst))


@dataclass
class Case:
    """One layer and op: both libraries' functions and their arguments."""

    conv: ConvShape
    op: str
    lax_fn: Callable
    convgrad_fn: Callable
    args: tuple  # jax.ShapeDtypeStruct until the case runs
    kwargs: dict  # conv_general_dilated's arguments after lhs and rhs
    template: Row


def make_case(conv: ConvShape, op: str, shape_set: str, args: argparse.Namespace) -> Case:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import convgrad.jax as cj

    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[args.dtype]
    x, w, g = (jax.ShapeDtypeStruct(s, dtype)
               for s in operand_shapes(conv, args.layout, args.batch))
    kwargs = {"window_strides": conv.strides,
              "padding": list(zip(conv.pads_begin, conv.pads_end, strict=True)),
              "lhs_dilation": None, "rhs_dilation": conv.dilations,
              "dimension_numbers": specs(len(conv.kernel), args.layout),
              "feature_group_count": conv.groups}

    def function(conv_fn: Callable) -> Callable:
        def call(x, w):
            return conv_fn(x, w, **kwargs)
        if op == "fwd":
            return call
        if op == "data":
            return lambda x, w, g: jax.vjp(lambda x: call(x, w), x)[1](g)[0]
        return lambda x, w, g: jax.vjp(lambda w: call(x, w), w)[1](g)[0]

    sized = replace(conv, batch=args.batch)
    row = Row(shape_set, conv.name, op, args.threads[0], args.batch, args.dtype, args.layout,
              sized.flops, shapes=" ".join(str(s.shape) for s in (x, w, g)))
    operands = (x, w) if op == "fwd" else (x, w, g)
    return Case(conv, op, function(lax.conv_general_dilated),
                function(cj.conv_general_dilated), operands, kwargs, row)


KERNELS = {"fwd": "ConvTransposeBackwardData", "data": "ConvolutionBackwardData",
           "weights": "ConvolutionBackwardWeights"}


def path_of(case: Case, summary: dict) -> str:
    """Which path convgrad's function took: explain's words for the forward call (the
    layouts), the op's kernel, checked against the optimized HLO."""
    import convgrad.jax as cj

    x, w = case.args[:2]
    words = cj.explain(x, w, **case.kwargs)
    if not words.startswith("convgrad "):
        return words
    if summary["convolutions"] or summary["convgrad_calls"] != 1:
        return (f"lax in part: the optimized HLO holds {summary['convgrad_calls']} convgrad "
                f"calls and {summary['convolutions']} XLA convolutions")
    return words.replace(KERNELS["fwd"], KERNELS[case.op], 1)


def run_case(case: Case, args: argparse.Namespace, rng: np.random.Generator) -> Row:
    import jax
    import jax.numpy as jnp

    row = replace(case.template)
    arrays = tuple(jnp.asarray(rng.standard_normal(s.shape, dtype=np.float32)).astype(s.dtype)
                   for s in case.args)
    compiled, seconds = [], []
    for fn in (case.lax_fn, case.convgrad_fn):
        begin = time.perf_counter()
        compiled.append(jax.jit(fn).lower(*arrays).compile())
        seconds.append(round(time.perf_counter() - begin, 3))
    lax_call, ours_call = compiled
    row.lax_compile_s, row.convgrad_compile_s = seconds
    ours_hlo, lax_hlo = hlo_summary(ours_call), hlo_summary(lax_call)
    row.convgrad_hlo, row.lax_hlo = hlo_text(ours_hlo), hlo_text(lax_hlo)
    row.path = path_of(case, ours_hlo)

    def call(fn):
        return lambda: fn(*arrays).block_until_ready()

    begin = time.perf_counter()
    theirs = lax_call(*arrays).block_until_ready()
    lax_first = time.perf_counter() - begin
    ours = ours_call(*arrays).block_until_ready()
    row.max_rel_diff = rel_diff(ours, theirs)
    if row.max_rel_diff > TOLERANCE[args.dtype]:
        row.note = f"MISMATCH (rel diff {row.max_rel_diff:.2g})"
    del theirs, ours
    if lax_first > args.max_lax_seconds:  # that call is lax's timing (compiled before)
        row.lax_ms, row.lax_calls, row.lax_capped = lax_first * 1e3, 1, True
        ((seconds, row.convgrad_calls),) = timed_pair([call(ours_call)], args.min_time)
        row.note = (row.note + "; " if row.note else "") + \
            f"lax timed once ({lax_first:.1f} s > --max-lax-seconds)"
    else:
        (lax_s, row.lax_calls), (seconds, row.convgrad_calls) = timed_pair(
            [call(lax_call), call(ours_call)], args.min_time)
        row.lax_ms = lax_s * 1e3
    row.convgrad_ms = seconds * 1e3
    row.ratio = row.lax_ms / row.convgrad_ms
    row.lax_gflops = row.flops / row.lax_ms / 1e6
    row.convgrad_gflops = row.flops / row.convgrad_ms / 1e6
    for name in ("lax_ms", "convgrad_ms", "lax_gflops", "convgrad_gflops", "ratio"):
        setattr(row, name, float(f"{getattr(row, name):.6g}"))
    return row


def worker(args: argparse.Namespace) -> int:
    """One thread count, in this process: kernels built, then every case timed."""
    threads = args.threads[0]
    check_thread_env(threads)
    if args.pin:
        pin(threads)
    import jax

    import convgrad.jax as cj

    convgrad.set_num_threads(threads)  # before any trace: the kernels' calls keep it
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
    Path(args.worker).write_text(json.dumps(
        {"machine": machine_info(), "threads": thread_info(threads),
         "kernel_calls": calls, "kernels_s": round(kernels_s, 2),
         "rows": [asdict(r) for r in rows]}))
    return 0


# --------------------------------------------------------------------------- reports

def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[Row]) -> str:
    header = ["layer", "op", "threads", "lax ms", "convgrad ms", "ratio", "rel diff", "path",
              "note"]
    lines = [[r.layer, r.op, str(r.threads), _fmt(r.lax_ms, ".3f"), _fmt(r.convgrad_ms, ".3f"),
              _fmt(r.ratio, ".3f"), _fmt(r.max_rel_diff, ".1e"), r.path, r.note] for r in rows]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
    text = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            for line in [header, *lines]]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


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
                        help=f"comma-separated shape sets: {', '.join(ALL_SETS)}, or all "
                             "(default resnet50)")
    parser.add_argument("--ops", default="fwd,data,weights",
                        help="comma-separated: fwd (the forward convolution), data (its "
                             "input gradient), weights (its weight gradient); default all")
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("--layout", default="nhwc", choices=["nhwc", "nchw"],
                        help="nhwc: NHWC data, HWIO weights; nchw: NCHW, OIHW (default nhwc)")
    parser.add_argument("--threads", type=int_list, default=[1, 2],
                        help="comma-separated thread counts, one process each (default 1,2)")
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
    parser.add_argument("--pin", action="store_true",
                        help="run each thread count's process on that many CPUs only "
                             "(sched_setaffinity, as taskset does)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the usual kernel cache instead of a new temporary one")
    parser.add_argument("--aot", action="store_true",
                        help="let convgrad use ahead-of-time kernels (ignored by default)")
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR,
                        help=f"benchdnn shape files (default {DEFAULT_SHAPES_DIR})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.set.split(",") if s.strip()]
    args.sets = ALL_SETS if names == ["all"] else names
    if not args.sets or any(s not in ALL_SETS for s in args.sets):
        parser.error(f"--set {args.set!r}: expected a comma-separated subset of {ALL_SETS}")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or any(o not in OPS for o in ops):
        parser.error(f"--ops {args.ops!r}: expected a comma-separated subset of {list(OPS)}")
    args.ops = list(dict.fromkeys(ops))
    args.layers = [p.strip() for p in (args.layers or "").split(",") if p.strip()]
    if args.batch < 1 or (args.limit is not None and args.limit < 1) or args.min_time < 0 \
            or args.max_lax_seconds <= 0:
        parser.error("--batch, --limit and --max-lax-seconds must be positive, --min-time "
                     "not negative")
    if args.worker and len(args.threads) != 1:
        parser.error("--worker runs one thread count")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    missing = [s for s in args.sets if load_shapes(s, args) is None]
    for name in missing:
        print(f"skipping set {name}: {args.shapes_dir / SETS[name][0]} not found",
              file=sys.stderr)
    if not any(load_shapes(s, args) for s in args.sets if s not in missing):
        print("no layers to run", file=sys.stderr)
        return 1
    command = "python -m benchmarks.jax_ops " + " ".join(argv)
    with contextlib.ExitStack() as stack:
        results = run_workers("benchmarks.jax_ops", argv, args.threads,
                              kernel_environment(args, stack))
    if results is None:
        return 1
    rows = [Row(**r) for result in results for r in result["rows"]]
    machine = results[0]["machine"]
    means = geomeans(rows)
    report = [f"{machine['cpu']}, {machine['logical_cpus']} logical CPUs; jax "
              f"{machine['jax']}, convgrad {machine['convgrad_generator']} ({machine['isa']})",
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.txt").write_text(command + "\n\n" + "\n".join(report) + "\n")
    with (args.out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(Row)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k != "worker"}
    (args.out / "results.json").write_text(json.dumps(
        {"command": command, "machine": machine, "settings": settings,
         "threads": [r["threads"] for r in results],
         "kernels": [{"threads": r["threads"]["threads"], "calls": r["kernel_calls"],
                      "seconds": r["kernels_s"]} for r in results],
         "geomean": means, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    print(f"\nwrote table.txt, results.csv, results.json to {args.out}")
    mismatches = [r for r in rows if r.note.startswith("MISMATCH")]
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
