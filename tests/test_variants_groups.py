"""Grouped and depthwise kernels (depthwise.c.j2, depthwise_weights.c.j2,
grouped_weights.c.j2) forced onto a plan on each ISA path this CPU runs, exact against
the reference: depthwise weight gradients in row and channel blocks and with every tap
in registers, sliding tiles, results streamed past the caches, lanes across groups.
"""

from __future__ import annotations

import pytest
from cases import make_case, rotating
from checks import run_case
from forcing import ISAS, run_streamed, run_with_plan
from geometries import ALL_TAPS_GEOMETRY, GROUP_LANES_GEOMETRY, STREAM_GEOMETRY

from convgrad.codegen.plan import Variant


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
