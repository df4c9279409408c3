"""`conv_general_dilated` and `conv_transpose` with lax's signatures, on the kernels.

A call is planned once per trace (`plan`): lax's own shape rule runs first (so a bad
call raises lax's error, and the kernels' result shape is checked against lax's), then
the call maps onto one primitive of convgrad.jax._primitives:
- no input dilation: the forward convolution (ConvTransposeBackwardData), its weights
  read in place where lax's kernel layout is OIX, XIO or OXI;
- an input dilation (a transposed convolution) with unit window strides: the data
  gradient (ConvolutionBackwardData) with the input dilation as its stride, on the
  weights flipped and regrouped (one small copy).
Data in another layout than NXC or NCX, and a result in another layout than the
input's, are transposed around the kernel. What no kernel covers runs lax's own
convolution: `Plan.reason` says why, a debug log line says which ran, and `explain`
returns it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from convgrad.codegen.shapes import extent
from convgrad.jax._primitives import DATA, FWD, Conv, as_array, bind, dtype_name, problem_of

log = logging.getLogger("convgrad")


@dataclass(frozen=True)
class Plan:
    """How one lax-style call runs: on a kernel (`conv` set) or on lax (`reason` set)."""

    conv: Conv | None
    reason: str = ""
    lhs_perm: tuple[int, ...] | None = None  # transpose of lhs before the kernel
    rhs_perm: tuple[int, ...] | None = None  # transpose of rhs into (O, I, k...) or the kernel's
    out_perm: tuple[int, ...] | None = None  # transpose of the kernel's result after it
    transposed: bool = False  # an input dilation: weights flipped and regrouped
    compute_dtype: object = None  # inputs cast to this first (preferred_element_type)

    @property
    def runs_kernel(self) -> bool:
        return self.conv is not None

    def describe(self) -> str:
        if self.conv is None:
            return f"lax.conv_general_dilated: {self.reason}"
        copies = [name for name, perm in (("input", self.lhs_perm), ("result", self.out_perm))
                  if perm is not None]
        text = f"convgrad {self.conv.kind} ({self.conv.data_format}, " \
               f"{self.conv.weights_format} weights"
        if self.transposed:
            text += ", weights flipped"
        if copies:
            text += ", transposed " + " and ".join(copies)
        return text + ")"


def _fallback(reason: str) -> Plan:
    return Plan(None, reason)


def _pads(padding, lhs_spatial, kernel, strides, dilations):
    if isinstance(padding, str):
        dilated = [extent(k, d) for k, d in zip(kernel, dilations, strict=True)]
        return [tuple(p) for p in lax.padtype_to_pads(lhs_spatial, dilated, strides, padding)]
    return [tuple(int(v) for v in pair) for pair in padding]


def _is_perm(spec, target) -> bool:
    return tuple(spec) == tuple(target)


def _frozen(value):
    """A hashable stand-in for a static argument: lists as tuples, and every leaf with
    its type (strides 2.0, which lax rejects, must not find the plan of strides 2)."""
    if type(value) in (list, tuple):
        return tuple(_frozen(v) for v in value)
    return type(value), value


def plan(lhs_shape, rhs_shape, dtype, rhs_dtype, window_strides, padding, lhs_dilation,
         rhs_dilation, dimension_numbers, feature_group_count, batch_group_count,
         preferred_element_type, backend: str | None = None) -> Plan:
    """How a conv_general_dilated call with these static arguments runs, worked out
    once per distinct arguments (an eager call would otherwise pay lax's shape rule,
    milliseconds, every time)."""
    args = (tuple(lhs_shape), tuple(rhs_shape), np.dtype(dtype), np.dtype(rhs_dtype),
            window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, preferred_element_type,
            backend or jax.default_backend())
    try:
        key = _frozen(args)
        hash(key)
    except TypeError:  # an unhashable value: planned every time
        return _plan(*args)
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        found = _plans[key] = _plan(*args)
    return found


MAX_PLANS = 4096
_plans: dict = {}


def _plan(lhs_shape, rhs_shape, dtype, rhs_dtype, window_strides, padding, lhs_dilation,
          rhs_dilation, dimension_numbers, feature_group_count, batch_group_count,
          preferred_element_type, backend: str) -> Plan:
    rank = len(lhs_shape) - 2
    if not 1 <= rank <= 3:
        return _fallback(f"{rank} spatial dimensions (kernels have 1 to 3)")
    if backend != "cpu":
        return _fallback(f"the {backend} backend (kernels run on the CPU)")
    compute = None
    if np.dtype(dtype) != np.dtype(rhs_dtype):
        return _fallback(f"operands of dtypes {dtype} and {rhs_dtype}")
    if dtype_name(dtype) is None:
        return _fallback(f"dtype {np.dtype(dtype)} (kernels take float32, float16, bfloat16)")
    if preferred_element_type is not None and np.dtype(preferred_element_type) != dtype:
        if np.dtype(preferred_element_type) != np.float32:
            return _fallback(f"preferred_element_type {np.dtype(preferred_element_type)}")
        compute = np.dtype(np.float32)  # products of f16/bf16 values are exact in f32
    if batch_group_count != 1:
        return _fallback(f"batch_group_count={batch_group_count}")
    if 0 in lhs_shape or 0 in rhs_shape:
        return _fallback("an operand with a zero-sized dimension")
    dn = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
    lhs_spec, rhs_spec, out_spec = (tuple(s) for s in dn)
    n = rank
    nxc, ncx = (0, n + 1, *range(1, n + 1)), (0, 1, *range(2, n + 2))
    if _is_perm(lhs_spec, nxc) or _is_perm(lhs_spec, ncx):
        data_format, lhs_perm = ("NXC" if lhs_spec == nxc else "NCX"), None
    else:  # into NXC
        data_format, lhs_perm = "NXC", (lhs_spec[0], *lhs_spec[2:], lhs_spec[1])
    oix, xio, oxi = (0, 1, *range(2, n + 2)), (n + 1, n, *range(n)), (0, n + 1, *range(1, n + 1))
    # lax's rhs spec: the positions of the (out feature, in feature, spatial...) axes
    layout_of = {oix: "OIX", xio: "XIO", oxi: "OXI"}
    strides = tuple(int(s) for s in window_strides)
    lhs_dil = tuple(int(v) for v in (lhs_dilation or (1,) * n))
    rhs_dil = tuple(int(v) for v in (rhs_dilation or (1,) * n))
    kernel = tuple(rhs_shape[d] for d in rhs_spec[2:])
    spatial = tuple(lhs_shape[d] for d in lhs_spec[2:])
    pads = _pads(padding, spatial, kernel, strides, rhs_dil)
    groups = int(feature_group_count)
    # the kernel's result is in data_format; lax's result in out_spec
    res_axes = {"N": 0, "C": n + 1 if data_format == "NXC" else 1}
    roles = {out_spec[0]: res_axes["N"], out_spec[1]: res_axes["C"]}
    for i, axis in enumerate(out_spec[2:]):
        roles[axis] = (1 + i) if data_format == "NXC" else (2 + i)
    out_perm = tuple(roles[t] for t in range(n + 2))
    out_perm = None if out_perm == tuple(range(n + 2)) else out_perm

    if all(d == 1 for d in lhs_dil):
        if any(p < 0 for pair in pads for p in pair):
            return _fallback(f"negative padding {pads}")
        weights_format = layout_of.get(rhs_spec)
        rhs_perm = None
        if weights_format is None:
            weights_format = "XIO" if data_format == "NXC" else "OIX"
            rhs_perm = _to_format(rhs_spec, weights_format)
        conv = Conv(FWD, strides, tuple(p[0] for p in pads), tuple(p[1] for p in pads),
                    rhs_dil, groups, data_format, weights_format)
        transposed = False
    else:
        if any(s != 1 for s in strides):
            return _fallback(f"window strides {list(strides)} with input dilation "
                             f"{list(lhs_dil)}")
        extents = [extent(k, d) for k, d in zip(kernel, rhs_dil, strict=True)]
        begin = tuple(e - 1 - lo for e, (lo, _) in zip(extents, pads, strict=True))
        end = tuple(max(e - 1 - hi, 0) for e, (_, hi) in zip(extents, pads, strict=True))
        if any(b < 0 for b in begin):
            return _fallback(f"padding {pads} beyond the dilated kernel extent "
                             "(a transposed convolution that crops its input)")
        out_spatial = tuple((x - 1) * s + 1 + lo + hi - e + 1 for x, s, e, (lo, hi)
                            in zip(spatial, lhs_dil, extents, pads, strict=True))
        weights_format = "XIO" if data_format == "NXC" else "OIX"
        conv = Conv(DATA, lhs_dil, begin, end, rhs_dil, groups, data_format, weights_format,
                    out_spatial)
        rhs_perm = (rhs_spec[0], rhs_spec[1], *rhs_spec[2:])  # into (O, I/g, k...)
        transposed = True
    try:  # the kernel's shape rule must agree with lax's
        a_shape = _permuted(lhs_shape, lhs_perm)
        b_shape = _weights_shape(rhs_shape, rhs_perm, conv, groups, transposed, n)
        out = problem_of(conv, a_shape, b_shape, compute or dtype).output_shape
    except (ValueError, TypeError) as error:
        return _fallback(f"no kernel takes it ({error})")
    expected = jax.eval_shape(
        lambda: lax.conv_general_dilated(
            jnp.zeros(lhs_shape, dtype), jnp.zeros(rhs_shape, dtype), window_strides,
            padding, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count,
            batch_group_count)).shape
    if _permuted(out, out_perm) != tuple(expected):
        return _fallback(f"the kernel's result shape {out} differs from lax's {expected}")
    return Plan(conv, "", lhs_perm, rhs_perm, out_perm, transposed, compute)


def _to_format(rhs_spec, weights_format):
    """The transpose taking lax's rhs into `weights_format` (in forward terms)."""
    o, i, sp = rhs_spec[0], rhs_spec[1], tuple(rhs_spec[2:])
    return {"OIX": (o, i, *sp), "XIO": (*sp, i, o), "OXI": (o, *sp, i)}[weights_format]


def _permuted(shape, perm):
    return tuple(shape) if perm is None else tuple(shape[p] for p in perm)


def _weights_shape(rhs_shape, rhs_perm, conv: Conv, groups, transposed, n):
    shape = _permuted(rhs_shape, rhs_perm)
    if not transposed:
        return shape
    o, i_g, kernel = shape[0], shape[1], shape[2:]  # (O, I/g, k...) of lax's conv
    oix = (i_g * groups, o // groups, *kernel)
    return oix if conv.weights_format == "OIX" else (*kernel, o // groups, i_g * groups)


def _transposed_weights(w, groups: int, weights_format: str):
    """lax's (O, I/g, k...) weights of an input-dilated convolution as the data
    gradient's weights: per group (I/g, O/g) swapped, the taps reversed."""
    o, i_g, kernel = w.shape[0], w.shape[1], w.shape[2:]
    n = len(kernel)
    w = w.reshape(groups, o // groups, i_g, *kernel).swapaxes(1, 2)
    w = w.reshape(groups * i_g, o // groups, *kernel)  # OIX: (I, O/g, k...)
    w = jnp.flip(w, axis=tuple(range(2, n + 2)))
    if weights_format == "XIO":
        w = jnp.transpose(w, (*range(2, n + 2), 1, 0))
    return w


def run(lhs, rhs, p: Plan):
    """Runs a kernel plan on the operands."""
    if p.compute_dtype is not None:
        lhs, rhs = lhs.astype(p.compute_dtype), rhs.astype(p.compute_dtype)
    if p.lhs_perm is not None:
        lhs = jnp.transpose(lhs, p.lhs_perm)
    if p.rhs_perm is not None:
        rhs = jnp.transpose(rhs, p.rhs_perm)
    if p.transposed:
        rhs = _transposed_weights(rhs, p.conv.groups, p.conv.weights_format)
    out = bind(lhs, rhs, p.conv)
    if p.out_perm is not None:
        out = jnp.transpose(out, p.out_perm)
    return out


def conv_general_dilated(lhs, rhs, window_strides: Sequence[int],
                         padding: str | Sequence[tuple[int, int]],
                         lhs_dilation: Sequence[int] | None = None,
                         rhs_dilation: Sequence[int] | None = None,
                         dimension_numbers=None, feature_group_count: int = 1,
                         batch_group_count: int = 1, precision=None,
                         preferred_element_type=None, out_sharding=None):
    """`jax.lax.conv_general_dilated` on convgrad's kernels: the same arguments,
    semantics and result. Its gradients run the data- and weight-gradient kernels (and
    theirs the forward one, so grad of grad works too). `precision` is accepted and
    changes nothing: the kernels sum in float32 whatever it asks. What no kernel covers
    runs lax's own convolution (see `explain`)."""
    lhs, rhs = as_array(lhs), as_array(rhs)
    p = plan(lhs.shape, rhs.shape, lhs.dtype, rhs.dtype, window_strides, padding,
             lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count,
             batch_group_count, preferred_element_type)
    if p.runs_kernel and out_sharding is None:
        log.debug("convgrad.jax: conv_general_dilated %s x %s runs %s", lhs.shape,
                  rhs.shape, p.describe())
        return run(lhs, rhs, p)
    if p.runs_kernel:
        p = _fallback("out_sharding given")
    log.debug("convgrad.jax: conv_general_dilated %s x %s runs %s", lhs.shape, rhs.shape,
              p.describe())
    return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation,
                                    rhs_dilation, dimension_numbers, feature_group_count,
                                    batch_group_count, precision, preferred_element_type,
                                    out_sharding)


_DEFAULT_SPECS = {1: ("NC", "IO", "NC"), 2: ("NHC", "HIO", "NHC"),
                  3: ("NHWC", "HWIO", "NHWC"), 4: ("NHWDC", "HWDIO", "NHWDC")}


def _transpose_padding(k: int, s: int, padding) -> tuple[int, int]:
    """Pads of the input-dilated convolution that a conv_transpose call means (lax's
    rules: SAME and VALID name the forward convolution's padding; a pair, with
    use_consistent_padding, too)."""
    if padding == "SAME":
        total = k + s - 2
        begin = k - 1 if s > k - 1 else -(-total // 2)
    elif padding == "VALID":
        total = k + s - 2 + max(k - s, 0)
        begin = k - 1
    else:
        lo, hi = (k - p - 1 for p in padding)
        return lo, hi
    return begin, total - begin


def conv_transpose(lhs, rhs, strides: Sequence[int], padding, rhs_dilation=None,
                   dimension_numbers=None, transpose_kernel: bool = False, precision=None,
                   preferred_element_type=None, use_consistent_padding: bool = False):
    """`jax.lax.conv_transpose` on convgrad's kernels (the data-gradient kernel runs the
    transposed convolution), with the same arguments and result."""
    lhs, rhs = as_array(lhs), as_array(rhs)
    n = lhs.ndim - 2
    if dimension_numbers is None:
        if lhs.ndim - 1 not in _DEFAULT_SPECS:
            raise ValueError("No 4+ dimensional dimension_number defaults.")
        dimension_numbers = _DEFAULT_SPECS[lhs.ndim - 1]
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    kernel = [rhs.shape[d] for d in dn.rhs_spec[2:]]
    dilation = tuple(rhs_dilation or (1,) * n)
    if use_consistent_padding or (isinstance(padding, str) and padding in ("SAME", "VALID")):
        per_axis = [padding] * n if isinstance(padding, str) else [tuple(p) for p in padding]
        pads = [_transpose_padding(extent(k, d), s, p)
                for k, d, s, p in zip(kernel, dilation, strides, per_axis, strict=True)]
    else:
        pads = padding
    if transpose_kernel:
        rhs = jnp.flip(rhs, axis=tuple(dn.rhs_spec[2:]))
        rhs = jnp.swapaxes(rhs, dn.rhs_spec[0], dn.rhs_spec[1])
    return conv_general_dilated(lhs, rhs, (1,) * n, pads, tuple(strides), dilation, dn,
                                precision=precision,
                                preferred_element_type=preferred_element_type)


def explain(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
            dimension_numbers=None, feature_group_count: int = 1, batch_group_count: int = 1,
            precision=None, preferred_element_type=None) -> str:
    """Which path a conv_general_dilated call with these arguments takes, and why
    (arrays or anything with .shape and .dtype, such as jax.ShapeDtypeStruct)."""
    del precision
    p = plan(tuple(lhs.shape), tuple(rhs.shape), lhs.dtype, rhs.dtype, window_strides,
             padding, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count,
             batch_group_count, preferred_element_type)
    return p.describe()
