"""The empirical tuner: candidate plans, their exactness, reuse of tuned plans without
timing, export and import, and AOT builds with tuned plans used without a compiler."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from cases import make_case

import convgrad
from convgrad import kernels, tuning
from convgrad.codegen import KernelConfig
from convgrad.codegen.ops import resolve
from convgrad.codegen.plan import PLAN_CHOICES, candidates, check_plan, kernel_name, render_context
from convgrad.codegen.render import render
from convgrad.codegen.rules_weights import CHUNK_PIXELS, weight_tiles

ROOT = Path(__file__).resolve().parent.parent
ISAS = convgrad.cpu.available_isas()
# The best path this CPU runs and the avx2 path (when it is another one).
PATHS = list(dict.fromkeys(i for i in (ISAS[0], "avx2") if i in ISAS))


def _config(family, kernel, cin, cout, data_format="NXC", groups=1, dtype="f32",
            isa="avx512"):
    rank = len(kernel)
    return KernelConfig(family, kernel, (1,) * rank, (1,) * rank, groups, cin, cout,
                        data_format, "XIO", dtype).with_isa(isa)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_candidates_render_different_kernels(isa):
    """The default (the rules' plan) first, then variations that each render other C
    under another kernel name; every plan is made of known choices."""
    configs = [_config("bwd_data", (3, 3), 64, 64, isa=isa),
               _config("bwd_data", (1, 1), 256, 64, "NCX", isa=isa),
               _config("fwd", (3, 3), 48, 80, isa=isa),
               _config("bwd_weights", (1, 1), 256, 64, isa=isa),
               _config("bwd_weights", (3, 3), 64, 64, "NCX", isa=isa),
               _config("bwd_data", (3, 3), 1, 1, groups=32, isa=isa)]
    for config in configs:
        plans = candidates(config)
        assert plans[0] == {} and 2 <= len(plans) <= 8, (config.name, plans)
        names = [kernel_name(config, p) for p in plans]
        assert names[0] == config.name and len(set(names)) == len(names)
        spellings = {json.dumps({k: v for k, v in render_context(config, "", p).items()
                                 if k not in ("name", "plan_items")}, default=str)
                     for p in plans}
        assert len(spellings) == len(plans)
        for plan in plans:
            assert check_plan(plan) == plan and set(plan) <= set(PLAN_CHOICES)
    # the default plan's source is the untuned kernel's, and names only its config
    assert render(configs[0], {}) == render(configs[0])
    assert "Plan (tuned" in render(configs[0], candidates(configs[0])[1])


def test_long_reductions_transpose_ncx_pointwise():
    """1x1 NCX data gradients reducing over more than 512 channels transpose by rule,
    and the tuner offers the in-place plan; up to 512 the rule reads in place (with
    strides too, through a compact copy)."""
    from convgrad.codegen.rules_ncx import pointwise_ncx_tiles

    for isa in ("avx512", "avx2"):
        long = _config("bwd_data", (1, 1), 256, 1024, "NCX", isa=isa)
        assert not pointwise_ncx_tiles(long)["pointwise_ncx"]
        assert {"ncx_in_place": 1} in candidates(long)
        assert pointwise_ncx_tiles(long, {"ncx_in_place": 1})["pointwise_ncx"]
        short = _config("bwd_data", (1, 1), 1024, 512, "NCX", isa=isa)
        assert pointwise_ncx_tiles(short)["pointwise_ncx"]
        assert {"ncx_in_place": 0} in candidates(short)
        # with strides: on a compact copy, of one image per thread as a candidate
        strided = replace(short, strides=(2, 2))
        assert pointwise_ncx_tiles(strided)["ncx_strided"]
        assert not pointwise_ncx_tiles(short)["ncx_strided"]
        assert {"ncx_in_place": 0} in candidates(strided)
        assert {"ncx_compact_kb": 0} in candidates(strided)
        assert {"ncx_compact_kb": 0} not in candidates(short)


def test_avx2_vector_blocks_stay_candidates():
    """Where the avx2 rules take another vector block (3 x 4 data tiles for 1x1 layers
    and up to WIDE_MAX_CHANNELS vectorised channels, 6 x 2 weight tiles for 1x1 layers),
    the usual 3-vector block is a candidate, and the wide data block one for the other
    layers."""
    from convgrad.codegen.rules_common import WIDE_MAX_CHANNELS
    from convgrad.codegen.rules_data import direct_tiles

    few = _config("bwd_data", (3, 3), WIDE_MAX_CHANNELS, 64, isa="avx2")
    many = _config("bwd_data", (3, 3), WIDE_MAX_CHANNELS + 8, 64, isa="avx2")
    assert few.vector_channels == WIDE_MAX_CHANNELS
    assert direct_tiles(few)["vec_block"] == 4 and direct_tiles(many)["vec_block"] == 3
    assert direct_tiles(few.with_isa("avx512"))["vec_block"] == 4  # its own maximum
    assert {"vec_block": 3} in candidates(few)
    assert {"vec_block": 4} in candidates(many)
    assert {"vec_block": 3} in candidates(_config("bwd_data", (1, 1), 256, 64, isa="avx2"))
    assert {"vec_block": 3} in candidates(_config("bwd_weights", (1, 1), 256, 128,
                                                  isa="avx2"))


def test_avx2_weight_blocks_leave_no_narrow_tail():
    """avx2 weight gradients take blocks of 2 vectors where blocks of 3 would leave a last
    block of one and blocks of 2 none (4, 10, 16 vectors), or a last block of two (8, 14)
    with input channels that fill 2-vector tiles' 6 rows, up to 16 vectors; else 3 (1x1
    layers: 2); 3 stays a candidate. Other paths keep their own rules."""
    def block(cout, kernel=(3, 3), isa="avx2", cin=64):
        return weight_tiles(_config("bwd_weights", kernel, cin, cout, isa=isa))["vec_block"]

    assert [block(c) for c in (32, 80, 128, 64, 112)] == [2, 2, 2, 2, 2]
    assert [block(c) for c in (24, 56, 40, 160, 256, 512)] == [3, 3, 3, 3, 3, 3]
    assert block(64, cin=6) == 2 and block(64, cin=5) == 3 and block(32, cin=3) == 2
    assert block(128, (1, 1)) == 2 and block(64, (1, 1)) == 2
    assert block(32, (3, 3, 3)) == 2 and block(32, (3,)) == 2
    assert block(32, isa="avx512") == 2 and block(128, isa="avx512") == 4
    assert {"vec_block": 3} in candidates(_config("bwd_weights", (3, 3), 64, 32, isa="avx2"))


def test_intel_keeps_avx2_data_tiles_of_3_vectors():
    """On Intel the avx2 data tiles the wide rule gives 4 vectors keep 3 (NARROW_VENDORS):
    that is the rules' plan there and the first candidate, with the vendor-free rules
    a candidate too; other vendors, paths, ops and layers keep the rules."""
    from convgrad.codegen.plan import vendor_plan
    from convgrad.codegen.rules_common import WIDE_MAX_CHANNELS
    from convgrad.codegen.rules_data import direct_tiles

    wide = _config("bwd_data", (3, 3), 64, 64, isa="avx2")
    intel = vendor_plan(wide, "GenuineIntel")
    assert intel == {"vec_block": 3} and direct_tiles(wide, intel)["vec_block"] == 3
    assert direct_tiles(wide)["vec_block"] == 4
    assert candidates(wide, "GenuineIntel")[:2] == [intel, {}]
    assert candidates(wide, "AuthenticAMD")[0] == {} and intel in candidates(wide)
    assert vendor_plan(_config("bwd_data", (1, 1), 512, 256, isa="avx2"), "GenuineIntel")
    for other, vendor in [(wide, "AuthenticAMD"), (wide, ""),
                          (wide.with_isa("avx512"), "GenuineIntel"),
                          (_config("bwd_weights", (3, 3), 64, 64, isa="avx2"), "GenuineIntel"),
                          (_config("bwd_data", (3, 3), WIDE_MAX_CHANNELS + 8, 64, isa="avx2"),
                           "GenuineIntel"),
                          (_config("bwd_data", (3, 3), 1, 1, groups=32, isa="avx2"),
                           "GenuineIntel")]:
        assert vendor_plan(other, vendor) == {}, (other.name, vendor)


def test_ncx_weights_read_in_place_while_sums_stay_in_l2_but_on_intel_avx2():
    """avx2 NCX weight gradients with at most as many outputs as inputs read src in place
    while their sums fit SUMS_IN_L2_BYTES, then pack; on Intel the rules' plan packs from
    INTEL_NCX_IN_PLACE_MAX_SUMS on (PACKED_NCX_VENDORS), and reading in place stays a
    candidate. avx512 and NXC layers, and more outputs than inputs, keep their rules."""
    from convgrad.codegen.plan import vendor_plan
    from convgrad.codegen.rules_weights import SUMS_IN_L2_BYTES
    from convgrad.codegen.vendors import INTEL_NCX_IN_PLACE_MAX_SUMS

    def ncx(kernel, cin, cout, isa="avx2"):
        return _config("bwd_weights", kernel, cin, cout, data_format="NCX", isa=isa)

    small, mid = ncx((1, 1), 256, 64), ncx((1, 1), 512, 128)  # 64 KB, 256 KB of sums
    largest, large = ncx((3, 3), 128, 128), ncx((1, 1), 1024, 256)  # 576 KB, 1 MB
    assert 4 * 128 * 128 * 9 <= SUMS_IN_L2_BYTES < 4 * 1024 * 256
    for config in (small, mid, largest):
        assert not weight_tiles(config)["packed"] and weight_tiles(config)["src_in_place"]
    assert weight_tiles(large)["packed"]
    assert vendor_plan(small, "GenuineIntel") == {}
    assert INTEL_NCX_IN_PLACE_MAX_SUMS[8] >= 4 * 256 * 64
    for config in (mid, largest):
        intel = vendor_plan(config, "GenuineIntel")
        assert intel == {"packed": 1} and weight_tiles(config, intel)["packed"]
        assert candidates(config, "GenuineIntel")[0] == intel and {} in candidates(
            config, "GenuineIntel")
        assert vendor_plan(config, "AuthenticAMD") == {} and {"packed": 1} in candidates(config)
    for other in (large, mid.with_isa("avx512"), ncx((1, 1), 128, 512),
                  _config("bwd_weights", (1, 1), 512, 256, isa="avx2")):
        assert vendor_plan(other, "GenuineIntel") == {}, other.name


def test_ncx_weights_of_several_taps_read_in_place_to_4_mb_on_avx512():
    """avx512 NCX f32 weight gradients of more than one tap read src in place up to
    NCX_IN_PLACE_MAX_TAPS_SUMS of sums (1x1 ones up to NCX_IN_PLACE_MAX_SUMS); Intel's
    vendor plan packs beyond its 1 MB, and AMD's keeps the rule."""
    from convgrad.codegen.plan import vendor_plan

    def ncx(kernel, cin, cout):
        return _config("bwd_weights", kernel, cin, cout, data_format="NCX", isa="avx512")

    wide = ncx((3, 3), 256, 256)  # 2.4 MB of sums
    assert not weight_tiles(wide)["packed"]
    assert weight_tiles(replace(wide, dtype="f16"))["packed"]  # f32 only: measured there
    assert vendor_plan(wide, "GenuineIntel") == {"packed": 1}
    assert vendor_plan(wide, "AuthenticAMD") == {}
    assert vendor_plan(ncx((3, 3), 128, 128), "GenuineIntel") == {}  # 576 KB
    for packed in (ncx((3, 3), 512, 512), ncx((1, 1), 1024, 512), ncx((3, 3), 256, 320)):
        assert weight_tiles(packed)["packed"], packed.name  # 9.4 MB, one tap, more outputs
        narrow = {"vec_block": 2} if packed.kernel == (1, 1) else {}  # wide 1x1 sums
        assert vendor_plan(packed, "GenuineIntel") == narrow, packed.name


def test_ncx_wide_pointwise_weights_take_narrow_blocks_on_intel_only():
    """1x1 stride-1 NCX weight gradients whose sums pass SUMS_IN_L2_BYTES keep the rule's
    vector block (4 on avx512) on AMD's cores, 2 in Intel's vendor plan; smaller sums,
    3x3 layers and avx2 (2 already) have no vendor rule there; 2 stays a candidate."""
    from convgrad.codegen.plan import candidates, vendor_plan

    def ncx(kernel, cin, cout, isa="avx512"):
        return _config("bwd_weights", kernel, cin, cout, data_format="NCX", isa=isa)

    for wide in (ncx((1, 1), 256, 1024), ncx((1, 1), 512, 2048)):  # 1 MB and 4 MB of sums
        assert weight_tiles(wide)["vec_block"] == 4
        assert vendor_plan(wide, "AuthenticAMD") == {}
        assert vendor_plan(wide, "GenuineIntel") == {"vec_block": 2}
        assert {"vec_block": 2} in candidates(wide, "AuthenticAMD")
    for other in (ncx((1, 1), 128, 512), ncx((3, 3), 256, 256), ncx((1, 1), 256, 1024, "avx2")):
        assert vendor_plan(other, "GenuineIntel").get("vec_block") is None, other.name


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_nxc_weights_read_in_place_but_on_intel_as_there(isa):
    """f32 channels-last weight gradients read in place by the rules: 1x1 layers of any
    stride up to IN_PLACE_MAX_COUT outputs, on avx512 any kernel's (Zen 4). On Intel the
    rules' plan packs where its own limits (1x1 stride 1, INTEL_IN_PLACE_CIN,
    INTEL_IN_PLACE_MAX_COUT) would, and reading in place stays a candidate there; layers
    tiled over (kw, channel) rows, which never pack, keep their plan."""
    from convgrad.codegen.plan import vendor_plan

    def nxc(cin, cout, stride=1):
        return replace(_config("bwd_weights", (1, 1), cin, cout, isa=isa),
                       strides=(stride, stride))

    # Intel's limits: inputs from 128 on avx2 (and outputs to 64), to 511 on avx512
    three = _config("bwd_weights", (3, 3), 64, 64, isa=isa)  # avx512: any kernel
    apart = ([nxc(64, 64), nxc(128, 128)] if isa == "avx2"
             else [nxc(512, 64), nxc(1024, 256), three])
    for config in (nxc(256, 128, 2), *apart):
        assert not weight_tiles(config)["packed"], config.name
        intel = vendor_plan(config, "GenuineIntel")
        assert intel == {"packed": 1} and weight_tiles(config, intel)["packed"], config.name
        assert candidates(config, "GenuineIntel")[0] == intel and {} in candidates(
            config, "GenuineIntel")
        assert vendor_plan(config, "AuthenticAMD") == {} and {"packed": 1} in candidates(config)
    # in place by both rules, or by neither and too few multiply-adds a value to pack
    for same_on_intel in (nxc(256, 64), nxc(3, 64, 2)):
        assert not weight_tiles(same_on_intel)["packed"]
        assert vendor_plan(same_on_intel, "GenuineIntel") == {}, same_on_intel.name
    for packed_by_both in (nxc(256, 1024), *([three] if isa == "avx2" else [])):
        assert weight_tiles(packed_by_both)["packed"]
        assert vendor_plan(packed_by_both, "GenuineIntel") == {}
    few_inputs = _config("bwd_weights", (7, 7), 3, 64, isa=isa)  # (kw, channel) rows: never
    depthwise = _config("bwd_weights", (3, 3), 1, 1, groups=64, isa=isa)  # its own template
    for other in (few_inputs, depthwise):
        assert vendor_plan(other, "GenuineIntel") == {}, other.name


def test_intel_widens_bf16():
    """On Intel, bf16 kernels on the avx512bf16 path widen to f32 (WIDEN_BF16_VENDORS):
    the rules' plan there, with the pairs (vdpbf16ps) the second candidate; elsewhere the
    pairs stay the rule and widening a candidate. Depthwise kernels always widen."""
    from convgrad.codegen.plan import vendor_plan
    from convgrad.codegen.rules_common import uses_bf16_dot

    for family in ("bwd_data", "bwd_weights"):
        pairs = _config(family, (3, 3), 64, 64, dtype="bf16", isa="avx512bf16")
        assert uses_bf16_dot(pairs) and not uses_bf16_dot(pairs, {"bf16_dot": 0})
        assert vendor_plan(pairs, "GenuineIntel") == {"bf16_dot": 0}
        assert candidates(pairs, "GenuineIntel")[:2] == [{"bf16_dot": 0}, {}]
        assert vendor_plan(pairs, "AuthenticAMD") == {} and {"bf16_dot": 0} in candidates(pairs)
        f32 = _config(family, (3, 3), 64, 64, isa="avx512bf16")
        for other in (pairs.with_isa("avx512"), f32,
                      _config(family, (3, 3), 1, 1, groups=32, dtype="bf16", isa="avx512bf16")):
            # f32 NXC weight gradients pack on Intel (PACKED_NXC_VENDORS), nothing else
            packs = other is f32 and family == "bwd_weights"
            assert vendor_plan(other, "GenuineIntel") == ({"packed": 1} if packs else {}), (
                other.name)


def test_kernels_built_for_a_cpu_without_amx_leave_it_out(fresh_cache):
    """A kernel compiled for this CPU alone (features given: lazy compilation) leaves the
    AMX path out where the CPU lacks AMX (plan amx 0), with the vendor's other rules;
    where the CPU has AMX, and for a build that may run elsewhere (no features: ahead
    of time), the rules keep it. The runtime's lazily compiled kernel follows this CPU."""
    from convgrad import kernels
    from convgrad.codegen.isa import AMX_FEATURES
    from convgrad.codegen.plan import vendor_plan
    from convgrad.codegen.rules_amx import amx_tiles

    carries = _config("bwd_weights", (3, 3), 64, 64, dtype="bf16", isa="avx512bf16")
    assert amx_tiles(carries)["amx"]
    zen4 = {"avx512f", "avx512_bf16"}
    assert vendor_plan(carries, "AuthenticAMD", zen4) == {"amx": 0}
    assert vendor_plan(carries, "GenuineIntel", zen4) == {"bf16_dot": 0, "amx": 0}
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        assert vendor_plan(carries, vendor, zen4 | AMX_FEATURES) == vendor_plan(carries, vendor)
        assert "amx" not in vendor_plan(carries, vendor)
    for other in (carries.with_isa("avx512"), _config("bwd_weights", (3, 3), 64, 48,
                                                      dtype="bf16", isa="avx512bf16")):
        assert not amx_tiles(other)["amx"] and vendor_plan(other, "AuthenticAMD", zen4) == {}
    # a lazy tuning's candidates are this CPU's too: each that would carry AMX leaves it
    # out, the first is the untuned kernel's plan; without features (AOT) they keep it
    for vendor in ("AuthenticAMD", "GenuineIntel"):
        lazy = candidates(carries, vendor, zen4)
        assert lazy[0] == vendor_plan(carries, vendor, zen4) and len(lazy) > 2
        assert not any(amx_tiles(carries, plan)["amx"] for plan in lazy)
        assert any(amx_tiles(carries, plan)["amx"] for plan in candidates(carries, vendor))
        assert candidates(carries, vendor, zen4 | AMX_FEATURES) == candidates(carries, vendor)
    if "avx512bf16" in ISAS:
        has_amx = convgrad.cpu.cpu_features() >= AMX_FEATURES
        assert kernels.get_kernel(carries).plan.get("amx", 1) == int(has_amx)


@pytest.mark.skipif("avx2" not in ISAS, reason="this CPU does not run the avx2 path")
@pytest.mark.parametrize("vendor, plan", [("GenuineIntel", {"vec_block": 3}),
                                          ("AuthenticAMD", {})])
def test_untuned_calls_and_aot_builds_take_the_vendors_rules(vendor, plan, tmp_path,
                                                             monkeypatch):
    """An untuned call runs the rules' plan for this CPU's vendor, exactly; an AOT build
    takes its target's vendor."""
    from convgrad import aot
    from convgrad.codegen.targets import target

    monkeypatch.setattr(kernels, "cpu_vendor", lambda: vendor)
    monkeypatch.setenv("CONVGRAD_AOT_PATH", "")
    monkeypatch.setenv("CONVGRAD_ISA", "avx2")
    kernels.reset()
    tuning.reset()
    try:
        case = make_case("ConvolutionBackwardData", spatial=(6, 7), kernel=(3, 3),
                         in_channels=32, out_channels=8, batch=2, seed=5,
                         attrs={"pads_begin": [1, 1], "pads_end": [1, 1]})
        a, b = case.inputs[:2]
        out = convgrad.execute(case.op, case.inputs, case.attrs, tune=False)
        np.testing.assert_array_equal(out.view(np.uint32), case.expected(a.dtype).view(np.uint32))
        problem = resolve("ConvolutionBackwardData", [a.shape, b.shape], case.attrs, None, "f32")
        assert kernels.get_kernel(problem.config.with_isa("avx2")).plan == plan
    finally:
        kernels.reset()
        tuning.reset()
    layers = aot.read_layers([], ops=("ConvolutionBackwardData",))[:4]
    name = "sapphirerapids" if vendor == "GenuineIntel" else "zen3"
    result = aot.build(layers, tmp_path / "k", isa="avx2", jobs=2, target=target(name))
    wide = [c for c in result.configs if c.vector_channels <= 128 or c.pointwise]
    assert wide and all(result.plans[c] == plan for c in wide)


def _workspace_bytes(op, plan, **params):
    case = make_case(op, **params)
    a, b = case.inputs[:2]
    problem = resolve(op, [a.shape, b.shape], case.attrs, None, "f32")
    kernel = kernels.get_kernel(problem.config.with_isa(PATHS[0]), plan)
    return kernel.workspace_size(kernels.dims_of(problem, 1))


def test_narrow_rows_pad_by_rule():
    """Data gradients pad narrow rows where each input value feeds at least
    PAD_MIN_FMAS multiply-adds, and (decided at run time) at most
    PAD_MAX_ZEROS_PERCENT of the padded row's multiply-adds are by zeros, and runs of
    each w tap cannot overlap instead: a plain 3x3 on 7 columns (10% zeros) copies the
    padded input into its workspace only with disjoint runs (its rule overlaps them), a
    dilation-3 3x3 on 11 columns (42% zeros, no tap reaching every column) does not even
    when its plan asks for padding."""
    from convgrad.codegen.rules_data import PAD_MIN_FMAS, pad_columns_below

    assert pad_columns_below(_config("bwd_data", (3, 3), 512, 512, isa="avx2")) > 0
    small = _config("bwd_data", (3, 3, 3), 16, 32, groups=16, isa="avx2")
    assert PAD_MIN_FMAS > 27 * 16 and pad_columns_below(small) == 0
    assert {"pad_columns": 1} in candidates(small)

    op = "ConvolutionBackwardData"
    plain = dict(spatial=(7, 7), kernel=(3, 3), in_channels=16, out_channels=8, batch=1,
                 attrs=dict(pads_begin=1, pads_end=1))
    padded, unpadded = (_workspace_bytes(op, {"pad_columns": p, "overlap_runs": 0}, **plain)
                        for p in (1, 0))
    assert padded > unpadded == _workspace_bytes(op, {"pad_columns": 1}, **plain)
    dilated = dict(plain, spatial=(7, 7), attrs=dict(pads_begin=1, pads_end=1,
                                                     dilations=[3, 3]))
    for overlap in (0, 1):
        padded, unpadded = (_workspace_bytes(op, {"pad_columns": p, "overlap_runs": overlap},
                                             **dilated) for p in (1, 0))
        assert padded == unpadded


def test_few_input_channels_take_tiles_of_two_vectors_where_rows_split_evenly():
    """Weight gradients with taps flattened into tile rows (conv1) take 2 output vectors
    per tile on 16-lane paths where the (kw, channel) rows split into near-equal tiles
    (7 x 3 = 21 rows: 12 + 9; 3 x 3 = 9: one tile), not where a short tile would be left
    (5 x 3 = 15 rows: 12 + 3), nor where a plan sets the block or on avx2."""

    def config(kernel, cout, isa="avx512"):
        return KernelConfig("bwd_weights", (kernel, kernel), (2, 2), (1, 1), 1, 3, cout,
                            "NXC", "XIO", "f32").with_isa(isa)

    for kernel, cout in ((7, 64), (7, 128), (7, 48), (3, 64)):
        tiles = weight_tiles(config(kernel, cout))
        assert tiles["flatten_w"] and tiles["vec_block"] == 2, (kernel, cout)
    assert weight_tiles(config(5, 48))["vec_block"] == 3
    assert weight_tiles(config(7, 64), {"vec_block": 4})["vec_block"] == 4
    assert weight_tiles(config(7, 64), {"vec_block": 4})["tiles"] == [(6, 4), (3, 4)]
    assert weight_tiles(config(7, 64, "avx2"))["vec_block"] == 3


def test_taps_flattened_into_tile_rows_only_for_few_channels():
    """(kw, channel) tile rows where a group has fewer than 8 input channels on avx512
    (6 on avx2) and the rows fit the registers; more channels take tiles of one tap's."""

    def flattened(channels, cout, isa):
        return weight_tiles(KernelConfig("bwd_weights", (3, 3, 3), (1, 1, 1), (1, 1, 1), 16,
                                         channels, cout, "NXC", "XIO", "f32", isa))["flatten_w"]

    assert flattened(7, 16, "avx512") and not flattened(8, 16, "avx512")
    assert flattened(5, 8, "avx2") and not flattened(6, 8, "avx2")
    assert not flattened(4, 64, "avx512")  # 8 rows of 4 vectors: more than the registers


def test_weight_gradients_fetch_their_next_chunk_by_rule():
    """f32 channels-last weight gradients in chunks of a few pixels fetch the next
    chunk's rows while their tiles run (read in place or packed), where the strides skip
    no src row; not strided 1x1 layers, NCX, f16, chunks of CHUNK_BYTES or a padded copy
    of src (conv1's 3 channels). The prefetches survive the compiler (GCC drops a call to
    a function that only prefetches)."""

    def config(kernel, cin, cout, strides=None, data_format="NXC", dtype="f32"):
        rank = len(kernel)
        return KernelConfig("bwd_weights", kernel, strides or (1,) * rank, (1,) * rank, 1,
                            cin, cout, data_format, "XIO", dtype).with_isa("avx512")

    fetching = [config((1, 1), 256, 64), config((3, 3), 64, 64), config((3, 3), 128, 128, (2, 2))]
    not_fetching = [config((1, 1), 256, 128, (2, 2)), config((1, 1), 256, 64, data_format="NCX"),
                    config((3, 3), 64, 64, dtype="f16"), config((1, 1), 1024, 256),
                    config((7, 7), 3, 64, (2, 2))]
    for each in fetching:
        assert weight_tiles(each)["prefetch_next_chunk"], each.name
        assert "prefetch_chunk(src, dd, next" in render(each), each.name
    for each in not_fetching:
        assert not weight_tiles(each)["prefetch_next_chunk"], each.name
        assert "prefetch_chunk(" not in render(each), each.name
    assert weight_tiles(config((1, 1), 1024, 256), {"chunk_pixels": 64})["prefetch_next_chunk"]
    objdump = shutil.which("objdump")
    x86 = [isa for isa in ISAS if isa in ("avx512", "avx2")]
    if objdump and x86:
        for each, fetches in ((fetching[0], True), (fetching[1], True), (not_fetching[0], False)):
            path = kernels.get_kernel(each.with_isa(x86[0])).path
            code = subprocess.run([objdump, "-d", str(path)],
                                  capture_output=True, text=True, check=True).stdout
            assert ("prefetcht1" in code) == fetches, each.name


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_packed_ncx_weights_fetch_rows_ahead_by_rule(isa):
    """Packed NCX weight gradients whose strides skip no src row pack diff_dst a vector
    block at a time and fetch the rows ahead (prefetch_panels), with the other way a
    candidate; not strided 1x1 layers, packed NXC ones, nor those read in place. The
    prefetches survive the compiler."""
    def config(kernel, cin, cout, strides=None, data_format="NCX", dtype="f32"):
        rank = len(kernel)
        return KernelConfig("bwd_weights", kernel, strides or (1,) * rank, (1,) * rank, 1,
                            cin, cout, data_format, "OIX", dtype).with_isa(isa)

    fetching = [config((1, 1), 512, 2048), config((1, 1), 512, 2048, dtype="f16"),
                config((3, 3), 512, 512, (2, 2))]
    not_fetching = [config((1, 1), 512, 2048, (2, 2)), config((1, 1), 512, 2048, data_format="NXC"),
                    config((1, 1), 256, 64)]
    for each in fetching:
        assert weight_tiles(each)["packed"] and weight_tiles(each)["prefetch_panels"], each.name
        assert {"prefetch_panels": 0} in candidates(each), each.name
        assert "prefetch_dd_block(dd, z" in render(each), each.name
        assert not weight_tiles(each, {"prefetch_panels": 0})["prefetch_panels"]
    for each in not_fetching:
        assert not weight_tiles(each)["prefetch_panels"], each.name
        assert all("prefetch_panels" not in plan for plan in candidates(each)), each.name
        assert "prefetch_dd_block(" not in render(each), each.name
    objdump = shutil.which("objdump")
    if objdump and isa in ISAS:  # more prefetches than the tiles' own of their sums
        def prefetches(plan):
            path = kernels.get_kernel(fetching[0], plan).path
            return subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True,
                                  check=True).stdout.count("prefetcht0")
        assert prefetches({}) > prefetches({"prefetch_panels": 0})


def test_weight_chunks_by_pixels_and_by_bytes_are_candidates():
    """Where the weight sums exceed L2, the tuner times the other kind of chunks than the
    rules': by bytes where packed overlapping rows take pixels, else by pixels."""
    def config(kernel, isa):
        return _config("bwd_weights", kernel, 512, 512, isa=isa)

    assert weight_tiles(config((3, 3), "avx2"))["chunk_pixels"] > 0
    assert {"chunk_pixels": 0} in candidates(config((3, 3), "avx2"))
    for rules_by_bytes in (config((3, 3), "avx512"), config((1, 1), "avx2")):
        assert weight_tiles(rules_by_bytes)["chunk_pixels"] == 0
        assert {"chunk_pixels": CHUNK_PIXELS} in candidates(rules_by_bytes)
    small = _config("bwd_weights", (3, 3), 64, 64, isa="avx2")  # sums in L2: pixels only
    assert all(plan.get("chunk_pixels", 1) for plan in candidates(small))


def test_plans_are_checked():
    with pytest.raises(ValueError, match="unknown plan choices"):
        check_plan({"tile_width": 3})
    with pytest.raises(ValueError, match="vec_block"):
        check_plan({"vec_block": 0})
    with pytest.raises(ValueError, match=r"step_unroll = 0 is invalid"):
        check_plan({"step_unroll": 0})  # 1 is the rolled loop
    assert check_plan({"ncx_pass_kb": 0}) == {"ncx_pass_kb": 0}  # 0: one pass
    assert check_plan({"packed": True}) == {"packed": 1}


# One problem per kernel family and plan kind: variations of blocks, chunks, padded
# columns, NCX in place, loop orders, packed panels and slices, sliding tiles.
EXACT_CASES = {
    "data 3x3 strided": dict(op="ConvolutionBackwardData", spatial=(6, 11), kernel=(3, 3),
                             in_channels=70, out_channels=40, batch=2,
                             attrs=dict(strides=[2, 1], pads_begin=1, pads_end=1)),
    "data 1x1 NCX": dict(op="ConvolutionBackwardData", spatial=(12, 13), kernel=(1, 1),
                         in_channels=70, out_channels=37, batch=2, data_format="NCX"),
    # one tap by rows: each row's vector blocks together, or each over every row
    "data 1x1 strided": dict(op="ConvolutionBackwardData", spatial=(7, 9), kernel=(1, 1),
                             in_channels=70, out_channels=40, batch=2,
                             attrs=dict(strides=2, pads_begin=[0, 1], pads_end=[1, 0])),
    "fwd 1x1 strided NCX": dict(op="ConvTransposeBackwardData", spatial=(13, 9),
                                kernel=(1, 1), in_channels=40, out_channels=70, batch=2,
                                data_format="NCX", attrs=dict(strides=[2, 1])),
    "fwd 3x3": dict(op="ConvTransposeBackwardData", spatial=(9, 8), kernel=(3, 3),
                    in_channels=40, out_channels=50, batch=2,
                    attrs=dict(pads_begin=1, pads_end=1)),
    "weights 1x1": dict(op="ConvolutionBackwardWeights", spatial=(32, 33), kernel=(1, 1),
                        in_channels=150, out_channels=40, batch=4),
    # several chunks and slices of the next-chunk prefetch, rows clamped at pads
    "weights 1x1 padded": dict(op="ConvolutionBackwardWeights", spatial=(23, 9), kernel=(1, 1),
                               in_channels=64, out_channels=24, batch=3,
                               attrs=dict(pads_begin=[1, 0], pads_end=[2, 1])),
    # few input channels: (kw, channel) tile rows, 2 vectors by rule on avx512
    "weights conv1-like": dict(op="ConvolutionBackwardWeights", spatial=(15, 21), kernel=(3, 7),
                               in_channels=3, out_channels=40, batch=2,
                               attrs=dict(strides=2, pads_begin=[1, 3], pads_end=[1, 2])),
    "weights 3x3 dilated": dict(op="ConvolutionBackwardWeights", spatial=(17, 12),
                                kernel=(3, 3), in_channels=20, out_channels=24, batch=3,
                                attrs=dict(dilations=[2, 1], pads_begin=1, pads_end=[0, 2])),
    # avx2: blocks of 2 vectors where 3 would leave a one-vector block (32 outputs)
    "weights 3x3 32 outputs": dict(op="ConvolutionBackwardWeights", spatial=(11, 9),
                                   kernel=(3, 3), in_channels=20, out_channels=32, batch=2,
                                   attrs=dict(strides=[1, 2], pads_begin=1, pads_end=1)),
    # sums beyond L2: chunks by pixels (avx2's rule for rows that overlap) or by bytes
    "weights 3x3 wide sums": dict(op="ConvolutionBackwardWeights", spatial=(10, 7),
                                  kernel=(3, 3), in_channels=150, out_channels=160, batch=2,
                                  attrs=dict(pads_begin=1, pads_end=1)),
    "weights 1x1 NCX": dict(op="ConvolutionBackwardWeights", spatial=(20, 26), kernel=(1, 1),
                            in_channels=64, out_channels=40, batch=2, data_format="NCX"),
    "weights 3x3 NCX f16": dict(op="ConvolutionBackwardWeights", spatial=(14, 11),
                                kernel=(3, 3), in_channels=40, out_channels=34, groups=2,
                                batch=2, data_format="NCX", dtype="f16",
                                attrs=dict(pads_begin=1, pads_end=0)),
    "weights across groups": dict(op="ConvolutionBackwardWeights", spatial=(9, 14),
                                  kernel=(3, 3), in_channels=20, out_channels=20, groups=5,
                                  batch=2, attrs=dict(strides=[1, 2], pads_begin=1,
                                                      pads_end=[0, 1])),
    "data across groups": dict(op="ConvolutionBackwardData", spatial=(9, 14), kernel=(3, 3),
                               in_channels=12, out_channels=18, groups=6, batch=2,
                               attrs=dict(strides=[2, 1], pads_begin=1, pads_end=[0, 1])),
    "depthwise weights": dict(op="ConvolutionBackwardWeights", spatial=(5, 30), kernel=(3, 3),
                              in_channels=40, out_channels=40, groups=40, batch=2,
                              attrs=dict(dilations=[1, 2], pads_begin=1, pads_end=[1, 2])),
    "depthwise data": dict(op="ConvolutionBackwardData", spatial=(5, 30), kernel=(3, 3),
                           in_channels=24, out_channels=24, groups=24, batch=2,
                           attrs=dict(pads_begin=1, pads_end=1)),
    # bf16: pairs (vdpbf16ps) or widened to f32 (bf16_dot 0, Intel's rule), each with
    # its variations
    "data 3x3 bf16": dict(op="ConvolutionBackwardData", spatial=(6, 11), kernel=(3, 3),
                          in_channels=40, out_channels=37, batch=2, dtype="bf16",
                          attrs=dict(strides=[1, 2], pads_begin=1, pads_end=1)),
    "fwd 1x1 NCX bf16": dict(op="ConvTransposeBackwardData", spatial=(12, 13), kernel=(1, 1),
                             in_channels=40, out_channels=37, batch=2, data_format="NCX",
                             dtype="bf16"),
    "weights 3x3 NCX bf16": dict(op="ConvolutionBackwardWeights", spatial=(14, 11),
                                 kernel=(3, 3), in_channels=40, out_channels=34, groups=2,
                                 batch=2, data_format="NCX", dtype="bf16",
                                 attrs=dict(pads_begin=1, pads_end=0)),
    "weights 1x1 bf16": dict(op="ConvolutionBackwardWeights", spatial=(16, 17), kernel=(1, 1),
                             in_channels=48, out_channels=40, batch=2, dtype="bf16"),
}


# f16 and bf16 on the best path only: on the lesser one they widen into the f32 tiles,
# whose candidates its f32 cases time already
@pytest.mark.parametrize("isa,name", [
    (isa, name) for isa in PATHS for name in sorted(EXACT_CASES)
    if isa == PATHS[0] or EXACT_CASES[name].get("dtype", "f32") == "f32"])
def test_every_candidate_is_exact(isa, name, monkeypatch):
    """Each candidate plan (for any vendor), forced, gives the reference's bits on integer
    data, the same on 1 and 2 threads."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    params = dict(EXACT_CASES[name])
    op = params.pop("op")
    case = make_case(op, **params, seed=11)
    a, b = case.inputs[:2]
    problem = resolve(op, [a.shape, b.shape], case.attrs, None, params.get("dtype", "f32"))
    config = problem.config.with_isa(isa)
    expected = case.expected(a.dtype)
    first, second = (b, a) if problem.swap_inputs else (a, b)
    plans = candidates(config)
    if params.get("dtype") == "bf16":  # the vendors' rules differ: pairs or widened
        plans += [p for p in candidates(config, "GenuineIntel") if p not in plans]
    assert len(plans) >= 2
    for plan in plans:
        kernel = kernels.get_kernel(config, plan)
        assert kernel.plan == plan and kernel.name == kernel_name(config, plan)
        results = []
        for threads in (1, 2):
            dims = kernels.dims_of(problem, threads)
            out = np.empty(problem.output_shape, dtype=a.dtype)
            workspace = np.empty(kernel.workspace_size(dims), dtype=np.uint8)
            kernels.call(kernel, problem, dims, first, second, out, workspace)
            results.append(out)
        view = np.uint16 if a.dtype.itemsize == 2 else np.uint32
        np.testing.assert_array_equal(results[0].view(view), expected.view(view),
                                      err_msg=f"{config.name} plan {plan}")
        np.testing.assert_array_equal(results[1].view(view), results[0].view(view))


CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import convgrad
    from convgrad import kernels, tuning
    from convgrad.codegen.plan import kernel_name
    rng = np.random.default_rng(0)
    src = rng.integers(-3, 4, (2, 40, 36, 64)).astype(np.float32)
    dd = rng.integers(-3, 4, (2, 40, 36, 48)).astype(np.float32)
    result = convgrad.convolution_backward_weights(src, dd, weights_shape=[1, 1],
                                                   num_threads=2)
    untuned = convgrad.convolution_backward_weights(src, dd, weights_shape=[1, 1],
                                                    num_threads=2, tune=False)
    from convgrad.bound import bind
    call = bind("ConvolutionBackwardWeights", src.shape, dd.shape, "f32",
                {"weights_shape": [1, 1]}, None, 2)
    plan = tuning.plan_for(call.problem, call.config, 2, tuning.mode(), (src, dd))
    print(json.dumps({"timings": tuning.timings_run, "plan": plan,
                      "same": bool(np.array_equal(result, untuned)),
                      "loaded": sorted(k[1] or "" for k in kernels._loaded if k[1])}))
""")


def _child(env: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_tuned_plan_is_reused_without_timing(tmp_path):
    """CONVGRAD_TUNE=1 times the candidates once and stores the winner; a second
    process reuses it without timing anything; untuned calls run the rules' plan."""
    cache_dir = str(tmp_path / "cache")
    first = _child({"CONVGRAD_CACHE_DIR": cache_dir, "CONVGRAD_TUNE": "1"})
    assert first["timings"] >= 2 and first["same"]
    (record,) = json.loads(next((tmp_path / "cache" / "tuned").glob("*.json")).read_text())[
        "records"]
    assert record["threads"] == 2 and record["sizes"] == {"batch": 2, "src": [40, 36],
                                                          "dst": [40, 36], "pads": [0, 0]}
    assert set(record["seconds"]) == set(record["plans"]) and len(record["plans"]) >= 2
    assert record["machine"]["cpu"] == convgrad.cpu.cpu_model()
    assert first["plan"] == record["plan"]
    if record["plan"]:  # another plan than the rules' won the rounds and the second look
        assert record["confirmed_ratio"] * (1 + tuning.NOISE) <= 1.0
    second = _child({"CONVGRAD_CACHE_DIR": cache_dir, "CONVGRAD_TUNE": "1"})
    assert second["timings"] == 0 and second["plan"] == record["plan"] and second["same"]
    untuned = _child({"CONVGRAD_CACHE_DIR": cache_dir, "CONVGRAD_TUNE": "0"})
    assert untuned["timings"] == 0 and untuned["plan"] is None


def test_export_and_import_of_a_tuned_plan(tmp_path, monkeypatch):
    """A record written by hand with a plan the rules would not choose, exported and
    imported into another cache, is run by a process there (CONVGRAD_TUNE=reuse)
    without timing, exactly."""
    monkeypatch.setenv("CONVGRAD_CACHE_DIR", str(tmp_path / "one"))
    tuning.reset()
    src_shape, dd_shape = (2, 40, 36, 64), (2, 40, 36, 48)
    problem = resolve("ConvolutionBackwardWeights", [src_shape, dd_shape],
                      {"weights_shape": [1, 1]}, None, "f32")
    config = problem.config.with_isa(convgrad.cpu.selected_isa())
    plan = {"vec_block": 2, "max_slices": 1}
    record = {"config": config.to_dict(), "sizes": tuning.sizes_of(problem), "threads": 2,
              "plan": plan, "machine": tuning.machine(), "seconds": {}, "plans": {},
              "rules_seconds": 1.0, "tuned_seconds": 1.0}
    assert tuning.store([record]) == 1
    exported = tmp_path / "plans.json"
    assert tuning.export_plans(exported) == 1
    monkeypatch.setenv("CONVGRAD_CACHE_DIR", str(tmp_path / "two"))
    tuning.reset()
    assert tuning.all_records() == []
    assert tuning.import_plans(exported) == 1
    child = _child({"CONVGRAD_CACHE_DIR": str(tmp_path / "two"), "CONVGRAD_TUNE": "reuse"})
    assert child["timings"] == 0 and child["plan"] == plan and child["same"]
    assert child["loaded"] == [kernel_name(config, plan).rsplit("_p", 1)[1]]
    with pytest.raises(ValueError, match="tuned-plans file"):
        bad = tmp_path / "bad.json"
        bad.write_text("{}")
        tuning.import_plans(bad)
    tuning.reset()


def test_tune_modes():
    assert tuning.mode(True) == "on" and tuning.mode(False) == "off"
    assert tuning.mode("reuse") == "reuse"
    with pytest.raises(ValueError, match="expected on"):
        tuning.mode("sometimes")


def test_aot_build_with_tune_runs_without_a_compiler(tmp_path):
    """`convgrad aot --tune` times each kernel's candidates, builds the winners and
    records them; a process with no compiler runs the layers from that library,
    exactly, with the manifest's kernels."""
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps([
        {"op": "ConvolutionBackwardWeights", "name": "w1x1",
         "inputs": [[2, 24, 22, 96], [2, 24, 22, 40], [1, 1]], "attrs": {}},
        {"op": "ConvolutionBackwardData", "name": "d3x3",
         "inputs": [[2, 14, 13, 40], [3, 3, 24, 40], [14, 13]],
         "attrs": {"pads_begin": [1, 1], "pads_end": [1, 1]}}]))
    output = tmp_path / "aot"
    env = {**os.environ, "CONVGRAD_CACHE_DIR": str(tmp_path / "cache"),
           "CONVGRAD_AOT_PATH": ""}
    build = subprocess.run([sys.executable, "-m", "convgrad", "aot", str(layers), "-o",
                            str(output), "--tune", "--threads", "1", "-j", "2"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "tuned 2 kernels" in build.stdout
    manifest = json.loads((output / "manifest.json").read_text())
    assert all("tuning" in k and "plan" in k for k in manifest["kernels"])
    for kernel in manifest["kernels"]:
        config = KernelConfig.from_dict(kernel["config"])
        assert kernel["name"] == kernel_name(config, kernel["plan"])
        assert kernel["tuning"]["plan"] == kernel["plan"]
    assert len(tuning.read_plans(output / "tuned_plans.json")) == 2
    header = (output / "convgrad_kernels.h").read_text()
    assert all(k["name"] in header for k in manifest["kernels"])
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        import numpy as np
        from cases import make_case
        from convgrad import kernels
        from convgrad.codegen.ops import resolve
        from convgrad.cpu import selected_isa
        cases = [make_case("ConvolutionBackwardWeights", spatial=(24, 22), kernel=(1, 1),
                           in_channels=96, out_channels=40, batch=2),
                 make_case("ConvolutionBackwardData", spatial=(14, 13), kernel=(3, 3),
                           in_channels=24, out_channels=40, batch=2,
                           attrs=dict(pads_begin=1, pads_end=1))]
        found = []
        for case in cases:
            import convgrad
            result = convgrad.execute(case.op, case.inputs, case.attrs, num_threads=2)
            config = resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs,
                             None, "f32").config.with_isa(selected_isa())
            kernel = kernels.get_kernel(config)
            found.append([kernel.origin, kernel.name,
                          bool(np.array_equal(result, case.expected(np.float32)))])
        print(json.dumps(found))
    """)
    no_compiler = {**env, "CONVGRAD_AOT_PATH": str(output), "CC": "/nonexistent/cc",
                   "PATH": str(Path(sys.executable).parent),
                   "CONVGRAD_CACHE_DIR": str(tmp_path / "empty")}
    run = subprocess.run([sys.executable, "-c", script], env=no_compiler,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    names = {k["name"] for k in manifest["kernels"]}
    assert [f[0] for f in found] == ["aot", "aot"] and all(f[2] for f in found)
    assert {f[1] for f in found} == names


def test_tune_command_shows_exports_and_imports(tmp_path):
    env = {**os.environ, "CONVGRAD_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "convgrad", "tune"]
    shown = subprocess.run([*command, "show"], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "0 tuned plans" in shown.stdout
    missing = subprocess.run([*command, "export"], env=env, capture_output=True, text=True)
    assert missing.returncode == 2 and "needs a FILE" in missing.stderr
    exported = subprocess.run([*command, "export", str(tmp_path / "p.json")], env=env,
                              capture_output=True, text=True)
    assert exported.returncode == 0 and "exported 0" in exported.stdout
    imported = subprocess.run([*command, "import", str(tmp_path / "p.json")], env=env,
                              capture_output=True, text=True)
    assert imported.returncode == 0 and "imported 0" in imported.stdout


def test_plan_text_names_the_vendors_rules():
    """convgrad aot's tables call the vendor's rules' plan "rules" (with its choices when
    the vendor's rules differ from the vendor-free ones), anything else by its choices."""
    from convgrad.cli import _plan_text

    assert _plan_text({}, {}) == "rules"
    assert _plan_text({"vec_block": 3}, {"vec_block": 3}) == "rules (vec_block=3)"
    assert _plan_text({}, {"vec_block": 3}) == "rules (any vendor)"
    assert _plan_text({"packed": 1, "vec_block": 2}, {}) == "packed=1, vec_block=2"


def test_one_pixel_problems_build_short_tiles_unless_their_kernel_exists(fresh_cache):
    """A direct kernel for a problem of one pixel an image and few multiply-adds (as a
    squeeze-and-excitation convolution) whose configuration has no kernel yet is built
    with the rules' plan plus small_problem_plan's tiles of few rows, exact; a problem of
    the same configuration with more pixels gets the rules' kernel, and a new one-pixel
    problem then takes that one."""
    from convgrad import bound
    from convgrad.codegen.variants import SMALL_PROBLEM_TILE_ROWS

    def kernel_of(spatial, batch):
        case = make_case("ConvTransposeBackwardData", spatial=spatial, kernel=(1, 1),
                         in_channels=64, out_channels=48, batch=batch, seed=3)
        bound._calls.clear()
        out = convgrad.execute(case.op, case.inputs, case.attrs, tune=False)
        np.testing.assert_array_equal(out.view(np.uint32),
                                      case.expected(out.dtype).view(np.uint32))
        [call] = bound._calls.values()
        return call.kernel

    def tallest(kernel):
        return max(rows for rows, _ in render_context(kernel.config, "v", kernel.plan)["tiles"])

    one_pixel = kernel_of((1, 1), 8)
    assert one_pixel.plan["tile_rows"] == SMALL_PROBLEM_TILE_ROWS
    larger = kernel_of((5, 6), 2)
    assert "tile_rows" not in larger.plan and larger.config == one_pixel.config
    assert tallest(one_pixel) <= SMALL_PROBLEM_TILE_ROWS + 1 < tallest(larger)
    assert kernel_of((1, 1), 4) is larger
