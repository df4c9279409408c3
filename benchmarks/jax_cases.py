"""The cases of benchmarks.jax_ops: one layer and op (`OPS`: the forward convolution, its
input gradient, its weight gradient) as lax's function and convgrad.jax's with the same
arguments, compiled ahead of time, checked against each other and timed in turns
(`Row`: a result, the CSV's columns). Imports jax inside the functions that need it."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from benchmarks.timing import timed_pair
from benchmarks.xla import hlo_summary, hlo_text
from convgrad.codegen.layers import ConvShape

OPS = ("fwd", "data", "weights")
DTYPES = ("f32", "bf16")
# Largest |convgrad - lax| / max |lax| still reported as the same result
# (benchmarks.cases.TOLERANCE's).
TOLERANCE = {"f32": 1e-3, "bf16": 5e-2}


def rel_diff(ours, theirs) -> float:
    """Largest |ours - theirs| relative to the largest |theirs|, in float64."""
    a = np.asarray(ours).astype(np.float64)
    b = np.asarray(theirs).astype(np.float64)
    if a.shape != b.shape:
        return math.inf
    scale = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a - b))) / scale


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
