"""Named CPU targets for ahead-of-time builds, as archspec (the library Spack uses to
name microarchitectures) names them: `x86_64_v3`, `zen3`, `zen4`, `sapphirerapids`,
`aarch64`, `neoverse_n1`, `neoverse_v1`, `riscv64`, ... archspec gives each target's
family, features and compiler flags; this module maps a target to the best ISA path
convgrad has for it.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

import archspec.cpu

from convgrad.codegen.isa import ISA_FEATURES

# SVE vector lengths archspec does not record (bits); convgrad's SVE path is 256-bit.
SVE_BITS = {"neoverse_v1": 256, "a64fx": 512}
X86_PATHS = ("avx512bf16", "avx512", "avx2")


@dataclass(frozen=True)
class Target:
    """A named microarchitecture and the ISA path convgrad builds for it."""

    name: str
    family: str  # "x86_64", "aarch64", "riscv64", ...
    vendor: str
    features: frozenset[str]
    isa: str

    def flags(self, compiler: str, version: str) -> tuple[str, ...]:
        """archspec's flags for this target and compiler ("gcc", "clang") version, or
        for its nearest ancestor the compiler knows (GCC 12.2 has no -march=znver4)."""
        microarchitecture = archspec.cpu.TARGETS[self.name]
        version = ".".join(version.split(".")[:2])
        for candidate in [microarchitecture, *microarchitecture.ancestors]:
            try:
                return tuple(candidate.optimization_flags(compiler, version).split())
            except archspec.cpu.UnsupportedMicroarchitecture:
                continue
        return ()

    def to_dict(self) -> dict:
        return {"name": self.name, "family": self.family, "vendor": self.vendor,
                "features": sorted(self.features)}


def target(name: str) -> Target:
    """The target `name` (ValueError, naming close matches, for an unknown one)."""
    microarchitecture = archspec.cpu.TARGETS.get(name)
    if microarchitecture is None:
        known = sorted(archspec.cpu.TARGETS)
        close = difflib.get_close_matches(name.lower().replace("-", "_"), known, n=6)
        raise ValueError(f"unknown target {name!r}; archspec names targets such as "
                         f"{', '.join(close or ['x86_64_v3', 'zen4', 'neoverse_n1'])}")
    features = frozenset(microarchitecture.features)
    family = microarchitecture.family.name
    return Target(name, family, microarchitecture.vendor, features,
                  best_isa(name, family, features))


def best_isa(name: str, family: str, features: frozenset[str]) -> str:
    """The ISA path for a microarchitecture of `family` with `features`."""
    if family == "x86_64":
        return next((isa for isa in X86_PATHS if ISA_FEATURES[isa] <= features), "portable")
    if family == "aarch64":
        return "sve256" if "sve" in features and SVE_BITS.get(name) == 256 else "neon"
    return "portable"


def host() -> str:
    """This machine's microarchitecture, as archspec names it (a VM may hide the model:
    then a generic level such as x86_64_v4)."""
    return archspec.cpu.host().name


def compiler_kind(identity: str) -> tuple[str, str]:
    """("gcc" or "clang", "X.Y.Z") from a compiler's --version text."""
    kind = "clang" if "clang" in identity.lower() else "gcc"
    found = re.search(r"(\d+\.\d+(?:\.\d+)?)", identity.split(":", 1)[-1])
    return kind, found.group(1) if found else "0"
