"""The machine a benchmark runs on: its f32 FMA peak, a description for the results
(with PyTorch's or jax's versions), and the environment that puts convgrad and PyTorch
on the same ISA path. Imports neither PyTorch nor jax until a description needs it."""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import cffi
import numpy as np

from convgrad import kernels
from convgrad.codegen import generator_version
from convgrad.codegen.isa import AMX_FEATURES
from convgrad.codegen.targets import host
from convgrad.compiler import compile_objects, compiler_identity
from convgrad.cpu import available_isas, cpu_features, cpu_model, selected_isa

_PEAK_SOURCE = r"""
typedef float vf __attribute__((vector_size(VBYTES)));

/* ACC independent chains of acc = acc * scale + add: with -mfma, one FMA each. */
double convgrad_bench_peak(long iterations)
{
    volatile float scale = 0.999f;
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

_AMX_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Whether Linux grants this process the tile data (ARCH_REQ_XCOMP_PERM, XTILEDATA). */
int convgrad_bench_amx_usable(void)
{
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* Four independent tile sums (16 x 16 f32 each), each grown by one 16 x 32 by 32 x 16
 * bf16 multiply (tdpbf16ps, 16,384 flops) per step from tiles that stay loaded: what
 * the tile unit does when nothing waits on memory. */
__attribute__((target("amx-tile,amx-bf16")))
double convgrad_bench_peak(long iterations)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    static uint16_t values[16 * 32] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; ++i)
        values[i] = 0x3a83;  /* bf16 0.001 */
    _tile_loadconfig(&config);
    _tile_loadd(4, values, 64);
    _tile_loadd(5, values, 64);
    _tile_loadd(6, values, 64);
    _tile_loadd(7, values, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long n = 0; n < iterations; ++n) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    static float sums[16 * 16] __attribute__((aligned(64)));
    double total = 0.0;
    _tile_stored(0, sums, 64);
    total += sums[0];
    _tile_stored(3, sums, 64);
    total += sums[255];
    _tile_release();
    return total;
}
"""


class PeakLoop:
    """A small generated C loop of known flops per step, timed whenever asked: the
    clock wanders (turbo, other tenants), so every row of bench.py gives its share of a
    peak measured next to it in the same process."""

    def __init__(self, source: str, isa: str, flops_per_iteration: int) -> None:
        self.isa = isa
        with tempfile.TemporaryDirectory(prefix="convgrad-bench-peak-") as tmp:
            path = Path(tmp) / "peak.c"
            path.write_text(source)
            library = Path(tmp) / "peak.so"
            compile_objects([path], library, isa)
            self._ffi = cffi.FFI()
            self._ffi.cdef("double convgrad_bench_peak(long);"
                           "int convgrad_bench_amx_usable(void);")
            self._library = self._ffi.dlopen(str(library))
            self._function = self._library.convgrad_bench_peak
        self._flops_per_iteration = flops_per_iteration
        self._iterations_per_second: float | None = None

    def measure(self, seconds: float = 0.05, runs: int = 7) -> float:
        """GFLOP/s of one thread running the loop: the best of `runs` runs of about
        `seconds` each."""
        if self._iterations_per_second is None:  # calibrate once
            iterations = 10_000
            while True:
                begin = time.perf_counter()
                self._function(iterations)
                elapsed = time.perf_counter() - begin
                if elapsed >= 0.01:
                    break
                iterations *= 4
            self._iterations_per_second = iterations / elapsed
        iterations = max(1, int(self._iterations_per_second * seconds))
        best = 0.0
        for _ in range(runs):
            begin = time.perf_counter()
            self._function(iterations)
            best = max(best, iterations * self._flops_per_iteration
                       / (time.perf_counter() - begin))
        return best / 1e9


class Peak(PeakLoop):
    """The single-thread f32 FMA peak of one ISA path; with `amx` (where the path is
    avx512bf16 and the CPU and Linux let this process run AMX-BF16 tiles) also the bf16
    tile peak (`self.amx`, a PeakLoop; None elsewhere)."""

    def __init__(self, isa: str, amx: bool = False) -> None:
        vbytes, accumulators = _PEAK_SHAPE[isa]
        super().__init__(f"#define VBYTES {vbytes}\n#define ACC {accumulators}\n"
                         + _PEAK_SOURCE,
                         isa, 2 * accumulators * vbytes // 4)
        self.amx = amx_peak(isa) if amx else None


def amx_peak(isa: str) -> PeakLoop | None:
    """The bf16 AMX tile peak loop where convgrad's kernels may run AMX (the avx512bf16
    path, AMX-TILE and AMX-BF16 in the CPU, CONVGRAD_AMX not 0) and Linux grants this
    process the tile data; else None."""
    if (isa != "avx512bf16" or not cpu_features() >= AMX_FEATURES
            or os.environ.get("CONVGRAD_AMX") == "0"):
        return None
    loop = PeakLoop(_AMX_PEAK_SOURCE, isa, 4 * 2 * 16 * 16 * 32)
    return loop if loop._library.convgrad_bench_amx_usable() else None


def pin(threads: int) -> list[int]:
    """Restricts this process to the first `threads` CPUs it may run on (as taskset
    does); those CPUs."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    return cpus


@contextlib.contextmanager
def pinned(threads: int | None) -> Iterator[list[int]]:
    """`pin(threads)` (None: no change), the CPUs allowed before given back after."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads is None:
        yield allowed
        return
    try:
        yield pin(threads)
    finally:
        os.sched_setaffinity(0, allowed)


def _software() -> dict:
    """convgrad's generator and compiler, Python, numpy, the platform and the date."""
    return {
        "convgrad_generator": generator_version(),
        "compiler": compiler_identity().splitlines()[0],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def cpu_info(peak: float) -> dict:
    """The machine, convgrad's ISA path and its measured FMA peak, and the software
    (PyTorch's and jax's versions aside)."""
    return {
        "cpu": cpu_model(),
        "target": host(),
        "logical_cpus": os.cpu_count(),
        "cpu_isas": list(available_isas()),
        "isa": selected_isa(),
        "convgrad_amx": os.environ.get("CONVGRAD_AMX", "default"),
        "peak_f32_gflops_per_core": round(peak, 2),
        **_software(),
    }


def machine_info(peak: float) -> dict:
    """The machine and the software, PyTorch's included (bench.py's)."""
    import torch

    return {
        **cpu_info(peak),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"),
        "torch": torch.__version__,
        "torch_mkldnn": bool(torch.backends.mkldnn.is_available()),
    }


def jax_machine_info() -> dict:
    """The machine and the software, jax's included (the JAX benchmarks' workers')."""
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
        **_software(),
    }


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


@contextlib.contextmanager
def environment(updates: dict[str, str]) -> Iterator[None]:
    """Sets environment variables and forgets loaded kernels; restores both after."""
    with mock.patch.dict(os.environ, updates):
        kernels.reset()
        try:
            yield
        finally:
            kernels.reset()
