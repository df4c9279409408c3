"""Weight-gradient kernels (bwd_weights*.c.j2) forced onto a plan on each ISA path
this CPU runs, exact against the reference: channels-first src read in order, dot
products along pixels, packed panels, src read in place, pixel slices, sums in the
user's weights, chunks by pixels or bytes, bf16 pixel pairs and blocks of images,
inputs swapped. The rules that pick these plans: test_rules.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import TRANSPOSE, make_case, rotating
from checks import assert_exact, problem_of, run_case
from forcing import AMX_OFF, ISAS, forced_kernel, placed, run_with_plan, taken
from geometries import (
    BF16_PAIR_GEOMETRY,
    DOT_WEIGHT_GEOMETRY,
    NCX_WEIGHT_GEOMETRY,
    PACKED_WEIGHT_GEOMETRY,
    SLICED_WEIGHT_GEOMETRY,
    SWAPPED,
)

from convgrad.codegen import KernelConfig
from convgrad.codegen.plan import Variant


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,geometry,op", [  # each runs both ops, in turn
    (dtype, geometry, ("ConvolutionBackwardWeights", "ConvTransposeBackwardWeights")[(d + g) % 2])
    for d, dtype in enumerate(["f32", "bf16", "f16"])
    for g, geometry in enumerate(sorted(NCX_WEIGHT_GEOMETRY))])
def test_weight_gradient_reads_ncx_src_in_order(isa, op, dtype, geometry, monkeypatch):
    """NCX weight gradients broadcast src along its pixels (f32 in place, f16/bf16
    widened in their order) and merge a row's run into the last one where both inputs
    continue it: channel tails, groups and every ISA path."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, **NCX_WEIGHT_GEOMETRY[geometry], in_channels=38, out_channels=22,
                     data_format="NCX", dtype=dtype, seed=5)
    run_case(case)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op,weights_format", [("ConvolutionBackwardWeights", "OIX"),
                                               ("ConvolutionBackwardWeights", "XIO"),
                                               ("ConvTransposeBackwardWeights", "XOI")])
@pytest.mark.parametrize("geometry", sorted(DOT_WEIGHT_GEOMETRY))
def test_weight_gradient_as_dot_products_along_pixels(isa, op, weights_format, geometry,
                                                      monkeypatch):
    """The pixel-dot plan of NCX f32 weight gradients (runs of both inputs packed into
    panels, per-lane sums added in a tree), forced on every ISA path: exact, and the same
    bits on 1, 2 and 3 threads."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, **DOT_WEIGHT_GEOMETRY[geometry], data_format="NCX",
                     weights_format=weights_format, seed=12)
    for threads in (1, 2, 3):  # (not across groups, where the rules would take that)
        run_with_plan(case, {"ncx_dot": 1, "group_lanes": 0}, isa, threads,
                      optional=("group_lanes",), variant=Variant.WEIGHTS_DOT)


@pytest.mark.skipif("avx512bf16" not in ISAS, reason="this CPU has no vdpbf16ps")
@pytest.mark.parametrize("geometry", sorted(BF16_PAIR_GEOMETRY))
@pytest.mark.parametrize("op", ["ConvolutionBackwardWeights", "ConvTransposeBackwardWeights"])
def test_ncx_bf16_pixel_pairs_transposed(geometry, op):
    """NCX bf16 weight gradients with vdpbf16ps copy the pixel pairs inside a row VL
    pairs x VL channels at a time (interleave_rows), the rest pair by pair; diff_dst rows
    of an even width up to VL at a time as one row: exact with pads, dilations, odd and
    even widths, channel tails and groups, 1-D to 3-D, on 1 and 2 threads."""
    case = make_case(op, **BF16_PAIR_GEOMETRY[geometry], batch=2, data_format="NCX",
                     dtype="bf16", seed=23)
    for threads in (1, 2):
        run_with_plan(case, {}, "avx512bf16", threads, variant=Variant.WEIGHTS_PAIRS)


@pytest.mark.skipif("avx512bf16" not in ISAS, reason="this CPU has no vdpbf16ps")
@pytest.mark.parametrize("op,data_format,geometry", [
    (op, data_format, geometry)
    for op, data_format in [("ConvolutionBackwardWeights", "NCX"),
                            ("ConvolutionBackwardWeights", "NXC"),
                            ("ConvTransposeBackwardWeights", "NXC")]
    for geometry in ["3x3", "1x1 groups", "1d", "3d even rows"]
    # channels-last 1x1 stride-1 layers run the batch as one image: one block
    if not (data_format == "NXC" and geometry == "1x1 groups")])
def test_bf16_weight_gradients_in_blocks_of_images(op, data_format, geometry):
    """bf16 weight gradients with vdpbf16ps copy and sum a block of images at a time
    (forced here to blocks of one image, and of two with a short last one): exact on 1
    to 3 threads with a smaller workspace than the whole batch's, and on real-valued data
    the same bits whatever the thread count (the blocks depend on the sizes only)."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    case = make_case(op, **BF16_PAIR_GEOMETRY[geometry], batch=5, data_format=data_format,
                     dtype="bf16", seed=31)
    blocks, whole = {"amx": 0, "image_block_kb": 1}, {"amx": 0, "image_block_kb": 0}
    sizes = {}
    for threads in (1, 2, 3):
        sizes[threads], run = forced_kernel(case, blocks, "avx512bf16", threads,
                                            optional=AMX_OFF, variant=Variant.WEIGHTS_PAIRS)
        run(np.empty(sizes[threads], dtype=np.uint8))
    whole_size = forced_kernel(case, whole, "avx512bf16", 2, optional=AMX_OFF,
                               variant=Variant.WEIGHTS_PAIRS)[0]
    assert sizes[2] < whole_size
    # the copies of one image, from the workspaces of 1 and 5 images: blocks of two
    pairs = {"amx": 0, "image_block_kb": (whole_size - sizes[2]) // 4 * 2 // 1024 + 1}
    for threads in (1, 3):
        size, run = forced_kernel(case, pairs, "avx512bf16", threads, optional=AMX_OFF,
                                  variant=Variant.WEIGHTS_PAIRS)
        assert sizes[2] < size < whole_size
        run(np.empty(size, dtype=np.uint8))
    a, b = (x.astype(np.float32) for x in case.inputs[:2])
    rng = np.random.default_rng(5)
    a = (a + rng.standard_normal(a.shape)).astype(case.inputs[0].dtype)
    b = (b + rng.standard_normal(b.shape)).astype(case.inputs[1].dtype)
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
    config = problem.config.with_isa("avx512bf16")
    kernel = kernels.get_kernel(config, taken(config, blocks, AMX_OFF))
    first, second = (b, a) if problem.swap_inputs else (a, b)
    results = []
    for threads in (1, 2, 3):
        out, dims = np.empty(problem.output_shape, dtype=a.dtype), kernels.dims_of(problem, threads)
        workspace = np.empty(kernel.workspace_size(dims), dtype=np.uint8)
        kernels.call(kernel, problem, dims, first, second, out, workspace)
        results.append(out.view(np.uint16))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op,geometry,data_format,dtype", [  # three layout/dtype pairs each
    (op, geometry, *formats) for i, (op, geometry) in enumerate(
        [("ConvolutionBackwardWeights", g) for g in sorted(PACKED_WEIGHT_GEOMETRY)]
        + [("ConvTransposeBackwardWeights", "3x3")])
    for formats in rotating([("NXC", "f32"), ("NCX", "f32"), ("NXC", "bf16"), ("NCX", "f16")],
                            i, 3)])
def test_weight_gradient_from_packed_panels(isa, op, geometry, data_format, dtype,
                                            monkeypatch):
    """Weight gradients that pack each chunk into panels (both layouts, widened f16/bf16;
    NCX diff_dst transposed in registers over runs of rows, a vector block at a time with
    rows fetched ahead where strides skip no src row, and all at once), forced on every
    ISA path, on 1 and 2 threads: channel tails, groups, strides, dilations, pads, several
    chunks; exact on both thread counts."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_common import uses_bf16_dot
    from convgrad.codegen.rules_weights import weight_tiles

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, **PACKED_WEIGHT_GEOMETRY[geometry], data_format=data_format,
                     dtype=dtype, seed=3)
    config = resolve(op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     dtype).config.with_isa(isa)
    packed = {"packed": 1, **({"bf16_dot": 0} if uses_bf16_dot(config) else {})}
    tiles = weight_tiles(config, packed)  # (bf16 pairs have their own copies: widened)
    assert tiles["packed"]
    skips_rows = any(s > (k - 1) * d + 1 for s, k, d in zip(
        config.strides, config.kernel, config.dilations, strict=True))
    prefetch = tiles["packed"] and data_format == "NCX" and not skips_rows
    assert tiles["prefetch_panels"] == prefetch
    plans = [packed] + ([{**packed, "prefetch_panels": 0}] if prefetch else [])
    for plan in plans:
        for threads in (1, 2):
            run_with_plan(case, plan, isa, threads, variant=Variant.WEIGHTS_PACKED)


@pytest.mark.parametrize("isa", ISAS)
def test_strided_pointwise_weight_gradient_read_in_place(isa, monkeypatch):
    """1x1 f32 channels-last weight gradients with strides read both inputs in place by
    the rules (the pixels a stride skips never enter a sum): exact with channel tails and
    pads, the same bits on 1 and 2 threads, on every path."""
    from convgrad.codegen.isa import VECTOR_LANES
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_weights import weight_tiles

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case("ConvolutionBackwardWeights", spatial=(23, 30), kernel=(1, 1),
                     in_channels=70, out_channels=38, batch=3, seed=5,
                     attrs=dict(strides=[2, 3], pads_begin=[1, 0], pads_end=[0, 2]))
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     "f32").config.with_isa(isa)
    packed = VECTOR_LANES[isa] < 8
    assert weight_tiles(config)["packed"] == packed
    for threads in (1, 2):
        run_with_plan(case, {}, isa, threads,
                      variant=Variant.WEIGHTS_PACKED if packed else Variant.WEIGHTS)


@pytest.mark.parametrize("isa", [i for i in ISAS if i.startswith("avx512")])
def test_ncx_weights_read_in_place_with_sums_beyond_l2(isa, monkeypatch):
    """avx512 NCX 3x3 weight gradients with sums past 1 MB read src in place in chunks by
    bytes (several here): exact, the same bits on 1 and 2 threads."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_weights import weight_tiles

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case("ConvolutionBackwardWeights", spatial=(22, 40), kernel=(3, 3),
                     in_channels=180, out_channels=170, batch=2, data_format="NCX", seed=6,
                     attrs=dict(pads_begin=[1, 0], pads_end=[0, 1]))  # 3 chunks of 19 rows
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     "f32").config.with_isa(isa)
    tiles = weight_tiles(config)
    assert not tiles["packed"] and tiles["src_in_place"] and tiles["chunk_pixels"] == 0
    for threads in (1, 2):
        run_with_plan(case, {}, isa, threads, variant=Variant.WEIGHTS)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_flattened_ncx_weights_transpose_diff_dst_by_chunk(isa, dtype, monkeypatch):
    """Few input channels (tile rows over (kw, channel), a padded src copy) in NCX take
    diff_dst a chunk of rows at a time, transposed by the thread that uses it: a
    MobileNet-like stem (3x3 stride 2, 3 -> 20: flattened on avx512; avx2 runs it on one
    tap's rows), one whose last src column no tap reaches (the padded copy drops it) and
    2 -> 13 channels with a tail, rows of 9 pixels in chunks that end inside an image
    (32 pixels: 3 rows, 5 rows an image) and in whole images; exact on 1-3 threads. The
    padded copy reads the user's NCX src itself (no channels-last copy first)."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_weights import uses_bf16_dot, weight_tiles
    from convgrad.codegen.variants import resolve_plan

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    cases = [make_case("ConvolutionBackwardWeights", spatial=(10, 17), kernel=(3, 3),
                       in_channels=3, out_channels=20, batch=3, data_format="NCX",
                       dtype=dtype, seed=7, attrs=dict(strides=2, pads_begin=1, pads_end=1)),
             make_case("ConvolutionBackwardWeights", spatial=(6, 11), kernel=(3, 3),
                       in_channels=3, out_channels=20, batch=2, data_format="NCX",
                       dtype=dtype, seed=9, attrs=dict(strides=2, pads_begin=1, pads_end=0)),
             make_case("ConvolutionBackwardWeights", spatial=(7, 9), kernel=(3, 5),
                       in_channels=2, out_channels=13, batch=2, data_format="NCX",
                       dtype=dtype, seed=8, attrs=dict(pads_begin=[1, 2], pads_end=[1, 2]))]
    flattened, pairs = 0, False
    for case in cases:
        config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                         dtype).config.with_isa(isa)
        tiles = weight_tiles(config)
        pairs = pairs or uses_bf16_dot(config)
        if not tiles["flatten_w"]:
            continue
        assert tiles["dd_by_chunk"], config
        assert not resolve_plan(config).kernel.pack_data  # the padded copy reads NCX src
        flattened += 1
        for plan in ({"chunk_pixels": 32}, {"chunk_pixels": 512}):
            for threads in (1, 2, 3):
                run_with_plan(case, plan, isa, threads, variant=Variant.WEIGHTS_FLAT)
    assert flattened or pairs  # bf16 with vdpbf16ps: the pairs' own kernel


@pytest.mark.parametrize("isa", ISAS)
def test_ncx_weights_with_more_outputs_read_src_in_place(isa, monkeypatch):
    """f32 channels-first weight gradients of several taps and one group read src in
    place with more output than input channels too (conv1-like 3 -> 20 channels, 7x7
    stride 2; 5 -> 37 with dilation and a channel tail), unless their sums pass the
    path's limit; not 1x1, grouped, f16 ones nor Intel's: exact on 1 and 2 threads."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.plan import vendor_plan
    from convgrad.codegen.rules_weights import weight_tiles
    from convgrad.codegen.vendors import PACKED_NCX_VENDORS

    monkeypatch.setenv("CONVGRAD_ISA", isa)

    def tiles_of(case, dtype="f32"):
        config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                         dtype).config.with_isa(isa)
        return config, weight_tiles(config)

    cases = [make_case("ConvolutionBackwardWeights", spatial=(23, 20), kernel=(7, 7),
                       in_channels=3, out_channels=20, batch=2, data_format="NCX", seed=3,
                       attrs=dict(strides=2, pads_begin=3, pads_end=2)),
             make_case("ConvolutionBackwardWeights", spatial=(13, 17), kernel=(3, 3),
                       in_channels=5, out_channels=37, batch=3, data_format="NCX", seed=4,
                       attrs=dict(dilations=[1, 2], pads_begin=1, pads_end=[0, 2]))]
    for case in cases:
        config, tiles = tiles_of(case)
        flattened = tiles["flatten_w"]  # few channels in (kw, channel) rows, not in place
        assert tiles["src_in_place"] is not flattened and not tiles["packed"]
        assert vendor_plan(config, "GenuineIntel").get("packed") == (
            None if flattened or config.isa not in PACKED_NCX_VENDORS else 1)
        for threads in (1, 2):
            run_with_plan(case, {}, isa, threads,
                          variant=Variant.WEIGHTS_FLAT if flattened else Variant.WEIGHTS)
    others = [dict(kernel=(1, 1), in_channels=300, out_channels=1000),  # 1x1, 1.2 MB
              dict(kernel=(3, 3), in_channels=16, out_channels=64, groups=2),
              dict(kernel=(3, 3), in_channels=128, out_channels=256),  # 1.2 MB of sums
              dict(kernel=(3, 3), in_channels=400, out_channels=500)]  # 7.2 MB
    for geometry in others:
        _, tiles = tiles_of(make_case("ConvolutionBackwardWeights", spatial=(6, 6),
                                      data_format="NCX", **geometry))
        assert not tiles["src_in_place"], geometry
    _, tiles = tiles_of(make_case("ConvolutionBackwardWeights", spatial=(6, 6), kernel=(3, 3),
                                  in_channels=16, out_channels=64, data_format="NCX",
                                  dtype="f16"), "f16")
    assert not tiles["src_channels_first"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geometry", sorted(SLICED_WEIGHT_GEOMETRY))
@pytest.mark.parametrize("data_format,dtype", [("NXC", "f32"), ("NCX", "f32"), ("NXC", "bf16"),
                                               ("NCX", "f16")])
def test_weight_gradient_in_pixel_slices(isa, geometry, data_format, dtype, monkeypatch):
    """Small weight sums split the pixels into slices summed apart and added in order:
    exact, and the same bits on 1, 2 and 3 threads (3 threads share 4 slices unevenly,
    more threads than slices share a slice's tiles)."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_weights import SLICE_MIN_PIXELS, weight_tiles

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case("ConvolutionBackwardWeights", **SLICED_WEIGHT_GEOMETRY[geometry],
                     data_format=data_format, dtype=dtype, seed=4)
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     dtype).config.with_isa(isa)
    dd = case.inputs[1]
    pixels = dd.size // dd.shape[-1 if data_format == "NXC" else 1]
    assert weight_tiles(config)["max_slices"] >= 4 and pixels >= 4 * SLICE_MIN_PIXELS
    one = run_case(case, num_threads=1)
    for threads in (2, 3, 5):
        np.testing.assert_array_equal(run_case(case, num_threads=threads), one)


WEIGHTS_AS_SUMS_GEOMETRY = {
    # whole vectors of channels on every path on both sides (NCX and ConvTranspose kernels
    # swap them); 1x1 read in place or packed
    "1x1": dict(spatial=(9, 14), kernel=(1, 1), in_channels=48, out_channels=32, batch=3),
    # 3x3 with stride, dilation and pads
    "3x3": dict(spatial=(13, 11), kernel=(3, 3), in_channels=32, out_channels=48, batch=2,
                attrs=dict(strides=[2, 1], dilations=[1, 2], pads_begin=[1, 2],
                           pads_end=[0, 1])),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geometry", sorted(WEIGHTS_AS_SUMS_GEOMETRY))
@pytest.mark.parametrize("op,data_format,packed", [
    ("ConvolutionBackwardWeights", "NXC", 0), ("ConvolutionBackwardWeights", "NXC", 1),
    ("ConvolutionBackwardWeights", "NCX", 0), ("ConvTransposeBackwardWeights", "NXC", 1)])
def test_weight_sums_in_the_weights(isa, geometry, op, data_format, packed):
    """Weight gradients that add their sums in the user's weights where those start on a
    64-byte boundary, else in workspace: exact both ways on 1 and 2 threads, and the
    workspace's sums untouched exactly when the weights hold them. (The user's weights
    format whose kernel writes XIO: NCX and ConvTranspose kernels may swap the roles.)"""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_weights import weight_tiles

    for weights_format in ("XOI", "IOX") if op in TRANSPOSE else ("XIO", "OIX"):
        case = make_case(op, **WEIGHTS_AS_SUMS_GEOMETRY[geometry], data_format=data_format,
                         weights_format=weights_format, seed=14)
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "f32")
        if problem.config.weights_format == "XIO":
            break
    config = problem.config.with_isa(isa)
    plan = {"max_slices": 1, "packed": packed}
    assert weight_tiles(config, plan)["sums_in_output"]
    kernel = kernels.get_kernel(config, plan)
    first, second = (b, a) if problem.swap_inputs else (a, b)
    for threads in (1, 2):
        dims = kernels.dims_of(problem, threads)
        for offset, in_output in ((0, True), (16, False), (4, False)):
            out = placed(np.zeros(problem.output_shape, np.float32), offset)
            workspace = kernels.empty_output((kernel.workspace_size(dims),), np.uint8)
            workspace[:] = 0xA5
            kernels.call(kernel, problem, dims, first, second, out, workspace)
            assert_exact(case, out)
            assert (workspace[:64] == 0xA5).all() == in_output, (offset, threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
def test_weight_gradient_chunks_by_pixels_or_by_bytes(isa, data_format, monkeypatch):
    """Weight sums that stay in L2 take chunks of about 128 pixels (512 for f32 NCX
    layers with few multiply-adds per pixel or rows that overlap, 64 for f32 NXC ones
    read in place on avx512); larger ones chunks of 1 MB of rows; kernels packed into
    panels whose rows overlap along h chunks of 512 pixels with any sums. Each runs
    several chunks here (rows of 5 pixels: 104 rows are 2-5 small chunks, 3 of 512
    pixels over both images, or 2 large ones for 280 x 300 channels), exact on 1 and 2
    threads, and so does the plan with the other kind of chunks."""
    from convgrad.codegen.isa import VECTOR_LANES
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_weights import (
        CHUNK_PIXELS,
        NCX_LIGHT_CHUNK_PIXELS,
        NCX_LIGHT_MACS,
        NXC_IN_PLACE_CHUNK_PIXELS,
        PACKED_OVERLAP_CHUNK_PIXELS,
        weight_tiles,
    )

    def config(channels, kernel=(3, 3), strides=(1, 1), dtype="f32"):
        return KernelConfig("bwd_weights", kernel, strides, (1, 1), 1, channels, channels,
                            data_format, "XIO", dtype).with_isa(isa)

    def chunk(each):
        return weight_tiles(each)["chunk_pixels"]

    def rule(each, otherwise):  # packed rows that overlap along h: 512 pixels
        return PACKED_OVERLAP_CHUNK_PIXELS if weight_tiles(each)["packed"] else otherwise

    light = (NCX_LIGHT_CHUNK_PIXELS if data_format == "NCX"
             else NXC_IN_PLACE_CHUNK_PIXELS.get(VECTOR_LANES[isa], CHUNK_PIXELS))
    assert chunk(config(20)) == rule(config(20), light)  # 3600 multiply-adds a pixel
    if data_format == "NCX":  # 1x1: 128 x 128 multiply-adds a pixel, then more
        assert weight_tiles(config(128, (1, 1)))["chunk_pixels"] == NCX_LIGHT_CHUNK_PIXELS
        assert NCX_LIGHT_MACS < 129 * 129
        assert weight_tiles(config(129, (1, 1)))["chunk_pixels"] == CHUNK_PIXELS
        # 3x3 read in place, rows that overlap: 512 whatever the work per pixel
        assert weight_tiles(config(128))["src_channels_first"]
        assert chunk(config(128)) == NCX_LIGHT_CHUNK_PIXELS
    assert chunk(config(20, dtype="bf16")) == rule(config(20, dtype="bf16"), CHUNK_PIXELS)
    assert chunk(config(280)) == rule(config(280), 0)
    if isa == "avx2":  # 8 lanes read 3x3 NXC layers and large NCX sums from panels
        assert weight_tiles(config(280))["packed"]
        assert weight_tiles(config(20))["packed"] == (data_format == "NXC")
    assert chunk(config(280, strides=(2, 1))) == chunk(config(280))
    # rows that no two output rows share (1-high kernel, or stride 3 with 3 rows): bytes
    for other in (config(280, (1, 3)), config(280, (3, 3), (3, 1)), config(600, (1, 1))):
        assert weight_tiles(other)["chunk_pixels"] == 0
    # 9 taps x 700 x 700 channels (rounded up to whole vectors): 17.6 MB of sums, chunks
    # of half that where chunks go by bytes
    lanes = VECTOR_LANES[isa]
    assert weight_tiles(config(700))["chunk_bytes"] == 9 * 700 * -(-700 // lanes) * lanes * 2
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    for channels in (20, 280):
        case = make_case("ConvolutionBackwardWeights", spatial=(52, 5), kernel=(3, 3),
                         in_channels=channels, out_channels=channels + 20, batch=2,
                         data_format=data_format, attrs=dict(pads_begin=1, pads_end=1))
        for threads in (1, 2):
            run_case(case, num_threads=threads)
        rules_pixels = weight_tiles(config(channels))["chunk_pixels"]
        other = {"chunk_pixels": 0 if rules_pixels else CHUNK_PIXELS}
        # the same kernel as the rules' but for its chunks: from panels or in place
        actual = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                         "f32").config.with_isa(isa)
        variant = Variant.WEIGHTS_PACKED if weight_tiles(actual)["packed"] else Variant.WEIGHTS
        for threads in (1, 2):
            run_with_plan(case, other, isa, threads, variant=variant)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op,weights_format", [("ConvolutionBackwardWeights", "XIO"),
                                               ("ConvolutionBackwardWeights", "OXI"),
                                               ("ConvTransposeBackwardWeights", "IOX")])
def test_channels_last_weight_gradients_with_inputs_swapped(isa, op, weights_format,
                                                             monkeypatch):
    """Channels-last 1x1 weight gradients with 8 more outputs than a multiple of 16 run
    swapped: the reference's weights in the user's format (torch's channels_last OXI
    too), with channel tails, on every ISA path, 1 and 2 threads."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    channels = (dict(in_channels=24, out_channels=72) if op in TRANSPOSE
                else dict(in_channels=72, out_channels=24))
    for extra in ({}, dict(in_channels=40, out_channels=8) if op not in TRANSPOSE
                  else dict(in_channels=8, out_channels=40)):
        case = make_case(op, **{**SWAPPED, **channels, **extra, "spatial": (5, 7),
                                "batch": 2, "data_format": "NXC"},
                         weights_format=weights_format, seed=9)
        assert problem_of(case).swap_inputs is (op not in TRANSPOSE)
        for threads in (1, 2):
            run_case(case, num_threads=threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op,weights_format", [("ConvolutionBackwardWeights", "OIX"),
                                               ("ConvolutionBackwardWeights", "XIO"),
                                               ("ConvolutionBackpropFilters", "OIX"),
                                               ("ConvTransposeBackwardWeights", "IOX"),
                                               ("ConvTransposeBackwardWeights", "XOI")])
@pytest.mark.parametrize("threads", [1, 2])
def test_weight_gradients_with_inputs_swapped(isa, op, weights_format, threads, monkeypatch):
    """Swapped weight gradients give the reference's weights in the user's format, on
    every ISA path (channel tails on both sides), in pixel slices and in place, and with
    large weights from packed panels."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    channels = (dict(in_channels=37, out_channels=20) if op in TRANSPOSE
                else dict(in_channels=20, out_channels=37))
    large = (dict(in_channels=256, out_channels=1030) if op in TRANSPOSE
             else dict(in_channels=1030, out_channels=256))  # 1 MB of weights, a tail
    case = make_case(op, **{**SWAPPED, **large, "spatial": (3, 4), "batch": 2},
                     weights_format=weights_format, seed=8)
    assert problem_of(case).swap_inputs is (op not in TRANSPOSE)
    run_case(case, num_threads=threads)
    for spatial, batch in (((5, 7), 3), ((40, 33), 2)):
        case = make_case(op, **{**SWAPPED, **channels, "spatial": spatial, "batch": batch},
                         weights_format=weights_format, seed=7)
        assert problem_of(case).swap_inputs is (op not in TRANSPOSE)
        run_case(case, num_threads=threads)
