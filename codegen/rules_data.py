"""Planner rules of the data-gradient kernels (fwd, bwd_data): direct tiles, col2im,
streaming stores, bands of rows and blocks of images (the NCX 1x1 tiles: rules_ncx).
"""

from __future__ import annotations

from collections.abc import Mapping
from math import inf, prod

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import SIMD, VECTOR_LANES
from convgrad.codegen.plan_choices import EMPTY_PLAN
from convgrad.codegen.rules_common import (
    MAX_TILE_ROWS,
    MAX_VECTOR_BLOCK,
    PARTIAL_PRODUCTS,
    WIDE_VECTOR_BLOCK,
    col2im_fills_better,
    lane_channels,
    lanes_filled,
    last_part,
    partial_steps,
    reduced_channels,
    register_tiles,
    unrolled_tiles,
    uses_bf16_dot,
    wide_vector_block,
)
from convgrad.codegen.rules_groups import LINE_FLOATS, data_across_groups

# A run of exactly one pixel more than a tile's height is one tile where the accumulators
# fit in this many of 32 registers (one may spill: cheaper than a second, short tile).
# Zen 4 avx512, 3x3 512 channels on 7x7 outputs: 88.9 -> 97.2 GFLOP/s (7x4 tiles, not 4 + 3).
# Only such a run: runs of 14-56 pixels in spilled 7x4 tiles were 1.02-1.12x slower than in
# 6-row tiles (Sapphire Rapids, 3x3 data on 28 and 56 columns, strided 1x1 on 14 and 28).
# Not on aarch64: there the 7x4 tile spilled in its inner loop (NEON and 256-bit SVE).
LONG_TILE_ACCUMULATORS = {"avx512bf16": 28, "avx512": 28}
WEIGHT_CHUNK_BYTES = 512 * 1024  # half of a 1 MB L2 (Zen 4, Sapphire Rapids: 2 MB)
# Data gradients copy their input with zero columns where the outputs are narrower than
# PAD_COLUMNS_PER_TAP x the kernel's w extent: every column then sees every w tap, so a
# row is one run of full tiles instead of one-pixel tiles at its edges (Zen 4 avx512,
# 3x3 on 14x14, 256 channels: 101.5 -> 110.1 GFLOP/s; on 7x7, 512 channels, with a long
# tile: 88.9 -> 97.2). Only where runs of each w tap cannot overlap (overlap_runs), which
# needs no copy.
PAD_COLUMNS_PER_TAP = 8
# The copy costs per input value, the gain is per multiply-add: padding is the rule only
# where a value of the input feeds at least this many (taps x vectorised channels).
# ResNeXt-101's 3-D 3x3x3 layer with 16 channels per group on 14x14 (432) ran 1.16 / 1.23
# x faster unpadded; a 5x5 dilated stride-2 layer (1200) and ResNet-50's 3x3 layers
# (2304, 4608) gain or break even padded (Zen 3 avx2, batch 8, 1 / 2 threads).
PAD_MIN_FMAS = 1024
# Channels-first data gradients copy their input into channels-last scratch (f32, or
# bf16 pairs for vdpbf16ps) and their f32 result back out; a block of images at a time,
# whose two copies take at most this many bytes (at least one image), keeps both copies
# in cache between the tiles and the transposes instead of sending the whole batch's
# through memory twice (bf16 pairs, Sapphire Rapids avx512bf16, ResNet-50 batch 8, pair
# ratios blocks / whole batch: geomean 1.067 on 1 thread, 1.031 on 2, 0.986-1.27).
IMAGE_BLOCK_BYTES = 1 << 20
# ...and bf16 weight gradients with vdpbf16ps copy src and diff_dst into pixel pairs a
# block of images at a time, the tiles summing block after block (the block depends on
# the sizes only, so results do not depend on the thread count): the pairs then stay in
# cache between the copies and the tiles. Zen 4 avx512bf16, batch 8, pair ratios blocks
# / whole batch (calls interleaved), 1 / 2 threads: NCX 1x1 64->256 and 256->64 on 56x56
# 1.18 / 1.17, 1.15 / 1.13, 128->512 on 28x28 1.14 / 1.13, 3x3 128->128 1.09 / 1.04; NXC
# 3x3 1.06 / 1.02 (NXC 1x1 stride-1 layers run the batch as one image). Not where the
# whole batch's copies take at most two blocks (1024->256 on 14x14, 4 MB: NCX 1.04 / 0.98).
WEIGHT_IMAGE_BLOCK_BYTES = 2 << 20
# ...but 1-D and 2-D f32 and f16 ones copy bands of a few rows per thread instead, the
# rows of about BAND_BYTES of input and result staying in the thread's cache between the
# transposes and the tiles (band_bytes). Zen 4, ResNet-50 NCX batch 8, pair ratios bands
# of 512 KB / blocks of images (1 MB), 1 / 2 threads: avx2 3x3 64 on 56x56 1.05 / 1.05,
# 128 on 28x28 1.04 / 1.03, 256 on 14x14 1.03 / 1.01, 1x1 stride 2 256->512 1.29 / 1.32,
# 256->128 1.64 / 1.70, 512->1024 1.23 / 1.20, 1024->512 1.22 / 1.10; avx512 1.00 / 1.02,
# 1.04 / 1.04, 1.01 / 0.98, 1.03 / 1.07, 1.07 / 1.06, 1.08 / 0.96, 1.12 / 1.06. Bands of
# 256 KB: the same on 3x3 layers, 4-10% slower on the strided ones (two rows a band,
# each band reading all the weights again).
BAND_BYTES = 512 << 10
# ...not where the weights exceed this many bytes (f32): each band reads all of them
# again (512 -> 2048 1x1 stride 2, 8 MB: avx2 1.09 / 1.01, avx512 0.97 / 0.97; 3x3 512
# on 7x7, 9 MB: 1.00 / 1.00, 1.02 / 1.02, and in a slower phase of the VM 0.92 on 2
# threads).
BAND_MAX_WEIGHT_BYTES = 4 << 20
# ...but f32 1x1 backward-data kernels with strides (those that reduce more channels than
# the compact copy takes, rules_ncx.NCX_MAX_REDUCED) take bands of this many bytes,
# whatever their weights' size: their rows are wide and their weights 2-8 MB, which
# bands of 512 KB read again every two or three rows. Zen 4, ResNet-50 NCX batch 8,
# pair_plans ratios 2 MB bands / the rule's before (512 KB bands; image blocks for 8 MB of
# weights), 1 / 2 threads, two runs: avx512 res4a_branch1 (1024 -> 512 channels on
# 28x28, 2 MB) 1.09-1.10 / 1.10-1.11, res5a_branch1 (2048 -> 1024 on 14x14, 8 MB) 1.05 /
# 1.00; avx2 1.00-1.01 / 1.01, 1.09 / 1.09-1.10 (1 MB and 4 MB bands read alike, within
# 2 %). Forward convolutions keep the rule's (2 MB: 0.95-1.03), as do 3x3 layers (0.96-1.03).
STRIDED_POINT_DATA_BAND_BYTES = 2 << 20
# 1x1 stride-1 data gradients run all the vector blocks of a block of pixels together
# (the input read once) while their weights take at most this; larger weights go vector
# block by vector block over all pixels. 1 MB weights (1024 <-> 256 channels) gain
# together: ResNet-50 res4a_branch2c / res4b_branch2a at batch 8, pair ratios on Zen 3
# avx2 1.13 / 1.04 (1 thread), 1.02 / 1.08 (2); the AOT tuner's pick on Zen 3 avx2
# (1.12, 1.30) and Zen 4 avx512 (1.12, 1.20). 4 MB (2048 <-> 512) lose: 0.92-0.98.
POINT_VB_INNER_BYTES = 1024 * 1024
# Data gradients by rows with one tap (1x1 strided, or padded) run each output row's
# vector blocks one after the other where a pass's weights (every vector block's) take at
# most this, so the row's input comes from memory once per pass rather than once per
# vector block (each input value feeds only a vector block's multiply-adds); else each
# vector block goes over every row of a thread's share (its weights stay in L2).
# Sapphire Rapids, ResNet-50 batch 8, pair ratios rows / vector blocks outer, avx512 /
# avx2, 1 thread: 1x1 stride 2 256<-512 (512 KB of weights) 1.16 / 1.14, 128<-256 1.19
# / 1.37, 256<-512 1.16 / 1.16 (2 threads 1.09-1.40; NCX 1.04-1.10); but 2 MB lose
# (512<-1024 0.89 / 0.95, 1024<-2048 0.59 / 0.65). Kernels of 9 taps reuse each input
# value 9 times per vector block: 3x3 on 64 and 128 channels 0.98-1.01, 256: 0.98 / 0.82.
ROW_VB_INNER_BYTES = 1024 * 1024
# 1x1 stride-1 data gradients without pads (pointwise.h.j2) read a block of pixels' input
# from memory in its first vector block (the others find it in the caches), with
# accesses the hardware prefetchers follow poorly where the input outgrows L3: where a
# group has at most this many vector blocks, each step of a tile also fetches a piece of
# the next tile's input (the pixels after its own). Zen 4 avx512, ResNet-50 NXC batch 8,
# pair ratios fetching / not, 1 and 2 threads: fwd 256 -> 64 at 56x56 (1 block) 1.15 /
# 1.12, 512 -> 128 (2) 1.02 / 1.01; data 64 <- 256 (1) 1.14 / 1.06, 128 <- 512 (2) 1.02 /
# 1.03; 64 -> 64 1.00 / 0.99 (its input fits L3). With 4 and more blocks the fetches
# are mostly of cached lines: 0.99-1.03 (fwd 64 -> 256 0.99 / 0.99). The avx2 path's
# tiles gain at any count of blocks: fwd 256 -> 64 1.25 / 1.24, 64 -> 256 (8 blocks)
# 1.02 / 1.02, 512 -> 128 1.07 / 1.03, 1024 -> 256 1.01 / 1.00; data 64 <- 256 1.25 /
# 1.23, 256 <- 64 1.02 / 1.01, 128 <- 512 1.06 / 1.02-1.04. Not measured off x86: none.
POINT_PREFETCH_BLOCKS = {"avx512bf16": 2, "avx512": 2, "avx2": inf}
# Multiply steps per iteration of a tile's reduction loop (over reduced channels in the
# direct tiles, over pixels in the weight-gradient tiles): a step of a 4 x 3 avx2 tile is
# 12 FMAs beside 7 loads, and the loop's own adds and compare-and-branch take issue slots
# the FMAs need. Sapphire Rapids, ResNet-50 NXC, 1 thread, pair ratios unrolled / not:
# data 0.98-1.10 on avx512 and avx2 (3x3 1.01-1.08), weights 0.98-1.07; NCX, 2 threads
# and widened bf16 alike. Only tiles whose accumulators,
# vector operands and broadcast register (GCC broadcasts into one on avx512 too) fit the
# register file unroll: 3 x 4 on avx2 (17 registers) spills, 0.75 of its speed unrolled;
# avx512's 7 x 4 long tile spills one accumulator either way, and runs the same unrolled.
# x86 only: on aarch64 (not measured) GCC's unrolled 6 x 4 SVE tile spills.
STEP_UNROLL = {"avx512bf16": 4, "avx512": 4, "avx2": 4}


def direct_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Register blocking of the direct-convolution tiles (fwd and bwd_data): output
    pixels x vectors of the vectorised channels per tile."""
    lanes = VECTOR_LANES[config.isa]
    across = config.depthwise or data_across_groups(config, plan)  # lanes over all groups
    channels = lane_channels(config) if across else config.vector_channels
    vectors = -(-channels // lanes)
    rule = MAX_VECTOR_BLOCK[config.isa]
    if wide_vector_block(config, across):
        rule = WIDE_VECTOR_BLOCK[config.isa]
    if may_stream(config, plan):
        rule = STREAM_VECTOR_BLOCK.get(config.isa, rule)
    block = min(vectors, plan.get("vec_block", rule))
    last = last_part(vectors, block)
    rows, rows_last, tiles = register_tiles(config.isa, block, last, not across, plan)
    # Reduced channels per pass: that chunk's weights for every tap stay in L2.
    reduced = reduced_channels(config)
    taps = prod(config.kernel)
    elem_bytes = 2 if uses_bf16_dot(config, plan) else 4
    chunk_bytes = plan.get("weight_chunk_kb", WEIGHT_CHUNK_BYTES // 1024) * 1024
    most = max(16, chunk_bytes // (taps * block * lanes * elem_bytes))
    # Near-equal chunks of whole pairs: 256 channels go as 128 + 128, not 226 + 30 (a
    # short last pass pays a whole pass's tile overhead for little work).
    passes = -(-reduced // most)
    chunk = -(-reduced // passes)
    chunk += chunk % 2 if passes > 1 else 0
    pass_weights = config.groups * vectors * lanes * chunk * elem_bytes  # per tap
    long_tile = rows + 1 if (rows + 1) * block <= LONG_TILE_ACCUMULATORS.get(config.isa, 0) and (
        not across and rows < MAX_TILE_ROWS) else 0
    if long_tile:
        tiles = list(dict.fromkeys([(long_tile, block), (long_tile, last), *tiles]))
    return {"tile_rows": rows, "tile_rows_last": rows_last, "vec_block": block,
            "vec_last": last, "tiles": tiles,
            "long_tile": long_tile,
            # tiles across groups are depthwise.c.j2's, whose loops run over taps
            "step_unroll": plan.get("step_unroll", STEP_UNROLL.get(config.isa, 1)),
            "unrolled_tiles": [] if across else unrolled_tiles(config.isa, tiles),
            "reduce_chunk": chunk, "partial_steps": partial_steps(config, plan),
            # 1x1 stride 1: a run-time check for zero pads then flattens all pixels
            "pointwise": config.pointwise,
            "point_prefetch": config.pointwise and bool(plan.get(
                "point_prefetch", -(-vectors // block) <= POINT_PREFETCH_BLOCKS.get(
                    config.isa, 0))),
            # ...and runs the vector blocks of a block of pixels together where all the
            # weights take at most POINT_VB_INNER_BYTES (Zen 4 avx2, 1x1 64<-256: 51 -> 81
            # GFLOP/s), else each vector block over all pixels (avx512 2 threads,
            # 2048<-512, 4 MB: 153 -> 198)
            "point_vb_inner": bool(plan.get("point_vb_inner",
                                            pass_weights <= POINT_VB_INNER_BYTES)),
            # Other layers go row by row, likewise for one tap (ROW_VB_INNER_BYTES).
            "row_vb_inner": bool(plan.get(
                "row_vb_inner", taps == 1 and not across and -(-vectors // block) > 1
                and pass_weights <= ROW_VB_INNER_BYTES))}


# Backward data with few result channels per pixel (conv1 of an image network: 3 of 8
# lanes) leaves most lanes of the direct tiles empty. col2im.c.j2 multiplies each
# diff_dst pixel by every tap's weights at once, a matrix product whose columns are the
# TAPS x CIN (tap, channel) pairs in whole vectors, then adds each pixel's columns into
# the result pixels its taps reach. The rule takes it where the direct tiles' vectors
# would be partly empty (fewer result channels than a vector, or at most
# COL2IM_MAX_FILL of their lanes used) and the columns fill more of theirs (not 1x1).
# Zen 4, batch 8, 1 thread, GFLOP/s col2im / direct (avx2 path): 7x7 s2 3 <- 64
# (conv1) 87 / 29, 3x3 1 <- 64 47 / 9, 3x3 7 <- 64 94 / 68, 3x3 12 <- 256 99 / 75,
# 3x3 20 <- 64 96 / 86; full vectors lose: 3x3 16 <- 64 101 / 109, 5x5 16 <- 64 105 /
# 116 (avx512: 106 / 120), 3x3 40 <- 64 (83% full) 100 / 102.
COL2IM_MAX_FILL = 0.75
# diff_dst pixels per block of columns: the block's columns stay in L1 between the tiles
# and the additions into the result (conv1 on avx2: 32 x 152 floats, 19 KB)
COL_PIXELS = 32
# Column vectors per block (_col2im_block): Zen 4 avx2, 1 thread, 3 repeats, GFLOP/s
# by block of 2 / 3 / 4 vectors: conv1 (19 vectors: 3 leaves one) 83.8 / 82.5 / 88.5;
# 3x3 s2 3 <- 64 (4 vectors) 61.2 / 63.2 / 69.9; 3x3 4 <- 64 (5) 83.1 / 86.1 / 78.2;
# 3x3 12 <- 256 (14; 4 x 256 reduced channels take 32 KB) 85.8 / 84.8 / 82.3.
COL2IM_BLOCK_BYTES = 24 * 1024


def weight_packing(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> str:
    """How direct.c.j2 repacks the user's weights (pack_weights_<this>.h.j2), by the axis
    contiguous in the user's layout: "v_rows" (vector channels: a vector at a time),
    "r_rows" (reduced channels: VL x VL blocks transposed in registers), "tap_rows"
    (taps: VL x TAPS blocks transposed), "v_pairs" and "tap_pairs" (bf16 pairs of rows
    contiguous in vector channels or taps: two rows interleaved, then as v_rows or
    tap_rows) or "values" (other bf16 pairs the user's layout does not hold together: one
    value at a time). Transposing in registers ran about 4x faster than value by value
    (3x3 512 x 512 of backward data, Zen 4: 3.3 -> ~0.9 ms); value by value, 1x1 1024 ->
    2048 OIX took 1 ms longer than XIO on Sapphire Rapids, and bf16 OXI 3x3 512 x 512 on
    4x4 pixels ran at 0.40x of torch, v_pairs at 1.13x (Zen 4, 1 thread; OIX by value
    0.55x, tap_pairs 1.09x)."""
    vector, reduced = ("I", "O") if config.family == "bwd_data" else ("O", "I")
    inner = {"XIO": "O", "OXI": "I",
             "OIX": "X" if prod(config.kernel) > 1 else "I"}[config.weights_format]
    if uses_bf16_dot(config, plan):  # pairs of reduced channels as 32-bit words
        if inner in (vector, "X"):  # two rows interleaved (and transposed, for taps)
            return "v_pairs" if inner == vector else "tap_pairs"
        pairs = inner == reduced and reduced_channels(config) % 2 == 0
        return "r_rows" if pairs else "values"
    return {vector: "v_rows", reduced: "r_rows", "X": "tap_rows"}[inner]


def col2im_eligible(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """Whether col2im.c.j2 can compute this configuration: backward data of one group
    (f32 sums, not bf16 pairs) whose columns fill at least one vector."""
    return (config.family == "bwd_data" and config.groups == 1
            and not uses_bf16_dot(config, plan)
            and prod(config.kernel) * config.cin_per_group >= VECTOR_LANES[config.isa])


def col2im(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """Whether this backward data runs by col2im (col2im_eligible; by rule where the
    columns fill more lanes and the result channels are fewer than a vector's lanes or
    fill at most COL2IM_MAX_FILL of their vectors)."""
    lanes, channels = VECTOR_LANES[config.isa], config.cin_per_group
    rule = col2im_fills_better(config) and (
        channels < lanes or lanes_filled(channels, lanes) <= COL2IM_MAX_FILL)
    return col2im_eligible(config, plan) and bool(plan.get("col2im", rule))


def _col2im_block(config: KernelConfig, vectors: int) -> int:
    """Column vectors per block by rule: the widest block (avx2: 4, as 3 x 4 tiles) that
    leaves no last block of one vector (its tiles broadcast once per multiply-add) and
    whose weights take at most COL2IM_BLOCK_BYTES per pass (in L1)."""
    isa = config.isa
    for block in range(WIDE_VECTOR_BLOCK.get(isa, MAX_VECTOR_BLOCK[isa]), 1, -1):
        weights = config.cout_per_group * block * VECTOR_LANES[isa] * 4
        if vectors % block != 1 and weights <= COL2IM_BLOCK_BYTES:
            return block
    return MAX_VECTOR_BLOCK[isa]


def col2im_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Register tiles of col2im.c.j2: diff_dst pixels x vectors of columns."""
    vectors = -(-prod(config.kernel) * config.cin_per_group // VECTOR_LANES[config.isa])
    block = min(vectors, plan.get("vec_block", _col2im_block(config, vectors)))
    last = last_part(vectors, block)
    rows, rows_last, tiles = register_tiles(config.isa, block, last, True, plan)
    return {"vec_block": block, "vec_last": last, "tile_rows": rows,
            "tile_rows_last": rows_last, "tiles": tiles,
            "col_pixels": plan.get("col_pixels", COL_PIXELS),
            "partial_steps": PARTIAL_PRODUCTS}


# Depthwise data gradients store results of at least STREAM_MIN_KB past the caches: with
# one multiply-add or few per value they wait on memory, and an ordinary store first reads
# each line it writes. The tiles then write whole 64-byte lines (LINE_FLOATS), a partial
# one would go to memory twice: on avx2, blocks of STREAM_VECTOR_BLOCK vectors. Zen 4,
# MobileNet batch 8, 1 thread, caches flushed, ordinary / streamed: 64 channels on 112x112
# stride 2 (25.7 MB result) avx2 4.4 / 1.4 ms, avx512 3.0 / 1.6; 128 on 56x56 (12.8 MB)
# 4.4 / 3.0, 4.2 / 3.3; 256 on 28x28 stride 2 (6.4 MB) 0.85 / 0.49. But a result that
# stays in the last-level cache for its next reader is better written there: in the
# benchmark (PyTorch's calls between ours), 2 threads, that last layer ran at 38-47
# GFLOP/s ordinary and 25 streamed (memory-bound at ~28 GB/s on this VM). So from 8 MB.
#
# 1x1 data gradients (direct.c.j2) stream too: they have the fewest multiply-adds per
# result value (the reduced channels), and with strides three quarters of a result are
# zeros, which cost no multiply-add at all. Zen 4, ResNet-50 NXC batch 8, pair ratios
# streamed / ordinary stores (avx2: blocks of 4 / 3 vectors), 1 / 2 threads: res3a_branch2a
# (1x1 s2, 128 -> 256 channels, 25.7 MB) avx2 1.54-1.55 / 1.55-1.56, avx512 1.51-1.53 /
# 1.47; res4a_branch2a (12.8 MB) 1.28-1.30 / 1.25-1.26, 1.15 / 1.08; res3a_branch1 1.05-1.06
# / 1.06-1.08, 1.10 / 1.09; res4a_branch1 1.12 / 1.11, 1.04 / 1.04; on avx512 stride-1
# res2b_branch2a (64 -> 256, 25.7 MB) 1.13 / 1.12 and res3b_branch2a (12.8 MB) 1.07 / 1.06.
# A result its next reader then finds in memory rather than in the last-level cache
# (threshold_backward right after each call) still gains on these, by 3-25% in all; but
# on avx2 the stride-1 kernels store at the pace of their multiply-adds (1.00-1.02 alone)
# and lose 2-6% with their reader: on avx2 only strided data gradients (with zeros)
# stream. 6.4 MB results gained 0-10% alone and lost up to 9% with their reader: the
# threshold stays at 8 MB. (The 4-vector blocks cost avx2's res5a_branch2a and
# res5a_branch1, 6.4 MB, 1-4% where they do not stream.)
# The forward convolutions' 1x1 kernels (fwd, the same template) do not stream: their
# result is the next layer's input, and without zeros they do enough multiply-adds per
# value. Sapphire Rapids avx512, ResNet-50 NXC batch 8, pair ratios ordinary / streamed,
# 1 / 2 threads: res3a_branch1 (1x1 s2, 256 -> 512, 12.8 MB) 1.27-1.28 / 1.30,
# res2a_branch1 (64 -> 256 on 56x56, 25.7 MB) 1.05 / 1.02-1.03. On Zen 4 (avx512) the
# same kernels alone gain by streaming (pair ratios streamed / ordinary, 1 / 2 threads:
# res2a_branch1 1.32-1.37 / 1.30-1.35, res3a_branch2c 1.03-1.05 / 1.15-1.17, other 12.8
# MB results 0.97-1.03), but not in a training step whose next op reads the result:
# ResNet-50 224x224 batch 8, 2 threads, torch.nn / convgrad step ratios, 4 alternated
# runs each, streamed 1.05-1.10 (median 1.05), ordinary 1.02-1.13 (median 1.11).
STREAM_MIN_KB = 8192
STREAM_VECTOR_BLOCK = {"avx2": 4}
STREAM_STRIDE_1_LANES = (16,)


def may_stream(config: KernelConfig, plan: Mapping[str, int]) -> bool:
    """Whether a data gradient's tiles may store its result past the caches: f32
    channels-last, written in place, in whole cache lines of every pixel (channels a
    multiple of a line), with non-temporal stores (x86); depthwise or across-group
    kernels (whose sliding tiles, which store one vector of each pixel at a time, then
    run only on results that do not stream), and 1x1 backward-data kernels of one group's
    channels (direct.c.j2), with strides or on STREAM_STRIDE_1_LANES (see STREAM_MIN_KB)."""
    across = config.depthwise or data_across_groups(config, plan)
    lines = (lane_channels(config) if across else config.vector_channels) % LINE_FLOATS == 0
    zeros = config.family == "bwd_data" and any(s > 1 for s in config.strides)
    pointwise = prod(config.kernel) == 1 and config.family == "bwd_data" and (
        zeros or VECTOR_LANES[config.isa] in STREAM_STRIDE_1_LANES)
    return (config.family != "bwd_weights" and config.dtype == "f32"
            and (across or pointwise)
            and config.data_format == "NXC"
            and SIMD[config.isa] != "generic" and lines
            and plan.get("stream_kb", STREAM_MIN_KB) > 0)


def stream_min_bytes(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Result bytes from which a depthwise.c.j2 kernel's tiles store past the caches (0:
    never): where may_stream and each vector block spans whole cache lines."""
    if not may_stream(config, plan):
        return 0
    if direct_tiles(config, plan)["vec_block"] * VECTOR_LANES[config.isa] % LINE_FLOATS:
        return 0
    return plan.get("stream_kb", STREAM_MIN_KB) * 1024


def pad_columns_below(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Output widths below which a data gradient pads its input's rows (0: never). Only
    where each copied value feeds at least PAD_MIN_FMAS multiply-adds; so not depthwise
    layers: one load per multiply-add, the copy costs more than the one-pixel tiles
    (Zen 4 avx512, 512 channels on 14x14: 32.9 GFLOP/s unpadded, 26.8 padded)."""
    extent = (config.kernel[-1] - 1) * config.dilations[-1]
    pays = not config.depthwise and prod(config.kernel) * config.vector_channels >= PAD_MIN_FMAS
    if uses_bf16_dot(config, plan) or not plan.get("pad_columns", pays):
        return 0
    return PAD_COLUMNS_PER_TAP * extent


def overlap_runs(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """Whether a direct data gradient runs each w tap over every column it reaches, runs
    overlapping (runs.h.j2), where each phase of a row has a tap that reaches all its
    columns (then no narrow row is padded either). f16/bf16 channels-last results then
    round a row once all its runs have added, not in the tiles.

    Sapphire Rapids, ResNet-50 NXC batch 8, pair ratios overlapping / disjoint runs (or
    padded rows where narrow), 1 / 2 threads: 3x3 on 28 columns 1.08 / 1.08 (avx512),
    1.06 / 1.06 (avx2); 56 columns 0.99 / 1.01, 1.10 / 1.14; 14 columns (padded before)
    1.01 / 1.01, 1.05 / 1.04; 7 columns 1.09 / 1.08, 1.08 / 1.07."""
    return bool(plan.get("overlap_runs", 1))


def band_bytes(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Bytes of input and result rows per band of a channels-first data gradient that
    copies, computes and copies back a few rows at a time (ncx_bands.h.j2: BAND_BYTES, or
    STRIDED_POINT_DATA_BAND_BYTES); 0: blocks of whole images (image_block_bytes). Not
    for 3-D layers (a band of rows reads rows of several planes), 1x1 stride-1 layers
    (their tiles run over all of an image's pixels at once) or bf16 pairs (their own
    copies)."""
    eligible = (config.data_format == "NCX" and config.family != "bwd_weights"
                and config.rank <= 2 and not config.pointwise
                and not uses_bf16_dot(config, plan))
    weight_bytes = (prod(config.kernel) * config.groups * config.cin_per_group
                    * config.cout_per_group * 4)
    if _strided_point_data(config):
        rule = STRIDED_POINT_DATA_BAND_BYTES
    else:
        rule = BAND_BYTES if weight_bytes <= BAND_MAX_WEIGHT_BYTES else 0
    return plan.get("band_kb", rule >> 10) << 10 if eligible else 0


def _strided_point_data(config: KernelConfig) -> bool:
    """Whether this is an f32 1x1 backward data with strides (STRIDED_POINT_DATA_BAND_BYTES)."""
    return (config.family == "bwd_data" and config.dtype == "f32"
            and prod(config.kernel) == 1 and any(s > 1 for s in config.strides))


def image_block_bytes(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Bytes of copies per block of images: input and result copies a channels-first
    data gradient copies in, computes and copies out before the next (unless it goes by
    bands of rows); the pixel pairs a bf16 weight gradient with vdpbf16ps copies and sums
    before the next (0: the whole batch at once)."""
    if config.family == "bwd_weights":
        rule = WEIGHT_IMAGE_BLOCK_BYTES if uses_bf16_dot(config, plan) else 0
    else:
        rule = IMAGE_BLOCK_BYTES if config.data_format == "NCX" and not band_bytes(
            config, plan) else 0
    return plan.get("image_block_kb", rule >> 10) << 10 if rule else 0


def rounds_in_tiles(config: KernelConfig) -> bool:
    """f16/bf16 channels-last results: the last chunk's tiles round into the user's
    tensor, with no f32 pass over the whole result."""
    return (config.dtype != "f32" and config.data_format == "NXC"
            and config.family != "bwd_weights" and not config.depthwise)
