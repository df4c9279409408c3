"""What a kernel variant is: one `VariantSpec` per body template, which says what the
variant applies to, the rules it runs, the typed record it fills, the candidates it
offers the tuner and (through its rules) the notes `convgrad explain` prints; and the
records a resolved plan is made of (`KernelPlan`, `KernelValues`).

The specs themselves are in variants_data.py and variants_weights.py; variants.py
resolves a configuration and plan through them (`resolve_plan`), candidates.py lists the
tuner's plans from them and rule_notes.py (convgrad.rule_notes) attributes choices to
their rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from enum import Enum

from convgrad.codegen.choices import Choices
from convgrad.codegen.config import KernelConfig

Plan = Mapping[str, int]
Rule = Callable[..., object]  # rule(config, plan) -> a dict of choices, or one choice


class Variant(str, Enum):
    """A kernel variant: the body template that spells it (kernel.c.j2 includes it)."""

    DIRECT = "direct.c.j2"  # fwd, bwd_data: register tiles of output pixels
    COL2IM = "col2im.c.j2"  # bwd_data with few result channels
    ACROSS_GROUPS = "depthwise.c.j2"  # fwd, bwd_data: depthwise, or lanes across groups
    DEPTHWISE_WEIGHTS = "depthwise_weights.c.j2"
    GROUPED_WEIGHTS = "grouped_weights.c.j2"  # lanes across groups
    WEIGHTS_DOT = "bwd_weights_dot.c.j2"  # NCX dot products along pixels
    WEIGHTS_PACKED = "bwd_weights_packed.c.j2"  # tiles over packed panels
    WEIGHTS_PAIRS = "bwd_weights_pairs.c.j2"  # bf16 pixel pairs (vdpbf16ps)
    WEIGHTS_FLAT = "bwd_weights_flat.c.j2"  # (kw, input channel) rows, padded src copy
    WEIGHTS = "bwd_weights.c.j2"  # input-channel rows of one tap, the user's buffers


@dataclass(frozen=True)
class VariantSpec:
    """One kernel variant, whole.

    - `applies(config, plan)`: whether this variant computes `config` under `plan`. For
      any configuration and plan exactly one spec of variants.SPECS applies (each spec
      states its whole condition, not "none of the others").
    - `rules`: the rule functions whose results fill the record (what `convgrad explain`
      attributes the choices to, and whose constants' notes it prints).
    - `record`: the typed record of every value of the variant that the templates read:
      its derived choices, which `fill(config, plan)` gives (from the rules and its own
      code), and its fixed values (choices.fixed).
    - `candidates(config)`: the plans that vary the rules' choices of this variant, which
      the tuner times where the rules pick it (candidates.py adds the rules' plan and
      the other ISA path of bf16 pairs).
    - `two_parts`: whether a build may compile its kernel as two objects at once
      (functions.h.j2's IN_PART guards)."""

    variant: Variant
    applies: Callable[[KernelConfig, Plan], bool]
    rules: tuple[Rule, ...]
    record: type[Choices]
    fill: Callable[[KernelConfig, Plan], dict[str, object]]
    candidates: Callable[[KernelConfig], list[dict[str, int]]]
    two_parts: bool = False

    @property
    def name(self) -> str:
        """The variant's name as `convgrad explain` prints it ("direct", ...)."""
        return self.variant.name.lower()

    def choices(self, config: KernelConfig, plan: Plan) -> Choices:
        """The record this variant fills for `config` under `plan`."""
        return self.record(**self.fill(config, plan))


@dataclass(frozen=True)
class KernelValues:
    """The values every kernel's templates read besides its variant's record, derived
    once from the configuration and the resolved variant."""

    bf16_dot: bool  # bf16 pairs multiplied with vdpbf16ps
    # f32 channels-last data is used in place; anything else goes through f32 scratch.
    pack_data: bool
    # data kernels compile pack_data and unpack_data (NCX: the transposes) in the
    # second object of a build in two (variants_data.SECOND_BASE_COST)
    copies_in_second_part: bool
    min_thread_flops: int  # rules_groups.min_thread_flops
    # 1x1 stride-1 NXC weight gradients regroup the batch's pixels into long rows
    regroup_pixels: bool
    # most zeros (percent of a padded row's multiply-adds) a run's padding may add
    pad_max_zeros_percent: int
    # NCX blocks of VL channels x VL pixels transposed in registers: into f32 scratch
    # (whole tensors, bands of rows or chunks) and into the packed plan's diff_dst panels
    transpose_to_f32: bool
    transpose_stages: list[int]  # the in-register transpose's halvings of VL
    transpose_masks: dict[int, tuple[list[int], list[int]]]  # its shuffle masks by stage
    # the template of the kernel's AMX path (amx.h.j2 includes it), None without one
    amx_body: str | None = None

    def template_values(self) -> dict[str, object]:
        """{name: value} of every field."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class KernelPlan:
    """A kernel's resolved plan: its variant (the spec), the overrides it was given (the
    plan; empty for the rules'), the variant's record of every choice the rules derived
    from them and the kernel-wide values, computed once per (configuration, plan)."""

    spec: VariantSpec
    overrides: Mapping[str, int]
    choices: Choices  # what the variant's template reads (tiles, flags, ...): its record
    kernel: KernelValues  # what every kernel's templates read beside the record
    reads: frozenset[str]  # the plan choices the rules consulted: those the variant takes

    @property
    def variant(self) -> Variant:
        """The variant (its body template)."""
        return self.spec.variant

    @property
    def bf16_dot(self) -> bool:
        """Whether bf16 pairs are multiplied with vdpbf16ps."""
        return self.kernel.bf16_dot

    def template_values(self) -> dict[str, object]:
        """What the templates read of the plan: the body template, the kernel-wide values
        and the record's (each name from one of them: none overrides another)."""
        kernel, record = self.kernel.template_values(), self.choices.template_values()
        both = set(kernel) & set(record)
        if both:
            raise ValueError(f"{self.spec.name}: {sorted(both)} are both the record's "
                             "and kernel-wide values")
        return {"body": self.variant.value, **kernel, **record}
