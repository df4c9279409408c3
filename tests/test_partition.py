"""convgrad.codegen.partition against the kernels' real partition: each kernel of the
ResNet-50 and MobileNetV2 layers (f32, the rules' plans for this CPU, data, weights and
forward ops) is built in the caller threading mode with -DCONVGRAD_TRACE_TASKS, run on
a pool that runs its parts one after the other (any part count runs on 2 cores), and
the tasks each part's main region counted are compared with the model's, for N up to
128. Then the computed balance of ResNet-50 at batch 32 (no compile)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from benchmarks.shapes import DEFAULT_SHAPES_DIR, load_set
from convgrad import kernels
from convgrad.codegen import render
from convgrad.codegen.layers import OP_ALIASES, conv_layers
from convgrad.codegen.partition import NotModelled, Sizes, split
from convgrad.codegen.plan import kernel_name, vendor_plan
from convgrad.compiler import compile_objects, compiler_identity
from convgrad.cpu import cpu_features, cpu_vendor, selected_isa

ROOT = Path(__file__).resolve().parent.parent
# Traced builds, kept between runs (keyed by the C, the flags and the compiler).
BUILDS = ROOT / ".pytest_cache" / "convgrad-traced"
# -O1: the partition is the same at any optimisation, and compiles in about half the time.
FLAGS = ("-DCONVGRAD_TRACE_TASKS", "-O1")
OPS = tuple(OP_ALIASES[op] for op in ("data", "weights", "fwd"))
THREADS = (1, 2, 3, 4, 7, 8, 16, 32, 64, 128)
# The split depends on the rows (batch x height), not on the values: batch 2 crosses
# images in every kind of split and keeps runs short.
BATCH = 2


def _layers(network: str, data_format: str = "NXC", batch: int = BATCH):
    isa = selected_isa()
    for conv in load_set(network, DEFAULT_SHAPES_DIR, None):
        for layer in conv_layers(conv, OPS, batch=batch, data_format=data_format):
            problem = layer.resolve()
            config = problem.config.with_isa(isa)
            yield layer, problem, config, vendor_plan(config, cpu_vendor(), cpu_features())


def _build(config, plan) -> tuple[str, Path]:
    """The kernel's traced shared library (built once, then reused)."""
    source = render(config, plan, "caller")
    name = kernel_name(config, plan)
    key = hashlib.sha256("\n".join((source, *FLAGS, compiler_identity())).encode())
    library = BUILDS / f"{name}-{key.hexdigest()[:16]}.so"
    if not library.exists():
        BUILDS.mkdir(parents=True, exist_ok=True)
        c_file = library.with_suffix(f".{os.getpid()}.c")
        c_file.write_text(source)
        built = library.with_suffix(f".{os.getpid()}.tmp")
        compile_objects([c_file], built, config.isa, extra=FLAGS, threading="caller")
        os.replace(built, library)
        c_file.unlink()
    return name, library


def _traced(problem, name: str, library: Path, threads: int) -> list[int]:
    """Tasks per part of one call on `threads` parts, run one after the other."""
    function, workspace_size = kernels.kernel_functions(name, library)
    counter = ctypes.c_int64.in_dll(ctypes.CDLL(str(library)), "convgrad_traced_tasks")
    per_part = [0] * threads

    @kernels.ffi.callback("void(void *, convgrad_task, void *, size_t)")
    def pool(_, task, argument, count):
        for part in range(count):
            counter.value = 0
            task(argument, part)
            per_part[part] += counter.value
        counter.value = 0

    dims = kernels.dims_of(problem, threads)
    dims.parallel_for = pool
    c = problem.config
    elements = max(problem.batch * math.prod(problem.src_spatial) * c.groups * c.cin_per_group,
                   problem.batch * math.prod(problem.dst_spatial) * c.groups * c.cout_per_group,
                   c.groups * c.cin_per_group * c.cout_per_group * math.prod(c.kernel))
    buffers = [np.zeros(elements, np.float32) for _ in range(3)]
    workspace = np.zeros(max(1, workspace_size(dims)), np.uint8)
    counter.value = 0
    status = function(*map(kernels.ffi.from_buffer, buffers), dims,
                      kernels.ffi.from_buffer(workspace))
    assert status == 0
    per_part[0] += counter.value  # a region of one part runs on the calling thread
    return per_part


def _check_network(network: str, data_format: str, threads=THREADS) -> list[str]:
    """Checks every modelled layer of the network; returns those not modelled."""
    layers = []
    not_modelled = []
    for entry in _layers(network, data_format):
        try:
            split(entry[2], Sizes.of(entry[1]), 1, entry[3])
            layers.append(entry)
        except NotModelled as why:
            not_modelled.append(f"{entry[0].name} {entry[0].op}: {why}")
    unique = {}
    for _, _, config, plan in layers:
        unique.setdefault((config, tuple(sorted(plan.items()))), (config, plan))
    with ThreadPoolExecutor(max_workers=2) as builder:
        built = dict(zip(unique, builder.map(lambda cp: _build(*cp), unique.values()),
                         strict=True))
    wrong = []
    for layer, problem, config, plan in layers:
        name, library = built[config, tuple(sorted(plan.items()))]
        for n in threads:
            model = split(config, Sizes.of(problem), n, plan)
            traced = _traced(problem, name, library, n)
            expected = list(model.tasks) + [0] * (n - model.shares)
            if traced != expected:
                wrong.append(f"{layer.name} {layer.op} N={n}: model {expected[:12]}, "
                             f"kernel {traced[:12]}")
    assert not wrong, "\n".join(wrong[:20])
    return not_modelled


@pytest.mark.parametrize("network", ["resnet50", "mobilenet_v2"])
def test_model_matches_the_kernels_partition(network):
    assert _check_network(network, "NXC") == []


@pytest.mark.slow
@pytest.mark.parametrize("network", ["resnet50", "mobilenet_v2"])
def test_model_matches_the_kernels_partition_ncx(network):
    """NCX: bands of rows and the channels-first 1x1 tiles are not modelled yet."""
    not_modelled = _check_network(network, "NCX")
    assert all("not modelled" in line for line in not_modelled)


@functools.cache
def _resnet50_batch32_unbalanced() -> tuple[tuple[str, str, int, object], ...]:
    """(layer, op, N, split) of every ResNet-50 layer at batch 32 whose largest share
    is above 1.25x the mean, N = 2..64 (computed: no compile)."""
    found = []
    for layer, problem, config, plan in _layers("resnet50", batch=32):
        for n in range(2, 65):
            result = split(config, Sizes.of(problem), n, plan)
            assert result.total and sum(result.tasks) == result.total
            if result.imbalance > 1.25:
                found.append((layer.name, layer.op, n, result))
    return tuple(found)


def test_resnet50_batch32_unbalanced_splits_are_the_known_two():
    """Up to 64 threads every ResNet-50 layer at batch 32 splits within 1.25x the mean,
    but for two known causes: weight gradients' whole pixel slices (weight_slices.h.j2's
    thread_share: 8 slices over 7 threads give one thread 2) or uneven threads per slice
    (12 threads over 8 slices), and the 1x1 data kernels of 7x7 layers, whose 136
    blocks of 96 pixels x 4 vectors are too few for 43 threads or more."""
    for name, op, n, result in _resnet50_batch32_unbalanced():
        assert result.kind == "slice_shares" or (
            result.kind == "part_ranges" and result.total < 4 * n), (name, op, n, str(result))


@pytest.mark.xfail(strict=True, reason="weight gradients' whole-slice split and the 1x1 "
                                       "7x7 data kernels' blocks (see the test above)")
def test_resnet50_batch32_within_1_25_of_the_mean_up_to_64_threads():
    assert not _resnet50_batch32_unbalanced()


def test_explain_prints_the_split(capsys):
    from convgrad.cli import main

    assert main(["explain", "--layer", "res2a_branch2b", "--ops", "data,weights",
                 "--batch", "32", "--threads", "2,7"]) == 0
    out = capsys.readouterr().out
    assert out.count("largest/mean") == 4 and "7: 7 shares, largest/mean 1.000" in out
