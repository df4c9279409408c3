"""In-process A/B of depthwise kernels with the threads threshold of rules_groups
(DEPTHWISE_MIN_THREAD_FLOPS) against the same C with the old 2e6: both
libraries built from one rendering, called in turn on the same arrays, 2 threads asked
for. Run from the repository's root folder:

    python ab_threshold.py            # CONVGRAD_ISA picks the path

MobileNetV2's and EfficientNet-B0's depthwise layers at 112x112 input, batch 8, whose
multiply-adds lie between the two thresholds (so the old build ran them on one thread).
Prints each layer's median microseconds (old, new), old / new, and the new threshold.
"""

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from convgrad.bound import bind, workspace
from convgrad.codegen import render
from convgrad.codegen.rules_groups import min_thread_flops
from convgrad.compiler import compile_objects
from convgrad.kernels import ffi, kernel_functions

OPS = ("ConvTransposeBackwardData", "ConvolutionBackwardData", "ConvolutionBackwardWeights")
# (spatial in, channels, kernel, stride): MobileNetV2 and EfficientNet-B0 at 112x112
LAYERS = [(14, 192, 3, 2), (7, 384, 3, 1), (7, 576, 3, 2), (4, 960, 3, 1),
          (7, 480, 5, 1), (7, 672, 5, 2), (4, 1152, 5, 1), (4, 1152, 3, 1)]
folder = Path(tempfile.mkdtemp())


def build(source: str, name: str, isa: str, tag: str):
    """The kernel `name` of C `source` and its workspace function, compiled for `isa`."""
    path = folder / f"{tag}-{name}.c"
    path.write_text(source)
    library = path.with_suffix(".so")
    compile_objects([path], library, isa)
    return kernel_functions(name, library)


def per_call(kernel, args, calls: int = 30) -> float:
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        kernel(*args)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


print(f"{'op':28s} {'layer':22s} {'MFLOP':>6s} {'old us':>8s} {'new us':>8s} {'old/new':>7s} "
      "threshold")
for size, channels, k, stride in LAYERS:
    out_size = (size + 2 * (k // 2) - k) // stride + 1
    for op in OPS:
        attrs = {"pads_begin": k // 2, "pads_end": k // 2, "groups": channels,
                 "strides": stride, "data_format": "NXC"}
        src, dst = (8, size, size, channels), (8, out_size, out_size, channels)
        if op == "ConvolutionBackwardWeights":
            shapes, shape = (src, dst), [k, k]
        elif op == "ConvolutionBackwardData":
            attrs["weights_format"] = "XIO"
            shapes, shape = (dst, (k, k, 1, channels)), [size, size]
        else:
            attrs["weights_format"] = "XOI"
            shapes, shape = (src, (k, k, 1, channels)), None
        call = bind(op, *shapes, "f32", attrs, shape, 2)
        flops = 2 * call.problem.multiply_adds
        new_c = render(call.config)
        threshold = min_thread_flops(call.config)
        old_c = new_c.replace(f"MIN_THREAD_FLOPS {threshold}", "MIN_THREAD_FLOPS 2e6")
        if old_c == new_c:
            raise SystemExit("not a depthwise kernel with a lower threshold")
        name = call.config.name
        isa = call.config.isa
        (new, size_of), (old, _) = (build(new_c, name, isa, "new"),
                                    build(old_c, name, isa, "old"))
        rng = np.random.default_rng(0)
        a, b = (rng.standard_normal(s, dtype=np.float32) for s in shapes)
        if call.swap:
            a, b = b, a
        out = np.empty(call.problem.output_shape, np.float32)
        args = (ffi.from_buffer(a), ffi.from_buffer(b),
                ffi.from_buffer(out, require_writable=True), call.dims,
                workspace(size_of(call.dims)))
        results = {"old": [], "new": []}
        for kernel in (old, new):
            kernel(*args)
        for _ in range(9):
            for tag, kernel in (("old", old), ("new", new)):
                results[tag].append(per_call(kernel, args))
        t_old = statistics.median(results["old"]) * 1e6
        t_new = statistics.median(results["new"]) * 1e6
        print(f"{op:28s} {f'{size}x{size} {channels} k{k} s{stride}':22s} {flops / 1e6:6.2f} "
              f"{t_old:8.1f} {t_new:8.1f} {t_old / t_new:7.2f} {threshold}")
