"""The shape and padding rules of the six ops, once, for every front end.

`convgrad.codegen.resolve` (the numpy API, convgrad.jax, the AOT command) validates a
call and then works out its sizes with these functions; convgrad.torch's fake
implementations, autograd formulas, stand-ins and functional API use them directly.

Notation of one spatial axis: a forward convolution reads `size` (Y) inputs with a
kernel of `k` taps, dilation `d`, stride `s` and pads `pb`/`pe`, and gives X outputs;
a transposed convolution maps X back to Y (plus `output_padding`).

Most functions are plain arithmetic (+, -, *, // and slicing, no comparison, no
int()), so that they also work on torch's SymInts while torch.compile traces dynamic
shapes. The ones that compare values (`tf_same_pads`, `transposed_same_pads`) say so
and are only called with concrete integers.

Layouts are named as in docs/semantics.md: data "NCX" (N, C, spatial...) or "NXC"
(N, spatial..., C); weights "OIX" (O, I/g, k...), "XIO" (k..., I/g, O) and "OXI"
(O, k..., I/g), in the forward problem's terms, or their ConvTranspose spellings
"IOX", "XOI" and "IXO", which place the axes alike.
"""

from __future__ import annotations

from collections.abc import Sequence

DATA_FORMATS = ("NCX", "NXC")
WEIGHTS_FORMATS = ("OIX", "XIO", "OXI", "IOX", "XOI", "IXO")
_SPATIAL_FIRST = ("XIO", "XOI")
_SPATIAL_INNER = ("OXI", "IXO")


# --- one axis -------------------------------------------------------------------------

def extent(k, d):
    """The dilated kernel extent of `k` taps at dilation `d`: d * (k - 1) + 1."""
    return d * (k - 1) + 1


def conv_output_size(size, extent, stride, pb, pe):
    """Outputs of a forward convolution over `size` inputs, kernel extent `extent`
    (see `extent`) and pads `pb`/`pe`: (size + pb + pe - extent) // stride + 1 (may be
    <= 0 where the padded input is shorter than the kernel)."""
    return (size + pb + pe - extent) // stride + 1


def transposed_output_size(size, extent, stride, pb, pe, output_padding=0):
    """The size of a transposed convolution of `size` inputs (torch's conv_transpose,
    docs/semantics.md rule 1): stride * (size - 1) + extent - pb - pe + output_padding (may
    be <= 0 where the pads exceed it)."""
    return stride * (size - 1) + extent - pb - pe + output_padding


def fit_pad_end(outputs, size, extent, stride, pb):
    """The pads_end that makes a forward convolution over `size` inputs with pads_begin
    `pb` give exactly `outputs` outputs (its last window ending at the last padded
    position): stride * (outputs - 1) + extent - size - pb. Negative where `size` has
    more trailing positions than any window reads; that many can be dropped instead."""
    return stride * (outputs - 1) + extent - size - pb


def tf_same_pads(size: int, extent: int, stride: int, upper: bool) -> tuple[int, int]:
    """(pads_begin, pads_end) of TensorFlow-style SAME padding of `size` inputs
    (auto_pad same_upper/same_lower, docs/semantics.md): ceil(size / stride) outputs, the
    odd pad at the end (`upper`) or at the beginning. Compares values: concrete
    integers only."""
    total = max(extent - (size % stride if size % stride else stride), 0)
    begin = total // 2 if upper else (total + 1) // 2
    return begin, total - begin


def transposed_same_pads(outputs: int, size: int, extent: int, stride: int,
                         output_padding: int, upper: bool) -> tuple[int, int]:
    """(pads_begin, pads_end) of ConvolutionBackpropData's auto_pad same_upper/same_lower
    with an output_shape (docs/semantics.md rule 1): the pads that crop the transposed
    convolution of `outputs` inputs to `size`, the odd one at the beginning (`upper`,
    as ONNX's ConvTranspose crops) or at the end. Compares values: concrete integers
    only."""
    total = max(stride * (outputs - 1) + extent - size + output_padding, 0)
    end = total // 2 if upper else total - total // 2
    return total - end, end


# --- every spatial axis ----------------------------------------------------------------

def conv_output_spatial(size: Sequence, kernel: Sequence, strides: Sequence,
                        dilations: Sequence, pads_begin: Sequence,
                        pads_end: Sequence) -> list:
    """`conv_output_size` of each spatial axis: the forward convolution's result sizes."""
    return [conv_output_size(y, extent(k, d), s, pb, pe) for y, k, s, d, pb, pe in
            zip(size, kernel, strides, dilations, pads_begin, pads_end, strict=True)]


def transposed_output_spatial(size: Sequence, kernel: Sequence, strides: Sequence,
                              dilations: Sequence, pads_begin: Sequence, pads_end: Sequence,
                              output_padding: Sequence | None = None) -> list:
    """`transposed_output_size` of each spatial axis (output_padding 0 when None)."""
    if output_padding is None:
        output_padding = [0] * len(size)
    return [transposed_output_size(x, extent(k, d), s, pb, pe, p)
            for x, k, s, d, pb, pe, p in zip(size, kernel, strides, dilations, pads_begin,
                                             pads_end, output_padding, strict=True)]


def fit_pads_end(outputs: Sequence, size: Sequence, kernel: Sequence, strides: Sequence,
                 dilations: Sequence, pads_begin: Sequence) -> list:
    """`fit_pad_end` of each spatial axis (values may be negative)."""
    return [fit_pad_end(x, y, extent(k, d), s, pb) for x, y, k, s, d, pb in
            zip(outputs, size, kernel, strides, dilations, pads_begin, strict=True)]


def torch_same_pads(kernel: Sequence, dilations: Sequence) -> tuple[list, list]:
    """(pads_begin, pads_end) of torch.nn.functional's padding="same" (stride 1 only):
    d * (k - 1) in all, the odd one at the end. At stride 1 this is `tf_same_pads`'s
    same_upper, without reading the input size."""
    totals = [extent(k, d) - 1 for k, d in zip(kernel, dilations, strict=True)]
    return [t // 2 for t in totals], [t - t // 2 for t in totals]


# --- layouts ---------------------------------------------------------------------------

def split_data(shape: Sequence, data_format: str = "NCX") -> tuple:
    """(N, C, spatial) of a data shape in `data_format` (spatial a tuple)."""
    if data_format == "NXC":
        return shape[0], shape[-1], tuple(shape[1:-1])
    return shape[0], shape[1], tuple(shape[2:])


def join_data(n, c, spatial: Sequence, data_format: str = "NCX") -> tuple:
    """The data shape of (N, C, spatial) in `data_format`."""
    return (n, *spatial, c) if data_format == "NXC" else (n, c, *spatial)


def split_weights(shape: Sequence, weights_format: str = "OIX") -> tuple:
    """(outer, inner, kernel) of a weights shape in `weights_format`: (O, I/g, kernel)
    in the forward problem's terms for OIX/XIO/OXI; for the ConvTranspose spellings
    IOX/XOI/IXO, torch's (IC, OC/g, kernel) of its ConvTranspose weight, which is the
    (O, I/g, kernel) of the forward convolution a ConvTranspose's data gradient runs."""
    if weights_format in _SPATIAL_FIRST:
        return shape[-1], shape[-2], tuple(shape[:-2])
    if weights_format in _SPATIAL_INNER:
        return shape[0], shape[-1], tuple(shape[1:-1])
    return shape[0], shape[1], tuple(shape[2:])


def join_weights(outer, inner, kernel: Sequence, weights_format: str = "OIX") -> tuple:
    """The weights shape of (outer, inner, kernel) in `weights_format` (see split_weights)."""
    if weights_format in _SPATIAL_FIRST:
        return (*kernel, inner, outer)
    if weights_format in _SPATIAL_INNER:
        return (outer, *kernel, inner)
    return (outer, inner, *kernel)


# --- the ops ---------------------------------------------------------------------------

def result_shape(family: str, transpose: bool, first: Sequence, second: Sequence, shape,
                 strides: Sequence, pads_begin: Sequence, pads_end: Sequence,
                 dilations: Sequence, groups, output_padding: Sequence | None = None,
                 data_format: str = "NCX", weights_format: str = "OIX") -> tuple:
    """The result shape of an op of `family` ("bwd_data", "fwd" or "bwd_weights";
    `transpose` for ConvTransposeBackwardWeights) with explicit pads, from the shapes of
    its two data inputs in the op's order and its shape input `shape` (the result's
    spatial sizes or full shape for bwd_data, None to compute them; the kernel's spatial
    sizes or the full weights shape for bwd_weights; ignored for fwd). The defaults are
    torch's logical layouts: data (N, C, spatial...), weights (OC, IC/g, k...) or, read
    alike, ConvTranspose's (IC, OC/g, k...).

    Validates nothing (that is `resolve`'s work): plain arithmetic on the sizes, so
    that a call resolve accepts gets resolve's shape, also with SymInts."""
    rank = len(first) - 2
    n, c_first, spatial_first = split_data(first, data_format)
    if family == "bwd_data":  # first: diff_dst (N, OC, X...), second: (OC, IC/g, k...)
        _, in_per_group, kernel = split_weights(second, weights_format)
        if shape is None:
            spatial = transposed_output_spatial(spatial_first, kernel, strides, dilations,
                                                pads_begin, pads_end, output_padding)
        elif len(shape) == rank:
            spatial = tuple(shape)
        else:
            spatial = split_data(shape, data_format)[2]
        return join_data(n, in_per_group * groups, spatial, data_format)
    if family == "fwd":  # first: (N, C, Y...), second: (O, C/g, k...)
        outer, _, kernel = split_weights(second, weights_format)
        spatial = conv_output_spatial(spatial_first, kernel, strides, dilations, pads_begin,
                                      pads_end)
        return join_data(n, outer, spatial, data_format)
    # weight gradients: first src, second diff_dst; ConvTranspose's the roles swapped
    kernel = tuple(shape) if len(shape) == rank else split_weights(shape, weights_format)[2]
    c_second = split_data(second, data_format)[1]
    if transpose:  # (IC, OC/g, k...)
        return join_weights(c_first, c_second // groups, kernel, weights_format)
    return join_weights(c_second, c_first // groups, kernel, weights_format)  # (OC, IC/g, k...)
