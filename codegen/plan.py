"""The planner: how a kernel computes its configuration.

A plan is a mapping of the choices in `PLAN_CHOICES` to integers; the empty plan is
the planner's rules. The rules live in one module per responsibility:

- `isa`: ISA paths, their CPU features, flags, lanes and registers;
- `plan_choices`: the plan vocabulary, plan keys and kernel names;
- `rules_problem`: the rules that pick a problem's configuration itself (its ISA path
  narrowed to avx2 for few channels, a weight gradient's inputs swapped);
- `rules_common`, `rules_data`, `rules_ncx`, `rules_weights`, `rules_dot`, `rules_groups`,
  `rules_amx`: the rules of each kernel family, every constant beside the function that reads it;
- `choices`: the typed record of derived choices of each kernel family (`Choices`);
- `variant`: `VariantSpec`, a variant whole (what it applies to, its rules, its record,
  its tuning candidates), and the records of a resolved plan (`KernelPlan`);
- `variants_data`, `variants_weights`: the specs of the data and weight variants;
- `variants`: `SPECS`, and `resolve_plan`, the one resolution of a configuration and
  plan into a `KernelPlan` (its spec, the body template, its family's record of every
  derived choice and the kernel-wide values), and the render context;
- `vendors`: where a CPU vendor's rules differ (`vendor_plan`);
- `candidates`: the plans the tuner times.

This module gathers the entry points the runtime and the tuner use.
"""

from convgrad.codegen.candidates import candidates
from convgrad.codegen.choices import Choices
from convgrad.codegen.plan_choices import (
    EMPTY_PLAN,
    PLAN_CHOICES,
    check_plan,
    kernel_name,
    plan_key,
)
from convgrad.codegen.variants import (
    SPECS,
    KernelPlan,
    Variant,
    VariantSpec,
    compile_parts,
    render_context,
    resolve_plan,
    small_problem_plan,
)
from convgrad.codegen.vendors import vendor_plan

__all__ = ["EMPTY_PLAN", "PLAN_CHOICES", "SPECS", "Choices", "KernelPlan", "Variant",
           "VariantSpec", "candidates", "check_plan", "compile_parts", "kernel_name",
           "plan_key", "render_context", "resolve_plan", "small_problem_plan", "vendor_plan"]
