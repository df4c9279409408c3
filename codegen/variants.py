"""The resolution of a configuration and plan into its variant and record, and the
render context: the one place that turns a configuration and its plan into what the
templates read. The variants themselves are `VariantSpec`s (codegen/variant.py), in
variants_data.py and variants_weights.py; SPECS lists them all.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from functools import lru_cache
from types import MappingProxyType

from convgrad.codegen.choices import Choices
from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import SIMD, VECTOR_LANES
from convgrad.codegen.ops import Problem
from convgrad.codegen.plan_choices import EMPTY_PLAN, PLAN_CHOICES, kernel_name
from convgrad.codegen.rules_common import uses_bf16_dot
from convgrad.codegen.rules_groups import min_thread_flops
from convgrad.codegen.variant import KernelPlan, KernelValues, Variant, VariantSpec
from convgrad.codegen.variants_data import DATA_SPECS
from convgrad.codegen.variants_weights import WEIGHT_SPECS

__all__ = ["FAMILY_DOCS", "PAD_MAX_ZEROS_PERCENT", "RECORDS", "SPECS", "KernelPlan",
           "KernelValues", "Variant", "VariantSpec", "compile_parts", "render_context",
           "resolve_plan", "small_problem_plan", "spec_of", "transpose_masks",
           "variant_spec"]

FAMILY_DOCS = {
    "fwd": "forward convolution, for ConvTransposeBackwardData",
    "bwd_data": "transposed convolution, for ConvolutionBackpropData/BackwardData",
    "bwd_weights": "weight gradient, for ConvolutionBackpropFilters/BackwardWeights "
                   "and ConvTransposeBackwardWeights",
}
# ...unless more than this share of the padded row's multiply-adds (column x w tap) would
# be by the zeros, as with dilated kernels on narrow rows (Zen 3 avx2, batch 8, pair
# ratios unpadded / padded, 1 / 2 threads: 1-D kernel 3 dilation 6 on 19 columns, 21%
# zeros, 1.11 / 1.17; 2-D dilation 3 and 4 on 11 columns 1.31 / 1.30 and 1.29 / 1.47;
# ResNet-50's 14 and 7 columns, 5% and 10% zeros, 0.98 and 0.82).
PAD_MAX_ZEROS_PERCENT = 10

# Every variant, one spec each: for any configuration and plan exactly one applies.
SPECS: tuple[VariantSpec, ...] = (*DATA_SPECS, *WEIGHT_SPECS)
_BY_VARIANT = {spec.variant: spec for spec in SPECS}
if len(_BY_VARIANT) != len(SPECS) or set(_BY_VARIANT) != set(Variant):
    raise RuntimeError("SPECS: not one spec per variant")
# Each variant's record of choices (codegen/choices.py).
RECORDS: Mapping[Variant, type[Choices]] = MappingProxyType(
    {spec.variant: spec.record for spec in SPECS})


def variant_spec(variant: Variant) -> VariantSpec:
    """The spec of `variant`."""
    return _BY_VARIANT[variant]


def spec_of(config: KernelConfig, plan: Mapping[str, int] = EMPTY_PLAN) -> VariantSpec:
    """The variant that computes `config` under `plan`: the one spec of SPECS that
    applies (RuntimeError if none or several do: the specs' conditions are wrong)."""
    found = [spec for spec in SPECS if spec.applies(config, plan)]
    if len(found) != 1:
        raise RuntimeError(f"{kernel_name(config, plan)} under {dict(plan)}: variants "
                           f"{[spec.name for spec in found]} apply, not one")
    return found[0]


class _Reads(Mapping):
    """A plan that records which choices the rules read (get, [], in; iterating it, as
    `{**plan}` does, counts as reading every choice)."""

    def __init__(self, plan: Mapping[str, int]):
        self._plan = plan
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> int:
        self.read.add(key)
        return self._plan[key]

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return key in self._plan

    def __iter__(self) -> Iterator[str]:
        self.read.update(self._plan)
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


def resolve_plan(config: KernelConfig, plan: Mapping[str, int] | None = None, *,
                 strict: bool = True) -> KernelPlan:
    """The resolved plan of `config` under `plan` (default: the rules'). An override that
    the chosen variant's rules never read is a ValueError naming the variant and the
    choices it takes, since it would change nothing (with `strict=False` it is left in
    `overrides`, and missing from `reads`)."""
    return _resolve(config, tuple(sorted((plan or {}).items())), strict)


def carries_amx(config: KernelConfig, plan: Mapping[str, int] | None = None) -> bool:
    """Whether the kernel of `config` under `plan` carries an AMX path (which it takes
    where the CPU has AMX): the resolved variant's choice, whichever variant that is."""
    return bool(resolve_plan(config, plan, strict=False).choices.amx)


@lru_cache(maxsize=4096)
def _resolve(config: KernelConfig, items: tuple[tuple[str, int], ...],
             strict: bool) -> KernelPlan:
    overrides = dict(items)
    reads = _Reads(overrides)
    spec = spec_of(config, reads)
    choices = spec.choices(config, reads)
    kernel = _kernel_values(config, spec, choices, uses_bf16_dot(config, reads))
    unread = sorted(set(overrides) - reads.read)
    if unread and strict:
        raise ValueError(
            f"plan {overrides} of {kernel_name(config, overrides)}: the "
            f"{spec.name} variant ({spec.variant.value}) does not read {unread}; "
            f"here it takes {sorted(reads.read & set(PLAN_CHOICES))}")
    return KernelPlan(spec, MappingProxyType(overrides), choices, kernel,
                      frozenset(reads.read))


def _kernel_values(config: KernelConfig, spec: VariantSpec, choices: Choices,
                   bf16_dot: bool) -> KernelValues:
    """The kernel-wide values of `config` computed by `spec`'s `choices`."""
    lanes, record = VECTOR_LANES[config.isa], choices.template_values()
    return KernelValues(
        bf16_dot=bf16_dot,
        # the flattened weight gradient's padded copy reads NCX src itself
        pack_data=(config.dtype != "f32" or config.data_format != "NXC") and not (
            spec.variant is Variant.WEIGHTS_FLAT and config.data_format == "NCX"),
        copies_in_second_part=config.family != "bwd_weights",
        min_thread_flops=min_thread_flops(config),
        regroup_pixels=config.family == "bwd_weights" and config.data_format == "NXC"
        and not config.depthwise and config.pointwise,
        pad_max_zeros_percent=PAD_MAX_ZEROS_PERCENT,
        transpose_to_f32=config.data_format == "NCX" and (
            spec.variant is Variant.WEIGHTS_PACKED or record["band_bytes"] > 0
            or not (bf16_dot or record["no_scratch"])),
        transpose_stages=_halvings(lanes),
        transpose_masks=transpose_masks(lanes),
        amx_body=amx_body(config, spec, record))


def amx_body(config: KernelConfig, spec: VariantSpec, record: dict) -> str | None:
    """The template that spells the AMX path of a kernel whose variant's record is
    `record`: tiles of patches where few input channels make them (rules_amx), the
    columns of col2im, else the weight gradient's or the data op's tile blocks."""
    if not record.get("amx"):
        return None
    patches = record.get("amx_patches", False)
    if config.family == "bwd_weights":
        return "amx_patch_weights.h.j2" if patches else "amx_weights.h.j2"
    if spec.variant is Variant.COL2IM:
        return "amx_columns.h.j2"
    return "amx_patches.h.j2" if patches else "amx_data.h.j2"


# A direct kernel's tiles (up to 7-14 output pixels) are most of its compile time: a 1x1
# kernel of few channels has 12-15 of them and compiled in 0.6-0.93 s (GCC 12, Zen 4),
# 0.23-0.37 s with tiles of at most SMALL_PROBLEM_TILE_ROWS pixels. Problems of one
# output pixel per image and few multiply-adds (squeeze-and-excitation and other
# fully connected layers as convolutions) gain nothing from the taller ones:
# EfficientNet-B0's (1x1, batch 8, 4-1152 channels: 28 of its 137 kernels), forward and
# data gradient, 2 threads, ran at 1.02-1.03x the time (geometric means of 24, two runs;
# at most 1.12x, 21.8 -> 24.4 us), exact on integer data (record
# zen4/small_problem_plan_8e5cde8). Only those: the rules' tiles are what other
# problems, and the tests' small ones, run.
SMALL_PROBLEM_MACS = 2**20
SMALL_PROBLEM_TILE_ROWS = 2


def small_problem_plan(config: KernelConfig, problem: Problem) -> dict[str, int] | None:
    """What the kernel of `config` (the problem's, on the ISA path that runs it) built
    for `problem` takes on top of the rules' plan where no kernel of its configuration
    exists yet: for a direct kernel of one pixel an image (input and result) and few
    multiply-adds, tiles of few rows (cheaper to compile, as fast there); else None."""
    one_pixel = math.prod(problem.src_spatial) == math.prod(problem.dst_spatial) == 1
    if not one_pixel or problem.multiply_adds > SMALL_PROBLEM_MACS:
        return None
    resolved = resolve_plan(config, EMPTY_PLAN)
    if (resolved.variant is not Variant.DIRECT or resolved.choices.amx
            or resolved.choices.tile_rows <= SMALL_PROBLEM_TILE_ROWS):
        return None
    return {"tile_rows": SMALL_PROBLEM_TILE_ROWS}


def compile_parts(config: KernelConfig, plan: Mapping[str, int] | None = None) -> int:
    """How many objects a build of this kernel (of `plan`, default the rules') may
    compile at once (functions.h.j2): two for direct kernels (their tiles split, the
    AMX path, where there is one, in the second) and for weight gradients from row
    segments (their tiles and AMX path in the second)."""
    return 2 if resolve_plan(config, plan).spec.two_parts else 1


def transpose_masks(lanes: int) -> dict[int, tuple[list[int], list[int]]]:
    """Per stage b of an in-register transpose, the two-source shuffle masks of row i
    (lanes with bit b set come from row i + b) and of row i + b."""
    return {b: ([lanes + j - b if j & b else j for j in range(lanes)],
                [lanes + j if j & b else j + b for j in range(lanes)])
            for b in _halvings(lanes)}


def _halvings(lanes: int) -> list[int]:
    return [lanes >> k for k in range(1, lanes.bit_length()) if lanes >> k]


def render_context(config: KernelConfig, generator_version: str,
                   plan: Mapping[str, int] = EMPTY_PLAN) -> dict:
    """Everything kernel.c.j2 reads: the configuration as the templates spell it, and the
    resolved plan's values (KernelPlan.template_values: its body template, kernel-wide
    values and variant record), no name from two of them."""
    pad = 3 - config.rank
    spelled = {
        "name": kernel_name(config, plan),
        "generator_version": generator_version,
        "plan_items": sorted(plan.items()),
        "family": config.family,
        "family_doc": FAMILY_DOCS[config.family],
        "config_items": list(config.to_dict().items()),
        "rank": config.rank,
        "groups": config.groups,
        "cin_per_group": config.cin_per_group,
        "cout_per_group": config.cout_per_group,
        "k3": (1,) * pad + config.kernel,
        "s3": (1,) * pad + config.strides,
        "d3": (1,) * pad + config.dilations,
        "dtype": config.dtype,
        "data_format": config.data_format,
        "weights_format": config.weights_format,
        "isa": config.isa,
        "vl": VECTOR_LANES[config.isa],
        "simd": SIMD[config.isa],
    }
    values = resolve_plan(config, plan).template_values()
    both = set(spelled) & set(values)
    if both:
        raise ValueError(f"{sorted(both)} are both the configuration's and the plan's")
    return {**spelled, **values}
