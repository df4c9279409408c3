"""The six ops of docs/semantics.md: names, attributes, shape and padding rules.

``resolve`` is the one place where attributes are validated, pads are computed
and shapes are inferred. It works on integers only (no arrays), so the runtime,
the AOT command and ``infer_shape`` share it. Its arithmetic is that of
``convgrad.codegen.shapes``, which the front ends (convgrad.torch's fake
implementations and autograd formulas, convgrad.jax's transposes) call too.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from functools import cached_property

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.rules_problem import swaps_operands
from convgrad.codegen.shapes import (
    conv_output_spatial,
    extent,
    join_data,
    join_weights,
    split_data,
    split_weights,
    tf_same_pads,
    transposed_output_spatial,
    transposed_same_pads,
)

# Sizes, pads and strides are passed to C as int64 and multiplied there; bounding
# them keeps every index computation far from overflow.
MAX_EXTENT = 2**31 - 1


@dataclass(frozen=True)
class OpSpec:
    """How one op kind maps onto a kernel family."""

    kind: str
    function: str  # name of the Python function in `runtime`
    family: str
    inputs: tuple[str, str]  # names of the two data inputs, in call order
    output: str
    shape_name: str | None  # shape input/attribute name, None if the op has none
    weights_attr: str  # "filter_format" or "weights_format"
    transpose: bool  # a ConvTranspose op (weights IOX/XOI)

    @property
    def has_output_padding(self) -> bool:
        return self.family != "bwd_weights"

    @cached_property
    def attributes(self) -> tuple[str, ...]:
        names = ["strides", "pads_begin", "pads_end", "dilations", "auto_pad", "groups",
                 "data_format", self.weights_attr]
        if self.has_output_padding:
            names.append("output_padding")
        if self.shape_name:
            names.append(self.shape_name)
        return tuple(names)

    @property
    def weights_formats(self) -> tuple[str, str, str]:
        """(torch's layout, the default, torch's channels_last layout)."""
        return ("IOX", "XOI", "IXO") if self.transpose else ("OIX", "XIO", "OXI")

    @property
    def defaults(self) -> dict:
        """Every attribute's value when it is not given (docs/semantics.md)."""
        values = {**ATTRIBUTE_DEFAULTS, self.weights_attr: self.weights_formats[1]}
        if self.shape_name:
            values[self.shape_name] = None
        return {name: values[name] for name in self.attributes}


# A ConvTranspose op's weights formats place the axes as the forward convolution's do:
# its IOX, XOI and IXO weights are the OIX, XIO and OXI of the convolution it runs.
FORWARD_WEIGHTS_FORMAT = {"IOX": "OIX", "XOI": "XIO", "IXO": "OXI"}
TRANSPOSE_WEIGHTS_FORMAT = {fwd: op for op, fwd in FORWARD_WEIGHTS_FORMAT.items()}

ATTRIBUTE_DEFAULTS = {"strides": 1, "pads_begin": 0, "pads_end": 0, "dilations": 1,
                      "auto_pad": "none", "output_padding": 0, "groups": 1,
                      "data_format": "NXC"}


OPS: dict[str, OpSpec] = {
    spec.kind: spec
    for spec in (
        OpSpec("ConvolutionBackpropData", "convolution_backprop_data", "bwd_data",
               ("output_delta", "filter"), "input_delta", "output_shape", "filter_format", False),
        OpSpec("ConvolutionBackwardData", "convolution_backward_data", "bwd_data",
               ("diff_dst", "weights"), "diff_src", "dst_shape", "weights_format", False),
        OpSpec("ConvolutionBackpropFilters", "convolution_backprop_filters", "bwd_weights",
               ("input_forward", "output_delta"), "filter_delta", "filter_shape",
               "filter_format", False),
        OpSpec("ConvolutionBackwardWeights", "convolution_backward_weights", "bwd_weights",
               ("src", "diff_dst"), "diff_weights", "weights_shape", "weights_format", False),
        OpSpec("ConvTransposeBackwardData", "conv_transpose_backward_data", "fwd",
               ("diff_dst", "weights"), "diff_src", None, "weights_format", True),
        OpSpec("ConvTransposeBackwardWeights", "conv_transpose_backward_weights",
               "bwd_weights", ("src", "diff_dst"), "diff_weights", "weights_shape",
               "weights_format", True),
    )
}

AUTO_PAD = {"none": "none", "explicit": "none", "": "none", "same_upper": "same_upper",
            "same_lower": "same_lower", "valid": "valid"}


@dataclass(frozen=True)
class Problem:
    """A fully resolved call: the kernel to run and its run-time arguments.

    ``src_spatial``/``dst_spatial``/``pads_begin`` are in the terms of the kernel's
    forward-convolution problem; ``swap_inputs`` is set when the op's first data
    input is the kernel's second argument (ConvTransposeBackwardWeights, and weight
    gradients run with their inputs swapped: rules_problem.swaps_operands), and
    ``operands_swapped`` when the kernel is that of the problem with the inputs swapped.
    """

    op: OpSpec
    config: KernelConfig
    batch: int
    src_spatial: tuple[int, ...]
    dst_spatial: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    output_shape: tuple[int, ...]
    swap_inputs: bool = False
    operands_swapped: bool = False

    @property
    def multiply_adds(self) -> int:
        """The op's multiply-adds at this batch (taps that hit padding count)."""
        c = self.config
        count = self.batch * c.groups * c.cin_per_group * c.cout_per_group
        for x, k in zip(self.dst_spatial, c.kernel, strict=True):
            count *= x * k
        return count


def _fail(op: str, what: str, value, expected: str, error=ValueError):
    raise error(f"{op}: {what} = {value!r} is invalid; expected {expected}")


def _integer(op: str, name: str, value) -> int:
    if isinstance(value, bool | str):
        _fail(op, name, value, "an integer", TypeError)
    try:
        return operator.index(value)
    except TypeError:
        _fail(op, name, value, "an integer", TypeError)


def _is_sequence(value) -> bool:
    # Duck-typed so that tuples, lists and 1-D arrays all qualify (no numpy here);
    # dicts and sets iterate too, but have no order of axes.
    return not isinstance(value, str | bytes | Mapping | Set) and hasattr(value, "__len__") \
        and hasattr(value, "__iter__")


def _int_list(op: str, name: str, value) -> list[int]:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        value = value.tolist()
    if not _is_sequence(value):
        _fail(op, name, value, "a sequence of integers", TypeError)
    return [_integer(op, name, v) for v in value]


def _per_axis(op: str, name: str, value, rank: int, minimum: int) -> tuple[int, ...]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if _is_sequence(value):
        values = _int_list(op, name, value)
        if len(values) != rank:
            _fail(op, name, value, f"{rank} values, one per spatial axis")
    else:
        values = [_integer(op, name, value)] * rank
    for v in values:
        if not minimum <= v <= MAX_EXTENT:
            _fail(op, name, value, f"values in [{minimum}, {MAX_EXTENT}]")
    return tuple(values)


def _choice(op: str, name: str, value, allowed: Sequence[str]) -> str:
    if not isinstance(value, str):
        _fail(op, name, value, f"one of {list(allowed)}", TypeError)
    if value not in allowed:  # formats are case-sensitive; only auto_pad is not
        _fail(op, name, value, f"one of {list(allowed)}")
    return value


@dataclass(frozen=True)
class _Attrs:
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    auto_pad: str
    output_padding: tuple[int, ...]
    groups: int
    data_format: str
    weights_format: str  # as the user named it (IOX/XOI for ConvTranspose)


def _normalize(spec: OpSpec, attrs: Mapping, rank: int) -> _Attrs:
    op = spec.kind
    unknown = sorted(set(attrs) - set(spec.attributes), key=repr)
    if unknown:
        _fail(op, "attribute", unknown[0], f"one of {list(spec.attributes)}")
    given = {**spec.defaults, **attrs}
    auto_pad = given["auto_pad"]
    if not isinstance(auto_pad, str):
        _fail(op, "auto_pad", auto_pad, f"one of {sorted(AUTO_PAD)}", TypeError)
    if auto_pad.lower() not in AUTO_PAD:
        _fail(op, "auto_pad", auto_pad, "none, explicit, same_upper, same_lower or valid")
    strides = _per_axis(op, "strides", given["strides"], rank, 1)
    dilations = _per_axis(op, "dilations", given["dilations"], rank, 1)
    output_padding = _per_axis(op, "output_padding", given.get("output_padding", 0), rank, 0)
    for axis, (p, s, d) in enumerate(zip(output_padding, strides, dilations, strict=True)):
        if p >= max(s, d):
            _fail(op, "output_padding", list(output_padding),
                  f"each value below the stride or the dilation of its axis "
                  f"(axis {axis}: stride {s}, dilation {d})")
    groups = _integer(op, "groups", given["groups"])
    if not 1 <= groups <= MAX_EXTENT:
        _fail(op, "groups", groups, "a positive integer")
    return _Attrs(
        strides=strides,
        dilations=dilations,
        pads_begin=_per_axis(op, "pads_begin", given["pads_begin"], rank, 0),
        pads_end=_per_axis(op, "pads_end", given["pads_end"], rank, 0),
        auto_pad=AUTO_PAD[auto_pad.lower()],
        output_padding=output_padding,
        groups=groups,
        data_format=_choice(op, "data_format", given["data_format"], ("NXC", "NCX")),
        weights_format=_choice(op, spec.weights_attr, given[spec.weights_attr],
                               spec.weights_formats),
    )


class _Layout:
    """Splits and joins tensor shapes in the user's formats (shapes.split_data and
    friends), checking ranks and sizes."""

    def __init__(self, spec: OpSpec, attrs: _Attrs, rank: int):
        self.op = spec.kind
        self.rank = rank
        self.data_format = attrs.data_format
        # Weights in forward-problem terms: (O, I/g, k...), (k..., I/g, O) or (O, k..., I/g).
        self.weights_format = attrs.weights_format

    def split_data(self, name: str, shape: Sequence[int]) -> tuple[int, int, tuple[int, ...]]:
        if len(shape) != self.rank + 2:
            _fail(self.op, f"{name} rank", len(shape), f"{self.rank + 2} (the data rank)")
        n, c, spatial = split_data(shape, self.data_format)
        if c == 0 or 0 in spatial:
            _fail(self.op, f"{name} shape", tuple(shape),
                  "non-zero channel and spatial dimensions")
        return n, c, spatial

    def join_data(self, n: int, c: int, spatial: Sequence[int]) -> tuple[int, ...]:
        return join_data(n, c, spatial, self.data_format)

    def split_weights(self, name: str, shape: Sequence[int]) -> tuple[int, int, tuple[int, ...]]:
        """(O, I/g, kernel) of a weights shape, in the forward problem's terms."""
        if len(shape) != self.rank + 2:
            _fail(self.op, f"{name} rank", len(shape), f"{self.rank + 2} (the data rank)")
        o, i_g, kernel = split_weights(shape, self.weights_format)
        if 0 in shape:
            _fail(self.op, f"{name} shape", tuple(shape), "no zero-sized dimension")
        return o, i_g, kernel

    def join_weights(self, o: int, i_g: int, kernel: Sequence[int]) -> tuple[int, ...]:
        return join_weights(o, i_g, kernel, self.weights_format)


def _shape_value(op: str, name: str, value, rank: int) -> list[int]:
    values = _int_list(op, name, value)
    if len(values) not in (rank, rank + 2):
        _fail(op, name, value, f"{rank} spatial sizes or a full shape of {rank + 2}")
    if any(v < 0 or v > MAX_EXTENT for v in values):
        _fail(op, name, value, f"sizes in [0, {MAX_EXTENT}]")
    return values


def _spatial_of_shape(op: str, name: str, values: list[int], layout: _Layout,
                      batch: int, channels: int) -> tuple[int, ...]:
    """Spatial part of a data-shape attribute, checking N and C of a full one."""
    if len(values) == layout.rank:
        spatial = tuple(values)
    else:
        n, c, spatial = layout.split_data(name, values)
        if n != batch or c != channels:
            _fail(op, name, values, f"batch {batch} and {channels} channels")
    if 0 in spatial:
        _fail(op, name, values, "non-zero spatial sizes")
    return spatial


def _divisible(op: str, what: str, channels: int, groups: int) -> None:
    if channels % groups:
        _fail(op, "groups", groups, f"a divisor of the {channels} {what} channels")


def _pads_for_input(attrs: _Attrs, size: Sequence[int], kernel: Sequence[int]):
    """Pads of a forward convolution reading `size`: rules 2 (with shape), 3, 4 and 5."""
    if attrs.auto_pad == "none":
        return attrs.pads_begin, attrs.pads_end
    if attrs.auto_pad == "valid":
        return (0,) * len(size), (0,) * len(size)
    pads = [tf_same_pads(y, extent(k, d), s, attrs.auto_pad == "same_upper")
            for y, k, s, d in zip(size, kernel, attrs.strides, attrs.dilations, strict=True)]
    return tuple(p[0] for p in pads), tuple(p[1] for p in pads)


def _check_dst(op: str, name: str, dst: Sequence[int], src: Sequence[int], kernel, attrs,
               pb, pe, source: str) -> None:
    expected = tuple(conv_output_spatial(src, kernel, attrs.strides, attrs.dilations, pb, pe))
    if tuple(dst) != expected:
        _fail(op, f"{name} spatial shape", tuple(dst),
              f"{expected} from {source}, strides, dilations and pads")


def _bwd_data_spatial(spec: OpSpec, attrs: _Attrs, dst: Sequence[int], kernel, shape):
    """Result size and pads of the backward-data ops (docs/semantics.md, rules 1 and 2)."""
    rank = len(dst)
    if spec.kind == "ConvolutionBackpropData":
        if shape is not None:
            if attrs.auto_pad in ("same_upper", "same_lower"):
                pads = [transposed_same_pads(x, y, extent(k, d), s, p,
                                             attrs.auto_pad == "same_upper")
                        for x, y, k, d, s, p in zip(dst, shape, kernel, attrs.dilations,
                                                    attrs.strides, attrs.output_padding,
                                                    strict=True)]
                return tuple(shape), tuple(p[0] for p in pads), tuple(p[1] for p in pads)
            if attrs.auto_pad == "valid":
                return tuple(shape), (0,) * rank, (0,) * rank
            return tuple(shape), attrs.pads_begin, attrs.pads_end
        if attrs.auto_pad == "none":
            pb, pe = attrs.pads_begin, attrs.pads_end
        else:
            pb, pe = (0,) * rank, (0,) * rank
    else:  # ConvolutionBackwardData
        if shape is not None:
            pb, pe = _pads_for_input(attrs, shape, kernel)
            _check_dst(spec.kind, spec.inputs[0], dst, shape, kernel, attrs, pb, pe,
                       f"{spec.shape_name} and the {spec.inputs[1]} kernel")
            return tuple(shape), pb, pe
        if attrs.auto_pad in ("same_upper", "same_lower"):
            size = tuple(x * s for x, s in zip(dst, attrs.strides, strict=True))
            pb, pe = _pads_for_input(attrs, size, kernel)
            return size, pb, pe
        if attrs.auto_pad == "valid":
            pb, pe = (0,) * rank, (0,) * rank
        else:
            pb, pe = attrs.pads_begin, attrs.pads_end
    size = tuple(transposed_output_spatial(dst, kernel, attrs.strides, attrs.dilations, pb, pe,
                                           attrs.output_padding))
    if any(y < 1 for y in size):
        _fail(spec.kind, f"{spec.output} spatial shape", size,
              "positive sizes (pads are larger than the transposed convolution's result)")
    return size, pb, pe


def _kernel_from_shape(spec: OpSpec, layout: _Layout, shape, o: int, i_g: int):
    if shape is None:
        _fail(spec.kind, spec.shape_name, None,
              "the weights shape as input or attribute (the kernel extent comes from it)")
    if len(shape) == layout.rank:
        kernel = tuple(shape)
    else:
        got_o, got_i_g, kernel = layout.split_weights(spec.shape_name, shape)
        if (got_o, got_i_g) != (o, i_g):
            _fail(spec.kind, spec.shape_name, list(shape),
                  f"a weights shape {layout.join_weights(o, i_g, kernel)} that agrees "
                  f"with the data channels and groups")
    if any(k < 1 for k in kernel):
        _fail(spec.kind, spec.shape_name, list(shape), "positive kernel sizes")
    return kernel


def resolve(kind: str, shapes: Sequence[Sequence[int]], attrs: Mapping,
            shape_input=None, dtype: str = "f32") -> Problem:
    """Validate one call and work out its kernel, run-time sizes and result shape.

    `shapes` are the shapes of the two data inputs in the op's order; `shape_input`
    is the optional shape input (it wins over the shape attribute).
    """
    spec = OPS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        _fail("execute", "op_kind", kind, f"one of {list(OPS)}")
    op = spec.kind
    first, second = (tuple(_int_list(op, f"{n} shape", s)) for n, s in
                     zip(spec.inputs, shapes, strict=True))
    for name, shape in zip(spec.inputs, (first, second), strict=True):
        if any(v < 0 for v in shape):
            _fail(op, f"{name} shape", shape, "non-negative sizes")
    if len(first) not in (3, 4, 5):
        _fail(op, f"{spec.inputs[0]} rank", len(first), "3, 4 or 5 (1 to 3 spatial axes)")
    rank = len(first) - 2
    attrs = dict(attrs)
    if shape_input is not None and spec.shape_name:
        attrs[spec.shape_name] = shape_input
    a = _normalize(spec, attrs, rank)
    layout = _Layout(spec, a, rank)
    shape = attrs.get(spec.shape_name) if spec.shape_name else None
    if shape is not None:
        shape = _shape_value(op, spec.shape_name, shape, rank)
    g = a.groups
    swapped = False  # a weight gradient run as its problem with the inputs swapped

    if spec.family == "bwd_data":
        n, oc, dst = layout.split_data(spec.inputs[0], first)
        w_oc, ic_g, kernel = layout.split_weights(spec.inputs[1], second)
        if w_oc != oc:
            _fail(op, f"{spec.inputs[1]} shape", second,
                  f"{oc} output channels, as {spec.inputs[0]} has")
        _divisible(op, "output", oc, g)
        ic = ic_g * g
        if shape is not None:
            shape = _spatial_of_shape(op, spec.shape_name, shape, layout, n, ic)
        src, pb, pe = _bwd_data_spatial(spec, a, dst, kernel, shape)
        cin_g, cout_g, out = ic_g, oc // g, layout.join_data(n, ic, src)
        swap = False
    elif spec.family == "fwd":  # ConvTransposeBackwardData: conv of diff_dst
        n, oc, src = layout.split_data(spec.inputs[0], first)
        ic, oc_g, kernel = layout.split_weights(spec.inputs[1], second)
        _divisible(op, "input", ic, g)
        if oc_g * g != oc:
            _fail(op, f"{spec.inputs[1]} shape", second,
                  f"{oc // g if oc % g == 0 else oc}/groups output channels per group "
                  f"({oc} in {spec.inputs[0]}, groups {g})")
        pb, pe = _pads_for_input(a, src, kernel)
        dst = tuple(conv_output_spatial(src, kernel, a.strides, a.dilations, pb, pe))
        if any(x < 1 for x in dst):
            _fail(op, f"{spec.inputs[0]} spatial shape", src,
                  f"sizes at least the dilated kernel extent minus pads (result {dst})")
        cin_g, cout_g, out = oc_g, ic // g, layout.join_data(n, ic, dst)
        swap = False
    else:  # weight gradients
        n, c0, sp0 = layout.split_data(spec.inputs[0], first)
        n1, c1, sp1 = layout.split_data(spec.inputs[1], second)
        if n1 != n:
            _fail(op, f"{spec.inputs[1]} batch", n1, f"{n}, the batch of {spec.inputs[0]}")
        # Forward problem: src is read with the kernel, dst is the convolution's result.
        swap = spec.transpose
        (cin, src), (cout, dst) = ((c1, sp1), (c0, sp0)) if swap else ((c0, sp0), (c1, sp1))
        _divisible(op, "input" if not swap else "output", cin, g)
        _divisible(op, "output" if not swap else "input", cout, g)
        kernel = _kernel_from_shape(spec, layout, shape, cout, cin // g)
        pb, pe = _pads_for_input(a, src, kernel)
        dst_name = spec.inputs[0] if swap else spec.inputs[1]
        src_name = spec.inputs[1] if swap else spec.inputs[0]
        _check_dst(op, dst_name, dst, src, kernel, a, pb, pe,
                   f"{src_name} and the {spec.shape_name} kernel")
        cin_g, cout_g = cin // g, cout // g
        out = layout.join_weights(cout, cin_g, kernel)
        swapped = swaps_operands(a.data_format, dtype, a.groups, kernel, a.strides,
                                 pb, pe, cin, cout)
        if swapped:
            swap = not swap
            cin_g, cout_g, src, dst = cout, cin, dst, src

    if any(v > MAX_EXTENT for v in (*src, *dst, *out, n)):
        _fail(op, "shape", out, f"sizes at most {MAX_EXTENT}")
    weights_format = FORWARD_WEIGHTS_FORMAT.get(a.weights_format, a.weights_format)
    if weights_format == "OXI" and all(k == 1 for k in kernel):
        weights_format = "OIX"  # one tap: the same memory
    if swapped:  # [i'][o'] sums are the [o][i] weights
        weights_format = {"OIX": "XIO", "XIO": "OIX"}[weights_format]
    config = KernelConfig(
        family=spec.family, kernel=tuple(kernel), strides=a.strides, dilations=a.dilations,
        groups=g, cin_per_group=cin_g, cout_per_group=cout_g, data_format=a.data_format,
        weights_format=weights_format, dtype=dtype)
    return Problem(op=spec, config=config, batch=n, src_spatial=tuple(src),
                   dst_spatial=tuple(dst), pads_begin=tuple(pb), pads_end=tuple(pe),
                   output_shape=tuple(out), swap_inputs=swap, operands_swapped=swapped)
