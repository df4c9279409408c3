"""convgrad.codegen.partition against the kernels' real partition: each kernel of the
ResNet-50 and MobileNetV2 layers (f32 and bf16, the rules' plans for this CPU but the
AMX path, data, weights and forward ops) is built in the caller threading mode with
-DCONVGRAD_TRACE_TASKS, run on a pool that runs its parts one after the other (any part
count runs on 2 cores), and the tasks each part's main region counted are compared with
the model's, for N up to 128. Then the computed balance of ResNet-50 at batch 32 (no
compile)."""

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
from convgrad.codegen.isa import VECTOR_LANES
from convgrad.codegen.layers import OP_ALIASES, conv_layers
from convgrad.codegen.partition import NotModelled, Sizes, split
from convgrad.codegen.plan import kernel_name, vendor_plan
from convgrad.codegen.variants import carries_amx, resolve_plan
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


def _layers(network: str, data_format: str = "NXC", batch: int = BATCH, dtype: str = "f32"):
    isa = selected_isa()
    for conv in load_set(network, DEFAULT_SHAPES_DIR, None):
        for layer in conv_layers(conv, OPS, batch=batch, data_format=data_format, dtype=dtype):
            problem = layer.resolve()
            config = problem.config.with_isa(isa)
            plan = vendor_plan(config, cpu_vendor(), cpu_features())
            if carries_amx(config):  # the AMX path is not modelled: check the vector tiles
                plan = {**plan, "amx": 0}
            yield layer, problem, config, plan


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


def _traced(problem, name: str, library: Path, threads: int) -> tuple[list[int], int]:
    """Tasks per part of one call on `threads` parts, run one after the other, and the
    data input's bytes past a 64-byte boundary."""
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
    return per_part, buffers[0].ctypes.data % 64


def _check_network(network: str, data_format: str, threads=THREADS,
                   names: tuple[str, ...] = (), dtype: str = "f32",
                   batch: int = BATCH) -> list[str]:
    """Checks every modelled layer of the network (those of `names`, if given, as the
    set names them: "res2b_branch2a" for "resnet_50:res2b_branch2a*2"); returns those
    not modelled."""
    layers = []
    not_modelled = []
    for entry in _layers(network, data_format, batch, dtype):
        if names and entry[0].name.split(":")[-1].split("*")[0] not in names:
            continue
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
            traced, offset = _traced(problem, name, library, n)
            model = split(config, Sizes.of(problem), n, plan, input_offset=offset)
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
    assert _check_network(network, "NCX") == []


def test_model_matches_the_kernels_partition_ncx_sample():
    """NCX, a layer of each kind of split (every layer: the slow test above): the
    channels-first 1x1 tiles in place (res2b_branch2a: with a head block, from numpy's
    input 16 bytes past a line), on a compact copy with strides (res3a_branch2a), and
    the 3x3 layers' bands of rows."""
    assert _check_network("resnet50", "NCX", (1, 2, 3, 7, 16, 64),
                          ("res2b_branch2a", "res3a_branch2a", "res3a_branch2b")) == []


@pytest.mark.slow
@pytest.mark.parametrize("network", ["resnet50", "mobilenet_v2"])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
def test_model_matches_the_kernels_partition_bf16(network, data_format):
    assert _check_network(network, data_format, dtype="bf16") == []


def test_model_matches_the_kernels_partition_bf16_sample():
    """bf16 (the rules' plans for this CPU, but the AMX path), batch 8: on Zen 4 the
    pairs (vdpbf16ps) of the direct tiles and of the weight gradients, whose pair copies
    go a block of images at a time (res2a_branch2b: one image a block, 1.6 MB of pairs
    each), and conv1's odd channel count (a zero partner); elsewhere the widened f32
    tiles (every layer: the slow test above)."""
    assert _check_network("resnet50", "NXC", (1, 2, 3, 7, 16, 64),
                          ("conv1", "res2a_branch2b", "res4a_branch1"), "bf16", 8) == []
    assert _check_network("resnet50", "NCX", (1, 3, 16),
                          ("res2b_branch2a", "res3a_branch2b"), "bf16", 8) == []


@functools.cache
def _resnet50_batch32_unbalanced(data_format: str = "NXC", dtype: str = "f32"
                                 ) -> tuple[tuple[str, str, int, object], ...]:
    """(layer, op, N, split) of every ResNet-50 layer at batch 32 whose largest share
    is above 1.25x the mean, N = 2..64 (computed: no compile)."""
    found = []
    for layer, problem, config, plan in _layers("resnet50", data_format, 32, dtype):
        for n in range(2, 65):
            result = split(config, Sizes.of(problem), n, plan)
            assert result.total and sum(result.tasks) == result.total
            if result.imbalance > 1.25:
                found.append((layer.name, layer.op, n, result))
    return tuple(found)


def test_resnet50_batch32_within_1_25_of_the_mean_up_to_64_threads():
    """Up to 64 threads every ResNet-50 layer at batch 32 splits within 1.25x the mean,
    res2a_branch2a's weight gradient included: its sums (64 x 64) have 11 tiles on
    avx512 (44 on avx2), and the rules give it 32 pixel slices (352 (slice, tile) items;
    avx2: 8, 352 items) where 8 (88 items) split 1.47x the mean on 43 threads."""
    assert _resnet50_batch32_unbalanced() == ()
    assert _resnet50_batch32_unbalanced("NCX") == ()  # bands and channels-first 1x1 tiles
    for layer, problem, config, plan in _layers("resnet50", batch=32):
        if layer.name.endswith(":res2a_branch2a") and config.family == "bwd_weights":
            detail = split(config, Sizes.of(problem), 43, plan).detail
            tiles = {16: 11, 8: 44}[VECTOR_LANES[config.isa]]
            assert f"{352 // tiles} slices" in detail and f"x {tiles} tiles" in detail, detail


def test_resnet50_bf16_batch32_within_1_25_of_the_mean_up_to_64_threads():
    """bf16 too (the rules' plans for this CPU but the AMX path: on AVX512-BF16 the pair
    kernels). The pair copies of a weight gradient go a block of images at a time, each
    block in the batch's slices of near-equal rows (res3a_branch2a: blocks of 2 images,
    in 8 slices, not the 1 of a block's own 1,568 pixels: 1.49x the mean on 64 threads).
    But where a block's rows are too few for its slices: NCX res2a_branch2a, 32 slices
    (11 tiles) of blocks of 112 rows, 3 or 4 rows each, up to 1.32x on 49-58 threads."""
    assert _resnet50_batch32_unbalanced("NXC", "bf16") == ()
    found = _resnet50_batch32_unbalanced("NCX", "bf16")
    assert {(layer, op) for layer, op, _, _ in found} <= {
        ("resnet_50:res2a_branch2a", "ConvolutionBackwardWeights")}, found
    assert all(result.imbalance <= 1.32 for *_, result in found), found


@pytest.mark.parametrize("op,geometry", [
    # 1x1 data and forward kernels of few pixels: blocks of fewer tiles on many threads
    ("ConvolutionBackwardData", dict(spatial=(7, 7), kernel=(1, 1), in_channels=96,
                                     out_channels=512, batch=4)),
    ("ConvTransposeBackwardData", dict(spatial=(7, 7), kernel=(1, 1), in_channels=512,
                                       out_channels=96, batch=4)),
])
def test_small_pixel_blocks_on_many_threads_keep_the_bits(op, geometry):
    """A 1x1 kernel whose POINT_BLOCK blocks would give each of many threads fewer
    than 4 items runs blocks of fewer tiles (the model says so for these threads, and
    that one thread keeps whole blocks): exact against the reference, and the same bits
    as on 1 thread."""
    from cases import make_case
    from checks import problem_of, run_case

    case = make_case(op, **geometry, seed=7)
    problem = problem_of(case)
    config = problem.config.with_isa(selected_isa())
    plan = vendor_plan(config, cpu_vendor(), cpu_features())
    one = run_case(case, num_threads=1)
    whole = f"blocks of {16 * resolve_plan(config, plan).choices.tile_rows} pixels"  # 16 tiles
    assert whole in split(config, Sizes.of(problem), 1, plan).detail
    result = split(config, Sizes.of(problem), 24, plan)
    # fewer than 4 items a share in whole blocks (on avx512 both layers; avx2's forward
    # op has 16 vector blocks, 80 items for its 9 shares): blocks of fewer tiles
    assert result.kind == "part_ranges" and result.imbalance <= 1.25
    assert whole not in result.detail or result.total >= 4 * result.shares, result
    if VECTOR_LANES[config.isa] == 16:
        assert whole not in result.detail
    for threads in (5, 12, 24):
        np.testing.assert_array_equal(run_case(case, num_threads=threads), one)


@pytest.mark.parametrize("geometry,slices", [
    (dict(spatial=(64, 66), kernel=(1, 1), in_channels=64, out_channels=64, batch=4), 8),
    (dict(spatial=(66, 64), kernel=(3, 3), in_channels=32, out_channels=48, batch=4,
          attrs=dict(pads_begin=1, pads_end=1)), 8),
    # few tiles, many pixels: 32 slices (MANY_SLICE_PIXELS each)
    (dict(spatial=(112, 112), kernel=(1, 1), in_channels=16, out_channels=32, batch=8), 32),
])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
def test_weight_slices_split_over_any_thread_count_keep_the_bits(geometry, slices,
                                                                 data_format):
    """A weight gradient in pixel slices (8; 32 for few tiles over many pixels) deals
    (slice, tile) items out evenly: on 3, 7 and 12 threads shares start and end inside
    slices, and the result is exact and the same bits as on 1 thread."""
    from cases import make_case
    from checks import problem_of, run_case

    case = make_case("ConvolutionBackwardWeights", **geometry, data_format=data_format,
                     seed=3)
    problem = problem_of(case)
    config = problem.config.with_isa(selected_isa())
    one = run_case(case, num_threads=1)
    for threads in (3, 7, 12):
        try:
            result = split(config, Sizes.of(problem), threads)
        except NotModelled:
            result = None
        if result is not None and result.kind == "slice_shares":
            assert f"{slices} slices" in result.detail and result.imbalance <= 1.25, \
                str(result)
        np.testing.assert_array_equal(run_case(case, num_threads=threads), one)


def test_explain_prints_the_split(capsys):
    from convgrad.cli import main

    assert main(["explain", "--layer", "res2a_branch2b", "--ops", "data,weights",
                 "--batch", "32", "--threads", "2,7"]) == 0
    out = capsys.readouterr().out
    assert out.count("largest/mean") == 4 and "7: 7 shares, largest/mean 1.000" in out
