"""An AOT folder's kernels on the caller's thread pool against the same kernels on OpenMP.

    python -m benchmarks.aot_threading [LAYER_FILES...] [--batch 8] [--threads 1,2]
                                       [--repeats 15] [--work DIR] [-j 2]

Builds the layers (default: the built-in ResNet-50 list, f32, NXC, as `convgrad aot`
reads it) twice, `--threading openmp` and `--threading caller` (kept in --work and
reused while their manifests name this mode and generator version), loads both
libraries into this one process, and times every layer in both at each thread count:
the OpenMP kernels with dims.num_threads = T, the caller ones on examples/caller_pool's
ThreadPool of T workers.
Calls go in blocks of `--repeats` back to back, the two modes' blocks alternating (the
first mode alternating too), with a pause between blocks so that neither runtime's
spinning threads steal the other's cores. Prints per layer the median call of each
mode and their ratio, and per thread count the geometric mean of the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from cffi import FFI

from convgrad.aot import read_layers
from convgrad.codegen import generator_version
from convgrad.codegen.render import render_dims_declaration
from convgrad.cpu import cpu_model

ROOT = Path(__file__).resolve().parent.parent
POOL = ROOT / "examples" / "caller_pool"
SHIM = r"""
#include "thread_pool.hpp"
extern "C" {
void *pool_create(unsigned workers) { return new ThreadPool(workers); }
void pool_destroy(void *pool) { delete static_cast<ThreadPool *>(pool); }
void pool_parallel_for(void *pool, convgrad_task task, void *argument, size_t count)
{
    ThreadPool::parallel_for(pool, task, argument, count);
}
}
"""


def build(mode: str, layer_args: list[str], folder: Path, jobs: int) -> dict:
    manifest = folder / "manifest.json"
    command = [sys.executable, "-m", "convgrad", "aot", *layer_args, "-o", str(folder),
               "--threading", mode, "-j", str(jobs)]
    recorded = json.loads(manifest.read_text()) if manifest.exists() else {}
    if (recorded.get("threading"), recorded.get("generator_version")) != (
            mode, generator_version()):
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(manifest.read_text())


def pool_library(folder: Path) -> Path:
    source, library = folder / "pool_shim.cpp", folder / "libpool_shim.so"
    source.write_text(SHIM)
    subprocess.run(["c++", "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", "-I",
                    str(folder), "-I", str(POOL), str(source), "-o", str(library)], check=True)
    return library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layers", nargs="*", type=Path)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=15, help="calls per block")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per mode")
    parser.add_argument("--work", type=Path, default=Path("aot-threading"))
    parser.add_argument("-j", "--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    layer_args = [*map(str, args.layers), "--batch", str(args.batch)]
    layers = read_layers(args.layers, batch=args.batch)
    manifests = {mode: build(mode, layer_args, args.work / mode, args.jobs)
                 for mode in ("openmp", "caller")}
    kernel_of = {(user["op"], user["name"]): kernel["name"]
                 for kernel in manifests["caller"]["kernels"] for user in kernel["layers"]}

    ffi = FFI()
    ffi.cdef(render_dims_declaration())
    names = sorted(set(kernel_of.values()))
    ffi.cdef("".join(f"int {name}(const void *, const void *, void *, const convgrad_dims *,"
                     f" void *);\nint64_t {name}_workspace_size(const convgrad_dims *);\n"
                     for name in names))
    ffi.cdef("void *pool_create(unsigned); void pool_destroy(void *);"
             "void pool_parallel_for(void *, convgrad_task, void *, size_t);")
    libraries = {mode: ffi.dlopen(str(args.work / mode / "libconvgrad_kernels.so"))
                 for mode in manifests}
    shim = ffi.dlopen(str(pool_library(args.work / "caller")))
    rng = np.random.default_rng(0)
    thread_counts = [int(t) for t in args.threads.split(",")]
    ratios: dict[int, list[float]] = {t: [] for t in thread_counts}
    print(f"CPU {cpu_model()}; batch {args.batch}; "
          f"medians of {args.blocks} blocks x {args.repeats} calls per mode", flush=True)
    print(f"{'layer':<34} {'op':<27} {'T':>2} {'openmp ms':>10} {'caller ms':>10} "
          f"{'caller/openmp':>13}")
    for threads in thread_counts:
        pool = shim.pool_create(threads)
        for layer in layers:
            problem = layer.resolve()
            arrays = [rng.standard_normal(shape).astype(np.float32)
                      for shape in layer.inputs[:2]]
            first, second = arrays[::-1] if problem.swap_inputs else arrays
            out = np.empty(problem.output_shape, np.float32)
            name = kernel_of[layer.op, layer.name]
            calls = {}
            for mode, library in libraries.items():
                dims = ffi.new("convgrad_dims *")
                dims.size = ffi.sizeof("convgrad_dims")
                rank = problem.config.rank
                dims.batch = problem.batch
                dims.src[0:rank] = problem.src_spatial
                dims.dst[0:rank] = problem.dst_spatial
                dims.pads_begin[0:rank] = problem.pads_begin
                dims.num_threads = threads
                if mode == "caller":
                    dims.parallel_for = shim.pool_parallel_for
                    dims.pool = pool
                kernel = getattr(library, name)
                workspace = np.zeros(getattr(library, f"{name}_workspace_size")(dims), np.uint8)
                pointers = (ffi.from_buffer(first), ffi.from_buffer(second),
                            ffi.from_buffer(out), dims, ffi.from_buffer(workspace))
                calls[mode] = (kernel, pointers, workspace, dims)
            times: dict[str, list[float]] = {mode: [] for mode in calls}
            for block in range(args.blocks * 2):
                mode = ("openmp", "caller")[(block + block // 2) % 2]
                kernel, pointers, *_ = calls[mode]
                if kernel(*pointers):
                    raise RuntimeError(f"{name} failed")
                for _ in range(args.repeats):
                    begin = time.perf_counter()
                    kernel(*pointers)
                    times[mode].append(time.perf_counter() - begin)
                time.sleep(0.02)
            medians = {mode: statistics.median(values) for mode, values in times.items()}
            ratio = medians["caller"] / medians["openmp"]
            ratios[threads].append(ratio)
            print(f"{layer.name:<34} {layer.op:<27} {threads:>2} "
                  f"{medians['openmp'] * 1e3:>10.3f} {medians['caller'] * 1e3:>10.3f} "
                  f"{ratio:>13.3f}", flush=True)
        shim.pool_destroy(pool)
    for threads, values in ratios.items():
        geomean = math.exp(sum(map(math.log, values)) / len(values))
        print(f"{threads} thread(s): caller/openmp time, geometric mean over {len(values)} "
              f"layers: {geomean:.3f} (min {min(values):.3f}, max {max(values):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
