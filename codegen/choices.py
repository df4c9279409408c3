"""The choices a kernel's plan resolves to (its tiles, chunks, blocks and flags): one
frozen, typed record per kernel family, which holds every value of its variant that the
templates read (render_context) and which `convgrad explain` prints. The rules
(rules_*.py) and the variant's own code (VariantSpec.fill) derive them; a record refuses
a choice its family does not have, or one missing.

Two kinds of field: derived choices, given when the record is made, and the variant's
fixed values (`fixed(...)`: a flag the variant always has, such as `amx = False` where it
has no AMX path), which nothing passes in or overrides. A record is also a read-only
mapping of the derived choices that apply: those left None (the AMX path's in a kernel
without it, the channels-first tiles' in one without them) are not among its keys, so a
template that reads one where it does not apply fails to render (StrictUndefined), as
before; `template_values()` adds the fixed values.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import Field, dataclass, field, fields
from functools import cache
from typing import Any

from convgrad.codegen.rules_weights import MANY_SLICE_PIXELS, MAX_SLICES

Tiles = tuple[tuple[int, int], ...]  # (rows, vectors) of register tiles
_TYPES = {"int": int, "bool": bool, "str": str}  # any other field is a tuple
_FIXED = "fixed"  # the metadata key of a variant's fixed values


def fixed(value: Any) -> Any:
    """A record field the variant always has at `value` (not an argument of the record)."""
    return field(default=value, init=False, metadata={_FIXED: True})


@dataclass(frozen=True, kw_only=True)
class Choices(Mapping):
    """A family's record: its fields, with lists (tiles) made tuples."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
                object.__setattr__(self, f.name, value)
            expected = _TYPES.get(str(f.type).split(" |")[0], tuple)
            if value is not None and (not isinstance(value, expected) or (
                    expected is int and isinstance(value, bool))):
                raise TypeError(f"{type(self).__name__}.{f.name} = {value!r}: expected "
                                f"{f.type}")

    def template_values(self) -> dict[str, object]:
        """Every value of the record that applies, the fixed ones too: what the variant's
        templates read."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def fixed_values(cls) -> dict[str, object]:
        """{name: value} of the variant's fixed values."""
        return {f.name: f.default for f in fields(cls) if _is_fixed(f)}

    def __getitem__(self, key: str) -> object:
        value = getattr(self, key, None) if key in self._names() else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._names() if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return _field_names(cls)


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    """The derived choices' fields of a record type (not its fixed values)."""
    return tuple(f.name for f in fields(cls) if not _is_fixed(f))


def _is_fixed(f: Field) -> bool:
    return bool(f.metadata.get(_FIXED))


# The flags every kernel's shared templates read (data_entry.c.j2, layout.h.j2, ...):
# each record has each of them, derived or fixed.
#   amx                the body carries the AMX path (amx.h.j2)
#   band_bytes         > 0: data_entry runs bands of rows (direct.c.j2, ncx_bands.h.j2)
#   column_runs        the body plans runs of output columns (runs.h.j2)
#   compute_scratch    compute() takes part 4 of the workspace as scratch (depthwise.c.j2's
#                      spread input rows, col2im.c.j2's columns)
#   image_block_bytes  > 0: data_entry runs blocks of images (direct.c.j2)
#   input_in_place     a data kernel reads its input in the user's layout
#   no_scratch         the body copies no whole data tensor
#   round_in_tiles     f16/bf16 channels-last results round in the last chunk's tiles


@dataclass(frozen=True, kw_only=True)
class RowTileChoices(Choices):
    """Register tiles of output pixels over rows (rules_data.direct_tiles), which the
    direct and across-groups data kernels share, with their padding and stores."""
    long_tile: int
    pad_columns_below: int
    partial_steps: int
    point_prefetch: bool
    point_vb_inner: bool
    pointwise: bool
    reduce_chunk: int
    row_vb_inner: bool
    step_unroll: int
    stream_min_bytes: int
    tile_rows: int
    tile_rows_last: int
    tiles: Tiles
    unrolled_tiles: Tiles
    vec_block: int
    vec_last: int
    column_runs: bool = fixed(True)
    input_in_place: bool = fixed(False)


@dataclass(frozen=True, kw_only=True)
class DirectChoices(RowTileChoices):
    """direct.c.j2: register tiles of output pixels (fwd, bwd_data), with the channels-
    first pointwise tiles (ncx_*) and the AMX path (amx_*) where the kernel has them."""
    amx: bool
    band_bytes: int
    image_block_bytes: int
    ncx_second_part: Tiles
    no_scratch: bool
    overlap_runs: bool
    pointwise_ncx: bool
    round_in_tiles: bool
    second_part: Tiles
    weight_packing: str
    amx_band_pixels: int | None = None
    amx_pack: str | None = None
    amx_patches: bool | None = None
    amx_phases: bool | None = None
    amx_pointwise: bool | None = None
    ncx_block_chunk: int | None = None
    ncx_compact_bytes: int | None = None
    ncx_stream_min_bytes: int | None = None
    ncx_head: bool | None = None
    ncx_min_pixels: int | None = None
    ncx_prefetch: bool | None = None
    ncx_reduce_chunk: int | None = None
    ncx_rows: int | None = None
    ncx_strided: bool | None = None
    ncx_tiles: Tiles | None = None
    ncx_vecs: int | None = None
    compute_scratch: bool = fixed(False)


@dataclass(frozen=True, kw_only=True)
class Col2imChoices(Choices):
    """col2im.c.j2: backward data with few result channels, as columns added into the
    result (one group, whole images in f32 scratch unless read in place)."""
    col_pixels: int
    input_in_place: bool
    partial_steps: int
    tile_rows: int
    tile_rows_last: int
    tiles: Tiles
    vec_block: int
    vec_last: int
    amx: bool
    band_bytes: int = fixed(0)
    column_runs: bool = fixed(False)
    compute_scratch: bool = fixed(True)
    image_block_bytes: int = fixed(0)
    no_scratch: bool = fixed(False)
    pad_columns_below: int = fixed(0)
    pointwise_ncx: bool = fixed(False)
    round_in_tiles: bool = fixed(False)


@dataclass(frozen=True, kw_only=True)
class AcrossGroupsChoices(RowTileChoices):
    """depthwise.c.j2: depthwise data kernels, or lanes across groups (input spread to
    the lanes, rows of it in scratch)."""
    reduced_per_group: int
    slide_rows: int
    spread_whole_bytes: int
    vector_per_group: int
    amx: bool = fixed(False)
    band_bytes: int = fixed(0)
    compute_scratch: bool = fixed(True)
    image_block_bytes: int = fixed(0)
    no_scratch: bool = fixed(False)
    overlap_runs: bool = fixed(False)
    pointwise_ncx: bool = fixed(False)
    round_in_tiles: bool = fixed(False)


@dataclass(frozen=True, kw_only=True)
class WeightFamilyChoices(Choices):
    """What every weight-gradient record has fixed: none of the data kernels' flags."""
    band_bytes: int = fixed(0)
    column_runs: bool = fixed(True)
    compute_scratch: bool = fixed(False)
    input_in_place: bool = fixed(False)
    round_in_tiles: bool = fixed(False)


@dataclass(frozen=True, kw_only=True)
class WeightChoices(WeightFamilyChoices):
    """bwd_weights*.c.j2: weight gradients from rows of one tap, packed panels, bf16 pixel
    pairs or flattened (kw, channel) rows."""
    amx: bool
    chunk_bytes: int
    chunk_pixels: int
    dd_by_chunk: bool
    flatten_w: bool
    image_block_bytes: int
    max_slices: int
    no_scratch: bool
    packed: bool
    partial_pixels: int
    prefetch_next_chunk: bool
    prefetch_panels: bool
    slice_min_pixels: int
    slot_steps: tuple[int, int]
    src_channels_first: bool
    src_in_place: bool
    step_unroll: int
    sums_in_output: bool
    sums_row: int
    tile_rows: int
    tiles: Tiles
    unrolled_tiles: Tiles
    vec_block: int
    amx_band_pixels: int | None = None
    amx_patches: bool | None = None
    few_slices: int = fixed(MAX_SLICES)
    many_slice_pixels: int = fixed(MANY_SLICE_PIXELS)


@dataclass(frozen=True, kw_only=True)
class GroupedWeightChoices(WeightFamilyChoices):
    """grouped_weights.c.j2: weight gradients with lanes across groups."""
    group_lanes: bool
    k_block: int
    max_unrolled_taps: int
    spread_bytes: int
    tiles: Tiles
    vec_block: int
    amx: bool = fixed(False)
    image_block_bytes: int = fixed(0)
    no_scratch: bool = fixed(False)


@dataclass(frozen=True, kw_only=True)
class DepthwiseWeightChoices(WeightFamilyChoices):
    """depthwise_weights.c.j2."""
    all_taps: bool
    group_bytes: int
    max_unrolled_taps: int
    pixel_sweep: bool
    row_vb_inner: bool
    row_vecs: tuple[int, ...]
    rows_template: str
    several_vec_blocks: bool
    slide_pixels: int
    vec_block: int
    vec_last: int
    amx: bool = fixed(False)
    image_block_bytes: int = fixed(0)
    no_scratch: bool = fixed(False)


@dataclass(frozen=True, kw_only=True)
class DotWeightChoices(WeightFamilyChoices):
    """bwd_weights_dot.c.j2: NCX weight gradients as dot products along pixels (it packs
    runs of pixels itself: no whole copies)."""
    chunk_pixels: int
    dot_tiles: Tiles
    max_slices: int
    ncx_dot: bool
    partial_pixels: int
    slice_min_pixels: int
    superblock_bytes: int
    tile_rows: int
    amx: bool = fixed(False)
    image_block_bytes: int = fixed(0)
    no_scratch: bool = fixed(True)
    few_slices: int = fixed(MAX_SLICES)
    many_slice_pixels: int = fixed(MANY_SLICE_PIXELS)
