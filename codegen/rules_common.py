"""Planner rules shared by the kernel families: vector blocks and tile shapes,
reduction steps, bf16 pairs, and small arithmetic helpers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from math import prod

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import REGISTERS, VECTOR_LANES
from convgrad.codegen.plan_choices import EMPTY_PLAN

# NEON multiplies by a lane of a register (fmla by element) where x86 broadcasts from
# memory, so each tile row also holds a register: GCC 12's 6x4 tiles (24 accumulators)
# spilled in their inner loops, 5x4 do not (aarch64-linux-gnu-gcc -O3 -S, Neoverse N1).
ACCUMULATORS = {"avx512bf16": 27, "avx512": 27, "avx2": 12, "portable": 12, "neon": 20,
                "sve256": 27}
MAX_VECTOR_BLOCK = {"avx512bf16": 4, "avx512": 4, "avx2": 3, "portable": 3, "neon": 4,
                    "sve256": 4}
MAX_TILE_ROWS = 14
# A wider vector block: on avx2, data-gradient tiles of 3 pixels x 4 vectors (3
# broadcasts and 4 weight loads per 12 multiply-adds, the blocking of oneDNN's AVX2
# kernels) instead of 4 x 3, where the vectorised channels are at most
# WIDE_MAX_CHANNELS, and for 1x1 stride-1 layers (which run every pixel of the batch as
# one long run). What decides is the channel count, not the row width: Zen 3, batch 8,
# 1 thread, 3x3, pair ratios 3 x 4 / 4 x 3 (calls in shuffled order): 32 channels on
# 56x56 1.23; 64 on 56x56, 14x14, 7x7 1.07-1.10, 1.12, 1.07; 96 on 28x28 1.05; 128 on
# 28x28, 14x14, 7x7 1.08, 1.05, 0.97; 160 on 14x14 0.99; 192 on 28x28 1.01; 256 on
# 56x56, 28x28, 14x14 1.02, 1.03, 0.96; 512 on 28x28 and 7x7 0.95 and 0.85, 1-D kernel 5
# on 32 columns 0.93 (2 threads alike). 1x1 stride-1 layers: geomean 1.06 (1 thread),
# 1.08 (2) over ResNet-50's nine, from 0.98 to 1.28.
WIDE_VECTOR_BLOCK = {"avx2": 4}
WIDE_MAX_CHANNELS = 128
LAST_TILE_EXTRA_ROWS = 2
# Products a register accumulates before adding them to a sum in memory (fixed order).
# Weight gradients take shorter chains: with 128, ResNet-50's 1x1 res5 weight gradients
# (392 pixels at batch 8) erred up to 2.08 x PyTorch's relative error against float64;
# with 64, at most 1.39 x on every layer and path, for ~1-2% of their speed (Zen 4).
PARTIAL_PRODUCTS = 128
PARTIAL_PRODUCTS_WEIGHTS = 64
# A data gradient's reduction of fewer than 3 x 128 products per output still splits
# into PARTIAL_CHAINS chains of at least MIN_PARTIAL_PRODUCTS: one chain of 96 products
# (1-D, kernel 3, 32 channels) erred 4.5e-7 against float64 where PyTorch on Zen 3 errs
# 1.5e-7 (its GEMM sums each tap apart), three chains of 32 2.2e-7; ResNet-50's
# res2a_branch1 (1x1, 256 products) 4.6e-7 in two chains against PyTorch's 2.3e-7, 3.3e-7
# in three. 1x1 kernels of at most 128 products keep one chain: there each flush re-reads
# the output, which costs more than the multiply-adds between (ResNet-50's 64- and
# 128-channel 1x1 layers, Zen 3 avx2: 0.62-0.91 of the speed with chains of 32-43).
PARTIAL_CHAINS = 3
MIN_PARTIAL_PRODUCTS = 32


def unrolled_tiles(isa: str, tiles: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The tiles (rows, vectors) whose reduction loop may unroll: those whose
    accumulators, vector operands and broadcast fit the registers."""
    return [(rows, vecs) for rows, vecs in tiles if rows * vecs + vecs + 1 <= REGISTERS[isa]]


def last_part(total: int, size: int) -> int:
    """The size of the last of ceil(total / size) parts of `size` (all of them full
    but the last)."""
    return total - (-(-total // size) - 1) * size


def power_of_two_floor(value: int) -> int:
    """The largest power of two <= value, at least 1."""
    return 1 << max(0, int(value).bit_length() - 1)


def uses_bf16_dot(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """bf16 on a CPU with vdpbf16ps: the reductions multiply pairs of bf16 directly (the
    depthwise kernels reduce over taps and pixels of one channel and stay f32), unless
    the plan widens them to f32 (bf16_dot 0: the rule on Intel, vendor_plan, and for
    backward data whose result channels fill at most COL2IM_BF16_MAX_FILL of a vector,
    which then runs by col2im)."""
    widen = col2im_fills_better(config) and lanes_filled(
        config.cin_per_group, VECTOR_LANES[config.isa]) <= COL2IM_BF16_MAX_FILL
    return (config.dtype == "bf16" and config.isa == "avx512bf16" and not config.depthwise
            and bool(plan.get("bf16_dot", not widen)))


def reduced_channels(config: KernelConfig) -> int:
    """Channels per group a data gradient (fwd, bwd_data) sums over at each tap."""
    return config.cout_per_group if config.family == "bwd_data" else config.cin_per_group


def partial_steps(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Multiply steps a register takes before its sum joins the running total in memory,
    in a fixed order (short chains keep long reductions accurate); a vdpbf16ps step
    adds two products."""
    if config.family == "bwd_weights":
        products = PARTIAL_PRODUCTS_WEIGHTS
    else:
        reduced = reduced_channels(config)
        taps = prod(config.kernel)
        total = reduced * taps  # products per output
        chains = PARTIAL_CHAINS if taps > 1 or total > PARTIAL_PRODUCTS else 1
        products = min(PARTIAL_PRODUCTS, max(MIN_PARTIAL_PRODUCTS, -(-total // chains)))
    return products // 2 if uses_bf16_dot(config, plan) else products


def wide_vector_block(config: KernelConfig, across: bool) -> bool:
    """Whether the rules take WIDE_VECTOR_BLOCK for direct tiles (fwd, bwd_data) that
    run `across` the groups or over one group's channels (at most WIDE_MAX_CHANNELS of
    them, or 1x1)."""
    return (config.isa in WIDE_VECTOR_BLOCK and config.family != "bwd_weights"
            and not across
            and (config.pointwise or config.vector_channels <= WIDE_MAX_CHANNELS))


def lane_channels(config: KernelConfig) -> int:
    """The channels a kernel across the groups (depthwise.c.j2) runs its lanes over: every
    channel of the result (a depthwise layer's vector_channels already are)."""
    return config.vector_channels * (1 if config.depthwise else config.groups)


def register_tiles(isa: str, block: int, last: int, taller_last: bool,
                   plan: Mapping[str, int]) -> tuple[int, int, list[tuple[int, int]]]:
    """Heights of the tiles of `block` vectors and of the last vector block's (`last`
    vectors), and every (pixels, vectors) tile a kernel instantiates."""
    rows = max(1, min(MAX_TILE_ROWS, ACCUMULATORS[isa] // block,
                      plan.get("tile_rows", MAX_TILE_ROWS)))
    # A narrower last vector block has taller tiles (its registers would idle otherwise),
    # at most LAST_TILE_EXTRA_ROWS more: every height is instantiated, and compiled.
    # (Zen 4 avx2, 3x3 64 <- 64 channels as 3 + 3 + 2 vectors: 95.5 GFLOP/s with 4 x 2
    # tiles, 102 with 6 x 2; PyTorch 110.)
    rows_last = rows if last == block or not taller_last else max(rows, min(
        ACCUMULATORS[isa] // last, rows + LAST_TILE_EXTRA_ROWS, MAX_TILE_ROWS))
    # Every tile height is instantiated, so a row's remainder is one smaller tile.
    tiles = list(dict.fromkeys([*((r, block) for r in range(rows, 0, -1)),
                                *((r, last) for r in range(rows_last, 0, -1))]))
    return rows, rows_last, tiles


# With bf16 on avx512bf16 the direct tiles multiply bf16 pairs (twice the products per
# instruction), so col2im (widened to f32) takes only result channels that fill at most
# a quarter of a vector: conv1 bf16, GFLOP/s col2im / pairs, 80 / 39; 3x3 4 <- 64 67 /
# 51; but 3x3 8 <- 64 78 / 95, 3x3 12 <- 256 100 / 167 (Zen 4, 1 thread).
COL2IM_BF16_MAX_FILL = 0.25


def lanes_filled(count: int, lanes: int) -> float:
    """The share of the lanes `count` values use in whole vectors."""
    return count / (-(-count // lanes) * lanes)


def col2im_fills_better(config: KernelConfig) -> bool:
    """Backward data of one group whose columns (taps x result channels) fill more of
    their vectors' lanes than the result channels fill of theirs."""
    lanes, channels = VECTOR_LANES[config.isa], config.cin_per_group
    return (config.family == "bwd_data" and config.groups == 1
            and lanes_filled(channels, lanes)
            < lanes_filled(channels * prod(config.kernel), lanes))


def weight_sums_bytes(config: KernelConfig) -> int:
    """Bytes of a weight gradient's f32 sums: every tap, input channel and vector of
    output channels of every group."""
    lanes = VECTOR_LANES[config.isa]
    vectors = -(-config.cout_per_group // lanes)
    return 4 * config.groups * prod(config.kernel) * config.cin_per_group * vectors * lanes


def kernel_extents(config: KernelConfig) -> list[int]:
    """Input pixels the dilated kernel spans along each spatial axis."""
    return [(k - 1) * d + 1 for k, d in zip(config.kernel, config.dilations, strict=True)]


def near_equal(total: int, most: int) -> int:
    """The size of near-equal parts of `total`, none above `most`."""
    return -(-total // -(-total // most))
