"""The cases of bench.py: one layer of one op, convgrad's call and PyTorch's on the same
data, timed at each thread count (`Row`: a result, the CSV's columns)."""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

import convgrad
from benchmarks.machine import Peak, pinned
from benchmarks.shapes import OPS, torch_dst
from benchmarks.tensors import (
    data_from_torch,
    data_to_torch,
    memory_format,
    torch,
    torch_dtype,
    weights_from_torch,
    weights_to_torch,
)
from benchmarks.timing import median_present, timed_calls, timed_pair
from convgrad import api, kernels, tuning
from convgrad.codegen.layers import ConvShape, Layer, conv_layers
from convgrad.codegen.plan import vendor_plan
from convgrad.cpu import cpu_features, cpu_vendor, selected_isa

# Largest |convgrad - PyTorch| / max |PyTorch| still reported as the same result.
TOLERANCE = {"f32": 1e-3, "bf16": 5e-2, "f16": 1e-2}


@dataclass
class Row:
    """One (layer, op, threads) measurement; the CSV columns."""

    shape_set: str
    layer: str
    op: str
    threads: int
    batch: int
    dtype: str
    data_format: str
    flops: int
    ours_ms: float | None = None
    ours_gflops: float | None = None
    ours_calls: int = 0
    torch_ms: float | None = None
    torch_gflops: float | None = None
    torch_calls: int = 0
    ratio: float | None = None  # ours GFLOP/s / torch GFLOP/s
    ours_pct_peak: float | None = None  # the median's share of peak_gflops x threads
    torch_pct_peak: float | None = None
    # the fastest call, and its share of the peak
    ours_best_ms: float | None = None
    ours_best_gflops: float | None = None
    ours_best_pct_peak: float | None = None
    torch_best_gflops: float | None = None
    torch_best_pct_peak: float | None = None
    peak_gflops: float | None = None  # FMA peak per core, measured right before and after
    # bf16 on a CPU with AMX: the tile peak per core (measured as the FMA peak is) and
    # each library's share of it
    amx_peak_gflops: float | None = None
    ours_pct_amx_peak: float | None = None
    ours_best_pct_amx_peak: float | None = None
    torch_pct_amx_peak: float | None = None
    ours_faults_per_call: float | None = None  # minor page faults (fresh memory touched)
    torch_faults_per_call: float | None = None
    alone: bool = False  # convgrad timed alone in the process, pinned to `threads` CPUs
    first_call_ms: float | None = None  # render + compile (or cache load) + one run
    kernel_origin: str = ""
    ours_inputs: str = ""  # convgrad's input shapes, in its layouts
    torch_grad_output: str = ""  # (N, C, *X)
    torch_shape_differs: bool = False  # asymmetric pads: PyTorch ran pads_begin on both ends
    torch_flops: int | None = None
    torch_layout: str = ""
    max_rel_err: float | None = None  # vs PyTorch on the same data (same shapes only)
    # --tune: the plan tuned at this size and thread count, its time and GFLOP/s the
    # rules' plan's scaled by tuned_gain
    tuned_ms: float | None = None
    tuned_gflops: float | None = None
    tuned_ratio: float | None = None  # ratio x tuned_gain
    tuned_gain: float | None = None  # rules' plan time / tuned time, paired apart from torch
    tuned_plan: str = ""
    note: str = ""


@dataclass
class Case:
    """One layer of one op, ready to run at any thread count."""

    layer: Layer
    ours: Callable[..., np.ndarray]
    torch_call: Callable[[], object] | None
    template: Row
    inputs: tuple[np.ndarray, np.ndarray]  # convgrad's first two inputs, in its layouts


def aligned(values: np.ndarray) -> np.ndarray:
    """`values` in an array on a 64-byte boundary, as PyTorch's tensors are (numpy's
    blocks of megabytes start 16 bytes past a page: channels-first 1x1 data gradients,
    which load vectors of the input in place, ran up to 17% slower from them)."""
    out = kernels.empty_output(values.shape, values.dtype)
    out[...] = values
    return out


def layer_inputs(layer: Layer, rng: np.random.Generator,
                 dtype: npt.DTypeLike = np.float32) -> list:
    """A layer's inputs for convgrad.execute: its two arrays of normal values (drawn in
    f32, in `dtype`) on 64-byte boundaries, and the shape it takes third, if any."""
    arrays = [aligned(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
              for shape in layer.inputs[:2]]
    return [*arrays, *([list(layer.inputs[2])] if len(layer.inputs) > 2 else [])]


def prepare(conv: ConvShape, op: str, shape_set: str, args: argparse.Namespace,
            rng: np.random.Generator) -> Case:
    """Arrays, tensors and calls of one layer; both sides get the same data where
    the problems have the same shapes."""
    (layer,) = conv_layers(conv, (OPS[op],), batch=args.batch, dtype=args.dtype,
                           data_format=args.data_format, weights_format=args.weights_format)
    dtype = api.DTYPE_BY_NAME[args.dtype]
    inputs = layer_inputs(layer, rng, dtype)
    a, b = inputs[:2]

    def ours(threads: int, tune: bool = False) -> np.ndarray:
        return api.execute(layer.op, inputs, layer.attrs, num_threads=threads, tune=tune)

    sized = replace(conv, batch=args.batch)
    rank = len(conv.kernel)
    dst = torch_dst(conv)
    differs = dst != conv.dst
    fmt, layout = memory_format(rank, args.data_format)
    n, g = args.batch, conv.groups
    grad_output_shape = (n, conv.out_channels, *dst)
    row = Row(shape_set, conv.name, op, 0, args.batch, args.dtype, args.data_format,
              sized.flops, ours_inputs=" ".join(str(tuple(s)) for s in layer.inputs[:2]),
              torch_grad_output=str(grad_output_shape), torch_shape_differs=differs,
              torch_layout=layout)
    if differs:
        row.note = "torch: symmetric pads_begin, other output size"
    if min(dst) < 1:
        row.note = "torch: no output with symmetric pads_begin; not run"
        return Case(layer, ours, None, row, (a, b))
    row.torch_flops = replace(sized, dst=dst).flops

    generator = torch.Generator().manual_seed(0)
    tdtype = torch_dtype(args.dtype)

    def random(shape: tuple[int, ...]) -> torch.Tensor:
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        return values.to(tdtype).contiguous(memory_format=fmt)

    weights_format = {"IOX": "OIX", "XOI": "XIO", "IXO": "OXI"}.get(
        layer.attrs["weights_format"], layer.attrs["weights_format"])
    weight_shape = (conv.out_channels, conv.in_channels // g, *conv.kernel)
    src_shape = (n, conv.in_channels, *conv.src)
    strides, pads, dilations = list(conv.strides), list(conv.pads_begin), list(conv.dilations)
    if op in ("data", "fwd"):  # data: a diff_dst, b weights; fwd: a src, b weights
        weight = weights_to_torch(b, weights_format, fmt)
        if op == "fwd":
            source = data_to_torch(a, args.data_format, fmt)

            def torch_call() -> object:
                return torch.ops.aten.convolution(source, weight, None, strides, pads,
                                                  dilations, False, [0] * rank, g)

            return Case(layer, ours, None if args.no_torch else torch_call, row, (a, b))
        grad_output = random(grad_output_shape) if differs else data_to_torch(
            a, args.data_format, fmt)
        source = random(src_shape)
        mask, index, transposed, extra = [True, False, False], 0, False, [0] * rank
    elif op == "weights":  # a: src, b: diff_dst
        source = data_to_torch(a, args.data_format, fmt)
        grad_output = random(grad_output_shape) if differs else data_to_torch(
            b, args.data_format, fmt)
        weight = random(weight_shape)
        mask, index, transposed, extra = [False, True, False], 1, False, [0] * rank
    else:  # tweights: a = the transposed convolution's src (this layer's dst), b its diff_dst
        source = random(grad_output_shape) if differs else data_to_torch(
            a, args.data_format, fmt)
        grad_output = data_to_torch(b, args.data_format, fmt)
        weight = random(weight_shape)
        # the transposed convolution's output padding that gives back this layer's src
        extra = [y - ((x - 1) * s - 2 * p + d * (k - 1) + 1) for y, x, s, p, d, k in zip(
            conv.src, dst, conv.strides, conv.pads_begin, conv.dilations, conv.kernel,
            strict=True)]
        if any(not 0 <= e < max(s, d) for e, s, d in zip(extra, conv.strides, conv.dilations,
                                                        strict=True)):
            row.note = "torch: no transposed convolution gives src back; not run"
            return Case(layer, ours, None, row, (a, b))
        mask, index, transposed = [False, True, False], 1, True

    def torch_call() -> object:
        return torch.ops.aten.convolution_backward(
            grad_output, source, weight, None, strides, pads, dilations, transposed, extra,
            g, mask)[index]

    return Case(layer, ours, None if args.no_torch else torch_call, row, (a, b))


def compare(case: Case, ours: np.ndarray, theirs: torch.Tensor, data_format: str) -> float:
    """Largest |convgrad - PyTorch| relative to the largest |PyTorch| value."""
    if case.template.op in ("data", "fwd"):
        expected = data_from_torch(theirs, data_format)
    else:
        fmt = case.layer.attrs["weights_format"]
        expected = weights_from_torch(theirs, {"XOI": "XIO", "IXO": "OXI"}.get(fmt, fmt))
    actual = ours.astype(np.float32)
    if actual.shape != expected.shape:
        return math.inf
    scale = float(np.max(np.abs(expected))) or 1.0
    return float(np.max(np.abs(actual - expected))) / scale


def counting_faults(function: Callable[[], object], counts: list[int]) -> Callable[[], object]:
    """`function`, adding its minor page faults and calls to counts[0] and counts[1]."""
    def call() -> object:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = function()
        counts[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        counts[1] += 1
        return result

    call.__name__ = getattr(function, "__name__", "call")
    return call


def run_case(case: Case, threads: Sequence[int], args: argparse.Namespace,
             peak: Peak) -> list[Row]:
    """Times one case at every thread count (the first convgrad call separately), each
    between two short measurements of the FMA peak. With args.alone, convgrad runs
    alone (PyTorch only checks the result once, before) and pinned to as many CPUs as
    threads."""
    template = case.template
    template.alone = bool(getattr(args, "alone", False))
    begin = time.perf_counter()
    result = case.ours(threads[0])
    template.first_call_ms = (time.perf_counter() - begin) * 1e3
    config = case.layer.resolve().config.with_isa(selected_isa())
    template.kernel_origin = kernels.get_kernel(config).origin
    if case.torch_call is not None:
        torch.set_num_threads(threads[0])
        try:
            theirs = case.torch_call()
        except RuntimeError as error:  # e.g. a dtype PyTorch's CPU backend lacks
            template.note = f"torch failed: {str(error).splitlines()[0][:80]}"
            case.torch_call = None
        else:
            if not template.torch_shape_differs:
                template.max_rel_err = compare(case, result, theirs, args.data_format)
                if template.max_rel_err > TOLERANCE[args.dtype]:
                    template.note = f"MISMATCH vs torch (rel err {template.max_rel_err:.2g})"
    timed_torch = None if template.alone else case.torch_call
    rows = []
    for count in threads:
        row = replace(template, threads=count)
        convgrad.set_num_threads(count)
        torch.set_num_threads(count)
        faults = [[0, 0], [0, 0]]
        functions = [lambda count=count: case.ours(count), timed_torch]
        calls = [counting_faults(f, counted) for f, counted in zip(functions, faults,
                                                                    strict=True) if f]
        with pinned(count if template.alone else None):
            for function in functions:  # warm up at this thread count
                if function:
                    function()
            amx = peak.amx if row.dtype == "bf16" else None
            before = peak.measure(0.01, 3)
            amx_before = amx.measure(0.01, 3) if amx else None
            times = timed_calls(calls, args.min_time)
            row.peak_gflops = max(before, peak.measure(0.01, 3))
            if amx:
                row.amx_peak_gflops = max(amx_before, amx.measure(0.01, 3))
        capacity = row.peak_gflops * count
        for name, seconds, (faulted, called) in zip(("ours", "torch"), times, faults,
                                                    strict=False):
            flops = row.flops if name == "ours" else row.torch_flops
            median, best = statistics.median(seconds), min(seconds)
            setattr(row, f"{name}_ms", median * 1e3)
            setattr(row, f"{name}_calls", len(seconds))
            setattr(row, f"{name}_gflops", flops / median / 1e9)
            setattr(row, f"{name}_best_gflops", flops / best / 1e9)
            setattr(row, f"{name}_pct_peak", 100 * flops / median / 1e9 / capacity)
            setattr(row, f"{name}_best_pct_peak", 100 * flops / best / 1e9 / capacity)
            setattr(row, f"{name}_faults_per_call", faulted / max(1, called))
        amx_shares(row)
        row.ours_best_ms = min(times[0]) * 1e3
        if row.torch_gflops:
            row.ratio = row.ours_gflops / row.torch_gflops
        if args.tune:
            # The tuned plan against the rules' in a pairing of their own: a call right
            # after PyTorch's runs up to 10% slower at 1 thread (Sapphire Rapids), and in
            # one round-robin of three one of the two would always follow PyTorch.
            case.ours(count, True)  # times the candidates now, then reuses the winner
            paired = timed_pair([lambda count=count: case.ours(count),
                                 lambda count=count: case.ours(count, True)], args.min_time)
            row.tuned_gain = paired[0][0] / paired[1][0]
            row.tuned_ms = row.ours_ms / row.tuned_gain
            row.tuned_gflops = row.ours_gflops * row.tuned_gain
            if row.ratio:
                row.tuned_ratio = row.ratio * row.tuned_gain
            row.tuned_plan = tuned_plan_text(case.layer, count)
        rows.append(row)
    return rows


def amx_shares(row: Row) -> None:
    """Sets a row's shares of the AMX tile peak (amx_peak_gflops x threads) from its
    GFLOP/s, where the row has that peak."""
    if not row.amx_peak_gflops:
        return
    capacity = row.amx_peak_gflops * row.threads
    for name, gflops in (("ours", row.ours_gflops), ("ours_best", row.ours_best_gflops),
                         ("torch", row.torch_gflops)):
        if gflops:
            setattr(row, f"{name}_pct_amx_peak", 100 * gflops / capacity)


def merge_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per (layer, op, threads) from rounds of the same rows: the median time of
    each library over the rounds (its share of the rounds' median peak, GFLOP/s per
    core, from that), the fastest call of all rounds, and the median of the rounds'
    ratios (a slow spell of the machine within one round moves one ratio, not the
    median); the first round's first call and checks, the calls of all rounds."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for same in zip(*rounds, strict=True):
        row = replace(same[0])
        row.peak_gflops = median_present([r.peak_gflops for r in same])
        capacity = (row.peak_gflops or math.nan) * row.threads
        for name in ("ours", "torch"):
            ms = median_present([getattr(r, f"{name}_ms") for r in same])
            setattr(row, f"{name}_calls", sum(getattr(r, f"{name}_calls") for r in same))
            setattr(row, f"{name}_ms", ms)
            flops = row.flops if name == "ours" else row.torch_flops
            if ms is not None:
                gflops = flops / ms / 1e6
                setattr(row, f"{name}_gflops", gflops)
                setattr(row, f"{name}_pct_peak", 100 * gflops / capacity)
            best = max((g for r in same if (g := getattr(r, f"{name}_best_gflops"))),
                       default=None)
            setattr(row, f"{name}_best_gflops", best)
            if best is not None:
                setattr(row, f"{name}_best_pct_peak", 100 * best / capacity)
            setattr(row, f"{name}_faults_per_call",
                    median_present([getattr(r, f"{name}_faults_per_call") for r in same]))
        if row.ours_best_gflops:
            row.ours_best_ms = row.flops / row.ours_best_gflops / 1e6
        row.amx_peak_gflops = median_present([r.amx_peak_gflops for r in same])
        amx_shares(row)
        row.ratio = median_present([r.ratio for r in same])
        row.tuned_gain = median_present([r.tuned_gain for r in same])
        if row.tuned_gain is not None:
            row.tuned_ms = row.ours_ms / row.tuned_gain
            row.tuned_gflops = row.ours_gflops * row.tuned_gain
            row.tuned_ratio = row.ratio * row.tuned_gain if row.ratio else None
        merged.append(row)
    return merged


def tuned_plan_text(layer: Layer, threads: int) -> str:
    """The plan tuned for a layer at a thread count ("rules" where none beat them)."""
    problem = layer.resolve()
    config = problem.config.with_isa(selected_isa())
    record = tuning.find(config, tuning.sizes_of(problem), threads)
    plan = record["plan"] if record else {}
    if plan == vendor_plan(config, cpu_vendor(), cpu_features()):  # the untuned kernel's
        return "rules"
    return ";".join(f"{k}={v}" for k, v in sorted(plan.items()))

