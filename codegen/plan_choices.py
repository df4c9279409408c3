"""The plan vocabulary: the choices a plan may set, plan keys, kernel names and the
check of a plan's values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from types import MappingProxyType

from convgrad.codegen.config import KernelConfig

# A plan says how a kernel computes its configuration where that differs from the
# planner's rules: a mapping of the choices below to integers. The empty plan is the
# rules' choice (the default); the tuner (convgrad.tuning) times the candidates() of a
# configuration and keeps the fastest. Every plan computes the same result.
PLAN_CHOICES = {
    "vec_block": "vectors of channels per register tile (fwd, bwd_data, bwd_weights)",
    "tile_rows": "most output pixels (or input channels) per register tile",
    "weight_chunk_kb": "data gradients: KB of weights per pass over the image",
    "pad_columns": "data gradients: 0 keeps runs cut at the edges, 1 pads narrow rows",
    "overlap_runs": "data gradients: 1 runs each w tap over all the columns it reaches "
                    "(runs overlap), 0 cuts rows into runs of the columns the same taps reach",
    "point_vb_inner": "1x1 data gradients: 1 runs a pixel block's vector blocks together",
    "point_prefetch": "1x1 data gradients: 1 each tile fetches the next tile's input "
                      "while it runs, 0 never",
    "pixel_sweep": "depthwise weight gradients: 1 sweeps all channels of a pixel at once, "
                   "sums in L1; 0 register tiles of a vector block",
    "row_vb_inner": "data gradients by rows, depthwise weight gradients: 1 runs each "
                    "row's vector blocks together (its input read once per pass), 0 each "
                    "vector block over every row",
    "step_unroll": "direct and weight-gradient tiles: multiply steps per iteration of "
                   "the reduction loop of the tiles whose registers allow it (1: none)",
    "ncx_in_place": "NCX f32 data gradients by 1x1 tiles or by col2im: 1 reads NCX in "
                    "place (1x1 with strides: through a compact copy of the pixels they "
                    "keep), 0 transposes",
    "ncx_compact_kb": "1x1 NCX f32 data gradients with strides read in place: KB per "
                      "thread of a block of images' compact copy of the pixels the "
                      "strides keep (0: one image per thread)",
    "ncx_head": "1x1 NCX f32 data gradients read in place: 1 puts a head block of one "
                "partial vector before the blocks, so that they load whole cache lines "
                "where every row of the input starts the same floats past one; 0 never",
    "ncx_prefetch": "1x1 NCX f32 data gradients read in place: 1 fetches the next pixel "
                    "block's input and output rows into L2 while the tiles run; 0 never",
    "ncx_pass_kb": "1x1 NCX f32 data gradients read in place: KB of a pixel block's input "
                   "per pass over its channel blocks (0: every reduced channel at once)",
    "all_taps": "depthwise weight gradients: 1 keeps every (kh, kw) tap of a channel block "
                "in registers over a block of rows, 0 the w taps of one kh along a row",
    "row_group_kb": "depthwise weight gradients with all_taps: KB of src and diff_dst rows "
                    "each vector block runs over before the next",
    "slide": "depthwise gradients: 1 uses sliding tiles (data) or a sliding window of src "
             "columns (weights) where stride 1 allows",
    "packed": "weight gradients: 1 copies chunks into panels, 0 reads in place",
    "prefetch_panels": "packed NCX weight gradients: 1 packs diff_dst a vector block at a "
                       "time while the tiles fetch the rows of the next block and of the "
                       "next chunk's src, 0 packs a chunk's panels at once",
    "ncx_dot": "NCX f32 weight gradients with stride 1 along w: 1 packs runs of pixels of "
               "both inputs and multiplies them (dot products), 0 broadcasts src",
    "chunk_pixels": "weight gradients: pixels per chunk (0: chunks of about 1 MB of "
                    "rows, or half the sums' bytes if more)",
    "max_slices": "weight gradients: most pixel slices (a power of two)",
    "sums_in_output": "f32 XIO weight gradients of one group and one slice: 1 adds the "
                      "sums in the user's weights, 0 in workspace, copied out at the end",
    "group_lanes": "grouped layers: 1 vectorises across the groups (lanes over every "
                   "channel of the vectorised side), 0 over one group's channels",
    "image_block_kb": "NCX data gradients: KB of input (f32, or bf16 pairs) and f32 result "
                      "copies per block of images; bf16 weight gradients with vdpbf16ps: KB "
                      "of src and diff_dst pair copies per block (0: the whole batch at once)",
    "band_kb": "NCX data gradients by direct tiles (1-D and 2-D): KB of input and result "
               "rows each thread copies channels-last, computes and copies back a band at a "
               "time (0: blocks of whole images, image_block_kb)",
    "spread_whole_mb": "data gradients across groups: MB of spread input up to which it is "
                       "spread whole up front, else row by row (0: always row by row)",
    "bf16_dot": "bf16 on avx512bf16: 1 multiplies bf16 pairs with vdpbf16ps, 0 widens to "
                "f32 and runs the f32 tiles",
    "stream_kb": "depthwise, across-group and 1x1 f32 data gradients (channels last; "
                 "channels first with strides): results of at least this many KB are "
                 "stored past the caches (non-temporal; 0: never)",
    "col2im": "backward data of one group with few result channels: 1 multiplies each "
              "diff_dst pixel by every tap's weights at once (columns of (tap, channel) "
              "pairs) and adds the columns into the result pixels the taps reach, 0 the "
              "direct tiles over result channels",
    "col_pixels": "backward data by col2im: diff_dst pixels per block of columns",
    "amx": "bf16 gradients on avx512bf16 (stride 1, or data 1x1): 1 multiplies with "
           "AMX tiles where the CPU has them (the kernel checks), 0 never",
}
EMPTY_PLAN: Mapping[str, int] = MappingProxyType({})


def plan_key(plan: Mapping[str, int] | None) -> str:
    """A short name of a plan: "" for the default, else 8 hex digits of its choices."""
    if not plan:
        return ""
    text = json.dumps(sorted(plan.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def kernel_name(config: KernelConfig, plan: Mapping[str, int] | None = None) -> str:
    """The C name of a kernel: the configuration's, with its plan's key if not default."""
    key = plan_key(plan)
    return f"{config.name}_p{key}" if key else config.name


def check_plan(plan: Mapping[str, int]) -> dict[str, int]:
    """A plan as a plain dict of known choices with integer values (ValueError else)."""
    if not isinstance(plan, Mapping):
        raise ValueError(f"a plan is a mapping of choices to integers; got {plan!r}")
    unknown = sorted(set(plan) - set(PLAN_CHOICES))
    if unknown:
        raise ValueError(f"unknown plan choices {unknown}; expected some of {list(PLAN_CHOICES)}")
    checked = {}
    for name, value in plan.items():
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, int) or value < 0 or (value == 0 and name in (
                "vec_block", "tile_rows", "weight_chunk_kb", "max_slices",
                "step_unroll", "col_pixels")):
            raise ValueError(f"plan choice {name} = {value!r} is invalid")
        checked[name] = value
    return checked
