"""Rules that choose the kernel configuration of a problem itself, before any plan: which
ISA path its vectors take (narrowed_isa) and whether a weight gradient runs as the
problem with its two inputs swapped (swaps_operands). The configuration (config.py) and
the problem's resolution (ops.py) apply them; they take plain values, so that this
module imports nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

# Kernels whose vectors run over at most this many channels take the avx2 path's 8-lane
# vectors on avx512: 16 lanes would leave half or more of each vector empty. Measured on
# Ice Lake-SP, 1 thread: ResNet-50 conv1's data gradient (3 channels) 14 GFLOP/s on
# avx512, 29 on avx2; 3-D grouped weight gradients with 4 channels per group 13 vs 17.
NARROW_CHANNELS = 8


def narrowed_isa(isa: str, vector_channels: int) -> str:
    """The ISA path of a kernel on `isa` whose vectors run over `vector_channels`
    channels: avx2 for avx512 where its vectors would be mostly empty (NARROW_CHANNELS)."""
    return "avx2" if isa == "avx512" and vector_channels <= NARROW_CHANNELS else isa


# A 1x1 weight gradient with stride 1 and no pads is symmetric in its two data inputs:
# diff_W[o][i] = sum over pixels of diff_dst[o] * src[i], so the kernel of the problem
# with src and diff_dst swapped (Cin and Cout swapped) computes it, its [i'][o'] sums
# (XIO) being the [o][i] (OIX) weights and the other way round. Channels-first f32 ones
# run with fewer outputs than inputs where the weights take at most SWAP_MAX_SUMS_BYTES:
# the planner then reads the larger tensor in place and transposes only the smaller one,
# instead of copying both into panels; and with more outputs than inputs where they take
# at least SWAP_MIN_SUMS_BYTES: both are packed then, and the panels of more output
# channels run faster on avx2. Sapphire Rapids, batch 8, pair ratios swapped / as given
# on 1 / 2 threads (XIO; OIX weights through register transposes):
#   more outputs: avx512 32->64 on 56x56 1.31 / 1.24, 64->128 1.21 / 1.20, 64->256
#   (ResNet-50's res2a_branch1) 1.20 / 1.25, 128->256 on 28x28 and 56x56 1.07-1.19 /
#   1.04-1.06, 128->512 (256 KB) 1.04-1.08 / 1.01-1.10, 256->1024 0.93 / 0.96, 512->2048
#   0.80 / 0.80; avx2 up to 32 KB 1.06-1.37 / 0.98-1.36, 64->256 1.03-1.04 / 0.96-1.05,
#   128->256 0.99-1.02 / 0.99-1.01, 128->512 0.94-0.95 / 0.96-0.98, 256->1024 0.85 / 0.85.
#   bf16 and f16 (widened copies) lose: 64->256 on avx512 0.71-0.78 on 1 thread.
#   fewer outputs: avx2 256->64 1.04 / 1.04, 512->128 1.07 / 1.03, 1024->256 (1 MB)
#   1.16 / 1.16, 2048->512 1.08 / 1.10; avx512 256->64 1.07 / 0.82, 512->128 0.93 / 0.95,
#   1024->256 1.01 / 0.99, 2048->512 0.98 / 1.01.
# Zen 4, same measure (after the sums left for the weights in whole vectors): 128->512
# on 28x28 (256 KB) avx2 1.12 / 1.20, avx512 1.11 / 1.09; 256->1024 avx2 0.93 / 1.05,
# avx512 1.15 / 1.14; 512->2048 avx2 0.92 / 0.89, avx512 1.04 / 0.97; hence 256 KB, not
# the 128 KB Sapphire Rapids' avx2 figures asked for.
# resolve() knows no ISA (the runtime, the AOT build and its fallback to a lesser ISA's
# kernels must agree on the configuration), hence thresholds both paths accept.
SWAP_MAX_SUMS_BYTES = 256 * 1024
SWAP_MIN_SUMS_BYTES = 1024 * 1024
# Channels-last f32 ones run swapped where fewer outputs than inputs leave the last of
# avx512's vectors half empty (SWAP_NXC_HALF_LANES more than a multiple of 16: the
# vectors then run over the inputs, full) and the weights take at most
# SWAP_NXC_MAX_SUMS_BYTES. Sapphire Rapids, batch 8, time as given / swapped (paired
# calls, exact on integer data), 1 / 2 threads: avx512 144->24 on 28x28 1.16-1.19 /
# 1.19, on 56x56 1.20 / 1.19, 96->24 1.16, 72->24 1.12 / 1.11, 64->24 on 56x56 1.17 /
# 1.15, 240->40 on 28x28 1.10 / 1.10, on 14x14 1.08 / 1.09; avx2 (24 and 40 fill whole
# vectors of 8) 1.02-1.07 / 1.02-1.08, 64->24 1.15 / 1.03, 240->40 0.99-1.04 / 0.98-0.99.
# Not 480->40 (77 KB): avx512 1.01 / 0.98, avx2 0.91 / 0.85. Nor outputs that fill whole
# vectors: 192->32 avx512 0.99, avx2 0.95; 384->64 0.84, 0.91; 960->160 0.88, 1.05.
SWAP_NXC_HALF_LANES = 8
SWAP_NXC_MAX_SUMS_BYTES = 48 * 1024


def swaps_operands(data_format: str, dtype: str, groups: int, kernel: Sequence[int],
                   strides: Sequence[int], pads_begin: Sequence[int],
                   pads_end: Sequence[int], cin: int, cout: int) -> bool:
    """Whether a weight gradient runs as the problem with its inputs swapped (its kernel
    computes the weights of the problem with src and diff_dst exchanged):
    SWAP_MAX_SUMS_BYTES, SWAP_MIN_SUMS_BYTES (channels first), SWAP_NXC_HALF_LANES and
    SWAP_NXC_MAX_SUMS_BYTES (channels last)."""
    sums = 4 * cin * cout
    if not (dtype == "f32" and groups == 1 and all(k == 1 for k in kernel)
            and all(s == 1 for s in strides) and not any(pads_begin) and not any(pads_end)):
        return False
    if data_format == "NXC":
        return (cin > cout and cout % 16 == SWAP_NXC_HALF_LANES
                and sums <= SWAP_NXC_MAX_SUMS_BYTES)
    return (cout > cin and sums <= SWAP_MAX_SUMS_BYTES
            or cin > cout and sums >= SWAP_MIN_SUMS_BYTES)
