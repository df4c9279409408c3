"""The three kernels as JAX primitives: the forward convolution, its data gradient and
its weight gradient, each bilinear, so that each one's derivative is made of the others.

A primitive's parameter is a `Conv`: one of three op kinds of the op table with every
attribute explicit (pads resolved, the data gradient's result size and the weight
gradient's kernel size given). Its shape rule is `convgrad.codegen.resolve`, the one
the numpy API and convgrad.torch use; lowered for the CPU it binds the call
(`convgrad.bound.bind`), loads or builds the kernel and emits one XLA custom call
through the FFI (convgrad.jax._ffi), with the kernel's scratch as a second result that
XLA allocates. A kernel that cannot be built (no compiler, a failed build) is lowered
as lax's convolution instead, with one warning.

- ConvTransposeBackwardData(x, w) = y: the forward convolution (weights in forward
  terms OIX/XIO/OXI, spelled IOX/XOI/IXO for this op);
- ConvolutionBackwardData(dy, w) = dx, of the result size `shape`;
- ConvolutionBackwardWeights(x, dy) = dw, of the kernel size `shape`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from convgrad import bound
from convgrad.api import DTYPES
from convgrad.codegen import Problem, resolve
from convgrad.codegen.ops import TRANSPOSE_WEIGHTS_FORMAT
from convgrad.codegen.render import DIMS_FIELDS
from convgrad.codegen.shapes import split_data, split_weights
from convgrad.jax import _ffi

log = logging.getLogger("convgrad")

FWD, DATA, WEIGHTS = ("ConvTransposeBackwardData", "ConvolutionBackwardData",
                      "ConvolutionBackwardWeights")
_XLA_DTYPES = {"f32": 11, "f16": 10, "bf16": 16}  # XLA_FFI_DataType


@dataclass(frozen=True)
class Conv:
    """One call of a primitive, every attribute explicit (hashable: a jaxpr parameter)."""

    kind: str  # FWD, DATA or WEIGHTS
    strides: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    dilations: tuple[int, ...]
    groups: int
    data_format: str  # NXC or NCX
    weights_format: str  # in forward-convolution terms: OIX, XIO or OXI
    shape: tuple[int, ...] | None = None  # DATA: the result's spatial sizes; WEIGHTS: kernel

    def attrs(self) -> dict:
        """The op's attributes by the op table's names."""
        values = {"strides": list(self.strides), "pads_begin": list(self.pads_begin),
                  "pads_end": list(self.pads_end), "dilations": list(self.dilations),
                  "groups": self.groups, "data_format": self.data_format,
                  "weights_format": (TRANSPOSE_WEIGHTS_FORMAT[self.weights_format]
                                     if self.kind == FWD else self.weights_format)}
        if self.kind == DATA:
            values["dst_shape"] = list(self.shape)
        elif self.kind == WEIGHTS:
            values["weights_shape"] = list(self.shape)
        return values

    def data_spatial(self, shape) -> tuple[int, ...]:
        """The spatial sizes of a data shape in this call's data format."""
        return split_data(shape, self.data_format)[2]

    def kernel_spatial(self, shape) -> tuple[int, ...]:
        """The kernel sizes of a weights shape in this call's weights format."""
        return split_weights(shape, self.weights_format)[2]


def as_array(value):
    """`value` as a JAX array (jnp.asarray costs an eager call tens of microseconds on
    what already is one, tracers included)."""
    return value if isinstance(value, jax.Array) else jnp.asarray(value)


def dtype_name(dtype) -> str | None:
    """convgrad's name of a JAX dtype ("f32", "f16", "bf16"), None if no kernel has it."""
    return DTYPES.get(np.dtype(dtype))


def problem_of(conv: Conv, a_shape, b_shape, dtype) -> Problem:
    """The resolved problem (raises the op's ValueError or TypeError when invalid)."""
    return resolve(conv.kind, (tuple(a_shape), tuple(b_shape)), conv.attrs(), None,
                   dtype_name(dtype))


def bound_call(conv: Conv, a_shape, b_shape, dtype) -> bound.BoundCall:
    """The memoised bound call (convgrad.bound) of a primitive's call."""
    return bound.bind(conv.kind, tuple(a_shape), tuple(b_shape), dtype_name(dtype),
                      conv.attrs())


# --- the primitives -------------------------------------------------------------------

def _abstract(a, b, *, conv: Conv):
    if a.dtype != b.dtype or dtype_name(a.dtype) is None:
        raise TypeError(f"{conv.kind}: operands are {a.dtype} and {b.dtype}; expected one "
                        "of float32, float16, bfloat16 for both")
    problem = problem_of(conv, a.shape, b.shape, a.dtype)
    return jax.core.ShapedArray(problem.output_shape, a.dtype)


_warned: set[str] = set()


def _kernel_or_none(call: bound.BoundCall):
    """The call's kernel, built if needed; None (one warning a kernel) when it cannot be."""
    try:
        return call.load()
    except (RuntimeError, OSError) as error:  # CompilerNotFoundError, CompileError, ...
        name = call.config.name
        if name not in _warned:
            _warned.add(name)
            message = (f"convgrad.jax: kernel {name} could not be built "
                       f"({type(error).__name__}: {error}); lax's convolution runs instead")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return None


def _ffi_call(a, b, *, conv: Conv):
    """The op on CPU: its kernel as an XLA custom call (lax's convolution without one)."""
    call = bound_call(conv, a.shape, b.shape, a.dtype)
    kernel = _kernel_or_none(call)
    if kernel is None:
        return lax_equivalent(a, b, conv)
    first, second = (b, a) if call.swap else (a, b)
    out_shape = call.problem.output_shape
    d = call.dims
    dims = (d.batch, *d.src[0:3], *d.dst[0:3], *d.pads_begin[0:3], d.num_threads)
    assert len(dims) == DIMS_FIELDS
    index = _ffi.call_index(kernel, dims, _XLA_DTYPES[call.config.dtype],
                            call.workspace_bytes, (first.shape, second.shape, out_shape))
    results = (jax.ShapeDtypeStruct(out_shape, a.dtype),
               jax.ShapeDtypeStruct((max(call.workspace_bytes, 1),), jnp.uint8))
    log.debug("convgrad.jax: %s runs kernel %s", conv.kind, kernel.name)
    out, _ = jax.ffi.ffi_call(_ffi.TARGET, results)(
        first, second, call=np.int64(index), token=np.int64(_ffi.token()))
    return out


@lru_cache(maxsize=1024)
def _compiled(conv: Conv):
    """The op of `conv` as a jitted function: an eager call (outside jit) dispatches it
    as jax does its own primitives, compiled once per shape, not traced each time."""
    return jax.jit(partial(bind, conv=conv))


def _impl(a, b, *, conv: Conv):
    return _compiled(conv)(a, b)


def _make(kind: str) -> Primitive:
    primitive = Primitive(f"convgrad_{kind}")
    primitive.def_impl(_impl)
    primitive.def_abstract_eval(_abstract)
    mlir.register_lowering(primitive, mlir.lower_fun(_ffi_call, multiple_results=False),
                           platform="cpu")
    return primitive


PRIMITIVES = {kind: _make(kind) for kind in (FWD, DATA, WEIGHTS)}


def bind(a, b, conv: Conv):
    """Runs `conv` on the operands (the op's two data inputs, in its order)."""
    return PRIMITIVES[conv.kind].bind(a, b, conv=conv)


def _shape_of(value):
    return value.aval.shape  # an undefined primal (its accumulator) or a value


# Each op is linear in each operand; its transposes are the other two ops.
def _fwd_x(ct, x, w, *, conv):
    return bind(ct, w, replace(conv, kind=DATA, shape=conv.data_spatial(_shape_of(x))))


def _fwd_w(ct, x, w, *, conv):
    return bind(x, ct, replace(conv, kind=WEIGHTS, shape=conv.kernel_spatial(_shape_of(w))))


def _data_dy(ct, dy, w, *, conv):
    return bind(ct, w, replace(conv, kind=FWD, shape=None))


def _data_w(ct, dy, w, *, conv):
    return bind(ct, dy, replace(conv, kind=WEIGHTS, shape=conv.kernel_spatial(_shape_of(w))))


def _weights_x(ct, x, dy, *, conv):
    return bind(dy, ct, replace(conv, kind=DATA, shape=conv.data_spatial(_shape_of(x))))


def _weights_dy(ct, x, dy, *, conv):
    return bind(x, ct, replace(conv, kind=FWD, shape=None))


ad.defbilinear(PRIMITIVES[FWD], _fwd_x, _fwd_w)
ad.defbilinear(PRIMITIVES[DATA], _data_dy, _data_w)
ad.defbilinear(PRIMITIVES[WEIGHTS], _weights_x, _weights_dy)


def _batch(kind: str):
    """vmap: a mapped data operand of the forward or data op (weights not mapped) joins
    the batch axis, one kernel call for the whole map; every other case (mapped weights,
    a weight gradient, which sums over the batch) runs the op once per mapped element."""

    def rule(args, dims, *, conv):
        (a, b), (da, db) = args, dims
        size = a.shape[da] if da is not None else b.shape[db]
        if kind != WEIGHTS and db is None:
            a = jnp.moveaxis(a, da, 0)
            out = bind(a.reshape(size * a.shape[1], *a.shape[2:]), b, conv)
            return out.reshape(size, a.shape[1], *out.shape[1:]), 0
        a = a if da is None else jnp.moveaxis(a, da, 0)
        b = b if db is None else jnp.moveaxis(b, db, 0)

        def one(operands):
            x, y = operands
            return bind(a if x is None else x, b if y is None else y, conv)

        mapped = (None if da is None else a,
                  None if db is None else b)
        return lax.map(one, mapped), 0

    return rule


for _kind, _primitive in PRIMITIVES.items():
    batching.primitive_batchers[_primitive] = _batch(_kind)


# --- lax's equivalents ------------------------------------------------------------------

_SPATIAL = "DHW"


def lax_dimension_numbers(conv: Conv, rank: int) -> tuple[str, str, str]:
    """The forward convolution's dimension numbers in lax's strings."""
    sp = _SPATIAL[3 - rank:]
    data = f"N{sp}C" if conv.data_format == "NXC" else f"NC{sp}"
    weights = {"OIX": f"OI{sp}", "XIO": f"{sp}IO", "OXI": f"O{sp}I"}[conv.weights_format]
    return data, weights, data


def _lax_forward(x, w, conv: Conv):
    rank = x.ndim - 2
    return lax.conv_general_dilated(
        x, w, conv.strides, list(zip(conv.pads_begin, conv.pads_end, strict=True)),
        rhs_dilation=conv.dilations, dimension_numbers=lax_dimension_numbers(conv, rank),
        feature_group_count=conv.groups, precision=lax.Precision.HIGHEST)


def lax_equivalent(a, b, conv: Conv):
    """The op by lax's convolution and its transposes (what runs where no kernel can)."""
    if conv.kind == FWD:
        return _lax_forward(a, b, conv)
    shape = problem_of(conv, a.shape, b.shape, a.dtype).output_shape
    if conv.kind == DATA:
        x = jax.ShapeDtypeStruct(shape, a.dtype)
        return jax.linear_transpose(lambda v: _lax_forward(v, b, conv), x)(a)[0]
    w = jax.ShapeDtypeStruct(shape, a.dtype)
    return jax.linear_transpose(lambda v: _lax_forward(a, v, conv), w)(b)[0]
