"""ISA paths: the CPU features each needs, its compiler flags, vector lanes and
registers. The runtime reads ISA facts from here only.
"""

from __future__ import annotations

from collections.abc import Iterable

from convgrad.codegen.config import ISAS

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


def runnable_isas(cpu_features: Iterable[str]) -> list[str]:
    """ISA paths this CPU can run, best first."""
    features = set(cpu_features)
    return [isa for isa in ISAS[::-1] if ISA_FEATURES[isa] <= features]


# The CPU features (Linux names) the AMX path runs on.
AMX_FEATURES = frozenset({"amx_tile", "amx_bf16"})
