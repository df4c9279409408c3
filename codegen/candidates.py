"""The tuner's candidates: plans that each render different C, the rules' plan
first.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from math import prod

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import VECTOR_LANES
from convgrad.codegen.plan_choices import EMPTY_PLAN
from convgrad.codegen.rules_amx import amx_tiles
from convgrad.codegen.rules_common import (
    MAX_VECTOR_BLOCK,
    WIDE_VECTOR_BLOCK,
    reduced_channels,
    uses_bf16_dot,
    weight_sums_bytes,
)
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
    pointwise_ncx_tiles,
)
from convgrad.codegen.rules_groups import (
    all_taps_vectors,
    data_across_groups,
    data_across_groups_eligible,
    depthwise_weight_rows,
    slide_rows,
    weights_across_groups,
    weights_across_groups_eligible,
)
from convgrad.codegen.rules_weights import (
    CHUNK_PIXELS,
    PACKED_OVERLAP_CHUNK_PIXELS,
    SUMS_IN_L2_BYTES,
    dot_eligible,
    weight_tiles,
)
from convgrad.codegen.variants import render_context
from convgrad.codegen.vendors import WIDEN_BF16_VENDORS, vendor_plan

MAX_CANDIDATES = 8
# ...a tuning candidate for 1x1 data gradients on 8-lane paths: a vector block's weights
# per pass that stay in L1. Sapphire Rapids avx2, ResNet-50 batch 8, pair ratios against
# the rule's 512 KB, 1 thread: 1.07-1.18 where 512-1024 channels are reduced (res4a_branch1
# 1.18), 0.97 on the strided 256<-512 and 1024<-2048; 2 threads 0.95-1.11. No rule: avx512
# loses (0.91-1.01), and so do 3x3 layers (0.90-0.93).
L1_WEIGHT_CHUNK_KB = 32


def _variations(config: KernelConfig, vendor: str = "") -> list[dict[str, int]]:
    """Plans that change one or two of the rules' choices for this configuration; for
    bf16 pairs also the widened path's (those of the avx512 path's kernel, which widens
    alike), first where the vendor's rules widen, and the kernels without AMX."""
    if not uses_bf16_dot(config):
        found = _one_path_variations(config)
        if uses_bf16_dot(config, {"bf16_dot": 1}):  # widened for col2im by rule
            found.insert(1, {"bf16_dot": 1})
        return found
    pairs = _one_path_variations(config)
    widened = [{"bf16_dot": 0, **plan}
               for plan in _one_path_variations(replace(config, isa="avx512"))]
    # without AMX, where the kernel carries it (the other plans differ only where the
    # CPU lacks it)
    amx = [{"amx": 0}, {"bf16_dot": 0, "amx": 0}] if amx_tiles(config)["amx"] else []
    if vendor in WIDEN_BF16_VENDORS:
        return [{"bf16_dot": 0}, *amx[::-1], *widened, *pairs]
    return [{"bf16_dot": 0}, *amx, *pairs, *widened]


def _one_path_variations(config: KernelConfig) -> list[dict[str, int]]:
    isa = config.isa
    if config.family == "bwd_weights":
        if config.depthwise:
            slides = depthwise_weight_rows(config, {"slide": 1})["slide_pixels"]
            rows = depthwise_weight_rows(config)
            flip = ([{"row_vb_inner": int(not rows["row_vb_inner"])}]
                    if rows["several_vec_blocks"] and not rows["pixel_sweep"] else [])
            taps = [{"all_taps": 1}] if all_taps_vectors(config) else []
            return [*flip, {"pixel_sweep": int(not rows["pixel_sweep"])},
                    *([{"slide": 1}] if slides else []), *taps]
        flip = ([{"group_lanes": int(not weights_across_groups(config)["group_lanes"])}]
                if weights_across_groups_eligible(config) else [])
        if weights_across_groups(config)["group_lanes"]:
            return flip + [{"vec_block": b} for b in range(1, MAX_VECTOR_BLOCK[isa] + 1)]
        tiles = weight_tiles(config)
        found: list[dict[str, int]] = flip + ([{"ncx_dot": 1}] if dot_eligible(config) else [])
        if not tiles["flatten_w"] and not uses_bf16_dot(config):
            found.append({"packed": int(not tiles["packed"])})
        if tiles["prefetch_panels"]:
            found.append({"prefetch_panels": 0})
        if tiles["image_block_bytes"]:
            found.append({"image_block_kb": 0})
        found += [{"vec_block": b} for b in range(MAX_VECTOR_BLOCK[isa], 1, -1)
                  if b != tiles["vec_block"]]
        if tiles["chunk_pixels"]:
            rule = tiles["chunk_pixels"]  # half, double (up to 512) and 128
            found += [{"chunk_pixels": p} for p in sorted(
                {rule // 2, CHUNK_PIXELS, min(rule * 2, PACKED_OVERLAP_CHUNK_PIXELS)} - {rule})]
        if weight_sums_bytes(config) > SUMS_IN_L2_BYTES:  # the other of pixels and bytes
            found.append({"chunk_pixels": 0 if tiles["chunk_pixels"] else CHUNK_PIXELS})
        if tiles["max_slices"] > 1:
            found.append({"max_slices": 1})
        if tiles["sums_in_output"]:
            found.append({"sums_in_output": 0})
        if tiles["unrolled_tiles"] and tiles["step_unroll"] > 1:
            found.append({"step_unroll": 1})
        return found
    found: list[dict[str, int]] = []
    if col2im_eligible(config):  # (one group: never across groups)
        flip = {"col2im": int(not col2im(config))}
        if col2im(config):
            block = col2im_tiles(config)["vec_block"]
            ncx = [{"ncx_in_place": 0}] if (config.data_format, config.dtype) == (
                "NCX", "f32") else []
            return [flip, *ncx,
                    *({"vec_block": b} for b in range(MAX_VECTOR_BLOCK[isa] + 1, 1, -1)
                      if b != block),
                    *({"col_pixels": p} for p in (COL_PIXELS // 2, COL_PIXELS * 2))]
        # first where the direct tiles leave lanes empty, else after the other choices
        found = [flip] if config.vector_channels % VECTOR_LANES[isa] else []
    tiles = direct_tiles(config)
    if data_across_groups_eligible(config):
        flip = {"group_lanes": int(not data_across_groups(config))}
        if not flip["group_lanes"]:
            return [flip, {"spread_whole_mb": 0}] + [
                {"vec_block": b} for b in range(1, MAX_VECTOR_BLOCK[isa] + 1)]
        found = [flip]
    blocks = [WIDE_VECTOR_BLOCK[isa]] if isa in WIDE_VECTOR_BLOCK and not config.depthwise else []
    found += [{"vec_block": b} for b in [*blocks, *range(MAX_VECTOR_BLOCK[isa], 1, -1)]
              if b != tiles["vec_block"]]
    if may_stream(config, EMPTY_PLAN):
        found.append({"stream_kb": 0})
    if config.depthwise:
        if config.strides[-1] == 1 and config.kernel[-1] > 1:
            found.append({"slide": int(not slide_rows(config))})
        return found
    if overlap_runs(config) and config.kernel[-1] > 1:  # one w tap: the same runs
        found.append({"overlap_runs": 0})
    if pad_columns_below(config, {"pad_columns": 1}):
        found.append({"pad_columns": int(not pad_columns_below(config))})
    if band_bytes(config, {"band_kb": BAND_BYTES >> 10}):
        found.append({"band_kb": 0 if band_bytes(config) else BAND_BYTES >> 10})
    if image_block_bytes(config):
        found.append({"image_block_kb": 0})
    if tiles["pointwise"]:
        found.append({"point_vb_inner": int(not tiles["point_vb_inner"])})
    if prod(config.kernel) == 1 and not tiles["pointwise"] and tiles["vec_block"] < -(
            -config.vector_channels // VECTOR_LANES[isa]):
        found.append({"row_vb_inner": int(not tiles["row_vb_inner"])})
    ncx = pointwise_ncx_tiles(config)
    if pointwise_ncx_tiles(config, {"ncx_in_place": 1})["pointwise_ncx"]:
        found.append({"ncx_in_place": int(not ncx["pointwise_ncx"])})
    if ncx["pointwise_ncx"]:
        if ncx["ncx_reduce_chunk"] < reduced_channels(config):
            found.append({"ncx_pass_kb": 0})
        found.append({"ncx_head": int(not ncx["ncx_head"])})
    if prod(config.kernel) == 1 and VECTOR_LANES[isa] == 8:
        found.append({"weight_chunk_kb": L1_WEIGHT_CHUNK_KB})
    found += [{"weight_chunk_kb": WEIGHT_CHUNK_BYTES // 1024 // 4},
              {"weight_chunk_kb": WEIGHT_CHUNK_BYTES // 1024 * 4}]
    if tiles["unrolled_tiles"] and tiles["step_unroll"] > 1:
        found.append({"step_unroll": 1})
    if col2im_eligible(config) and not config.vector_channels % VECTOR_LANES[isa]:
        found.append({"col2im": 1})
    return found


def candidates(config: KernelConfig, vendor: str = "",
               features: Iterable[str] | None = None) -> list[dict[str, int]]:
    """The plans a tuner times for this configuration on a CPU of `vendor`: the rules'
    plan there first (vendor_plan), then up to MAX_CANDIDATES - 1 variations that each
    render different C. With `features` (a tuning for this CPU alone, as vendor_plan's),
    and no AMX among them, every plan leaves the AMX path out: it would never run."""
    first = vendor_plan(config, vendor, features)
    found = [first]
    seen = [_spelling(config, first)]
    for plan in [{}, *_variations(config, vendor)]:
        if first.get("amx") == 0 and amx_tiles(config, plan)["amx"]:
            plan = {**plan, "amx": 0}
        spelling = _spelling(config, plan)
        if spelling not in seen:
            found.append(plan)
            seen.append(spelling)
        if len(found) == MAX_CANDIDATES:
            break
    return found


def _spelling(config: KernelConfig, plan: Mapping[str, int]) -> str:
    """What a plan makes the templates spell (its render context but the names)."""
    context = render_context(config, "", plan)
    for name in ("name", "plan_items"):
        context.pop(name)
    return json.dumps(context, sort_keys=True, default=str)
