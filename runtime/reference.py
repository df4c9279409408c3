"""Independent numpy reference for the convolution-gradient ops of docs/semantics.md.

Written straight from the contract (``docs/semantics.md``) and sharing nothing with the
code generator or the runtime. Everything is computed in float64; the caller
rounds the result to the dtype under test.

Internally every op is reduced to one forward convolution and its two gradients,
on canonical layouts:

* data: ``(N, G, C/G, spatial...)``;
* weights: ``(G, A/G, B, k...)`` where ``(A, B, k...)`` is the channels-first
  weights format (``OIX`` for convolution ops, ``IOX`` for ConvTranspose ops).

On one spatial axis the forward convolution maps ``Y`` input positions to ``X``
output positions with ``y = x*s - pb + j*d``:

=============================  ======================  =======================
op family                      forward input (Y)       forward output (X)
=============================  ======================  =======================
Convolution*Data               result (diff_src)       diff_dst
Convolution*Filters/Weights    src                     diff_dst
ConvTransposeBackwardData      diff_dst                result (diff_src)
ConvTransposeBackwardWeights   diff_dst                src
=============================  ======================  =======================
"""

from itertools import product

import numpy as np

__all__ = ["OP_KINDS", "reference", "reference_shape"]

# op kind -> (family, shape input/attribute name, weights-format attribute name)
_OPS = {
    "ConvolutionBackpropData": ("conv_data", "output_shape", "filter_format"),
    "ConvolutionBackwardData": ("conv_data", "dst_shape", "weights_format"),
    "ConvolutionBackpropFilters": ("conv_weights", "filter_shape", "filter_format"),
    "ConvolutionBackwardWeights": ("conv_weights", "weights_shape", "weights_format"),
    "ConvTransposeBackwardData": ("convt_data", None, "weights_format"),
    "ConvTransposeBackwardWeights": ("convt_weights", "weights_shape", "weights_format"),
}
OP_KINDS = tuple(_OPS)

_CHANNELS_LAST_WEIGHTS = ("XIO", "XOI")  # (k..., B, A)
_CHANNELS_INNER_WEIGHTS = ("OXI", "IXO")  # (A, k..., B): torch's channels_last weights


# ----------------------------------------------------------------------------
# attributes
# ----------------------------------------------------------------------------


def _per_axis(attrs, name, nsp, default):
    """A per-axis attribute as a tuple of nsp ints; a scalar applies to every axis."""
    value = attrs.get(name)
    if value is None:
        return (default,) * nsp
    if np.ndim(value) == 0:
        return (int(value),) * nsp
    value = tuple(int(v) for v in np.asarray(value).ravel())
    if len(value) != nsp:
        raise ValueError(f"{name}={value!r}: expected {nsp} values")
    return value


def _auto_pad(attrs):
    """The auto_pad mode, lower case, with 'explicit' and '' folded into 'none'."""
    mode = attrs.get("auto_pad")
    mode = "none" if mode is None else str(mode).lower()
    if mode in ("", "explicit"):
        mode = "none"
    if mode not in ("none", "same_upper", "same_lower", "valid"):
        raise ValueError(f"auto_pad={attrs.get('auto_pad')!r}: unknown value")
    return mode


def _weights_format(op_kind, attrs):
    """The weights format of an op: its own attribute name, else the other spelling."""
    family, _, fmt_name = _OPS[op_kind]
    other = "weights_format" if fmt_name == "filter_format" else "filter_format"
    transpose = family.startswith("convt")
    fmt = attrs.get(fmt_name, attrs.get(other))
    if fmt is None:
        fmt = "XOI" if transpose else "XIO"
    allowed = ("IOX", "XOI", "IXO") if transpose else ("OIX", "XIO", "OXI")
    if fmt not in allowed:
        raise ValueError(f"{fmt_name}={fmt!r}: expected one of {allowed}")
    return fmt


def _tf_same(size, k, s):
    """TF-style SAME total pad on an input of `size` positions (effective kernel k, stride s)."""
    total = max(k - (size % s if size % s else s), 0)
    return total


def _same_pads(mode, total):
    """Split a TF-style total pad: same_upper pb = total//2, same_lower pb = (total+1)//2."""
    pb = total // 2 if mode == "same_upper" else (total + 1) // 2
    return pb, total - pb


# ----------------------------------------------------------------------------
# shapes
# ----------------------------------------------------------------------------


def _split_data(shape, data_format):
    """(N, C, spatial) of a data shape in NXC / NCX order."""
    shape = tuple(int(v) for v in shape)
    if data_format == "NCX":
        return shape[0], shape[1], shape[2:]
    return shape[0], shape[-1], shape[1:-1]


def _make_data(n, c, spatial, data_format):
    """A data shape in NXC / NCX order."""
    spatial = tuple(spatial)
    if data_format == "NCX":
        return (n, c) + spatial
    return (n,) + spatial + (c,)


def _split_weights(shape, fmt):
    """(A, B, k) of a weights shape; (A, B) are (OC, IC/g) for OIX/XIO/OXI, (IC, OC/g) for
    IOX/XOI/IXO."""
    shape = tuple(int(v) for v in shape)
    if fmt in _CHANNELS_LAST_WEIGHTS:
        return shape[-1], shape[-2], shape[:-2]
    if fmt in _CHANNELS_INNER_WEIGHTS:
        return shape[0], shape[-1], shape[1:-1]
    return shape[0], shape[1], shape[2:]


def _make_weights(a, b, k, fmt):
    """A weights shape from (A, B, k) in the given format."""
    k = tuple(k)
    if fmt in _CHANNELS_LAST_WEIGHTS:
        return k + (b, a)
    if fmt in _CHANNELS_INNER_WEIGHTS:
        return (a,) + k + (b,)
    return (a, b) + k


def _as_shape(value):
    """A shape input or attribute as a tuple of ints (None stays None)."""
    if value is None:
        return None
    return tuple(int(v) for v in np.asarray(value).ravel())


def _data_spatial_from(value, nsp, data_format, n, c, name):
    """Spatial sizes from a full (N, C, spatial in data_format order) or spatial-only shape."""
    if len(value) == nsp:
        return value
    if len(value) == nsp + 2:
        vn, vc, sp = _split_data(value, data_format)
        if vn != n or vc != c:
            raise ValueError(f"{name}={value!r}: expected N={n}, C={c}")
        return sp
    raise ValueError(f"{name}={value!r}: expected {nsp} or {nsp + 2} values")


def _kernel_from(value, nsp, fmt, a, b, name):
    """Kernel sizes from a full (weights-format order) or spatial-only weights shape."""
    if len(value) == nsp:
        return value
    if len(value) == nsp + 2:
        va, vb, k = _split_weights(value, fmt)
        if (va, vb) != (a, b):
            raise ValueError(f"{name}={value!r}: expected channels ({a}, {b}) in {fmt}")
        return k
    raise ValueError(f"{name}={value!r}: expected {nsp} or {nsp + 2} values")


def _plan(op_kind, shapes, shape_value, attrs):
    """Shape inference and pads for one call.

    Returns a dict with the family, layouts, groups, per-axis s, d, k, pb, the
    forward-convolution sizes Y (input) and X (output), and the result shape.
    """
    if op_kind not in _OPS:
        raise ValueError(f"unknown op kind {op_kind!r}")
    family, shape_name, _ = _OPS[op_kind]
    a_shape, b_shape = tuple(shapes[0]), tuple(shapes[1])
    nsp = len(a_shape) - 2
    if nsp not in (1, 2, 3) or len(b_shape) != nsp + 2:
        raise ValueError(f"{op_kind}: wrong ranks {a_shape}, {b_shape}")
    data_format = attrs.get("data_format", "NXC")
    if data_format not in ("NXC", "NCX"):
        raise ValueError(f"data_format={data_format!r}: expected NXC or NCX")
    wfmt = _weights_format(op_kind, attrs)
    s = _per_axis(attrs, "strides", nsp, 1)
    d = _per_axis(attrs, "dilations", nsp, 1)
    op = _per_axis(attrs, "output_padding", nsp, 0)
    groups = int(attrs.get("groups", 1))
    mode = _auto_pad(attrs)
    if mode == "none":
        pb = _per_axis(attrs, "pads_begin", nsp, 0)
        pe = _per_axis(attrs, "pads_end", nsp, 0)
    else:
        pb = pe = (0,) * nsp
    pb, pe = list(pb), list(pe)
    if shape_value is None and shape_name is not None:
        shape_value = attrs.get(shape_name)
    shape_value = _as_shape(shape_value)

    def eff(k):
        return [d[i] * (k[i] - 1) + 1 for i in range(nsp)]

    def tf_same_on(sizes, K):
        if mode.startswith("same"):
            for i in range(nsp):
                pb[i], pe[i] = _same_pads(mode, _tf_same(sizes[i], K[i], s[i]))

    def check_x(X, Y, K, what):
        want = tuple((Y[i] + pb[i] + pe[i] - K[i]) // s[i] + 1 for i in range(nsp))
        if tuple(X) != want:
            raise ValueError(f"{op_kind}: {what} spatial size {tuple(X)} must equal {want}")

    if family == "conv_data":
        n, oc, X = _split_data(a_shape, data_format)
        wa, icg, k = _split_weights(b_shape, wfmt)
        if wa != oc or oc % groups:
            raise ValueError(f"{op_kind}: weights {b_shape} do not match diff_dst channels {oc}")
        ic = icg * groups
        K = eff(k)
        if shape_value is not None:
            Y = _data_spatial_from(shape_value, nsp, data_format, n, ic, shape_name)
            if op_kind == "ConvolutionBackpropData":  # rule 1, with output_shape
                if mode.startswith("same"):
                    for i in range(nsp):
                        total = max(s[i] * (X[i] - 1) + K[i] - Y[i] + op[i], 0)
                        if mode == "same_upper":
                            pe[i] = total // 2
                            pb[i] = total - pe[i]
                        else:
                            pb[i] = total // 2
                            pe[i] = total - pb[i]
            else:  # rule 2, with dst_shape
                tf_same_on(Y, K)
                check_x(X, Y, K, "diff_dst")
        elif op_kind == "ConvolutionBackpropData":  # rule 1, without output_shape
            Y = [s[i] * (X[i] - 1) + K[i] - pb[i] - pe[i] + op[i] for i in range(nsp)]
        elif mode.startswith("same"):  # rule 2, without dst_shape
            Y = [X[i] * s[i] for i in range(nsp)]
            tf_same_on(Y, K)
        else:
            Y = [s[i] * (X[i] - 1) + K[i] - pb[i] - pe[i] + op[i] for i in range(nsp)]
        if min(Y) < 1:
            raise ValueError(f"{op_kind}: result spatial size {tuple(Y)} is empty")
        result = _make_data(n, ic, Y, data_format)
    elif family == "conv_weights":
        n, ic, Y = _split_data(a_shape, data_format)
        n2, oc, X = _split_data(b_shape, data_format)
        if n2 != n or ic % groups or oc % groups:
            raise ValueError(f"{op_kind}: src {a_shape} and diff_dst {b_shape} disagree")
        if shape_value is None:
            raise ValueError(f"{op_kind}: {shape_name} is required")
        k = _kernel_from(shape_value, nsp, wfmt, oc, ic // groups, shape_name)
        K = eff(k)
        tf_same_on(Y, K)
        check_x(X, Y, K, "diff_dst")
        result = _make_weights(oc, ic // groups, k, wfmt)
    elif family == "convt_data":
        n, oc, Y = _split_data(a_shape, data_format)
        ic, ocg, k = _split_weights(b_shape, wfmt)
        if ocg * groups != oc or ic % groups:
            raise ValueError(f"{op_kind}: weights {b_shape} do not match diff_dst channels {oc}")
        K = eff(k)
        tf_same_on(Y, K)
        X = [(Y[i] + pb[i] + pe[i] - K[i]) // s[i] + 1 for i in range(nsp)]
        if min(X) < 1:
            raise ValueError(f"{op_kind}: diff_src spatial size {tuple(X)} must be at least 1")
        result = _make_data(n, ic, X, data_format)
    else:  # convt_weights
        n, ic, X = _split_data(a_shape, data_format)
        n2, oc, Y = _split_data(b_shape, data_format)
        if n2 != n or ic % groups or oc % groups:
            raise ValueError(f"{op_kind}: src {a_shape} and diff_dst {b_shape} disagree")
        if shape_value is None:
            raise ValueError(f"{op_kind}: {shape_name} is required")
        k = _kernel_from(shape_value, nsp, wfmt, ic, oc // groups, shape_name)
        K = eff(k)
        tf_same_on(Y, K)
        check_x(X, Y, K, "src")
        result = _make_weights(ic, oc // groups, k, wfmt)

    return dict(
        family=family, data_format=data_format, wfmt=wfmt, groups=groups,
        s=tuple(s), d=tuple(d), k=tuple(k), pb=tuple(pb),
        Y=tuple(Y), X=tuple(X), result=tuple(int(v) for v in result),
    )


# ----------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------


def _data_to_canon(x, data_format, groups):
    """NXC/NCX data -> (N, G, C/G, spatial...)."""
    if data_format == "NXC":
        x = np.moveaxis(x, -1, 1)
    n, c = x.shape[:2]
    return x.reshape((n, groups, c // groups) + x.shape[2:])


def _data_from_canon(xc, data_format):
    """(N, G, C/G, spatial...) -> NXC/NCX data."""
    n, g, cg = xc.shape[:3]
    x = xc.reshape((n, g * cg) + xc.shape[3:])
    if data_format == "NXC":
        x = np.moveaxis(x, 1, -1)
    return np.ascontiguousarray(x)


def _weights_to_canon(w, fmt, groups):
    """Weights in any format -> (G, A/G, B, k...)."""
    if fmt in _CHANNELS_LAST_WEIGHTS:
        nsp = w.ndim - 2
        w = np.moveaxis(w, (nsp + 1, nsp), (0, 1))
    elif fmt in _CHANNELS_INNER_WEIGHTS:  # (A, k..., B)
        w = np.moveaxis(w, -1, 1)
    a, b = w.shape[:2]
    return w.reshape((groups, a // groups, b) + w.shape[2:])


def _weights_from_canon(wc, fmt):
    """(G, A/G, B, k...) -> weights in the given format."""
    g, ag, b = wc.shape[:3]
    w = wc.reshape((g * ag, b) + wc.shape[3:])
    if fmt in _CHANNELS_LAST_WEIGHTS:
        nsp = w.ndim - 2
        w = np.moveaxis(w, (0, 1), (nsp + 1, nsp))
    elif fmt in _CHANNELS_INNER_WEIGHTS:
        w = np.moveaxis(w, 1, -1)
    return np.ascontiguousarray(w)


# ----------------------------------------------------------------------------
# the three kernels, one tap at a time
# ----------------------------------------------------------------------------


def _tap_slices(tap, p):
    """Index ranges hit by one tap: (x slices, y slices, counts), or None if it hits nothing.

    Positions x in [0, X) with y = x*s - pb + j*d in [0, Y); clipped, never wrapped.
    """
    xs, ys, counts = [], [], []
    for j, s, d, pb, X, Y in zip(tap, p["s"], p["d"], p["pb"], p["X"], p["Y"], strict=True):
        off = j * d - pb
        lo = max(0, (-off + s - 1) // s)
        hi = min(X - 1, (Y - 1 - off) // s)
        if hi < lo:
            return None
        xs.append(slice(lo, hi + 1))
        ys.append(slice(lo * s + off, hi * s + off + 1, s))
        counts.append(hi - lo + 1)
    return tuple(xs), tuple(ys), tuple(counts)


def _taps(p):
    """Every tap of the kernel with its index ranges, skipping taps that hit nothing."""
    for tap in product(*(range(k) for k in p["k"])):
        hit = _tap_slices(tap, p)
        if hit is not None:
            yield (tap,) + hit


def _forward(x, w, p):
    """out[n, g, o, x] = sum_{i, j} x[n, g, i, x*s - pb + j*d] * w[g, o, i, j]."""
    n, g, ig = x.shape[:3]
    og = w.shape[1]
    out = np.zeros((n, g, og) + p["X"])
    for tap, xsl, ysl, cnt in _taps(p):
        size = int(np.prod(cnt))
        src = x[(Ellipsis,) + ysl].reshape(n, g, ig, size)
        res = np.matmul(w[(Ellipsis,) + tap], src)  # (G, Og, Ig) @ (N, G, Ig, P)
        out[(Ellipsis,) + xsl] += res.reshape((n, g, og) + cnt)
    return out


def _backward_data(dy, w, p):
    """dx[n, g, i, y] = sum of dy[n, g, o, x] * w[g, o, i, j] over x*s - pb + j*d == y."""
    n, g, og = dy.shape[:3]
    ig = w.shape[2]
    dx = np.zeros((n, g, ig) + p["Y"])
    for tap, xsl, ysl, cnt in _taps(p):
        size = int(np.prod(cnt))
        grad = dy[(Ellipsis,) + xsl].reshape(n, g, og, size)
        wt = np.swapaxes(w[(Ellipsis,) + tap], 1, 2)  # (G, Ig, Og)
        dx[(Ellipsis,) + ysl] += np.matmul(wt, grad).reshape((n, g, ig) + cnt)
    return dx


def _backward_weights(x, dy, p):
    """dw[g, o, i, j] = sum_{n, x} x[n, g, i, x*s - pb + j*d] * dy[n, g, o, x]."""
    n, g, ig = x.shape[:3]
    og = dy.shape[2]
    dw = np.zeros((g, og, ig) + p["k"])
    for tap, xsl, ysl, cnt in _taps(p):
        size = int(np.prod(cnt))
        grad = dy[(Ellipsis,) + xsl].reshape(n, g, og, size)
        grad = np.moveaxis(grad, 0, 2).reshape(g, og, n * size)  # (G, Og, N*P)
        src = x[(Ellipsis,) + ysl].reshape(n, g, ig, size)
        src = np.moveaxis(src, 0, 2).reshape(g, ig, n * size)  # (G, Ig, N*P)
        dw[(Ellipsis,) + tap] = np.matmul(grad, np.swapaxes(src, 1, 2))
    return dw


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def _shape_input(inputs):
    """The optional third input (the shape input), or None."""
    return inputs[2] if len(inputs) > 2 else None


def reference_shape(op_kind, input_shapes, attrs):
    """Output shape of `op_kind` for the data input shapes, without computing anything.

    `input_shapes` holds the shapes of the two data inputs, optionally followed by
    the shape input's value (the integers it holds, or None).
    """
    p = _plan(op_kind, input_shapes[:2], _shape_input(input_shapes), dict(attrs))
    return p["result"]


def reference(op_kind, inputs, attrs):
    """Compute `op_kind` in float64 and return it in the requested output layout.

    `inputs`: the two data arrays in the order of docs/semantics.md's table, optionally
    followed by the shape input (sequence or 1-D int array, or None). `attrs`: the
    spec's attribute names; missing ones take the contract's defaults.
    """
    attrs = dict(attrs)
    a = np.asarray(inputs[0]).astype(np.float64)
    b = np.asarray(inputs[1]).astype(np.float64)
    p = _plan(op_kind, [a.shape, b.shape], _shape_input(inputs), attrs)
    fmt, wfmt, g = p["data_format"], p["wfmt"], p["groups"]
    if p["family"] == "conv_data":
        dy, w = _data_to_canon(a, fmt, g), _weights_to_canon(b, wfmt, g)
        return _data_from_canon(_backward_data(dy, w, p), fmt)
    if p["family"] == "conv_weights":
        x, dy = _data_to_canon(a, fmt, g), _data_to_canon(b, fmt, g)
        return _weights_from_canon(_backward_weights(x, dy, p), wfmt)
    if p["family"] == "convt_data":
        dd, w = _data_to_canon(a, fmt, g), _weights_to_canon(b, wfmt, g)
        return _data_from_canon(_forward(dd, w, p), fmt)
    # convt_weights: forward input is diff_dst, forward output is src
    src, dd = _data_to_canon(a, fmt, g), _data_to_canon(b, fmt, g)
    return _weights_from_canon(_backward_weights(dd, src, p), wfmt)
