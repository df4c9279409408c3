"""The planner: what the templates need to spell out one configuration.

Chooses the target ISA (from the CPU features the runtime detects, or a forced
one), its compiler flags, and the per-configuration choices such as unrolling.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from math import gcd, prod
from types import MappingProxyType

from convgrad.codegen.config import ISAS, KernelConfig

# A plan says how a kernel computes its configuration where that differs from the
# planner's rules: a mapping of the choices below to integers. The empty plan is the
# rules' choice (the default); the tuner (convgrad.tuning) times the candidates() of a
# configuration and keeps the fastest. Every plan computes the same result.
PLAN_CHOICES = {
    "vec_block": "vectors of channels per register tile (fwd, bwd_data, bwd_weights)",
    "tile_rows": "most output pixels (or input channels) per register tile",
    "weight_chunk_kb": "data gradients: KB of weights per pass over the image",
    "pad_columns": "data gradients: 0 keeps runs cut at the edges, 1 pads narrow rows",
    "overlap_runs": "data gradients: 1 runs each w tap over all the columns it reaches "
                    "(runs overlap), 0 cuts rows into runs of the columns the same taps reach",
    "point_vb_inner": "1x1 data gradients: 1 runs a pixel block's vector blocks together",
    "pixel_sweep": "depthwise weight gradients: 1 sweeps all channels of a pixel at once, "
                   "sums in L1; 0 register tiles of a vector block",
    "row_vb_inner": "data gradients by rows, depthwise weight gradients: 1 runs each "
                    "row's vector blocks together (its input read once per pass), 0 each "
                    "vector block over every row",
    "step_unroll": "direct and weight-gradient tiles: multiply steps per iteration of "
                   "the reduction loop of the tiles whose registers allow it (1: none)",
    "ncx_in_place": "NCX f32 data gradients by 1x1 tiles or by col2im: 1 reads NCX in "
                    "place, 0 transposes",
    "ncx_head": "1x1 NCX f32 data gradients read in place: 1 puts a head block of one "
                "partial vector before the blocks, so that they load whole cache lines "
                "where every row of the input starts the same floats past one; 0 never",
    "ncx_pass_kb": "1x1 NCX f32 data gradients read in place: KB of a pixel block's input "
                   "per pass over its channel blocks (0: every reduced channel at once)",
    "all_taps": "depthwise weight gradients: 1 keeps every (kh, kw) tap of a channel block "
                "in registers over a block of rows, 0 the w taps of one kh along a row",
    "row_group_kb": "depthwise weight gradients with all_taps: KB of src and diff_dst rows "
                    "each vector block runs over before the next",
    "slide": "depthwise gradients: 1 uses sliding tiles (data) or a sliding window of src "
             "columns (weights) where stride 1 allows",
    "packed": "weight gradients: 1 copies chunks into panels, 0 reads in place",
    "prefetch_panels": "packed NCX weight gradients: 1 packs diff_dst a vector block at a "
                       "time while the tiles fetch the rows of the next block and of the "
                       "next chunk's src, 0 packs a chunk's panels at once",
    "ncx_dot": "NCX f32 weight gradients with stride 1 along w: 1 packs runs of pixels of "
               "both inputs and multiplies them (dot products), 0 broadcasts src",
    "chunk_pixels": "weight gradients: pixels per chunk (0: chunks of about 1 MB of "
                    "rows, or half the sums' bytes if more)",
    "max_slices": "weight gradients: most pixel slices (a power of two)",
    "sums_in_output": "f32 XIO weight gradients of one group and one slice: 1 adds the "
                      "sums in the user's weights, 0 in workspace, copied out at the end",
    "group_lanes": "grouped layers: 1 vectorises across the groups (lanes over every "
                   "channel of the vectorised side), 0 over one group's channels",
    "image_block_kb": "NCX data gradients: KB of input (f32, or bf16 pairs) and f32 result "
                      "copies per block of images; bf16 weight gradients with vdpbf16ps: KB "
                      "of src and diff_dst pair copies per block (0: the whole batch at once)",
    "band_kb": "NCX data gradients by direct tiles (1-D and 2-D): KB of input and result "
               "rows each thread copies channels-last, computes and copies back a band at a "
               "time (0: blocks of whole images, image_block_kb)",
    "spread_whole_mb": "data gradients across groups: MB of spread input up to which it is "
                       "spread whole up front, else row by row (0: always row by row)",
    "bf16_dot": "bf16 on avx512bf16: 1 multiplies bf16 pairs with vdpbf16ps, 0 widens to "
                "f32 and runs the f32 tiles",
    "stream_kb": "depthwise, across-group and 1x1 f32 channels-last data gradients: "
                 "results of at least this many KB are stored past the caches "
                 "(non-temporal; 0: never)",
    "col2im": "backward data of one group with few result channels: 1 multiplies each "
              "diff_dst pixel by every tap's weights at once (columns of (tap, channel) "
              "pairs) and adds the columns into the result pixels the taps reach, 0 the "
              "direct tiles over result channels",
    "col_pixels": "backward data by col2im: diff_dst pixels per block of columns",
    "amx": "bf16 gradients on avx512bf16 (stride 1, or data 1x1): 1 multiplies with "
           "AMX tiles where the CPU has them (the kernel checks), 0 never",
}
EMPTY_PLAN: Mapping[str, int] = MappingProxyType({})
MAX_CANDIDATES = 8


def plan_key(plan: Mapping[str, int] | None) -> str:
    """A short name of a plan: "" for the default, else 8 hex digits of its choices."""
    if not plan:
        return ""
    text = json.dumps(sorted(plan.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def kernel_name(config: KernelConfig, plan: Mapping[str, int] | None = None) -> str:
    """The C name of a kernel: the configuration's, with its plan's key if not default."""
    key = plan_key(plan)
    return f"{config.name}_p{key}" if key else config.name


def check_plan(plan: Mapping[str, int]) -> dict[str, int]:
    """A plan as a plain dict of known choices with integer values (ValueError else)."""
    if not isinstance(plan, Mapping):
        raise ValueError(f"a plan is a mapping of choices to integers; got {plan!r}")
    unknown = sorted(set(plan) - set(PLAN_CHOICES))
    if unknown:
        raise ValueError(f"unknown plan choices {unknown}; expected some of {list(PLAN_CHOICES)}")
    checked = {}
    for name, value in plan.items():
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int) or value < 0 or (value == 0 and name in (
                "vec_block", "tile_rows", "weight_chunk_kb", "max_slices",
                "step_unroll", "col_pixels")):
            raise ValueError(f"plan choice {name} = {value!r} is invalid")
        checked[name] = value
    return checked


# CPU features (Linux /proc/cpuinfo names) each ISA path needs, best path first.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"})
ISA_FEATURES: dict[str, frozenset[str]] = {
    "avx512bf16": _AVX512 | {"avx512_bf16"},
    "avx512": _AVX512,
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "portable": frozenset(),
    # aarch64 (/proc/cpuinfo "Features" names); sve256 also needs 256-bit SVE vectors
    "neon": frozenset({"asimd"}),
    "sve256": frozenset({"asimd", "sve"}),
}

# Target flags per ISA; the portable path is the compiler's baseline for the machine.
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
                 "-mf16c", "-mprefer-vector-width=512")
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512bf16": (*_AVX512_FLAGS, "-mavx512bf16"),
    "avx512": _AVX512_FLAGS,
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "portable": (),
    "neon": ("-march=armv8-a",),
    "sve256": ("-march=armv8.2-a+sve", "-msve-vector-bits=256"),
}
# Flags an ISA path needs on top of a named target's own (convgrad aot --target): x86's
# feature flags (GCC 12 knows no znver4, so zen4's flags lack -mavx512bf16) and the
# vector width; on aarch64 the target's -mcpu chooses the instructions, and another
# -march would contradict it.
ISA_EXTRA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512bf16": ISA_FLAGS["avx512bf16"], "avx512": ISA_FLAGS["avx512"],
    "avx2": ISA_FLAGS["avx2"], "portable": (), "neon": (), "sve256": ("-msve-vector-bits=256",)}

FAMILY_DOCS = {
    "fwd": "forward convolution, for ConvTransposeBackwardData",
    "bwd_data": "transposed convolution, for ConvolutionBackpropData/BackwardData",
    "bwd_weights": "weight gradient, for ConvolutionBackpropFilters/BackwardWeights "
                   "and ConvTransposeBackwardWeights",
}

# f32 lanes of a vector, and how many accumulator vectors a tile may keep in
# registers (32 zmm / 16 ymm or xmm, less the weight vectors and a broadcast).
VECTOR_LANES = {"avx512bf16": 16, "avx512": 16, "avx2": 8, "portable": 4, "neon": 4,
                "sve256": 8}
# Vector registers of each path (aarch64 has 32 for NEON and SVE alike).
REGISTERS = {"avx512bf16": 32, "avx512": 32, "avx2": 16, "portable": 16, "neon": 32,
             "sve256": 32}
# Which x86 intrinsics the templates spell masked loads and conversions with; "generic":
# none (portable C the compiler vectorises).
SIMD = {"avx512bf16": "avx512", "avx512": "avx512", "avx2": "avx2", "portable": "generic",
        "neon": "generic", "sve256": "generic"}
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
# ...but not on Intel's cores, where the same tiles lose to 4 x 3: Sapphire Rapids'
# avx2 path, ResNet-50 NXC data, batch 8, pair ratios 4 x 3 / 3 x 4 over its 20 layers
# (1.00 where the wide rule does not apply): geomean 1.026 on 1 thread and 1.025 on 2,
# from 0.99 to 1.10 (res2a_branch2b 3x3 64 ch 1.10 / 1.06, res4b_branch2a 1x1 1024->256
# 1.08 / 1.06). KernelConfig names no CPU, so a vendor's rule is a plan: vendor_plan().
NARROW_VENDORS = {"avx2": ("GenuineIntel",)}
# bf16 widened to f32 (the f32 tiles) rather than multiplied in pairs with vdpbf16ps:
# Intel's cores issue one vdpbf16ps a cycle against two FMAs, so the pairs gain no
# arithmetic and their copies cost; Zen 4 runs vdpbf16ps at twice its f32 rate.
# Sapphire Rapids, ResNet-50 batch 8, NXC, GFLOP/s widened / pairs (one run each):
# data geomean 1.42 (1 thread) and 1.41 (2), 0.97-1.72; weights 1.85 and 1.84, 1.36-2.48.
# Zen 4 (benchmarks/results/zen4, NXC): pairs ran at 1.93 / 2.04 x its f32 kernels'
# GFLOP/s for data and 1.70 / 2.08 for weights, which the widened ones do not exceed.
WIDEN_BF16_VENDORS = ("GenuineIntel",)
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
# ...and so do those where blocks of 3 leave a last block of 2 (4 x 2 tiles: 8 sums, few
# to hide the multiply-adds' latency) and the input channels fill the 6 rows of 2-vector
# tiles. Zen 4 avx2, batch 8, packed chunks of 512 pixels, pair ratios 2 / 3 vectors, 1 / 2
# threads: 3x3 64->64 on 56x56 1.02 / 1.03 (NCX 1.02 / 1.01), on 28x28 1.02 / 1.02 (NCX
# 1.03 / 1.01), stride 2 1.04 / 1.01 (NCX 1.01 / 1.01), 112->112 on 28x28 1.02 / 1.03 (NCX
# 1.02 / 1.01), 16->64 1.02 / 1.00; beyond 16 vectors 160->160 on 14x14 1.04, 224->224
# 1.03, 256->256 1.01-1.02, but stride 2 on 28x28 0.93; 3x3 3->64 0.73 / 0.73.
# On Intel's cores (a vendor's rule: vendor_plan), so do 1x1 stride-1 NCX weight
# gradients where their sums exceed SUMS_IN_L2_BYTES: chunks then hold 1 MB of panels, a
# diff_dst block of 4 vectors is too large for L1 while every row block passes over it, a
# block of 2 is not. Sapphire Rapids avx512, batch 8, 1 thread, pair ratios 2 / 4
# vectors: 256->1024 1.15, 512->2048 1.13, 2048->512 1.10 (strided 1x1 and 3x3 layers
# 0.98-1.01: not them). Zen 4 (1 MB of L2) the other way: ResNet-50 batch 8, in-run pair
# ratios 4 / 2 vectors, 1 / 2 threads: res4a_branch2c (256->1024) 1.09-1.10 / 1.07-1.08,
# res5a_branch2c (512->2048) 1.08-1.09 / 1.10; run swapped, 1.00 / 0.99-1.03
# (res4b_branch2a) and 0.99 / 1.00-1.01 (res5b_branch2a).
NCX_WIDE_SUMS_WEIGHT_VECTOR_BLOCK = 2
NCX_WIDE_SUMS_VENDORS = ("GenuineIntel",)
# ...and 1x1 f32 channels-last weight gradients on 16-lane paths with this many output
# channels (8-16 vectors): 13 x 2 tiles rather than 6 x 4. Sapphire Rapids avx512, batch
# 8, pair ratios 2 / 4 vectors, 1 / 2 threads: 64->256 1.13 / 1.13, 512->128 1.15 / 1.13,
# strided 256->128 1.07 / 1.07, strided 512->256 1.06 / 1.09, 1024->256 0.99 / 1.02; not
# 64 outputs (256->64 0.96 / 0.96) nor 512 and more (0.98-1.02).
NXC_POINTWISE_MID_COUT = (128, 256)
LAST_TILE_EXTRA_ROWS = 2
# A run of exactly one pixel more than a tile's height is one tile where the accumulators
# fit in this many of 32 registers (one may spill: cheaper than a second, short tile).
# Zen 4 avx512, 3x3 512 channels on 7x7 outputs: 88.9 -> 97.2 GFLOP/s (7x4 tiles, not 4 + 3).
# Only such a run: runs of 14-56 pixels in spilled 7x4 tiles were 1.02-1.12x slower than in
# 6-row tiles (Sapphire Rapids, 3x3 data on 28 and 56 columns, strided 1x1 on 14 and 28).
# Not on aarch64: there the 7x4 tile spilled in its inner loop (NEON and 256-bit SVE).
LONG_TILE_ACCUMULATORS = {"avx512bf16": 28, "avx512": 28}
WEIGHT_CHUNK_BYTES = 512 * 1024  # half of a 1 MB L2 (Zen 4, Sapphire Rapids: 2 MB)
# ...a tuning candidate for 1x1 data gradients on 8-lane paths: a vector block's weights
# per pass that stay in L1. Sapphire Rapids avx2, ResNet-50 batch 8, pair ratios against
# the rule's 512 KB, 1 thread: 1.07-1.18 where 512-1024 channels are reduced (res4a_branch1
# 1.18), 0.97 on the strided 256<-512 and 1024<-2048; 2 threads 0.95-1.11. No rule: avx512
# loses (0.91-1.01), and so do 3x3 layers (0.90-0.93).
L1_WEIGHT_CHUNK_KB = 32

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
MAX_SLICES = 8
SLICE_MIN_PIXELS = 1024
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
PACKED_NCX_VENDORS = {"avx2": ("GenuineIntel",), "avx512": ("GenuineIntel",)}
INTEL_NCX_IN_PLACE_MAX_SUMS = {8: 64 * 1024, 16: NCX_IN_PLACE_MAX_SUMS[16]}
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
# Intel's cores keep the limits the rules had on Sapphire Rapids (a vendor's rule is a
# plan: vendor_plan): stride 1, inputs INTEL_IN_PLACE_CIN, outputs up to
# INTEL_IN_PLACE_MAX_COUT. There, strided layers read in place also bring in the lines of
# the pixels a stride skips (Sapphire Rapids avx512, 1x1 256->128 stride 2, time in place
# / packed, 1 / 2 threads: batch 2 1.08 / 1.02, 8 1.07 / 1.14, 16 1.04 / 1.12, 32 1.11 /
# 1.11), and long rows a power of two apart share a few cache sets (Ice Lake avx2, 1x1
# 1024->256: 47 GFLOP/s in place, 93 from panels).
PACKED_NXC_VENDORS = ("GenuineIntel",)
INTEL_IN_PLACE_CIN = {16: (1, 511), 8: (128, 1024)}
INTEL_IN_PLACE_MAX_COUT = {16: 256, 8: 64}

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

# Data gradients copy their input with zero columns where the outputs are narrower than
# PAD_COLUMNS_PER_TAP x the kernel's w extent: every column then sees every w tap, so a
# row is one run of full tiles instead of one-pixel tiles at its edges (Zen 4 avx512,
# 3x3 on 14x14, 256 channels: 101.5 -> 110.1 GFLOP/s; on 7x7, 512 channels, with a long
# tile: 88.9 -> 97.2). Only where runs of each w tap cannot overlap (overlap_runs), which
# needs no copy.
PAD_COLUMNS_PER_TAP = 8
# ...unless more than this share of the padded row's multiply-adds (column x w tap) would
# be by the zeros, as with dilated kernels on narrow rows (Zen 3 avx2, batch 8, pair
# ratios unpadded / padded, 1 / 2 threads: 1-D kernel 3 dilation 6 on 19 columns, 21%
# zeros, 1.11 / 1.17; 2-D dilation 3 and 4 on 11 columns 1.31 / 1.30 and 1.29 / 1.47;
# ResNet-50's 14 and 7 columns, 5% and 10% zeros, 0.98 and 0.82).
PAD_MAX_ZEROS_PERCENT = 10
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

# Tap loops longer than this stay loops instead of being unrolled.
MAX_UNROLLED_TAPS = 16

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


def unrolled_tiles(isa: str, tiles: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The tiles (rows, vectors) whose reduction loop may unroll: those whose
    accumulators, vector operands and broadcast fit the registers."""
    return [(rows, vecs) for rows, vecs in tiles if rows * vecs + vecs + 1 <= REGISTERS[isa]]


def _last_part(total: int, size: int) -> int:
    """The size of the last of ceil(total / size) parts of `size` (all of them full
    but the last)."""
    return total - (-(-total // size) - 1) * size


def _power_of_two_floor(value: int) -> int:
    """The largest power of two <= value, at least 1."""
    return 1 << max(0, int(value).bit_length() - 1)


def runnable_isas(cpu_features: Iterable[str]) -> list[str]:
    """ISA paths this CPU can run, best first."""
    features = set(cpu_features)
    return [isa for isa in ISAS[::-1] if ISA_FEATURES[isa] <= features]


def best_isa(cpu_features: Iterable[str]) -> str:
    return runnable_isas(cpu_features)[0]


def uses_bf16_dot(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """bf16 on a CPU with vdpbf16ps: the reductions multiply pairs of bf16 directly (the
    depthwise kernels reduce over taps and pixels of one channel and stay f32), unless
    the plan widens them to f32 (bf16_dot 0: the rule on Intel, vendor_plan, and for
    backward data whose result channels fill at most COL2IM_BF16_MAX_FILL of a vector,
    which then runs by col2im)."""
    widen = _col2im_fills_better(config) and _lanes_filled(
        config.cin_per_group, VECTOR_LANES[config.isa]) <= COL2IM_BF16_MAX_FILL
    return (config.dtype == "bf16" and config.isa == "avx512bf16" and not config.depthwise
            and bool(plan.get("bf16_dot", not widen)))


def _reduced_channels(config: KernelConfig) -> int:
    """Channels per group a data gradient (fwd, bwd_data) sums over at each tap."""
    return config.cout_per_group if config.family == "bwd_data" else config.cin_per_group


def partial_steps(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Multiply steps a register takes before its sum joins the running total in memory,
    in a fixed order (short chains keep long reductions accurate); a vdpbf16ps step
    adds two products."""
    if config.family == "bwd_weights":
        products = PARTIAL_PRODUCTS_WEIGHTS
    else:
        reduced = _reduced_channels(config)
        taps = prod(config.kernel)
        total = reduced * taps  # products per output
        chains = PARTIAL_CHAINS if taps > 1 or total > PARTIAL_PRODUCTS else 1
        products = min(PARTIAL_PRODUCTS, max(MIN_PARTIAL_PRODUCTS, -(-total // chains)))
    return products // 2 if uses_bf16_dot(config, plan) else products


def _wide_vector_block(config: KernelConfig, across: bool) -> bool:
    """Whether the rules take WIDE_VECTOR_BLOCK for direct tiles (fwd, bwd_data) that
    run `across` the groups or over one group's channels (at most WIDE_MAX_CHANNELS of
    them, or 1x1)."""
    return (config.isa in WIDE_VECTOR_BLOCK and config.family != "bwd_weights"
            and not across
            and (config.pointwise or config.vector_channels <= WIDE_MAX_CHANNELS))


def vendor_plan(config: KernelConfig, vendor: str,
                features: Iterable[str] | None = None) -> dict[str, int]:
    """The rules' plan on a CPU of `vendor` (/proc/cpuinfo's vendor_id, archspec's
    Target.vendor; "" where unknown): {} but where a vendor was measured apart from
    the CPUs the rules were set on (NARROW_VENDORS, WIDEN_BF16_VENDORS, the packing and
    wide-sums vendors). `features`,
    for a kernel built for this CPU alone (a lazy compilation; not an ahead-of-time
    build, which may run elsewhere): its CPU features, and without AMX the kernel
    leaves the AMX path out, which it would never take (it compiles 0.1-0.3 s longer)."""
    plan = {}
    if (features is not None and not set(features) >= AMX_FEATURES
            and amx_tiles(config)["amx"]):
        plan["amx"] = 0
    if vendor in WIDEN_BF16_VENDORS and uses_bf16_dot(config):
        return {"bf16_dot": 0, **plan}
    if (vendor in PACKED_NCX_VENDORS.get(config.isa, ()) and _ncx_in_place(config)
            and (_weight_sums_bytes(config) > INTEL_NCX_IN_PLACE_MAX_SUMS[
                VECTOR_LANES[config.isa]]
                 # more outputs than inputs: in place measured on AMD's cores only
                 or config.cout_per_group > config.cin_per_group)):
        return {"packed": 1, **plan}
    if (vendor in NCX_WIDE_SUMS_VENDORS and config.family == "bwd_weights"
            and config.data_format == "NCX" and config.pointwise
            and _weight_sums_bytes(config) > SUMS_IN_L2_BYTES
            and weight_tiles(config)["vec_block"] > NCX_WIDE_SUMS_WEIGHT_VECTOR_BLOCK):
        return {"vec_block": NCX_WIDE_SUMS_WEIGHT_VECTOR_BLOCK, **plan}
    if (vendor in PACKED_NXC_VENDORS and _nxc_in_place(config)
            and not _nxc_in_place(config, intel=True) and _feeds_packing(config)
            and _body(config, EMPTY_PLAN)["body"] == "bwd_weights.c.j2"
            and _body(config, {"packed": 1})["body"] == "bwd_weights_packed.c.j2"):
        return {"packed": 1, **plan}
    across = config.depthwise or data_across_groups(config)
    if vendor in NARROW_VENDORS.get(config.isa, ()) and _wide_vector_block(config, across):
        return {"vec_block": MAX_VECTOR_BLOCK[config.isa], **plan}
    return plan


def _feeds_packing(config: KernelConfig) -> bool:
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


def _nxc_in_place(config: KernelConfig, intel: bool = False) -> bool:
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
    sums = _weight_sums_bytes(config)
    return (cin <= IN_PLACE_MAX_CIN[lanes] and cout <= IN_PLACE_MAX_COUT[lanes]
            and sums <= IN_PLACE_MAX_SUMS.get(lanes, sums))


def _ncx_in_place(config: KernelConfig) -> bool:
    """Whether the rules read this channels-first weight gradient's src in place (the
    body _body picks for it broadcasts src along its rows)."""
    return (config.family == "bwd_weights" and config.data_format == "NCX"
            and _body(config, EMPTY_PLAN).get("src_channels_first", False))


def _lane_channels(config: KernelConfig) -> int:
    """The channels a kernel across the groups (depthwise.c.j2) runs its lanes over: every
    channel of the result (a depthwise layer's vector_channels already are)."""
    return config.vector_channels * (1 if config.depthwise else config.groups)


def _register_tiles(isa: str, block: int, last: int, taller_last: bool,
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


def direct_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Register blocking of the direct-convolution tiles (fwd and bwd_data): output
    pixels x vectors of the vectorised channels per tile."""
    lanes = VECTOR_LANES[config.isa]
    across = config.depthwise or data_across_groups(config, plan)  # lanes over all groups
    channels = _lane_channels(config) if across else config.vector_channels
    vectors = -(-channels // lanes)
    rule = MAX_VECTOR_BLOCK[config.isa]
    if _wide_vector_block(config, across):
        rule = WIDE_VECTOR_BLOCK[config.isa]
    if _may_stream(config, plan):
        rule = STREAM_VECTOR_BLOCK.get(config.isa, rule)
    block = min(vectors, plan.get("vec_block", rule))
    last = _last_part(vectors, block)
    rows, rows_last, tiles = _register_tiles(config.isa, block, last, not across, plan)
    # Reduced channels per pass: that chunk's weights for every tap stay in L2.
    reduced = _reduced_channels(config)
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
# With bf16 on avx512bf16 the direct tiles multiply bf16 pairs (twice the products per
# instruction), so col2im (widened to f32) takes only result channels that fill at most
# a quarter of a vector: conv1 bf16, GFLOP/s col2im / pairs, 80 / 39; 3x3 4 <- 64 67 /
# 51; but 3x3 8 <- 64 78 / 95, 3x3 12 <- 256 100 / 167 (Zen 4, 1 thread).
COL2IM_BF16_MAX_FILL = 0.25
# diff_dst pixels per block of columns: the block's columns stay in L1 between the tiles
# and the additions into the result (conv1 on avx2: 32 x 152 floats, 19 KB)
COL_PIXELS = 32
# Column vectors per block (_col2im_block): Zen 4 avx2, 1 thread, 3 repeats, GFLOP/s
# by block of 2 / 3 / 4 vectors: conv1 (19 vectors: 3 leaves one) 83.8 / 82.5 / 88.5;
# 3x3 s2 3 <- 64 (4 vectors) 61.2 / 63.2 / 69.9; 3x3 4 <- 64 (5) 83.1 / 86.1 / 78.2;
# 3x3 12 <- 256 (14; 4 x 256 reduced channels take 32 KB) 85.8 / 84.8 / 82.3.
COL2IM_BLOCK_BYTES = 24 * 1024


def _lanes_filled(count: int, lanes: int) -> float:
    """The share of the lanes `count` values use in whole vectors."""
    return count / (-(-count // lanes) * lanes)


def col2im_eligible(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """Whether col2im.c.j2 can compute this configuration: backward data of one group
    (f32 sums, not bf16 pairs) whose columns fill at least one vector."""
    return (config.family == "bwd_data" and config.groups == 1
            and not uses_bf16_dot(config, plan)
            and prod(config.kernel) * config.cin_per_group >= VECTOR_LANES[config.isa])


def _col2im_fills_better(config: KernelConfig) -> bool:
    """Backward data of one group whose columns (taps x result channels) fill more of
    their vectors' lanes than the result channels fill of theirs."""
    lanes, channels = VECTOR_LANES[config.isa], config.cin_per_group
    return (config.family == "bwd_data" and config.groups == 1
            and _lanes_filled(channels, lanes)
            < _lanes_filled(channels * prod(config.kernel), lanes))


def col2im(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> bool:
    """Whether this backward data runs by col2im (col2im_eligible; by rule where the
    columns fill more lanes and the result channels are fewer than a vector's lanes or
    fill at most COL2IM_MAX_FILL of their vectors)."""
    lanes, channels = VECTOR_LANES[config.isa], config.cin_per_group
    rule = _col2im_fills_better(config) and (
        channels < lanes or _lanes_filled(channels, lanes) <= COL2IM_MAX_FILL)
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
    last = _last_part(vectors, block)
    rows, rows_last, tiles = _register_tiles(config.isa, block, last, True, plan)
    return {"vec_block": block, "vec_last": last, "tile_rows": rows,
            "tile_rows_last": rows_last, "tiles": tiles,
            "col_pixels": plan.get("col_pixels", COL_PIXELS),
            "partial_steps": PARTIAL_PRODUCTS}


def _weight_sums_bytes(config: KernelConfig) -> int:
    """Bytes of a weight gradient's f32 sums: every tap, input channel and vector of
    output channels of every group."""
    lanes = VECTOR_LANES[config.isa]
    vectors = -(-config.cout_per_group // lanes)
    return 4 * config.groups * prod(config.kernel) * config.cin_per_group * vectors * lanes


def _max_slices(sums_bytes: int, plan: Mapping[str, int]) -> int:
    """Most pixel slices of a weight gradient: several only while the sums stay in L2."""
    if sums_bytes > SUMS_IN_L2_BYTES:
        return 1
    return _power_of_two_floor(min(plan.get("max_slices", MAX_SLICES),
                                   SLICE_SUMS_BYTES // sums_bytes))


def weight_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Register blocking of the weight-gradient tiles: input channels x vectors of
    output channels of one tap."""
    lanes = VECTOR_LANES[config.isa]
    vectors = -(-config.cout_per_group // lanes)
    rule = MAX_VECTOR_BLOCK[config.isa]
    sums_bytes = _weight_sums_bytes(config)
    one_tap = all(k == 1 for k in config.kernel)  # 1x1, any stride
    if one_tap:
        rule = POINTWISE_WEIGHT_VECTOR_BLOCK.get(config.isa, rule)
    elif (vectors % 2 == 0 and vectors <= ONE_VECTOR_TAIL_MAX_VECTORS.get(config.isa, 0)
          and (_last_part(vectors, rule) == 1 or (
              _last_part(vectors, rule) == 2
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
    last = _last_part(vectors, block)
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
        rows, total = _near_equal(channels, max(1, min(channels, budget))), channels
    rows = min(rows, total)
    rows_last = _last_part(total, rows)
    tiles = list(dict.fromkeys((r, v) for r in (rows, rows_last) for v in (block, last)))
    # Packed panels (bwd_weights_packed.c.j2): per chunk, each thread copies what its tiles
    # read into panels at consecutive addresses (see _feeds_packing).
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
        in_place = _nxc_in_place(config)
    packed = not flatten_w and not dot and bool(plan.get(
        "packed", not in_place and _feeds_packing(config)))
    # Otherwise tiles broadcast src values, so NCX src needs no transpose: each tile row
    # is a stream along the pixels of one channel (f32 is read in place, f16/bf16 widened
    # in their order). Only diff_dst, the vector operand, is made channels-last.
    src_channels_first = config.data_format == "NCX" and not flatten_w and not (
        dot or packed)
    in_l2 = sums_bytes <= SUMS_IN_L2_BYTES
    nxc_in_place = config.data_format == "NXC" and not (packed or flatten_w or dot)
    if packed and _rows_overlap(config):
        rule_pixels = PACKED_OVERLAP_CHUNK_PIXELS
    elif in_l2 and nxc_in_place:
        rule_pixels = NXC_IN_PLACE_CHUNK_PIXELS.get(lanes, CHUNK_PIXELS)
    elif in_l2:
        light = (config.data_format == "NCX" and config.dtype == "f32" and (
            cin * config.cout_per_group * prod(config.kernel) <= NCX_LIGHT_MACS
            or _rows_overlap(config)))
        rule_pixels = NCX_LIGHT_CHUNK_PIXELS if light else CHUNK_PIXELS
    else:
        rule_pixels = 0
    chunk_pixels = plan.get("chunk_pixels", rule_pixels)
    max_slices = _max_slices(sums_bytes, plan)
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
            # ...and its diff_dst is transposed chunk by chunk, by the thread that uses it
            "dd_by_chunk": src_channels_first,
            "src_in_place": src_channels_first and config.dtype == "f32",
            "prefetch_next_chunk": _prefetch_next_chunk(config, chunk_pixels,
                                                        flatten_w or dot),
            "image_block_bytes": image_block_bytes(config, plan)}


def _kernel_extents(config: KernelConfig) -> list[int]:
    """Input pixels the dilated kernel spans along each spatial axis."""
    return [(k - 1) * d + 1 for k, d in zip(config.kernel, config.dilations, strict=True)]


def _rows_overlap(config: KernelConfig) -> bool:
    """Whether some src row along d or h is read by several output rows (a kernel extent
    above its stride there)."""
    return any(e > s for e, s in zip(_kernel_extents(config)[:-1], config.strides[:-1],
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
    if _kernel_extents(config)[-2] > sh:
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
    last = _last_part(total, rows)
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
    return all(s <= e for s, e in zip(config.strides, _kernel_extents(config), strict=True))


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
    rows_last = _last_part(config.cin_per_group, rows)
    cols = min(DOT_COLS, config.cout_per_group)
    cols_last = _last_part(config.cout_per_group, cols)
    return {"ncx_dot": True, "tile_rows": rows,
            "dot_tiles": list(dict.fromkeys((r, c) for r in (rows, rows_last)
                                            for c in (cols, cols_last))),
            "chunk_pixels": plan.get("chunk_pixels") or DOT_CHUNK_PIXELS,  # never by bytes
            "superblock_bytes": DOT_SUPERBLOCK_BYTES,
            "partial_pixels": partial_steps(config),
            "max_slices": _max_slices(_weight_sums_bytes(config), plan),
            "slice_min_pixels": SLICE_MIN_PIXELS}


def dot_eligible(config: KernelConfig) -> bool:
    """Whether the pixel-dot plan can compute this configuration."""
    return (config.family == "bwd_weights" and config.data_format == "NCX"
            and config.dtype == "f32" and not config.depthwise and config.strides[-1] == 1)


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
# Data gradients spread their input whole up front while the spread copy takes at most
# this (a last-level cache: Zen 3's L3), else row by row as each thread's output rows
# read them. Sapphire Rapids, batch 8, pair ratios rows / whole, 1 / 2 threads, avx2 and
# avx512: ResNeXt conv_3d:1 (8x56x56, 4 channels per group, 154 MB spread) 1.95-2.03,
# 3d_gconv block-4 (21^3, 28-38 MB) 1.05-1.11, but 3d_gconv s2 (11-22 MB, short rows)
# 0.85-0.94.
SPREAD_WHOLE_BYTES = 32 * 1024 * 1024


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
    outs_last = _last_part(config.cout_per_group, outs)
    vecs_last = _last_part(vectors, vecs)
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
            and prod(config.kernel) * _reduced_channels(config) <= MAX_SPREAD_PRODUCTS)


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


def _all_taps_vectors(config: KernelConfig) -> int:
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
    all_taps = _all_taps_vectors(config) > 0 and bool(plan.get("all_taps", 0))
    slide = (config.strides[-1] == 1 and taps_w > 1 and window <= MAX_UNROLLED_TAPS
             and bool(plan.get("slide", 0)) and not all_taps)
    per_vector = taps_w + window + 1 if slide else taps_w + 1
    budget = REGISTERS[config.isa] if slide else ACCUMULATORS[config.isa]
    most = _all_taps_vectors(config) if all_taps else budget // per_vector
    block = max(1, min(vectors, plan.get("vec_block", MAX_VECTOR_BLOCK[config.isa]), most))
    last = _last_part(vectors, block)
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


# Outputs per band of the AMX path's KxK data gradients (amx_rows.h.j2): whole rows of
# the input width plus the kernel's extent, about this many, copied per thread with their
# rows above and below (56x56x64 bf16: 18 rows, 150 KB), so that the last block's
# overrun past a band is small.
AMX_BAND_PIXELS = 1024


# Bytes of the AMX weight gradients' copies per band (amx_weights.h.j2): src channels
# first and diff_dst pairs, (CIN + COUT) x 2 bytes a pixel, about this much (in L2 while
# every block runs over them), and at least AMX_WEIGHT_MIN_BAND pixels, so that a block's
# sums go in and out of its tiles once per 8 multiplies or fewer.
AMX_WEIGHT_BAND_BYTES = 1 << 20
AMX_WEIGHT_MIN_BAND = 256


# The CPU features (Linux names) the AMX path runs on.
AMX_FEATURES = frozenset({"amx_tile", "amx_bf16"})


def amx_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Whether a kernel carries the AMX path (amx.h.j2): bf16 (channels first through
    channels-last copies), one group, channels in whole blocks of 32 on both sides, any
    taps (the copies of a band are made once per depth tap) and any strides: fwd and
    bwd_weights by phase of the stride (the band's copies split the input by phase),
    bwd_data with taps by phase of the result (amx_phases.h.j2), 1x1 bwd_data with the
    result's pixels between zero. The kernel takes it on a CPU with AMX-BF16 (which it
    checks at run time), else runs its other tiles."""
    one_by_one = all(k == 1 for k in config.kernel)
    pointwise = config.pointwise or (config.family == "bwd_data" and one_by_one)
    eligible = (config.dtype == "bf16" and config.isa == "avx512bf16" and config.groups == 1
                and _reduced_channels(config) % 32 == 0 and config.vector_channels % 32 == 0)
    if not (eligible and plan.get("amx", 1)):
        return {"amx": False}
    if config.family == "bwd_weights":
        pixels = AMX_WEIGHT_BAND_BYTES // (2 * (config.cin_per_group + config.cout_per_group))
        return {"amx": True, "amx_band_pixels": max(AMX_WEIGHT_MIN_BAND, pixels)}
    # how the weights repack: a pair of reduced channels is one 32-bit word of the user's
    # weights where the reduced channels are their contiguous axis (bwd_data XIO: [i][o],
    # fwd OIX 1x1: [o][i], fwd OXI); the output channels are, in the other two 1x1 cases,
    # fwd XIO and bwd_data OXI; OIX with several taps has neither
    one_tap = prod(config.kernel) == 1
    fmt, data = config.weights_format, config.family == "bwd_data"
    if (fmt == "OXI" and not data) or data == (fmt == "XIO") and (one_tap or fmt == "XIO"):
        pack = "pairs"
    else:
        pack = "rows" if one_tap or fmt in ("XIO", "OXI") else "values"
    phases = config.family == "bwd_data" and not pointwise and any(s > 1 for s in config.strides)
    return {"amx": True, "amx_pointwise": pointwise, "amx_phases": phases, "amx_pack": pack,
            "amx_band_pixels": AMX_BAND_PIXELS}


def pointwise_ncx_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """The channels-first pointwise plan of a data gradient (fwd, bwd_data), or none."""
    reduced = _reduced_channels(config)
    if not (config.pointwise and config.data_format == "NCX" and config.dtype == "f32"
            and not config.depthwise
            and plan.get("ncx_in_place", reduced <= NCX_MAX_REDUCED)):
        return {"pointwise_ncx": False}
    out_channels = config.vector_channels
    rows = min(NCX_ROWS[config.isa], out_channels)
    last = _last_part(out_channels, rows)
    vecs = NCX_VECS[config.isa]
    return {"pointwise_ncx": True, "ncx_rows": rows, "ncx_vecs": vecs,
            "ncx_tiles": list(dict.fromkeys((r, v) for r in (rows, last)
                                            for v in range(vecs, 0, -1))),
            "ncx_min_pixels": NCX_MIN_PIXELS,
            "ncx_reduce_chunk": _ncx_reduce_chunk(config, plan, vecs),
            "ncx_head": bool(plan.get("ncx_head", reduced >= NCX_HEAD_MIN_REDUCED)),
            # channel blocks per chunk: their weights stay in L2; near-equal chunks (171
            # blocks as 57 x 3, not 85 + 85 + 1: threads share the chunks' work evenly)
            "ncx_block_chunk": _near_equal(-(-out_channels // rows),
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
    reduced = _reduced_channels(config)
    per_channel = vecs * VECTOR_LANES[config.isa] * 4
    steps = partial_steps(config, plan)
    if "ncx_pass_kb" in plan:
        budget = plan["ncx_pass_kb"] * 1024 or reduced * per_channel
    else:
        budget = NCX_L1_INPUT_BYTES
    if reduced * per_channel <= budget:
        return reduced
    return max(1, budget // (per_channel * steps)) * steps


def _near_equal(total: int, most: int) -> int:
    """The size of near-equal parts of `total`, none above `most`."""
    return -(-total // -(-total // most))


# Depthwise data gradients with stride 1 along w run whole runs in sliding tiles of
# SLIDE_ROWS outputs x one vector: each input column is loaded once per (kd, kh) for all
# w taps (registers: the rows, KW weights and one input vector). Measured on Zen 4,
# MobileNet 3x3 layers, 1 thread: 32 channels on 112x112 22 -> 26 GFLOP/s (both paths);
# 128 on 56x56 avx2 10.6 -> 14.5; but 512 on 14x14 avx2 33 -> 21 (pixels 2 KB apart): only
# up to SLIDE_MAX_CHANNELS.
SLIDE_ROWS = {"avx512bf16": 16, "avx512": 16, "avx2": 11, "portable": 11, "neon": 16,
              "sve256": 16}
SLIDE_MAX_CHANNELS = 256
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
# res2a_branch1 (64 -> 256 on 56x56, 25.7 MB) 1.05 / 1.02-1.03.
LINE_FLOATS = 16
STREAM_MIN_KB = 8192
STREAM_VECTOR_BLOCK = {"avx2": 4}
STREAM_STRIDE_1_LANES = (16,)


def _may_stream(config: KernelConfig, plan: Mapping[str, int]) -> bool:
    """Whether a data gradient's tiles may store its result past the caches: f32
    channels-last, written in place, in whole cache lines of every pixel (channels a
    multiple of a line), with non-temporal stores (x86); depthwise or across-group
    kernels (whose sliding tiles, which store one vector of each pixel at a time, then
    run only on results that do not stream), and 1x1 backward-data kernels of one group's
    channels (direct.c.j2), with strides or on STREAM_STRIDE_1_LANES (see STREAM_MIN_KB)."""
    across = config.depthwise or data_across_groups(config, plan)
    lines = (_lane_channels(config) if across else config.vector_channels) % LINE_FLOATS == 0
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
    never): where _may_stream and each vector block spans whole cache lines."""
    if not _may_stream(config, plan):
        return 0
    if direct_tiles(config, plan)["vec_block"] * VECTOR_LANES[config.isa] % LINE_FLOATS:
        return 0
    return plan.get("stream_kb", STREAM_MIN_KB) * 1024


def slide_rows(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> int:
    """Outputs per depthwise sliding tile, 0 where the kernel has none."""
    kw = config.kernel[-1]
    if not (config.depthwise and config.family != "bwd_weights" and config.strides[-1] == 1
            and kw > 1 and plan.get("slide", config.groups <= SLIDE_MAX_CHANNELS)):
        return 0
    return max(0, min(SLIDE_ROWS[config.isa], REGISTERS[config.isa] - kw - 2))


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
    copies, computes and copies back a few rows at a time (ncx_bands.h.j2); 0: blocks of
    whole images (image_block_bytes). Not for 3-D layers (a band of rows reads rows of
    several planes), 1x1 layers (their tiles run over all of an image's pixels at once)
    or bf16 pairs (their own copies)."""
    eligible = (config.data_format == "NCX" and config.family != "bwd_weights"
                and config.rank <= 2 and not config.pointwise
                and not uses_bf16_dot(config, plan))
    weight_bytes = (prod(config.kernel) * config.groups * config.cin_per_group
                    * config.cout_per_group * 4)
    rule = BAND_BYTES if weight_bytes <= BAND_MAX_WEIGHT_BYTES else 0
    return plan.get("band_kb", rule >> 10) << 10 if eligible else 0


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


def _rounds_in_tiles(config: KernelConfig) -> bool:
    """f16/bf16 channels-last results: the last chunk's tiles round into the user's
    tensor, with no f32 pass over the whole result."""
    return (config.dtype != "f32" and config.data_format == "NXC"
            and config.family != "bwd_weights" and not config.depthwise)


def _body(config: KernelConfig, plan: Mapping[str, int]) -> dict:
    """The template that computes this configuration, and its tiles."""
    if config.family == "bwd_weights" and config.depthwise:
        return {"body": "depthwise_weights.c.j2", **depthwise_weight_rows(config, plan)}
    if config.family == "bwd_weights":
        grouped = weights_across_groups(config, plan)
        if grouped["group_lanes"]:
            return {"body": "grouped_weights.c.j2", **grouped}
        dot = dot_tiles(config, plan)
        if dot["ncx_dot"]:
            return {"body": "bwd_weights_dot.c.j2", "no_scratch": True, **dot}
        tiles = weight_tiles(config, plan)
        if tiles["packed"]:
            body = "bwd_weights_packed.c.j2"
        elif uses_bf16_dot(config, plan):  # bf16 pixel pairs
            body = "bwd_weights_pairs.c.j2"
        elif tiles["flatten_w"]:  # (kw, input channel) rows over a padded copy
            body = "bwd_weights_flat.c.j2"
        else:  # input-channel rows of one tap
            body = "bwd_weights.c.j2"
        return {"body": body, "no_scratch": tiles["packed"], **tiles, **amx_tiles(config, plan)}
    if config.depthwise or data_across_groups(config, plan):
        grouped = not config.depthwise  # input spread to the lanes, never padded
        return {"body": "depthwise.c.j2", "slide_rows": slide_rows(config, plan),
                "pad_columns_below": 0 if grouped else pad_columns_below(config, plan),
                "vector_per_group": config.vector_channels if grouped else 1,
                "reduced_per_group": _reduced_channels(config) if grouped else 1,
                "compute_scratch": True, "stream_min_bytes": stream_min_bytes(config, plan),
                "spread_whole_bytes": plan.get("spread_whole_mb", SPREAD_WHOLE_BYTES >> 20) << 20,
                "round_in_tiles": False, "pointwise_ncx": False, "overlap_runs": False,
                **direct_tiles(config, plan)}
    if col2im(config, plan):
        in_place = config.data_format == "NCX" and config.dtype == "f32" and bool(
            plan.get("ncx_in_place", 1))
        return {"body": "col2im.c.j2", "column_runs": False, "compute_scratch": True,
                "input_in_place": in_place,
                "round_in_tiles": False, "pad_columns_below": 0, "image_block_bytes": 0,
                "pointwise_ncx": False, **col2im_tiles(config, plan)}
    tiles, ncx = direct_tiles(config, plan), pointwise_ncx_tiles(config, plan)
    amx = amx_tiles(config, plan)
    bands = band_bytes(config, plan)
    second, ncx_second = split_tiles("NCX bands" if bands else config.data_format,
                                     tiles["tiles"], ncx.get("ncx_tiles", []), amx["amx"])
    return {"body": "direct.c.j2", "pad_columns_below": pad_columns_below(config, plan),
            "overlap_runs": overlap_runs(config, plan),
            "stream_min_bytes": stream_min_bytes(config, plan),
            "band_bytes": bands,
            "no_scratch": bool(bands),  # copies bands of rows, not whole tensors
            "image_block_bytes": image_block_bytes(config, plan),
            "second_part": second, "ncx_second_part": ncx_second, **tiles, **ncx, **amx}


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


# Kernels whose tiles carry IN_PART guards (functions.h.j2): direct kernels split their
# tiles between the two objects (split_tiles); weight gradients from row segments
# (weight_tiles.h.j2) put all their tiles in the second, about a third of their compile
# time (GCC 12, Zen 4: 0.08-0.14 s of tiles beside 0.25-0.7 s of the rest).
TWO_PART_BODIES = ("direct.c.j2", "bwd_weights.c.j2", "bwd_weights_packed.c.j2")


def compile_parts(config: KernelConfig, plan: Mapping[str, int] | None = None) -> int:
    """How many objects a build of this kernel (of `plan`, default the rules') may
    compile at once (functions.h.j2): two for direct kernels (their tiles split, the
    AMX path, where there is one, in the second) and for weight gradients from row
    segments (their tiles and AMX path in the second)."""
    return 2 if _body(config, plan or EMPTY_PLAN)["body"] in TWO_PART_BODIES else 1


def transpose_masks(lanes: int) -> dict[int, tuple[list[int], list[int]]]:
    """Per stage b of an in-register transpose, the two-source shuffle masks of row i
    (lanes with bit b set come from row i + b) and of row i + b."""
    return {b: ([lanes + j - b if j & b else j for j in range(lanes)],
                [lanes + j if j & b else j + b for j in range(lanes)])
            for b in _halvings(lanes)}


def _halvings(lanes: int) -> list[int]:
    return [lanes >> k for k in range(1, lanes.bit_length()) if lanes >> k]


def render_context(config: KernelConfig, generator_version: str,
                   plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Everything kernel.c.j2 reads, derived from the configuration and its plan."""
    pad = 3 - config.rank
    kernel_w = config.kernel[-1]
    body = _body(config, plan)
    return {
        "name": kernel_name(config, plan),
        "generator_version": generator_version,
        "plan_items": sorted(plan.items()),
        "family": config.family,
        "family_doc": FAMILY_DOCS[config.family],
        "config_items": list(config.to_dict().items()),
        "rank": config.rank,
        "groups": config.groups,
        "cin_per_group": config.cin_per_group,
        "cout_per_group": config.cout_per_group,
        "k3": (1,) * pad + config.kernel,
        "s3": (1,) * pad + config.strides,
        "d3": (1,) * pad + config.dilations,
        "dtype": config.dtype,
        "data_format": config.data_format,
        "weights_format": config.weights_format,
        # f32 channels-last data is used in place; anything else goes through f32 scratch.
        "pack_data": config.dtype != "f32" or config.data_format != "NXC",
        # data kernels compile pack_data and unpack_data (NCX: the transposes) in the
        # second object of a build in two (SECOND_BASE_COST)
        "copies_in_second_part": config.family != "bwd_weights",
        "unroll_taps": f"#pragma GCC unroll {kernel_w}" if 1 < kernel_w <= MAX_UNROLLED_TAPS
        else "",
        "isa": config.isa,
        "vl": VECTOR_LANES[config.isa],
        "simd": SIMD[config.isa],
        "transpose_stages": _halvings(VECTOR_LANES[config.isa]),
        "transpose_masks": transpose_masks(VECTOR_LANES[config.isa]),
        "bf16_dot": uses_bf16_dot(config, plan),
        "regroup_pixels": config.family == "bwd_weights" and config.data_format == "NXC"
        and not config.depthwise and config.pointwise,
        "round_in_tiles": _rounds_in_tiles(config),
        "no_scratch": False,  # True: the body copies no whole data tensor
        # True: compute() takes part 4 of the workspace as scratch (depthwise.c.j2's
        # spread input rows, col2im.c.j2's columns)
        "compute_scratch": False,
        "column_runs": True,  # the body plans runs of output columns (runs.h.j2)
        "input_in_place": False,  # True: a data kernel reads its input in the user's layout
        "image_block_bytes": 0,  # > 0: data_entry runs blocks of images (direct.c.j2)
        "band_bytes": 0,  # > 0: data_entry runs bands of rows (direct.c.j2, ncx_bands.h.j2)
        "amx": False,  # True: the body carries the AMX path (amx.h.j2)
        "pad_max_zeros_percent": PAD_MAX_ZEROS_PERCENT,
        # NCX blocks of VL channels x VL pixels transposed in registers: into f32 scratch
        # (whole tensors, bands of rows or chunks) and into the packed plan's diff_dst panels
        "transpose_to_f32": config.data_format == "NCX" and (
            body["body"] == "bwd_weights_packed.c.j2" or body.get("band_bytes", 0) > 0
            or not (uses_bf16_dot(config, plan) or body.get("no_scratch", False))),
        **body,
    }


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
            taps = [{"all_taps": 1}] if _all_taps_vectors(config) else []
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
        if _weight_sums_bytes(config) > SUMS_IN_L2_BYTES:  # the other of pixels and bytes
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
    if _may_stream(config, EMPTY_PLAN):
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
        if ncx["ncx_reduce_chunk"] < _reduced_channels(config):
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
