"""How a kernel's main parallel region splits its work over N threads, computed from its
resolved plan and a call's sizes (`convgrad explain --threads N`).

Every parallel region of a kernel is `run_shares(threads, fn, job)` (fn computes share t
of nt itself) or `run_ranges(threads, count, fn, job)` (`part_range`'s contiguous ranges;
templates/parallel.h.j2). This module mirrors, in Python, the C arithmetic of the region
that does a kernel's multiply-adds (its *main region*; the copies and packing before it
are not counted), one function per kind of split, chosen by the plan's variant:

- `row_shares`: output rows `rows * t / nt` (direct.c.j2's row_shares.h.j2, the NCX
  bands of ncx_bands.h.j2, col2im.c.j2);
- `part_ranges`: `part_range` over a count of items (the 1x1 direct kernels' blocks of
  pixels, channels-first 1x1 tiles' (group, chunk, image, pixel block) items,
  depthwise.c.j2's rows, depthwise_weights.c.j2's (row block, channel part) pairs);
- `slice_shares`: weight_slices.h.j2's `thread_share`: `part_range` over the (pixel
  slice, tile) items, numbered slice by slice (shares start and end inside slices), the
  slices of near-equal rows (weight_compute.h.j2; of whole uniform chunks in the packed
  kernels); bf16 pixel pairs (bwd_weights_pairs.c.j2) once per block of images of their
  pair copies, in the batch's slices.

A *task* is the unit each split counts, the same the kernels' test hook counts
(`TRACE_TASKS` in templates/parallel.h.j2, compiled in under -DCONVGRAD_TRACE_TASKS):
(output row, vector block) pairs for direct kernels' rows, (pixel block, group, vector
block) items of 1x1 kernels per chunk of reduced channels, (group, chunk of channel
blocks, image, pixel block) items of channels-first 1x1 tiles, output rows for col2im and
depthwise data kernels, (diff_dst row, tile) pairs for weight gradients and (row,
channel block) pairs for depthwise weight gradients. Tasks of one kernel are of near
equal cost, so the largest share over the mean is how much longer the slowest thread
runs than a perfect split would.

    >>> from convgrad.codegen.layers import Layer
    >>> layer = Layer("ConvolutionBackwardData", ((32, 56, 56, 64), (3, 3, 64, 64)),
    ...               {"pads_begin": 1, "pads_end": 1})
    >>> print(split_of(layer.resolve(), 16, isa="avx512"))  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import VECTOR_LANES
from convgrad.codegen.ops import Problem
from convgrad.codegen.rules_groups import min_thread_flops
from convgrad.codegen.rules_weights import weight_tile_count
from convgrad.codegen.variants import KernelPlan, Variant, resolve_plan


class NotModelled(ValueError):
    """The kernel's main region takes a path this module does not model (yet)."""


@dataclass(frozen=True)
class Sizes:
    """A call's run-time sizes as the kernel reads them (kernel.c.j2's sizes_t): 3-D,
    absent leading axes 1."""

    batch: int
    id: int
    ih: int
    iw: int
    od: int
    oh: int
    ow: int
    pd: int = 0
    ph: int = 0
    pw: int = 0

    @classmethod
    def of(cls, problem: Problem) -> Sizes:
        pad = 3 - problem.config.rank
        src = (1,) * pad + tuple(problem.src_spatial)
        dst = (1,) * pad + tuple(problem.dst_spatial)
        pads = (0,) * pad + tuple(problem.pads_begin)
        return cls(problem.batch, *src, *dst, *pads)

    def read(self, family: str) -> tuple[int, int, int]:
        """read_extent: the spatial sizes a data kernel's tiles read."""
        return (self.od, self.oh, self.ow) if family == "bwd_data" else (self.id, self.ih, self.iw)

    def write(self, family: str) -> tuple[int, int, int]:
        """write_extent: the spatial sizes a data kernel writes."""
        return (self.id, self.ih, self.iw) if family == "bwd_data" else (self.od, self.oh, self.ow)


@dataclass(frozen=True)
class Split:
    """The main region's split of one call over `asked` threads: `tasks[t]` for each of
    the `shares` the kernel runs (fewer than asked for a small layer: one per
    MIN_THREAD_FLOPS)."""

    kind: str  # the split function: row_shares, part_ranges or slice_shares
    unit: str  # what a task is
    asked: int
    tasks: tuple[int, ...]
    detail: str = ""  # how the work is cut: the pieces the split deals out

    @property
    def shares(self) -> int:
        return len(self.tasks)

    @property
    def total(self) -> int:
        return sum(self.tasks)

    @property
    def idle(self) -> int:
        """Threads asked for that run no task: shares without any, and those the small
        layer's cap leaves out."""
        return self.asked - sum(1 for t in self.tasks if t)

    @property
    def imbalance(self) -> float:
        """The largest share over the mean of the shares run (1.0: a perfect split)."""
        return max(self.tasks) * self.shares / self.total if self.total else 1.0

    def __str__(self) -> str:
        capped = " (one per MIN_THREAD_FLOPS)" if self.shares < self.asked else ""
        return (f"{self.asked}: {self.shares} shares{capped}, largest/mean "
                f"{self.imbalance:.3f}, {min(self.tasks)}-{max(self.tasks)} of {self.total} "
                f"tasks a share, {self.idle} idle ({self.kind} of {self.detail}; a task: one "
                f"{self.unit})")


# -- the split functions, as the C computes them ------------------------------------------

def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def row_shares(rows: int, nt: int) -> list[int]:
    """Rows per share of `rows * t / nt` (row_shares.h.j2, col2im.c.j2)."""
    return [rows * (t + 1) // nt - rows * t // nt for t in range(nt)]


def part_ranges(count: int, nt: int) -> list[tuple[int, int]]:
    """parallel.h.j2's part_range: the first count % nt ranges hold one item more."""
    size, extra = divmod(count, nt)
    ranges = []
    for t in range(nt):
        begin = t * size + min(t, extra)
        ranges.append((begin, begin + size + (t < extra)))
    return ranges


def point_block(pixels: int, tile: int, items_per_block: int, nt: int) -> int:
    """pointwise.h.j2's point_block: 16 tiles of pixels, on more than one thread halved
    while the threads would get fewer than 4 (block, group, vector block) items each,
    down to one tile."""
    block = 16 * tile
    while nt > 1 and block > tile and ceil_div(pixels, block) * items_per_block < 4 * nt:
        block //= 2
    return block


def thread_share(begin: int, end: int, tiles: int) -> tuple[int, int, int, int]:
    """weight_slices.h.j2's thread_share of the (slice, tile) items [begin, end): slices
    [s0, s1), the first one's tiles from tile0, the last one's before tile1."""
    if begin == end:
        return 0, 0, 0, 0
    return begin // tiles, (end - 1) // tiles + 1, begin % tiles, (end - 1) % tiles + 1


def uniform_slice_rows(rows: int, chunk: int, chunks: int, count: int) -> list[int]:
    """Rows of each of `count` slices taking whole chunks of `chunks` chunks of `chunk`
    rows (uniform_chunks.h.j2: the packed and dot-product weight gradients)."""
    return [sum(min(c * chunk + chunk, rows) - c * chunk
                for c in range(chunks * s // count, chunks * (s + 1) // count))
            for s in range(count)]


def even_slice_rows(rows: int, count: int) -> list[int]:
    """Rows of each of `count` slices of near-equal rows (weight_compute.h.j2's
    slice_rows)."""
    return [rows * (s + 1) // count - rows * s // count for s in range(count)]


def slice_shares(slice_rows: list[int], tiles: int, nt: int) -> list[int]:
    """(diff_dst row, tile) pairs per share of a weight gradient over slices of
    `slice_rows` rows (weight_slices.h.j2's thread_share)."""
    count = len(slice_rows)
    tasks = []
    for begin, end in part_ranges(count * tiles, nt):
        s0, s1, tile0, tile1 = thread_share(begin, end, tiles)
        tasks.append(sum(((tile1 if s == s1 - 1 else tiles) - (tile0 if s == s0 else 0))
                         * slice_rows[s] for s in range(s0, s1)))
    return tasks


# -- a kernel's sizes and threads ---------------------------------------------------------

def regroups_pixels(config: KernelConfig) -> bool:
    """variants.render_context's regroup_pixels: a 1x1 stride-1 NXC weight gradient,
    whose read_dims regroups the batch's pixels into long rows."""
    return (config.family == "bwd_weights" and config.data_format == "NXC"
            and not config.depthwise and config.pointwise)


def call_sizes(config: KernelConfig, sizes: Sizes, threads: int) -> tuple[Sizes, int]:
    """read_dims (kernel.c.j2): the sizes the body sees (a 1x1 weight gradient's pixels
    regrouped into rows of an even width) and its shares, one per MIN_THREAD_FLOPS of
    multiply-adds at most."""
    z = sizes
    if regroups_pixels(config):
        pixels = z.batch * z.id * z.ih * z.iw
        if (z.pd == z.ph == z.pw == 0 and (z.id, z.ih, z.iw) == (z.od, z.oh, z.ow)
                and pixels > 0 and pixels % 2 == 0):
            width = 64
            while pixels % width:
                width -= 2
            if width >= 8:
                z = replace(z, batch=1, id=1, od=1, ih=pixels // width, oh=pixels // width,
                            iw=width, ow=width)
    shares = max(1, threads)
    flops = (2.0 * z.batch * (z.od * z.oh * z.ow) * config.groups * config.cin_per_group
             * config.cout_per_group * math.prod(config.kernel))
    useful = flops / float(min_thread_flops(config))
    if useful < shares:
        shares = 1 if useful < 1.0 else int(useful)
    return z, shares


# -- the main region of each variant ------------------------------------------------------

def _vectors(channels: int, config: KernelConfig, block: int) -> int:
    """Vector blocks of `block` vectors over `channels` (NVB)."""
    return ceil_div(ceil_div(channels, VECTOR_LANES[config.isa]), block)


def _is_pointwise(z: Sizes) -> bool:
    """is_pointwise (pointwise.h.j2): no pads and the input's sizes the output's."""
    return z.pd == z.ph == z.pw == 0 and (z.id, z.ih, z.iw) == (z.od, z.oh, z.ow)


def images_per_block(per_image: int, block_bytes: int, nt: int, batch: int) -> int:
    """direct.c.j2's images_per_block: images of about `block_bytes` per thread."""
    return min((block_bytes // per_image if per_image < block_bytes else 1) * nt, batch)


def image_blocks(batch: int, block: int) -> list[int]:
    """The images of each block of `block` over the batch, the last one the rest (one
    empty block for an empty batch, as the kernels run their loop over none)."""
    return [min(block, batch - n0) for n0 in range(0, batch, block)] if batch else [0]


def _takes_ncx_path(config: KernelConfig, plan: KernelPlan, z: Sizes) -> bool:
    """takes_ncx_path (ncx_in_place.h.j2, ncx_strided.h.j2): whether a call runs the
    channels-first 1x1 tiles (else the transposes and the plan's other tiles)."""
    c = plan.choices
    if not c.pointwise_ncx or z.od * z.oh * z.ow < c.ncx_min_pixels:
        return False
    if not c.ncx_strided:
        return _is_pointwise(z)
    if z.pd or z.ph or z.pw:
        return False
    sd, sh, sw = (1,) * (3 - config.rank) + config.strides
    return ((z.od - 1) * sd < z.id and (z.oh - 1) * sh < z.ih and (z.ow - 1) * sw < z.iw)


def _pointwise_ncx(config: KernelConfig, plan: KernelPlan, z: Sizes, nt: int,
                   input_offset: int) -> Split:
    """compute_pointwise_ncx (pointwise_ncx.h.j2): run_ranges over (group, chunk of
    channel blocks, image, pixel block) items, per block of images of the compact copy
    with strides (ncx_strided.h.j2's ncx_block), else once."""
    c = plan.choices
    lanes = VECTOR_LANES[config.isa]
    cv = config.cin_per_group if config.family == "bwd_data" else config.cout_per_group
    chunks = ceil_div(ceil_div(cv, c.ncx_rows), c.ncx_block_chunk)
    spatial = z.od * z.oh * z.ow
    if c.ncx_strided:  # images per block: their compact copies, NCX_COMPACT_BYTES a thread
        per_image = config.groups * config.cin_per_group * spatial * 4
        block = images_per_block(per_image, c.ncx_compact_bytes, nt, z.batch)
    else:
        block = z.batch
    # the data input of each call: the user's (from input_offset bytes past a cache line)
    # but for a convolution's compact copy (in the workspace, on a line)
    in_image = config.groups * (config.cout_per_group if config.family == "bwd_data"
                                else config.cin_per_group) * spatial * 4
    user_input = config.family == "bwd_data" or not c.ncx_strided
    totals = [0] * nt
    calls = []
    for n0 in range(0, z.batch, block):
        at = (input_offset + n0 * in_image) % 64 if user_input else 0
        past = at // 4 % lanes
        head = lanes - past if c.ncx_head and at % 4 == 0 and spatial % lanes == 0 and past else 0
        blocks = (head > 0) + ceil_div(spatial - head, c.ncx_vecs * lanes)
        batch = min(block, z.batch - n0)
        calls.append(blocks)
        per = [e - b for b, e in part_ranges(config.groups * chunks * batch * blocks, nt)]
        totals = [a + b for a, b in zip(totals, per, strict=True)]
    images = f" in {len(calls)} blocks of images" if len(calls) > 1 else ""
    return Split("part_ranges", "(group, chunk of channel blocks, image, pixel block) item",
                 nt, tuple(totals), f"{config.groups} groups x {chunks} chunks of channel "
                 f"blocks x {z.batch} images x {calls[0]} blocks of {c.ncx_vecs * lanes} "
                 f"pixels{images}")


def _direct(config: KernelConfig, plan: KernelPlan, z: Sizes, nt: int,
            input_offset: int = 0) -> Split:
    c = plan.choices
    if c.amx:
        raise NotModelled(f"{plan.variant.value}: the AMX path is not modelled")
    if _takes_ncx_path(config, plan, z):
        return _pointwise_ncx(config, plan, z, nt, input_offset)
    bwd = config.family == "bwd_data"
    cr = config.cout_per_group if bwd else config.cin_per_group
    cv = config.cin_per_group if bwd else config.cout_per_group
    out_c = config.groups * cv
    nvb = _vectors(cv, config, c.vec_block)
    if c.band_bytes:  # ncx_bands.h.j2's compute_bands: shares of rows, in bands
        d, h, _ = z.write(config.family)
        return Split("row_shares", "(output row, vector block) pair", nt,
                     tuple(r * nvb for r in row_shares(z.batch * d * h, nt)),
                     f"{z.batch * d * h} output rows, in bands of about {c.band_bytes} bytes")
    # data_entry.c.j2: blocks of images (image_block), each one call of compute()
    batches = [z.batch]
    if c.image_block_bytes:
        read, write = z.read(config.family), z.write(config.family)
        # bytes of a multiply step's reduced elements: one f32, or a pair of bf16
        steps = ceil_div(cr, 2) if plan.bf16_dot else cr  # CRP
        if plan.bf16_dot:  # input_pairs_bytes: none where the user's pixels are pairs
            copied = config.data_format != "NXC" or cr % 2 == 1
        else:  # pack_data's f32 copy
            copied = config.dtype != "f32" or config.data_format != "NXC"
        per_image = 4 * (math.prod(read) * config.groups * steps * copied
                         + math.prod(write) * out_c)
        weight_bytes = config.groups * nvb * math.prod(config.kernel) * steps * c.vec_block \
            * VECTOR_LANES[config.isa] * 4
        if 2 * weight_bytes <= per_image:
            batches = image_blocks(z.batch, images_per_block(per_image, c.image_block_bytes,
                                                             nt, z.batch))
    totals = [0] * nt
    pointwise = c.pointwise and _is_pointwise(z)
    for batch in batches:
        if pointwise:  # pointwise.h.j2: one run_ranges per chunk of reduced channels
            pixels = batch * z.od * z.oh * z.ow
            block = point_block(pixels, c.tile_rows, config.groups * nvb, nt)
            blocks = ceil_div(pixels, block)
            chunks = ceil_div(cr, c.reduce_chunk)
            per = [(e - b) * chunks for b, e in part_ranges(blocks * config.groups * nvb, nt)]
        else:
            d, h, _ = z.write(config.family)
            per = [r * nvb for r in row_shares(batch * d * h, nt)]
        totals = [a + b for a, b in zip(totals, per, strict=True)]
    calls = f" in {len(batches)} blocks of images" if len(batches) > 1 else ""
    if pointwise:
        return Split("part_ranges", "(pixel block, group, vector block) item", nt,
                     tuple(totals), f"{blocks} blocks of {block} pixels x "
                     f"{config.groups} groups x {nvb} vector blocks, x {chunks} chunks{calls}")
    return Split("row_shares", "(output row, vector block) pair", nt, tuple(totals),
                 f"{z.batch * math.prod(z.write(config.family)[:2])} output rows{calls}")


def _pair_image_blocks(config: KernelConfig, plan: KernelPlan, z: Sizes) -> list[int]:
    """bwd_weights_pairs.c.j2's image_block: the batch's blocks of images whose pixel-pair
    copies (src pairs of every kw tap, bf16 diff_dst pairs) stay in cache."""
    block_bytes = plan.choices.image_block_bytes
    ppr = ceil_div(z.ow, 2)  # pairs_per_row
    src_step, dd_step = _pair_steps(config)
    per_image = ppr * (z.id * z.ih * src_step * 4 + z.od * z.oh * dd_step * 2)
    if not block_bytes or z.batch * per_image <= 2 * block_bytes:
        return image_blocks(z.batch, z.batch)
    return image_blocks(z.batch, images_per_block(per_image, block_bytes, 1, z.batch))


def _pair_steps(config: KernelConfig) -> tuple[int, int]:
    """bwd_weights_pairs.c.j2's SRC_STEP (src pairs) and DD_STEP (bf16 values) between
    output pixel pairs."""
    vl = VECTOR_LANES[config.isa]
    return (config.groups * config.kernel[-1] * config.cin_per_group,
            config.groups * ceil_div(config.cout_per_group, vl) * vl * 2)


def _weights(config: KernelConfig, plan: KernelPlan, z: Sizes, nt: int) -> Split:
    c = plan.choices
    if c.amx:
        raise NotModelled("the AMX path is not modelled")
    vl = VECTOR_LANES[config.isa]
    nvb = _vectors(config.cout_per_group, config, c.vec_block)
    kd, kh, kw = (1,) * (3 - config.rank) + config.kernel
    sd, sh, _ = (1,) * (3 - config.rank) + config.strides
    cin, cout = config.groups * config.cin_per_group, config.groups * config.cout_per_group
    pairs = plan.variant is Variant.WEIGHTS_PAIRS  # bf16 pixel pairs, every kw in the rows
    # tile rows over (kw, channel) pairs
    by_columns = pairs or plan.variant is Variant.WEIGHTS_FLAT
    rows_per_tile_group = (kw if by_columns else 1) * config.cin_per_group
    nrb = ceil_div(rows_per_tile_group, c.tile_rows)
    tiles = weight_tile_count(config, c.tile_rows, rows_per_tile_group, c.vec_block,
                              ceil_div(config.cout_per_group, vl), by_columns)
    # chunk_rule_rows: diff_dst rows per chunk by the rule
    if c.chunk_pixels:
        rule = 1 if z.ow >= c.chunk_pixels else c.chunk_pixels // z.ow
    else:
        if plan.variant is Variant.WEIGHTS_PACKED:
            columns = z.ow if kw == 1 else z.iw
            row_bytes = 4 * (z.ow * nvb * c.vec_block * vl + kd * kh * columns * nrb * c.tile_rows)
        elif pairs:
            src_step, dd_step = _pair_steps(config)
            row_bytes = ceil_div(z.ow, 2) * (dd_step * 2 + sh * sd * src_step * 4)
        else:
            row_bytes = 4 * (z.ow * cout + sh * sd * z.iw * cin)
        rule = 1 if row_bytes >= c.chunk_bytes else c.chunk_bytes // row_bytes
    # weight_slices.h.j2's slices() of the batch...
    rows = z.batch * z.od * z.oh
    pixels = rows * z.ow
    most = min(pixels // c.slice_min_pixels, ceil_div(rows, rule))
    count = c.max_slices
    while count > 1 and (count > most
                         or (count > c.few_slices and count * c.many_slice_pixels > pixels)):
        count //= 2
    if plan.variant is Variant.WEIGHTS_PACKED:  # uniform_chunks.h.j2: whole chunks a slice
        per_slice = ceil_div(ceil_div(rows, rule), count)
        chunk = ceil_div(rows, per_slice * count) if rows else rule
        chunks = ceil_div(rows, chunk)
        tasks = slice_shares(uniform_slice_rows(rows, chunk, chunks, count), tiles, nt)
        return Split("slice_shares", "(diff_dst row, tile) pair", nt, tuple(tasks),
                     f"{count} slices of {rows} rows ({chunks} chunks) x {tiles} tiles")
    # ...weight_compute.h.j2: near-equal rows a slice, of each block of images of the pair
    # copies (bwd_weights_pairs.c.j2), else of the batch
    totals = [0] * nt
    batches = _pair_image_blocks(config, plan, z) if pairs else [z.batch]
    for batch in batches:
        per = slice_shares(even_slice_rows(batch * z.od * z.oh, count), tiles, nt)
        totals = [a + b for a, b in zip(totals, per, strict=True)]
    images = (f" in {len(batches)} blocks of images of {batches[0] * z.od * z.oh} rows"
              if len(batches) > 1 else "")
    return Split("slice_shares", "(diff_dst row, tile) pair", nt, tuple(totals),
                 f"{count} slices of {rows} rows{images} x {tiles} tiles")


def _depthwise_weights(config: KernelConfig, plan: KernelPlan, z: Sizes, nt: int) -> Split:
    # row_blocks.h.j2: block_count and block_first; depthwise_weights.c.j2's compute()
    rows = z.batch * z.od * z.oh
    per_block = ceil_div(512, z.ow)  # MIN_BLOCK_PIXELS
    blocks = min(ceil_div(rows, per_block), 64)  # MAX_BLOCKS
    if blocks > 1:
        blocks = ceil_div(blocks, 4) * 4  # BLOCK_MULTIPLE
    blocks = min(blocks, rows)
    nvb = _vectors(config.groups, config, plan.choices.vec_block)
    parts = 1 if blocks >= nt else (nvb if nvb < nt else nt)

    def first(b: int) -> int:
        return b * (rows // blocks) + min(b, rows % blocks) if blocks else 0

    tasks = [sum((first(pair // parts + 1) - first(pair // parts))
                 * ((pair % parts + 1) * nvb // parts - pair % parts * nvb // parts)
                 for pair in range(b, e))
             for b, e in part_ranges(blocks * parts, nt)]
    return Split("part_ranges", "(diff_dst row, channel block) pair", nt, tuple(tasks),
                 f"{blocks} row blocks of {rows} rows x {parts} parts of {nvb} channel blocks")


def _output_rows(kind: str):
    def split(config: KernelConfig, plan: KernelPlan, z: Sizes, nt: int) -> Split:
        d, h, _ = z.write(config.family)
        rows = z.batch * d * h
        tasks = row_shares(rows, nt) if kind == "row_shares" else [
            e - b for b, e in part_ranges(rows, nt)]
        return Split(kind, "output row", nt, tuple(tasks), f"{rows} output rows")
    return split


MAIN_REGIONS = {
    Variant.DIRECT: _direct,
    Variant.COL2IM: _output_rows("row_shares"),
    Variant.ACROSS_GROUPS: _output_rows("part_ranges"),
    Variant.WEIGHTS: _weights,
    Variant.WEIGHTS_FLAT: _weights,
    Variant.WEIGHTS_PACKED: _weights,
    Variant.WEIGHTS_PAIRS: _weights,
    Variant.DEPTHWISE_WEIGHTS: _depthwise_weights,
}


def split(config: KernelConfig, sizes: Sizes, threads: int,
          plan: Mapping[str, int] | None = None, input_offset: int = 0) -> Split:
    """The main region's split of a call of the kernel of `config` (and `plan`, default
    the rules') with `sizes` on `threads` threads, its data input `input_offset` bytes
    past a 64-byte boundary (0, as PyTorch's tensors: where channels-first 1x1 tiles
    read it in place, a head block may align their loads). NotModelled for the variants
    and paths not mirrored here (AMX, the grouped and dot-product weight gradients)."""
    resolved = resolve_plan(config, plan)
    region = MAIN_REGIONS.get(resolved.variant)
    if region is None:
        raise NotModelled(f"the {resolved.variant.name.lower()} variant "
                          f"({resolved.variant.value}) is not modelled")
    z, shares = call_sizes(config, sizes, threads)
    result = (_direct(config, resolved, z, shares, input_offset) if region is _direct
              else region(config, resolved, z, shares))
    return replace(result, asked=max(1, threads))
