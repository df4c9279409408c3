"""The six ops of SEMANTICS.md as PyTorch custom ops: `torch.ops.convgrad.<function>`.

Each op takes torch tensors in torch's logical layouts: data (N, C, spatial...), stored
contiguous (the kernels' NCX) or channels_last (NXC; for 1-D data, the tensor of
`x.transpose(1, 2).contiguous().transpose(1, 2)`), and weights as torch's convolution
weight (OC, IC/g, k...) = OIX, or for the ConvTranspose ops torch's ConvTranspose
weight (IC, OC/g, k...) = IOX. A data result has the layout of the op's first data
input. Attributes are explicit lists (pads as `pads_begin`/`pads_end`, so asymmetric
pads are expressible); `auto_pad` is not offered here. The functions of this module
take scalars for per-axis attributes as the numpy API does, then call the registered
op.

Every op has a fake implementation (for torch.compile and other tracing) and autograd:
each op is linear in each of its two data inputs, and the gradients are again these
ops, so gradients of gradients work too.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import convgrad
from convgrad.torch import _bridge

Ints = Sequence[int]


@dataclass(frozen=True)
class _Spec:
    name: str  # the function and torch op name
    kind: str  # the op kind of SEMANTICS.md
    inputs: tuple[str, str]
    shape_name: str | None
    weights_attr: str
    weights_format: str  # OIX or IOX: torch's own weight layouts
    family: str  # "data", "fwd" or "weights"

    @property
    def qualname(self) -> str:
        return f"convgrad::{self.name}"


_SPECS = {spec.name: spec for spec in (
    _Spec("convolution_backward_data", "ConvolutionBackwardData", ("diff_dst", "weights"),
          "dst_shape", "weights_format", "OIX", "data"),
    _Spec("convolution_backprop_data", "ConvolutionBackpropData", ("output_delta", "filter"),
          "output_shape", "filter_format", "OIX", "data"),
    _Spec("convolution_backward_weights", "ConvolutionBackwardWeights", ("src", "diff_dst"),
          "weights_shape", "weights_format", "OIX", "weights"),
    _Spec("convolution_backprop_filters", "ConvolutionBackpropFilters",
          ("input_forward", "output_delta"), "filter_shape", "filter_format", "OIX", "weights"),
    _Spec("conv_transpose_backward_data", "ConvTransposeBackwardData", ("diff_dst", "weights"),
          None, "weights_format", "IOX", "fwd"),
    _Spec("conv_transpose_backward_weights", "ConvTransposeBackwardWeights",
          ("src", "diff_dst"), "weights_shape", "weights_format", "IOX", "weights"),
)}

_COMMON = "int[] strides, SymInt[] pads_begin, SymInt[] pads_end, int[] dilations, int groups"


def _schema(spec: _Spec) -> str:
    a, b = spec.inputs
    if spec.family == "data":
        args = f"Tensor {a}, Tensor {b}, SymInt[]? {spec.shape_name}, {_COMMON}, " \
               "int[] output_padding"
    elif spec.family == "fwd":
        args = f"Tensor {a}, Tensor {b}, {_COMMON}"
    else:
        args = f"Tensor {a}, Tensor {b}, SymInt[] {spec.shape_name}, {_COMMON}"
    return f"({args}) -> Tensor"


def _extent(k, d):
    return d * (k - 1) + 1


def _is_concrete(*values) -> bool:
    return all(type(v) is int for group in values for v in group)


# Result shapes by (op, shapes, attributes): convgrad.infer_shape validates everything,
# which costs more than a small kernel; a training loop repeats the same calls.
_shapes: dict = {}
MAX_SHAPES = 4096


def _result_shape(spec: _Spec, a: torch.Tensor, b: torch.Tensor, shape, strides, pads_begin,
                  pads_end, dilations, groups, output_padding=None) -> list:
    """The result shape in torch order. With concrete sizes it is convgrad.infer_shape's
    (which validates everything, with its messages); with symbolic sizes (dynamic
    shapes in torch.compile) the same rules as plain arithmetic."""
    if _is_concrete(a.shape, b.shape, shape or (), pads_begin, pads_end):
        key = (spec.name, tuple(a.shape), tuple(b.shape),
               None if shape is None else tuple(shape), tuple(strides), tuple(pads_begin),
               tuple(pads_end), tuple(dilations), groups,
               None if output_padding is None else tuple(output_padding))
        result = _shapes.get(key)
        if result is None:
            result = _infer_shape(spec, a, b, shape, strides, pads_begin, pads_end,
                                  dilations, groups, output_padding)
            if len(_shapes) >= MAX_SHAPES:
                _shapes.clear()
            _shapes[key] = result
        return list(result)
    return _symbolic_shape(spec, a, b, shape, strides, pads_begin, pads_end, dilations,
                           groups, output_padding)


def _infer_shape(spec: _Spec, a, b, shape, strides, pads_begin, pads_end, dilations,
                 groups, output_padding) -> tuple:
    attrs = {"strides": list(strides), "pads_begin": list(pads_begin),
             "pads_end": list(pads_end), "dilations": list(dilations), "groups": groups,
             "data_format": "NCX", spec.weights_attr: spec.weights_format}
    if output_padding is not None:
        attrs["output_padding"] = list(output_padding)
    inputs = [tuple(a.shape), tuple(b.shape)]
    if shape is not None:
        inputs.append(list(shape))
    return tuple(convgrad.infer_shape(spec.kind, inputs, attrs))


def _symbolic_shape(spec: _Spec, a, b, shape, strides, pads_begin, pads_end, dilations,
                    groups, output_padding) -> list:
    """SEMANTICS.md's shape rules (explicit pads) as arithmetic that SymInts follow."""
    if spec.family == "data":  # a: (N, OC, X...), b: (OC, IC/g, k...)
        if shape is not None:
            spatial = list(shape)[-(a.dim() - 2):]
        else:
            spatial = [s * (x - 1) + _extent(k, d) - pb - pe + p for x, k, s, d, pb, pe, p in
                       zip(a.shape[2:], b.shape[2:], strides, dilations, pads_begin,
                           pads_end, output_padding, strict=True)]
        return [a.shape[0], b.shape[1] * groups, *spatial]
    if spec.family == "fwd":  # a: (N, OC, Y...), b: (IC, OC/g, k...)
        spatial = [(y + pb + pe - _extent(k, d)) // s + 1 for y, k, s, d, pb, pe in
                   zip(a.shape[2:], b.shape[2:], strides, dilations, pads_begin, pads_end,
                       strict=True)]
        return [a.shape[0], b.shape[0], *spatial]
    kernel = list(shape)[-(a.dim() - 2):]
    if spec.kind == "ConvTransposeBackwardWeights":  # (IC, OC/g, k...)
        return [a.shape[1], b.shape[1] // groups, *kernel]
    return [b.shape[1], a.shape[1] // groups, *kernel]  # (OC, IC/g, k...)


def _layouts(spec: _Spec, a: torch.Tensor, b: torch.Tensor) -> tuple[str, str | None]:
    """(layout the kernel reads its data in, layout of the result or None for weights).
    The first data input decides; where it is both (one channel or one pixel), the
    second (the other data tensor, or channels_last weights) does."""
    fmt = _bridge.data_format(a, hint=b)
    return fmt, (None if spec.family == "weights" else fmt)


def _run(spec: _Spec, a, b, shape, strides, pads_begin, pads_end, dilations, groups,
         output_padding=None) -> torch.Tensor:
    _bridge.check_pair(spec.kind, spec.inputs, a, b)
    result_shape = _result_shape(spec, a, b, shape, strides, pads_begin, pads_end,
                                 dilations, groups, output_padding)
    fmt, out_fmt = _layouts(spec, a, b)
    if spec.family == "weights":
        arrays = [_bridge.as_array(a, fmt), _bridge.as_array(b, fmt)]
        out = _bridge.new_weights(result_shape, a)
    else:
        arrays = [_bridge.as_array(a, fmt), _bridge.weights_array(b)]
        out = _bridge.new_data(result_shape, out_fmt, a)
    if shape is not None:  # a data shape goes as its spatial part: fmt may be NXC
        arrays.append(list(shape)[-(a.dim() - 2):] if spec.family == "data" else list(shape))
    attrs = {"strides": list(strides), "pads_begin": list(pads_begin),
             "pads_end": list(pads_end), "dilations": list(dilations), "groups": groups,
             "data_format": fmt, spec.weights_attr: spec.weights_format}
    if output_padding is not None:
        attrs["output_padding"] = list(output_padding)
    if out.numel():
        convgrad.execute(spec.kind, arrays, attrs, out=_bridge.out_array(out, out_fmt),
                         num_threads=_bridge.num_threads())
    return out


def _fake(spec: _Spec, a, b, shape, strides, pads_begin, pads_end, dilations, groups,
          output_padding=None) -> torch.Tensor:
    _bridge.check_pair(spec.kind, spec.inputs, a, b, fake=True)
    result_shape = _result_shape(spec, a, b, shape, strides, pads_begin, pads_end,
                                 dilations, groups, output_padding)
    if spec.family == "weights":
        return _bridge.new_weights(result_shape, a)
    return _bridge.new_data(result_shape, _layouts(spec, a, b)[1], a)


def _define(spec: _Spec):
    """Registers one op: the kernel call and its fake implementation."""
    if spec.family == "data":
        def impl(a, b, shape, strides, pads_begin, pads_end, dilations, groups,
                 output_padding):
            return _run(spec, a, b, shape, strides, pads_begin, pads_end, dilations, groups,
                        output_padding)

        def fake(a, b, shape, strides, pads_begin, pads_end, dilations, groups,
                 output_padding):
            return _fake(spec, a, b, shape, strides, pads_begin, pads_end, dilations,
                         groups, output_padding)
    elif spec.family == "fwd":
        def impl(a, b, strides, pads_begin, pads_end, dilations, groups):
            return _run(spec, a, b, None, strides, pads_begin, pads_end, dilations, groups)

        def fake(a, b, strides, pads_begin, pads_end, dilations, groups):
            return _fake(spec, a, b, None, strides, pads_begin, pads_end, dilations, groups)
    else:
        def impl(a, b, shape, strides, pads_begin, pads_end, dilations, groups):
            return _run(spec, a, b, shape, strides, pads_begin, pads_end, dilations, groups)

        def fake(a, b, shape, strides, pads_begin, pads_end, dilations, groups):
            return _fake(spec, a, b, shape, strides, pads_begin, pads_end, dilations,
                         groups)
    impl.__name__ = spec.name
    op = torch.library.custom_op(spec.qualname, impl, mutates_args=(),
                                 schema=_schema(spec))
    op.register_fake(fake)
    return op


_ops = {name: _define(spec) for name, spec in _SPECS.items()}


# Autograd. Notation of one spatial axis: the forward convolution reads a size-Y tensor
# with kernel k, stride s, dilation d and pads pb/pe, and gives X outputs.

def _fit(t: torch.Tensor, outputs: Sequence, kernel: Sequence, strides, dilations,
         pads_begin) -> tuple[torch.Tensor, list]:
    """(t, pads_end) such that a forward convolution over `t` gives exactly `outputs`:
    pads_end = s*(X-1) + K - Y - pb, and where that is negative, t loses that many
    trailing positions instead (the convolution never reads them)."""
    pads_end = []
    for axis, (x, k, s, d, pb) in enumerate(zip(outputs, kernel, strides, dilations,
                                                 pads_begin, strict=True)):
        y = t.shape[2 + axis]
        pe = s * (x - 1) + _extent(k, d) - y - pb
        if pe < 0:
            t = t.narrow(2 + axis, 0, y + pe)
            pe = 0
        pads_end.append(pe)
    return t, pads_end


def _setup(ctx, inputs, output) -> None:
    a, b, *attrs = inputs
    ctx.save_for_backward(a, b)
    ctx.attrs = attrs


def _backward_data(ctx, grad):
    """A data op: out (N, IC, Y) from diff_dst (N, OC, X) and weights (OC, IC/g, k)."""
    diff_dst, weights = ctx.saved_tensors
    _, strides, pads_begin, _, dilations, groups, _ = ctx.attrs
    kernel = weights.shape[2:]
    grad, pads_end = _fit(grad, diff_dst.shape[2:], kernel, strides, dilations, pads_begin)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:  # a forward convolution of grad
        grad_a = _ops["conv_transpose_backward_data"](grad, weights, strides, pads_begin,
                                                      pads_end, dilations, groups)
    if ctx.needs_input_grad[1]:  # grad reads as the forward's src, diff_dst as its result
        grad_b = _ops["convolution_backward_weights"](grad, diff_dst, list(kernel), strides,
                                                      pads_begin, pads_end, dilations,
                                                      groups)
    return grad_a, grad_b, None, None, None, None, None, None, None


def _backward_weights(ctx, grad):
    """ConvolutionBackwardWeights: (OC, IC/g, k) from src (N, IC, Y), diff_dst (N, OC, X)."""
    src, diff_dst = ctx.saved_tensors
    _, strides, pads_begin, pads_end, dilations, groups = ctx.attrs
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = _ops["convolution_backward_data"](diff_dst, grad, list(src.shape[2:]),
                                                   strides, pads_begin, pads_end, dilations,
                                                   groups, [0] * len(strides))
    if ctx.needs_input_grad[1]:
        grad_b = _ops["conv_transpose_backward_data"](src, grad, strides, pads_begin,
                                                      pads_end, dilations, groups)
    return grad_a, grad_b, None, None, None, None, None, None


def _backward_fwd(ctx, grad):
    """ConvTransposeBackwardData: (N, IC, X) from diff_dst (N, OC, Y), weights (IC, OC/g, k)."""
    diff_dst, weights = ctx.saved_tensors
    strides, pads_begin, pads_end, dilations, groups = ctx.attrs
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = _ops["convolution_backward_data"](grad, weights, list(diff_dst.shape[2:]),
                                                   strides, pads_begin, pads_end, dilations,
                                                   groups, [0] * len(strides))
    if ctx.needs_input_grad[1]:
        grad_b = _ops["convolution_backward_weights"](diff_dst, grad, list(weights.shape[2:]),
                                                      strides, pads_begin, pads_end,
                                                      dilations, groups)
    return grad_a, grad_b, None, None, None, None, None


def _backward_transpose_weights(ctx, grad):
    """ConvTransposeBackwardWeights: (IC, OC/g, k) from src (N, IC, X), diff_dst (N, OC, Y)."""
    src, diff_dst = ctx.saved_tensors
    _, strides, pads_begin, pads_end, dilations, groups = ctx.attrs
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = _ops["conv_transpose_backward_data"](diff_dst, grad, strides, pads_begin,
                                                      pads_end, dilations, groups)
    if ctx.needs_input_grad[1]:
        grad_b = _ops["convolution_backward_data"](src, grad, list(diff_dst.shape[2:]),
                                                   strides, pads_begin, pads_end, dilations,
                                                   groups, [0] * len(strides))
    return grad_a, grad_b, None, None, None, None, None, None


_BACKWARD = {"convolution_backward_data": _backward_data,
             "convolution_backprop_data": _backward_data,
             "convolution_backward_weights": _backward_weights,
             "convolution_backprop_filters": _backward_weights,
             "conv_transpose_backward_data": _backward_fwd,
             "conv_transpose_backward_weights": _backward_transpose_weights}
for _name, _op in _ops.items():
    _op.register_autograd(_BACKWARD[_name], setup_context=_setup)


# The Python functions: scalars for per-axis attributes, keywords as in convgrad's
# numpy API (minus the formats, which the tensors' layouts give).

def _per_axis(op: str, name: str, value, rank: int) -> list:
    """One integer per spatial axis from a scalar or a sequence (TypeError/ValueError)."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        values = list(value)
        if len(values) != rank:
            raise ValueError(f"{op}: {name} = {value!r} is invalid; expected {rank} values, "
                             "one per spatial axis")
    else:
        values = [value] * rank
    result = []
    for v in values:
        if isinstance(v, torch.SymInt):  # a size being traced
            result.append(v)
            continue
        try:
            if isinstance(v, bool):
                raise TypeError
            result.append(operator.index(v))
        except TypeError:
            raise TypeError(f"{op}: {name} = {value!r} is invalid; expected an integer or "
                            f"a sequence of {rank} integers") from None
    return result


def _rank(op: str, name: str, t) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} is a {type(t).__name__}; expected a torch.Tensor")
    if t.dim() not in (3, 4, 5):
        raise ValueError(f"{op}: {name} has {t.dim()} dimensions; expected 3, 4 or 5 "
                         "(N, C and 1 to 3 spatial axes)")
    return t.dim() - 2


def _groups(op: str, groups) -> int:
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"{op}: groups = {groups!r} is invalid; expected a positive integer")
    return groups


def _shape(op: str, name: str, value):
    if value is None:
        return None
    if isinstance(value, torch.Size | Sequence) and not isinstance(value, str):
        return _per_axis(op, name, list(value), len(value))
    raise TypeError(f"{op}: {name} = {value!r} is invalid; expected a sequence of integers")


def _data_op(spec: _Spec):
    def function(a: torch.Tensor, b: torch.Tensor, shape: Ints | None = None, *,
                 strides: int | Ints = 1, pads_begin: int | Ints = 0, pads_end: int | Ints = 0,
                 dilations: int | Ints = 1, groups: int = 1,
                 output_padding: int | Ints = 0) -> torch.Tensor:
        rank = _rank(spec.kind, spec.inputs[0], a)
        return _ops[spec.name](
            a, b, _shape(spec.kind, spec.shape_name, shape),
            _per_axis(spec.kind, "strides", strides, rank),
            _per_axis(spec.kind, "pads_begin", pads_begin, rank),
            _per_axis(spec.kind, "pads_end", pads_end, rank),
            _per_axis(spec.kind, "dilations", dilations, rank), _groups(spec.kind, groups),
            _per_axis(spec.kind, "output_padding", output_padding, rank))
    return function


def _weights_op(spec: _Spec):
    def function(a: torch.Tensor, b: torch.Tensor, shape: Ints, *, strides: int | Ints = 1,
                 pads_begin: int | Ints = 0, pads_end: int | Ints = 0,
                 dilations: int | Ints = 1, groups: int = 1) -> torch.Tensor:
        rank = _rank(spec.kind, spec.inputs[0], a)
        if shape is None:
            raise ValueError(f"{spec.kind}: {spec.shape_name} = None is invalid; expected the "
                             "kernel's spatial sizes (or the full weights shape)")
        return _ops[spec.name](
            a, b, _shape(spec.kind, spec.shape_name, shape),
            _per_axis(spec.kind, "strides", strides, rank),
            _per_axis(spec.kind, "pads_begin", pads_begin, rank),
            _per_axis(spec.kind, "pads_end", pads_end, rank),
            _per_axis(spec.kind, "dilations", dilations, rank), _groups(spec.kind, groups))
    return function


def _fwd_op(spec: _Spec):
    def function(a: torch.Tensor, b: torch.Tensor, *, strides: int | Ints = 1,
                 pads_begin: int | Ints = 0, pads_end: int | Ints = 0,
                 dilations: int | Ints = 1, groups: int = 1) -> torch.Tensor:
        rank = _rank(spec.kind, spec.inputs[0], a)
        return _ops[spec.name](
            a, b, _per_axis(spec.kind, "strides", strides, rank),
            _per_axis(spec.kind, "pads_begin", pads_begin, rank),
            _per_axis(spec.kind, "pads_end", pads_end, rank),
            _per_axis(spec.kind, "dilations", dilations, rank), _groups(spec.kind, groups))
    return function


def _public(name: str):
    spec = _SPECS[name]
    make = {"data": _data_op, "weights": _weights_op, "fwd": _fwd_op}[spec.family]
    function = make(spec)
    function.__name__ = function.__qualname__ = name
    a, b = spec.inputs
    shape = f", {spec.shape_name}" if spec.shape_name else ""
    function.__doc__ = (
        f"{spec.kind} on torch tensors: `{name}({a}, {b}{shape}, *, strides, pads_begin, "
        "pads_end, dilations, groups" + (", output_padding" if spec.family == "data" else "")
        + ")` runs `torch.ops.convgrad." + name + "`.\n\nData tensors are (N, C, spatial...), "
        "contiguous or channels_last; weights are " + spec.weights_format + " (torch's "
        + ("ConvTranspose" if spec.weights_format == "IOX" else "convolution")
        + " weight layout). The positional names are "
        f"`{a}`, `{b}`" + (f" and `{spec.shape_name}`" if spec.shape_name else "") + ". "
        "Per-axis attributes take a scalar or one value per spatial axis. Differentiable "
        "in both data inputs.")
    return function


convolution_backward_data = _public("convolution_backward_data")
convolution_backprop_data = _public("convolution_backprop_data")
convolution_backward_weights = _public("convolution_backward_weights")
convolution_backprop_filters = _public("convolution_backprop_filters")
conv_transpose_backward_data = _public("conv_transpose_backward_data")
conv_transpose_backward_weights = _public("conv_transpose_backward_weights")

OPS = dict(_ops)  # name -> the registered op (a torch.library CustomOpDef)
