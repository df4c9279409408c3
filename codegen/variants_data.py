"""The data-gradient variants (fwd, bwd_data): direct tiles, col2im and lanes across
groups, each one `VariantSpec` (codegen/variant.py): what it applies to, its rules, its
record's values and the tuner's candidates.
"""

from __future__ import annotations

from math import prod

from convgrad.codegen.choices import AcrossGroupsChoices, Col2imChoices, DirectChoices
from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import VECTOR_LANES
from convgrad.codegen.plan_choices import EMPTY_PLAN
from convgrad.codegen.rules_amx import amx_columns, amx_tiles
from convgrad.codegen.rules_common import MAX_VECTOR_BLOCK, WIDE_VECTOR_BLOCK, reduced_channels
from convgrad.codegen.rules_data import (
    BAND_BYTES,
    COL_PIXELS,
    WEIGHT_CHUNK_BYTES,
    band_bytes,
    col2im,
    col2im_eligible,
    col2im_tiles,
    direct_tiles,
    image_block_bytes,
    may_stream,
    overlap_runs,
    pad_columns_below,
    rounds_in_tiles,
    stream_min_bytes,
    weight_packing,
)
from convgrad.codegen.rules_groups import (
    data_across_groups,
    data_across_groups_eligible,
    slide_rows,
)
from convgrad.codegen.rules_ncx import pointwise_ncx_tiles
from convgrad.codegen.variant import Plan, Variant, VariantSpec

# Data gradients spread their input whole up front while the spread copy takes at most
# this (a last-level cache: Zen 3's L3), else row by row as each thread's output rows
# read them. Sapphire Rapids, batch 8, pair ratios rows / whole, 1 / 2 threads, avx2 and
# avx512: ResNeXt conv_3d:1 (8x56x56, 4 channels per group, 154 MB spread) 1.95-2.03,
# 3d_gconv block-4 (21^3, 28-38 MB) 1.05-1.11, but 3d_gconv s2 (11-22 MB, short rows)
# 0.85-0.94.
SPREAD_WHOLE_BYTES = 32 * 1024 * 1024
# ...a tuning candidate for 1x1 data gradients on 8-lane paths: a vector block's weights
# per pass that stay in L1. Sapphire Rapids avx2, ResNet-50 batch 8, pair ratios against
# the rule's 512 KB, 1 thread: 1.07-1.18 where 512-1024 channels are reduced (res4a_branch1
# 1.18), 0.97 on the strided 256<-512 and 1024<-2048; 2 threads 0.95-1.11. No rule: avx512
# loses (0.91-1.01), and so do 3x3 layers (0.90-0.93).
L1_WEIGHT_CHUNK_KB = 32


def merged(*parts: dict[str, object]) -> dict[str, object]:
    """The union of a variant's parts of its record, each name from one part only (no
    value overrides another)."""
    found: dict[str, object] = {}
    for part in parts:
        both = set(found) & set(part)
        if both:
            raise ValueError(f"choices {sorted(both)} come from two rules")
        found.update(part)
    return found


def _data(config: KernelConfig) -> bool:
    return config.family != "bwd_weights"


def _by_channels(config: KernelConfig, plan: Plan) -> bool:
    """A data gradient whose vectors run over one group's channels (not across groups)."""
    return _data(config) and not config.depthwise and not data_across_groups(config, plan)


# --- direct tiles -------------------------------------------------------------------

def _direct_applies(config: KernelConfig, plan: Plan) -> bool:
    return _by_channels(config, plan) and not col2im(config, plan)


def _direct_fill(config: KernelConfig, plan: Plan) -> dict[str, object]:
    tiles, ncx = direct_tiles(config, plan), pointwise_ncx_tiles(config, plan)
    amx = amx_tiles(config, plan)
    bands = band_bytes(config, plan)
    second, ncx_second = split_tiles("NCX bands" if bands else config.data_format,
                                     tiles["tiles"], ncx.get("ncx_tiles", []), amx["amx"])
    return merged({"pad_columns_below": pad_columns_below(config, plan),
                   "overlap_runs": overlap_runs(config, plan),
                   "stream_min_bytes": stream_min_bytes(config, plan),
                   "band_bytes": bands,
                   "no_scratch": bool(bands),  # copies bands of rows, not whole tensors
                   "image_block_bytes": image_block_bytes(config, plan),
                   "weight_packing": weight_packing(config, plan),
                   "round_in_tiles": rounds_in_tiles(config),
                   "second_part": second, "ncx_second_part": ncx_second}, tiles, ncx, amx)


def _direct_candidates(config: KernelConfig) -> list[dict[str, int]]:
    isa = config.isa
    lanes_empty = config.vector_channels % VECTOR_LANES[isa]
    # col2im first where the direct tiles leave lanes empty, else after the other choices
    found: list[dict[str, int]] = [{"col2im": 1}] if col2im_eligible(config) and lanes_empty else []
    if data_across_groups_eligible(config):
        found.append({"group_lanes": 1})
    tiles = direct_tiles(config)
    blocks = [WIDE_VECTOR_BLOCK[isa]] if isa in WIDE_VECTOR_BLOCK else []
    found += [{"vec_block": b} for b in [*blocks, *range(MAX_VECTOR_BLOCK[isa], 1, -1)]
              if b != tiles["vec_block"]]
    if may_stream(config, EMPTY_PLAN):
        found.append({"stream_kb": 0})
    if overlap_runs(config) and config.kernel[-1] > 1:  # one w tap: the same runs
        found.append({"overlap_runs": 0})
    if pad_columns_below(config, {"pad_columns": 1}):
        found.append({"pad_columns": int(not pad_columns_below(config))})
    if band_bytes(config, {"band_kb": BAND_BYTES >> 10}):
        found.append({"band_kb": 0 if band_bytes(config) else BAND_BYTES >> 10})
        if band_bytes(config) not in (0, BAND_BYTES):
            found.append({"band_kb": BAND_BYTES >> 10})
    if image_block_bytes(config):
        found.append({"image_block_kb": 0})
    if tiles["pointwise"]:
        found.append({"point_vb_inner": int(not tiles["point_vb_inner"])})
        found.append({"point_prefetch": int(not tiles["point_prefetch"])})
    if prod(config.kernel) == 1 and not tiles["pointwise"] and tiles["vec_block"] < -(
            -config.vector_channels // VECTOR_LANES[isa]):
        found.append({"row_vb_inner": int(not tiles["row_vb_inner"])})
    ncx = pointwise_ncx_tiles(config)
    if pointwise_ncx_tiles(config, {"ncx_in_place": 1})["pointwise_ncx"]:
        found.append({"ncx_in_place": int(not ncx["pointwise_ncx"])})
    if ncx["pointwise_ncx"]:
        if ncx["ncx_strided"]:
            found.append({"ncx_compact_kb": 0})
        if ncx["ncx_reduce_chunk"] < reduced_channels(config):
            found.append({"ncx_pass_kb": 0})
        found.append({"ncx_head": int(not ncx["ncx_head"])})
        found.append({"ncx_prefetch": int(not ncx["ncx_prefetch"])})
    if prod(config.kernel) == 1 and VECTOR_LANES[isa] == 8:
        found.append({"weight_chunk_kb": L1_WEIGHT_CHUNK_KB})
    found += [{"weight_chunk_kb": WEIGHT_CHUNK_BYTES // 1024 // 4},
              {"weight_chunk_kb": WEIGHT_CHUNK_BYTES // 1024 * 4}]
    if tiles["unrolled_tiles"] and tiles["step_unroll"] > 1:
        found.append({"step_unroll": 1})
    if col2im_eligible(config) and not lanes_empty:
        found.append({"col2im": 1})
    return found


DIRECT = VariantSpec(
    Variant.DIRECT, _direct_applies,
    (direct_tiles, pointwise_ncx_tiles, amx_tiles, band_bytes, image_block_bytes,
     pad_columns_below, overlap_runs, stream_min_bytes, weight_packing),
    DirectChoices, _direct_fill, _direct_candidates, two_parts=True)


# --- col2im ---------------------------------------------------------------------------

def _col2im_applies(config: KernelConfig, plan: Plan) -> bool:
    return _by_channels(config, plan) and col2im(config, plan)


def _col2im_fill(config: KernelConfig, plan: Plan) -> dict[str, object]:
    in_place = config.data_format == "NCX" and config.dtype == "f32" and bool(
        plan.get("ncx_in_place", 1))
    return merged({"input_in_place": in_place}, col2im_tiles(config, plan),
                  amx_columns(config, plan))


def _col2im_candidates(config: KernelConfig) -> list[dict[str, int]]:
    isa = config.isa
    block = col2im_tiles(config)["vec_block"]
    ncx = [{"ncx_in_place": 0}] if (config.data_format, config.dtype) == ("NCX", "f32") else []
    return [{"col2im": 0}, *ncx,
            *({"vec_block": b} for b in range(MAX_VECTOR_BLOCK[isa] + 1, 1, -1) if b != block),
            *({"col_pixels": p} for p in (COL_PIXELS // 2, COL_PIXELS * 2))]


COL2IM = VariantSpec(Variant.COL2IM, _col2im_applies, (col2im_tiles, amx_columns),
                     Col2imChoices, _col2im_fill, _col2im_candidates)


# --- across groups (depthwise, or lanes over every group's channels) -----------------

def _across_applies(config: KernelConfig, plan: Plan) -> bool:
    return _data(config) and (config.depthwise or data_across_groups(config, plan))


def _across_fill(config: KernelConfig, plan: Plan) -> dict[str, object]:
    grouped = not config.depthwise  # input spread to the lanes, never padded
    return merged({
        "slide_rows": slide_rows(config, plan),
        "pad_columns_below": 0 if grouped else pad_columns_below(config, plan),
        "vector_per_group": config.vector_channels if grouped else 1,
        "reduced_per_group": reduced_channels(config) if grouped else 1,
        "stream_min_bytes": stream_min_bytes(config, plan),
        "spread_whole_bytes": plan.get("spread_whole_mb", SPREAD_WHOLE_BYTES >> 20) << 20},
        direct_tiles(config, plan))


def _across_candidates(config: KernelConfig) -> list[dict[str, int]]:
    isa = config.isa
    if not config.depthwise:  # grouped, across by rule
        return [{"group_lanes": 0}, {"spread_whole_mb": 0}] + [
            {"vec_block": b} for b in range(1, MAX_VECTOR_BLOCK[isa] + 1)]
    tiles = direct_tiles(config)
    found = [{"vec_block": b} for b in range(MAX_VECTOR_BLOCK[isa], 1, -1)
             if b != tiles["vec_block"]]
    if may_stream(config, EMPTY_PLAN):
        found.append({"stream_kb": 0})
    if config.strides[-1] == 1 and config.kernel[-1] > 1:
        found.append({"slide": int(not slide_rows(config))})
    return found


ACROSS_GROUPS = VariantSpec(
    Variant.ACROSS_GROUPS, _across_applies,
    (direct_tiles, slide_rows, pad_columns_below, stream_min_bytes),
    AcrossGroupsChoices, _across_fill, _across_candidates)

DATA_SPECS = (DIRECT, COL2IM, ACROSS_GROUPS)


# Compile time of a direct kernel's code besides its tiles, and of each tile on top of
# its accumulators (rows x vectors, twice that with the odd partial sums of small tiles),
# in units of one accumulator: to balance the two objects a lazy build compiles at once
# (fit to GCC 12's times for the parts of ResNet-50 kernels compiled alone, Zen 4: about
# 1 ms a unit). The copies of data kernels that pack their input and unpack their
# result (pack_data, unpack_data: channels-first kernels' transposes) are the second
# object's, SECOND_BASE_COST; the transposes of kernels that copy bands of rows
# (ncx_bands.h.j2) the first's, with the bands' loop ("NCX bands": measured as 0.1 s more
# in the first object and 0.15 s less in the second than with whole copies). The AMX
# path, always the second object's, costs about AMX_COST (Sapphire Rapids, GCC 12:
# 0.15-0.25 s; NCX with its channels-last copies).
BASE_COST = {"NXC": 150, "NCX": 180, "NCX bands": 280}
SECOND_BASE_COST = {"NXC": 0, "NCX": 150, "NCX bands": 0}
TILE_COST = 30
AMX_COST = {"NXC": 150, "NCX": 250, "NCX bands": 250}


def split_tiles(data_format: str, tiles: list[tuple[int, int]],
                ncx_tiles: list[tuple[int, int]], amx: bool = False,
                ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The tiles a direct kernel's second object defines (see functions.h.j2): the
    costliest first, each to the object with less to compile so far (the second holds
    a data kernel's copies, SECOND_BASE_COST, and the AMX path, where there is one)."""
    def cost(tile: tuple[int, int]) -> int:
        accumulators = tile[0] * tile[1]
        return TILE_COST + accumulators * (2 if accumulators < 8 else 1)

    load = [BASE_COST[data_format],
            SECOND_BASE_COST[data_format] + (AMX_COST[data_format] if amx else 0)]
    second: list[tuple[str, tuple[int, int]]] = []
    named = [("tile", t) for t in tiles] + [("ncx", t) for t in ncx_tiles]
    for kind, tile in sorted(named, key=lambda n: -cost(n[1])):
        part = int(load[1] < load[0])
        load[part] += cost(tile)
        if part:
            second.append((kind, tile))
    return ([t for kind, t in second if kind == "tile"],
            [t for kind, t in second if kind == "ncx"])
