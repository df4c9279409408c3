"""Vendor rules: where a CPU vendor's cores measured apart from the CPUs the rules
were set on, the plan that differs there (the rules' plan on that vendor).
"""

from __future__ import annotations

from collections.abc import Iterable

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import AMX_FEATURES, VECTOR_LANES
from convgrad.codegen.rules_common import (
    MAX_VECTOR_BLOCK,
    uses_bf16_dot,
    weight_sums_bytes,
    wide_vector_block,
)
from convgrad.codegen.rules_groups import data_across_groups
from convgrad.codegen.rules_weights import (
    NCX_IN_PLACE_MAX_SUMS,
    SUMS_IN_L2_BYTES,
    feeds_packing,
    nxc_in_place,
    weight_tiles,
)
from convgrad.codegen.variants import Variant, carries_amx, resolve_plan

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
PACKED_NCX_VENDORS = {"avx2": ("GenuineIntel",), "avx512": ("GenuineIntel",)}
INTEL_NCX_IN_PLACE_MAX_SUMS = {8: 64 * 1024, 16: NCX_IN_PLACE_MAX_SUMS[16]}
# Intel's cores keep the limits the rules had on Sapphire Rapids (a vendor's rule is a
# plan: vendor_plan): stride 1, inputs INTEL_IN_PLACE_CIN, outputs up to
# INTEL_IN_PLACE_MAX_COUT. There, strided layers read in place also bring in the lines of
# the pixels a stride skips (Sapphire Rapids avx512, 1x1 256->128 stride 2, time in place
# / packed, 1 / 2 threads: batch 2 1.08 / 1.02, 8 1.07 / 1.14, 16 1.04 / 1.12, 32 1.11 /
# 1.11), and long rows a power of two apart share a few cache sets (Ice Lake avx2, 1x1
# 1024->256: 47 GFLOP/s in place, 93 from panels).
PACKED_NXC_VENDORS = ("GenuineIntel",)


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
            and carries_amx(config)):
        plan["amx"] = 0
    if vendor in WIDEN_BF16_VENDORS and uses_bf16_dot(config):
        return {"bf16_dot": 0, **plan}
    if (vendor in PACKED_NCX_VENDORS.get(config.isa, ()) and _ncx_in_place(config)
            and (weight_sums_bytes(config) > INTEL_NCX_IN_PLACE_MAX_SUMS[
                VECTOR_LANES[config.isa]]
                 # more outputs than inputs: in place measured on AMD's cores only
                 or config.cout_per_group > config.cin_per_group)):
        return {"packed": 1, **plan}
    if (vendor in NCX_WIDE_SUMS_VENDORS and config.family == "bwd_weights"
            and config.data_format == "NCX" and config.pointwise
            and weight_sums_bytes(config) > SUMS_IN_L2_BYTES
            and weight_tiles(config)["vec_block"] > NCX_WIDE_SUMS_WEIGHT_VECTOR_BLOCK):
        return {"vec_block": NCX_WIDE_SUMS_WEIGHT_VECTOR_BLOCK, **plan}
    if (vendor in PACKED_NXC_VENDORS and nxc_in_place(config)
            and not nxc_in_place(config, intel=True) and feeds_packing(config)
            and resolve_plan(config).variant is Variant.WEIGHTS
            and resolve_plan(config, {"packed": 1}, strict=False).variant
            is Variant.WEIGHTS_PACKED):
        return {"packed": 1, **plan}
    across = config.depthwise or data_across_groups(config)
    if vendor in NARROW_VENDORS.get(config.isa, ()) and wide_vector_block(config, across):
        return {"vec_block": MAX_VECTOR_BLOCK[config.isa], **plan}
    return plan


def _ncx_in_place(config: KernelConfig) -> bool:
    """Whether the rules read this channels-first weight gradient's src in place (the
    variant they pick for it broadcasts src along its rows)."""
    return (config.family == "bwd_weights" and config.data_format == "NCX"
            and resolve_plan(config).choices.get("src_channels_first", False))
