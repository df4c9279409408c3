"""The six ops of docs/semantics.md as PyTorch custom ops: `torch.ops.convgrad.<function>`.

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

Under `torch.autocast("cpu", dtype=...)` each op does what aten's convolutions do
there (they are on CPU autocast's lower-precision list): its floating-point inputs
are cast to the autocast dtype (bfloat16 or float16) and the op runs with autocast
off, so its result has that dtype; autograd through the casts gives float32 leaves
float32 gradients. The gradients themselves are not autocast (aten's
convolution_backward is not either), also where backward() runs inside the region.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch

from convgrad.codegen.ops import OpSpec
from convgrad.codegen.shapes import fit_pads_end
from convgrad.torch import _bridge, _calls, _native
from convgrad.torch._calls import SPECS, execute, result_shape

Ints = Sequence[int]

_COMMON = "int[] strides, SymInt[] pads_begin, SymInt[] pads_end, int[] dilations, int groups"


def _qualname(spec: OpSpec) -> str:
    return f"convgrad::{spec.function}"


def _schema(spec: OpSpec) -> str:
    a, b = spec.inputs
    if spec.family == "bwd_data":
        args = f"Tensor {a}, Tensor {b}, SymInt[]? {spec.shape_name}, {_COMMON}, " \
               "int[] output_padding"
    elif spec.family == "fwd":
        args = f"Tensor {a}, Tensor {b}, {_COMMON}"
    else:
        args = f"Tensor {a}, Tensor {b}, SymInt[] {spec.shape_name}, {_COMMON}"
    return f"({args}) -> Tensor"


def _fake(spec: OpSpec, a, b, shape, strides, pads_begin, pads_end, dilations, groups,
          output_padding=None) -> torch.Tensor:
    _bridge.check_pair(spec.kind, spec.inputs, a, b, fake=True)
    shape = result_shape(spec, a, b, shape, strides, pads_begin, pads_end, dilations, groups,
                         output_padding)
    return _calls.new_result(spec, shape, _calls.layouts(spec, a, b)[1], a)


def _kernel(name: str, a, b, attrs: tuple) -> torch.Tensor:
    """The registered op's CPU kernel (what torch.compile's graphs and every traced or
    moded call run): the C++ path's site where it is loaded, else Python's."""
    native = _native_site(name, attrs) if a.is_cpu and b.is_cpu else None
    if native is not None:
        return native[0].run(a, b, native[1])
    return _execute(name, a, b, attrs)


def _define(spec: OpSpec):
    """Registers one op: the kernel call and its fake implementation."""
    name = spec.function
    if spec.family == "bwd_data":
        def impl(a, b, shape, strides, pads_begin, pads_end, dilations, groups,
                 output_padding):
            return _kernel(name, a, b, (shape, strides, pads_begin, pads_end, dilations,
                                        groups, output_padding))

        def fake(a, b, shape, strides, pads_begin, pads_end, dilations, groups,
                 output_padding):
            return _fake(spec, a, b, shape, strides, pads_begin, pads_end, dilations,
                         groups, output_padding)
    elif spec.family == "fwd":
        def impl(a, b, strides, pads_begin, pads_end, dilations, groups):
            return _kernel(name, a, b, (strides, pads_begin, pads_end, dilations, groups))

        def fake(a, b, strides, pads_begin, pads_end, dilations, groups):
            return _fake(spec, a, b, None, strides, pads_begin, pads_end, dilations, groups)
    else:
        def impl(a, b, shape, strides, pads_begin, pads_end, dilations, groups):
            return _kernel(name, a, b, (shape, strides, pads_begin, pads_end, dilations,
                                        groups))

        def fake(a, b, shape, strides, pads_begin, pads_end, dilations, groups):
            return _fake(spec, a, b, shape, strides, pads_begin, pads_end, dilations,
                         groups)
    impl.__name__ = name
    op = torch.library.custom_op(_qualname(spec), impl, mutates_args=(),
                                 schema=_schema(spec))
    op.register_fake(fake)
    return op


_ops = {name: _define(spec) for name, spec in SPECS.items()}


# Autocast: one rule, aten's for an op of CPU autocast's lower-precision list, as each
# op's AutocastCPU kernel and in dispatch()'s eager path. torch.library.register_autocast
# would cast to one dtype fixed when registering; autocast's is chosen per region.

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_autocast_enabled = torch.is_autocast_enabled


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as CPU autocast casts an input of a lower-precision op: a floating-point CPU
    tensor other than float64 in `dtype` (itself if it has it), anything else as is."""
    if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64
            and t.device.type == "cpu"):
        return t.to(dtype)
    return t


def _autocast_inputs(a, b) -> tuple:
    """An op's two data inputs in the autocast dtype (where the rule casts them)."""
    dtype = torch.get_autocast_dtype("cpu")
    return _cast(a, dtype), _cast(b, dtype)


def _no_autocast() -> torch._C._ExcludeDispatchKeyGuard:
    """A context in which autocast is off for the CPU, as inside aten's autocast
    kernels (torch.is_autocast_enabled("cpu") is False there); cheaper than
    torch.autocast(enabled=False)."""
    return torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU)


def _autocast_kernel(op: torch._ops.OpOverload) -> Callable:
    """The AutocastCPU kernel of `op`: its data inputs cast, then `op` without autocast."""
    def kernel(keyset, a, b, *attrs):
        with _no_autocast():
            return op(*_autocast_inputs(a, b), *attrs)
    return kernel


_LIB = torch.library.Library("convgrad", "IMPL")  # lives as long as the ops
for _name in _ops:
    _LIB.impl(_name, _autocast_kernel(getattr(torch.ops.convgrad, _name).default),
              "AutocastCPU", with_keyset=True)


def _outside_autocast(backward: Callable) -> Callable:
    """An autograd formula that runs with autocast off: backward() called inside an
    autocast region would otherwise cast the gradients' ops (aten's are not)."""
    @functools.wraps(backward)
    def formula(ctx, grad):
        if not torch.is_autocast_enabled("cpu"):
            return backward(ctx, grad)
        with torch.autocast("cpu", enabled=False):  # torch's own context: traceable
            return backward(ctx, grad)
    return formula


# Autograd. Notation of one spatial axis: the forward convolution reads a size-Y tensor
# with kernel k, stride s, dilation d and pads pb/pe, and gives X outputs.

def _fit(t: torch.Tensor, outputs: Sequence, kernel: Sequence, strides, dilations,
         pads_begin) -> tuple[torch.Tensor, list]:
    """(t, pads_end) such that a forward convolution over `t` gives exactly `outputs`:
    pads_end by convgrad.codegen.shapes.fit_pads_end, and where that is negative, t
    loses that many trailing positions instead (the convolution never reads them)."""
    pads_end = fit_pads_end(outputs, t.shape[2:], kernel, strides, dilations, pads_begin)
    for axis, pe in enumerate(pads_end):
        if pe < 0:
            t = t.narrow(2 + axis, 0, t.shape[2 + axis] + pe)
            pads_end[axis] = 0
    return t, pads_end


def _setup(ctx, inputs, output) -> None:
    a, b, *attrs = inputs
    ctx.save_for_backward(a, b)
    ctx.attrs = attrs


@_outside_autocast
def _backward_data(ctx, grad):
    """A data op: out (N, IC, Y) from diff_dst (N, OC, X) and weights (OC, IC/g, k)."""
    diff_dst, weights = ctx.saved_tensors
    _, strides, pads_begin, _, dilations, groups, _ = ctx.attrs
    kernel = weights.shape[2:]
    grad, pads_end = _fit(grad, diff_dst.shape[2:], kernel, strides, dilations, pads_begin)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:  # a forward convolution of grad
        grad_a = dispatch("conv_transpose_backward_data", grad, weights, strides, pads_begin,
                                                      pads_end, dilations, groups)
    if ctx.needs_input_grad[1]:  # grad reads as the forward's src, diff_dst as its result
        grad_b = dispatch("convolution_backward_weights", grad, diff_dst, list(kernel), strides,
                                                      pads_begin, pads_end, dilations,
                                                      groups)
    return grad_a, grad_b, None, None, None, None, None, None, None


@_outside_autocast
def _backward_weights(ctx, grad):
    """ConvolutionBackwardWeights: (OC, IC/g, k) from src (N, IC, Y), diff_dst (N, OC, X)."""
    src, diff_dst = ctx.saved_tensors
    _, strides, pads_begin, pads_end, dilations, groups = ctx.attrs
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = dispatch("convolution_backward_data", diff_dst, grad, list(src.shape[2:]),
                                                   strides, pads_begin, pads_end, dilations,
                                                   groups, [0] * len(strides))
    if ctx.needs_input_grad[1]:
        grad_b = dispatch("conv_transpose_backward_data", src, grad, strides, pads_begin,
                                                      pads_end, dilations, groups)
    return grad_a, grad_b, None, None, None, None, None, None


@_outside_autocast
def _backward_fwd(ctx, grad):
    """ConvTransposeBackwardData: (N, IC, X) from diff_dst (N, OC, Y), weights (IC, OC/g, k)."""
    diff_dst, weights = ctx.saved_tensors
    strides, pads_begin, pads_end, dilations, groups = ctx.attrs
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = dispatch("convolution_backward_data", grad, weights, list(diff_dst.shape[2:]),
                                                   strides, pads_begin, pads_end, dilations,
                                                   groups, [0] * len(strides))
    if ctx.needs_input_grad[1]:
        grad_b = dispatch("convolution_backward_weights", diff_dst, grad, list(weights.shape[2:]),
                                                      strides, pads_begin, pads_end,
                                                      dilations, groups)
    return grad_a, grad_b, None, None, None, None, None


@_outside_autocast
def _backward_transpose_weights(ctx, grad):
    """ConvTransposeBackwardWeights: (IC, OC/g, k) from src (N, IC, X), diff_dst (N, OC, Y)."""
    src, diff_dst = ctx.saved_tensors
    _, strides, pads_begin, pads_end, dilations, groups = ctx.attrs
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = dispatch("conv_transpose_backward_data", diff_dst, grad, strides, pads_begin,
                                                      pads_end, dilations, groups)
    if ctx.needs_input_grad[1]:
        grad_b = dispatch("convolution_backward_data", src, grad, list(diff_dst.shape[2:]),
                                                   strides, pads_begin, pads_end, dilations,
                                                   groups, [0] * len(strides))
    return grad_a, grad_b, None, None, None, None, None, None


def _plain(a, b) -> bool:
    """Whether both are plain CPU tensors outside any tracing, transform or mode: then
    the op runs without torch's dispatcher (the registered op serves everything else)."""
    return (type(a) in _PLAIN and type(b) in _PLAIN and a.is_cpu and b.is_cpu
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def dispatch(name: str, a: torch.Tensor, b: torch.Tensor, *attrs) -> torch.Tensor:
    """Op `name` on (a, b) with the registered op's other arguments, by the cheapest
    path that keeps its meaning: the registered op (`torch.ops.convgrad.<name>`) when
    torch.compile traces or the tensors are fake, meta, subclasses or under a mode;
    else (inputs cast first under autocast, as the op's AutocastCPU kernel casts
    them) an autograd.Function with the same gradients (when one of them needs a
    gradient), or the kernel itself. Python custom ops cost about 16 us a call (27 in
    grad mode), more than a small kernel; the autograd.Function about 6."""
    if torch.compiler.is_compiling() or not _plain(a, b):
        return _ops[name](a, b, *attrs)
    if _autocast_enabled("cpu"):  # what the op's AutocastCPU kernel does
        with _no_autocast():
            return dispatch(name, *_autocast_inputs(a, b), *attrs)
    native = _native_site(name, attrs)
    if native is not None:  # the C++ path: kernel call and autograd node
        return native[0](a, b, native[1])
    if _profiling():
        with torch.profiler.record_function(f"convgrad::{name}"):
            return _eager(name, a, b, attrs)
    return _eager(name, a, b, attrs)


_profiling = torch._C._autograd._profiler_enabled


def _static(values) -> tuple:
    return tuple(tuple(v) if isinstance(v, list) else v for v in values)


def _native_site(name: str, attrs: tuple):
    """(the C++ path's site of op `name` with the registered op's other arguments, the
    shape argument as a list or None), or None where Python's path serves the call (the
    extension not loaded yet, aot_kernels noting calls)."""
    if _calls.recording():
        return None
    shape, static = (None, attrs) if name in _NO_SHAPE else (attrs[0], attrs[1:])
    try:
        site = _native.site(name, _static(static), _BACKWARD)
    except TypeError:  # unhashable attribute values
        return None
    if site is None:
        return None
    return site, None if shape is None else list(shape)


def forward_site(args: tuple):
    """The C++ path's site of the forward convolution (conv_transpose_backward_data)
    with args (strides, pads_begin, pads_end, dilations, groups), or None."""
    return _native.site("conv_transpose_backward_data", _static(args), _BACKWARD)


def native_ready(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a module's convolution of (a, b) plus bias may run on its C++ site: plain
    CPU tensors outside tracing, modes and autocast, and aot_kernels not noting calls."""
    return (_plain(a, b) and (bias is None or type(bias) in _PLAIN)
            and not _autocast_enabled("cpu") and not _calls.recording())


def _eager(name: str, a, b, attrs: tuple) -> torch.Tensor:
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _apply(a, b, name, attrs)
    return _execute(name, a, b, attrs)


_NO_SHAPE = frozenset(name for name, spec in SPECS.items() if spec.shape_name is None)


def _execute(name: str, a, b, attrs: tuple) -> torch.Tensor:
    """execute() with the registered op's arguments (ops without a shape have none)."""
    if name in _NO_SHAPE:
        return execute(name, a, b, None, *attrs)
    return execute(name, a, b, *attrs)


class _Op(torch.autograd.Function):
    """One op with the registered op's gradients (_BACKWARD), outside the dispatcher."""

    @staticmethod
    def forward(ctx, a, b, name, attrs):
        ctx.save_for_backward(a, b)
        ctx.attrs, ctx.name = attrs, name
        return _execute(name, a, b, attrs)

    @staticmethod
    def backward(ctx, grad):
        grad_a, grad_b = _BACKWARD[ctx.name](ctx, grad)[:2]
        return grad_a, grad_b, None, None


# autograd.Function.apply without its Python wrapper (defaults binding and the unwrapping
# of dead functorch wrappers, which plain tensors outside transforms never are): 4.1
# instead of 5.9 us a call (Sapphire Rapids).
_base_apply = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
_apply = _base_apply.__get__(None, _Op) if hasattr(_base_apply, "__get__") else _Op.apply


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


def _data_op(spec: OpSpec):
    def function(a: torch.Tensor, b: torch.Tensor, shape: Ints | None = None, *,
                 strides: int | Ints = 1, pads_begin: int | Ints = 0, pads_end: int | Ints = 0,
                 dilations: int | Ints = 1, groups: int = 1,
                 output_padding: int | Ints = 0) -> torch.Tensor:
        rank = _rank(spec.kind, spec.inputs[0], a)
        return dispatch(
            spec.function, a, b, _shape(spec.kind, spec.shape_name, shape),
            _per_axis(spec.kind, "strides", strides, rank),
            _per_axis(spec.kind, "pads_begin", pads_begin, rank),
            _per_axis(spec.kind, "pads_end", pads_end, rank),
            _per_axis(spec.kind, "dilations", dilations, rank), _groups(spec.kind, groups),
            _per_axis(spec.kind, "output_padding", output_padding, rank))
    return function


def _weights_op(spec: OpSpec):
    def function(a: torch.Tensor, b: torch.Tensor, shape: Ints, *, strides: int | Ints = 1,
                 pads_begin: int | Ints = 0, pads_end: int | Ints = 0,
                 dilations: int | Ints = 1, groups: int = 1) -> torch.Tensor:
        rank = _rank(spec.kind, spec.inputs[0], a)
        if shape is None:
            raise ValueError(f"{spec.kind}: {spec.shape_name} = None is invalid; expected the "
                             "kernel's spatial sizes (or the full weights shape)")
        return dispatch(
            spec.function, a, b, _shape(spec.kind, spec.shape_name, shape),
            _per_axis(spec.kind, "strides", strides, rank),
            _per_axis(spec.kind, "pads_begin", pads_begin, rank),
            _per_axis(spec.kind, "pads_end", pads_end, rank),
            _per_axis(spec.kind, "dilations", dilations, rank), _groups(spec.kind, groups))
    return function


def _fwd_op(spec: OpSpec):
    def function(a: torch.Tensor, b: torch.Tensor, *, strides: int | Ints = 1,
                 pads_begin: int | Ints = 0, pads_end: int | Ints = 0,
                 dilations: int | Ints = 1, groups: int = 1) -> torch.Tensor:
        rank = _rank(spec.kind, spec.inputs[0], a)
        return dispatch(
            spec.function, a, b, _per_axis(spec.kind, "strides", strides, rank),
            _per_axis(spec.kind, "pads_begin", pads_begin, rank),
            _per_axis(spec.kind, "pads_end", pads_end, rank),
            _per_axis(spec.kind, "dilations", dilations, rank), _groups(spec.kind, groups))
    return function


def _public(name: str):
    spec = SPECS[name]
    make = {"bwd_data": _data_op, "bwd_weights": _weights_op, "fwd": _fwd_op}[spec.family]
    weights_format = _calls.torch_weights_format(spec)
    function = make(spec)
    function.__name__ = function.__qualname__ = name
    a, b = spec.inputs
    shape = f", {spec.shape_name}" if spec.shape_name else ""
    function.__doc__ = (
        f"{spec.kind} on torch tensors: `{name}({a}, {b}{shape}, *, strides, pads_begin, "
        "pads_end, dilations, groups" + (", output_padding" if spec.family == "bwd_data" else "")
        + ")` runs `torch.ops.convgrad." + name + "`.\n\nData tensors are (N, C, spatial...), "
        "contiguous or channels_last; weights are " + weights_format + " (torch's "
        + ("ConvTranspose" if spec.transpose else "convolution")
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
