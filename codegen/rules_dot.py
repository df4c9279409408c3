"""Planner rules of the pixel-dot NCX weight gradients (bwd_weights_dot.c.j2): tiles of
input x output channels whose registers hold per-lane sums along the pixels."""

from __future__ import annotations

from collections.abc import Mapping

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.plan_choices import EMPTY_PLAN
from convgrad.codegen.rules_common import (
    ACCUMULATORS,
    last_part,
    partial_steps,
    weight_sums_bytes,
)
from convgrad.codegen.rules_weights import (
    SLICE_MIN_PIXELS,
    max_slices_of,
    weight_tile_count,
)

# NCX f32 weight gradients with stride 1 along w can multiply runs of consecutive pixels
# of src and diff_dst planes (bwd_weights_dot.c.j2): DOT_COLS output x ACCUMULATORS //
# DOT_COLS input channels per tile, each a vector of per-lane sums added in a tree at each
# flush; chunks of about DOT_CHUNK_PIXELS pixels packed into panels; superblocks of input
# channels whose panels take about DOT_SUPERBLOCK_BYTES. A tuning candidate only: the
# rules took it for 1x1 stride-1 layers on avx2 while the broadcast plans transposed
# diff_dst value by value where rows are narrower than a vector (Zen 4, ratio to PyTorch,
# broadcast -> dot, 1 thread: 0.89-0.94 -> 0.93-1.03), but with VL x VL blocks transposed
# in registers over whole runs of rows the broadcast plans win (Sapphire Rapids avx2,
# batch 8, 1 thread, pair ratios broadcast / dot on ResNet-50's 1x1 stride-1 layers:
# 1.03-1.26), as they did on avx512 and on 3x3 layers before.
DOT_COLS = 4
DOT_CHUNK_PIXELS = 512
DOT_SUPERBLOCK_BYTES = 256 * 1024


def dot_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """The pixel-dot plan of an NCX weight gradient, or none: tiles of input x output
    channels of one tap whose registers hold per-lane sums along the pixels."""
    if not dot_eligible(config) or not plan.get("ncx_dot", False):
        return {"ncx_dot": False}
    rows = max(1, min(config.cin_per_group, plan.get(
        "tile_rows", ACCUMULATORS[config.isa] // DOT_COLS)))
    rows_last = last_part(config.cin_per_group, rows)
    cols = min(DOT_COLS, config.cout_per_group)
    cols_last = last_part(config.cout_per_group, cols)
    return {"ncx_dot": True, "tile_rows": rows,
            "dot_tiles": list(dict.fromkeys((r, c) for r in (rows, rows_last)
                                            for c in (cols, cols_last))),
            "chunk_pixels": plan.get("chunk_pixels") or DOT_CHUNK_PIXELS,  # never by bytes
            "superblock_bytes": DOT_SUPERBLOCK_BYTES,
            "partial_pixels": partial_steps(config),
            "max_slices": max_slices_of(weight_sums_bytes(config), plan, weight_tile_count(
                config, rows, config.cin_per_group, cols, config.cout_per_group, False)),
            "slice_min_pixels": SLICE_MIN_PIXELS}


def dot_eligible(config: KernelConfig) -> bool:
    """Whether the pixel-dot plan can compute this configuration."""
    return (config.family == "bwd_weights" and config.data_format == "NCX"
            and config.dtype == "f32" and not config.depthwise and config.strides[-1] == 1)
