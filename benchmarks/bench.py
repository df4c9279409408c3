"""convgrad against PyTorch's CPU backward, side by side in one process.

    python benchmarks/bench.py [--set resnet50|resnet18_112|mobilenet_v2|mobilenet_dw|dilated|
                                      1d|3d|resnext101|gconv|all]
                               [--ops data,weights,fwd,tweights] [--threads 1,2] [--batch 8]
                               [--dtype f32|bf16|f16] [--data-format NXC|NCX]
                               [--weights-format OIX|XIO|OXI]
                               [--min-time 0.3] [--limit N] [--keep-cache] [--out DIR]

Every benchdnn forward convolution of the chosen set becomes the layers of
ConvolutionBackwardData ("data"), ConvolutionBackwardWeights ("weights"),
ConvTransposeBackwardData ("fwd": the forward convolution itself) and
ConvTransposeBackwardWeights ("tweights": the weight gradient of the transposed
convolution whose forward is this layer's backward data), built with
convgrad.codegen.layers.conv_layers and run through convgrad.execute; PyTorch runs the
same problem through torch.ops.aten.convolution_backward (torch.ops.aten.convolution
for "fwd"; transposed=True for "tweights") with the same dtype, memory layout and
thread count. Each timing is the median of at least 3 calls
and at least --min-time seconds, the two libraries' calls interleaved. GFLOP/s
count 2 x N x OC x IC/g x output pixels x kernel taps. The machine's f32 FMA peak
per core is measured by a small generated C loop, and every row gives convgrad's
share of it (GFLOP/s / (peak x threads)).

Outputs: a table and the geometric mean of the ratios (convgrad GFLOP/s / PyTorch
GFLOP/s, above 1 means convgrad is faster) per op and thread count on stdout, and
results.csv, results.json (with the machine) and results.png in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from unittest import mock

import cffi
import ml_dtypes
import numpy as np

import convgrad
from convgrad import api, kernels, tuning
from convgrad.aot import median_seconds
from convgrad.codegen import KernelConfig, generator_version
from convgrad.codegen.layers import OP_ALIASES, ConvShape, Layer, conv_layers, parse_benchdnn
from convgrad.codegen.plan import vendor_plan
from convgrad.codegen.targets import host
from convgrad.compiler import compile_objects, compiler_identity
from convgrad.cpu import available_isas, cpu_features, cpu_model, cpu_vendor, selected_isa

ROOT = Path(__file__).resolve().parent.parent

try:
    import torch
except ImportError:  # reported by main()
    torch = None

OPS = OP_ALIASES
DTYPES = ("f32", "bf16", "f16")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DEFAULT_SHAPES_DIR = ROOT.parent / "shared" / "benchdnn_conv_shapes"

# Shape sets: (file, selected descriptor names or None for every descriptor).
# The ResNet-50 list is the package's bundled copy; the others are a handful of
# representative descriptors of oneDNN benchdnn's files in DEFAULT_SHAPES_DIR.
SETS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "resnet50": ("shapes_resnet_50", None),
    "mobilenet_v2": ("(inline)", None),
    "resnet18_112": ("(inline)", None),
    "mobilenet_dw": ("shapes_mobilenet_dw", (
        "mobilenet:conv2_1/dw", "mobilenet:conv2_2/dw", "mobilenet:conv3_1/dw",
        "mobilenet:conv4_2/dw", "mobilenet:conv5_1/dw", "mobilenet:conv6/dw")),
    "dilated": ("shapes_dilated", (
        "dilated_conv:18", "dilated_conv:19", "dilated_conv:20", "dilated_conv:21",
        "dilated_conv:24", "dilated_conv:25", "dilated_conv:42/dw")),
    "1d": ("shapes_1d", (
        "conv_dw", "1d_gconv_channel-block-16", "conv1d:2", "conv1d:3", "conv1d:6",
        "conv1d:19", "conv1d_gemm:3")),
    "3d": ("shapes_3d", (
        "3d_conv_pad:1", "3d_conv_pad:4", "3d_conv:2", "vnet:conv3",
        "3d_gconv_channel-block-8", "3d_gconv_non-block_s2")),
    # grouped layers: 2-128 channels per group
    "resnext101": ("shapes_3d_resnext101", (
        "Resnext:conv_3d:1", "Resnext:conv_3d:4", "Resnext:conv_3d:6", "Resnext:conv_3d:8",
        "Resnext:conv_3d:11", "Resnext:conv_3d:15*2", "Resnext:conv_3d:19",
        "Resnext:conv_3d:22", "Resnext:conv_3d:25")),
    "gconv": ("shapes_3d", (
        "3d_gconv_channel-block-16", "3d_gconv_channel-block-8", "3d_gconv_channel-block-4",
        "3d_gconv_non-block", "3d_gconv_non-block_1x1", "3d_gconv_non-block_s2")),
}
BUNDLED = {"resnet50"}

# MobileNetV2's distinct layers at a 112x112 input (as benchmarks/models.py builds it):
# the 1x1 expand and project layers (16-320 channels on 56x56 to 4x4) and the 3x3
# depthwise layers (the stem and the last 1x1 too). Written here in benchdnn's syntax.
INLINE = {"mobilenet_v2": " ".join(
    f'mb8_g{g}ic{ic}oc{oc}_ih{i}oh{o}kh{k}sh{s}dh0ph{k // 2}_iw{i}ow{o}kw{k}sw{s}dw0pw{k // 2}'
    f'_n"mobilenet_v2:{name}"' for name, g, ic, oc, i, o, k, s in (
        ("stem", 1, 3, 32, 112, 56, 3, 2), ("dw32", 32, 32, 32, 56, 56, 3, 1),
        ("pw32-16", 1, 32, 16, 56, 56, 1, 1), ("pw16-96", 1, 16, 96, 56, 56, 1, 1),
        ("dw96s2", 96, 96, 96, 56, 28, 3, 2), ("pw96-24", 1, 96, 24, 28, 28, 1, 1),
        ("pw24-144", 1, 24, 144, 28, 28, 1, 1), ("dw144", 144, 144, 144, 28, 28, 3, 1),
        ("pw144-24", 1, 144, 24, 28, 28, 1, 1), ("dw144s2", 144, 144, 144, 28, 14, 3, 2),
        ("pw144-32", 1, 144, 32, 14, 14, 1, 1), ("pw32-192", 1, 32, 192, 14, 14, 1, 1),
        ("dw192", 192, 192, 192, 14, 14, 3, 1), ("pw192-32", 1, 192, 32, 14, 14, 1, 1),
        ("pw64-384", 1, 64, 384, 7, 7, 1, 1), ("dw384", 384, 384, 384, 7, 7, 3, 1),
        ("pw384-96", 1, 384, 96, 7, 7, 1, 1), ("dw576s2", 576, 576, 576, 7, 4, 3, 2),
        ("pw160-960", 1, 160, 960, 4, 4, 1, 1), ("dw960", 960, 960, 960, 4, 4, 3, 1),
        ("pw960-320", 1, 960, 320, 4, 4, 1, 1), ("pw320-1280", 1, 320, 1280, 4, 4, 1, 1))),
    # ResNet-18's distinct layers at a 112x112 input: half ImageNet's sizes (56 to 4)
    "resnet18_112": " ".join(
        f'mb8_g1ic{ic}oc{oc}_ih{i}oh{o}kh{k}sh{s}dh0ph{k // 2}_iw{i}ow{o}kw{k}sw{s}dw0pw{k // 2}'
        f'_n"resnet18_112:{name}"' for name, ic, oc, i, o, k, s in (
            ("conv1", 3, 64, 112, 56, 7, 2), ("l1", 64, 64, 28, 28, 3, 1),
            ("l2s2", 64, 128, 28, 14, 3, 2), ("l2", 128, 128, 14, 14, 3, 1),
            ("l2down", 64, 128, 28, 14, 1, 2), ("l3s2", 128, 256, 14, 7, 3, 2),
            ("l3", 256, 256, 7, 7, 3, 1), ("l3down", 128, 256, 14, 7, 1, 2),
            ("l4s2", 256, 512, 7, 4, 3, 2), ("l4", 512, 512, 4, 4, 3, 1),
            ("l4down", 256, 512, 7, 4, 1, 2)))}

# The tiny problem of the call-overhead measurement: 1x1, N=1, 4x4, 16 channels.
TINY = ConvShape(name="tiny", groups=1, batch=1, in_channels=16, out_channels=16,
                 src=(4, 4), dst=(4, 4), kernel=(1, 1), strides=(1, 1), pads_begin=(0, 0),
                 pads_end=(0, 0), dilations=(1, 1))

# Largest |convgrad - PyTorch| / max |PyTorch| still reported as the same result.
TOLERANCE = {"f32": 1e-3, "bf16": 5e-2, "f16": 1e-2}


# --------------------------------------------------------------------------- shapes

def load_set(name: str, shapes_dir: Path, limit: int | None,
             layers: Sequence[str] = ()) -> list[ConvShape] | None:
    """The forward convolutions of a shape set (None when its file is missing), only
    those whose name contains one of `layers` when it is not empty."""
    file, selection = SETS[name]
    if name in INLINE:
        text = INLINE[name]
    elif name in BUNDLED:
        text = (resources.files("convgrad.codegen") / "data" / file).read_text()
    else:
        path = shapes_dir / file
        if not path.is_file():
            return None
        text = path.read_text()
    convs = parse_benchdnn(text)
    if selection is not None:
        by_name: dict[str, ConvShape] = {}
        for conv in convs:
            by_name.setdefault(conv.name, conv)  # a repeated name: its first descriptor
        convs = [by_name[n] for n in selection if n in by_name]
    if layers:
        convs = [c for c in convs if any(part in c.name for part in layers)]
    return convs[:limit] if limit else convs


def torch_dst(conv: ConvShape) -> tuple[int, ...]:
    """The output size PyTorch computes with symmetric padding pads_begin."""
    return tuple((i + 2 * p - d * (k - 1) - 1) // s + 1 for i, p, d, k, s in zip(
        conv.src, conv.pads_begin, conv.dilations, conv.kernel, conv.strides, strict=True))


# --------------------------------------------------------------------------- torch

def torch_dtype(dtype: str) -> torch.dtype:
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]


def memory_format(rank: int, data_format: str) -> tuple[torch.memory_format, str]:
    """PyTorch's memory format for a data format, and a description of it."""
    if data_format == "NCX":
        return torch.contiguous_format, "contiguous"
    if rank == 2:
        return torch.channels_last, "channels_last"
    if rank == 3:
        return torch.channels_last_3d, "channels_last_3d"
    return torch.contiguous_format, "contiguous NCW (PyTorch has no channels_last for 1D)"


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    if array.dtype == ml_dtypes.bfloat16:  # torch.from_numpy does not know ml_dtypes
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def data_to_torch(array: np.ndarray, data_format: str, fmt: torch.memory_format
                  ) -> torch.Tensor:
    """A convgrad data array as a PyTorch (N, C, *X) tensor in memory format `fmt`."""
    tensor = _from_numpy(array)
    if data_format == "NXC":
        rank = array.ndim - 2
        tensor = tensor.permute(0, rank + 1, *range(1, rank + 1))
    return tensor.contiguous(memory_format=fmt)


def weights_to_torch(array: np.ndarray, weights_format: str, fmt: torch.memory_format
                     ) -> torch.Tensor:
    """convgrad weights (OIX, XIO or OXI) as a PyTorch (O, I/g, *K) tensor."""
    tensor = _from_numpy(array)
    rank = array.ndim - 2
    if weights_format == "XIO":
        tensor = tensor.permute(rank + 1, rank, *range(rank))
    elif weights_format == "OXI":
        tensor = tensor.permute(0, rank + 1, *range(1, rank + 1))
    return tensor.contiguous(memory_format=fmt)


def data_from_torch(tensor: torch.Tensor, data_format: str) -> np.ndarray:
    """A PyTorch (N, C, *X) result as f32 numpy in convgrad's data format."""
    if data_format == "NXC":
        tensor = tensor.permute(0, *range(2, tensor.dim()), 1)
    return tensor.float().contiguous().numpy()


def weights_from_torch(tensor: torch.Tensor, weights_format: str) -> np.ndarray:
    """A PyTorch (O, I/g, *K) result as f32 numpy in convgrad's weights format."""
    if weights_format == "XIO":
        tensor = tensor.permute(*range(2, tensor.dim()), 1, 0)
    elif weights_format == "OXI":
        tensor = tensor.permute(0, *range(2, tensor.dim()), 1)
    return tensor.float().contiguous().numpy()


# --------------------------------------------------------------------------- machine

_PEAK_SOURCE = r"""
typedef float vf __attribute__((vector_size(VBYTES)));

/* ACC independent chains of acc = acc * scale + add: with -mfma, one FMA each. */
double convgrad_bench_fma(long iterations, float scale)
{
    const vf zero = {0};
    const vf mul = zero + scale, add = zero + 1e-3f;
    vf acc[ACC];
    for (int i = 0; i < ACC; ++i)
        acc[i] = zero + 1e-3f * (float)i;
    for (long n = 0; n < iterations; ++n) {
#pragma GCC unroll 32
        for (int i = 0; i < ACC; ++i)
            acc[i] = acc[i] * mul + add;
    }
    float total = 0.0f;
    for (int i = 0; i < ACC; ++i)
        for (int j = 0; j < VBYTES / 4; ++j)
            total += acc[i][j];
    return total;
}
"""

# Vector bytes and accumulators per ISA: enough chains to cover FMA latency x
# throughput, few enough to stay in registers (32 zmm, 16 ymm/xmm).
_PEAK_SHAPE = {"avx512bf16": (64, 24), "avx512": (64, 24), "avx2": (32, 12), "portable": (16, 12)}


def measure_peak(isa: str, seconds: float = 0.05, runs: int = 7) -> float:
    """Single-thread f32 GFLOP/s of independent FMA chains (best of `runs`)."""
    vbytes, accumulators = _PEAK_SHAPE[isa]
    with tempfile.TemporaryDirectory(prefix="convgrad-bench-peak-") as tmp:
        source = Path(tmp) / "peak.c"
        source.write_text(f"#define VBYTES {vbytes}\n#define ACC {accumulators}\n"
                          + _PEAK_SOURCE)
        library = Path(tmp) / "peak.so"
        compile_objects([source], library, isa)
        ffi = cffi.FFI()
        ffi.cdef("double convgrad_bench_fma(long, float);")
        function = ffi.dlopen(str(library)).convgrad_bench_fma
    flops_per_iteration = 2 * accumulators * vbytes // 4
    iterations = 100_000
    while True:  # calibrate to about `seconds` a run
        begin = time.perf_counter()
        function(iterations, 0.999)
        elapsed = time.perf_counter() - begin
        if elapsed >= seconds / 4:
            break
        iterations *= 4
    iterations = max(1, int(iterations * seconds / elapsed))
    best = 0.0
    for _ in range(runs):
        begin = time.perf_counter()
        function(iterations, 0.999)
        best = max(best, iterations * flops_per_iteration / (time.perf_counter() - begin))
    return best / 1e9


def machine_info(peak: float) -> dict:
    return {
        "cpu": cpu_model(),
        "target": host(),
        "logical_cpus": os.cpu_count(),
        "cpu_isas": list(available_isas()),
        "isa": selected_isa(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"),
        "convgrad_amx": os.environ.get("CONVGRAD_AMX", "default"),
        "peak_f32_gflops_per_core": round(peak, 2),
        "torch": torch.__version__,
        "torch_mkldnn": bool(torch.backends.mkldnn.is_available()),
        "convgrad_generator": generator_version(),
        "compiler": compiler_identity().splitlines()[0],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# --------------------------------------------------------------------------- timing

def timed_pair(functions: Sequence[Callable[[], object]], min_time: float,
               min_repeats: int = 3, block_time: float = 0.05) -> list[tuple[float, int]]:
    """(median seconds, calls) of each function, until each ran `min_repeats` timed
    calls and `min_time` seconds in total.

    The functions take turns in blocks of calls (so a change of machine load hits all
    alike), and the first call of a block is not counted: PyTorch bundles its own
    OpenMP runtime, whose idle threads spin for a while after each call and would slow
    down the first call of the other library on a 2-core machine (and ours do the
    same to PyTorch)."""
    times: list[list[float]] = [[] for _ in functions]
    while True:
        pending = [i for i, t in enumerate(times) if len(t) < min_repeats or sum(t) < min_time]
        if not pending:
            return [(statistics.median(t), len(t)) for t in times]
        for i in pending:
            block_start, calls = time.perf_counter(), 0
            while calls < 2 or time.perf_counter() - block_start < block_time:
                begin = time.perf_counter()
                functions[i]()
                if calls:
                    times[i].append(time.perf_counter() - begin)
                calls += 1


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
    data_format: str
    flops: int
    ours_ms: float | None = None
    ours_gflops: float | None = None
    ours_calls: int = 0
    torch_ms: float | None = None
    torch_gflops: float | None = None
    torch_calls: int = 0
    ratio: float | None = None  # ours GFLOP/s / torch GFLOP/s
    ours_pct_peak: float | None = None
    torch_pct_peak: float | None = None
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


def prepare(conv: ConvShape, op: str, shape_set: str, args: argparse.Namespace,
            rng: np.random.Generator) -> Case:
    """Arrays, tensors and calls of one layer; both sides get the same data where
    the problems have the same shapes."""
    (layer,) = conv_layers(conv, (OPS[op],), batch=args.batch, dtype=args.dtype,
                           data_format=args.data_format, weights_format=args.weights_format)
    dtype = api.DTYPE_BY_NAME[args.dtype]
    a, b = (aligned(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
            for shape in layer.inputs[:2])
    inputs = [a, b, *([list(layer.inputs[2])] if len(layer.inputs) > 2 else [])]

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


def run_case(case: Case, threads: Sequence[int], args: argparse.Namespace,
             peak: float) -> list[Row]:
    """Times one case at every thread count (the first convgrad call separately)."""
    template = case.template
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
    rows = []
    for count in threads:
        row = replace(template, threads=count)
        convgrad.set_num_threads(count)
        torch.set_num_threads(count)
        calls: list[Callable[[], object]] = [lambda count=count: case.ours(count)]
        if case.torch_call is not None:
            calls.append(case.torch_call)
        for call in calls:  # warm up at this thread count
            call()
        timings = timed_pair(calls, args.min_time)
        row.ours_ms, row.ours_calls = timings[0][0] * 1e3, timings[0][1]
        row.ours_gflops = row.flops / timings[0][0] / 1e9
        row.ours_pct_peak = 100 * row.ours_gflops / (peak * count)
        if case.torch_call is not None:
            row.torch_ms, row.torch_calls = timings[1][0] * 1e3, timings[1][1]
            row.torch_gflops = row.torch_flops / timings[1][0] / 1e9
            row.torch_pct_peak = 100 * row.torch_gflops / (peak * count)
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


def merge_rounds(rounds: list[list[Row]], peak: float) -> list[Row]:
    """One row per (layer, op, threads) from rounds of the same rows: the median time of
    each library over the rounds (its share of `peak`, GFLOP/s per core, from that), and
    the median of the rounds' ratios (a slow spell of the machine within one round moves
    one ratio, not the median); the first round's first call and checks, the calls of all
    rounds."""
    if len(rounds) == 1:
        return rounds[0]

    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    merged = []
    for same in zip(*rounds, strict=True):
        row = replace(same[0])
        for name in ("ours", "torch"):
            ms = median([getattr(r, f"{name}_ms") for r in same])
            setattr(row, f"{name}_calls", sum(getattr(r, f"{name}_calls") for r in same))
            setattr(row, f"{name}_ms", ms)
            if ms is not None:
                flops = row.flops if name == "ours" else row.torch_flops
                gflops = flops / ms / 1e6
                setattr(row, f"{name}_gflops", gflops)
                setattr(row, f"{name}_pct_peak", 100 * gflops / (peak * row.threads))
        row.ratio = median([r.ratio for r in same])
        row.tuned_gain = median([r.tuned_gain for r in same])
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


# --------------------------------------------------------------------------- overheads

def measure_call_overhead(args: argparse.Namespace, calls: int = 2000
                          ) -> tuple[dict, KernelConfig]:
    """Median microseconds of one call on a tiny problem (1 thread), both libraries,
    and the KernelConfig of convgrad's kernel for it."""
    tiny_args = argparse.Namespace(**{**vars(args), "batch": 1, "no_torch": False})
    case = prepare(TINY, "data", "overhead", tiny_args, np.random.default_rng(1))
    convgrad.set_num_threads(1)
    torch.set_num_threads(1)
    ours = case.ours
    result = {}
    for name, call in (("ours", lambda: ours(1)), ("torch", case.torch_call)):
        seconds = median_seconds(call, calls, warmups=50)
        result[f"{name}_tiny_call_us"] = round(seconds * 1e6, 2)
    result["tiny_problem"] = (f"ConvolutionBackwardData 1x1, N=1, 4x4, 16->16 channels, "
                              f"{args.dtype} {args.data_format}, 1 thread")
    config = case.layer.resolve().config.with_isa(selected_isa())
    return result, config


_LOAD_SNIPPET = """
import json, sys, time
from convgrad.codegen import KernelConfig
from convgrad import kernels
config = KernelConfig.from_dict(json.loads(sys.argv[1]))
begin = time.perf_counter()
kernel = kernels.get_kernel(config)
print(json.dumps({"ms": (time.perf_counter() - begin) * 1e3, "origin": kernel.origin}))
"""


def measure_cached_load(config: KernelConfig, processes: int = 3) -> dict:
    """Milliseconds for a fresh process to get a kernel that is in the disk cache
    (cache key, compiler identity, digest check, dlopen), median of `processes`
    processes."""
    env = dict(os.environ)
    samples, origin = [], ""
    for _ in range(processes):
        out = subprocess.run([sys.executable, "-c", _LOAD_SNIPPET,
                              json.dumps(config.to_dict())], capture_output=True, text=True,
                             check=True, env=env, cwd=ROOT).stdout
        record = json.loads(out.strip().splitlines()[-1])
        samples.append(record["ms"])
        origin = record["origin"]
    return {"cached_load_ms": round(statistics.median(samples), 2),
            "cached_load_origin": origin}


# --------------------------------------------------------------------------- reports

def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: list[Row]) -> str:
    tuned = any(r.tuned_gflops for r in rows)
    header = ["layer", "op", "threads", "ours GFLOP/s", "torch GFLOP/s", "ratio",
              "ours % peak", "first call ms"]
    header += ["tuned GFLOP/s", "tuned ratio", "tuned gain", "tuned plan"] if tuned else []
    lines = [[r.layer, r.op, str(r.threads), _fmt(r.ours_gflops, 2), _fmt(r.torch_gflops, 2),
              _fmt(r.ratio, 3), _fmt(r.ours_pct_peak, 1), _fmt(r.first_call_ms, 0)]
             + ([_fmt(r.tuned_gflops, 2), _fmt(r.tuned_ratio, 3), _fmt(r.tuned_gain, 3),
                 r.tuned_plan] if tuned else [])
             for r in rows]
    header.append("note")
    for line, r in zip(lines, rows, strict=True):
        line.append(r.note)
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
    text = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            for line in [header, *lines]]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def geomeans(rows: list[Row]) -> list[dict]:
    """Geometric means per (op, threads): of the ratios to PyTorch, and with --tune of
    the tuned plans' ratios to PyTorch and their gains over the rules' plans."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        if row.ratio or row.tuned_gain:
            groups.setdefault((row.op, row.threads), []).append(row)
    means = []
    for (op, threads), group in sorted(groups.items()):
        ratios = [r.ratio for r in group if r.ratio]
        mean = {"op": op, "threads": threads, "layers": len(ratios),
                "geomean_ratio": geomean(ratios)}
        if any(r.tuned_gain for r in group):
            mean["tuned_geomean_ratio"] = geomean([r.tuned_ratio for r in group
                                                    if r.tuned_ratio])
            mean["tuned_geomean_gain"] = geomean([r.tuned_gain for r in group
                                                   if r.tuned_gain])
        means.append(mean)
    return means


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[field.name for field in fields(Row)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


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


# --------------------------------------------------------------------------- main

@contextlib.contextmanager
def environment(updates: dict[str, str]) -> Iterator[None]:
    """Sets environment variables and forgets loaded kernels; restores both after."""
    with mock.patch.dict(os.environ, updates):
        kernels.reset()
        try:
            yield
        finally:
            kernels.reset()


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,2")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="resnet50", choices=[*SETS, "all"],
                        help="shape set (default resnet50)")
    parser.add_argument("--ops", default="data,weights",
                        help="comma-separated: data (ConvolutionBackwardData), weights "
                             "(ConvolutionBackwardWeights), fwd (ConvTransposeBackwardData: "
                             "the forward convolution), tweights "
                             "(ConvTransposeBackwardWeights); default data,weights")
    parser.add_argument("--threads", type=int_list, default=[1, 2],
                        help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--batch", type=int, default=8, help="batch, overrides mb (default 8)")
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"],
                        help="NXC: PyTorch channels_last; NCX: contiguous (default NXC)")
    parser.add_argument("--weights-format", default=None, choices=["OIX", "XIO", "OXI"],
                        help="convgrad's weights layout: OIX is PyTorch's own (its "
                             "[O][I][k...]), OXI PyTorch's channels_last, XIO the ops' "
                             "default (default XIO; IOX/XOI/IXO for the ConvTranspose ops)")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="seconds of calls per timing, at least 3 calls (default 0.3)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every case this many times, one round of all cases after "
                             "another, and report medians (default 1)")
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N shapes of each set")
    parser.add_argument("--layers", default=None,
                        help="comma-separated substrings: only the layers whose name "
                             "contains one (e.g. res2a_branch2a,conv1)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the usual kernel cache (CONVGRAD_CACHE_DIR) instead of a "
                             "fresh temporary one, so first calls may be cache loads")
    parser.add_argument("--aot", action="store_true",
                        help="let the runtime use ahead-of-time kernels (CONVGRAD_AOT_PATH "
                             "or generated/); by default they are ignored")
    parser.add_argument("--isa", default=None, choices=list(ONEDNN_ISA),
                        help="run convgrad's path for this ISA (CONVGRAD_ISA) and limit "
                             "PyTorch's oneDNN to the same (ONEDNN_MAX_CPU_ISA) and MKL too "
                             "(MKL_ENABLE_INSTRUCTIONS); default: the best this CPU runs, "
                             "unlimited")
    parser.add_argument("--tune", action="store_true",
                        help="also time each layer's tuned plan (convgrad.tuning: candidates "
                             "timed at this size and thread count first), paired with the "
                             "rules' plan apart from PyTorch; its ratio to PyTorch is the "
                             "rules' ratio times that gain")
    parser.add_argument("--no-torch", action="store_true",
                        help="time convgrad only (PyTorch's CPU f16 weight gradient runs at "
                             "~0.2 GFLOP/s: a full f16 set with it takes hours)")
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR,
                        help=f"benchdnn shape files (default {DEFAULT_SHAPES_DIR})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or any(o not in OPS for o in ops):
        parser.error(f"--ops {args.ops!r}: expected a comma-separated subset of {list(OPS)}")
    args.ops = list(dict.fromkeys(ops))
    args.layers = [p.strip() for p in (args.layers or "").split(",") if p.strip()]
    if args.batch < 1 or (args.limit is not None and args.limit < 1) or args.min_time < 0:
        parser.error("--batch and --limit must be positive, --min-time not negative")
    if torch is None:
        parser.error("PyTorch is not installed: pip install -e '.[bench]'")
    if args.isa and args.isa not in available_isas():
        parser.error(f"--isa {args.isa}: this CPU runs {list(available_isas())}")
    return args


# oneDNN's and MKL's names of the most each library may use on each convgrad path.
ONEDNN_ISA = {"avx512bf16": ("AVX512_CORE_BF16", "AVX512_E2"), "avx512": ("AVX512_CORE", "AVX512"),
              "avx2": ("AVX2", "AVX2"), "portable": ("SSE41", "SSE4_2")}


def limit_isa(isa: str) -> dict[str, str]:
    """The environment that puts convgrad and PyTorch on the same ISA path. oneDNN
    reads ONEDNN_MAX_CPU_ISA at its first primitive, so this is set before any call.
    Every path it names is below AMX, so convgrad's kernels leave AMX too (CONVGRAD_AMX)."""
    onednn, mkl = ONEDNN_ISA[isa]
    return {"CONVGRAD_ISA": isa, "ONEDNN_MAX_CPU_ISA": onednn, "MKL_ENABLE_INSTRUCTIONS": mkl,
            "CONVGRAD_AMX": "0"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sets = list(SETS) if args.set == "all" else [args.set]
    shapes: list[tuple[str, ConvShape]] = []
    for name in sets:
        convs = load_set(name, args.shapes_dir, args.limit, args.layers)
        if convs is None:
            print(f"skipping set {name}: {args.shapes_dir / SETS[name][0]} not found",
                  file=sys.stderr)
            continue
        shapes += [(name, conv) for conv in convs]
    if not shapes:
        print("no shapes to run", file=sys.stderr)
        return 1

    saved_torch_threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        updates = {} if args.aot else {"CONVGRAD_AOT_PATH": ""}
        if args.isa:
            updates.update(limit_isa(args.isa))
        if not args.keep_cache:
            updates["CONVGRAD_CACHE_DIR"] = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="convgrad-bench-cache-"))
        stack.enter_context(environment(updates))
        stack.callback(convgrad.set_num_threads, None)
        stack.callback(torch.set_num_threads, saved_torch_threads)

        isa = selected_isa()
        peak = measure_peak(isa)
        machine = machine_info(peak)
        print(f"{machine['cpu']}, {machine['logical_cpus']} logical CPUs; convgrad "
              f"{machine['convgrad_generator']} ({machine['isa']}), torch {machine['torch']}")
        print(f"f32 FMA peak ({isa}, 1 thread): {peak:.1f} GFLOP/s per core; PyTorch's "
              f"oneDNN limited to {machine['onednn_max_cpu_isa']}")
        overhead, tiny_config = measure_call_overhead(args)
        overhead.update(measure_cached_load(tiny_config))
        print(f"call on a tiny problem: convgrad {overhead['ours_tiny_call_us']:.1f} us, "
              f"torch {overhead['torch_tiny_call_us']:.1f} us; cached kernel load in a "
              f"fresh process: {overhead['cached_load_ms']:.1f} ms "
              f"({overhead['cached_load_origin']})")
        print(f"{len(shapes)} shapes x ops {','.join(args.ops)} x threads "
              f"{','.join(map(str, args.threads))}; batch {args.batch}, {args.dtype}, "
              f"{args.data_format}, weights {args.weights_format or 'XIO'}; ratio = convgrad "
              f"GFLOP/s / PyTorch GFLOP/s\n", flush=True)

        rng = np.random.default_rng(0)
        rounds: list[list[Row]] = []
        for number in range(args.rounds):
            rounds.append([])
            for (shape_set, conv), op in itertools.product(shapes, args.ops):
                case = prepare(conv, op, shape_set, args, rng)  # one case's arrays at a time
                rounds[-1] += run_case(case, args.threads, args, peak)
                for row in rounds[-1][-len(args.threads):]:
                    print(f"  {f'round {number + 1}: ' if args.rounds > 1 else ''}"
                          f"{row.layer} {row.op} x{row.threads}: ours "
                          f"{_fmt(row.ours_gflops, 2)}, torch {_fmt(row.torch_gflops, 2)} "
                          f"GFLOP/s", file=sys.stderr, flush=True)
        rows = merge_rounds(rounds, peak)

    means = geomeans(rows)
    print(table(rows))
    print("\ngeometric mean of ratios (convgrad / PyTorch):")
    for m in means:
        tuned = (f"; tuned {_fmt(m['tuned_geomean_ratio'], 3)}, tuned / untuned "
                 f"{m['tuned_geomean_gain']:.3f}" if "tuned_geomean_gain" in m else "")
        print(f"  {m['op']:8} {m['threads']} thread(s): {_fmt(m['geomean_ratio'], 3)} "
              f"over {m['layers']} layers{tuned}")

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "results.csv")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps(
        {"machine": machine, "settings": settings, "overhead": overhead,
         "geomean": means, "rows": [asdict(r) for r in rows]}, indent=1))
    title = (f"convgrad vs PyTorch {machine['torch']}: {args.set}, batch {args.batch}, "
             f"{args.dtype} {args.data_format}, {machine['cpu']}")
    written = ["results.csv", "results.json"]
    if plot(rows, means, args.out / "results.png", title):
        written.append("results.png")
    else:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')",
              file=sys.stderr)
    print(f"\nwrote {', '.join(written)} to {args.out}")
    mismatches = [r for r in rows if r.note.startswith("MISMATCH")]
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
