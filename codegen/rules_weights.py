"""Planner rules of the weight-gradient kernels: register tiles, chunks, slices,
packed panels, reading in place and the NCX dot-product kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import gcd, prod

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import VECTOR_LANES
from convgrad.codegen.plan_choices import EMPTY_PLAN
from convgrad.codegen.rules_common import (
    ACCUMULATORS,
    MAX_VECTOR_BLOCK,
    kernel_extents,
    last_part,
    near_equal,
    partial_steps,
    power_of_two_floor,
    unrolled_tiles,
    uses_bf16_dot,
    weight_sums_bytes,
)
from convgrad.codegen.rules_data import STEP_UNROLL, image_block_bytes

# 1x1 weight gradients on avx2 take tiles of 6 input channels x 2 vectors rather than
# 4 x 3. Zen 3, batch 8, pair ratios 2 vectors / 3 over ResNet-50's 12 1x1 layers, NXC:
# 0.99-1.13 (geomean 1.05 on 1 and on 2 threads), largest where 3-vector blocks leave a
# last block of one vector (128, 512, 2048 output channels); the tuner chose 2 for 1x1
# layers on Zen 4's avx2 path too. Other layers keep 3 (2 measured 0.89-1.09 on 3x3
# layers of 64-512 outputs), but:
POINTWISE_WEIGHT_VECTOR_BLOCK = {"avx2": 2}
# avx2 weight gradients where blocks of 3 vectors would leave a last block of one and
# blocks of 2 none take 2, up to this many vectors (4, 10, 16: 32, 80, 128
# output channels per group): the one-vector tile runs at about half speed. Zen 4, batch
# 8, interleaved pair ratios 2 / 3 vectors, 1 / 2 threads: 3x3 64->32 on 56x56 1.15-1.17 /
# 1.04-1.05 (NCX 1.15-1.17 / 1.12-1.16), 32->32 on 112x112 1.09-1.12 / 1.08-1.11, ResNeXt
# conv_3d:6 and :11 (3x3x3, 16->32 per group) 1.13-1.19 / 1.16-1.22, conv1d:6 (k3,
# 32->32) 1.12 / 1.16, 128->80 on 28x28 1.03-1.06 / 0.99-1.02, 128->128 1.04 / 1.01 (NCX
# 1.03 / 1.01-1.02), dilated_conv:21 (64->128) 1.04 / 1.03; with 3 input channels, whose
# (kw, channel) rows then fill 6-row tiles, 3x3 stride 1 on 112x112 0.93 / 1.16, stride 2
# 1.19 / 1.19, 7x7 stride 2 1.34 / 1.40. Not 64 vectors (3x3 512 on 7x7: 0.88 / 0.97).
ONE_VECTOR_TAIL_MAX_VECTORS = {"avx2": 16}
# ...and 1x1 f32 channels-last weight gradients on 16-lane paths with this many output
# channels (8-16 vectors): 13 x 2 tiles rather than 6 x 4. Sapphire Rapids avx512, batch
# 8, pair ratios 2 / 4 vectors, 1 / 2 threads: 64->256 1.13 / 1.13, 512->128 1.15 / 1.13,
# strided 256->128 1.07 / 1.07, strided 512->256 1.06 / 1.09, 1024->256 0.99 / 1.02; not
# 64 outputs (256->64 0.96 / 0.96) nor 512 and more (0.98-1.02).
NXC_POINTWISE_MID_COUT = (128, 256)
# Weight-gradient chunks: every tile passes over one chunk of diff_dst rows before the
# next. Where all the weight sums stay in L2, a chunk is about CHUNK_PIXELS pixels, so
# its rows stay in L1 (tiles over 25088 pixels on Ice Lake, 64-512 channels: chunks of
# 64-128 pixels run 1.3-2.5x faster than 1024-4096). Larger sums would then stream from
# L3 once per chunk: chunks hold CHUNK_BYTES of rows instead, or half the sums' bytes if
# more (Ice Lake, 1x1 512->2048, 4 MB of sums: 0.57 -> 0.90 of PyTorch on AVX2 with
# 2 MB chunks rather than 1 MB).
CHUNK_PIXELS = 128
# ...but 64 for avx512 NXC layers read in place, which fetch their next chunk ahead
# (Sapphire Rapids, ResNet-50 batch 8, pair ratios 64 / 128 on 1 / 2 threads: 1x1
# 64->64 1.16 / 1.18, 64->256 1.08 / 1.06, 256->64 1.08 / 1.05; avx2 0.94-0.99).
NXC_IN_PLACE_CHUNK_PIXELS = {16: 64}
# ...and NCX_LIGHT_CHUNK_PIXELS for f32 channels-first layers with at most NCX_LIGHT_MACS
# multiply-adds per output pixel: their tiles' work per chunk is small beside what each
# chunk costs (the copies of each channel's run of the chunk's pixels, a tile call's
# sums). Zen 4, batch 8, 56x56, pair ratios 512 / 128 on 1 / 2 threads: avx2 1x1 64->64
# 1.09-1.11 / 1.18, 256->64 1.07-1.08 / 1.14, 64->256 1.07-1.08 / 1.14-1.16; avx512
# 64->64 1.03-1.06 / 1.09-1.10, 256->64 1.03-1.05, 64->256 1.03-1.04 / 1.15; 7x7 3->64
# stride 2 (224x224) 1.02-1.04 / 1.02-1.08. Not heavier 1x1 layers (512->128 on 28x28
# 0.99 / 0.98; 512->256 stride 2 on avx2 0.87 in a later session); nor NXC layers (avx2
# 0.84-1.00, avx512 0.68-0.91), nor bf16 pairs (no effect beyond the spread of one plan
# timed twice). But f32 channels-first layers whose rows overlap along d or h take them
# whatever their work per pixel (src read in place, diff_dst transposed by chunk). First
# measured at 1.00-1.02 / 0.99-1.00 (3x3 64->64) and 0.93-0.98 (128->128); with the
# 2-vector blocks of 64 outputs (ONE_VECTOR_TAIL_MAX_VECTORS), Zen 4, batch 8, pair
# ratios on 1 / 2 threads, avx2: 3x3 64->64 on 56x56 1.03-1.05 / 1.01-1.05, 128->128 on
# 28x28 1.03 / 1.01-1.02; avx512 1.02-1.03 / 1.03-1.06, 1.01 / 1.00-1.02.
NCX_LIGHT_CHUNK_PIXELS = 512
NCX_LIGHT_MACS = 16384
# Few input channels, kw taps flattened into tile rows (conv1): 16-lane paths take tiles
# of 2 output vectors where those rows split into tiles of near-equal height
# (_flatten_vector_block). Sapphire Rapids avx512, batch 8, pair ratios 2 / the rule's 4
# or 3 vectors on 1 / 2 threads: 3 -> 48-128 channels, 7x7 stride 2 (21 rows: 12 + 9)
# 1.14-1.16 / 1.15-1.23 (ResNet-50's conv1 1.17 / 1.18, the 1-D set's 1.15 / 1.15);
# 3x3, 3 -> 64 (9 rows) 1.16 / 1.06, 3 -> 48 1.04 / 1.00; but 5x5 with 3 channels (15
# rows: 12 + 3) 0.79-0.82.
FLATTEN_VECTOR_BLOCK = {16: 2}
# ...only below this many input channels per group: from 8 on avx512 (6 on avx2) tiles of
# one tap's channels, packed, run faster. Sapphire Rapids, batch 8, 1 thread, pair ratios
# flattened / not, 3x3 and 3x3x3 layers with 16-32 outputs per group: avx512 4-5 channels
# 0.63-0.82, 6 0.93-1.04, 7 0.89, but 8 1.20-1.35 (ResNeXt conv_3d:4 1.30, 1.01 on 2
# threads) and 12 1.31; avx2 (8 outputs) 4 channels 0.61-0.72, 6 1.00-1.18.
FLATTEN_BELOW_CHANNELS = {"avx512bf16": 8, "avx512": 8, "avx2": 6}
SUMS_IN_L2_BYTES = 640 * 1024  # half of Ice Lake-SP's 1.25 MB L2
CHUNK_BYTES = 1024 * 1024
# ...but weight gradients packed into panels whose rows overlap along d or h (each src
# row packed once per chunk: _slot_steps) take chunks of this many pixels, whatever the
# sums: a chunk of more rows packs fewer src rows per output row (3x3 stride 1: 4 for 2
# rows, 10 for 8) and runs each tile longer. Zen 4, batch 8, pair ratios 512 / the rules'
# 128 pixels (or bytes), 1 / 2 threads, avx2 NXC: ResNet-50 3x3 64 on 56x56 1.04-1.05 /
# 1.07-1.10, 128 on 28x28 1.03-1.04 / 1.01-1.02, 256 on 14x14 1.00 / 1.00, 512 on 7x7
# 1.07-1.08 / 1.04, conv1 1.05 / 1.35, dilated_conv:18, :21, :24, :25 1.07, 1.02, 1.02,
# 1.04 / 1.14, 1.06, 0.99, 1.02, 3d_conv_pad:1 1.06 / 1.41, ResNeXt conv_3d:4 and :8
# 1.03-1.04, 1.22 / 1.06, 1.51, gconv 3d 0.99-1.01 / 1.00-1.03; avx2 NCX 256 on 14x14 and
# 512 on 7x7 1.00, 1.03 / 1.01; avx512 ResNeXt conv_3d:8 1.18-1.21 / 1.16-1.27 (NCX :4,
# :6, :11 1.01, 1.01, 0.99 / 1.02, 1.00, 1.11), 3d_gconv_channel-block-8 0.96 / 1.09,
# NCX 512 on 7x7 1.00 / 0.99, NXC 64-512 channels forced packed 1.00-1.02.
PACKED_OVERLAP_CHUNK_PIXELS = 512
# Weight gradients whose sums stay in L2 split their pixels into up to MAX_SLICES slices
# (a power of two, so 2, 4, 8 threads share them evenly)
# of at least SLICE_MIN_PIXELS, each summed on its own and added in order at the end
# (the count never depends on the threads): threads then share a layer with few tiles
# without each packing the same panels. The slices' sums take at most SLICE_SUMS_BYTES.
# Layers of few tiles take more slices, up to MOST_SLICES, until there are SLICE_ITEMS
# (slice, tile) items: 4 a thread on 64 threads, so that part_range's shares differ by at
# most a quarter of the mean (ResNet-50 res2a_branch2a, batch 32: 8 slices of 11 tiles
# split 1.47x the mean on 43 threads, 32 slices 1.15 or less up to 64). Slices beyond
# MAX_SLICES keep MANY_SLICE_PIXELS each (so batches of the layers' pixels that few threads
# share keep 8): on 1 and 2 threads a slice costs its sums' zeroing and adding (Zen 4,
# batch 8, pair ratios 8 / 16 slices, 1 / 2 threads: res2a_branch2a NCX 1.005-1.052 /
# 1.027-1.043, NXC 0.996-1.017 / 0.991-1.010; conv1 NCX 0.957-0.987 / 0.976-1.026).
MAX_SLICES = 8
MOST_SLICES = 64
SLICE_ITEMS = 256
SLICE_MIN_PIXELS = 1024
MANY_SLICE_PIXELS = 3 * SLICE_MIN_PIXELS
SLICE_SUMS_BYTES = 2 * 1024 * 1024
# Rows of weight sums a multiple of this many floats (2 KB) apart are padded by a vector.
SUMS_ROW_ALIAS_FLOATS = 512
# Weight gradients use packed panels where a packed value feeds this many FMAs.
PACKED_MIN_FMAS = 4
# Output channels from which an f32 weight gradient keeps its sums in workspace rather than
# in the user's weights, by vector lanes (_sums_in_output_eligible).
SUMS_IN_OUTPUT_MAX_ROW = {8: 2048}
# Channels-first (NCX) weight gradients read src in place (tiles broadcast along its
# rows, diff_dst transposed by chunk) where they have at most as many output as input
# channels and sums of at most NCX_IN_PLACE_MAX_SUMS bytes (by vector lanes); else
# they pack both. Sapphire Rapids, batch 8, 1 thread, ResNet-50, time in place /
# packed (panels of diff_dst transposed VL x VL in registers): avx512 64->64 0.79,
# 256->64 0.77, 512->128 0.91, 1024->256 0.89, 3x3 64->64 0.89, but 128->512 1.08,
# 256->1024 1.05, 2048->512 (4 MB of sums) 1.07, 3x3 256->256 1.13, strided 1x1
# 256->512 .. 1024->2048 1.09-1.42; avx2 64->64 and 256->64 0.89, 3x3 64->64 0.98, but
# 512->128 1.05, 1024->256 1.26, 512->256 1.20, 3x3 128->128 1.16, 128->512 1.20.
# On AMD's cores the avx2 path reads in place while the sums stay in L2: Zen 4, batch 8,
# pair ratios packed / in place on 1 / 2 threads: 3x3 64->64 on 56x56 0.95-0.97 /
# 0.94-0.95, 3x3 128->128 on 28x28 0.87-0.91 / 0.90-0.91, 1x1 on 28x28 256->128
# 0.87-0.88 / 0.83-0.86, 512->128 0.84 / 0.85 (bf16 0.86-0.87 / 0.89-0.90), 512->256
# 0.96 / 0.93-0.97 (14x14 0.94-0.97 / 0.87-0.88), stride 2 256->128 0.89-0.90 / 0.90-0.91;
# but 1024->256 (1 MB) 1.32-1.33 / 1.45-1.52. On avx512, f32 kernels of several taps
# read in place up to NCX_IN_PLACE_MAX_TAPS_SUMS (f16 and bf16 not measured): Zen 4,
# batch 8, pair ratios in place / packed, 1 / 2 threads: 3x3 256->256 on 14x14 (2.4 MB)
# 1.04 / 1.07, on 28x28 1.03 /
# 1.12-1.13, 192->192 on 28x28 (1.3 MB) 1.04 / 1.07, 384->256 on 14x14 (3.5 MB) 1.03-1.04
# / 1.17; not 512->512 on 7x7 (9.4 MB: 0.96-0.97 / 1.12-1.13), nor 1x1 layers (1024->512,
# 2 MB: 0.99 / 0.91). Intel's cores keep 64 KB on avx2 and 1 MB on avx512
# (INTEL_NCX_IN_PLACE_MAX_SUMS): a vendor's rule is a plan (vendor_plan).
# Those of one group and several taps read src in place with more output than input
# channels too, f32 (f16 and bf16 not measured). Zen 4, batch 8, 1 thread, time packed /
# in place: avx2 3->64 7x7 stride 2 (ResNet-50's conv1) 1.04-1.05 (2 threads 1.07), 3x3
# 3->64, 4->64, 5->64, 8->64 on 112x112 1.08, 1.09, 1.20, 1.07, 3x3 16->64 on 56x56 1.05,
# 32->64 on 112x112 1.02, 64->128 on 56x56 1.02 (stride 2 1.12), 5x5 16->32 1.04; avx512
# (4 -> 16 channels, where few channels do not flatten into (kw, channel) rows) 1.03-1.04,
# 32->64 1.05, 64->128 1.04 (stride 2 1.04); up to these limits, not
# NCX_IN_PLACE_MAX_TAPS_SUMS: 128->256 on 28x28 (1.2 MB) avx2 0.88, avx512 0.98-1.02,
# 256->320 and 256->512 on 14x14 avx512 0.97-0.99 on 1 and 2 threads.
NCX_IN_PLACE_MAX_SUMS = {16: 1024 * 1024, 8: SUMS_IN_L2_BYTES}
NCX_IN_PLACE_MAX_TAPS_SUMS = {16: 4 * 1024 * 1024}
# ...except 1x1 f32 channels-last layers (any stride) with at most IN_PLACE_MAX_COUT
# outputs and IN_PLACE_MAX_CIN inputs (and on avx2 at most IN_PLACE_MAX_SUMS bytes of
# sums): their tiles read src and diff_dst in place, each pixel's rows whole lines. Zen 4,
# batch 8, interleaved pair ratios in place / packed, 1 / 2 threads (ResNet-50 layers and
# others on the same images): avx512 64->256 and 64->64 1.00 / 1.00-1.02 (in place
# already), 512->64 1.26-1.27 / 1.30-1.33, 1024->64 1.15-1.17 / 1.26-1.27, 128->512
# 1.07-1.08 / 1.08, 512->128 1.01-1.05 / 1.05-1.07, 1024->256 1.04-1.05 / 1.06-1.08,
# 2048->256 1.04 / 1.03-1.05, 512->512 0.95 / 1.05, 1024->512 1.01 / 1.01-1.05, 2048->512
# 0.99 / 0.98-1.06; strided 256->128 1.10-1.13 / 1.15-1.20, 256->512 1.07-1.08 /
# 1.08-1.09, 512->256 1.00-1.02 / 1.04-1.06, 1024->512 1.03-1.04 / 1.14-1.19; but 1024
# and more outputs lose (256->1024 0.95-0.96 / 0.98-1.00, 512->2048 0.85-0.88, strided
# 512->1024 0.93-0.97 / 0.95, 1024->2048 0.80 / 0.91). avx2 (tiles of 24 or 16 outputs):
# 32->64 on 112x112 1.14 / 1.40, 64->256 1.10 / 1.19, 64->64 1.09 / 1.10, 128->128
# 1.04-1.05 / 1.05-1.07, 256->64 and 512->64 1.12-1.21 / 1.15-1.16 (in place already),
# strided 256->128 1.07-1.08 / 1.11-1.14, 256->256 1.00 / 0.98-1.01, 512->128 0.97 /
# 1.00; but 128->512 0.94 / 0.94-0.97, strided 256->512 0.78 / 0.91, 512->256 0.78 /
# 0.89-1.04 and larger 0.52-0.82.
# On avx512 any kernel's layers do (the channels-last rows of each tap read in place):
# 3x3 64->64 on 56x56 1.04 / 1.06, 128->128 on 28x28 1.03 / 1.03, 256 on 14x14 1.00 /
# 1.03, 512 on 7x7 1.01 / 1.02, 64->128 1.04 / 1.04, 32->32 on 112x112 1.08 / 1.09,
# stride 2 128->128 1.08-1.09 / 1.09, dilation 2 256->256 0.98-0.99 / 1.01-1.08, 5x5
# 128->128 on 28x28 1.00 / 1.22, 3x3x3 64->64 on 14x14x14 1.06 / 1.08, 1-D kernel 3 256
# on 512 columns 1.01 / 1.08-1.09, groups of 32 and 64 channels 1.05-1.06 / 1.02-1.05
# (the tuner picked it for ResNet-50's first two 3x3 layers too); avx2's 3x3 layers
# break even (0.99-1.01) and keep their panels.
IN_PLACE_ANY_KERNEL_LANES = (16,)
IN_PLACE_MAX_CIN = {16: 2048, 8: 1024}
IN_PLACE_MAX_COUT = {16: 512, 8: 256}
IN_PLACE_MAX_SUMS = {8: 256 * 1024}
INTEL_IN_PLACE_CIN = {16: (1, 511), 8: (128, 1024)}
INTEL_IN_PLACE_MAX_COUT = {16: 256, 8: 64}


def feeds_packing(config: KernelConfig) -> bool:
    """Whether each value a weight gradient packs into panels feeds at least
    PACKED_MIN_FMAS multiply-adds, so that packing can pay where the rules do not read in
    place. Read in place, channels-last rows a power of two apart share a few cache sets
    and a page per pixel (Ice Lake, AVX2, 1x1 1024->256: 47 GFLOP/s in place, 93 from
    panels); NCX data is read in short runs per channel (a chunk's pixels), costly per
    value (1x1 64->64 feeds 32: slower packed); a grouped 1x1 layer with 1-2 channels per
    group feeds 0.7 (2.3x slower packed)."""
    channels, cout = config.cin_per_group, config.cout_per_group
    kd_kh = prod(config.kernel[:-1])
    fmas_per_value = channels * cout * prod(config.kernel) / (channels * kd_kh + cout)
    return fmas_per_value >= PACKED_MIN_FMAS


def nxc_in_place(config: KernelConfig, intel: bool = False) -> bool:
    """Whether a channels-last weight gradient's tiles read both inputs in place by the
    rules (IN_PLACE_MAX_CIN and the limits beside it), or by Intel's (`intel`)."""
    lanes = VECTOR_LANES[config.isa]
    one_tap = all(k == 1 for k in config.kernel)
    if not (config.family == "bwd_weights" and config.data_format == "NXC"
            and config.dtype == "f32" and lanes in IN_PLACE_MAX_CIN
            and (one_tap or lanes in IN_PLACE_ANY_KERNEL_LANES)):
        return False
    cin, cout = config.groups * config.cin_per_group, config.groups * config.cout_per_group
    if intel:
        low, high = INTEL_IN_PLACE_CIN[lanes]
        return (one_tap and config.pointwise and low <= cin <= high
                and cout <= INTEL_IN_PLACE_MAX_COUT[lanes])
    sums = weight_sums_bytes(config)
    return (cin <= IN_PLACE_MAX_CIN[lanes] and cout <= IN_PLACE_MAX_COUT[lanes]
            and sums <= IN_PLACE_MAX_SUMS.get(lanes, sums))


def max_slices_of(sums_bytes: int, plan: Mapping[str, int], tiles: int) -> int:
    """Most pixel slices of a weight gradient of `tiles` tiles: several only while the
    sums stay in L2; MAX_SLICES, or more where they have fewer than SLICE_ITEMS items."""
    if sums_bytes > SUMS_IN_L2_BYTES:
        return 1
    rule = MAX_SLICES
    while rule * tiles < SLICE_ITEMS and rule < MOST_SLICES:
        rule *= 2
    return power_of_two_floor(min(plan.get("max_slices", rule),
                                  SLICE_SUMS_BYTES // sums_bytes))


def weight_tile_count(config: KernelConfig, rows: int, total: int, block: int, vectors: int,
                      by_columns: bool) -> int:
    """Tiles of a weight gradient (its templates' tile loop; partition._weights): groups
    x taps (their kw in the rows where `by_columns`) x row blocks of `rows` over `total`
    rows x vector blocks of `block` over `vectors`."""
    taps = prod(config.kernel) // (config.kernel[-1] if by_columns else 1)
    return config.groups * taps * -(-total // rows) * -(-vectors // block)


def weight_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Register blocking of the weight-gradient tiles: input channels x vectors of
    output channels of one tap."""
    lanes = VECTOR_LANES[config.isa]
    vectors = -(-config.cout_per_group // lanes)
    rule = MAX_VECTOR_BLOCK[config.isa]
    sums_bytes = weight_sums_bytes(config)
    one_tap = all(k == 1 for k in config.kernel)  # 1x1, any stride
    if one_tap:
        rule = POINTWISE_WEIGHT_VECTOR_BLOCK.get(config.isa, rule)
    elif (vectors % 2 == 0 and vectors <= ONE_VECTOR_TAIL_MAX_VECTORS.get(config.isa, 0)
          and (last_part(vectors, rule) == 1 or (
              last_part(vectors, rule) == 2
              and config.cin_per_group >= ACCUMULATORS[config.isa] // 2))):
        rule = 2
    low, high = NXC_POINTWISE_MID_COUT
    if (lanes == 16 and config.data_format == "NXC" and config.dtype == "f32"
            and one_tap and low <= config.cout_per_group <= high):
        rule = 2
    block = min(vectors, plan.get("vec_block", rule))
    most_rows = plan.get("tile_rows", ACCUMULATORS[config.isa])
    channels = config.cin_per_group
    # Few input channels: tile rows over (kw, channel) pairs fill the registers.
    dot = uses_bf16_dot(config, plan)
    flatten_w = (2 * channels <= min(ACCUMULATORS[config.isa] // block, most_rows)
                 and channels < FLATTEN_BELOW_CHANNELS.get(config.isa, channels + 1)
                 and config.kernel[-1] > 1 and not dot)
    if flatten_w and "vec_block" not in plan:
        block = _flatten_vector_block(config, block, most_rows)
    last = last_part(vectors, block)
    budget = min(ACCUMULATORS[config.isa] // block, most_rows)
    if flatten_w:
        rows, total = _flattened_rows(config, block, most_rows)
    elif dot:  # rows run over (kw, channel) of the pixel-pair copy of src
        total = channels * config.kernel[-1]
        rows = min(total, budget)
    else:
        # tiles of near-equal height: 16 channels as 8 + 8 rather than 13 + 3, whose
        # short tile has too few sums to hide the multiply-adds' latency (Sapphire Rapids,
        # ResNeXt-101 3-D grouped 3x3x3 layers, batch 8, pair ratios 1 / 2 threads:
        # avx512 16 -> 32 channels per group 1.18 / 1.16, 16 -> 32 on 14x14 1.33 / 1.35;
        # avx2 8 -> 16 as 4 + 4 rather than 6 + 2 1.06 / 1.07)
        rows, total = near_equal(channels, max(1, min(channels, budget))), channels
    rows = min(rows, total)
    rows_last = last_part(total, rows)
    tiles = list(dict.fromkeys((r, v) for r in (rows, rows_last) for v in (block, last)))
    # Packed panels (bwd_weights_packed.c.j2): per chunk, each thread copies what its tiles
    # read into panels at consecutive addresses (see feeds_packing).
    cin, cout = config.groups * channels, config.groups * config.cout_per_group
    if config.data_format == "NCX":
        most = NCX_IN_PLACE_MAX_SUMS.get(lanes, NCX_IN_PLACE_MAX_SUMS[8])
        # more outputs than inputs: packed for 1x1 layers (those of small weights run
        # swapped instead), read in place with several taps (see NCX_IN_PLACE_MAX_SUMS)
        more_outputs = (not one_tap and config.groups == 1 and config.dtype == "f32"
                        and sums_bytes <= most)
        if not one_tap and config.dtype == "f32":
            most = max(most, NCX_IN_PLACE_MAX_TAPS_SUMS.get(lanes, 0))
        in_place = (cout <= cin or more_outputs) and sums_bytes <= most
    else:
        in_place = nxc_in_place(config)
    packed = not flatten_w and not dot and bool(plan.get(
        "packed", not in_place and feeds_packing(config)))
    # Otherwise tiles broadcast src values, so NCX src needs no transpose: each tile row
    # is a stream along the pixels of one channel (f32 is read in place, f16/bf16 widened
    # in their order). Only diff_dst, the vector operand, is made channels-last.
    src_channels_first = config.data_format == "NCX" and not flatten_w and not (
        dot or packed)
    in_l2 = sums_bytes <= SUMS_IN_L2_BYTES
    nxc_reads_in_place = config.data_format == "NXC" and not (packed or flatten_w or dot)
    if packed and _rows_overlap(config):
        rule_pixels = PACKED_OVERLAP_CHUNK_PIXELS
    elif in_l2 and nxc_reads_in_place:
        rule_pixels = NXC_IN_PLACE_CHUNK_PIXELS.get(lanes, CHUNK_PIXELS)
    elif in_l2:
        light = (config.data_format == "NCX" and config.dtype == "f32" and (
            cin * config.cout_per_group * prod(config.kernel) <= NCX_LIGHT_MACS
            or _rows_overlap(config)))
        rule_pixels = NCX_LIGHT_CHUNK_PIXELS if light else CHUNK_PIXELS
    else:
        rule_pixels = 0
    chunk_pixels = plan.get("chunk_pixels", rule_pixels)
    max_slices = max_slices_of(sums_bytes, plan, weight_tile_count(
        config, rows, total, block, vectors, flatten_w or dot))
    sums_in_output = bool(plan.get("sums_in_output", 1)) and _sums_in_output_eligible(
        config, max_slices, flatten_w or dot)
    # floats per input channel of the sums, one vector more where rows 2 KB apart would
    # put a tile's rows of sums in one or two sets of L1 (not in the user's weights)
    row = vectors * lanes
    sums_row = row + (lanes if row % SUMS_ROW_ALIAS_FLOATS == 0 and not sums_in_output
                      else 0)
    return {"tile_rows": rows, "vec_block": block, "tiles": tiles, "flatten_w": flatten_w,
            "sums_row": sums_row,
            # bf16 pairs keep their loop: 0.96-1.06 unrolled (Sapphire Rapids)
            "step_unroll": plan.get("step_unroll", STEP_UNROLL.get(config.isa, 1)),
            "unrolled_tiles": [] if dot else unrolled_tiles(config.isa, tiles),
            "packed": packed, "partial_pixels": partial_steps(config, plan),
            "prefetch_panels": _prefetch_panels(config, packed, plan),
            "max_slices": max_slices, "sums_in_output": sums_in_output,
            "slice_min_pixels": SLICE_MIN_PIXELS,
            "chunk_pixels": chunk_pixels, "slot_steps": _slot_steps(config),
            "chunk_bytes": max(CHUNK_BYTES, sums_bytes // 2),
            "src_channels_first": src_channels_first,
            # ...and its diff_dst is transposed chunk by chunk, by the thread that uses it;
            # so is the flattened rows' (their src is a padded copy): MobileNet's stem (3x3
            # s2, 3 -> 32 on 224x224), NCX batch 8, 1 thread, whole / by chunk: see
            # benchmarks/results/zen4/flat_dd_by_chunk_ab
            "dd_by_chunk": src_channels_first or (config.data_format == "NCX" and flatten_w),
            "src_in_place": src_channels_first and config.dtype == "f32",
            "prefetch_next_chunk": _prefetch_next_chunk(config, chunk_pixels,
                                                        flatten_w or dot),
            "image_block_bytes": image_block_bytes(config, plan)}


def _rows_overlap(config: KernelConfig) -> bool:
    """Whether some src row along d or h is read by several output rows (a kernel extent
    above its stride there)."""
    return any(e > s for e, s in zip(kernel_extents(config)[:-1], config.strides[:-1],
                                    strict=True))


def _slot_steps(config: KernelConfig) -> tuple[int, int]:
    """Slots between consecutive output rows and between kh taps in a packed weight
    gradient's src panels (bwd_weights_packed.c.j2): where the h extent of the dilated
    kernel exceeds the stride, consecutive output rows share src rows and a slot is one
    src row (strides and dilations over their common divisor); else KH slots a row.
    Zen 4 avx2, 3x3 64 -> 64 on 56x56, 1 thread: packing took 8% of the kernel's time,
    most of it src rows, each packed once for every kh that reads it."""
    if len(config.kernel) < 2:  # 1-D: one row per output row
        return 1, 1
    kh, sh, dh = config.kernel[-2], config.strides[-2], config.dilations[-2]
    if kernel_extents(config)[-2] > sh:
        unit = gcd(sh, dh)
        return sh // unit, dh // unit
    return kh, 1


def _sums_in_output_eligible(config: KernelConfig, max_slices: int, other_rows: bool) -> bool:
    """Whether a weight gradient's f32 sums can be the user's weights themselves: XIO
    weights of one group are laid out as the sums ([tap][input channel][output channel])
    where the output channels fill whole vectors, and one slice of sums (no others to add
    in) with rows of channels, not (kw, channel) pairs.

    Then no copy at the end, where the sums of large weights went through memory twice
    more. Rows of a multiple of 512 floats lose their padding vector against 2 KB
    aliasing (SUMS_ROW_ALIAS_FLOATS). Sapphire Rapids, ResNet-50 NXC batch 8, results
    64-byte aligned, pair ratios in the weights / in workspace, 1 / 2 threads: avx512
    res5 layers (1-9 MB of weights) 1.04-1.11 / 1.01-1.08, res4 1.00-1.03 / 1.00-1.04;
    avx2 res5 1.01-1.06 / 1.00-1.04, but rows of 2048 floats (8 KB apart) 0.99-1.03 /
    0.94-0.98, which keep theirs (SUMS_IN_OUTPUT_MAX_ROW)."""
    lanes, cout = VECTOR_LANES[config.isa], config.cout_per_group
    return (config.dtype == "f32" and config.weights_format == "XIO" and config.groups == 1
            and cout % lanes == 0 and cout < SUMS_IN_OUTPUT_MAX_ROW.get(lanes, cout + 1)
            and max_slices == 1 and not other_rows)


def _flatten_vector_block(config: KernelConfig, block: int, most_rows: int) -> int:
    """The vector block of a weight gradient whose tile rows run over (kw, input
    channel) pairs: FLATTEN_VECTOR_BLOCK where its taller tiles split those rows into
    tiles of near-equal height (the last at least half as tall), else `block`."""
    narrow = FLATTEN_VECTOR_BLOCK.get(VECTOR_LANES[config.isa])
    if narrow is None or block <= narrow:
        return block
    rows, total = _flattened_rows(config, narrow, most_rows)
    rows = min(total, rows)
    if rows < 1:
        return block
    last = last_part(total, rows)
    return narrow if 2 * last >= rows else block


def _flattened_rows(config: KernelConfig, block: int, most_rows: int) -> tuple[int, int]:
    """Tile rows over (kw, input channel) pairs with vector block `block` (whole kw
    taps' channels that the registers hold), and how many such pairs there are."""
    channels = config.cin_per_group
    budget = min(ACCUMULATORS[config.isa] // block, most_rows)
    return channels * (budget // channels), channels * config.kernel[-1]


def _prefetch_panels(config: KernelConfig, packed: bool, plan: Mapping[str, int]) -> bool:
    """Whether a packed NCX weight gradient packs diff_dst a vector block at a time while
    its tiles fetch the user's rows of the next block and of the next chunk's src
    (ncx_prefetch.h.j2): where strides skip no src row (the rows from a chunk's first to
    its last are fetched whole).

    Zen 4, ResNet-50 NCX batch 8, in-run pair ratios without / with (pair_plans.py), 1 / 2
    threads: avx2 res4b_branch2a (1024->256, run swapped) 0.89-0.91 / 0.89-0.92,
    res4a_branch2c 0.83-1.10 (noisy), res5a_branch2c 0.99-0.995 / 0.97-0.99 (1.02-1.06
    before tiles with empty shares returned at once), res5b_branch2a 0.98-1.05; avx512
    res4a_branch2c 0.92-0.95 / 0.90-0.93, res4b_branch2a 0.90-0.95 / 0.90-0.96,
    res5a_branch2c 0.94-0.97 / 0.96-1.03, res5b_branch2a 0.98-1.01 / 1.03-1.05. Stride-2
    1x1 layers lost, with the span of rows fetched (every other row for nothing): avx2
    res5a_branch2a 1.12-1.23, res4a_branch1 1.03-1.08; with only the rows read,
    res5a_branch2a still 1.03-1.06 on both paths."""
    return (packed and config.data_format == "NCX" and bool(plan.get("prefetch_panels", 1))
            and _strides_skip_nothing(config))


def _strides_skip_nothing(config: KernelConfig) -> bool:
    """Whether no stride exceeds the dilated kernel's extent along its axis: every src row
    and column from the first to the last a chunk's output rows read is read."""
    return all(s <= e for s, e in zip(config.strides, kernel_extents(config), strict=True))


def _prefetch_next_chunk(config: KernelConfig, chunk_pixels: int, copied: bool) -> bool:
    """Whether an f32 weight gradient fetches the channels-last rows of its next chunk
    while its tiles run over the current one (next_chunk.h.j2): chunks of a few pixels
    (those of CHUNK_BYTES would evict the current one), read from the data itself (not
    from a pair or padded copy), and strides that skip no src row or column (the rows from
    the chunk's first to its last are all read).

    Sapphire Rapids, ResNet-50 NXC batch 8, pair ratios with / without, 1 thread: 1x1
    256->64 (read in place) 1.55 on avx512 and 1.24 on avx2, 64->256 1.05 and 1.11, the
    others 1.00-1.06; on 2 threads 1.00-1.08. Strided 1x1 layers (rows skipped, the whole
    span fetched) lost 0.85-0.92, f16 (packed, converting) 0.95-0.98."""
    return (config.data_format == "NXC" and config.dtype == "f32" and chunk_pixels > 0
            and not copied and _strides_skip_nothing(config))
