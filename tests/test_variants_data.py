"""Data-gradient kernels (direct.c.j2, col2im.c.j2) forced onto a plan on each ISA path
this CPU runs, exact against the reference: rows with and without padded columns,
overlapping tap runs, long tiles, channels-first 1x1 layers read in place, results
streamed past the caches, blocks of images and bands of rows, bf16 channel pairs, few
result channels by col2im. A forced plan names the variant its kernel must be of
(forcing.run_with_plan); the rules that pick these plans: test_rules.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from cases import make_case, rotating
from checks import assert_exact, run_case
from forcing import AMX_OFF, ISAS, forced_kernel, placed, run_streamed, run_with_plan, taken
from geometries import BF16_CHANNEL_PAIR_GEOMETRY, COL2IM_GEOMETRY, IMAGE_BLOCK_GEOMETRY

from convgrad.codegen import KernelConfig
from convgrad.codegen.plan import Variant


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("width", [7, 14, 15, 40])
@pytest.mark.parametrize("data_format,dtype", [("NXC", "f32"), ("NCX", "f16")])
def test_data_gradient_rows_with_and_without_padded_columns(isa, op, width, data_format,
                                                             dtype, monkeypatch):
    """Narrow outputs copy the input with zero columns so a row is one run (7 pixels: one
    long tile where 28 accumulators fit, 14: two); wide ones keep runs cut at the edges. Kernel
    3 wide, dilation 2 in w, stride 2 in h, asymmetric pads, 70 channels (a vector tail)."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    attrs = dict(strides=[2, 1], dilations=[1, 2], pads_begin=[1, 3], pads_end=[0, 1])
    if op == "ConvolutionBackwardData":
        attrs["output_padding"] = [1, 0]
    case = make_case(op, spatial=(5, width), kernel=(2, 3), in_channels=70, out_channels=70,
                     batch=2, data_format=data_format, dtype=dtype, attrs=attrs, seed=6)
    run_case(case)
    np.testing.assert_array_equal(run_case(case, num_threads=2), run_case(case, num_threads=1))


# Data-gradient rows whose phases each have a w tap that reaches every column (then runs
# of each tap overlap) and some that do not (disjoint runs, maybe padded): rows wider and
# narrower than the padding threshold, strides along w (phases) and h, dilation, 1-D/3-D.
OVERLAP_GEOMETRY = {
    "3x3 on 28": dict(spatial=(4, 28), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1)),
    "3x3 on 7": dict(spatial=(5, 7), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1)),
    "3x5 strided": dict(spatial=(7, 19), kernel=(3, 5),
                        attrs=dict(strides=[2, 2], pads_begin=[1, 2], pads_end=[1, 2])),
    "1x7 stride 3": dict(spatial=(3, 19), kernel=(1, 7),
                         attrs=dict(strides=[1, 3], pads_begin=[0, 3], pads_end=[0, 1])),
    "1-D dilated": dict(spatial=(30,), kernel=(5,),
                        attrs=dict(dilations=[3], pads_begin=[4], pads_end=[2])),
    "3-D": dict(spatial=(3, 4, 11), kernel=(3, 3, 3), attrs=dict(pads_begin=1, pads_end=1)),
}


OVERLAP_VARIANTS = {"NXC-f32": ("NXC", "f32", {}), "NCX-f16": ("NCX", "f16", {}),
                    "NXC-bf16": ("NXC", "bf16", {}),
                    "NXC-f32-disjoint": ("NXC", "f32", {"overlap_runs": 0})}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geometry,variant,op", [  # three variants each, both ops in turn
    (geometry, variant, ("ConvolutionBackwardData", "ConvTransposeBackwardData")[(g + v) % 2])
    for g, geometry in enumerate(OVERLAP_GEOMETRY)
    for v, variant in enumerate(rotating(list(OVERLAP_VARIANTS), g, 3))])
def test_data_gradient_rows_as_overlapping_tap_runs(isa, geometry, variant, op):
    """Each w tap runs over all the columns it reaches, later taps adding to the sums of
    a tap that reaches them all (the rule; bf16 channels-last results then round whole
    rows, not in the tiles), or rows are cut into disjoint runs: exact, on 1 and 2
    threads, 37 <- 70 channels (vector tails on both sides)."""
    data_format, dtype, plan = OVERLAP_VARIANTS[variant]
    case = make_case(op, **OVERLAP_GEOMETRY[geometry], in_channels=37, out_channels=70,
                     batch=2, data_format=data_format, dtype=dtype, seed=3)
    for threads in (1, 2):
        run_with_plan(case, plan, isa, threads, variant=Variant.DIRECT)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", [7, 14, 21])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_long_tile_only_for_runs_of_its_height(isa, width, dtype, monkeypatch):
    """A run one pixel longer than a tile is one long tile (avx512: 7 columns x 4
    vectors); longer runs, its multiples too, go in near-equal tiles no taller than a
    tile. Bit for bit with the reference, and on 1 and 2 threads alike."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_data import direct_tiles

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case("ConvolutionBackwardData", spatial=(3, width), kernel=(3, 3),
                     in_channels=70, out_channels=24, batch=2, dtype=dtype, seed=11,
                     attrs=dict(pads_begin=1, pads_end=1))
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     dtype).config.with_isa(isa)
    if isa.startswith("avx512"):
        assert direct_tiles(config)["long_tile"] == 7
    np.testing.assert_array_equal(run_case(case, num_threads=2), run_case(case, num_threads=1))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_taller_tiles_for_a_narrower_last_vector_block(isa, dtype):
    """136 input channels are 5 x 3 + 2 vectors of 8 (avx2) or 4 + 4 + 1 of 16 (avx512):
    the last block's tiles are taller (rule checked on the plan). Rows of 20 pixels fill
    them; 9 taps x 40 channels flush partial sums, and a small weight chunk makes later
    chunks add to earlier ones; bit for bit on 1 and 2 threads."""
    from convgrad.codegen.rules_data import direct_tiles

    config = KernelConfig("bwd_data", (3, 3), (1, 1), (1, 1), 1, 136, 40, "NXC", "XIO",
                          "f32", "avx2")
    tiles = direct_tiles(config)
    assert (tiles["vec_block"], tiles["vec_last"], tiles["tile_rows"],
            tiles["tile_rows_last"]) == (3, 2, 4, 6)
    assert (6, 2) in tiles["tiles"] and (5, 3) not in tiles["tiles"]
    case = make_case("ConvolutionBackpropData", spatial=(3, 20), kernel=(3, 3), in_channels=136,
                     out_channels=40, batch=2, dtype=dtype, attrs=dict(pads_begin=1, pads_end=1))
    for plan in ({}, {"weight_chunk_kb": 4}):
        for threads in (1, 2):
            run_with_plan(case, plan, isa, threads, variant=Variant.DIRECT)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvolutionBackpropData",
                                "ConvTransposeBackwardData"])
@pytest.mark.parametrize("spatial,groups,channels", [((12, 13), 1, (70, 37)),
                                                     ((16, 16), 2, (26, 40)),
                                                     ((300,), 1, (9, 130)),
                                                     ((4, 5, 9), 3, (12, 21)),
                                                     ((11, 14), 1, (20, 300))])
def test_channels_first_pointwise_in_place(isa, op, spatial, groups, channels, monkeypatch):
    """1x1 stride-1 NCX f32 data gradients of images with >= 128 pixels read and write
    the user's buffers in place (pixel tails, channel-block tails, groups, 1-D and 3-D,
    long reductions in passes over a pixel block); smaller images and pads take the
    transposing path."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_ncx import pointwise_ncx_tiles

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, spatial=spatial, kernel=(1,) * len(spatial), in_channels=channels[0],
                     out_channels=channels[1], groups=groups, batch=2, data_format="NCX",
                     seed=7)
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     "f32").config.with_isa(isa)
    assert pointwise_ncx_tiles(config)["pointwise_ncx"]
    np.testing.assert_array_equal(run_case(case, num_threads=2), run_case(case, num_threads=1))
    padded = make_case(op, spatial=spatial, kernel=(1,) * len(spatial),
                       in_channels=channels[0], out_channels=channels[1], groups=groups,
                       batch=1, data_format="NCX", seed=8, attrs=dict(pads_begin=1, pads_end=0))
    run_case(padded)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("spatial,channels", [((12, 16), (20, 130)), ((320,), (9, 40)),
                                              ((12, 13), (20, 130))])  # 156: no head on x86
def test_channels_first_pointwise_head_block(isa, op, spatial, channels):
    """Channels-first 1x1 data gradients read in place put a head block of one partial
    vector first where every input row starts the same floats past a cache line (by rule
    from 128 reduced channels, forced here both ways; rows of a whole number of vectors
    only): exact with the inputs and the result at any float offset, on 1 and 2 threads."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_ncx import NCX_HEAD_MIN_REDUCED, pointwise_ncx_tiles

    case = make_case(op, spatial=spatial, kernel=(1,) * len(spatial), in_channels=channels[0],
                     out_channels=channels[1], batch=2, data_format="NCX", seed=15)
    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "f32")
    config = problem.config.with_isa(isa)
    assert pointwise_ncx_tiles(config)["ncx_head"] == (channels[1] >= NCX_HEAD_MIN_REDUCED)
    for plan in ({"ncx_head": 1}, {"ncx_head": 0}):
        kernel = kernels.get_kernel(config, plan)
        for threads in (1, 2):
            dims = kernels.dims_of(problem, threads)
            workspace = np.empty(kernel.workspace_size(dims), dtype=np.uint8)
            for in_at, out_at in ((0, 0), (16, 0), (4, 0), (60, 0), (36, 36), (8, 24)):
                x, y = placed(a, in_at), placed(b, in_at)
                first, second = (y, x) if problem.swap_inputs else (x, y)
                out = placed(np.zeros(problem.output_shape, np.float32), out_at)
                kernels.call(kernel, problem, dims, first, second, out, workspace)
                assert_exact(case, out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("prefetch", [1, 0])
def test_channels_first_pointwise_prefetch(isa, op, prefetch):
    """Channels-first 1x1 tiles read in place fetch the next block of pixels by rule
    (ncx_prefetch), forced both ways: exact on 1, 2 and 3 threads (a thread's last item
    fetches nothing), with 300 reduced channels in passes of 8 KB (the output rows only
    in the last), a partial last block of each image and the next image's first block."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_ncx import pointwise_ncx_tiles
    from convgrad.codegen.variants import render_context

    case = make_case(op, spatial=(9, 15), kernel=(1, 1), in_channels=300, out_channels=300,
                     batch=3, data_format="NCX", seed=21)
    a, b = case.inputs[:2]
    config = resolve(case.op, [a.shape, b.shape], case.attrs, None, "f32").config.with_isa(isa)
    assert pointwise_ncx_tiles(config)["ncx_prefetch"]  # the rule's
    plan = {"ncx_prefetch": prefetch, "ncx_pass_kb": 8}
    tiles = pointwise_ncx_tiles(config, plan)
    assert tiles["pointwise_ncx"] and tiles["ncx_reduce_chunk"] < 300  # passes
    assert render_context(config, "", plan)["ncx_prefetch"] is bool(prefetch)
    for threads in (1, 2, 3):
        run_with_plan(case, plan, isa, threads, variant=Variant.DIRECT)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("prefetch", [1, 0])
def test_pointwise_tiles_fetch_the_next_tiles_input(isa, op, prefetch):
    """1x1 stride-1 channels-last tiles fetch the next tile's input as they run by rule
    on the x86 paths where a group has few vector blocks (point_prefetch), forced both
    ways: exact on 1, 2 and 3 threads, in one pass over 300 reduced channels and in
    passes of 8 KB of weights (fetches that reach past a pass's channels, and past the
    last pixel: a fetch never faults)."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_data import direct_tiles
    from convgrad.codegen.variants import render_context

    # both ops reduce the (forward or transposed) convolution's out channels
    case = make_case(op, spatial=(9, 15), kernel=(1, 1), in_channels=40, out_channels=300,
                     batch=3, seed=23)
    a, b = case.inputs[:2]
    config = resolve(case.op, [a.shape, b.shape], case.attrs, None, "f32").config.with_isa(isa)
    assert direct_tiles(config)["point_prefetch"] is (isa != "portable")  # the rule's
    for plan in ({"point_prefetch": prefetch}, {"point_prefetch": prefetch, "weight_chunk_kb": 8}):
        assert render_context(config, "", plan)["point_prefetch"] is bool(prefetch)
        assert (direct_tiles(config, plan)["reduce_chunk"] < 300) is ("weight_chunk_kb" in plan)
        for threads in (1, 2, 3):
            run_with_plan(case, plan, isa, threads, variant=Variant.DIRECT)


STRIDED_NCX_GEOMETRY = {
    # op's input spatial, strides, channels in / out, groups: enough multiply-adds for 3
    # threads (MIN_THREAD_FLOPS), >= 128 kept pixels per image
    "2-D": ((24, 34), [2, 2], (80, 70), 1),
    "1-D": ((400,), [3], (64, 130), 1),  # the input's last column unused
    "3-D": ((9, 12, 13), [2, 1, 3], (50, 70), 1),
    "groups": ((25, 35), [2, 3], (104, 128), 2),  # a last row and two columns unused
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("geometry", sorted(STRIDED_NCX_GEOMETRY))
def test_channels_first_pointwise_with_strides(isa, op, geometry):
    """Channels-first 1x1 data gradients with strides run the 1x1 tiles on a compact copy
    of the pixels the strides keep (the forward convolution gathers its input into it,
    the data gradient spreads its result out of it, zeros between; ncx_strided.h.j2), by
    rule (and in 2-D with one image per thread, ncx_compact_kb 0, and forced off,
    ncx_in_place 0: the transposes), and the data gradient's result streamed past the
    caches (stream_kb 1: spread in a staging plane per thread, stored in whole lines):
    exact on 1, 2 and 3 threads. The workspace the kernel asks for is the path's own: its
    packed weights, one block's compact copy and the staging planes (its size is how the
    test knows which path ran)."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_data import IMAGE_BLOCK_BYTES
    from convgrad.codegen.rules_ncx import pointwise_ncx_tiles

    spatial, strides, channels, groups = STRIDED_NCX_GEOMETRY[geometry]
    attrs = dict(strides=strides)
    if op == "ConvolutionBackwardData":  # spatial is diff_dst's: rows and columns of
        attrs["output_padding"] = [int(s > 1) for s in strides]  # the result no pixel reaches
    case = make_case(op, spatial=spatial, kernel=(1,) * len(spatial), in_channels=channels[0],
                     out_channels=channels[1], groups=groups, batch=3, data_format="NCX",
                     seed=23, attrs=attrs)
    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "f32")
    config = problem.config.with_isa(isa)
    tiles = pointwise_ncx_tiles(config)
    assert tiles["pointwise_ncx"] and tiles["ncx_strided"]
    bwd = config.family == "bwd_data"
    reduced = config.cout_per_group if bwd else config.cin_per_group
    vectors = config.cin_per_group if bwd else config.cout_per_group
    # the compact copy: the strided tensor's channels on diff_dst's / dst's pixels
    per_image = (groups * (vectors if bwd else reduced) * int(np.prod(problem.dst_spatial))
                 * 4)
    weights = groups * -(-vectors // tiles["ncx_rows"]) * tiles["ncx_rows"] * reduced * 4

    def up(n):
        return -(-n // 64) * 64

    # images per thread in a block: by rule, at least one; one; the transposes instead;
    # the data gradient's result streamed from 1 KB (each thread's staging plane after
    # the compact copy)
    plans = [({}, IMAGE_BLOCK_BYTES // per_image)]
    if geometry == "2-D":
        plans += [({"ncx_compact_kb": 0}, 1), ({"ncx_in_place": 0}, None)]
    streams = bwd and isa != "portable"
    if streams:
        plans.append(({"stream_kb": 1}, IMAGE_BLOCK_BYTES // per_image))
    for plan, images in plans:
        assert images is None or images >= 1
        for threads in (1, 2, 3):
            size, run = forced_kernel(case, plan, isa, threads, variant=Variant.DIRECT)
            if images is not None:
                block = min(3, threads * images)
                staging = threads * up(int(np.prod(problem.src_spatial)) * 4) if plan.get(
                    "stream_kb") else 0
                assert size == up(weights) + up(block * per_image) + staging + 64, (
                    plan, threads)
            run(np.empty(size, dtype=np.uint8))
    if streams:  # into results on a cache line and a float past one
        run_streamed(case, {"stream_kb": 1}, isa, variant=Variant.DIRECT)


POINTWISE_STREAM_GEOMETRY = {
    # stride (2, 3) with trailing rows and columns no output reads: tiles of zeros, which
    # stream too; 48 channels: vector blocks 4 + 2 on avx2, 3 vectors on avx512
    "strided": dict(spatial=(9, 14), in_channels=48, out_channels=20, groups=1,
                    attrs=dict(strides=[2, 3])),
    # stride 1 without pads (every pixel one run); 40 reduced channels in passes of 16
    # (weight_chunk_kb 1): only the last pass streams, the others' sums are read back
    "pointwise": dict(spatial=(6, 7), in_channels=32, out_channels=40, groups=1),
    # two groups of 16 channels, pads: runs cut at the edges
    "groups": dict(spatial=(5, 9), in_channels=32, out_channels=24, groups=2,
                   attrs=dict(strides=[1, 2], pads_begin=[1, 0], pads_end=[0, 1])),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geometry,op", [
    *((geometry, "ConvolutionBackwardData") for geometry in sorted(POINTWISE_STREAM_GEOMETRY)),
    ("groups", "ConvTransposeBackwardData")])
def test_pointwise_results_stream_past_the_caches(isa, geometry, op):
    """1x1 backward-data kernels (direct.c.j2) store results of at least stream_kb with
    non-temporal stores, in whole cache lines, on 1 and 2 threads, after several passes
    over the reduced channels too; a result off a cache line takes ordinary stores, and
    so does the forward convolution (ConvTransposeBackwardData). Exact."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_data import stream_min_bytes

    case = make_case(op, **POINTWISE_STREAM_GEOMETRY[geometry], kernel=(1, 1), batch=2,
                     seed=6)
    plan = {"stream_kb": 1, "weight_chunk_kb": 1}
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     "f32").config.with_isa(isa)
    zeros = op == "ConvolutionBackwardData" and geometry != "pointwise"  # strided
    assert (stream_min_bytes(config, plan) == 1024) == (op == "ConvolutionBackwardData" and (
        isa.startswith("avx512") or (isa == "avx2" and zeros)))
    run_streamed(case, plan, isa, variant=Variant.DIRECT)


def _ncx_data_case(op, geometry, dtype, isa, *, seed):
    """An NCX case of IMAGE_BLOCK_GEOMETRY at batch 5: the case, its problem, its
    configuration on `isa` and the plan that keeps it off col2im where these few result
    channels would take it, and off the channels-first 1x1 tiles (f32 1x1 layers)."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_data import col2im_eligible
    from convgrad.codegen.rules_ncx import pointwise_ncx_tiles

    case = make_case(op, **IMAGE_BLOCK_GEOMETRY[geometry], batch=5, data_format="NCX",
                     dtype=dtype, seed=seed)
    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, dtype)
    config = problem.config.with_isa(isa)
    plan = {"col2im": 0} if col2im_eligible(config) else {}
    if pointwise_ncx_tiles(config)["pointwise_ncx"]:
        plan["ncx_in_place"] = 0
    return case, problem, config, plan


@pytest.mark.parametrize("isa,op,dtype,geometry", [  # three geometries each, rotating
    (isa, op, dtype, geometry) for i, (isa, (op, dtype)) in enumerate(
        (isa, pair) for isa in ISAS
        for pair in [("ConvolutionBackwardData", "f32"), ("ConvolutionBackwardData", "f16"),
                     ("ConvolutionBackwardData", "bf16"), ("ConvTransposeBackwardData", "f32")]
        if pair[1] != "bf16" or isa == "avx512bf16")  # elsewhere bf16 widens as f16 does
    for geometry in rotating(sorted(IMAGE_BLOCK_GEOMETRY), i, 3)])
def test_ncx_data_gradients_in_blocks_of_images(isa, geometry, op, dtype):
    """NCX data gradients copy in, compute and copy out a block of images at a time
    (forced here to one image per thread: blocks of 1-3 images, the last one short):
    exact on 1, 2 and 3 threads, and with a smaller workspace than the whole batch's.
    bf16 on the avx512bf16 path: its input copied as pairs (elsewhere widened as f16).
    (direct.c.j2's: where these few result channels would take col2im, forced off.)"""
    from convgrad import kernels

    case, problem, config, direct = _ncx_data_case(op, geometry, dtype, isa, seed=17)
    # (bands of rows: 1-D and 2-D layers only)
    blocks = taken(config, {"band_kb": 0, "image_block_kb": 1, **direct}, ("band_kb",))
    whole = taken(config, {"band_kb": 0, "image_block_kb": 0, **direct}, ("band_kb",))
    for threads in (1, 2, 3):
        run_with_plan(case, blocks, isa, threads, variant=Variant.DIRECT)
        dims = kernels.dims_of(problem, threads)
        assert (kernels.get_kernel(config, blocks).workspace_size(dims)
                < kernels.get_kernel(config, whole).workspace_size(dims))
    run_with_plan(case, whole, isa, 2, variant=Variant.DIRECT)


BAND_GEOMETRY = [name for name in IMAGE_BLOCK_GEOMETRY if name != "3d"]


@pytest.mark.parametrize("isa,op,dtype,geometry", [  # one geometry each, rotating: each
    (isa, op, dtype, geometry) for i, (isa, (op, dtype)) in enumerate(  # runs 3 times
        (isa, pair) for isa in ISAS
        for pair in [("ConvolutionBackwardData", "f32"), ("ConvolutionBackwardData", "f16"),
                     ("ConvTransposeBackwardData", "f32")])
    for geometry in rotating(BAND_GEOMETRY, i, 1)])
def test_ncx_data_gradients_in_bands_of_rows(isa, geometry, op, dtype):
    """1-D and 2-D NCX data gradients copy in, compute and copy out a band of rows per
    thread at a time (forced here to bands of one row, of a few rows that image ends and
    thread shares cut short, and of one row read from zero-padded columns): exact on 1,
    2 and 3 threads with a workspace smaller than whole images' copies, and on
    real-valued data the same bits as the same plan on the whole batch's copies whatever
    the bands and the threads (each result row is summed in the same order).
    (direct.c.j2's: col2im off.)"""
    from convgrad import kernels
    from convgrad.codegen.rules_data import band_bytes

    case, problem, config, direct = _ncx_data_case(op, geometry, dtype, isa, seed=19)
    a, b = case.inputs[:2]
    plans = [{"band_kb": 1, **direct}, {"band_kb": 3, **direct},
             {"band_kb": 1, "pad_columns": 1, "overlap_runs": 0, **direct}]
    whole = {"band_kb": 0, "image_block_kb": 0, **direct}
    assert all(band_bytes(config, plan) for plan in plans) and not band_bytes(config, whole)
    for plan in plans:
        for threads in (1, 2, 3):
            run_with_plan(case, plan, isa, threads, variant=Variant.DIRECT)
    dims = kernels.dims_of(problem, 2)
    assert (kernels.get_kernel(config, plans[0]).workspace_size(dims)
            < kernels.get_kernel(config, whole).workspace_size(dims))
    rng = np.random.default_rng(3)
    a, b = ((x + rng.standard_normal(x.shape)).astype(x.dtype) for x in (a, b))
    first, second = (b, a) if problem.swap_inputs else (a, b)

    def result(plan, threads):
        kernel, dims = kernels.get_kernel(config, plan), kernels.dims_of(problem, threads)
        out = np.empty(problem.output_shape, dtype=a.dtype)
        kernels.call(kernel, problem, dims, first, second, out,
                     np.empty(kernel.workspace_size(dims), dtype=np.uint8))
        return out

    for plan in plans:
        blocks = result({**plan, "band_kb": 0, "image_block_kb": 0}, 1)
        for threads in (1, 3):
            np.testing.assert_array_equal(result(plan, threads), blocks)


@pytest.mark.skipif("avx512bf16" not in ISAS, reason="this CPU has no vdpbf16ps")
@pytest.mark.parametrize("geometry", sorted(BF16_CHANNEL_PAIR_GEOMETRY))
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
def test_ncx_bf16_channel_pairs_transposed(geometry, op):
    """NCX bf16 data gradients with vdpbf16ps copy their input as channel pairs: an even
    count per group is the input channels-last, 2 x VL pixels x VL channels at a time
    through register transposes, the last pixels and channels value by value; an odd
    count pads each group with a zero. Exact with tails, groups and pads, on 1 to 3
    threads, with the whole batch or one image at a time copied (AMX off: the pairs are
    its own copy)."""
    case = make_case(op, **BF16_CHANNEL_PAIR_GEOMETRY[geometry], batch=3, data_format="NCX",
                     dtype="bf16", seed=29)
    for threads in (1, 2, 3):
        for image_block_kb in (0, 1):
            run_with_plan(case, {"amx": 0, "image_block_kb": image_block_kb}, "avx512bf16",
                          threads, optional=AMX_OFF, variant=Variant.DIRECT)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geometry,data_format,dtype,op", [
    (geometry, data_format, dtype, ("ConvolutionBackwardData", "ConvolutionBackpropData")[i % 2])
    for i, (geometry, data_format, dtype) in enumerate(
        itertools.product(sorted(COL2IM_GEOMETRY), ["NXC", "NCX"], ["f32"]))] + [
    ("conv1", "NXC", "bf16", "ConvolutionBackwardData"),
    ("3d", "NCX", "f16", "ConvolutionBackwardData")])
def test_few_result_channels_run_by_col2im(isa, geometry, data_format, dtype, op):
    """Backward data with few result channels multiplies diff_dst by every tap's weights
    (columns) and adds them into the result (col2im.c.j2): by rule where the result
    channels are fewer than a vector or fill at most 3/4 of their vectors (bf16 on
    avx512bf16: a quarter, else bf16 pairs in the direct tiles), and the columns fill
    more; NCX f32 diff_dst read in place (or transposed, a candidate); exact on 1, 2 and
    3 threads, every path."""
    from convgrad.codegen.isa import VECTOR_LANES
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_data import col2im

    case = make_case(op, **COL2IM_GEOMETRY[geometry], data_format=data_format, dtype=dtype,
                     seed=14)
    a, b = case.inputs[:2]
    config = resolve(case.op, [a.shape, b.shape], case.attrs, None,
                     dtype).config.with_isa(isa)
    channels, lanes = COL2IM_GEOMETRY[geometry]["in_channels"], VECTOR_LANES[config.isa]
    padded = -(-channels // lanes) * lanes
    kernel = COL2IM_GEOMETRY[geometry]["kernel"]
    columns = channels * int(np.prod(kernel))
    if isa == "avx512bf16" and dtype == "bf16":  # else bf16 pairs in the direct tiles
        few = 4 * channels <= padded
        assert candidates(config)[1:3] == ([{"col2im": 0}, {"bf16_dot": 1}] if few else
                                           [{"bf16_dot": 0}])
    else:
        few = channels < lanes or 4 * channels <= 3 * padded
    assert col2im(config) == (few and channels / padded < columns / (-(-columns // lanes)
                                                                     * lanes))
    plans = [{"col2im": 1} if col2im(config, {"col2im": 1}) else {}]
    if (data_format, dtype) == ("NCX", "f32"):  # diff_dst read in place, or transposed
        plans.append({"col2im": 1, "ncx_in_place": 0})
    for plan, threads in itertools.product(plans, (1, 2, 3)):
        run_with_plan(case, plan, isa, threads,
                      variant=Variant.COL2IM if plan.get("col2im") else Variant.DIRECT)
