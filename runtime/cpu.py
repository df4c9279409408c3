"""CPU feature detection and the choice of ISA path."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

from convgrad import settings
from convgrad.codegen.isa import runnable_isas

X86_ISAS = ("avx512bf16", "avx512", "avx2", "portable")
AARCH64_ISAS = ("sve256", "neon", "portable")


@cache
def cpu_features() -> frozenset[str]:
    """Feature flags of this CPU as Linux names them (empty where unknown)."""
    info = _cpuinfo()  # x86: "flags"; aarch64: "Features"
    return frozenset((info.get("flags") or info.get("Features") or "").split())


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


def cpu_vendor() -> str:
    """This CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"; ""
    where it names none): a few of the planner's rules differ by vendor (vendor_plan)."""
    return _cpuinfo().get("vendor_id", "")


def host_family() -> str:
    """This machine's architecture family as archspec names them (x86_64, aarch64, ...)."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _sve_bits() -> int:
    """This process's SVE vector length in bits (0 without SVE)."""
    try:
        return 8 * int(Path("/proc/sys/abi/sve_default_vector_length").read_text())
    except (OSError, ValueError):
        return 0


@cache
def available_isas() -> tuple[str, ...]:
    """ISA paths this machine can run, best first ("portable" always)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return tuple(i for i in runnable_isas(cpu_features()) if i in X86_ISAS)
    if machine in ("aarch64", "arm64"):
        found = [i for i in runnable_isas(cpu_features()) if i in AARCH64_ISAS]
        return tuple(i for i in found if i != "sve256" or _sve_bits() == 256)
    return ("portable",)


def selected_isa() -> str:
    """The ISA path kernels are built for: CONVGRAD_ISA if set, else the best one."""
    forced = settings.current().isa
    if not forced:
        return available_isas()[0]
    if forced not in available_isas():
        raise RuntimeError(
            f"CONVGRAD_ISA={forced!r} cannot run on this CPU (it runs {list(available_isas())})")
    return forced
