"""A C driver that runs an AOT folder's kernels on cases written by Python, natively or
under qemu, and the layer list the threading and package tests build: small layers whose
kernels take the templates with OpenMP regions that ask for their thread number (row
shares, NCX bands, the grouped and plain weight gradients, depthwise). The C++ driver
runs a --threading caller folder's kernels on examples/caller_pool's thread pool."""

from __future__ import annotations

import json
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convgrad.codegen.layers import Layer, load_json
from convgrad.reference import reference

LAYERS = [
    {"op": "ConvolutionBackwardData", "name": "data_nxc",
     "inputs": [[2, 6, 5, 32], [3, 3, 16, 32], [11, 9]],
     "attrs": {"strides": 2, "pads_begin": 1, "pads_end": 1}},
    {"op": "ConvolutionBackwardData", "name": "data_ncx",
     "inputs": [[2, 32, 6, 5], [32, 16, 3, 3], [6, 5]],
     "attrs": {"pads_begin": 1, "pads_end": 1, "data_format": "NCX", "weights_format": "OIX"}},
    {"op": "ConvolutionBackwardWeights", "name": "weights_nxc",
     "inputs": [[2, 11, 9, 16], [2, 6, 5, 32], [3, 3]],
     "attrs": {"strides": 2, "pads_begin": 1, "pads_end": 1}},
    {"op": "ConvolutionBackwardWeights", "name": "weights_grouped",
     "inputs": [[2, 7, 6, 6], [2, 7, 6, 4], [3, 3]],
     "attrs": {"groups": 2, "pads_begin": 1, "pads_end": 1}},
    {"op": "ConvolutionBackwardData", "name": "data_depthwise",
     "inputs": [[2, 7, 6, 16], [3, 3, 1, 16], [7, 6]],
     "attrs": {"groups": 16, "pads_begin": 1, "pads_end": 1}},
]
# Larger layers of the same kinds: every one of them splits over 3 threads (the kernels
# wake a thread per 2e6 multiply-adds at most, depthwise ones per 5e5).
POOL_LAYERS = [
    {"op": "ConvolutionBackwardData", "name": "data_nxc",
     "inputs": [[8, 12, 10, 32], [3, 3, 16, 32], [23, 19]],
     "attrs": {"strides": 2, "pads_begin": 1, "pads_end": 1}},
    {"op": "ConvolutionBackwardData", "name": "data_ncx",
     "inputs": [[8, 32, 12, 10], [32, 16, 3, 3], [12, 10]],
     "attrs": {"pads_begin": 1, "pads_end": 1, "data_format": "NCX", "weights_format": "OIX"}},
    {"op": "ConvolutionBackwardWeights", "name": "weights_nxc",
     "inputs": [[8, 23, 19, 16], [8, 12, 10, 32], [3, 3]],
     "attrs": {"strides": 2, "pads_begin": 1, "pads_end": 1}},
    {"op": "ConvolutionBackwardWeights", "name": "weights_grouped",
     "inputs": [[8, 14, 12, 32], [8, 14, 12, 16], [3, 3]],
     "attrs": {"groups": 2, "pads_begin": 1, "pads_end": 1}},
    {"op": "ConvolutionBackwardData", "name": "data_depthwise",
     "inputs": [[16, 28, 24, 16], [3, 3, 1, 16], [28, 24]],
     "attrs": {"groups": 16, "pads_begin": 1, "pads_end": 1}},
]

DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "%s"

typedef int (*kernel_fn)(const void *, const void *, void *, const convgrad_dims *, void *);
static const kernel_fn KERNELS[] = {%s};

/* argv[1]: a case (15 int64: kernel, batch, src[3], dst[3], pads[3], threads, bytes of
 * a, b and out; then a and b); argv[2]: the status (int32) and the result. */
int main(int argc, char **argv)
{
    int64_t h[15];
    FILE *in = argc == 3 ? fopen(argv[1], "rb") : NULL;
    if (!in || fread(h, sizeof h[0], 15, in) != 15)
        return 2;
    char *a = malloc((size_t)h[12] + 1), *b = malloc((size_t)h[13] + 1);
    char *out = malloc((size_t)h[14] + 1);
    if (!a || !b || !out || fread(a, 1, (size_t)h[12], in) != (size_t)h[12]
        || fread(b, 1, (size_t)h[13], in) != (size_t)h[13])
        return 3;
    fclose(in);
    convgrad_dims dims = {.batch = h[1], .src = {h[2], h[3], h[4]}, .dst = {h[5], h[6], h[7]},
                          .pads_begin = {h[8], h[9], h[10]}, .num_threads = (int32_t)h[11],
                          .size = sizeof(convgrad_dims)};
    int32_t status = KERNELS[h[0]](a, b, out, &dims, NULL);
    FILE *result = fopen(argv[2], "wb");
    fwrite(&status, sizeof status, 1, result);
    fwrite(out, 1, (size_t)h[14], result);
    fclose(result);
    return 0;
}
"""


# The same driver in C++, for --threading caller folders: the case's thread count is the
# worker count of examples/caller_pool's ThreadPool, whose parallel_for runs the parts.
POOL_DRIVER = r"""
#include <cstdint>
#include <cstdio>
#include <vector>
#include "%s"
#include "thread_pool.hpp"

typedef int (*kernel_fn)(const void *, const void *, void *, const convgrad_dims *, void *);
static const kernel_fn KERNELS[] = {%s};

static int pool_calls;

static void counted_parallel_for(void *pool, convgrad_task task, void *argument, size_t count)
{
    ++pool_calls;
    ThreadPool::parallel_for(pool, task, argument, count);
}

int main(int argc, char **argv)
{
    int64_t h[15];
    FILE *in = argc == 3 ? std::fopen(argv[1], "rb") : nullptr;
    if (!in || std::fread(h, sizeof h[0], 15, in) != 15)
        return 2;
    std::vector<char> a(h[12] + 1), b(h[13] + 1), out(h[14] + 1);
    if (std::fread(a.data(), 1, h[12], in) != (size_t)h[12]
        || std::fread(b.data(), 1, h[13], in) != (size_t)h[13])
        return 3;
    std::fclose(in);
    ThreadPool pool(static_cast<unsigned>(h[11]));
    convgrad_dims dims = CONVGRAD_DIMS_INIT;
    dims.batch = h[1];
    for (int i = 0; i < 3; ++i) {
        dims.src[i] = h[2 + i];
        dims.dst[i] = h[5 + i];
        dims.pads_begin[i] = h[8 + i];
    }
    dims.num_threads = static_cast<int32_t>(pool.workers());
    dims.parallel_for = counted_parallel_for;
    dims.pool = &pool;
    int32_t status = KERNELS[h[0]](a.data(), b.data(), out.data(), &dims, nullptr);
    if (h[11] > 1 && pool_calls == 0)
        return 5; /* the kernel never handed its parts to the pool */
    FILE *result = std::fopen(argv[2], "wb");
    std::fwrite(&status, sizeof status, 1, result);
    std::fwrite(out.data(), 1, h[14], result);
    std::fclose(result);
    return 0;
}
"""
POOL_INCLUDE = Path(__file__).resolve().parent.parent / "examples" / "caller_pool"

@dataclass
class Case:
    layer: Layer
    kernel: str  # the C name of its kernel in the folder
    header: list[int]  # the driver's 15 numbers but the kernel's index
    first: np.ndarray  # the kernel's a and b
    second: np.ndarray
    expected: np.ndarray


def write_layers(folder: Path, layers: list[dict] = LAYERS) -> Path:
    path = folder / "layers.json"
    path.write_text(json.dumps(layers))
    return path


def cases(layers_file: Path, manifest: dict, seed: int = 0) -> list[Case]:
    """Each layer of the file on integer data (exact in any summation order), with the
    kernel that serves it in the folder of `manifest`."""
    kernel_of = {(user["op"], user["name"]): kernel["name"] for kernel in manifest["kernels"]
                 for user in kernel["layers"]}
    rng = np.random.default_rng(seed)
    found = []
    for layer in load_json(layers_file):
        a, b = (rng.integers(-2, 3, size=shape).astype(np.float32) for shape in layer.inputs[:2])
        expected = reference(layer.op, [a, b, *map(np.array, layer.inputs[2:])], layer.attrs)
        expected = np.ascontiguousarray(expected, dtype=np.float32)
        problem = layer.resolve()
        first, second = (b, a) if problem.swap_inputs else (a, b)
        pad = [1] * (3 - problem.config.rank)
        header = [problem.batch, *problem.src_spatial, *pad, *problem.dst_spatial, *pad,
                  *problem.pads_begin, *[0] * len(pad), 2,
                  first.nbytes, second.nbytes, expected.nbytes]
        found.append(Case(layer, kernel_of[layer.op, layer.name], header, first, second,
                          expected))
    return found


def driver_source(kernels: list[str], header: str = "convgrad_kernels.h") -> str:
    """The driver's C, calling `kernels` (by index) declared in `header`."""
    return DRIVER % (header, ", ".join(kernels))


def write_driver(folder: Path, kernels: list[str]) -> Path:
    path = folder / "driver.c"
    path.write_text(driver_source(kernels))
    return path


def write_pool_driver(folder: Path, kernels: list[str]) -> Path:
    """The C++ driver of a caller folder (compile with -I POOL_INCLUDE -pthread)."""
    path = folder / "driver.cpp"
    path.write_text(POOL_DRIVER % ("convgrad_kernels.h", ", ".join(kernels)))
    return path


def with_threads(found: list[Case], threads: int) -> list[Case]:
    """The cases with another thread count (the driver's workers)."""
    return [Case(case.layer, case.kernel, [*case.header[:10], threads, *case.header[11:]],
                 case.first, case.second, case.expected) for case in found]


def run(program: Path, found: list[Case], kernels: list[str], work: Path,
        runner: tuple[str, ...] = ()) -> list[bytes]:
    """Runs every case through the driver (under `runner`, e.g. qemu); asserts each
    returns CONVGRAD_OK and equals the reference bit for bit; returns the results."""
    results = []
    for index, case in enumerate(found):
        case_file, result_file = work / f"case{index}.bin", work / f"out{index}.bin"
        case_file.write_bytes(struct.pack("<15q", kernels.index(case.kernel), *case.header)
                              + case.first.tobytes() + case.second.tobytes())
        done = subprocess.run([*runner, str(program), str(case_file), str(result_file)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (case.layer.name, done.returncode, done.stderr[-2000:])
        data = result_file.read_bytes()
        assert struct.unpack("<i", data[:4])[0] == 0, case.layer.name
        result = np.frombuffer(data[4:], dtype=np.float32).reshape(case.expected.shape)
        np.testing.assert_array_equal(result.view(np.uint32), case.expected.view(np.uint32),
                                      err_msg=f"{case.layer.name}: {case.kernel}")
        results.append(data[4:])
    return results


def dynamic_needs(library: Path) -> set[str]:
    """The NEEDED entries of a shared library's dynamic section (readelf -d)."""
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True,
                             check=True).stdout
    return {line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines()
            if "(NEEDED)" in line}


def openmp_symbols(binary: Path, nm: str = "nm") -> list[str]:
    """The undefined symbols of a library or archive that OpenMP would define (GOMP_*,
    omp_*, __kmpc_*)."""
    listing = subprocess.run([nm, "-u", "-A", str(binary)], capture_output=True, text=True,
                             check=True).stdout
    return [line for line in listing.splitlines()
            if line.split()[-1].startswith(("GOMP_", "omp_", "__kmpc_"))]
