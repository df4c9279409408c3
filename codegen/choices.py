"""The choices a kernel's plan resolves to (its tiles, chunks, blocks and flags): one
frozen, typed record per kernel family, which its templates read (render_context) and
`convgrad explain` prints. The rules (rules_*.py) derive them; a record refuses a choice
its family does not have, or one missing. A record is also a read-only mapping of the
choices that apply: those left None (the AMX path's in a kernel without it, the
channels-first tiles' in one without them) are not among its keys, so a template that
reads one where it does not apply fails to render (StrictUndefined), as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from functools import cache

Tiles = tuple[tuple[int, int], ...]  # (rows, vectors) of register tiles
_TYPES = {"int": int, "bool": bool, "str": str}  # any other field is a tuple


@dataclass(frozen=True, kw_only=True)
class Choices(Mapping):
    """A family's record: its fields, with lists (tiles) made tuples."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, list):
                value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
                object.__setattr__(self, field.name, value)
            expected = _TYPES.get(str(field.type).split(" |")[0], tuple)
            if value is not None and (not isinstance(value, expected) or (
                    expected is int and isinstance(value, bool))):
                raise TypeError(f"{type(self).__name__}.{field.name} = {value!r}: expected "
                                f"{field.type}")

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
    return tuple(field.name for field in fields(cls))


@dataclass(frozen=True, kw_only=True)
class RowTileChoices(Choices):
    """Register tiles of output pixels over rows (rules_data.direct_tiles), which the
    direct and across-groups data kernels share, with their runs, padding and stores."""
    long_tile: int
    overlap_runs: bool
    pad_columns_below: int
    partial_steps: int
    point_vb_inner: bool
    pointwise: bool
    pointwise_ncx: bool
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


@dataclass(frozen=True, kw_only=True)
class DirectChoices(RowTileChoices):
    """direct.c.j2: register tiles of output pixels (fwd, bwd_data), with the channels-
    first pointwise tiles (ncx_*) and the AMX path (amx_*) where the kernel has them."""
    amx: bool
    band_bytes: int
    image_block_bytes: int
    ncx_second_part: Tiles
    no_scratch: bool
    second_part: Tiles
    weight_packing: str
    amx_band_pixels: int | None = None
    amx_pack: str | None = None
    amx_phases: bool | None = None
    amx_pointwise: bool | None = None
    ncx_block_chunk: int | None = None
    ncx_head: bool | None = None
    ncx_min_pixels: int | None = None
    ncx_reduce_chunk: int | None = None
    ncx_rows: int | None = None
    ncx_tiles: Tiles | None = None
    ncx_vecs: int | None = None


@dataclass(frozen=True, kw_only=True)
class Col2imChoices(Choices):
    """col2im.c.j2: backward data with few result channels, as columns added into the
    result."""
    col_pixels: int
    column_runs: bool
    compute_scratch: bool
    image_block_bytes: int
    input_in_place: bool
    pad_columns_below: int
    partial_steps: int
    pointwise_ncx: bool
    round_in_tiles: bool
    tile_rows: int
    tile_rows_last: int
    tiles: Tiles
    vec_block: int
    vec_last: int


@dataclass(frozen=True, kw_only=True)
class AcrossGroupsChoices(RowTileChoices):
    """depthwise.c.j2: depthwise data kernels, or lanes across groups."""
    compute_scratch: bool
    reduced_per_group: int
    round_in_tiles: bool
    slide_rows: int
    spread_whole_bytes: int
    vector_per_group: int


@dataclass(frozen=True, kw_only=True)
class WeightChoices(Choices):
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


@dataclass(frozen=True, kw_only=True)
class GroupedWeightChoices(Choices):
    """grouped_weights.c.j2: weight gradients with lanes across groups."""
    group_lanes: bool
    k_block: int
    max_unrolled_taps: int
    spread_bytes: int
    tiles: Tiles
    vec_block: int


@dataclass(frozen=True, kw_only=True)
class DepthwiseWeightChoices(Choices):
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


@dataclass(frozen=True, kw_only=True)
class DotWeightChoices(Choices):
    """bwd_weights_dot.c.j2: NCX weight gradients as dot products along pixels."""
    chunk_pixels: int
    dot_tiles: Tiles
    max_slices: int
    ncx_dot: bool
    no_scratch: bool
    partial_pixels: int
    slice_min_pixels: int
    superblock_bytes: int
    tile_rows: int
