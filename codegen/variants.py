"""The variant of a kernel (its body template) and its render context: the one
place that turns a configuration and its plan into what the templates read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from types import MappingProxyType

from convgrad.codegen.choices import (
    AcrossGroupsChoices,
    Choices,
    Col2imChoices,
    DepthwiseWeightChoices,
    DirectChoices,
    DotWeightChoices,
    GroupedWeightChoices,
    WeightChoices,
)
from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import SIMD, VECTOR_LANES
from convgrad.codegen.ops import Problem
from convgrad.codegen.plan_choices import EMPTY_PLAN, PLAN_CHOICES, kernel_name
from convgrad.codegen.rules_amx import amx_tiles
from convgrad.codegen.rules_common import reduced_channels, uses_bf16_dot
from convgrad.codegen.rules_data import (
    band_bytes,
    col2im,
    col2im_tiles,
    direct_tiles,
    image_block_bytes,
    overlap_runs,
    pad_columns_below,
    pointwise_ncx_tiles,
    rounds_in_tiles,
    stream_min_bytes,
    weight_packing,
)
from convgrad.codegen.rules_groups import (
    MAX_UNROLLED_TAPS,
    data_across_groups,
    depthwise_weight_rows,
    min_thread_flops,
    slide_rows,
    weights_across_groups,
)
from convgrad.codegen.rules_weights import dot_tiles, weight_tiles

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
# Data gradients spread their input whole up front while the spread copy takes at most
# this (a last-level cache: Zen 3's L3), else row by row as each thread's output rows
# read them. Sapphire Rapids, batch 8, pair ratios rows / whole, 1 / 2 threads, avx2 and
# avx512: ResNeXt conv_3d:1 (8x56x56, 4 channels per group, 154 MB spread) 1.95-2.03,
# 3d_gconv block-4 (21^3, 28-38 MB) 1.05-1.11, but 3d_gconv s2 (11-22 MB, short rows)
# 0.85-0.94.
SPREAD_WHOLE_BYTES = 32 * 1024 * 1024


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


# Each variant's record of choices (codegen/choices.py).
RECORDS: dict[Variant, type[Choices]] = {
    Variant.DIRECT: DirectChoices, Variant.COL2IM: Col2imChoices,
    Variant.ACROSS_GROUPS: AcrossGroupsChoices,
    Variant.DEPTHWISE_WEIGHTS: DepthwiseWeightChoices,
    Variant.GROUPED_WEIGHTS: GroupedWeightChoices, Variant.WEIGHTS_DOT: DotWeightChoices,
    Variant.WEIGHTS_PACKED: WeightChoices, Variant.WEIGHTS_PAIRS: WeightChoices,
    Variant.WEIGHTS_FLAT: WeightChoices, Variant.WEIGHTS: WeightChoices,
}


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


@dataclass(frozen=True)
class KernelPlan:
    """A kernel's resolved plan: its variant, the overrides it was given (the plan; empty
    for the rules') and every choice the rules derived from them (what the variant's
    template reads), computed once per (configuration, plan)."""

    variant: Variant
    overrides: Mapping[str, int]
    choices: Choices  # what the variant's template reads (tiles, flags, ...): its record
    bf16_dot: bool  # bf16 pairs multiplied with vdpbf16ps
    reads: frozenset[str]  # the plan choices the rules consulted: those the variant takes


def resolve_plan(config: KernelConfig, plan: Mapping[str, int] | None = None, *,
                 strict: bool = True) -> KernelPlan:
    """The resolved plan of `config` under `plan` (default: the rules'). An override that
    the chosen variant's rules never read is a ValueError naming the variant and the
    choices it takes, since it would change nothing (with `strict=False` it is left in
    `overrides`, and missing from `reads`)."""
    return _resolve(config, tuple(sorted((plan or {}).items())), strict)


@lru_cache(maxsize=4096)
def _resolve(config: KernelConfig, items: tuple[tuple[str, int], ...],
             strict: bool) -> KernelPlan:
    overrides = dict(items)
    reads = _Reads(overrides)
    body = _body(config, reads)
    variant = Variant(body.pop("body"))
    choices = RECORDS[variant](**body)
    bf16_dot = uses_bf16_dot(config, reads)
    unread = sorted(set(overrides) - reads.read)
    if unread and strict:
        raise ValueError(
            f"plan {overrides} of {kernel_name(config, overrides)}: the "
            f"{variant.name.lower()} variant ({variant.value}) does not read {unread}; "
            f"here it takes {sorted(reads.read & set(PLAN_CHOICES))}")
    return KernelPlan(variant, MappingProxyType(overrides), choices, bf16_dot,
                      frozenset(reads.read))


def _body(config: KernelConfig, plan: Mapping[str, int]) -> dict:
    """The template that computes this configuration, and its tiles."""
    if config.family == "bwd_weights" and config.depthwise:
        return {"body": "depthwise_weights.c.j2", **depthwise_weight_rows(config, plan)}
    if config.family == "bwd_weights":
        grouped = weights_across_groups(config, plan)
        if grouped["group_lanes"]:
            return {"body": "grouped_weights.c.j2", **grouped}
        dot = dot_tiles(config, plan)
        if dot["ncx_dot"]:
            return {"body": "bwd_weights_dot.c.j2", "no_scratch": True, **dot}
        tiles = weight_tiles(config, plan)
        if tiles["packed"]:
            body = "bwd_weights_packed.c.j2"
        elif uses_bf16_dot(config, plan):  # bf16 pixel pairs
            body = "bwd_weights_pairs.c.j2"
        elif tiles["flatten_w"]:  # (kw, input channel) rows over a padded copy
            body = "bwd_weights_flat.c.j2"
        else:  # input-channel rows of one tap
            body = "bwd_weights.c.j2"
        return {"body": body, "no_scratch": tiles["packed"], **tiles, **amx_tiles(config, plan)}
    if config.depthwise or data_across_groups(config, plan):
        grouped = not config.depthwise  # input spread to the lanes, never padded
        return {"body": "depthwise.c.j2", "slide_rows": slide_rows(config, plan),
                "pad_columns_below": 0 if grouped else pad_columns_below(config, plan),
                "vector_per_group": config.vector_channels if grouped else 1,
                "reduced_per_group": reduced_channels(config) if grouped else 1,
                "compute_scratch": True, "stream_min_bytes": stream_min_bytes(config, plan),
                "spread_whole_bytes": plan.get("spread_whole_mb", SPREAD_WHOLE_BYTES >> 20) << 20,
                "round_in_tiles": False, "pointwise_ncx": False, "overlap_runs": False,
                **direct_tiles(config, plan)}
    if col2im(config, plan):
        in_place = config.data_format == "NCX" and config.dtype == "f32" and bool(
            plan.get("ncx_in_place", 1))
        return {"body": "col2im.c.j2", "column_runs": False, "compute_scratch": True,
                "input_in_place": in_place,
                "round_in_tiles": False, "pad_columns_below": 0, "image_block_bytes": 0,
                "pointwise_ncx": False, **col2im_tiles(config, plan)}
    tiles, ncx = direct_tiles(config, plan), pointwise_ncx_tiles(config, plan)
    amx = amx_tiles(config, plan)
    bands = band_bytes(config, plan)
    second, ncx_second = split_tiles("NCX bands" if bands else config.data_format,
                                     tiles["tiles"], ncx.get("ncx_tiles", []), amx["amx"])
    return {"body": "direct.c.j2", "pad_columns_below": pad_columns_below(config, plan),
            "overlap_runs": overlap_runs(config, plan),
            "stream_min_bytes": stream_min_bytes(config, plan),
            "band_bytes": bands,
            "no_scratch": bool(bands),  # copies bands of rows, not whole tensors
            "image_block_bytes": image_block_bytes(config, plan),
            "weight_packing": weight_packing(config, plan),
            "second_part": second, "ncx_second_part": ncx_second, **tiles, **ncx, **amx}


# Compile time of a direct kernel's code besides its tiles, and of each tile on top of
# its accumulators (rows x vectors, twice that with the odd partial sums of small tiles),
# in units of one accumulator: to balance the two objects a lazy build compiles at once
# (fit to GCC 12's times for the parts of ResNet-50 kernels compiled alone, Zen 4: about
# 1 ms a unit). The copies of data kernels that pack their input and unpack their
# result (pack_data, unpack_data: channels-first kernels' transposes) are the second
# object's, SECOND_BASE_COST; the transposes of kernels that copy bands of rows
# (ncx_bands.h.j2) the first's, with the bands' loop ("NCX bands": measured as 0.1 s more
# in the first object and 0.15 s less in the second than with whole copies). The AMX
# path, always the second object's, costs about AMX_COST (Sapphire Rapids, GCC 12:
# 0.15-0.25 s; NCX with its channels-last copies).
BASE_COST = {"NXC": 150, "NCX": 180, "NCX bands": 280}
SECOND_BASE_COST = {"NXC": 0, "NCX": 150, "NCX bands": 0}
TILE_COST = 30
AMX_COST = {"NXC": 150, "NCX": 250, "NCX bands": 250}


def split_tiles(data_format: str, tiles: list[tuple[int, int]],
                ncx_tiles: list[tuple[int, int]], amx: bool = False,
                ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The tiles a direct kernel's second object defines (see functions.h.j2): the
    costliest first, each to the object with less to compile so far (the second holds
    a data kernel's copies, SECOND_BASE_COST, and the AMX path, where there is one)."""
    def cost(tile: tuple[int, int]) -> int:
        accumulators = tile[0] * tile[1]
        return TILE_COST + accumulators * (2 if accumulators < 8 else 1)

    load = [BASE_COST[data_format],
            SECOND_BASE_COST[data_format] + (AMX_COST[data_format] if amx else 0)]
    second: list[tuple[str, tuple[int, int]]] = []
    named = [("tile", t) for t in tiles] + [("ncx", t) for t in ncx_tiles]
    for kind, tile in sorted(named, key=lambda n: -cost(n[1])):
        part = int(load[1] < load[0])
        load[part] += cost(tile)
        if part:
            second.append((kind, tile))
    return ([t for kind, t in second if kind == "tile"],
            [t for kind, t in second if kind == "ncx"])


# Kernels whose tiles carry IN_PART guards (functions.h.j2): direct kernels split their
# tiles between the two objects (split_tiles); weight gradients from row segments
# (weight_tiles.h.j2) put all their tiles in the second, about a third of their compile
# time (GCC 12, Zen 4: 0.08-0.14 s of tiles beside 0.25-0.7 s of the rest).
TWO_PART_BODIES = ("direct.c.j2", "bwd_weights.c.j2", "bwd_weights_pairs.c.j2",
                   "bwd_weights_flat.c.j2", "bwd_weights_packed.c.j2")


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
    return 2 if resolve_plan(config, plan).variant.value in TWO_PART_BODIES else 1


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
    """Everything kernel.c.j2 reads, derived from the configuration and its plan."""
    pad = 3 - config.rank
    kernel_w = config.kernel[-1]
    resolved = resolve_plan(config, plan)
    body = {"body": resolved.variant.value, **resolved.choices}
    return {
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
        # f32 channels-last data is used in place; anything else goes through f32 scratch.
        "pack_data": config.dtype != "f32" or config.data_format != "NXC",
        # data kernels compile pack_data and unpack_data (NCX: the transposes) in the
        # second object of a build in two (SECOND_BASE_COST)
        "copies_in_second_part": config.family != "bwd_weights",
        "unroll_taps": f"#pragma GCC unroll {kernel_w}" if 1 < kernel_w <= MAX_UNROLLED_TAPS
        else "",
        "isa": config.isa,
        "min_thread_flops": min_thread_flops(config),
        "vl": VECTOR_LANES[config.isa],
        "simd": SIMD[config.isa],
        "transpose_stages": _halvings(VECTOR_LANES[config.isa]),
        "transpose_masks": transpose_masks(VECTOR_LANES[config.isa]),
        "bf16_dot": resolved.bf16_dot,
        "regroup_pixels": config.family == "bwd_weights" and config.data_format == "NXC"
        and not config.depthwise and config.pointwise,
        "round_in_tiles": rounds_in_tiles(config),
        "no_scratch": False,  # True: the body copies no whole data tensor
        # True: compute() takes part 4 of the workspace as scratch (depthwise.c.j2's
        # spread input rows, col2im.c.j2's columns)
        "compute_scratch": False,
        "column_runs": True,  # the body plans runs of output columns (runs.h.j2)
        "input_in_place": False,  # True: a data kernel reads its input in the user's layout
        "image_block_bytes": 0,  # > 0: data_entry runs blocks of images (direct.c.j2)
        "band_bytes": 0,  # > 0: data_entry runs bands of rows (direct.c.j2, ncx_bands.h.j2)
        "amx": False,  # True: the body carries the AMX path (amx.h.j2)
        "pad_max_zeros_percent": PAD_MAX_ZEROS_PERCENT,
        # NCX blocks of VL channels x VL pixels transposed in registers: into f32 scratch
        # (whole tensors, bands of rows or chunks) and into the packed plan's diff_dst panels
        "transpose_to_f32": config.data_format == "NCX" and (
            body["body"] == "bwd_weights_packed.c.j2" or body.get("band_bytes", 0) > 0
            or not (resolved.bf16_dot or body.get("no_scratch", False))),
        **body,
    }
