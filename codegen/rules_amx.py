"""Planner rules of the AMX path (bf16 tiles on CPUs with AMX-BF16).
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.plan_choices import EMPTY_PLAN
from convgrad.codegen.rules_common import reduced_channels

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
# Forward convolutions over fewer input channels than this (an image's 3) multiply
# patches (amx_patches.h.j2): each output pixel's TAPS x CIN input values, at most
# AMX_PATCH_VALUES of them, zeros up to whole multiplies of 32; a band of AMX_PATCH_PIXELS
# output pixels' patches at a time per thread (conv1, 7x7x3: 128 x 320 bytes, 40 KB).
AMX_PATCH_CHANNELS = 16
AMX_PATCH_VALUES = 512
AMX_PATCH_PIXELS = 128
# Output pixels per band of the weight gradients' patches (amx_patch_weights.h.j2): the
# band's patches, their pixel pairs and diff_dst channels first, per thread (conv1:
# 2 x 80 KB + 32 KB).
AMX_PATCH_WEIGHT_PIXELS = 256


def amx_tiles(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Whether a kernel carries the AMX path (amx.h.j2): bf16 (channels first through
    channels-last copies), one group, channels in whole blocks of 32 on both sides, any
    taps (the copies of a band are made once per depth tap) and any strides: fwd and
    bwd_weights by phase of the stride (the band's copies split the input by phase),
    bwd_data with taps by phase of the result (amx_phases.h.j2), 1x1 bwd_data with the
    result's pixels between zero. Forward convolutions over fewer than AMX_PATCH_CHANNELS
    input channels multiply patches of the input instead (amx_patches.h.j2).
    The kernel takes it on a CPU with AMX-BF16 (which it checks at run time), else runs
    its other tiles."""
    one_by_one = all(k == 1 for k in config.kernel)
    pointwise = config.pointwise or (config.family == "bwd_data" and one_by_one)
    amx_isa = config.dtype == "bf16" and config.isa == "avx512bf16" and config.groups == 1
    if amx_isa and plan.get("amx", 1) and takes_patches(config):
        band = AMX_PATCH_WEIGHT_PIXELS if config.family == "bwd_weights" else AMX_PATCH_PIXELS
        return {"amx": True, "amx_patches": True, "amx_band_pixels": band}
    eligible = (amx_isa and reduced_channels(config) % 32 == 0
                and config.vector_channels % 32 == 0)
    if not (eligible and plan.get("amx", 1)):
        return {"amx": False}
    if config.family == "bwd_weights":
        pixels = AMX_WEIGHT_BAND_BYTES // (2 * (config.cin_per_group + config.cout_per_group))
        return {"amx": True, "amx_patches": False,
                "amx_band_pixels": max(AMX_WEIGHT_MIN_BAND, pixels)}
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
    return {"amx": True, "amx_patches": False, "amx_pointwise": pointwise,
            "amx_phases": phases, "amx_pack": pack, "amx_band_pixels": AMX_BAND_PIXELS}


def takes_patches(config: KernelConfig) -> bool:
    """Whether a forward convolution's or weight gradient's AMX path multiplies patches
    of src (amx_patches.h.j2, amx_patch_weights.h.j2): fewer than AMX_PATCH_CHANNELS
    input channels, output channels in whole blocks of 32, at most AMX_PATCH_VALUES
    values a patch (channels first through channels-last copies)."""
    return (config.family in ("fwd", "bwd_weights")
            and config.cin_per_group < AMX_PATCH_CHANNELS
            and config.cout_per_group % 32 == 0
            and prod(config.kernel) * config.cin_per_group <= AMX_PATCH_VALUES)


def amx_columns(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Whether a col2im kernel (backward data with few result channels: conv1's 3)
    carries the AMX path for its columns (amx_columns.h.j2): bf16 channels last on the
    avx512bf16 path, one group, reduced channels in whole multiplies of 32."""
    return {"amx": bool(config.dtype == "bf16" and config.isa == "avx512bf16"
                        and config.groups == 1 and config.data_format == "NXC"
                        and config.cout_per_group % 32 == 0 and plan.get("amx", 1))}
