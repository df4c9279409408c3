"""Planner rules of the channels-first (NCX) f32 1x1 data gradients (fwd, bwd_data) that
read and write NCX in place (pointwise_ncx.h.j2) or, with strides, on a compact copy of
the pixels the strides keep (ncx_strided.h.j2)."""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import SIMD, VECTOR_LANES
from convgrad.codegen.plan_choices import EMPTY_PLAN
from convgrad.codegen.rules_common import last_part, near_equal, partial_steps, reduced_channels
from convgrad.codegen.rules_data import IMAGE_BLOCK_BYTES, WEIGHT_CHUNK_BYTES

# Channels-first f32 1x1 data gradients (stride 1, no pads) read and write NCX in place:
# tiles of NCX_ROWS output channels x NCX_VECS pixel vectors, on images of at least
# NCX_MIN_PIXELS pixels (smaller ones transpose: whole vectors no longer dominate) and
# with at most NCX_MAX_REDUCED reduced channels: a tile reads a strided row per reduced
# channel, and 1024 of them no longer stay in L1 (ResNet-50 res4a_branch2c, 1024 -> 256
# channels on 14x14, ratio to PyTorch in place -> transposed, the tuner's choice on every
# run: Zen 3 avx2 0.70 -> 0.83 (1 thread), 0.75 -> 0.85 (2); Zen 4 avx2 0.85 -> 0.98,
# 0.89 -> 0.97; Zen 4 avx512 1.05 -> 1.09. Layers reducing 64-512 kept in place).
NCX_ROWS = {"avx512bf16": 6, "avx512": 6, "avx2": 4, "portable": 4, "neon": 6, "sve256": 6}
NCX_VECS = {"avx512bf16": 4, "avx512": 4, "avx2": 3, "portable": 3, "neon": 4, "sve256": 4}
NCX_MIN_PIXELS = 128
NCX_MAX_REDUCED = 512
# ...which load vectors of the user's input in place: where its rows all start the same
# floats past a cache line (numpy's arrays of megabytes start 16 bytes past a page), a
# head block of one partial vector aligns the other blocks' loads, and misaligns the
# stores of a result on a line instead. Sapphire Rapids, ResNet-50 batch 8, input 16
# bytes past a line and result on one, pair ratios with / without, 1 / 2 threads, on
# 28x28 and 56x56: avx512 1.06-1.09 / 1.07-1.09 reducing 128-256 channels (512: 1.00 /
# 1.08), 1.00 / 1.01-1.05 reducing 64; avx2 1.00-1.07 / 1.03-1.13 reducing 128-512,
# 0.97-0.98 / 0.99-1.01 reducing 64. So from this many reduced channels:
NCX_HEAD_MIN_REDUCED = 128
# The tiles read a block of pixels of every reduced channel: as many streams as
# channels, more than the hardware prefetchers follow. So each tile fetches a share of
# the next block's input rows and its own output rows of that block into L2
# (pointwise_ncx.h.j2 prefetch_next_ncx_block). Zen 4, ResNet-50 batch 8, fwd and data,
# fetched / not (`benchmarks.ab_builds --data-format NCX`, same process): avx512 1
# thread 1.07-1.27 on 56x56 and 28x28 layers, 1.02-1.03 on 14x14; 2 threads 1.06-1.24,
# 0.99-1.01; avx2 1 thread 1.08-1.49, 0.98-1.02. An hour later, the VM 25-40% slower
# for both, `pair_plans` read 0.89-1.25 without over with, no consistent sign: no gain
# then, no loss either (benchmarks/results/zen4/ncx_prefetch_ab_88478eb). Plan choice
# ncx_prefetch.
NCX_PREFETCH = True


# ...and with strides, on a compact copy of the pixels the strides keep (ncx_strided.h.j2:
# the forward convolution gathers them, the data gradient spreads its result with zeros
# between), not by the NCX bands. Zen 4 avx512, ResNet-50 batch 8, pair_plans ratios
# compact copy / bands, 1 / 2 threads: data res3a_branch2a 1.20 / 1.26, res4a_branch2a
# 1.12 / 1.12, res3a_branch1 1.11 / 1.13; fwd res3a_branch2a 1.11-1.22 / 1.04,
# res3a_branch1 1.04 (2 threads), res4a_branch2a 1.04 / 0.96-1.04 and res4a_branch1
# (512 -> 1024 channels on 14x14) 0.99 / 0.89: forward convolutions reducing more than
# this keep the bands.
NCX_STRIDED_FWD_MAX_REDUCED = 256


def pointwise_ncx_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """The channels-first 1x1 plan of a data gradient (fwd, bwd_data), or none: with
    strides, on a compact copy of the pixels they keep (ncx_strided.h.j2), a block of
    images of about IMAGE_BLOCK_BYTES per thread at a time."""
    reduced = reduced_channels(config)
    strided = any(s > 1 for s in config.strides)
    most = NCX_STRIDED_FWD_MAX_REDUCED if strided and config.family == "fwd" else NCX_MAX_REDUCED
    if not (prod(config.kernel) == 1 and config.data_format == "NCX" and config.dtype == "f32"
            and not config.depthwise and plan.get("ncx_in_place", reduced <= most)):
        return {"pointwise_ncx": False}
    out_channels = config.vector_channels
    rows = min(NCX_ROWS[config.isa], out_channels)
    last = last_part(out_channels, rows)
    vecs = NCX_VECS[config.isa]
    return {"pointwise_ncx": True, "ncx_rows": rows, "ncx_vecs": vecs,
            "ncx_tiles": list(dict.fromkeys((r, v) for r in (rows, last)
                                            for v in range(vecs, 0, -1))),
            "ncx_min_pixels": NCX_MIN_PIXELS,
            "ncx_reduce_chunk": _ncx_reduce_chunk(config, plan, vecs),
            "ncx_head": bool(plan.get("ncx_head", reduced >= NCX_HEAD_MIN_REDUCED)),
            "ncx_prefetch": bool(plan.get("ncx_prefetch", NCX_PREFETCH)),
            "ncx_strided": strided,
            "ncx_compact_bytes": plan.get("ncx_compact_kb", IMAGE_BLOCK_BYTES >> 10) << 10
                                 if strided else 0,
            "ncx_stream_min_bytes": ncx_stream_min_bytes(config, plan) if strided else 0,
            # channel blocks per chunk: their weights stay in L2; near-equal chunks (171
            # blocks as 57 x 3, not 85 + 85 + 1: threads share the chunks' work evenly)
            "ncx_block_chunk": near_equal(-(-out_channels // rows),
                                         max(1, WEIGHT_CHUNK_BYTES // (reduced * rows * 4)))}


# Channels-first 1x1 tiles read a block of NCX_VECS pixel vectors of every reduced
# channel; where that block takes more than this, each pass over it takes a multiple of
# the partial steps (the tiles' own flushes, so the sums and their order are the same)
# and runs every channel block, so the pass's input stays in L1. Sapphire Rapids avx512,
# batch 8, pair ratios passes / one, 1 / 2 threads: 256 reduced channels on 56x56
# 1.03-1.11 / 1.17 (noisy), 512 on 28x28 1.18-1.19 / 1.19, 256 on 14x14 1.10 / 1.09;
# avx2 512 on 28x28 0.99.
NCX_L1_INPUT_BYTES = 32 * 1024


def _ncx_reduce_chunk(config: KernelConfig, plan: Mapping[str, int], vecs: int) -> int:
    """Reduced channels per pass of the channels-first 1x1 tiles over a block of pixels
    (NCX_L1_INPUT_BYTES; plan ncx_pass_kb)."""
    reduced = reduced_channels(config)
    per_channel = vecs * VECTOR_LANES[config.isa] * 4
    steps = partial_steps(config, plan)
    if "ncx_pass_kb" in plan:
        budget = plan["ncx_pass_kb"] * 1024 or reduced * per_channel
    else:
        budget = NCX_L1_INPUT_BYTES
    if reduced * per_channel <= budget:
        return reduced
    return max(1, budget // (per_channel * steps)) * steps


# Channels-first 1x1 data gradients with strides spread their result out of the compact
# copy (ncx_strided.h.j2): every byte of it, three quarters zeros, after few multiply-adds
# per value, and a quarter of their time (perf, Zen 4, res3a_branch2a batch 8). Streamed
# through a staging plane per thread: Zen 4 avx512, ResNet-50 NCX batch 8, pair_plans
# ratios streamed / ordinary (3 repeats), 1 / 2 threads: res3a_branch2a (128 -> 256, 25.7
# MB) 1.07-1.08 / 1.04-1.06, res3a_branch1 (512 -> 256, 25.7 MB) 1.01-1.02 / 1.03;
# res4a_branch2a (12.8 MB) 1.02 / 0.98-1.00, and 0.95-0.97 in a first run: from 16 MB.
NCX_STREAM_MIN_KB = 16384


def ncx_stream_min_bytes(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Result bytes from which a strided channels-first 1x1 data gradient streams its
    result past the caches (0: never): backward data, x86 vectors."""
    if config.family != "bwd_data" or SIMD[config.isa] == "generic":
        return 0
    return plan.get("stream_kb", NCX_STREAM_MIN_KB) * 1024
