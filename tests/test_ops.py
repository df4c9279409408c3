"""Every op of the runtime against the independent numpy reference.

Inputs are small integers, so f32 sums are exact and compared bit for bit; f16 and
bf16 results are compared exactly with the exact sum rounded once to the dtype.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest
from cases import DATA_OPS, DTYPES, SHAPE_NAMES, TRANSPOSE, make_case, rotating
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import convgrad
from convgrad import api
from convgrad.codegen import KernelConfig
from convgrad.codegen.isa import AMX_FEATURES
from convgrad.codegen.plan import Variant, resolve_plan
from convgrad.reference import OP_KINDS

FUNCTIONS = {spec.kind: getattr(convgrad, spec.function) for spec in api.OPS.values()}
DTYPE_NAMES = {np.dtype(dtype): name for name, dtype in DTYPES.items()}


def assert_exact(case, result):
    dtype = result.dtype
    expected = case.expected(dtype)
    assert result.shape == expected.shape
    np.testing.assert_array_equal(result.view(np.uint16 if dtype.itemsize == 2 else np.uint32),
                                  expected.view(np.uint16 if dtype.itemsize == 2 else np.uint32))


def assert_equal_with_nans(result, expected):
    """NaN exactly where `expected` has one (any payload), equal values elsewhere."""
    np.testing.assert_array_equal(np.isnan(result), np.isnan(expected))
    np.testing.assert_array_equal(result[~np.isnan(result)], expected[~np.isnan(expected)])


def run_case(case, **kwargs):
    result = convgrad.execute(case.op, case.inputs, case.attrs, **kwargs)
    assert_exact(case, result)
    return result


# Per rank: stride and dilation above 1 somewhere, asymmetric pads.
GEOMETRY = {
    1: dict(spatial=(9,), kernel=(3,), attrs=dict(strides=2, dilations=2, pads_begin=[2],
                                                   pads_end=[1])),
    2: dict(spatial=(7, 6), kernel=(3, 2), attrs=dict(strides=[2, 1], dilations=[1, 2],
                                                       pads_begin=[1, 0], pads_end=[0, 2])),
    3: dict(spatial=(4, 5, 3), kernel=(2, 3, 2),
            attrs=dict(strides=[1, 2, 1], dilations=[2, 1, 1], pads_begin=[1, 2, 0],
                       pads_end=[0, 1, 1])),
}


def _weights_formats(op):
    return ("IOX", "XOI", "IXO") if op in TRANSPOSE else ("OIX", "XIO", "OXI")


# Each (op, layout, dtype) runs the three weights formats, one on each rank.
GRID = [(op, rank, df, _weights_formats(op)[(rank + i) % 3], dt)
        for op, rank, df, (i, dt) in
        itertools.product(OP_KINDS, (1, 2, 3), ("NXC", "NCX"), enumerate(DTYPES))]


@pytest.mark.parametrize("op,rank,data_format,weights_format,dtype", GRID)
def test_grid(op, rank, data_format, weights_format, dtype):
    """op x rank x data layout x weights layout x dtype, grouped, strided, dilated."""
    geometry = GEOMETRY[rank]
    case = make_case(op, **geometry, groups=2, in_channels=4, out_channels=6,
                     data_format=data_format, weights_format=weights_format, dtype=dtype)
    run_case(case)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("groups,in_channels,out_channels", [(1, 3, 5), (3, 6, 9), (8, 8, 8),
                                                             (4, 4, 8)])
def test_groups(op, groups, in_channels, out_channels):
    """Groups 1, > 1 and depthwise (with and without a channel multiplier)."""
    case = make_case(op, spatial=(6, 5), kernel=(3, 3), groups=groups, in_channels=in_channels,
                     out_channels=out_channels, attrs=dict(pads_begin=1, pads_end=1), seed=3)
    run_case(case)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("rank,data_format,dtype", [(1, "NXC", "f32"), (2, "NCX", "bf16"),
                                                    (3, "NXC", "f16"), (2, "NXC", "f32")])
@pytest.mark.parametrize("channels", [20, 70])
def test_depthwise(op, rank, data_format, dtype, channels):
    """Depthwise kernels vectorise across groups: a tail vector, several vector blocks."""
    geometry = GEOMETRY[rank]
    case = make_case(op, **geometry, groups=channels, in_channels=channels,
                     out_channels=channels, batch=1, data_format=data_format, dtype=dtype)
    run_case(case)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("pads,groups", [(0, 1), (0, 2), (1, 1)])
@pytest.mark.parametrize("spatial,batch", [((5, 7), 3), ((6, 7), 2), ((3, 3), 2)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_pointwise(op, pads, groups, spatial, batch, dtype):
    """1x1 stride 1: without pads every pixel of the batch is one run (data gradients) or
    the pixels are regrouped into rows of an even width (weight gradients: 84 pixels into
    2 rows of 42, 18 into one row; 105 pixels stay as they are); with pads, neither."""
    case = make_case(op, spatial=spatial, kernel=(1, 1), in_channels=34, out_channels=18,
                     groups=groups, batch=batch, dtype=dtype,
                     attrs=dict(pads_begin=pads, pads_end=pads))
    run_case(case)


AUTO_PADS = ["none", "explicit", "", "same_upper", "same_lower", "valid", "SAME_UPPER", "Valid"]


SHAPE_MODES = [(op, mode) for op in OP_KINDS
               for mode in ["absent", "attribute", "input", "full", "full_input"]
               # ConvTransposeBackwardData has no shape; the weight gradients need theirs.
               if (mode == "absent") == (op == "ConvTransposeBackwardData")
               or (mode == "absent" and op in DATA_OPS)]


@pytest.mark.parametrize("op,shape_mode", SHAPE_MODES)
@pytest.mark.parametrize("auto_pad", AUTO_PADS)
def test_auto_pad_and_shape(op, auto_pad, shape_mode):
    """Every auto_pad spelling with the shape absent, as attribute or input, spatial or full."""
    attrs = dict(strides=[2, 3], dilations=[1, 2], pads_begin=[2, 1], pads_end=[0, 3],
                 auto_pad=auto_pad)
    case = make_case(op, spatial=(7, 8), kernel=(3, 2), attrs=attrs, shape_mode=shape_mode,
                     seed=5)
    run_case(case)


@pytest.mark.parametrize("op", DATA_OPS)
@pytest.mark.parametrize("output_padding", [[1, 0], [0, 2], 1])
def test_output_padding(op, output_padding):
    attrs = dict(strides=[2, 3], dilations=[1, 1], output_padding=output_padding)
    case = make_case(op, spatial=(4, 3), kernel=(3, 3), attrs=attrs, shape_mode="absent")
    run_case(case)


@pytest.mark.parametrize("op", sorted(SHAPE_NAMES))
def test_shape_input_wins_over_attribute(op):
    case = make_case(op, spatial=(6, 6), kernel=(3, 3), shape_mode="input",
                     attrs=dict(pads_begin=1, pads_end=1))
    wrong = [7, 7] if op in DATA_OPS else [1, 1]
    case.attrs[SHAPE_NAMES[op]] = wrong  # the input must win
    result = convgrad.execute(case.op, case.inputs, case.attrs)
    case.attrs.pop(SHAPE_NAMES[op])
    assert_exact(case, result)


@pytest.mark.parametrize("op", OP_KINDS)
def test_functions_match_execute(op):
    """The per-op functions take the same inputs and keyword attributes."""
    case = make_case(op, spatial=(5, 6), kernel=(2, 3), groups=2, shape_mode="input",
                     attrs=dict(strides=2, pads_begin=[1, 0]))
    result = FUNCTIONS[op](*case.inputs, **case.attrs)
    assert_exact(case, result)


@pytest.mark.parametrize("op", OP_KINDS)
def test_out_argument(op):
    case = make_case(op, spatial=(5, 4), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1))
    expected = convgrad.execute(case.op, case.inputs, case.attrs)
    out = np.full_like(expected, 99)
    result = convgrad.execute(case.op, case.inputs, case.attrs, out=out)
    assert result is out
    assert_exact(case, out)


@pytest.mark.parametrize("op", OP_KINDS)
def test_empty_batch(op):
    case = make_case(op, spatial=(5, 4), kernel=(3, 3), batch=0,
                     attrs=dict(pads_begin=1, pads_end=1))
    result = convgrad.execute(case.op, case.inputs, case.attrs)
    expected = case.expected(np.float32)
    assert result.shape == expected.shape
    if op in DATA_OPS:
        assert result.size == 0
    else:
        assert np.all(result == 0)  # a sum over no samples


@pytest.mark.parametrize("op", OP_KINDS)
def test_non_contiguous_inputs(op):
    case = make_case(op, spatial=(5, 4), kernel=(3, 3), attrs=dict(pads_begin=1))
    case.inputs[0] = np.asfortranarray(case.inputs[0])
    run_case(case)


@pytest.mark.parametrize("dtype,base", [("bf16", 256), ("f16", 2048)])
def test_rounding_is_to_nearest_even(dtype, base):
    """Sums base + 1, base + 2, ... fall on and between representable values (spacing 2
    there), so ties must go to the even neighbour."""
    np_dtype = DTYPES[dtype]
    offsets = np.arange(1, 17, dtype=np.float32)
    diff_dst = np.stack([np.full_like(offsets, base), offsets], axis=-1)[None]  # N, W, C=2
    weights = np.ones((1, 1, 2), dtype=np.float32)  # X=1, I=1, O=2
    result = convgrad.convolution_backward_data(diff_dst.astype(np_dtype),
                                               weights.astype(np_dtype))
    exact = base + offsets
    # Odd sums lie halfway between two neighbours; the even one is the multiple of 4.
    expected = np.where(exact % 2 == 0, exact,
                        np.where((exact - 1) % 4 == 0, exact - 1, exact + 1))
    np.testing.assert_array_equal(result[0, :, 0].astype(np.float32), expected)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("groups,in_channels,out_channels", [(1, 21, 38), (64, 64, 64),
                                                             (1, 3, 38)])
def test_thread_counts_agree(op, threads, groups, in_channels, out_channels):
    """Large enough that kernels use every thread asked for (tiny ones take one); 3
    input channels: backward data by col2im, threads sharing an image's rows."""
    rng = np.random.default_rng(1)
    case = make_case(op, spatial=(40, 38), kernel=(3, 3), in_channels=in_channels,
                     out_channels=out_channels, groups=groups, batch=4,
                     attrs=dict(pads_begin=1, pads_end=1))
    # Non-integer data: the order of the sums shows in the bits.
    case.inputs[:2] = [rng.standard_normal(x.shape).astype(np.float32) for x in case.inputs[:2]]
    one = convgrad.execute(case.op, case.inputs, case.attrs, num_threads=1)
    many = convgrad.execute(case.op, case.inputs, case.attrs, num_threads=threads)
    np.testing.assert_array_equal(one, many)
    # f32 sums of ~6000 products of normal values: rounding, bounded loosely
    np.testing.assert_allclose(one, case.expected(np.float32), rtol=1e-4, atol=2e-3)


ISAS = convgrad.cpu.available_isas()
HAS_AMX = convgrad.cpu.cpu_features() >= AMX_FEATURES
# Plans that keep a kernel off its AMX path say amx=0 only where it has one.
AMX_OFF = ("amx",)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("in_channels,out_channels,data_format,dtype",
                         [(37, 70, "NXC", "f32"), (70, 37, "NCX", "bf16"), (16, 64, "NXC", "f16"),
                          (37, 70, "NXC", "bf16")])
def test_isa_paths_and_channel_tails(isa, op, in_channels, out_channels, data_format, dtype,
                                     monkeypatch):
    """Every ISA path this CPU runs, with several vector blocks and channel tails."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, spatial=(7, 9), kernel=(3, 2), in_channels=in_channels,
                     out_channels=out_channels, batch=1, data_format=data_format, dtype=dtype,
                     attrs=dict(strides=[2, 1], dilations=[1, 2], pads_begin=[1, 0],
                                pads_end=[1, 1]))
    run_case(case)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", OP_KINDS)
def test_channels_last_weights_on_every_path(isa, op, monkeypatch):
    """torch's channels_last weights, (O, k..., I/g) = OXI (IXO for the ConvTranspose
    ops), read and written in place on every ISA path: several vector blocks with channel
    tails, grouped 3-D, depthwise; f32, bf16 and f16. (AMX: test_amx_tiles_*.)"""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    fmt = "IXO" if op in TRANSPOSE else "OXI"
    for dtype, groups, channels, kernel, spatial, data_format in (
            ("f32", 1, (37, 70), (3, 2), (7, 9), "NXC"),
            ("bf16", 2, (6, 10), (2, 1, 3), (3, 4, 5), "NCX"),
            ("f16", 24, (24, 24), (3, 3), (6, 5), "NXC")):
        case = make_case(op, spatial=spatial, kernel=kernel, in_channels=channels[0],
                         out_channels=channels[1], groups=groups, batch=2,
                         data_format=data_format, weights_format=fmt, dtype=dtype,
                         attrs=dict(pads_begin=1, pads_end=0))
        run_case(case)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("spatial,batch,kernel,channels,stride", [
    ((5, 7), 2, (3, 3), 200, 1),
    ((40, 33), 3, (3, 3), 200, 1),  # 8 row blocks
    ((6, 90), 1, (5, 5), 300, 1),   # one row block, enough work for 2 and 3 threads
    ((12, 90), 2, (5, 3), 300, 2),  # 4 row blocks; rows that sweep whole pixels (stride 2)
])
def test_depthwise_weights_share_row_and_channel_blocks(isa, spatial, batch, kernel, channels,
                                                        stride, monkeypatch):
    """Depthwise weight gradients: threads share (row block, part of the channel blocks)
    pairs, so a small image with many channels (one row block) runs on several, its
    channel blocks in parts; exact and the same bits on 1, 2 and 3 threads (200 and 300
    channels: several vector blocks and a tail). With stride along w on 8-lane paths
    (vector blocks of 3, part of a cache line) each row sweeps a part's channels pixel by
    pixel (pixel_sweep); else register tiles."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_groups import depthwise_weight_rows

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case("ConvolutionBackwardWeights", spatial=spatial, kernel=kernel,
                     groups=channels, in_channels=channels, out_channels=channels, batch=batch,
                     attrs=dict(strides=[1, stride], pads_begin=1, pads_end=1), seed=5)
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     "f32").config.with_isa(isa)
    eight_lanes = isa in ("avx2", "portable")
    assert depthwise_weight_rows(config)["pixel_sweep"] == (stride > 1 and eight_lanes)
    for threads in (1, 2, 3):
        run_with_plan(case, {}, isa, threads, variant=Variant.DEPTHWISE_WEIGHTS)


ALL_TAPS_GEOMETRY = {
    # 3x3, a channel tail (avx512: 5 vectors, blocks of 2 and a last 1), pads on one side
    "3x3": dict(spatial=(9, 23), kernel=(3, 3), in_channels=72, out_channels=72, groups=72,
                batch=2, attrs=dict(pads_begin=[1, 1], pads_end=[0, 1])),
    # strides and dilation: columns some w taps never reach, rows some h taps skip
    "strided": dict(spatial=(11, 17), kernel=(3, 2), in_channels=40, out_channels=40,
                    groups=40, batch=1,
                    attrs=dict(strides=[2, 3], dilations=[2, 1], pads_begin=[2, 0],
                               pads_end=[1, 1])),
    # 3-D: one register tile per kd; 1-D: a single h tap
    "3d": dict(spatial=(4, 5, 9), kernel=(2, 3, 3), in_channels=24, out_channels=24,
               groups=24, batch=2, attrs=dict(pads_begin=1, pads_end=[0, 1, 1])),
    "1d": dict(spatial=(50,), kernel=(5,), in_channels=33, out_channels=33, groups=33,
               batch=3, attrs=dict(dilations=[2], pads_begin=[4], pads_end=[3])),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geometry,plan,threads", [
    ("3x3", {"all_taps": 1}, 2), ("3x3", {"all_taps": 1, "row_vb_inner": 1}, 1),
    ("strided", {"all_taps": 1, "row_group_kb": 1}, 3), ("3d", {"all_taps": 1}, 2),
    ("1d", {"all_taps": 1}, 2)])
def test_depthwise_weights_with_every_tap_in_registers(isa, geometry, plan, threads):
    """The all_taps plan (a tuning candidate): register tiles of every (kh, kw) tap of a
    kd over groups of rows (by bytes; one row with row_vb_inner; row_group_kb 1: one row
    each), exact on every path, with channel tails, strides, dilations, one-sided pads,
    3-D and 1-D, on 1-3 threads. Where the taps do not fit beside a vector (5x5 on avx2)
    the plan keeps the row kernels."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_groups import depthwise_weight_rows

    case = make_case("ConvolutionBackwardWeights", **ALL_TAPS_GEOMETRY[geometry], seed=12)
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     "f32").config.with_isa(isa)
    rows = depthwise_weight_rows(config, plan)
    assert rows["rows_template"] == "depthwise_taps.h.j2"
    assert rows["row_vb_inner"] == bool(plan.get("row_vb_inner", 0))
    assert not depthwise_weight_rows(config)["all_taps"]
    run_with_plan(case, plan, isa, threads, variant=Variant.DEPTHWISE_WEIGHTS)


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
    from convgrad.codegen.rules_data import NCX_L1_INPUT_BYTES, pointwise_ncx_tiles

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
    from convgrad.codegen.rules_data import pointwise_ncx_tiles

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


def _placed(array: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `array` whose data starts `offset` bytes past a 64-byte boundary."""
    from convgrad import kernels

    block = kernels.empty_output((array.nbytes + 64,), np.uint8)
    placed = block[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
    placed[...] = array
    return placed


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
    from convgrad.codegen.rules_data import NCX_HEAD_MIN_REDUCED, pointwise_ncx_tiles

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
                x, y = _placed(a, in_at), _placed(b, in_at)
                first, second = (y, x) if problem.swap_inputs else (x, y)
                out = _placed(np.zeros(problem.output_shape, np.float32), out_at)
                kernels.call(kernel, problem, dims, first, second, out, workspace)
                assert_exact(case, out)


AMX_WEIGHTS = [("ConvolutionBackwardData", "XIO"), ("ConvolutionBackwardData", "OIX"),
               ("ConvolutionBackwardData", "OXI"), ("ConvTransposeBackwardData", "IOX"),
               ("ConvTransposeBackwardData", "XOI"), ("ConvTransposeBackwardData", "IXO")]


def test_amx_tiles_by_rule():
    """The AMX path is carried by bf16 gradients (either layout) of one group with channels
    in multiples of 32 on both sides, on the avx512bf16 path, with any taps and strides
    (backward data with strides and taps by phase of the result)."""
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


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("op,weights_format,strides,channels,data_format", [
    (*row, *layout) for i, row in enumerate(
        [*((op, layout, (1, 1)) for op, layout in AMX_WEIGHTS),
         ("ConvolutionBackwardData", "XIO", (2, 2)), ("ConvolutionBackwardData", "OIX", (1, 3))])
    # without AMX (the kernels fall back) one of the two in turn
    for layout in rotating([((64, 96), "NXC"), ((32, 32), "NCX")], i, 2 if HAS_AMX else 1)])
def test_amx_tiles_pointwise(isa, op, weights_format, strides, channels, data_format):
    """bf16 1x1 data gradients on AMX tiles (channels first through channels-last copies),
    where the CPU has them (else the kernel's other tiles): exact for 1 to 72 pixels
    (blocks of 32 and a zero-padded last block), both weight layouts, strided backward
    data (the result's other pixels zero, on a result first filled with garbage), inputs
    and results at odd offsets, 1 and 2 threads. On a CPU with AMX the workspace is the
    AMX path's (packed weights, one block of input rows, NCX copies), so a silent
    fallback fails; elsewhere it is the other tiles'."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    for spatial, batch in (((1, 1), 1), ((3, 3), 2), ((4, 8), 1), ((5, 7), 2), ((8, 9), 1)):
        case = make_case(op, spatial=spatial, kernel=(1, 1), in_channels=channels[0],
                         out_channels=channels[1], batch=batch, data_format=data_format,
                         weights_format=weights_format, dtype="bf16", seed=21,
                         attrs=dict(strides=list(strides)))
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        reduced = config.cout_per_group if config.family == "bwd_data" else config.cin_per_group
        # packed weights, a block of input rows and (NCX) channels-last copies, each part
        # at a 64-byte boundary
        parts = [reduced * config.vector_channels * 2, 32 * reduced * 2]
        if data_format == "NCX":
            parts += [a.size * 2, int(np.prod(problem.output_shape)) * 2]
        amx_bytes = sum(-(-part // 64) * 64 for part in parts)
        for plan in ({"bf16_dot": 0},):  # the AMX path is the same under either
            kernel = kernels.get_kernel(config, plan)
            other = kernels.get_kernel(config, {**plan, "amx": 0})
            for threads in (1, 2):
                dims = kernels.dims_of(problem, threads)
                size = kernel.workspace_size(dims)
                assert size == (amx_bytes + 64 if HAS_AMX else other.workspace_size(dims))
                workspace = np.empty(size, dtype=np.uint8)
                for in_at, out_at in ((0, 0), (2, 6), (34, 62)):
                    x, y = _placed(a, in_at), _placed(b, in_at)
                    first, second = (y, x) if problem.swap_inputs else (x, y)
                    out = _placed(np.full(problem.output_shape, 7, a.dtype), out_at)
                    kernels.call(kernel, problem, dims, first, second, out, workspace)
                    assert_exact(case, out)


AMX_ROWS_GEOMETRY = {  # stride 1 with taps: pads within and past the kernel's extent
    "3x3": dict(spatial=(5, 7), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1)),
    "3x3 unpadded": dict(spatial=(5, 7), kernel=(3, 3)),
    "dilated": dict(spatial=(6, 9), kernel=(1, 3),
                    attrs=dict(dilations=[1, 2], pads_begin=[0, 2], pads_end=[0, 1])),
    "uneven pads": dict(spatial=(4, 5), kernel=(2, 2), attrs=dict(pads_begin=[1, 0],
                                                                  pads_end=[0, 1])),
    "wide pads": dict(spatial=(4, 4), kernel=(3, 3), attrs=dict(pads_begin=[2, 2],
                                                                pads_end=[0, 1])),
    "pad past extent": dict(spatial=(4, 4), kernel=(3, 3), attrs=dict(pads_begin=[3, 0],
                                                                      pads_end=[1, 0])),
    "1d": dict(spatial=(11,), kernel=(3,), attrs=dict(pads_begin=1, pads_end=2)),
    "3d": dict(spatial=(3, 4, 5), kernel=(1, 3, 3), attrs=dict(pads_begin=[0, 1, 1],
                                                                  pads_end=[0, 1, 1])),
    "tall": dict(spatial=(40, 3), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1)),
}
# taps in depth: a copy of the band per depth tap, planes past the input's depth as
# zeros, dilated and wide pads in depth
AMX_DEPTH_GEOMETRY = {
    "3x3x3": dict(spatial=(3, 4, 5), kernel=(3, 3, 3), attrs=dict(pads_begin=1, pads_end=1)),
    "3x3x3 unpadded": dict(spatial=(4, 4, 5), kernel=(3, 3, 3)),
    "depth dilated": dict(spatial=(5, 3, 4), kernel=(2, 1, 3),
                          attrs=dict(dilations=[2, 1, 1], pads_begin=[3, 0, 1],
                                     pads_end=[0, 0, 1])),
    "depth tall": dict(spatial=(2, 40, 3), kernel=(3, 3, 3),
                       attrs=dict(pads_begin=[2, 1, 1], pads_end=[1, 1, 1])),
}

AMX_STRIDED_GEOMETRY = {  # data gradients with strides: split by phase of the stride
    "3x3 s2": dict(spatial=(7, 9), kernel=(3, 3),
                   attrs=dict(strides=[2, 2], pads_begin=1, pads_end=1)),
    "1x1 s2": dict(spatial=(7, 8), kernel=(1, 1), attrs=dict(strides=[2, 2])),
    "3x3x3 s2": dict(spatial=(5, 4, 7), kernel=(3, 3, 3),
                     attrs=dict(strides=[2, 2, 2], pads_begin=1, pads_end=1)),
    "uneven": dict(spatial=(9, 11), kernel=(2, 4),
                   attrs=dict(strides=[3, 2], pads_begin=[2, 1], pads_end=[0, 3])),
    "dilated s2": dict(spatial=(9, 10), kernel=(3, 2),
                       attrs=dict(strides=[2, 2], dilations=[2, 3], pads_begin=[2, 3],
                                  pads_end=[1, 0])),
    "stride past kernel": dict(spatial=(6, 13), kernel=(2, 2),
                               attrs=dict(strides=[3, 4], pads_begin=[0, 5])),
    "tall s2": dict(spatial=(80, 5), kernel=(3, 3),
                    attrs=dict(strides=[2, 2], pads_begin=1, pads_end=1)),
}


def _amx_cases(geometries, layouts):
    """Each geometry with one of the op and weight layout pairs, every pair in turn, and
    channels last or first (through channels-last copies) in turn. Without AMX, every
    other case: the kernels then run their other tiles, which the rest of the suite
    covers, and these cases check only that the kernels that carry AMX fall back."""
    cases = [(name, *layouts[k % len(layouts)], ("NXC", "NCX")[k // len(layouts) % 2])
             for k, name in enumerate(sorted(geometries))]
    return cases if HAS_AMX else cases[::2]


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("geometry,op,weights_format,data_format", [
    *_amx_cases({**AMX_ROWS_GEOMETRY, **AMX_DEPTH_GEOMETRY}, AMX_WEIGHTS),
    # strides: each geometry for both ops
    *_amx_cases({name: geometry for name, geometry in AMX_STRIDED_GEOMETRY.items()
                 if name != "1x1 s2"}, AMX_WEIGHTS[:3]),  # as test_amx_tiles_pointwise
    *_amx_cases(AMX_STRIDED_GEOMETRY, AMX_WEIGHTS[3:])])
def test_amx_tiles_data(isa, op, weights_format, data_format, geometry):
    """bf16 channels-last data gradients with taps on AMX tiles, where the CPU has them:
    bands of rows copied with zero borders (several bands: "tall"), the outputs past the
    width dropped, both weight layouts (OIX value by value), 1 and 2 threads, a result
    first filled with garbage. Taps in depth: a copy per depth tap. Strides: the forward
    op's copies hold the input by phase of the stride (only the phases a tap reads);
    backward data's result goes phase by phase, each over its own taps (none: zeros,
    "stride past kernel"), from one copy of diff_dst's rows. Backward data with stride 1
    and a pad past the kernel's extent takes the other tiles; on a CPU with AMX every
    other call takes the AMX path (its workspace differs from the other tiles')."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    geometries = {**AMX_ROWS_GEOMETRY, **AMX_DEPTH_GEOMETRY, **AMX_STRIDED_GEOMETRY}
    for batch in (1, 3):
        case = make_case(op, **geometries[geometry], in_channels=64, out_channels=32,
                         batch=batch, data_format=data_format, weights_format=weights_format,
                         dtype="bf16", seed=22)
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        kernel = kernels.get_kernel(config, {"bf16_dot": 0})
        other = kernels.get_kernel(config, {"bf16_dot": 0, "amx": 0})
        for threads in (1, 2):
            dims = kernels.dims_of(problem, threads)
            size, other_size = kernel.workspace_size(dims), other.workspace_size(dims)
            assert (size != other_size) == (HAS_AMX and not (
                geometry == "pad past extent" and op == "ConvolutionBackwardData"))
            workspace = np.empty(size, dtype=np.uint8)
            first, second = (b, a) if problem.swap_inputs else (a, b)
            out = np.full(problem.output_shape, 7, a.dtype)
            kernels.call(kernel, problem, dims, first, second, out, workspace)
            assert_exact(case, out)


AMX_WEIGHT_GEOMETRY = {**AMX_ROWS_GEOMETRY, **AMX_DEPTH_GEOMETRY,
                       **{name: geometry for name, geometry in AMX_STRIDED_GEOMETRY.items()
                          if name not in ("1x1 s2", "tall s2")},  # as "1x1 strided", "tall"
                       "1x1": dict(spatial=(5, 7), kernel=(1, 1)),
                       "1x1 strided": dict(spatial=(7, 10), kernel=(1, 1),
                                           attrs=dict(strides=[2, 3])),
                       "many bands": dict(spatial=(70, 40), kernel=(3, 3),
                                          attrs=dict(pads_begin=1, pads_end=1))}


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("geometry,op,weights_format,data_format", _amx_cases(
    AMX_WEIGHT_GEOMETRY, [("ConvolutionBackwardWeights", "XIO"),
                          ("ConvolutionBackwardWeights", "OIX"),
                          ("ConvolutionBackwardWeights", "OXI"),
                          ("ConvTransposeBackwardWeights", "IOX"),
                          ("ConvTransposeBackwardWeights", "XOI"),
                          ("ConvTransposeBackwardWeights", "IXO")]))
def test_amx_tiles_weights(isa, op, weights_format, data_format, geometry):
    """bf16 channels-last weight gradients on AMX tiles, where the CPU has them: bands of
    whole images (one or several per band) or of rows ("tall", "many bands"), src copied
    channels first with zero borders (by phase of the stride, only the phases a tap
    reads; taps in depth: a copy per depth tap), diff_dst as pixel pairs (odd
    row widths: pairs across rows), 1 to 3 threads (threads split the input or the output
    channels), both weight layouts. On a CPU with AMX every call takes the AMX path (its
    workspace differs from the other tiles')."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    for batch, channels in ((1, (64, 32)), (3, (32, 96))):
        case = make_case(op, **AMX_WEIGHT_GEOMETRY[geometry], in_channels=channels[0],
                         out_channels=channels[1], batch=batch, data_format=data_format,
                         weights_format=weights_format, dtype="bf16", seed=24)
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        kernel = kernels.get_kernel(config, {"bf16_dot": 0})
        other = kernels.get_kernel(config, {"bf16_dot": 0, "amx": 0})
        for threads in (1, 2, 3):
            dims = kernels.dims_of(problem, threads)
            size = kernel.workspace_size(dims)
            assert (size != other.workspace_size(dims)) == HAS_AMX
            first, second = (b, a) if problem.swap_inputs else (a, b)
            out = np.full(problem.output_shape, 7, a.dtype)
            kernels.call(kernel, problem, dims, first, second, out,
                         np.empty(size, dtype=np.uint8))
            assert_exact(case, out)


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("op", ["ConvolutionBackwardWeights", "ConvolutionBackwardData"])
def test_amx_tiles_never_multiply_inf_by_padding(isa, op):
    """An inf in src at the image's corner (weight gradients), or in the weights (data
    gradients), meets the AMX copies' zeros where the convolution has no product; such
    calls take the other tiles, whose result (here NaN and inf exactly where products of
    the inf are) the AMX kernel then gives too."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    case = make_case(op, spatial=(5, 7), kernel=(3, 3), in_channels=32, out_channels=32,
                     batch=1, data_format="NXC", dtype="bf16", seed=25,
                     attrs=dict(pads_begin=1, pads_end=1))
    a, b = case.inputs[:2]
    if op == "ConvolutionBackwardWeights":
        a[0, 0, 0, 3] = np.inf  # src
    else:
        b[0, 0, 5, 2] = np.inf  # weights (XIO): tap (0, 0)
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
    config = problem.config.with_isa(isa)
    results = []
    for plan in ({"bf16_dot": 0}, {"bf16_dot": 0, "amx": 0}):
        kernel = kernels.get_kernel(config, plan)
        dims = kernels.dims_of(problem, 2)
        first, second = (b, a) if problem.swap_inputs else (a, b)
        out = np.zeros(problem.output_shape, a.dtype)
        kernels.call(kernel, problem, dims, first, second, out,
                     np.empty(kernel.workspace_size(dims), dtype=np.uint8))
        results.append(out.astype(np.float32))
    assert np.isinf(results[1]).any()
    np.testing.assert_array_equal(results[0], results[1])


AMX_OFF_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
from cases import make_case
from test_ops import assert_exact
from convgrad import kernels
from convgrad.codegen.ops import resolve
case = make_case("ConvolutionBackwardData", spatial=(5, 7), kernel=(1, 1), in_channels=64,
                 out_channels=32, batch=2, dtype="bf16", seed=23)
a, b = case.inputs[:2]
problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
config = problem.config.with_isa("avx512bf16")
kernel = kernels.get_kernel(config, {{}})
dims = kernels.dims_of(problem, 2)
size = kernel.workspace_size(dims)
assert size == kernels.get_kernel(config, {{"amx": 0}}).workspace_size(dims), size
out = np.empty(problem.output_shape, a.dtype)
first, second = (b, a) if problem.swap_inputs else (a, b)
kernels.call(kernel, problem, dims, first, second, out, np.empty(size, np.uint8))
assert_exact(case, out)
print("ok")
"""


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
def test_amx_off_by_environment(isa):
    """CONVGRAD_AMX=0 keeps kernels that carry AMX on their other tiles (the benchmark
    sets it where it limits oneDNN below AMX): in a child process, the workspace is the
    other tiles' and the result exact."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = AMX_OFF_CHILD.format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "CONVGRAD_AMX": "0"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
def test_amx_tiles_flushes_denormals(isa):
    """AMX reads bf16 denormals as zero and flushes denormal f32 sums, as vdpbf16ps does
    (README): on a CPU with AMX, 1.5 x 2^-126 - 1.25 x 2^-126 gives 0, and a denormal
    input multiplies as 0; without AMX the widened tiles keep the denormal 2^-128 and the
    input (vdpbf16ps, Zen 4's rule, would flush them too)."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    tiny, bf16 = 2.0 ** -126, DTYPES["bf16"]
    diff_dst = np.zeros((1, 5, 1, 32), np.float32)
    diff_dst[0, :2, 0, 0], diff_dst[0, :2, 0, 2] = 1.5 * tiny, -1.25 * tiny
    diff_dst[0, 2:, 0, 0] = 0.5 * tiny  # a bf16 denormal
    weights = np.zeros((1, 1, 32, 32), np.float32)  # XIO
    weights[..., 0] = weights[..., 2] = 1.0
    first, second = diff_dst.astype(bf16), weights.astype(bf16)
    problem = resolve("ConvolutionBackwardData", [first.shape, second.shape],
                      dict(data_format="NXC", weights_format="XIO"), [5, 1], "bf16")
    config = problem.config.with_isa(isa)
    dims = kernels.dims_of(problem, 1)
    for plan, flushed in (({"bf16_dot": 0}, HAS_AMX), ({"amx": 0, "bf16_dot": 0}, False)):
        kernel = kernels.get_kernel(config, plan)
        out = np.empty(problem.output_shape, bf16)
        workspace = np.empty(kernel.workspace_size(dims), np.uint8)
        kernels.call(kernel, problem, dims, first, second, out, workspace)
        expected = np.zeros(problem.output_shape, np.float32)
        if not flushed:
            expected[0, :2, 0, :] = 0.25 * tiny
            expected[0, 2:, 0, :] = 0.5 * tiny
        np.testing.assert_array_equal(out.astype(np.float32), expected)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("channels,dilation,width", [(40, 1, 37), (24, 2, 30), (19, 1, 12)])
@pytest.mark.parametrize("data_format,dtype", [("NXC", "f32"), ("NCX", "bf16")])
def test_depthwise_sliding_tiles(isa, op, channels, dilation, width, data_format, dtype,
                                 monkeypatch):
    """Depthwise data gradients with stride 1 along w run runs that see every w tap in
    sliding tiles (each input column loaded once for all taps), the rest of the run and
    the edges in the usual tiles: channel tails, dilation, 1-3 tiles per run."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_groups import slide_rows

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, spatial=(3, width), kernel=(2, 3), in_channels=channels,
                     out_channels=channels, groups=channels, batch=2, data_format=data_format,
                     dtype=dtype, seed=9,
                     attrs=dict(strides=[2, 1], dilations=[1, dilation], pads_begin=[1, 2],
                                pads_end=[0, 1]))
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     dtype).config.with_isa(isa)
    assert slide_rows(config) > 0
    run_case(case)



STREAM_GEOMETRY = {
    # stride 2 with pads: 1, 2 or 4 taps per pixel; 48 channels, a last vector block of
    # 2 on avx2 (4 + 2), 3 single-vector blocks on avx512
    "strided": dict(spatial=(9, 13), kernel=(3, 3), in_channels=48, out_channels=48,
                    groups=48, attrs=dict(strides=[2, 2], pads_begin=[1, 1],
                                          pads_end=[1, 0])),
    # stride 1 along w: the sliding tiles' runs, which tiles take where the result streams
    "sliding": dict(spatial=(5, 30), kernel=(2, 3), in_channels=32, out_channels=32,
                    groups=32, attrs=dict(dilations=[1, 2], pads_begin=[1, 2],
                                          pads_end=[0, 1])),
    # 3-D, one line of channels
    "3d": dict(spatial=(3, 4, 5), kernel=(2, 3, 3), in_channels=16, out_channels=16,
               groups=16, attrs=dict(strides=[1, 2, 1], pads_begin=1, pads_end=[0, 1, 1])),
    # enough multiply-adds for 2 threads (MIN_THREAD_FLOPS): each streams its rows
    "threads": dict(spatial=(24, 40), kernel=(3, 3), in_channels=128, out_channels=128,
                    groups=128, attrs=dict(pads_begin=1, pads_end=1)),
    # across groups, 2 channels per group spread to the lanes
    "groups": dict(spatial=(6, 9), kernel=(3, 3), in_channels=16, out_channels=16, groups=8,
                   attrs=dict(pads_begin=1, pads_end=1)),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("geometry,op", [  # each runs both ops, in turn
    (geometry, ("ConvolutionBackwardData", "ConvTransposeBackwardData")[g % 2])
    for g, geometry in enumerate(sorted(STREAM_GEOMETRY))])
def test_depthwise_results_stream_past_the_caches(isa, geometry, op):
    """Depthwise and across-group data gradients store results of at least stream_kb
    with non-temporal stores, in whole cache lines, on 1 and 2 threads; a result that
    does not start on a cache line takes ordinary stores. Both exact."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_data import stream_min_bytes

    case = make_case(op, **STREAM_GEOMETRY[geometry], batch=2, seed=4)
    plan = {"stream_kb": 1, "group_lanes": 1} if geometry == "groups" else {"stream_kb": 1}
    config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     "f32").config.with_isa(isa)
    assert (stream_min_bytes(config, plan) == 1024) == (isa != "portable")
    run_streamed(case, plan, isa, variant=Variant.ACROSS_GROUPS)



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


def run_streamed(case, plan, isa, *, variant):
    """Runs `case` (f32, a result of at least 1 KB) with a forced plan on 1 and 2 threads
    into a result on a cache line, and on 2 into one a float past it; checks the bits.
    (stream_kb goes where the kernel does not stream: the portable path, other ops.)"""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "f32")
    config = problem.config.with_isa(isa)
    kernel = kernels.get_kernel(config, taken(config, plan, ("stream_kb",)))
    assert_variant(case, kernel, plan, variant)
    first, second = (b, a) if problem.swap_inputs else (a, b)
    size = int(np.prod(problem.output_shape))
    assert size * 4 >= 1024
    for threads, offset in ((1, 0), (2, 0), (2, 1)):  # offset: floats past a line
        dims = kernels.dims_of(problem, threads)
        block = kernels.empty_output((size + 1,), np.float32)
        out = block[offset:offset + size].reshape(problem.output_shape)
        out[...] = np.nan
        kernels.call(kernel, problem, dims, first, second, out,
                     np.empty(kernel.workspace_size(dims), np.uint8))
        assert_exact(case, out)


NCX_WEIGHT_GEOMETRY = {
    # 1x1 stride 1 without pads: each image's pixels are one run of every channel
    "pointwise": dict(spatial=(5, 7), kernel=(1, 1), batch=3, groups=1),
    # runs of one row each, cut by pads; stride, dilation, groups, rows no tap reads
    "strided": dict(spatial=(9, 8), kernel=(3, 2), batch=2, groups=2,
                    attrs=dict(strides=[3, 1], dilations=[1, 2], pads_begin=[1, 2],
                               pads_end=[0, 1])),
    # 1-D with a kernel wider than the image's pads: runs that merge across images do not
    "1d": dict(spatial=(11,), kernel=(4,), batch=3, groups=1,
               attrs=dict(pads_begin=[2], pads_end=[1])),
}


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


DOT_WEIGHT_GEOMETRY = {
    # 1x1: runs merge across rows; 3 chunks, 3 superblocks, input-channel tails
    "1x1": dict(spatial=(20, 26), kernel=(1, 1), in_channels=301, out_channels=46, batch=2),
    # taps, pads, dilation along w, stride along h, groups, output-channel tail
    "3x3": dict(spatial=(9, 13), kernel=(3, 3), in_channels=20, out_channels=26, groups=2,
                batch=2, attrs=dict(strides=[2, 1], dilations=[1, 2], pads_begin=[1, 2],
                                    pads_end=[0, 1])),
    # 1-D with pads and runs shorter than a vector; 3-D
    "1d": dict(spatial=(11,), kernel=(4,), in_channels=9, out_channels=7, batch=3,
               attrs=dict(pads_begin=[2], pads_end=[1])),
    "3d": dict(spatial=(4, 5, 6), kernel=(1, 2, 2), in_channels=12, out_channels=5, batch=2,
               attrs=dict(strides=[2, 1, 1], pads_begin=[0, 1, 0], pads_end=[1, 0, 1])),
}


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


def taken(config, plan, optional=()):
    """`plan` without those of its `optional` overrides that the variant `config` takes
    under it does not read (such as amx=0 where a kernel has no AMX path): any other
    override the variant does not take stays, for resolve_plan to refuse."""
    reads = resolve_plan(config, plan, strict=False).reads
    return {k: v for k, v in plan.items() if k in reads or k not in optional}


def forced_kernel(case, plan=None, isa=None, threads=1, *, optional=(), variant=None):
    """`case`'s kernel (with a forced plan and ISA path where given, less the `optional`
    overrides its variant does not take): the workspace bytes it needs, and a function
    that runs it on a given workspace and checks the bits. A forced plan names the
    `variant` it is meant to run (a Variant, or one per op kind), and the kernel must
    be of it."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, DTYPE_NAMES[a.dtype])
    config = problem.config.with_isa(isa) if isa else problem.config
    plan = None if plan is None else taken(config, plan, optional)
    kernel = kernels.get_kernel(config, plan)
    assert plan is None or kernel.plan == plan
    assert_variant(case, kernel, plan, variant)
    first, second = (b, a) if problem.swap_inputs else (a, b)
    dims = kernels.dims_of(problem, threads)

    def run(workspace):
        out = np.empty(problem.output_shape, dtype=a.dtype)
        kernels.call(kernel, problem, dims, first, second, out, workspace)
        assert_exact(case, out)

    return kernel.workspace_size(dims), run


def assert_variant(case, kernel, plan, variant) -> None:
    """A kernel of a forced plan is of the `variant` (a Variant, or a mapping from op
    kinds to one) the test names."""
    if plan is None and variant is None:
        return
    assert variant is not None, "a test that forces a plan names the variant it runs"
    expected = variant[case.op] if isinstance(variant, Mapping) else variant
    assert kernel.variant is expected, (kernel.variant, expected)


def run_with_plan(case, plan, isa, threads, *, optional=(), variant):
    """Runs `case` with a forced plan on one ISA path and checks the result's bits and
    the kernel's variant (`optional`, `variant`: as forced_kernel)."""
    size, run = forced_kernel(case, plan, isa, threads, optional=optional, variant=variant)
    run(np.empty(size, dtype=np.uint8))


def test_dot_products_are_a_tuning_candidate_only():
    """The planner (pure: no CPU needed) never picks the pixel-dot plan by its rules; it is
    a candidate wherever stride 1 along w lets it run (any kernel, stride along h, any
    path), never for other dtypes or NXC."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_weights import dot_tiles

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


@pytest.mark.parametrize("op,data_format", [("ConvolutionBackwardWeights", "NCX"),
                                            ("ConvolutionBackwardWeights", "NXC"),
                                            ("ConvolutionBackwardData", "NCX"),
                                            ("ConvTransposeBackwardData", "NXC")])
def test_kernels_align_a_workspace_at_any_address(op, data_format):
    """A caller's workspace of exactly workspace_size bytes may start at any address: the
    kernel aligns its parts inside it (no vector straddles cache lines) and writes
    nothing past its end."""
    case = make_case(op, spatial=(10, 12), kernel=(1, 1) if op.endswith("Weights") else (3, 3),
                     in_channels=40, out_channels=24, data_format=data_format, seed=13,
                     attrs={} if op.endswith("Weights") else dict(pads_begin=1, pads_end=1))
    size, run = forced_kernel(case, threads=2)
    for offset in (0, 4, 24, 36, 63):
        block = np.full(size + offset + 64, 0xA5, dtype=np.uint8)
        run(block[offset:offset + size])
        assert (block[offset + size:] == 0xA5).all() and (block[:offset] == 0xA5).all()


IMAGE_BLOCK_GEOMETRY = {
    # 3x3 with pads on rows narrow enough to be padded (the padded copy per block)
    "3x3 padded": dict(spatial=(30, 13), kernel=(3, 3), in_channels=5, out_channels=7,
                       attrs=dict(pads_begin=1, pads_end=1)),
    # strides and dilation: phases of the data gradient; rows too wide to pad
    "strided": dict(spatial=(27, 40), kernel=(3, 2), in_channels=3, out_channels=6,
                    attrs=dict(strides=[2, 3], dilations=[2, 1], pads_begin=[1, 0],
                               pads_end=[2, 1])),
    # strided 1x1 (ResNet's projection shortcuts), 1-D and 3-D
    "1x1 strided": dict(spatial=(24, 22), kernel=(1, 1), in_channels=9, out_channels=20,
                        attrs=dict(strides=[2, 2])),
    "1d": dict(spatial=(700,), kernel=(5,), in_channels=6, out_channels=4,
               attrs=dict(pads_begin=[2], pads_end=[2])),
    "3d": dict(spatial=(6, 11, 12), kernel=(3, 1, 3), in_channels=4, out_channels=5,
               attrs=dict(pads_begin=[1, 0, 1], pads_end=[1, 0, 1])),
}


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
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_data import col2im_eligible

    case = make_case(op, **IMAGE_BLOCK_GEOMETRY[geometry], batch=5, data_format="NCX",
                     dtype=dtype, seed=17)
    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, dtype)
    config = problem.config.with_isa(isa)
    direct = {"col2im": 0} if col2im_eligible(config) else {}
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
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_data import band_bytes, col2im_eligible

    case = make_case(op, **IMAGE_BLOCK_GEOMETRY[geometry], batch=5, data_format="NCX",
                     dtype=dtype, seed=19)
    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, dtype)
    config = problem.config.with_isa(isa)
    direct = {"col2im": 0} if col2im_eligible(config) else {}
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


BF16_PAIR_GEOMETRY = {
    # rows of 45 pixels (19-21 pairs inside), pads and a dilation move the pairs' first
    # pixel by kw; 37 and 35 channels: two blocks of 16 and a tail
    "3x3": dict(spatial=(3, 45), kernel=(3, 3), in_channels=37, out_channels=35,
                attrs=dict(dilations=[1, 2], pads_begin=[1, 1], pads_end=[1, 2])),
    # two groups of 24 input channels, an odd width (a last pixel without partner)
    "1x1 groups": dict(spatial=(2, 71), kernel=(1, 1), in_channels=48, out_channels=40,
                       groups=2),
    "1d": dict(spatial=(100,), kernel=(5,), in_channels=16, out_channels=17,
               attrs=dict(pads_begin=[2], pads_end=[3])),
    # even widths: diff_dst rows go VL at a time as one row (19 rows of 14 pixels: a run
    # of 16 and one of 3; 5 rows of 6: one run shorter than a transpose; 3-D: runs over
    # depth and height), with output channel tails
    "1x1 even rows": dict(spatial=(19, 14), kernel=(1, 1), in_channels=20, out_channels=35),
    "3x3 even rows": dict(spatial=(5, 6), kernel=(3, 3), in_channels=18, out_channels=20,
                          attrs=dict(pads_begin=1, pads_end=1)),
    "3d even rows": dict(spatial=(3, 7, 8), kernel=(2, 1, 3), in_channels=8, out_channels=33,
                         groups=1, attrs=dict(pads_begin=[1, 0, 1], pads_end=[0, 0, 1])),
}


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


BF16_CHANNEL_PAIR_GEOMETRY = {
    # 63 pixels: one block of 32 and a tail of 31; 40 reduced channels: two vectors of 16
    # and a tail of 8 (the 1x1 layers of ResNet-50 in miniature)
    "1x1": dict(spatial=(7, 9), kernel=(1, 1), in_channels=24, out_channels=40),
    # exactly two blocks of 32 pixels and two vectors of channels: no tails
    "1x1 whole blocks": dict(spatial=(8, 8), kernel=(1, 1), in_channels=16, out_channels=32),
    # two groups of 18 reduced channels each: the pairs are still the channels-last input
    "3x3 groups": dict(spatial=(5, 13), kernel=(3, 3), in_channels=20, out_channels=36,
                       groups=2, attrs=dict(pads_begin=1, pads_end=[0, 2])),
    # 5 reduced channels per group: a zero partner ends each group, so value by value
    "odd groups": dict(spatial=(6, 11), kernel=(1, 3), in_channels=9, out_channels=15,
                       groups=3, attrs=dict(pads_begin=[0, 1], pads_end=[0, 1])),
}


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
    other choice is a candidate either way."""
    from convgrad.codegen.plan import candidates
    from convgrad.codegen.rules_data import (
        BAND_BYTES,
        BAND_MAX_WEIGHT_BYTES,
        IMAGE_BLOCK_BYTES,
        band_bytes,
        image_block_bytes,
    )

    def config(kernel=(3, 3), strides=(1, 1), channels=64, fmt="NCX", dtype="f32",
               isa="avx2", family="bwd_data"):
        rank = len(kernel)
        return KernelConfig(family, kernel, strides, (1,) * rank, 1, channels, channels, fmt,
                            "OIX", dtype, isa)

    for banded in (config(), config(family="fwd"), config(kernel=(5,), strides=(1,)),
                   config(kernel=(1, 1), strides=(2, 2)), config(dtype="f16", isa="avx512"),
                   config(channels=256)):
        assert band_bytes(banded) == BAND_BYTES and image_block_bytes(banded) == 0
        assert band_bytes(banded, {"band_kb": 16}) == 16 << 10
        assert {"band_kb": 0} in candidates(banded)
    assert 9 * 256 * 256 * 4 <= BAND_MAX_WEIGHT_BYTES < 9 * 512 * 512 * 4
    heavy = config(channels=512)
    assert band_bytes(heavy) == 0 and image_block_bytes(heavy) == IMAGE_BLOCK_BYTES
    assert band_bytes(heavy, {"band_kb": 256}) and {"band_kb": BAND_BYTES >> 10} in candidates(
        heavy)
    for never in (config(kernel=(3, 3, 3), strides=(1, 1, 1)), config(kernel=(1, 1)),
                  config(dtype="bf16", isa="avx512bf16"), config(fmt="NXC"),
                  config(family="bwd_weights")):
        assert band_bytes(never) == band_bytes(never, {"band_kb": 16}) == 0
        assert all("band_kb" not in plan for plan in candidates(never))

PACKED_WEIGHT_GEOMETRY = {
    # taps, stride, dilation, groups, pads; about 2 chunks per image
    "3x3": dict(spatial=(14, 11), kernel=(3, 3), in_channels=124, out_channels=124, groups=2,
                batch=2, attrs=dict(strides=[2, 1], dilations=[1, 2], pads_begin=[1, 2],
                                    pads_end=[0, 1])),
    # rows two apart in h: each output row's src rows packed once, two slots apart;
    # chunks of 14 rows over planes of 13
    "3x3 dilated rows": dict(spatial=(17, 9), kernel=(3, 3), in_channels=20, out_channels=24,
                             batch=2, attrs=dict(dilations=[2, 1], pads_begin=[1, 1],
                                                 pads_end=[1, 0])),
    # 1-wide kernel with strides: panels hold only the columns outputs read; pads
    "1x1 strided": dict(spatial=(9, 11), kernel=(1, 1), in_channels=260, out_channels=300,
                        batch=2, attrs=dict(strides=[2, 3], pads_begin=[1, 1],
                                            pads_end=[0, 1])),
    # 1x1 stride 1: channels-last pixels regrouped into long rows, runs that merge
    "pointwise": dict(spatial=(15, 21), kernel=(1, 1), in_channels=260, out_channels=270,
                      batch=2),
    "1d": dict(spatial=(150,), kernel=(3,), in_channels=100, out_channels=98, batch=2,
               attrs=dict(strides=[2], pads_begin=[2], pads_end=[0])),
    "3d": dict(spatial=(5, 6, 7), kernel=(3, 3, 3), in_channels=64, out_channels=48, batch=1,
               attrs=dict(pads_begin=1, pads_end=1)),
    # 16 input channels per group: tiles of near-equal height (8 + 8 on avx512, 4 x 4 on
    # avx2) over 2 output vectors
    "3d grouped": dict(spatial=(4, 5, 6), kernel=(3, 3, 3), in_channels=32, out_channels=64,
                       groups=2, batch=1, attrs=dict(pads_begin=1, pads_end=[0, 1, 1])),
}


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


SLICED_WEIGHT_GEOMETRY = {
    # 1x1: read in place (channels-last f32 on avx512) or from packed panels
    "1x1": dict(spatial=(32, 33), kernel=(1, 1), in_channels=150, out_channels=40, batch=4),
    # 3x3 with groups, pads, stride in h: packed panels, rows cut into slices
    "3x3": dict(spatial=(132, 32), kernel=(3, 3), in_channels=24, out_channels=34, groups=2,
                batch=2, attrs=dict(strides=[2, 1], pads_begin=1, pads_end=[0, 1])),
}


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
            out = _placed(np.zeros(problem.output_shape, np.float32), offset)
            workspace = kernels.empty_output((kernel.workspace_size(dims),), np.uint8)
            workspace[:] = 0xA5
            kernels.call(kernel, problem, dims, first, second, out, workspace)
            assert_exact(case, out)
            assert (workspace[:64] == 0xA5).all() == in_output, (offset, threads)


def test_results_start_on_64_byte_boundaries():
    """The arrays execute() allocates for results of more than 4 KB start on a 64-byte
    boundary (as PyTorch's do), whatever numpy would give; smaller ones are numpy's own."""
    for op, spatial in (("ConvolutionBackwardWeights", (40, 50)),
                        ("ConvolutionBackwardData", (33, 17)), ("ConvolutionBackwardData", (1, 1))):
        case = make_case(op, spatial=spatial, kernel=(1, 1), in_channels=64, out_channels=32)
        result = run_case(case)
        assert result.flags.c_contiguous
        assert result.nbytes <= 4096 or result.ctypes.data % 64 == 0
        assert_exact(case, result)


GROUP_LANES_GEOMETRY = {
    # 2 in x 2 out per group, a partial vector, stride, dilation, asymmetric pads
    "2x2 strided": dict(spatial=(13, 11), kernel=(3, 3), in_channels=6, out_channels=6,
                        groups=3, batch=2, attrs=dict(strides=[2, 1], dilations=[1, 2],
                                                      pads_begin=[1, 2], pads_end=[0, 1])),
    # 4 x 4 over 3 vectors (avx2): several vector blocks; rows narrower than the kernel
    "4x4 3d": dict(spatial=(4, 5, 3), kernel=(3, 3, 3), in_channels=24, out_channels=24,
                   groups=6, batch=2, attrs=dict(pads_begin=1, pads_end=[0, 1, 1])),
    # groups that straddle vectors: 3 in, 2 out; outputs in blocks with a last block
    "3x2 1d": dict(spatial=(40,), kernel=(5,), in_channels=27, out_channels=18, groups=9,
                   batch=3, attrs=dict(strides=[3], pads_begin=[2], pads_end=[1])),
    # 1x1, 2 in x 4 out (ResNeXt-style bottleneck widths, fewer)
    "2x4 1x1": dict(spatial=(9, 7), kernel=(1, 1), in_channels=10, out_channels=20, groups=5,
                    batch=2),
    # 6 outputs per group: two output blocks on avx2
    "1x6": dict(spatial=(6, 9), kernel=(3, 3), in_channels=4, out_channels=24, groups=4,
                batch=2, attrs=dict(pads_begin=1, pads_end=1)),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op,geometry,data_format,dtype", [  # two layout/dtype pairs each
    (op, geometry, *formats) for i, (op, geometry) in enumerate(
        [(op, g) for g in sorted(GROUP_LANES_GEOMETRY)
         for op in ("ConvolutionBackwardWeights", "ConvolutionBackwardData")]
        + [("ConvTransposeBackwardWeights", "2x2 strided"),
           ("ConvTransposeBackwardData", "2x2 strided"), ("ConvTransposeBackwardData", "3x2 1d")])
    for formats in rotating([("NXC", "f32"), ("NXC", "bf16"), ("NCX", "f16")], i, 2)])
def test_grouped_layers_across_groups(isa, op, geometry, data_format, dtype, monkeypatch):
    """Grouped layers vectorised across the groups (weight gradients with diff_dst, data
    gradients with their input spread to the lanes, whole or row by row), forced on every
    ISA path where the rules would not take it: exact, and the same bits on 1, 2 and 3
    threads."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_groups import data_across_groups, weights_across_groups

    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, **GROUP_LANES_GEOMETRY[geometry], data_format=data_format,
                     dtype=dtype, seed=5)
    config = resolve(op, [x.shape for x in case.inputs[:2]], case.attrs, None,
                     dtype).config.with_isa(isa)
    plan = {"group_lanes": 1}
    taken = (weights_across_groups(config, plan)["group_lanes"] if config.family == "bwd_weights"
             else data_across_groups(config, plan))
    if isa == "avx512bf16" and dtype == "bf16":  # bf16 pairs: the other plans' own copy
        assert not taken
        return
    assert taken
    variant = (Variant.GROUPED_WEIGHTS if config.family == "bwd_weights"
               else Variant.ACROSS_GROUPS)
    for threads in (1, 2, 3):
        run_with_plan(case, plan, isa, threads, variant=variant)
    if config.family != "bwd_weights":  # the input spread row by row, not whole
        for threads in (1, 2, 3):
            run_with_plan(case, {**plan, "spread_whole_mb": 0}, isa, threads,
                          variant=variant)


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


@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_reduced_channels_in_several_chunks(op, data_format, dtype):
    """300 reduced channels over 7 taps take several passes over the image (the weight
    chunk of one pass stays in L2), and stride 2 over a 1-row kernel leaves output rows
    no tap reaches: the last pass must still write (and round) them."""
    case = make_case(op, spatial=(3, 5), kernel=(1, 7), in_channels=64, out_channels=300,
                     batch=1, data_format=data_format, dtype=dtype,
                     attrs=dict(strides=[2, 1], pads_begin=[0, 3], pads_end=[0, 3]))
    run_case(case)


@pytest.mark.parametrize("op", ["ConvolutionBackwardWeights", "ConvTransposeBackwardWeights"])
@pytest.mark.parametrize("in_channels", [2, 40])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_weight_gradient_with_rows_no_tap_reads(op, in_channels, dtype):
    """Stride 3 over a 1-row kernel: two src rows in three are never read, so converted
    copies skip them (2 input channels: the w-padded copy, which reads every row)."""
    case = make_case(op, spatial=(8, 7), kernel=(1, 3), in_channels=in_channels,
                     out_channels=20, batch=2, dtype=dtype,
                     attrs=dict(strides=[3, 2], pads_begin=[0, 1], pads_end=[0, 1]))
    run_case(case)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
def test_nan_reaches_exactly_the_results_it_touches(op, dtype, data_format):
    """A NaN in each data input: NaN where the reference has one, exact values elsewhere
    (padding, pair partners and unused vector lanes must not spread it)."""
    case = make_case(op, spatial=(7, 6), kernel=(3, 2), in_channels=5, out_channels=18,
                     batch=2, data_format=data_format, dtype=dtype,
                     attrs=dict(strides=[2, 1], pads_begin=[1, 0], pads_end=[1, 1]))
    first = case.inputs[0]
    first[(0,) * first.ndim] = np.nan
    if case.inputs[1].ndim == first.ndim and case.inputs[1].shape[0] == first.shape[0]:
        second = case.inputs[1]  # weight gradients: a NaN in diff_dst too
        second[(1,) + (2,) * (second.ndim - 1)] = np.nan
    result = convgrad.execute(case.op, case.inputs, case.attrs)
    expected = case.expected(result.dtype)
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    assert_equal_with_nans(result, expected)


@pytest.mark.parametrize("op", ["ConvolutionBackwardWeights", "ConvTransposeBackwardWeights"])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
@pytest.mark.parametrize("in_channels,groups", [(16, 1), (2, 1), (4, 4)])
@pytest.mark.parametrize("column", [0, 2])
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_weight_gradient_of_inf_at_a_padded_border(op, dtype, data_format, in_channels, groups,
                                                   column):
    """Copies that are zero outside the image multiply the padding by diff_dst; an inf
    there (column 0) must not turn taps that only reach padding into NaN (0 x inf). Sums
    without a NaN skip the scan for it: an inf inside (column 2) gives the op's result."""
    case = make_case(op, spatial=(6, 6), kernel=(3, 3), in_channels=in_channels,
                     out_channels=16 if groups == 1 else 4, groups=groups, batch=1,
                     data_format=data_format, dtype=dtype,
                     attrs=dict(pads_begin=[1, 1], pads_end=[1, 1]))
    diff = case.inputs[1]  # diff_dst (the ConvTranspose op's own src) of the weight gradient
    diff[(0, 2, column, 0) if data_format == "NXC" else (0, 0, 2, column)] = np.inf
    result = convgrad.execute(case.op, case.inputs, case.attrs)
    expected = case.expected(result.dtype)
    assert np.isinf(expected).any()
    assert_equal_with_nans(result, expected)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_inputs_at_odd_addresses(op, dtype):
    """Data one element past an aligned address: the bf16 path reads channel pairs in
    place as 32-bit words (the sanitizer run checks those reads too)."""
    case = make_case(op, spatial=(5, 6), kernel=(3, 3), in_channels=16, out_channels=32,
                     dtype=dtype)
    for index, array in enumerate(case.inputs[:2]):
        buffer = np.empty(array.size + 1, array.dtype)
        case.inputs[index] = buffer[1:].reshape(array.shape)
        case.inputs[index][...] = array
    run_case(case)


@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
def test_bf16_denormal_result_is_kept(data_format):
    """1.5 x 2^-126 - 1.25 x 2^-126 over two multiply steps: the f32 sum is denormal and
    rounds to the bf16 denormal 2^-128 in either layout (vcvtneps2bf16 alone flushes it)."""
    tiny = 2.0 ** -126
    diff_dst = np.zeros((1, 5, 1, 4), np.float32)
    diff_dst[..., 0], diff_dst[..., 2] = 1.5 * tiny, -1.25 * tiny
    weights = np.zeros((1, 1, 16, 4), np.float32)  # XIO
    weights[..., 0] = weights[..., 2] = 1.0
    bf16 = DTYPES["bf16"]
    first = diff_dst.astype(bf16)
    if data_format == "NCX":
        first = np.ascontiguousarray(np.moveaxis(first, -1, 1))
    result = convgrad.execute("ConvolutionBackwardData",
                             [first, weights.astype(bf16), np.array([5, 1])],
                             dict(data_format=data_format, weights_format="XIO"))
    np.testing.assert_array_equal(result.astype(np.float32), np.float32(0.25 * tiny))


def _other_paths(dtype: str) -> list[str]:
    """ISA paths other than the one the full grid runs for `dtype` (an ISA that adds
    nothing for a dtype is its base path there: avx512bf16 for f32 is avx512)."""
    def path(isa: str) -> str:
        return KernelConfig("fwd", (1,), (1,), (1,), 1, 64, 64, "NXC", "OIX", dtype).with_isa(
            isa).isa
    return [isa for isa in ISAS[1:] if path(isa) == isa and path(isa) != path(ISAS[0])]


@pytest.mark.parametrize("op,rank,data_format,weights_format,dtype,isa",
                         [(*g, isa) for g in GRID if g[4] != "f16" and g[2] == "NXC"
                          for isa in _other_paths(g[4])])
def test_isa_grid(op, rank, data_format, weights_format, dtype, isa, monkeypatch):
    """The grid on the other ISA paths (the best path runs the full grid)."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, **GEOMETRY[rank], groups=2, in_channels=4, out_channels=6,
                     data_format=data_format, weights_format=weights_format, dtype=dtype)
    run_case(case)


def test_infer_shape_matches_results():
    for op in OP_KINDS:
        case = make_case(op, spatial=(6, 5), kernel=(3, 2), groups=2,
                         attrs=dict(strides=2, pads_begin=1))
        shapes = [case.inputs[0].shape, case.inputs[1].shape]
        if len(case.inputs) > 2:
            shapes.append(list(case.inputs[2]))
        assert convgrad.infer_shape(op, shapes, case.attrs) == case.expected(np.float32).shape


@st.composite
def random_cases(draw):
    op = draw(st.sampled_from(OP_KINDS))
    rank = draw(st.integers(1, 3))
    kernel = tuple(draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)))
    strides = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    dilations = draw(st.lists(st.integers(1, 2), min_size=rank, max_size=rank))
    groups = draw(st.sampled_from([1, 2, 3]))
    in_channels = groups * draw(st.integers(1, 3))
    out_channels = groups * draw(st.integers(1, 3))
    spatial = tuple(draw(st.lists(st.integers(4, 7), min_size=rank, max_size=rank)))
    auto_pad = draw(st.sampled_from(["none", "same_upper", "same_lower", "valid"]))
    pads = draw(st.lists(st.integers(0, 2), min_size=2 * rank, max_size=2 * rank))
    attrs = dict(strides=strides, dilations=dilations, auto_pad=auto_pad,
                 pads_begin=pads[:rank], pads_end=pads[rank:])
    return dict(op=op, spatial=spatial, kernel=kernel, groups=groups,
                in_channels=in_channels, out_channels=out_channels, attrs=attrs,
                data_format=draw(st.sampled_from(["NXC", "NCX"])),
                weights_format=draw(st.sampled_from(_weights_formats(op))),
                dtype=draw(st.sampled_from(list(DTYPES))),
                shape_mode=draw(st.sampled_from(["attribute", "input", "full"])),
                seed=draw(st.integers(0, 1000)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cases())
def test_random_configurations(params):
    try:
        case = make_case(**params)
        case.expected(np.float32)
    except ValueError:
        return  # the reference rejects this geometry (e.g. kernel larger than input)
    run_case(case)


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


def _problem(case):
    return api.resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs,
                       case.inputs[2] if len(case.inputs) > 2 else None,
                       DTYPE_NAMES[case.inputs[0].dtype])


SWAPPED = dict(spatial=(5, 7), kernel=(1, 1), in_channels=20, out_channels=37, batch=3,
               data_format="NCX")


def test_weight_gradients_swap_their_inputs_by_rule():
    """1x1 channels-first f32 weight gradients with stride 1, no pads and one group run
    the problem with src and diff_dst swapped (channels swapped, weights format flipped)
    where they have more output than input channels and small weights, or fewer and
    large weights; no others do."""
    for op, swap in (("ConvolutionBackwardWeights", False), ("ConvTransposeBackwardWeights", True)):
        channels = dict(in_channels=37, out_channels=20) if swap else {}
        problem = _problem(make_case(op, **{**SWAPPED, **channels},
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
        problem = _problem(make_case("ConvolutionBackwardWeights", **geometry))
        assert not problem.swap_inputs, change
        assert problem.config.cout_per_group * problem.config.groups == geometry["out_channels"]
    for cin, cout in ((1024, 256), (128, 512)):  # 1 MB, fewer outputs; 256 KB, more
        problem = _problem(make_case("ConvolutionBackwardWeights",
                                     **{**SWAPPED, "in_channels": cin, "out_channels": cout}))
        assert problem.swap_inputs and problem.config.cout_per_group == cin
    # channels last: fewer outputs, their last avx512 vector half empty, small weights
    for cin, cout, swap in ((144, 24, True), (240, 40, True), (40, 8, True), (480, 40, False),
                            (192, 32, False), (24, 40, False)):
        problem = _problem(make_case("ConvolutionBackwardWeights", **{
            **SWAPPED, "in_channels": cin, "out_channels": cout, "data_format": "NXC"}))
        assert problem.swap_inputs is swap, (cin, cout)


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
        assert _problem(case).swap_inputs is (op not in TRANSPOSE)
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
    assert _problem(case).swap_inputs is (op not in TRANSPOSE)
    run_case(case, num_threads=threads)
    for spatial, batch in (((5, 7), 3), ((40, 33), 2)):
        case = make_case(op, **{**SWAPPED, **channels, "spatial": spatial, "batch": batch},
                         weights_format=weights_format, seed=7)
        assert _problem(case).swap_inputs is (op not in TRANSPOSE)
        run_case(case, num_threads=threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op,weights_format", [("ConvolutionBackwardWeights", "OIX"),
                                               ("ConvTransposeBackwardWeights", "IOX"),
                                               ("ConvolutionBackwardData", "OIX"),
                                               ("ConvolutionBackpropData", "OIX")])
@pytest.mark.parametrize("data_format,dtype,kernel", [  # two of the kernels each, rotating
    (*formats, kernel)
    for i, formats in enumerate([("NXC", "f32"), ("NCX", "bf16"), ("NXC", "f16")])
    for kernel in rotating([(3, 2), (3, 3), (1, 1)], i, 2)])
def test_oix_weights_through_register_transposes(isa, op, weights_format, data_format, dtype,
                                                 kernel, monkeypatch):
    """OIX weights go in and out through VL x VL register transposes: weight gradients
    leave their sums in blocks of (i, tap) values x output channels, several blocks of
    output channels; data gradients pack blocks of vector channels x taps (more taps than
    an avx2 vector's lanes with 3x3). Tails of both on every ISA path."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, spatial=(6, 7), kernel=kernel, in_channels=37, out_channels=70,
                     data_format=data_format, weights_format=weights_format, dtype=dtype,
                     seed=3)
    run_case(case)


COL2IM_GEOMETRY = {
    # conv1 of an image network: 7x7 stride 2, pads; columns of 49 taps x 3 channels
    "conv1": dict(spatial=(9, 11), kernel=(7, 7), in_channels=3, out_channels=8, batch=2,
                  attrs=dict(strides=[2, 2], pads_begin=[3, 3], pads_end=[2, 3])),
    # dilation along w (a tap's channels one at a time), stride 3, rows no tap reaches;
    # more than PARTIAL_PRODUCTS reduced channels (two partial sums per column)
    "1d": dict(spatial=(7,), kernel=(5,), in_channels=2, out_channels=130, batch=3,
               attrs=dict(strides=[3], dilations=[2], pads_begin=[4], pads_end=[3])),
    # result channels over more than one vector (a partial last one) on 8 and 4 lanes
    "3x3": dict(spatial=(6, 5), kernel=(3, 3), in_channels=12, out_channels=9, batch=2,
                attrs=dict(pads_begin=[1, 1], pads_end=[1, 0])),
    # 3-D, one result channel, stride and dilation along d, one image over 2 threads
    "3d": dict(spatial=(3, 4, 5), kernel=(2, 3, 3), in_channels=1, out_channels=5, batch=1,
               attrs=dict(strides=[2, 1, 1], dilations=[2, 1, 1], pads_begin=[1, 1, 0],
                          pads_end=[0, 1, 2])),
}


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
