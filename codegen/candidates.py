"""The tuner's candidates: plans that each render different C, the rules' plan
first, then the variations that the rules' variant offers (VariantSpec.candidates).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.rules_common import uses_bf16_dot
from convgrad.codegen.variants import carries_amx, render_context, resolve_plan
from convgrad.codegen.vendors import WIDEN_BF16_VENDORS, vendor_plan

MAX_CANDIDATES = 8


def _variations(config: KernelConfig, vendor: str = "") -> list[dict[str, int]]:
    """Plans that change one or two of the rules' choices for this configuration; for
    bf16 pairs also the widened path's (those of the avx512 path's kernel, which widens
    alike), first where the vendor's rules widen, and the kernels without AMX."""
    # without AMX, where the kernel carries it (the other plans differ only where the
    # CPU lacks it)
    amx = [{"amx": 0}, {"bf16_dot": 0, "amx": 0}] if carries_amx(config) else []
    if not uses_bf16_dot(config):
        found = _one_path_variations(config)
        if uses_bf16_dot(config, {"bf16_dot": 1}):  # widened for col2im by rule
            found.insert(1, {"bf16_dot": 1})
        return amx[:1] + found
    pairs = _one_path_variations(config)
    widened = [{"bf16_dot": 0, **plan}
               for plan in _one_path_variations(replace(config, isa="avx512"))]
    if vendor in WIDEN_BF16_VENDORS:
        return [{"bf16_dot": 0}, *amx[::-1], *widened, *pairs]
    return [{"bf16_dot": 0}, *amx, *pairs, *widened]


def _one_path_variations(config: KernelConfig) -> list[dict[str, int]]:
    """The variations the variant that the rules pick for `config` offers (its spec's
    candidates)."""
    return resolve_plan(config).spec.candidates(config)


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
        if first.get("amx") == 0 and carries_amx(config, plan):
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
