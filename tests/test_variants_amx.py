"""bf16 kernels that carry the AMX path, on the avx512bf16 ISA path: exact where the CPU
has AMX tiles (the workspace size shows the AMX path ran) and where it has not (the
kernels fall back to their other tiles), and kept off AMX by CONVGRAD_AMX=0. On a CPU
without avx512bf16 their parameter lists are empty and pytest skips them.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import make_case, rotating
from checks import assert_exact
from forcing import HAS_AMX, ISAS, placed

AMX_WEIGHTS = [("ConvolutionBackwardData", "XIO"), ("ConvolutionBackwardData", "OIX"),
               ("ConvolutionBackwardData", "OXI"), ("ConvTransposeBackwardData", "IOX"),
               ("ConvTransposeBackwardData", "XOI"), ("ConvTransposeBackwardData", "IXO")]


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("op,weights_format,strides,channels,data_format", [
    (*row, *layout) for i, row in enumerate(
        [*((op, layout, (1, 1)) for op, layout in AMX_WEIGHTS),
         ("ConvolutionBackwardData", "XIO", (2, 2)), ("ConvolutionBackwardData", "OIX", (1, 3))])
    # without AMX (the kernels fall back) one of the two in turn
    for layout in rotating([((64, 96), "NXC"), ((32, 32), "NCX")], i, 2 if HAS_AMX else 1)])
def test_amx_tiles_pointwise(isa, op, weights_format, strides, channels, data_format):
    """bf16 1x1 data gradients on AMX tiles (channels first through channels-last copies),
    where the CPU has them (else the kernel's other tiles): exact for 1 to 72 pixels
    (blocks of 32 and a zero-padded last block), both weight layouts, strided backward
    data (the result's other pixels zero, on a result first filled with garbage), inputs
    and results at odd offsets, 1 and 2 threads. On a CPU with AMX the workspace is the
    AMX path's (packed weights, one block of input rows, NCX copies), so a silent
    fallback fails; elsewhere it is the other tiles'."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    for spatial, batch in (((1, 1), 1), ((3, 3), 2), ((4, 8), 1), ((5, 7), 2), ((8, 9), 1)):
        case = make_case(op, spatial=spatial, kernel=(1, 1), in_channels=channels[0],
                         out_channels=channels[1], batch=batch, data_format=data_format,
                         weights_format=weights_format, dtype="bf16", seed=21,
                         attrs=dict(strides=list(strides)))
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        reduced = config.cout_per_group if config.family == "bwd_data" else config.cin_per_group
        # packed weights, a block of input rows and (NCX) channels-last copies, each part
        # at a 64-byte boundary
        parts = [reduced * config.vector_channels * 2, 32 * reduced * 2]
        if data_format == "NCX":
            parts += [a.size * 2, int(np.prod(problem.output_shape)) * 2]
        amx_bytes = sum(-(-part // 64) * 64 for part in parts)
        for plan in ({"bf16_dot": 0},):  # the AMX path is the same under either
            kernel = kernels.get_kernel(config, plan)
            other = kernels.get_kernel(config, {**plan, "amx": 0})
            for threads in (1, 2):
                dims = kernels.dims_of(problem, threads)
                size = kernel.workspace_size(dims)
                assert size == (amx_bytes + 64 if HAS_AMX else other.workspace_size(dims))
                workspace = np.empty(size, dtype=np.uint8)
                for in_at, out_at in ((0, 0), (2, 6), (34, 62)):
                    x, y = placed(a, in_at), placed(b, in_at)
                    first, second = (y, x) if problem.swap_inputs else (x, y)
                    out = placed(np.full(problem.output_shape, 7, a.dtype), out_at)
                    kernels.call(kernel, problem, dims, first, second, out, workspace)
                    assert_exact(case, out)


AMX_ROWS_GEOMETRY = {  # stride 1 with taps: pads within and past the kernel's extent
    "3x3": dict(spatial=(5, 7), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1)),
    "3x3 unpadded": dict(spatial=(5, 7), kernel=(3, 3)),
    "dilated": dict(spatial=(6, 9), kernel=(1, 3),
                    attrs=dict(dilations=[1, 2], pads_begin=[0, 2], pads_end=[0, 1])),
    "uneven pads": dict(spatial=(4, 5), kernel=(2, 2), attrs=dict(pads_begin=[1, 0],
                                                                  pads_end=[0, 1])),
    "wide pads": dict(spatial=(4, 4), kernel=(3, 3), attrs=dict(pads_begin=[2, 2],
                                                                pads_end=[0, 1])),
    "pad past extent": dict(spatial=(4, 4), kernel=(3, 3), attrs=dict(pads_begin=[3, 0],
                                                                      pads_end=[1, 0])),
    "1d": dict(spatial=(11,), kernel=(3,), attrs=dict(pads_begin=1, pads_end=2)),
    "3d": dict(spatial=(3, 4, 5), kernel=(1, 3, 3), attrs=dict(pads_begin=[0, 1, 1],
                                                                  pads_end=[0, 1, 1])),
    "tall": dict(spatial=(40, 3), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1)),
}


# taps in depth: a copy of the band per depth tap, planes past the input's depth as
# zeros, dilated and wide pads in depth
AMX_DEPTH_GEOMETRY = {
    "3x3x3": dict(spatial=(3, 4, 5), kernel=(3, 3, 3), attrs=dict(pads_begin=1, pads_end=1)),
    "3x3x3 unpadded": dict(spatial=(4, 4, 5), kernel=(3, 3, 3)),
    "depth dilated": dict(spatial=(5, 3, 4), kernel=(2, 1, 3),
                          attrs=dict(dilations=[2, 1, 1], pads_begin=[3, 0, 1],
                                     pads_end=[0, 0, 1])),
    "depth tall": dict(spatial=(2, 40, 3), kernel=(3, 3, 3),
                       attrs=dict(pads_begin=[2, 1, 1], pads_end=[1, 1, 1])),
}


AMX_STRIDED_GEOMETRY = {  # data gradients with strides: split by phase of the stride
    "3x3 s2": dict(spatial=(7, 9), kernel=(3, 3),
                   attrs=dict(strides=[2, 2], pads_begin=1, pads_end=1)),
    "1x1 s2": dict(spatial=(7, 8), kernel=(1, 1), attrs=dict(strides=[2, 2])),
    "3x3x3 s2": dict(spatial=(5, 4, 7), kernel=(3, 3, 3),
                     attrs=dict(strides=[2, 2, 2], pads_begin=1, pads_end=1)),
    "uneven": dict(spatial=(9, 11), kernel=(2, 4),
                   attrs=dict(strides=[3, 2], pads_begin=[2, 1], pads_end=[0, 3])),
    "dilated s2": dict(spatial=(9, 10), kernel=(3, 2),
                       attrs=dict(strides=[2, 2], dilations=[2, 3], pads_begin=[2, 3],
                                  pads_end=[1, 0])),
    "stride past kernel": dict(spatial=(6, 13), kernel=(2, 2),
                               attrs=dict(strides=[3, 4], pads_begin=[0, 5])),
    "tall s2": dict(spatial=(80, 5), kernel=(3, 3),
                    attrs=dict(strides=[2, 2], pads_begin=1, pads_end=1)),
}


def _amx_cases(geometries, layouts):
    """Each geometry with one of the op and weight layout pairs, every pair in turn, and
    channels last or first (through channels-last copies) in turn. Without AMX, every
    other case: the kernels then run their other tiles, which the rest of the suite
    covers, and these cases check only that the kernels that carry AMX fall back."""
    cases = [(name, *layouts[k % len(layouts)], ("NXC", "NCX")[k // len(layouts) % 2])
             for k, name in enumerate(sorted(geometries))]
    return cases if HAS_AMX else cases[::2]


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("geometry,op,weights_format,data_format", [
    *_amx_cases({**AMX_ROWS_GEOMETRY, **AMX_DEPTH_GEOMETRY}, AMX_WEIGHTS),
    # strides: each geometry for both ops
    *_amx_cases({name: geometry for name, geometry in AMX_STRIDED_GEOMETRY.items()
                 if name != "1x1 s2"}, AMX_WEIGHTS[:3]),  # as test_amx_tiles_pointwise
    *_amx_cases(AMX_STRIDED_GEOMETRY, AMX_WEIGHTS[3:])])
def test_amx_tiles_data(isa, op, weights_format, data_format, geometry):
    """bf16 channels-last data gradients with taps on AMX tiles, where the CPU has them:
    bands of rows copied with zero borders (several bands: "tall"), the outputs past the
    width dropped, both weight layouts (OIX value by value), 1 and 2 threads, a result
    first filled with garbage. Taps in depth: a copy per depth tap. Strides: the forward
    op's copies hold the input by phase of the stride (only the phases a tap reads);
    backward data's result goes phase by phase, each over its own taps (none: zeros,
    "stride past kernel"), from one copy of diff_dst's rows. Backward data with stride 1
    and a pad past the kernel's extent takes the other tiles; on a CPU with AMX every
    other call takes the AMX path (its workspace differs from the other tiles')."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    geometries = {**AMX_ROWS_GEOMETRY, **AMX_DEPTH_GEOMETRY, **AMX_STRIDED_GEOMETRY}
    for batch in (1, 3):
        case = make_case(op, **geometries[geometry], in_channels=64, out_channels=32,
                         batch=batch, data_format=data_format, weights_format=weights_format,
                         dtype="bf16", seed=22)
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        kernel = kernels.get_kernel(config, {"bf16_dot": 0})
        other = kernels.get_kernel(config, {"bf16_dot": 0, "amx": 0})
        for threads in (1, 2):
            dims = kernels.dims_of(problem, threads)
            size, other_size = kernel.workspace_size(dims), other.workspace_size(dims)
            assert (size != other_size) == (HAS_AMX and not (
                geometry == "pad past extent" and op == "ConvolutionBackwardData"))
            workspace = np.empty(size, dtype=np.uint8)
            first, second = (b, a) if problem.swap_inputs else (a, b)
            out = np.full(problem.output_shape, 7, a.dtype)
            kernels.call(kernel, problem, dims, first, second, out, workspace)
            assert_exact(case, out)


AMX_WEIGHT_GEOMETRY = {**AMX_ROWS_GEOMETRY, **AMX_DEPTH_GEOMETRY,
                       **{name: geometry for name, geometry in AMX_STRIDED_GEOMETRY.items()
                          if name not in ("1x1 s2", "tall s2")},  # as "1x1 strided", "tall"
                       "1x1": dict(spatial=(5, 7), kernel=(1, 1)),
                       "1x1 strided": dict(spatial=(7, 10), kernel=(1, 1),
                                           attrs=dict(strides=[2, 3])),
                       "many bands": dict(spatial=(70, 40), kernel=(3, 3),
                                          attrs=dict(pads_begin=1, pads_end=1))}


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("geometry,op,weights_format,data_format", _amx_cases(
    AMX_WEIGHT_GEOMETRY, [("ConvolutionBackwardWeights", "XIO"),
                          ("ConvolutionBackwardWeights", "OIX"),
                          ("ConvolutionBackwardWeights", "OXI"),
                          ("ConvTransposeBackwardWeights", "IOX"),
                          ("ConvTransposeBackwardWeights", "XOI"),
                          ("ConvTransposeBackwardWeights", "IXO")]))
def test_amx_tiles_weights(isa, op, weights_format, data_format, geometry):
    """bf16 channels-last weight gradients on AMX tiles, where the CPU has them: bands of
    whole images (one or several per band) or of rows ("tall", "many bands"), src copied
    channels first with zero borders (by phase of the stride, only the phases a tap
    reads; taps in depth: a copy per depth tap), diff_dst as pixel pairs (odd
    row widths: pairs across rows), 1 to 3 threads (threads split the input or the output
    channels), both weight layouts. On a CPU with AMX every call takes the AMX path (its
    workspace differs from the other tiles')."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    for batch, channels in ((1, (64, 32)), (3, (32, 96))):
        case = make_case(op, **AMX_WEIGHT_GEOMETRY[geometry], in_channels=channels[0],
                         out_channels=channels[1], batch=batch, data_format=data_format,
                         weights_format=weights_format, dtype="bf16", seed=24)
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        kernel = kernels.get_kernel(config, {"bf16_dot": 0})
        other = kernels.get_kernel(config, {"bf16_dot": 0, "amx": 0})
        for threads in (1, 2, 3):
            dims = kernels.dims_of(problem, threads)
            size = kernel.workspace_size(dims)
            assert (size != other.workspace_size(dims)) == HAS_AMX
            first, second = (b, a) if problem.swap_inputs else (a, b)
            out = np.full(problem.output_shape, 7, a.dtype)
            kernels.call(kernel, problem, dims, first, second, out,
                         np.empty(size, dtype=np.uint8))
            assert_exact(case, out)


AMX_PATCH_GEOMETRY = {  # forward convolutions over few input channels: patches
    "7x7 s2": dict(spatial=(13, 11), kernel=(7, 7),
                   attrs=dict(strides=[2, 2], pads_begin=3, pads_end=3)),
    "3x3 s2": dict(spatial=(9, 8), kernel=(3, 3),
                   attrs=dict(strides=[2, 2], pads_begin=1, pads_end=1)),
    "dilated": dict(spatial=(8, 10), kernel=(2, 3),
                    attrs=dict(dilations=[2, 2], pads_begin=[1, 2], pads_end=[0, 1])),
    "uneven pads": dict(spatial=(6, 7), kernel=(3, 2),
                        attrs=dict(strides=[1, 3], pads_begin=[2, 0], pads_end=[0, 4])),
    "1d": dict(spatial=(19,), kernel=(5,), attrs=dict(pads_begin=2, pads_end=2)),
    "3d": dict(spatial=(3, 5, 6), kernel=(2, 3, 3),
               attrs=dict(strides=[1, 2, 2], pads_begin=[1, 1, 1], pads_end=[0, 1, 1])),
    "1x1": dict(spatial=(5, 7), kernel=(1, 1)),
    "many bands": dict(spatial=(46, 30), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1)),
}


def _runs_its_amx_layout(case, problem, config, plan, parts):
    """Runs `case`'s kernel of `plan` (on the ISA path of `config`) on 1 to 3 threads,
    each result exact, into a result first filled with garbage. On a CPU with AMX the
    workspace is the AMX path's layout, `parts` (base, per thread) pairs of bytes for a
    call that wakes `used` threads: base + used x per thread each, to a 64-byte boundary,
    and the block's alignment on top (a small call wakes fewer), so a silent fallback
    fails; elsewhere it is the kernel without AMX's."""
    from convgrad import kernels

    a, b = case.inputs[:2]
    kernel = kernels.get_kernel(config, plan)
    other = kernels.get_kernel(config, {**plan, "amx": 0})
    for threads in (1, 2, 3):
        dims = kernels.dims_of(problem, threads)
        size = kernel.workspace_size(dims)
        amx_bytes = {sum(-(-(base + used * each) // 64) * 64 for base, each in parts) + 64
                     for used in range(1, threads + 1)}
        assert size in amx_bytes if HAS_AMX else size == other.workspace_size(dims)
        first, second = (b, a) if problem.swap_inputs else (a, b)
        out = np.full(problem.output_shape, 7, a.dtype)
        kernels.call(kernel, problem, dims, first, second, out, np.empty(size, np.uint8))
        assert_exact(case, out)


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("geometry,weights_format,channels,data_format", [
    (name, ("IOX", "XOI", "IXO")[k % 3], ((3, 64), (1, 32), (4, 96), (15, 32))[k % 4],
     ("NXC", "NCX")[k // 2 % 2]) for k, name in enumerate(sorted(AMX_PATCH_GEOMETRY))])
def test_amx_tiles_patches(isa, geometry, weights_format, channels, data_format):
    """bf16 forward convolutions over 1 to 15 input channels on AMX tiles, where the CPU
    has them (channels first through channels-last copies, a pixel at a time for so few
    channels): each output pixel's patch (its taps' input values, zeros where a tap
    reads past the input, then zeros up to whole multiplies) copied a band of output
    pixels at a time, blocks across rows and images ("many bands": several bands an
    image, a last band's partial block), all three weight layouts, 1 to 3 threads, a
    result first filled with garbage. On a CPU with AMX the workspace is the patches'
    (packed weights, one band per thread it wakes, NCX copies), so a silent fallback fails;
    elsewhere it is the other tiles'."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_amx import AMX_PATCH_PIXELS

    cin, cout = channels
    patch = -(-cin * int(np.prod(AMX_PATCH_GEOMETRY[geometry]["kernel"])) // 32) * 32
    for batch in (1, 3):
        case = make_case("ConvTransposeBackwardData", **AMX_PATCH_GEOMETRY[geometry],
                         in_channels=cout, out_channels=cin, batch=batch,
                         data_format=data_format, weights_format=weights_format,
                         dtype="bf16", seed=25)
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        assert (config.family, config.cin_per_group, config.cout_per_group) == ("fwd", cin,
                                                                                cout)
        # packed weights, one band of patches per thread, NCX copies
        copies = [(a.size * 2, 0), (int(np.prod(problem.output_shape)) * 2, 0)]
        _runs_its_amx_layout(case, problem, config, {"bf16_dot": 0}, [
            (cout * patch * 2, 0), (0, AMX_PATCH_PIXELS * patch * 2),
            *(copies if data_format == "NCX" else [])])


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("geometry,op,weights_format,channels,data_format", [
    (name, *(("ConvolutionBackwardWeights", "XIO"), ("ConvolutionBackwardWeights", "OIX"),
             ("ConvolutionBackwardWeights", "OXI"), ("ConvTransposeBackwardWeights", "IOX"))[k % 4],
     ((3, 64), (1, 32), (4, 96), (15, 32))[k % 4], ("NXC", "NCX")[k // 2 % 2])
    for k, name in enumerate(sorted(AMX_PATCH_GEOMETRY))])
def test_amx_tiles_patch_weights(isa, geometry, op, weights_format, channels, data_format):
    """bf16 weight gradients over 1 to 15 input channels on AMX tiles, where the CPU has
    them: each band of 256 output pixels' patches of src (channels first through
    channels-last copies) as pixel pairs and diff_dst channels first, 2 x 2 tiles a block
    of 32 output channels x 32 patch values, the bands' sums added in f32 ("many bands",
    a last band's pixels past the output zero), each share filling the rows of taps its
    blocks read (1 to 3 threads), all weight layouts, weights first filled with garbage.
    On a CPU with AMX the workspace is the patches' (sums, each share's patches, pairs
    and diff_dst rows, NCX copies), so a silent fallback fails."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.rules_amx import AMX_PATCH_WEIGHT_PIXELS as BAND

    cin, cout = channels
    patch = -(-cin * int(np.prod(AMX_PATCH_GEOMETRY[geometry]["kernel"])) // 32) * 32
    for batch in (1, 3):
        # the ConvTranspose op's channels are its own: its src is the forward's diff_dst
        ic, oc = (cin, cout) if op == "ConvolutionBackwardWeights" else (cout, cin)
        case = make_case(op, **AMX_PATCH_GEOMETRY[geometry], in_channels=ic, out_channels=oc,
                         batch=batch, data_format=data_format, weights_format=weights_format,
                         dtype="bf16", seed=28)
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        assert (config.family, config.cin_per_group, config.cout_per_group) == (
            "bwd_weights", cin, cout)
        # the sums, each share's patches and pairs, its diff_dst rows, NCX copies
        copies = [(a.size * 2, 0), (b.size * 2, 0)] if data_format == "NCX" else []
        _runs_its_amx_layout(case, problem, config, {"bf16_dot": 0}, [
            (cout * patch * 4, 0), (0, 2 * BAND * patch * 2), (0, cout * BAND * 2), *copies])


AMX_COLUMN_GEOMETRY = {  # backward data with few result channels: columns by AMX
    "7x7 s2": dict(spatial=(11, 9), kernel=(7, 7),
                   attrs=dict(strides=[2, 2], pads_begin=3, pads_end=3, output_padding=1)),
    "3x3 s2": dict(spatial=(5, 40), kernel=(3, 3),
                   attrs=dict(strides=[2, 2], pads_begin=1, pads_end=1)),
    "dilated": dict(spatial=(6, 35), kernel=(2, 3),
                    attrs=dict(dilations=[2, 2], pads_begin=[1, 2], pads_end=[0, 1])),
    "1d": dict(spatial=(70,), kernel=(7,), attrs=dict(pads_begin=2, pads_end=2)),
    "3d": dict(spatial=(2, 3, 33), kernel=(2, 3, 3),
               attrs=dict(strides=[1, 2, 2], pads_begin=[1, 1, 1], pads_end=[0, 1, 1])),
}


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("geometry,weights_format,channels,col_pixels", [
    (name, ("XIO", "OIX", "OXI")[k % 3], ((3, 64), (4, 32), (7, 96))[k % 3],
     (32, 16, 64)[k % 3]) for k, name in enumerate(sorted(AMX_COLUMN_GEOMETRY))])
def test_amx_tiles_col2im(isa, geometry, weights_format, channels, col_pixels):
    """bf16 channels-last backward data with 3 to 7 result channels (col2im) on AMX
    tiles, where the CPU has them: each block of diff_dst pixels times every (tap,
    result channel) column in whole blocks of 32 (rows of 33-70 pixels: a short last
    block from a zero-padded copy), the columns added into the result in f32, all three
    weight layouts, blocks of 16, 32 and 64 pixels, 1 to 3 threads, a result first
    filled with garbage. On a CPU with AMX the workspace is the AMX columns' (packed
    weights, the f32 result and each share's columns), so a silent fallback fails."""
    from convgrad.codegen.ops import resolve
    from convgrad.codegen.variants import resolve_plan

    cin, cout = channels
    taps = int(np.prod(AMX_COLUMN_GEOMETRY[geometry]["kernel"]))
    columns = -(-taps * cin // 32) * 32
    rows = -(-col_pixels // 32) * 32
    for batch in (1, 2):
        case = make_case("ConvolutionBackwardData", **AMX_COLUMN_GEOMETRY[geometry],
                         in_channels=cin, out_channels=cout, batch=batch,
                         weights_format=weights_format, dtype="bf16", seed=27)
        a, b = case.inputs[:2]
        problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
        config = problem.config.with_isa(isa)
        plan = {"bf16_dot": 0, "col2im": 1, "col_pixels": col_pixels}
        assert resolve_plan(config, plan).variant.value == "col2im.c.j2"
        # packed weights; the f32 result, then each share's columns and padded rows
        result = -(-int(np.prod(problem.output_shape)) * 4 // 64) * 64
        share = (rows * columns + 32 * cout // 2) * 4
        _runs_its_amx_layout(case, problem, config, plan,
                             [(cout * columns * 2, 0), (result, share)])


AMX_OFF_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
from cases import make_case
from checks import assert_exact
from convgrad import kernels
from convgrad.codegen.ops import resolve
case = make_case("ConvolutionBackwardData", spatial=(5, 7), kernel=(1, 1), in_channels=64,
                 out_channels=32, batch=2, dtype="bf16", seed=23)
a, b = case.inputs[:2]
problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
config = problem.config.with_isa("avx512bf16")
kernel = kernels.get_kernel(config, {{}})
dims = kernels.dims_of(problem, 2)
size = kernel.workspace_size(dims)
assert size == kernels.get_kernel(config, {{"amx": 0}}).workspace_size(dims), size
out = np.empty(problem.output_shape, a.dtype)
first, second = (b, a) if problem.swap_inputs else (a, b)
kernels.call(kernel, problem, dims, first, second, out, np.empty(size, np.uint8))
assert_exact(case, out)
print("ok")
"""


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
def test_amx_off_by_environment(isa):
    """CONVGRAD_AMX=0 keeps kernels that carry AMX on their other tiles (the benchmark
    sets it where it limits oneDNN below AMX): in a child process, the workspace is the
    other tiles' and the result exact."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = AMX_OFF_CHILD.format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "CONVGRAD_AMX": "0"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
