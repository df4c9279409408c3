"""CPU feature detection and the choice of ISA path."""

from __future__ import annotations

import os
import platform
from functools import cache

from convgrad.codegen.config import ISAS
from convgrad.codegen.plan import runnable_isas


@cache
def cpu_features() -> frozenset[str]:
    """Feature flags of this CPU as Linux names them (empty where unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def available_isas() -> tuple[str, ...]:
    """ISA paths this machine can run, best first ("portable" always)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("portable",)
    return tuple(runnable_isas(cpu_features()))


def selected_isa() -> str:
    """The ISA path kernels are built for: CONVGRAD_ISA if set, else the best one."""
    forced = os.environ.get("CONVGRAD_ISA", "").strip().lower()
    if not forced:
        return available_isas()[0]
    if forced not in ISAS:
        raise ValueError(f"CONVGRAD_ISA={forced!r} is not one of {list(ISAS)}")
    if forced not in available_isas():
        raise RuntimeError(
            f"CONVGRAD_ISA={forced!r} cannot run on this CPU (it runs {list(available_isas())})")
    return forced
