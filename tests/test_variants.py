"""Each kernel variant is one object (codegen/variant.py's VariantSpec): the variant a
configuration and plan resolve to, the tuner's candidates and the rules `convgrad
explain` attributes the choices to all come from that object, on the configurations
of the rendered-sources set (benchmarks/rendered_sources.py, by its own enumeration):
every 16th of them by default, all of them as a slow sweep.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from functools import cache
from unittest import mock

import pytest

from benchmarks import rendered_sources
from convgrad import rule_notes
from convgrad.codegen.choices import Col2imChoices, DirectChoices
from convgrad.codegen.config import KernelConfig
from convgrad.codegen.plan import (
    SPECS,
    Variant,
    VariantSpec,
    candidates,
    render_context,
    resolve_plan,
    vendor_plan,
)
from convgrad.codegen.rules_amx import amx_tiles
from convgrad.codegen.rules_common import uses_bf16_dot
from convgrad.codegen.variants import RECORDS, variant_spec

SUBSET_STEP = 16
# The data gradient of ResNet-50's conv1 (3 result channels): col2im by rule.
CONV1_DATA = KernelConfig(family="bwd_data", kernel=(7, 7), strides=(2, 2), dilations=(1, 1),
                          groups=1, cin_per_group=3, cout_per_group=64, data_format="NXC",
                          weights_format="XIO", dtype="f32", isa="avx2")


@cache
def rendered_configs() -> tuple[KernelConfig, ...]:
    """The configurations benchmarks.rendered_sources renders kernels of, found by its
    own loop over the shape sets (its render and candidates replaced by a recorder)."""
    found: dict[str, KernelConfig] = {}

    def record(config: KernelConfig, plan: object = None) -> str:
        found.setdefault(config.name, config)
        return ""

    with mock.patch.object(rendered_sources, "candidates", lambda config, vendor: [{}]), \
            mock.patch.object(rendered_sources, "render", record):
        rendered_sources.digests(rendered_sources.DEFAULT_SHAPES_DIR)
    return tuple(found[name] for name in sorted(found))


@cache
def tuned_plans(config: KernelConfig) -> tuple[dict[str, int], ...]:
    """Every plan the tuner times for `config` on the vendors rendered_sources renders
    for (the rules' plan first), each once."""
    plans: list[dict[str, int]] = []
    for vendor in rendered_sources.VENDORS:
        plans += [plan for plan in candidates(config, vendor) if plan not in plans]
    return tuple(plans)


def configs(full: bool) -> tuple[KernelConfig, ...]:
    every = rendered_configs()
    return every if full else every[::SUBSET_STEP]


def _check_one_variant(config: KernelConfig, plan: dict[str, int]) -> VariantSpec:
    """Exactly one spec's condition holds; the resolved plan is that spec's, with its
    record type."""
    applying = [spec for spec in SPECS if spec.applies(config, plan)]
    assert len(applying) == 1, (config.name, plan, [spec.name for spec in applying])
    spec = applying[0]
    resolved = resolve_plan(config, plan)
    assert resolved.spec is spec and resolved.variant is spec.variant
    assert variant_spec(spec.variant) is spec and RECORDS[spec.variant] is spec.record
    assert type(resolved.choices) is spec.record
    return spec


def _check_candidates(config: KernelConfig) -> None:
    """The tuner's plans are the rules' plan and variations of the variant the rules
    pick (its spec's candidates; for bf16 pairs also the avx512 path's, widened, and
    the kernels without AMX), with the AMX path left out where the vendor's plan does."""
    spec = resolve_plan(config).spec
    offered = [{}, *spec.candidates(config)]
    if uses_bf16_dot(config):  # the other path: the avx512 kernel's variant, widened
        wide = replace(config, isa="avx512")
        offered += [{"bf16_dot": 0}, {"amx": 0}, {"bf16_dot": 0, "amx": 0}]
        offered += [{"bf16_dot": 0, **plan}
                    for plan in resolve_plan(wide).spec.candidates(wide)]
    elif uses_bf16_dot(config, {"bf16_dot": 1}):
        offered.append({"bf16_dot": 1})
    with_amx_off = [{**plan, "amx": 0} for plan in offered if amx_tiles(config, plan)["amx"]]
    for vendor in rendered_sources.VENDORS:
        first, *rest = candidates(config, vendor)
        assert first == vendor_plan(config, vendor)
        for plan in rest:
            assert plan in offered or plan in with_amx_off, (config.name, vendor, plan)


def _check_rules(config: KernelConfig, plan: dict[str, int],
                 attributing: dict[Variant, set[str]]) -> None:
    """explain's rules of the resolved plan are its spec's: each derived choice is
    attributed once, to one of the spec's rules or to the spec's own code (BODY)."""
    resolved = resolve_plan(config, plan)
    assert rule_notes.RULES[resolved.variant] is resolved.spec.rules
    found = rule_notes.attribute(config, resolved)
    names = {rule_notes.rule_name(rule) for rule in resolved.spec.rules}
    assert set(found) <= names | {rule_notes.BODY}, (config.name, plan, found)
    attributed = sorted(choice for choices in found.values() for choice in choices)
    assert attributed == sorted(resolved.choices)
    attributing.setdefault(resolved.variant, set()).update(set(found) - {rule_notes.BODY})


def _check_record(config: KernelConfig, plan: dict[str, int]) -> None:
    """The render context is the configuration's spelling and the plan's typed values,
    each name from one source: every record value (fixed ones too) and kernel-wide
    value is in it as the record holds it; the spec's fill gives the derived choices
    and only those."""
    resolved = resolve_plan(config, plan)
    context = render_context(config, "v", plan)
    values = resolved.template_values()
    record = resolved.choices.template_values()
    kernel = dataclasses.asdict(resolved.kernel)
    assert not set(record) & set(kernel)
    assert values == {"body": resolved.variant.value, **kernel, **record}
    for name, value in values.items():
        assert context[name] == value, (config.name, plan, name)
    assert set(resolved.spec.fill(config, plan)) == set(resolved.choices)
    assert set(record) - set(resolved.choices) == set(resolved.spec.record.fixed_values())


def _sweep(full: bool) -> None:
    seen: set[Variant] = set()
    attributing: dict[Variant, set[str]] = {}
    for config in configs(full):
        _check_candidates(config)
        for plan in tuned_plans(config):
            seen.add(_check_one_variant(config, plan).variant)
            _check_rules(config, plan, attributing)
            _check_record(config, plan)
    # a rule a spec lists that never attributes a choice is no rule of its variant
    for variant, names in attributing.items():
        listed = {rule_notes.rule_name(rule) for rule in variant_spec(variant).rules}
        assert names == listed, (variant, listed - names)
    if full:
        assert seen == set(Variant)


def test_variants_candidates_and_rules_come_from_one_spec():
    """On every 16th configuration of the rendered set and each plan the tuner times for
    it: one variant applies, the tuner's plans are that variant's, explain's rules are
    its spec's and its record holds every value its templates read."""
    _sweep(full=False)


@pytest.mark.slow
def test_variants_candidates_and_rules_come_from_one_spec_on_the_whole_rendered_set():
    """The same on every configuration of the rendered set; every variant is reached."""
    _sweep(full=True)


def test_a_variants_fixed_values_are_no_arguments():
    """A record's fixed values (col2im runs no bands of rows) are the record type's: no
    fill passes or overrides them, and they are no derived choice (explain's)."""
    resolved = resolve_plan(CONV1_DATA)
    assert resolved.variant is Variant.COL2IM
    assert ("band_bytes" not in resolved.choices
            and resolved.choices.template_values()["band_bytes"] == 0)
    with pytest.raises(TypeError, match="band_bytes"):
        Col2imChoices(**resolved.choices, band_bytes=0)
    assert DirectChoices.fixed_values() == {"column_runs": True, "input_in_place": False,
                                            "compute_scratch": False}


def test_the_decision_is_the_specs():
    """Changing a spec's condition changes what resolves to it (resolution consults
    the specs, no other decision): with col2im's condition never true, the layer above
    runs the direct tiles, and no spec applying at all is an error."""
    from convgrad.codegen import variants

    direct = variant_spec(Variant.DIRECT)
    col2im = variant_spec(Variant.COL2IM)
    never = replace(col2im, applies=lambda config, plan: False)
    always_direct = replace(direct, applies=lambda config, plan: config.family == "bwd_data")
    with mock.patch.object(variants, "SPECS", tuple(
            never if spec is col2im else always_direct if spec is direct else spec
            for spec in variants.SPECS)):
        assert variants.spec_of(CONV1_DATA) is always_direct
    with mock.patch.object(variants, "SPECS", tuple(
            never if spec is col2im else spec for spec in variants.SPECS)), \
            pytest.raises(RuntimeError, match="not one"):
        variants.spec_of(CONV1_DATA)
