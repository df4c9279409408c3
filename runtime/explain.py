"""Which kernel a layer gets, its variant and plan, and why (`convgrad explain`).

    >>> from convgrad.explain import explain
    >>> from convgrad.codegen.layers import Layer
    >>> print(explain(Layer("ConvolutionBackwardData", ((8, 56, 56, 64), (3, 3, 64, 64)),
    ...                     {"pads_begin": 1, "pads_end": 1})))

For each layer: the kernel's configuration and name, the plan (the rules', a vendor's
rules or a given one) and where each of its choices came from, the variant (the body
template) that plan resolves to, the plan choices that variant takes (any other
override is an error), every choice the rules derived for its template, and the
template files the kernel renders from. With `threads`, how the kernel's main parallel
region splits the layer's work over each thread count (convgrad.codegen.partition):
tasks, per-thread least and most, the largest share over the mean, idle threads.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from convgrad import rule_notes
from convgrad.codegen import KernelConfig
from convgrad.codegen.layers import Layer
from convgrad.codegen.partition import NotModelled, Sizes, Split, split
from convgrad.codegen.plan import (
    PLAN_CHOICES,
    KernelPlan,
    check_plan,
    kernel_name,
    resolve_plan,
    small_problem_plan,
    vendor_plan,
)
from convgrad.codegen.render import templates_of
from convgrad.cpu import cpu_features, cpu_vendor, selected_isa
from convgrad.rule_notes import Note


@dataclass(frozen=True)
class Explanation:
    """What `explain` found for one layer; str() gives the report."""

    layer: Layer
    config: KernelConfig
    plan: dict[str, int]  # the plan the kernel is built with ({}: the rules')
    source: str  # "rules", "rules for <vendor>" or "given"
    resolved: KernelPlan
    templates: tuple[str, ...]
    problem_rules: tuple[str, ...] = ()  # rules_problem's, where they changed the kernel
    rules: Mapping[str, list[str]] = field(default_factory=dict)  # rule -> its choices
    notes: Mapping[str, list[Note]] = field(default_factory=dict)  # rule -> its constants
    splits: tuple[Split | str, ...] = ()  # per thread count asked: the split, or why none

    def __str__(self) -> str:
        c = self.config
        lines = [f"{self.layer.name or self.layer.op}: {self.layer.op}, {c.dtype}, "
                 f"{c.data_format} data, {c.weights_format} weights, isa {c.isa}",
                 f"  kernel     {kernel_name(c, self.plan)}",
                 f"  variant    {self.resolved.variant.name.lower()} "
                 f"({self.resolved.variant.value})",
                 f"  plan       {json.dumps(self.plan) if self.plan else '{}'} ({self.source})"]
        lines[1:1] = [f"  problem    {rule}" for rule in self.problem_rules]
        for choice in sorted(self.plan):
            lines.append(f"    {choice} = {self.plan[choice]}: {PLAN_CHOICES[choice]}")
        taken = sorted(self.resolved.reads & set(PLAN_CHOICES))
        for title, items in (
                ("takes", taken or ["no plan choice"]),
                ("derived", [f"{k}={_short(v)}" for k, v in sorted(self.resolved.choices.items())]),
                ("templates", self.templates)):
            lines.append(textwrap.fill(", ".join(items), width=100,
                                       initial_indent=f"  {title:<10} ",
                                       subsequent_indent=" " * 13, break_on_hyphens=False))
        for index, (rule, choices) in enumerate(self.rules.items()):
            lines.append(textwrap.fill(f"{rule}: {', '.join(choices)}", width=100,
                                       initial_indent=f"  {'rules' if not index else '':<10} ",
                                       subsequent_indent=" " * 15, break_on_hyphens=False))
            for note in self.notes.get(rule, []):
                lines.append(textwrap.fill(
                    f"{note.name} = {_short(note.value)} ({note.module}): "
                    f"{note.comment or '(no note)'}", width=100, initial_indent=" " * 15,
                    subsequent_indent=" " * 17, break_on_hyphens=False))
        for index, entry in enumerate(self.splits):
            lines.append(textwrap.fill(str(entry), width=100,
                                       initial_indent=f"  {'threads' if not index else '':<10} ",
                                       subsequent_indent=" " * 15, break_on_hyphens=False))
        return "\n".join(lines)


def _short(value: object) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def explain(layer: Layer, *, isa: str | None = None, plan: Mapping[str, int] | None = None,
            vendor: str | None = None, with_notes: bool = False,
            threads: Sequence[int] = ()) -> Explanation:
    """The kernel `layer` runs on the `isa` path (default this CPU's), with `plan` if
    given, else the rules' plan for a CPU of `vendor` (default this CPU's, whose
    features also decide whether the kernel carries an AMX path). Each derived choice is
    attributed to the rule that set it; `with_notes` adds the measured notes of the
    constants each rule reads; `threads` adds the main region's split over each of those
    thread counts at the layer's sizes."""
    problem = layer.resolve()
    asked = isa or selected_isa()
    config = problem.config.with_isa(asked)
    rules = []
    base = problem.config.base_isa(asked)
    if config.isa != base:  # narrowed
        rules.append(f"isa {config.isa}, not {base}: vectors over {config.vector_channels} "
                     f"channels (rules_problem.narrowed_isa)")
    if problem.operands_swapped:
        rules.append("inputs swapped: the kernel of the problem with src and diff_dst "
                     "exchanged (rules_problem.swaps_operands)")
    if plan is not None:
        chosen, source = check_plan(plan), "given"
    else:
        here = vendor is None
        vendor = cpu_vendor() if here else vendor
        chosen = vendor_plan(config, vendor, cpu_features() if here else None)
        source = f"rules for {vendor or 'any vendor'}" if chosen else "rules"
    small = small_problem_plan(config, problem)
    if plan is None and small:
        rules.append(f"a lazy build where no kernel of this configuration exists adds "
                     f"{json.dumps(small)}: one pixel an image, {problem.multiply_adds} "
                     "multiply-adds (variants.small_problem_plan)")
    resolved = resolve_plan(config, chosen)
    attributed = rule_notes.attribute(config, resolved)
    by_name = {rule_notes.rule_name(r): r for r in rule_notes.RULES[resolved.variant]}
    noted = {name: rule_notes.notes(by_name[name]) for name in attributed
             if with_notes and name in by_name}
    splits = tuple(_split(config, problem, n, chosen) for n in threads)
    return Explanation(layer, config, dict(chosen), source, resolved,
                       templates_of(config, chosen), tuple(rules), attributed, noted, splits)


def _split(config: KernelConfig, problem, threads: int, plan: Mapping[str, int]) -> Split | str:
    try:
        return split(config, Sizes.of(problem), threads, plan)
    except NotModelled as why:
        return f"{threads}: not modelled ({why})"
