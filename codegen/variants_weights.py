"""The weight-gradient variants (bwd_weights): depthwise rows, lanes across groups, dot
products along pixels, and the register tiles over packed panels, bf16 pixel pairs,
flattened (kw, channel) rows or rows of one tap, each one `VariantSpec`
(codegen/variant.py): what it applies to, its rules, its record's values and the tuner's
candidates.
"""

from __future__ import annotations

from collections.abc import Callable

from convgrad.codegen.choices import (
    DepthwiseWeightChoices,
    DotWeightChoices,
    GroupedWeightChoices,
    WeightChoices,
)
from convgrad.codegen.config import KernelConfig
from convgrad.codegen.rules_amx import amx_tiles
from convgrad.codegen.rules_common import MAX_VECTOR_BLOCK, uses_bf16_dot, weight_sums_bytes
from convgrad.codegen.rules_dot import dot_eligible, dot_tiles
from convgrad.codegen.rules_groups import (
    all_taps_vectors,
    depthwise_weight_rows,
    weights_across_groups,
    weights_across_groups_eligible,
)
from convgrad.codegen.rules_weights import (
    CHUNK_PIXELS,
    PACKED_OVERLAP_CHUNK_PIXELS,
    SUMS_IN_L2_BYTES,
    weight_tiles,
)
from convgrad.codegen.variant import Plan, Variant, VariantSpec
from convgrad.codegen.variants_data import merged


def _weights(config: KernelConfig) -> bool:
    return config.family == "bwd_weights"


# --- depthwise ------------------------------------------------------------------------

def _depthwise_applies(config: KernelConfig, plan: Plan) -> bool:
    return _weights(config) and config.depthwise


def _depthwise_candidates(config: KernelConfig) -> list[dict[str, int]]:
    slides = depthwise_weight_rows(config, {"slide": 1})["slide_pixels"]
    rows = depthwise_weight_rows(config)
    flip = ([{"row_vb_inner": int(not rows["row_vb_inner"])}]
            if rows["several_vec_blocks"] and not rows["pixel_sweep"] else [])
    taps = [{"all_taps": 1}] if all_taps_vectors(config) else []
    return [*flip, {"pixel_sweep": int(not rows["pixel_sweep"])},
            *([{"slide": 1}] if slides else []), *taps]


DEPTHWISE_WEIGHTS = VariantSpec(
    Variant.DEPTHWISE_WEIGHTS, _depthwise_applies, (depthwise_weight_rows,),
    DepthwiseWeightChoices, depthwise_weight_rows, _depthwise_candidates)


# --- lanes across groups --------------------------------------------------------------

def _one_group_lanes(config: KernelConfig, plan: Plan) -> bool:
    """A weight gradient, not depthwise, whose vectors run over one group's channels."""
    return (_weights(config) and not config.depthwise
            and not weights_across_groups(config, plan)["group_lanes"])


def _grouped_applies(config: KernelConfig, plan: Plan) -> bool:
    return (_weights(config) and not config.depthwise
            and weights_across_groups(config, plan)["group_lanes"])


def _grouped_candidates(config: KernelConfig) -> list[dict[str, int]]:
    return [{"group_lanes": 0}] + [
        {"vec_block": b} for b in range(1, MAX_VECTOR_BLOCK[config.isa] + 1)]


GROUPED_WEIGHTS = VariantSpec(
    Variant.GROUPED_WEIGHTS, _grouped_applies, (weights_across_groups,),
    GroupedWeightChoices, weights_across_groups, _grouped_candidates)


# --- dot products along pixels --------------------------------------------------------

def _dot_applies(config: KernelConfig, plan: Plan) -> bool:
    return _one_group_lanes(config, plan) and dot_tiles(config, plan)["ncx_dot"]


def _rows_candidates(config: KernelConfig) -> list[dict[str, int]]:
    """The candidates of weight gradients by register tiles over one group's channels
    (the dot products and the four row-tile variants, which flip into each other)."""
    isa = config.isa
    tiles = weight_tiles(config)
    found: list[dict[str, int]] = [{"group_lanes": 1}] if weights_across_groups_eligible(
        config) else []
    if dot_eligible(config):
        found.append({"ncx_dot": 1})
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


WEIGHTS_DOT = VariantSpec(Variant.WEIGHTS_DOT, _dot_applies, (dot_tiles,), DotWeightChoices,
                          dot_tiles, _rows_candidates)


# --- register tiles of rows: packed panels, bf16 pairs, flattened rows, one tap -------

def _tile_rows(config: KernelConfig, plan: Plan) -> bool:
    """Weight gradients by register tiles of rows (weight_tiles): over one group's
    channels, not as dot products."""
    return _one_group_lanes(config, plan) and not dot_tiles(config, plan)["ncx_dot"]


def _unpacked(config: KernelConfig, plan: Plan) -> bool:
    return _tile_rows(config, plan) and not weight_tiles(config, plan)["packed"]


def _f32_rows(config: KernelConfig, plan: Plan) -> bool:
    """Rows read in place and multiplied in f32 (not bf16 pairs)."""
    return _unpacked(config, plan) and not uses_bf16_dot(config, plan)


def _tiles_fill(config: KernelConfig, plan: Plan) -> dict[str, object]:
    tiles = weight_tiles(config, plan)
    return merged({"no_scratch": tiles["packed"]}, tiles, amx_tiles(config, plan))


def _packed_applies(config: KernelConfig, plan: Plan) -> bool:
    return _tile_rows(config, plan) and weight_tiles(config, plan)["packed"]


def _pairs_applies(config: KernelConfig, plan: Plan) -> bool:
    return _unpacked(config, plan) and uses_bf16_dot(config, plan)


def _flat_applies(config: KernelConfig, plan: Plan) -> bool:
    return _f32_rows(config, plan) and weight_tiles(config, plan)["flatten_w"]


def _one_tap_applies(config: KernelConfig, plan: Plan) -> bool:
    return _f32_rows(config, plan) and not weight_tiles(config, plan)["flatten_w"]


def _tiles_spec(variant: Variant, applies: Callable[[KernelConfig, Plan], bool]) -> VariantSpec:
    return VariantSpec(variant, applies, (weight_tiles, amx_tiles), WeightChoices,
                       _tiles_fill, _rows_candidates, two_parts=True)


WEIGHTS_PACKED = _tiles_spec(Variant.WEIGHTS_PACKED, _packed_applies)
WEIGHTS_PAIRS = _tiles_spec(Variant.WEIGHTS_PAIRS, _pairs_applies)  # bf16 pixel pairs
# (kw, input channel) rows over a padded copy
WEIGHTS_FLAT = _tiles_spec(Variant.WEIGHTS_FLAT, _flat_applies)
WEIGHTS = _tiles_spec(Variant.WEIGHTS, _one_tap_applies)  # input-channel rows of one tap

WEIGHT_SPECS = (DEPTHWISE_WEIGHTS, GROUPED_WEIGHTS, WEIGHTS_DOT, WEIGHTS_PACKED,
                WEIGHTS_PAIRS, WEIGHTS_FLAT, WEIGHTS)
