"""The planner's rules alone (codegen/rules_*.py, plan.candidates and the problem's
resolution): the plan a configuration gets by rule and the other plans that are tuning
candidates. Pure: no kernel is compiled or run, so none needs this CPU's ISA; the
kernels of these plans are checked against the reference in test_variants_*.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from cases import make_case
from checks import problem_of
from geometries import SWAPPED

from convgrad.codegen import KernelConfig


def test_every_tap_in_registers_is_a_tuning_candidate_where_the_taps_fit():
    """The planner (no CPU needed): all_taps is never the rules' plan; it is a candidate
    where the taps of a kd and one diff_dst vector fit the accumulators (3x3: 2 vectors
    on avx512, 1 on avx2; 5x5 avx512 only), and wins over pixel_sweep and slide."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_groups import depthwise_weight_rows

    def config(kernel=(3, 3), isa="avx512"):
        ones = (1,) * len(kernel)
        return KernelConfig("bwd_weights", kernel, ones, ones, 256, 1, 1, "NXC", "XIO", "f32",
                            isa)

    for isa, kernel, vectors in (("avx512", (3, 3), 2), ("avx2", (3, 3), 1),
                                 ("avx512", (5, 5), 1), ("avx512", (3, 3, 3), 2),
                                 ("avx2", (7,), 1)):
        c = config(kernel, isa)
        assert not depthwise_weight_rows(c)["all_taps"] and {"all_taps": 1} in candidates(c)
        forced = depthwise_weight_rows(c, {"all_taps": 1, "pixel_sweep": 1, "slide": 1})
        assert forced["all_taps"] and forced["vec_block"] == vectors
        assert not forced["pixel_sweep"] and not forced["slide_pixels"]
    for too_many in (config((5, 5), "avx2"), config((7, 7), "avx512")):
        assert not depthwise_weight_rows(too_many, {"all_taps": 1})["all_taps"]
        assert {"all_taps": 1} not in candidates(too_many)


def test_overlapping_tap_runs_by_rule():
    """Direct data gradients (and ConvTranspose's, fwd) overlap their runs by rule, in
    every dtype and layout; disjoint runs stay a candidate. Depthwise layers keep their
    own runs."""
    from convgrad.codegen.plan import candidates, render_context
    from convgrad.codegen.rules_data import overlap_runs

    def config(dtype="f32", fmt="NXC", family="bwd_data", groups=1, channels=64):
        return KernelConfig(family, (3, 3), (1, 1), (1, 1), groups, channels, channels, fmt,
                            "XIO", dtype, "avx2")

    for on in (config(), config(fmt="NCX"), config("f16"), config("bf16", "NCX"),
               config(family="fwd")):
        assert overlap_runs(on) and not overlap_runs(on, {"overlap_runs": 0})
        assert {"overlap_runs": 0} in candidates(on)
        assert render_context(on, "v")["overlap_runs"]
    depthwise = config(groups=64, channels=1)
    assert depthwise.depthwise and not render_context(depthwise, "v")["overlap_runs"]
    assert all("overlap_runs" not in plan for plan in candidates(depthwise))


def test_row_vector_blocks_inner_by_rule():
    """Data gradients by rows with one tap run each row's vector blocks together where a
    pass's weights take at most ROW_VB_INNER_BYTES; larger weights, kernels of several
    taps and single vector blocks keep each vector block over every row; the other
    order stays a candidate."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_data import ROW_VB_INNER_BYTES, direct_tiles

    def config(cin, cout, kernel=(1, 1), family="bwd_data", isa="avx512", fmt="NXC"):
        return KernelConfig(family, kernel, (2, 2), (1, 1), 1, cin, cout, fmt, "XIO", "f32",
                            isa)

    for on in (config(256, 512), config(128, 256, isa="avx2"), config(256, 512, fmt="NCX"),
               config(512, 256, family="fwd")):
        assert direct_tiles(on)["row_vb_inner"]
        assert {"row_vb_inner": 0} in candidates(on)
    assert ROW_VB_INNER_BYTES < 512 * 1024 * 4  # config(512, 1024)
    for off in (config(512, 1024), config(128, 128, (3, 3)), config(64, 256)):
        assert not direct_tiles(off)["row_vb_inner"]
    assert {"row_vb_inner": 1} in candidates(config(512, 1024))
    # one vector block (64 channels on avx512): no other order to offer
    assert all("row_vb_inner" not in plan for plan in candidates(config(64, 256)))


def test_tile_loops_unroll_where_registers_allow():
    """The reduction loops of direct and weight-gradient tiles unroll STEP_UNROLL steps
    on x86 where a tile's accumulators, vector operands and broadcast fit the registers: avx2's
    4 x 3 (16 registers) does, its 3 x 4 (17) does not, nor does avx512's 7 x 4 (33).
    {"step_unroll": 1} is a candidate and unrolls none."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.render import render
    from convgrad.codegen.rules_common import unrolled_tiles
    from convgrad.codegen.rules_data import STEP_UNROLL, direct_tiles
    from convgrad.codegen.rules_weights import weight_tiles

    assert unrolled_tiles("avx2", [(4, 3), (3, 4), (6, 2), (2, 1)]) == [(4, 3), (6, 2), (2, 1)]
    assert unrolled_tiles("avx512", [(7, 4), (9, 3), (6, 4)]) == [(9, 3), (6, 4)]
    direct_loop = "for (; c < stop; ++c) {"
    weight_loop = "for (; x < stop; ++x, sp += SRC_STEP, dp += DD_STEP) {"
    for family, isa, loop, tiles_of in (("bwd_data", "avx512", direct_loop, direct_tiles),
                                        ("bwd_data", "avx2", direct_loop, direct_tiles),
                                        ("bwd_weights", "avx512", weight_loop, weight_tiles),
                                        ("bwd_weights", "avx2", weight_loop, weight_tiles)):
        config = KernelConfig(family, (3, 3), (1, 1), (1, 1), 1, 256, 256, "NXC", "XIO",
                              "f32", isa)
        tiles = tiles_of(config)
        assert tiles["unrolled_tiles"] == unrolled_tiles(isa, tiles["tiles"]) != []
        assert tiles["step_unroll"] == STEP_UNROLL[isa] > 1
        assert {"step_unroll": 1} in candidates(config)
        unrolled = f"#pragma GCC unroll {STEP_UNROLL[isa]}\n            {loop}"
        # direct tiles of fewer than 8 accumulators step twice a loop of their own
        one_step = [t for t in tiles["unrolled_tiles"]
                    if family == "bwd_weights" or t[0] * t[1] >= 8]
        assert render(config).count(unrolled) == len(one_step) > 0
        assert unrolled not in render(config, {"step_unroll": 1})
    wide = KernelConfig("bwd_data", (3, 3), (1, 1), (1, 1), 1, 64, 64, "NXC", "XIO", "f32",
                        "avx2")
    assert (3, 4) in direct_tiles(wide)["tiles"]
    assert (3, 4) not in direct_tiles(wide)["unrolled_tiles"]


def test_channels_first_pointwise_passes_by_rule():
    """Channels-first 1x1 tiles whose pixel block of every reduced channel takes more
    than NCX_L1_INPUT_BYTES reduce in passes of whole partial-sum chains; the one pass
    stays a candidate."""
    from convgrad.codegen.isa import VECTOR_LANES
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_common import partial_steps
    from convgrad.codegen.rules_ncx import NCX_L1_INPUT_BYTES, pointwise_ncx_tiles

    def config(reduced, isa="avx512"):
        return KernelConfig("bwd_data", (1, 1), (1, 1), (1, 1), 1, 64, reduced, "NCX",
                            "XIO", "f32", isa)

    for reduced, isa in ((256, "avx512"), (512, "avx512"), (300, "avx512"), (512, "avx2")):
        ncx = pointwise_ncx_tiles(config(reduced, isa))
        chunk = ncx["ncx_reduce_chunk"]
        assert chunk < reduced and chunk % partial_steps(config(reduced, isa)) == 0
        assert chunk * ncx["ncx_vecs"] * VECTOR_LANES[isa] * 4 <= NCX_L1_INPUT_BYTES
        assert {"ncx_pass_kb": 0} in candidates(config(reduced, isa))
        assert pointwise_ncx_tiles(config(reduced, isa),
                                   {"ncx_pass_kb": 0})["ncx_reduce_chunk"] == reduced
    for reduced, isa in ((128, "avx512"), (256, "avx2")):
        assert pointwise_ncx_tiles(config(reduced, isa))["ncx_reduce_chunk"] == reduced
        assert all("ncx_pass_kb" not in plan for plan in candidates(config(reduced, isa)))


def test_amx_tiles_by_rule():
    """The AMX path is carried by bf16 gradients (either layout) of one group with channels
    in multiples of 32 on both sides, on the avx512bf16 path, with any taps and strides
    (backward data with strides and taps by phase of the result), and by channels-last
    forward convolutions over few input channels (patches)."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_amx import amx_tiles

    def config(op="ConvolutionBackwardData", channels=(64, 96), dtype="bf16", fmt="NXC",
               kernel=(1, 1), groups=1, strides=None, isa="avx512bf16", spatial=(4, 6)):
        case = make_case(op, spatial=spatial, kernel=kernel, in_channels=channels[0],
                         out_channels=channels[1], groups=groups, data_format=fmt,
                         dtype=dtype, attrs=dict(strides=list(strides or [1] * len(kernel))))
        a, b = case.inputs[:2]
        return resolve(case.op, [a.shape, b.shape], case.attrs, None, dtype).config.with_isa(isa)

    assert amx_tiles(config(strides=(2, 2)))["amx_pointwise"]  # the others pixels zero
    strided = amx_tiles(config("ConvTransposeBackwardData", strides=(2, 2)))
    assert strided["amx"] and not strided["amx_pointwise"]  # phases of the stride
    assert amx_tiles(config("ConvolutionBackwardWeights", strides=(2, 2)))["amx"]
    assert amx_tiles(config("ConvolutionBackwardWeights", kernel=(3, 3), strides=(2, 2)))["amx"]
    for op in ("ConvolutionBackwardData", "ConvTransposeBackwardData"):
        assert amx_tiles(config(op))["amx_pointwise"]
        for kernel, spatial in (((3, 3), (4, 6)), ((3,), (5,)), ((1, 2, 3), (2, 3, 4)),
                                ((3, 3, 3), (3, 4, 5)), ((2, 1, 1), (3, 4, 5))):
            rows = amx_tiles(config(op, kernel=kernel, spatial=spatial))
            assert rows["amx"] and not rows["amx_pointwise"]
        strided = amx_tiles(config(op, kernel=(3, 3, 3), spatial=(3, 4, 5), strides=(2, 1, 2)))
        assert strided["amx"] and strided["amx_phases"] == (op == "ConvolutionBackwardData")
        assert {"bf16_dot": 0, "amx": 0} in candidates(config(op), "GenuineIntel")
        assert {"amx": 0} in candidates(config(op), "AuthenticAMD")
        assert not amx_tiles(config(op), {"amx": 0})["amx"]
    for kernel in ((3, 3, 3), (2, 1, 1), (1, 3, 3)):
        assert amx_tiles(config("ConvolutionBackwardWeights", kernel=kernel,
                                spatial=(3, 4, 5)))["amx"]
    assert amx_tiles(config("ConvolutionBackwardWeights", kernel=(3, 3, 3), spatial=(3, 4, 5),
                            strides=(2, 1, 2)))["amx"]
    assert amx_tiles(config(fmt="NCX"))["amx"]  # through channels-last copies
    for other in (dict(dtype="f32"), dict(dtype="f16"), dict(isa="avx512"),
                  dict(channels=(64, 80)), dict(channels=(48, 64)), dict(groups=2)):
        assert not amx_tiles(config(**other))["amx"], other
    # forward convolutions over fewer than 16 input channels (an image's 3) multiply
    # patches, output channels in blocks of 32, at most 512 patch values
    conv1 = dict(op="ConvTransposeBackwardData", channels=(64, 3), kernel=(7, 7),
                 spatial=(15, 15), strides=(2, 2))
    assert amx_tiles(config(**conv1))["amx_patches"]
    assert amx_tiles(config(**{**conv1, "channels": (32, 15), "kernel": (3, 3)}))[
        "amx_patches"]
    assert not amx_tiles(config(**{**conv1, "channels": (64, 32)}))["amx_patches"]
    assert not amx_tiles(config(**conv1), {"amx": 0})["amx"]
    assert amx_tiles(config(**{**conv1, "fmt": "NCX"}))["amx_patches"]  # through copies
    # ...and so do their weight gradients
    weights = amx_tiles(config(**{**conv1, "op": "ConvolutionBackwardWeights",
                                  "channels": (3, 64)}))
    assert weights["amx_patches"] and weights["amx_band_pixels"] == 256
    assert not amx_tiles(config("ConvolutionBackwardWeights"))["amx_patches"]
    # backward data by col2im (conv1's 3 result channels) takes its columns on AMX where
    # it reduces whole multiples of 32 channels, channels last; the tuner times it
    # without, and a kernel for a CPU without AMX leaves the path out
    from convgrad.codegen.variants import carries_amx, resolve_plan
    from convgrad.codegen.vendors import vendor_plan

    data = config(**{**conv1, "op": "ConvolutionBackwardData", "channels": (3, 64)})
    assert resolve_plan(data).variant.value == "col2im.c.j2" and carries_amx(data)
    assert {"amx": 0} in candidates(data, "GenuineIntel")
    assert vendor_plan(data, "GenuineIntel", features=["avx512f"]) == {"amx": 0}
    assert not carries_amx(data, {"amx": 0})
    for other in (dict(fmt="NCX"), dict(channels=(3, 48)), dict(isa="avx512")):
        assert not carries_amx(config(**{**conv1, "op": "ConvolutionBackwardData",
                                         "channels": (3, 64), **other})), other
    for other in (dict(channels=(64, 16)), dict(channels=(48, 3)),
                  dict(kernel=(15, 15), spatial=(31, 31)), dict(dtype="f32"),
                  dict(op="ConvolutionBackwardData", channels=(3, 64))):
        assert not amx_tiles(config(**{**conv1, **other})).get("amx_patches"), other


def test_streaming_is_planned_for_f32_channels_last_data_only():
    """The planner (no CPU needed): depthwise (and across-group) f32 NXC data gradients
    whose channels fill whole cache lines stream results of STREAM_MIN_KB, and so do 1x1
    backward-data ones of one group's channels (direct.c.j2) on avx512, on avx2 where
    strides put zeros in the result, there in blocks of 4 vectors (2 lines); never
    weights, 1x1 forward convolutions (fwd), f16/bf16, NCX, channel counts off a line,
    other dense kernels, the portable path, or stream_kb=0, which keeps the 3-vector rule
    on avx2."""
    from convgrad.codegen.rules_data import STREAM_MIN_KB, direct_tiles, stream_min_bytes

    def config(family="bwd_data", groups=64, cin=1, cout=1, fmt="NXC", dtype="f32",
               isa="avx2", kernel=(3, 3)):
        return KernelConfig(family, kernel, (2, 2), (1, 1), groups, cin, cout, fmt, "XIO",
                            dtype, isa)

    dense = config(groups=1, cin=256, cout=128, kernel=(1, 1))  # 1x1 stride 2, 256 <- 128
    stride_1 = replace(dense, strides=(1, 1))
    for streams in (config(), config(isa="avx512"), config(family="fwd"),
                    config(groups=16, cin=4, cout=2),  # across groups: 16 x 4 lanes
                    dense, replace(dense, isa="avx512"), replace(dense, groups=2, cin_per_group=16),
                    replace(stride_1, isa="avx512")):
        plan = {"group_lanes": 1} if streams.groups == 16 else {}
        assert stream_min_bytes(streams, plan) == STREAM_MIN_KB * 1024, streams
    for streaming in (config(), dense):
        assert direct_tiles(streaming)["vec_block"] == 4
        assert direct_tiles(streaming, {"stream_kb": 0})["vec_block"] == 3
        assert stream_min_bytes(streaming, {"stream_kb": 0}) == 0
        assert stream_min_bytes(streaming, {"vec_block": 3}) == 0  # blocks off a line
    for never in (config(family="bwd_weights"), config(dtype="bf16"), config(fmt="NCX"),
                  config(groups=72), config(isa="portable"), replace(dense, kernel=(3, 3)),
                  replace(dense, cin_per_group=264), replace(dense, dtype="f16"),
                  replace(dense, family="bwd_weights"),
                  stride_1, replace(dense, family="fwd"),  # avx2: strided data gradients only
                  replace(dense, family="fwd", isa="avx512")):
        assert stream_min_bytes(never) == 0, never


def test_channels_first_strided_data_gradients_stream_from_16_mb():
    """NCX 1x1 data gradients with strides (the compact copy's spread) stream results of
    NCX_STREAM_MIN_KB on the x86 paths (stream_kb overrides it, 0: never); their forward
    convolutions, stride-1 layers and the generic paths never."""
    from convgrad.codegen.rules_ncx import NCX_STREAM_MIN_KB, pointwise_ncx_tiles

    data = KernelConfig("bwd_data", (1, 1), (2, 2), (1, 1), 1, 256, 128, "NCX", "XIO",
                        "f32", "avx512")
    for isa in ("avx512", "avx2", "avx512bf16"):
        assert pointwise_ncx_tiles(replace(data, isa=isa))["ncx_stream_min_bytes"] == (
            NCX_STREAM_MIN_KB * 1024)
    assert pointwise_ncx_tiles(data, {"stream_kb": 1})["ncx_stream_min_bytes"] == 1024
    assert pointwise_ncx_tiles(data, {"stream_kb": 0})["ncx_stream_min_bytes"] == 0
    for never in (replace(data, family="fwd", cin_per_group=128, cout_per_group=256),
                  replace(data, strides=(1, 1)), replace(data, isa="portable"),
                  replace(data, isa="neon")):
        tiles = pointwise_ncx_tiles(never)
        assert tiles["pointwise_ncx"] and tiles["ncx_stream_min_bytes"] == 0, never


def test_dot_products_are_a_tuning_candidate_only():
    """The planner (pure: no CPU needed) never picks the pixel-dot plan by its rules; it is
    a candidate wherever stride 1 along w lets it run (any kernel, stride along h, any
    path), never for other dtypes or NXC."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_dot import dot_tiles

    def config(kernel=(1, 1), strides=(1, 1), cout=512, isa="avx2", dtype="f32", fmt="NCX"):
        return KernelConfig("bwd_weights", kernel, strides, (1, 1), 1, 256, cout, fmt, "OIX",
                            dtype, isa)

    for other in (config(), config(cout=2048), config(isa="avx512"), config(kernel=(3, 3)),
                  config(strides=(2, 1))):
        assert not dot_tiles(other)["ncx_dot"] and {"ncx_dot": 1} in candidates(other)
        assert dot_tiles(other, {"ncx_dot": 1})["ncx_dot"]
    for never in (config(strides=(1, 2)), config(dtype="f16"), config(fmt="NXC")):
        assert not dot_tiles(never, {"ncx_dot": 1})["ncx_dot"]
        assert all("ncx_dot" not in plan for plan in candidates(never))


def test_image_blocks_by_rule():
    """The planner (pure: no CPU needed) blocks images in channels-first data gradients
    (IMAGE_BLOCK_BYTES of copies per thread, f32 or bf16 pairs; 0 in a plan: the whole
    batch), never in channels-last ones (no copies, or rounded in the tiles); and in bf16
    weight gradients with vdpbf16ps in both layouts (WEIGHT_IMAGE_BLOCK_BYTES of pair
    copies), never where they widen to f32 or in f32 ones, a candidate either way."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_data import (
        IMAGE_BLOCK_BYTES,
        WEIGHT_IMAGE_BLOCK_BYTES,
        image_block_bytes,
    )

    def config(fmt="NCX", dtype="f32", isa="avx2", family="bwd_data"):
        return KernelConfig(family, (3, 3), (1, 1), (1, 1), 1, 64, 64, fmt, "OIX", dtype, isa)

    assert image_block_bytes(config(), {"band_kb": 0}) == IMAGE_BLOCK_BYTES
    assert image_block_bytes(config(dtype="f16", isa="avx512"), {"band_kb": 0}) == IMAGE_BLOCK_BYTES
    assert image_block_bytes(config(dtype="bf16", isa="avx512bf16")) == IMAGE_BLOCK_BYTES
    assert image_block_bytes(config(), {"band_kb": 0, "image_block_kb": 64}) == 64 << 10
    for never in (config(fmt="NXC"), config(fmt="NXC", dtype="bf16"),
                  config(fmt="NXC", dtype="bf16", isa="avx512bf16")):
        assert image_block_bytes(never) == 0
    assert image_block_bytes(config(), {"image_block_kb": 0}) == 0
    for fmt in ("NCX", "NXC"):
        pairs = config(fmt, "bf16", "avx512bf16", "bwd_weights")
        assert image_block_bytes(pairs) == WEIGHT_IMAGE_BLOCK_BYTES
        assert image_block_bytes(pairs, {"image_block_kb": 64}) == 64 << 10
        assert {"image_block_kb": 0} in candidates(pairs)
        for never in (config(fmt, "f32", "avx512", "bwd_weights"),
                      config(fmt, "bf16", "avx512", "bwd_weights")):
            assert image_block_bytes(never) == 0
            assert all("image_block_kb" not in plan for plan in candidates(never))
        assert image_block_bytes(pairs, {"bf16_dot": 0}) == 0


def test_bands_by_rule():
    """The planner (pure) runs channels-first 1-D and 2-D data gradients in bands of
    BAND_BYTES of rows per thread, f32 and widened f16 alike, for both data ops; never 3-D
    (rows of several planes), 1x1 stride-1 layers, bf16 pairs, channels-last data, weight
    gradients, or weights past BAND_MAX_WEIGHT_BYTES (those keep blocks of images); the
    other choice is a candidate either way. f32 1x1 backward data with strides takes
    bands of STRIDED_POINT_DATA_BAND_BYTES whatever its weights (BAND_BYTES a candidate);
    its forward convolution and f16 keep BAND_BYTES."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_data import (
        BAND_BYTES,
        BAND_MAX_WEIGHT_BYTES,
        IMAGE_BLOCK_BYTES,
        STRIDED_POINT_DATA_BAND_BYTES,
        band_bytes,
        image_block_bytes,
    )

    def config(kernel=(3, 3), strides=(1, 1), channels=64, fmt="NCX", dtype="f32",
               isa="avx2", family="bwd_data"):
        rank = len(kernel)
        return KernelConfig(family, kernel, strides, (1,) * rank, 1, channels, channels, fmt,
                            "OIX", dtype, isa)

    for banded in (config(), config(family="fwd"), config(kernel=(5,), strides=(1,)),
                   config(kernel=(1, 1), strides=(2, 2), family="fwd"),
                   config(kernel=(1, 1), strides=(2, 2), dtype="f16", isa="avx512"),
                   config(dtype="f16", isa="avx512"), config(channels=256)):
        assert band_bytes(banded) == BAND_BYTES and image_block_bytes(banded) == 0
        assert band_bytes(banded, {"band_kb": 16}) == 16 << 10
        assert {"band_kb": 0} in candidates(banded)
    assert 9 * 256 * 256 * 4 <= BAND_MAX_WEIGHT_BYTES < 9 * 512 * 512 * 4
    heavy = config(channels=512)
    assert band_bytes(heavy) == 0 and image_block_bytes(heavy) == IMAGE_BLOCK_BYTES
    assert band_bytes(heavy, {"band_kb": 256}) and {"band_kb": BAND_BYTES >> 10} in candidates(
        heavy)
    assert STRIDED_POINT_DATA_BAND_BYTES > BAND_BYTES
    for strided in (config(kernel=(1, 1), strides=(2, 2)),
                    config(kernel=(1, 1), strides=(2, 2), channels=2048, isa="avx512")):
        assert band_bytes(strided) == STRIDED_POINT_DATA_BAND_BYTES, strided
        assert image_block_bytes(strided) == 0
        assert {"band_kb": BAND_BYTES >> 10} in candidates(strided)
        assert {"band_kb": 0} in candidates(strided)
    for never in (config(kernel=(3, 3, 3), strides=(1, 1, 1)), config(kernel=(1, 1)),
                  config(dtype="bf16", isa="avx512bf16"), config(fmt="NXC"),
                  config(family="bwd_weights")):
        assert band_bytes(never) == band_bytes(never, {"band_kb": 16}) == 0
        assert all("band_kb" not in plan for plan in candidates(never))


def test_weight_sums_in_the_weights_by_rule():
    """f32 XIO weight gradients of one group with whole vectors of output channels and one
    slice add their sums in the user's weights (rows unpadded), and {"sums_in_output": 0}
    is then a candidate; never other dtypes, OIX, groups, channel tails, several slices,
    or rows of 2048 floats on 8-lane paths."""
    from convgrad.codegen.isa import VECTOR_LANES
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_weights import weight_tiles

    def config(cout=512, isa="avx512", dtype="f32", wfmt="XIO", groups=1, kernel=(3, 3),
               cin=256):
        return KernelConfig("bwd_weights", kernel, (1, 1), (1, 1), groups, cin, cout, "NXC",
                            wfmt, dtype, isa)

    for isa in ("avx512", "avx2", "neon"):
        yes = config(isa=isa)
        tiles = weight_tiles(yes)
        assert tiles["sums_in_output"] and tiles["sums_row"] == 512 and tiles["max_slices"] == 1
        assert {"sums_in_output": 0} in candidates(yes)
        kept = weight_tiles(yes, {"sums_in_output": 0})
        assert not kept["sums_in_output"] and kept["sums_row"] == 512 + VECTOR_LANES[isa]
    assert weight_tiles(config(cout=2048))["sums_in_output"]
    for no in (config(dtype="bf16"), config(dtype="f16"), config(wfmt="OIX"),
               config(groups=2), config(cout=520), config(cout=2048, isa="avx2"),
               config(cin=16, cout=64, kernel=(1, 1))):  # 64 KB of sums: slices
        assert not weight_tiles(no)["sums_in_output"], no
        assert all("sums_in_output" not in plan for plan in candidates(no))
    assert weight_tiles(config(cin=16, cout=64, kernel=(1, 1)), {"max_slices": 1})[
        "sums_in_output"]


def test_grouped_layers_across_groups_by_rule():
    """The planner's rule (pure: no CPU needed): across the groups where a group's
    vectorised channels fill at most 6/8 of a vector's lanes with 5 taps or more, 3/8
    with fewer (weight gradients), 4/8 and 2/8 (data gradients; never 1x1, nor with
    more than 256 products per output); never depthwise; a candidate either way."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_groups import data_across_groups, weights_across_groups

    def config(kernel=(3, 3), groups=32, cin=4, cout=4, isa="avx2", family="bwd_weights"):
        return KernelConfig(family, kernel, (1,) * len(kernel), (1,) * len(kernel),
                            groups, cin, cout, "NXC", "OIX", "f32", isa)

    def across(config, plan=None):
        if config.family == "bwd_weights":
            return weights_across_groups(config, plan or {})["group_lanes"]
        return data_across_groups(config, plan or {})

    data = "bwd_data"
    for taken in (config(), config(cout=6), config(kernel=(1, 1), cout=3),
                  config(kernel=(5,), cout=6), config(isa="avx512", cout=12),
                  config(family=data), config(family=data, kernel=(3,), cin=2),
                  config(family=data, cin=8, isa="avx512"), config(family="fwd", cin=6)):
        assert across(taken)
        assert {"group_lanes": 0} in candidates(taken)
    for other in (config(cout=7), config(kernel=(3,)), config(kernel=(1, 1)),
                  config(isa="avx512", cout=13), config(groups=1, cout=2),
                  config(family=data, cin=5), config(family=data, kernel=(3,)),
                  config(family=data, kernel=(1, 1), cin=1)):
        assert not across(other)
    assert {"group_lanes": 1} in candidates(config(kernel=(3,)))
    assert {"group_lanes": 1} in candidates(config(family=data, cin=6))
    for never in (config(cin=1, cout=1), config(family=data, cin=1, cout=1),
                  config(family=data, cout=29)):  # 9 x 29 products per output: one chain
        assert not across(never, {"group_lanes": 1})


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_packed_panels_where_a_value_feeds_enough_multiply_adds(isa):
    """The planner's rule (pure: no CPU needed), on both vector widths; f32
    channels-last layers read in place within IN_PLACE_MAX_COUT (avx2: 1x1 ones only);
    1x1 stride-1 NCX layers whose sums exceed L2 take blocks of 2 vectors on Intel."""
    from convgrad.codegen.plan import vendor_plan
    from convgrad.codegen.rules_weights import weight_tiles

    def packed(kernel, groups, cin_per_group, cout_per_group, data_format, dtype="f32"):
        rank = len(kernel)
        config = KernelConfig("bwd_weights", kernel, (1,) * rank, (1,) * rank, groups,
                              cin_per_group, cout_per_group, data_format, "XIO",
                              dtype, isa)
        return weight_tiles(config)["packed"]

    # NCX: src in place where outputs are at most inputs and the sums small (by lanes)
    assert not packed((1, 1), 1, 64, 64, "NCX")
    assert not packed((1, 1), 1, 256, 64, "NCX")
    assert packed((1, 1), 1, 64, 256, "NCX")
    assert packed((1, 1), 1, 1024, 256, "NCX") == (isa == "avx2")  # 1 MB of sums
    assert packed((1, 1), 1, 2048, 512, "NCX")                      # 4 MB
    assert not packed((3, 3), 1, 64, 64, "NCX")  # 144 KB: in place while the sums fit L2
    assert packed((3, 3), 1, 64, 64, "NXC") == (isa == "avx2")  # avx512 NXC: any kernel
    assert packed((3, 3), 1, 64, 1024, "NXC")
    assert not packed((1, 1, 1), 10, 1, 2, "NXC")    # grouped 1x1, 1 -> 2 per group: 0.7
    # 1x1 f32 channels-last, any stride: read in place up to 512 outputs on avx512, 256
    # outputs and 256 KB of sums on avx2 (IN_PLACE_MAX_COUT, IN_PLACE_MAX_SUMS), else packed
    assert packed((1, 1), 1, 4096, 64, "NXC")        # past IN_PLACE_MAX_CIN on both
    assert packed((1, 1), 1, 2048, 64, "NXC") == (isa == "avx2")  # 512 KB of sums
    assert packed((1, 1), 1, 256, 512, "NXC") == (isa == "avx2")
    assert packed((1, 1), 1, 256, 1024, "NXC")
    assert packed((1, 1), 1, 256, 64, "NXC", "f16")  # widened: always packed
    for cin, cout in ((256, 64), (64, 64), (256, 128), (64, 256), (1024, 64)):
        assert not packed((1, 1), 1, cin, cout, "NXC"), (cin, cout)
    assert packed((1, 1), 1, 1024, 128, "NXC") == (isa == "avx2")
    strided = KernelConfig("bwd_weights", (1, 1), (2, 2), (1, 1), 1, 256, 128, "NXC", "XIO",
                           "f32", isa)  # strided 1x1 alike
    assert not weight_tiles(strided)["packed"]
    assert weight_tiles(replace(strided, cout_per_group=1024))["packed"]
    ncx = KernelConfig("bwd_weights", (1, 1), (1, 1), (1, 1), 1, 256, 1024, "NCX", "OIX",
                       "f32", isa)  # 1 MB of sums: 2-vector blocks in Intel's plan only
    assert weight_tiles(ncx)["vec_block"] == (2 if isa == "avx2" else 4)
    assert weight_tiles(ncx, vendor_plan(ncx, "GenuineIntel"))["vec_block"] == 2
    assert weight_tiles(replace(ncx, cout_per_group=512))["vec_block"] == (
        2 if isa == "avx2" else 4)
    # ...and 1x1 f32 NXC layers with 128-256 outputs on avx512
    nxc = replace(ncx, data_format="NXC", cin_per_group=512, cout_per_group=128)
    for cout, avx512_block in ((64, 4), (128, 2), (256, 2), (512, 4)):
        expected = 2 if isa == "avx2" else avx512_block
        assert weight_tiles(replace(nxc, cout_per_group=cout))["vec_block"] == expected


def test_weight_tiles_of_near_equal_height():
    """Weight-gradient tiles split a group's input channels into tiles of near-equal
    height, not full tiles and a short one."""
    from convgrad.codegen.rules_weights import weight_tiles

    def rows(cin, isa, cout=32):
        tiles = weight_tiles(KernelConfig("bwd_weights", (3, 3, 3), (1, 1, 1), (1, 1, 1), 8,
                                          cin, cout, "NXC", "XIO", "f32", isa))
        return sorted({r for r, _ in tiles["tiles"]})

    assert rows(16, "avx512") == [8]
    assert rows(32, "avx512") == [10, 11]
    assert rows(8, "avx2", 16) == [4]
    assert rows(64, "avx512", 64) == [4, 6]  # 10 x 6 + 4: already near equal


def test_weight_gradients_swap_their_inputs_by_rule():
    """1x1 channels-first f32 weight gradients with stride 1, no pads and one group run
    the problem with src and diff_dst swapped (channels swapped, weights format flipped)
    where they have more output than input channels and small weights, or fewer and
    large weights; no others do."""
    for op, swap in (("ConvolutionBackwardWeights", False), ("ConvTransposeBackwardWeights", True)):
        channels = dict(in_channels=37, out_channels=20) if swap else {}
        problem = problem_of(make_case(op, **{**SWAPPED, **channels},
                                     weights_format="XOI" if swap else "XIO"))
        assert (problem.config.cin_per_group, problem.config.cout_per_group) == (37, 20)
        assert problem.config.weights_format == "OIX"
        assert problem.swap_inputs is not swap
    unswapped = [dict(in_channels=37, out_channels=20), dict(data_format="NXC"),
                 dict(dtype="f16"), dict(groups=2, in_channels=20, out_channels=38),
                 dict(attrs=dict(strides=2)), dict(attrs=dict(pads_begin=[1, 0], pads_end=[1, 0])),
                 dict(kernel=(1, 3)), dict(in_channels=160, out_channels=512),
                 dict(in_channels=512, out_channels=128), dict(in_channels=256, out_channels=1024)]
    for change in unswapped:
        geometry = {**SWAPPED, **change}
        problem = problem_of(make_case("ConvolutionBackwardWeights", **geometry))
        assert not problem.swap_inputs, change
        assert problem.config.cout_per_group * problem.config.groups == geometry["out_channels"]
    for cin, cout in ((1024, 256), (128, 512)):  # 1 MB, fewer outputs; 256 KB, more
        problem = problem_of(make_case("ConvolutionBackwardWeights",
                                     **{**SWAPPED, "in_channels": cin, "out_channels": cout}))
        assert problem.swap_inputs and problem.config.cout_per_group == cin
    # channels last: fewer outputs, their last avx512 vector half empty, small weights
    for cin, cout, swap in ((144, 24, True), (240, 40, True), (40, 8, True), (480, 40, False),
                            (192, 32, False), (24, 40, False)):
        problem = problem_of(make_case("ConvolutionBackwardWeights", **{
            **SWAPPED, "in_channels": cin, "out_channels": cout, "data_format": "NXC"}))
        assert problem.swap_inputs is swap, (cin, cout)
