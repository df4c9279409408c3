"""convgrad.jax: convgrad's kernels inside JAX programs, through XLA's FFI.

- `conv_general_dilated` and `conv_transpose` take lax's arguments and return lax's
  results; the forward convolution runs ConvTransposeBackwardData's kernel, its
  gradients ConvolutionBackwardData's and ConvolutionBackwardWeights', and an input
  dilation (a transposed convolution) the data kernel. They work under jit, grad (of
  grad), vmap, jax.checkpoint and shard_map. `flax.nnx.Conv(...,
  conv_general_dilated=convgrad.jax.conv_general_dilated)` uses them.
- The six ops of the op table with its attribute names (`convolution_backward_data`,
  ...), on JAX arrays in the numpy API's layouts.
- `compile_kernels(fn, *args)` builds every kernel a function's trace needs, in
  parallel, before its first call; `explain(...)` says which path a call takes.

The kernels run as XLA custom calls (no Python, no copy); each is built (or found in the
disk cache or an AOT folder) when a function is traced for compilation. Requires jax
(`pip install convgrad[jax]`).
"""

from __future__ import annotations

try:
    import jax
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("convgrad.jax needs jax: pip install 'convgrad[jax]'") from error

import sys

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from convgrad import background
from convgrad.codegen import OPS, resolve
from convgrad.codegen.ops import FORWARD_WEIGHTS_FORMAT
from convgrad.jax._lax import conv_general_dilated, conv_transpose, explain
from convgrad.jax._primitives import (
    DATA,
    FWD,
    PRIMITIVES,
    WEIGHTS,
    Conv,
    as_array,
    bind,
    bound_call,
    dtype_name,
)

_CANONICAL = {"fwd": FWD, "bwd_data": DATA, "bwd_weights": WEIGHTS}


def _op_function(kind: str):
    spec = OPS[kind]
    shape_name = spec.shape_name

    def function(a, b, shape_input=None, **attrs):
        unknown = sorted(set(attrs) - set(spec.attributes))
        if unknown:
            raise TypeError(f"{kind}: got an unexpected keyword argument {unknown[0]!r}")
        a, b = as_array(a), as_array(b)
        if a.dtype != b.dtype or dtype_name(a.dtype) is None:
            raise TypeError(f"{kind}: {spec.inputs[0]} is {a.dtype} and {spec.inputs[1]} "
                            f"is {b.dtype}; expected one of float32, float16, bfloat16 "
                            "for both")
        if shape_input is not None:
            shape_input = [int(v) for v in np.asarray(shape_input).ravel()]
        problem = resolve(kind, (a.shape, b.shape), attrs, shape_input, dtype_name(a.dtype))
        c = problem.config
        given = attrs.get(spec.weights_attr, spec.weights_formats[1])
        canonical = _CANONICAL[spec.family]
        shape = (problem.src_spatial if canonical == DATA
                 else c.kernel if canonical == WEIGHTS else None)
        conv = Conv(canonical, c.strides, problem.pads_begin, problem.pads_end, c.dilations,
                    c.groups, c.data_format, FORWARD_WEIGHTS_FORMAT.get(given, given), shape)
        if spec.family == "bwd_weights" and spec.transpose:
            a, b = b, a  # the forward problem's src is this op's diff_dst
        return bind(a, b, conv)

    function.__name__ = function.__qualname__ = spec.function
    function.__doc__ = (
        f"{kind} on JAX arrays: `{spec.output}` from `{spec.inputs[0]}` and "
        f"`{spec.inputs[1]}`"
        + (f", with the optional `{shape_name}` input third" if shape_name else "")
        + ". Attributes are keywords with the op table's names and defaults, as in the "
        "numpy API (convgrad." + spec.function + "); differentiable in both inputs, and "
        "usable under jit, vmap and shard_map.")
    return function


convolution_backprop_data = _op_function("ConvolutionBackpropData")
convolution_backward_data = _op_function("ConvolutionBackwardData")
convolution_backprop_filters = _op_function("ConvolutionBackpropFilters")
convolution_backward_weights = _op_function("ConvolutionBackwardWeights")
conv_transpose_backward_data = _op_function("ConvTransposeBackwardData")
conv_transpose_backward_weights = _op_function("ConvTransposeBackwardWeights")


def _equations(jaxpr: Jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, ClosedJaxpr):
                    yield from _equations(item.jaxpr)
                elif isinstance(item, Jaxpr):
                    yield from _equations(item)


def kernel_calls(fn, *args, **kwargs) -> list:
    """The bound calls (convgrad.bound.BoundCall) of the kernels `fn(*args, **kwargs)`
    runs, from its trace (jax.make_jaxpr; `args` may be jax.ShapeDtypeStruct)."""
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    primitives = set(PRIMITIVES.values())
    calls = {}
    for eqn in _equations(closed.jaxpr):
        if eqn.primitive in primitives:
            a, b = (v.aval for v in eqn.invars)
            call = bound_call(eqn.params["conv"], a.shape, b.shape, a.dtype)
            calls[id(call)] = call
    return list(calls.values())


def compile_kernels(fn, *args, progress: bool | None = None, **kwargs) -> int:
    """Builds every kernel that `fn(*args, **kwargs)` runs (a training step, say: pass
    the function that takes the gradients), all at once on every core, with a progress
    bar on a terminal; returns how many calls it found. `args` may be arrays or
    jax.ShapeDtypeStruct. Kernels already loaded, in an AOT folder or in the disk cache
    are not compiled again; a failed build warns, and that op runs lax's convolution."""
    calls = kernel_calls(fn, *args, **kwargs)
    # what is loaded, in an AOT folder or the cache's index loads here, at once; only
    # the rest goes to the build workers
    missing = [call for call in calls if call.tunes or call.load(build=False) is None]
    if progress is None:
        progress = sys.stderr.isatty()
    background.wait(missing, progress=progress)
    return len(calls)


__all__ = ["conv_general_dilated", "conv_transpose", "explain", "compile_kernels",
           "kernel_calls", "convolution_backprop_data", "convolution_backward_data",
           "convolution_backprop_filters", "convolution_backward_weights",
           "conv_transpose_backward_data", "conv_transpose_backward_weights"]
