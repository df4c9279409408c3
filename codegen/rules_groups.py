"""Planner rules of grouped and depthwise layers: vectorising across groups (data
and weight gradients) and the depthwise weight-gradient rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import REGISTERS, VECTOR_LANES
from convgrad.codegen.plan_choices import EMPTY_PLAN
from convgrad.codegen.rules_common import (
    ACCUMULATORS,
    MAX_VECTOR_BLOCK,
    PARTIAL_PRODUCTS,
    last_part,
    reduced_channels,
    uses_bf16_dot,
)

# Tap loops longer than this stay loops instead of being unrolled.
MAX_UNROLLED_TAPS = 16
# A kernel wakes one thread per this many FLOPs (2 per multiply-add) at most
# (kernel.c.j2's MIN_THREAD_FLOPS): below, waking a thread costs more than it saves.
# Depthwise kernels run at about a quarter of the dense kernels' FLOP rate (a load per
# multiply-add: 25-30 GFLOP/s against 100-110 on Zen 4 avx2, 1 thread), so they take a
# second thread at a quarter of the work; their weight gradients, which add partial
# sums across threads, at half (with 5e5, weights of 7x7 576 channels, stride 2, 1.33
# MFLOP, ran at 0.71 of one thread's speed on avx512). Zen 4, batch 8, 2 threads,
# MobileNetV2's and EfficientNet-B0's depthwise layers at 112x112 of 1.3-2.7 MFLOP (all
# on one thread with 2e6), time with 2e6 / with these, in one process
# (benchmarks/results/zen4/depthwise_threads_ab): data and fwd 1.04-1.87 (avx512),
# 1.08-1.85 (avx2); weights of 2.2-2.7 MFLOP 1.36-1.58 and 1.41-1.61.
MIN_THREAD_FLOPS = "2e6"
DEPTHWISE_MIN_THREAD_FLOPS = {"fwd": "5e5", "bwd_data": "5e5", "bwd_weights": "1e6"}
# Grouped layers with few channels per group leave most lanes of a vector of one group's
# channels empty (2 of 8 with 2 per group): vectorised across the groups instead, lanes
# over every channel of the vectorised side against a copy of the other operand spread
# to match (weight gradients: grouped_weights.c.j2 spreads diff_dst; data gradients:
# depthwise.c.j2 spreads its input). The copy costs a store per lane of each reduced
# channel, the gain is per multiply-add. Zen 3 avx2, batch 8, 1 thread, pair ratios
# across groups / one group's channels (inputs x outputs per group):
#   weights: 3-D 3x3x3 2x2 1.78, 4x4 1.42-1.46, 6x6 1.02, 16x16 and 8x8 0.45-0.67; 2-D
#   3x3 1x4 3.70, 2x2 3.03, 4x4 1.21 (56x56, also strided 1.51), 8x8 0.58, 6x6 1.12
#   (1.21 on 2 threads); 1-D kernel 3 4x2 1.70, 2x2 2.97, 6x3 1.17, but 4x4 0.79; kernel
#   5 6x3 1.74-1.81; 1x1 2x2 1.31-2.17, 2x3 1.24, 4x4 1.28-2.04 on 28x28 but 0.93 strided
#   and 2x4 on rows of 16 0.21.
#   data: 3-D 3x3x3 2x2 stride 2 2.54, 4x4 1.94 (19^3) and 1.01 (8x56x56), 6x6 0.89, 8x8
#   and 16x16 0.25-0.39; 2-D 3x3 2x2 2.34, 4x2 1.15, 4x4 1.00 (56x56), 1.12 (14x14),
#   1.39 (strided), 6x6 0.76; 1-D kernel 3 2x2 3.30, 4x4 0.74; kernel 5 6x3 0.76; 1x1
#   2x4 0.14 (the 1x1 plan runs all pixels as one matrix product).
# Hence the shares of a vector's lanes a group's vectorised channels may fill, in
# eighths, with GROUP_LANES_MIN_TAPS taps or more / 2-4 taps / 1 tap: weight gradients
# 6 / 3 / 3, data gradients 4 / 2 / 0. Measured on avx2; the other paths take the same
# shares of their lanes.
GROUP_LANES_MIN_TAPS = 5
GROUP_LANES_SHARES = {"weights": (6, 3, 3), "data": (4, 2, 0)}
# Weight gradients spread this many bytes of diff_dst rows at a time (at least two rows):
# they stay in L1 while the kernel's (kd, kh) tap rows reuse them. Zen 3, 1 / 2 threads,
# pair ratios 24 KB / 128 KB: 3d_gconv 4x4 1.38 / 1.27, 6x6 1.23 / 1.37, 2x2 s2 1.07 /
# 1.10; ResNeXt conv_3d:1 (57 KB a row, so two rows either way) 1.01 / 1.03; 2-D layers
# 0.95-1.04. At 128 KB, whole spread blocks (2.4 MB on conv_3d:1) had run at 0.70x.
GROUP_LANES_SPREAD_BYTES = 24 * 1024


def _across_groups_by_rule(config: KernelConfig) -> bool:
    """Whether the rules vectorise a grouped layer across its groups: where a group's
    vectorised channels fill at most `share` eighths of the lanes (GROUP_LANES_SHARES)."""
    taps = prod(config.kernel)
    many, few, one = GROUP_LANES_SHARES["weights" if config.family == "bwd_weights" else "data"]
    share = many if taps >= GROUP_LANES_MIN_TAPS else few if taps > 1 else one
    return 8 * config.vector_channels <= share * VECTOR_LANES[config.isa]


def weights_across_groups(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """The across-groups plan of a grouped weight gradient, or none: tiles of KW taps x
    outputs of a group x vectors of input channels of one (kd, kh) tap row."""
    if not weights_across_groups_eligible(config, plan) or not plan.get(
            "group_lanes", _across_groups_by_rule(config)):
        return {"group_lanes": False}
    lanes, kw = VECTOR_LANES[config.isa], config.kernel[-1]
    budget = ACCUMULATORS[config.isa] // kw  # KW x outs x vecs sums in registers
    vectors = -(-config.groups * config.cin_per_group // lanes)
    outs = -(-config.cout_per_group // -(-config.cout_per_group // budget))
    vecs = max(1, min(vectors, plan.get("vec_block", MAX_VECTOR_BLOCK[config.isa]),
                      budget // outs))
    outs_last = last_part(config.cout_per_group, outs)
    vecs_last = last_part(vectors, vecs)
    return {"group_lanes": True, "k_block": outs, "vec_block": vecs,
            "tiles": list(dict.fromkeys((o, v) for o in (outs, outs_last)
                                        for v in (vecs, vecs_last))),
            "spread_bytes": GROUP_LANES_SPREAD_BYTES, "max_unrolled_taps": MAX_UNROLLED_TAPS}


def weights_across_groups_eligible(config: KernelConfig,
                                    plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """Whether the across-groups plan can compute this configuration: a grouped weight
    gradient, not depthwise, not bf16 pairs, whose KW sums of a tile fit the registers."""
    return (config.family == "bwd_weights" and config.groups > 1 and not config.depthwise
            and not uses_bf16_dot(config, plan)
            and config.kernel[-1] <= ACCUMULATORS[config.isa])


def data_across_groups(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """Whether a grouped data gradient (fwd, bwd_data) runs across the groups like a
    depthwise one (depthwise.c.j2), its input spread to the lanes."""
    return data_across_groups_eligible(config, plan) and bool(
        plan.get("group_lanes", _across_groups_by_rule(config)))


def data_across_groups_eligible(config: KernelConfig,
                                 plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """Whether the across-groups plan can compute this data gradient: grouped, not
    depthwise (always across), not bf16 pairs; at most MAX_SPREAD_PRODUCTS products per
    output (taps x reduced channels per group: each pair is a tap of the tiles, summed
    in one register, so this bounds the chain as PARTIAL_PRODUCTS does elsewhere)."""
    return (config.family != "bwd_weights" and config.groups > 1 and not config.depthwise
            and not uses_bf16_dot(config, plan)
            and prod(config.kernel) * reduced_channels(config) <= MAX_SPREAD_PRODUCTS)


MAX_SPREAD_PRODUCTS = 2 * PARTIAL_PRODUCTS
# Depthwise weight gradients with stride 1 along w can take the columns every w tap
# reaches this many at a time, each src column loaded once into a window of registers (2
# loads per KW multiply-adds, not KW + 1). A tuning candidate only: the window costs
# registers, so fewer channel vectors per row pass, and narrow rows lose more by that
# than they gain. Sapphire Rapids, MobileNet stride-1 layers, batch 8, 1 thread, pair
# ratios sliding / not: avx2 (2 vectors, not 3) 32 channels on 112x112 1.29, 128 on
# 56x56 1.12, 512 on 14x14 0.73, 1024 on 7x7 0.61; avx512 (4 vectors either way)
# 1.01, 0.90, 0.98, 1.00.
DEPTHWISE_WEIGHT_SLIDE = 8
# ...and run each row's vector blocks one after the other (plan row_vb_inner) where a
# pixel's channels take at least this many bytes, else each vector block over a block of
# rows. Zen 4 avx2, MobileNet batch 8, caches flushed, 1 / 2 threads, each vector block
# over the block -> row by row: 1024 channels on 7x7 0.78-0.87 -> 0.42-0.49 ms / 0.32-0.45
# -> 0.19-0.21; 512 on 14x14 and 256 on 28x28 (stride 2) unchanged; 32 on 112x112
# 1.84-1.87 -> 2.07-2.10 (1 thread).
DEPTHWISE_ROW_VB_INNER_BYTES = 1024
# ...and with stride along w, where a vector block is not all the channels and takes
# part of a cache line (avx2's 3 vectors: 96 bytes), each row sweeps every channel of a
# pixel at once with its sums in L1 (plan pixel_sweep, depthwise_sweep.h.j2): strided
# tiles read each pixel in several passes, part of its lines each. Zen 4, MobileNet batch
# 8, caches flushed, tiles -> sweep, 1 / 2 threads: 64 ch on 112x112 stride 2 avx2 3.9 ->
# 2.4 / 1.95 -> 1.22 ms; 256 ch on 28x28 stride 2 avx2 1.18 -> 0.65 / 0.63 -> 0.42. In
# the benchmark (PyTorch between calls) avx2's 64 ch ran 7.4 -> 11.7 / 15.1 -> 23.2
# GFLOP/s, but avx512's 256 ch (blocks of 4 whole lines) 34.0 -> 25.3 / 47.4 -> 38.5;
# alone and cold it had gained (0.67 -> 0.57 ms). Not where one block holds every
# channel (64 ch avx512: 1.80 -> 2.16, 0.94 -> 1.15), nor with stride 1 (32 ch on
# 112x112 avx2: 1.87 -> 2.97).
# Depthwise weight gradients can keep every (kh, kw) tap of a kd in registers (plan
# all_taps, depthwise_taps.h.j2): a call runs a vector block over a group of rows of about
# DEPTHWISE_GROUP_KB of src and diff_dst (in L2 for the next vector block), each diff_dst
# vector loaded once for all taps, its sums loaded and stored once per group. A tuning
# candidate only: 3x3 leaves room for 2 vectors on avx512 (1 on avx2) against the row
# kernels' 4 (3), so a pixel takes twice the passes. Zen 4, avx512, batch 8, stride 1,
# 64-byte aligned normal data, blocks of calls alternating with PyTorch's (as the
# benchmark runs), ours all_taps / row kernels, 1 / 2 threads: 32 channels on 112x112
# 1.04-1.05 / 1.04-1.09, 64 on 56x56 1.49-1.53 / 1.40, 128 on 28x28 1.50-1.52 / 1.34-1.49,
# 256 on 28x28 1.33-1.36 / 1.35-1.36; but 128 on 56x56 (25.6 MB, past the L3) 0.75-0.76 /
# 0.71-0.83, 512 on 14x14 0.90-0.92 / 0.90-0.98, 1024 on 7x7 0.98 / 0.70. Groups of 64 KB
# to a whole row block, and prefetching the rows ahead, changed none of the losses. On
# avx2 (1 vector; in-process pairs) 0.47-0.75, but 128 on 56x56 1.06-1.09.
DEPTHWISE_GROUP_KB = 512


def all_taps_vectors(config: KernelConfig) -> int:
    """Channel vectors per register tile where every (kh, kw) tap of a kd stays in
    registers (0: the taps do not fit beside one vector of diff_dst)."""
    plane_taps = prod(config.kernel[-2:])
    return min(MAX_VECTOR_BLOCK[config.isa], ACCUMULATORS[config.isa] // (plane_taps + 1))


def depthwise_weight_rows(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Channel vectors per depthwise weight-gradient row kernel: KW taps x vectors of
    sums stay in registers, next to the diff_dst vectors (and, sliding, a window of
    (KW - 1) x DW + 1 src vectors); or, all_taps, every (kh, kw) tap of a kd."""
    lanes = VECTOR_LANES[config.isa]
    vectors = -(-config.groups // lanes)
    taps_w, dilation = config.kernel[-1], config.dilations[-1]
    window = (taps_w - 1) * dilation + 1
    all_taps = all_taps_vectors(config) > 0 and bool(plan.get("all_taps", 0))
    slide = (config.strides[-1] == 1 and taps_w > 1 and window <= MAX_UNROLLED_TAPS
             and bool(plan.get("slide", 0)) and not all_taps)
    per_vector = taps_w + window + 1 if slide else taps_w + 1
    budget = REGISTERS[config.isa] if slide else ACCUMULATORS[config.isa]
    most = all_taps_vectors(config) if all_taps else budget // per_vector
    block = max(1, min(vectors, plan.get("vec_block", MAX_VECTOR_BLOCK[config.isa]), most))
    last = last_part(vectors, block)
    several = vectors > block  # vector blocks per pixel
    partial_lines = block * lanes % LINE_FLOATS != 0  # a vector block's part of a pixel
    sweep = bool(plan.get("pixel_sweep", config.strides[-1] > 1 and several
                          and partial_lines)) and not slide and not all_taps
    row_vb_inner = config.groups * 4 >= DEPTHWISE_ROW_VB_INNER_BYTES and not all_taps
    return {"vec_block": block, "vec_last": last, "several_vec_blocks": several,
            "row_vecs": [] if sweep else sorted({block, last}),  # register tiles
            "max_unrolled_taps": MAX_UNROLLED_TAPS,
            "row_vb_inner": bool(plan.get("row_vb_inner", row_vb_inner)),
            "pixel_sweep": sweep, "all_taps": all_taps,
            "group_bytes": plan.get("row_group_kb", DEPTHWISE_GROUP_KB) * 1024,
            "rows_template": ("depthwise_taps.h.j2" if all_taps else
                              "depthwise_sweep.h.j2" if sweep else "depthwise_rows.h.j2"),
            "slide_pixels": DEPTHWISE_WEIGHT_SLIDE if slide else 0}


# Depthwise data gradients with stride 1 along w run whole runs in sliding tiles of
# SLIDE_ROWS outputs x one vector: each input column is loaded once per (kd, kh) for all
# w taps (registers: the rows, KW weights and one input vector). Measured on Zen 4,
# MobileNet 3x3 layers, 1 thread: 32 channels on 112x112 22 -> 26 GFLOP/s (both paths);
# 128 on 56x56 avx2 10.6 -> 14.5; but 512 on 14x14 avx2 33 -> 21 (pixels 2 KB apart): only
# up to SLIDE_MAX_CHANNELS.
SLIDE_ROWS = {"avx512bf16": 16, "avx512": 16, "avx2": 11, "portable": 11, "neon": 16,
              "sve256": 16}
SLIDE_MAX_CHANNELS = 256
# f32 values per 64-byte cache line (results stored past the caches go in whole lines)
LINE_FLOATS = 16


def slide_rows(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Outputs per depthwise sliding tile, 0 where the kernel has none."""
    kw = config.kernel[-1]
    if not (config.depthwise and config.family != "bwd_weights" and config.strides[-1] == 1
            and kw > 1 and plan.get("slide", config.groups <= SLIDE_MAX_CHANNELS)):
        return 0
    return max(0, min(SLIDE_ROWS[config.isa], REGISTERS[config.isa] - kw - 2))


def min_thread_flops(config: KernelConfig) -> str:
    """The FLOPs of a call per thread it wakes, at least (a C literal: MIN_THREAD_FLOPS,
    or DEPTHWISE_MIN_THREAD_FLOPS for depthwise layers)."""
    if config.depthwise:
        return DEPTHWISE_MIN_THREAD_FLOPS[config.family]
    return MIN_THREAD_FLOPS
