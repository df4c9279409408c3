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
    return frozenset(_cpuinfo().get("flags", "").split())


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


@cache
def cpu_model() -> str:
    """This CPU as /proc/cpuinfo names it, with its family, model and stepping (a VM's
    model name alone, such as "AMD EPYC", does not tell one generation from another)."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    numbers = [f"{key} {info[key]}" for key in ("cpu family", "model", "stepping") if key in info]
    return f"{name} ({', '.join(numbers)})" if numbers else name


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
