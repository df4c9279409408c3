"""Tests of the numpy reference (tests/reference.py): against PyTorch and hand-worked examples."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from convgrad.reference import reference, reference_shape  # noqa: E402

DATA_OPS = ("ConvolutionBackpropData", "ConvolutionBackwardData")
WEIGHTS_OPS = ("ConvolutionBackpropFilters", "ConvolutionBackwardWeights")
SHAPE_NAME = {
    "ConvolutionBackpropData": "output_shape",
    "ConvolutionBackwardData": "dst_shape",
    "ConvolutionBackpropFilters": "filter_shape",
    "ConvolutionBackwardWeights": "weights_shape",
    "ConvTransposeBackwardWeights": "weights_shape",
}
FMT_NAME = {
    "ConvolutionBackpropData": "filter_format",
    "ConvolutionBackwardData": "weights_format",
    "ConvolutionBackpropFilters": "filter_format",
    "ConvolutionBackwardWeights": "weights_format",
    "ConvTransposeBackwardData": "weights_format",
    "ConvTransposeBackwardWeights": "weights_format",
}


# ----------------------------------------------------------------------------
# PyTorch comparisons
# ----------------------------------------------------------------------------

# Forward-convolution geometry: Y input positions -> X output positions per axis.
# (name, N, IC, OC, groups, k, s, d, pb, pe, Y); IC/OC are the forward convolution's
# channels; for ConvTranspose ops IC is the ConvTranspose src channels and OC its dst.
CONFIGS = [
    ("1d-basic", 2, 3, 4, 1, (3,), (1,), (1,), (0,), (0,), (7,)),
    ("1d-g2-s2-asym", 2, 4, 6, 2, (3,), (2,), (1,), (2,), (1,), (9,)),
    ("1d-d2-asym", 1, 2, 3, 1, (3,), (1,), (2,), (1,), (3,), (8,)),
    ("1d-dw-s3-bigpad", 2, 4, 4, 4, (2,), (3,), (1,), (3,), (4,), (5,)),
    ("1d-s3-remainder", 3, 2, 2, 1, (4,), (3,), (1,), (0,), (0,), (11,)),
    ("2d-basic-asym", 2, 3, 5, 1, (3, 2), (1, 2), (1, 1), (1, 0), (0, 1), (6, 7)),
    ("2d-g2-s2-d2", 1, 4, 6, 2, (3, 3), (2, 2), (2, 1), (2, 1), (1, 2), (9, 8)),
    ("2d-dw-mult2", 2, 3, 6, 3, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), (7, 6)),
    ("2d-1x1-s2", 2, 4, 2, 1, (1, 1), (2, 2), (1, 1), (0, 0), (0, 0), (5, 6)),
    ("3d-basic-asym", 1, 2, 3, 1, (2, 3, 2), (1, 2, 1), (1, 1, 2), (0, 1, 1), (1, 0, 2), (4, 5, 6)),
    ("3d-g2-s2", 2, 4, 4, 2, (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), (0, 0, 0), (5, 5, 5)),
    ("3d-dw-d2", 1, 3, 3, 3, (2, 2, 2), (1, 1, 1), (2, 2, 2), (1, 0, 1), (0, 1, 1), (4, 5, 3)),
]
LAYOUTS = [("NCX", "first"), ("NXC", "first"), ("NCX", "last"), ("NXC", "last"),
           ("NXC", "inner")]  # inner: torch's channels_last weights, OXI / IXO


def _cfg(config):
    name, n, ic, oc, g, k, s, d, pb, pe, y = config
    big_k = tuple(di * (ki - 1) + 1 for ki, di in zip(k, d, strict=True))
    span = [yi + b + e - kk for yi, b, e, kk in zip(y, pb, pe, big_k, strict=True)]
    x = tuple(sp // si + 1 for sp, si in zip(span, s, strict=True))
    rem = tuple(sp % si for sp, si in zip(span, s, strict=True))
    return dict(n=n, ic=ic, oc=oc, g=g, k=k, s=s, d=d, pb=pb, pe=pe, Y=y, X=x, K=big_k, rem=rem)


def _ints(torch, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=gen).to(torch.float64)


def _pad(torch, t, pb, pe):
    """Pad (or crop, for negative values) the spatial axes of an NCX tensor."""
    pads = []
    for b, e in reversed(list(zip(pb, pe, strict=True))):
        pads += [b, e]
    return torch.nn.functional.pad(t, pads)


def _data_out(t, data_format):
    """NCX torch tensor -> numpy array in the data format."""
    a = t.detach().numpy()
    return np.moveaxis(a, 1, -1).copy() if data_format == "NXC" else a.copy()


def _weights_out(t, where):
    """(A, B, k...) torch tensor -> numpy (A, B, k...), (k..., B, A) or (A, k..., B)."""
    a = t.detach().numpy()
    if where == "last":
        nsp = a.ndim - 2
        return np.moveaxis(a, (0, 1), (nsp + 1, nsp)).copy()
    if where == "inner":
        return np.moveaxis(a, 1, -1).copy()
    return a.copy()


def _conv_fmt(where):
    return {"first": "OIX", "last": "XIO", "inner": "OXI"}[where]


def _convt_fmt(where):
    return {"first": "IOX", "last": "XOI", "inner": "IXO"}[where]


def _full_data_shape(n, c, sp, data_format):
    return [n, c, *sp] if data_format == "NCX" else [n, *sp, c]


def _conv_forward(torch, c, seed):
    """Leaf src and weights, the forward output of a padded convolution, and a diff_dst."""
    F = torch.nn.functional
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(c["k"])]
    x = _ints(torch, (c["n"], c["ic"], *c["Y"]), seed).requires_grad_()
    w = _ints(torch, (c["oc"], c["ic"] // c["g"], *c["k"]), seed + 1).requires_grad_()
    out = conv(_pad(torch, x, c["pb"], c["pe"]), w, stride=c["s"], dilation=c["d"], groups=c["g"])
    assert tuple(out.shape[2:]) == c["X"]
    dy = _ints(torch, out.shape, seed + 2)
    out.backward(dy)
    return x, w, dy


def _convt_forward(torch, c, seed):
    """Leaf src and weights of a ConvTranspose, asymmetric pads by cropping, and a diff_dst."""
    F = torch.nn.functional
    convt = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[len(c["k"])]
    src = _ints(torch, (c["n"], c["ic"], *c["X"]), seed).requires_grad_()
    w = _ints(torch, (c["ic"], c["oc"] // c["g"], *c["k"]), seed + 1).requires_grad_()
    full = convt(src, w, stride=c["s"], output_padding=c["rem"], groups=c["g"], dilation=c["d"])
    dst = _pad(torch, full, [-b for b in c["pb"]], [-e for e in c["pe"]])
    assert tuple(dst.shape[2:]) == c["Y"]
    dd = _ints(torch, dst.shape, seed + 2)
    dst.backward(dd)
    return src, w, dd


def _attrs(c, data_format, fmt_name, fmt, **extra):
    attrs = dict(strides=list(c["s"]), dilations=list(c["d"]), pads_begin=list(c["pb"]),
                 pads_end=list(c["pe"]), groups=c["g"], data_format=data_format)
    attrs[fmt_name] = fmt
    attrs.update(extra)
    return attrs


def _check(op, inputs, attrs, expected):
    got = reference(op, inputs, attrs)
    assert got.dtype == np.float64
    shapes = [np.shape(inputs[0]), np.shape(inputs[1])] + list(inputs[2:])
    assert reference_shape(op, shapes, attrs) == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join(v))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda v: v[0])
@pytest.mark.parametrize("op", DATA_OPS)
@pytest.mark.parametrize("shape_mode", ["none", "spatial_input", "full_attr"])
def test_conv_backward_data_vs_torch(op, config, layout, shape_mode):
    torch = pytest.importorskip("torch")
    c = _cfg(config)
    data_format, where = layout
    x, w, dy = _conv_forward(torch, c, seed=len(config[0]))
    attrs = _attrs(c, data_format, FMT_NAME[op], _conv_fmt(where))
    inputs = [_data_out(dy, data_format), _weights_out(w, where)]
    if shape_mode == "none":
        attrs["output_padding"] = list(c["rem"])  # lengthens the result to Y
    elif shape_mode == "spatial_input":
        attrs[SHAPE_NAME[op]] = [99] * len(c["k"])  # the shape input wins
        inputs.append(np.array(c["Y"], dtype=np.int32))
    else:
        attrs[SHAPE_NAME[op]] = _full_data_shape(c["n"], c["ic"], c["Y"], data_format)
    _check(op, inputs, attrs, _data_out(x.grad, data_format))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join(v))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda v: v[0])
@pytest.mark.parametrize("op", WEIGHTS_OPS)
@pytest.mark.parametrize("shape_mode", ["spatial_attr", "full_input"])
def test_conv_backward_weights_vs_torch(op, config, layout, shape_mode):
    torch = pytest.importorskip("torch")
    c = _cfg(config)
    data_format, where = layout
    x, w, dy = _conv_forward(torch, c, seed=len(config[0]) + 7)
    fmt = _conv_fmt(where)
    attrs = _attrs(c, data_format, FMT_NAME[op], fmt)
    inputs = [_data_out(x, data_format), _data_out(dy, data_format)]
    expected = _weights_out(w.grad, where)
    if shape_mode == "spatial_attr":
        attrs[SHAPE_NAME[op]] = list(c["k"])
    else:
        inputs.append(list(expected.shape))
    _check(op, inputs, attrs, expected)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join(v))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda v: v[0])
def test_conv_transpose_backward_data_vs_torch(config, layout):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    c = _cfg(config)
    data_format, where = layout
    src, w, dd = _convt_forward(torch, c, seed=len(config[0]) + 3)
    op = "ConvTransposeBackwardData"
    # output_padding is accepted and changes nothing
    attrs = _attrs(c, data_format, FMT_NAME[op], _convt_fmt(where),
                   output_padding=[si - 1 for si in c["s"]])
    inputs = [_data_out(dd, data_format), _weights_out(w, where)]
    _check(op, inputs, attrs, _data_out(src.grad, data_format))
    # ... and it is a forward convolution of diff_dst with the weights read as (IC, OC/g)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(c["k"])]
    fwd = conv(_pad(torch, dd, c["pb"], c["pe"]), w.detach(), stride=c["s"], dilation=c["d"],
               groups=c["g"])
    _check(op, inputs, attrs, _data_out(fwd, data_format))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "-".join(v))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda v: v[0])
@pytest.mark.parametrize("shape_mode", ["spatial_input", "full_attr"])
def test_conv_transpose_backward_weights_vs_torch(config, layout, shape_mode):
    torch = pytest.importorskip("torch")
    c = _cfg(config)
    data_format, where = layout
    src, w, dd = _convt_forward(torch, c, seed=len(config[0]) + 5)
    op = "ConvTransposeBackwardWeights"
    attrs = _attrs(c, data_format, FMT_NAME[op], _convt_fmt(where))
    inputs = [_data_out(src, data_format), _data_out(dd, data_format)]
    expected = _weights_out(w.grad, where)
    if shape_mode == "spatial_input":
        inputs.append(tuple(c["k"]))
    else:
        attrs["weights_shape"] = list(expected.shape)
    _check(op, inputs, attrs, expected)


@pytest.mark.parametrize("mode", ["same_upper", "same_lower", "SAME_UPPER", "valid"])
def test_backward_weights_auto_pad_vs_torch(mode):
    """auto_pad on BackwardWeights is TF-style SAME on the src size (pads worked out here)."""
    torch = pytest.importorskip("torch")
    # Y = (8, 7), k = (3, 2), s = (2, 3): TF totals are 3 - 2 = 1 and 2 - 1 = 1,
    # so (pads_begin, pads_end) are ((0, 0), (1, 1)) for same_upper, ((1, 1), (0, 0)) for same_lower
    pads = {"same_upper": ((0, 0), (1, 1)), "same_lower": ((1, 1), (0, 0)),
            "SAME_UPPER": ((0, 0), (1, 1)), "valid": ((0, 0), (0, 0))}[mode]
    config = ("2d", 2, 2, 4, 2, (3, 2), (2, 3), (1, 1), pads[0], pads[1], (8, 7))
    c = _cfg(config)
    x, w, dy = _conv_forward(torch, c, seed=11)
    attrs = dict(strides=[2, 3], pads_begin=[5, 5], pads_end=[5, 5], auto_pad=mode, groups=2,
                 data_format="NCX", weights_format="OIX", weights_shape=[3, 2])
    _check("ConvolutionBackwardWeights", [x.detach().numpy(), dy.numpy()], attrs,
           w.grad.numpy())


# ----------------------------------------------------------------------------
# hand-worked 1-D examples (N = 1, C = 1, NCX, channels-first weights)
# ----------------------------------------------------------------------------


def _v(*values):
    return np.array(values, dtype=np.float64).reshape(1, 1, -1)


def _run(op, inputs, **attrs):
    attrs.setdefault("data_format", "NCX")
    attrs.setdefault(FMT_NAME[op], "IOX" if op.startswith("ConvTranspose") else "OIX")
    out = reference(op, inputs, attrs)
    shapes = [np.shape(inputs[0]), np.shape(inputs[1])] + list(inputs[2:])
    assert reference_shape(op, shapes, attrs) == out.shape
    return out.ravel().tolist()


# diff_dst [1, 2, 3] (X = 3), weights [10, 100] (k = 2), stride 2:
# y = 2x + j - pb, so without pads diff_src = [10, 100, 20, 200, 30, 300].
DY3, W2 = _v(1, 2, 3), _v(10, 100)
# weights [1, 10, 100] (k = 3), stride 2, for ConvolutionBackwardData's TF-style pads.
W3 = _v(1, 10, 100)


@pytest.mark.parametrize("op", DATA_OPS)
def test_hand_backward_data_explicit(op):
    assert _run(op, [DY3, W2], strides=2) == [10, 100, 20, 200, 30, 300]
    # output_padding lengthens the result at the end
    assert _run(op, [DY3, W2], strides=[2], output_padding=1) == [10, 100, 20, 200, 30, 300, 0]
    # pads_begin = 1: y = 2x + j - 1; position -1 (x = 0, j = 0) is dropped
    assert _run(op, [DY3, W2], strides=2, pads_begin=1) == [100, 20, 200, 30, 300]
    assert _run(op, [DY3, W2], strides=2, pads_end=[1], auto_pad="explicit") == \
        [10, 100, 20, 200, 30]
    assert _run(op, [DY3, W2], strides=2, pads_end=[1], auto_pad="") == [10, 100, 20, 200, 30]


def test_hand_backprop_data_rule1_without_output_shape():
    # same_* and valid use pads 0: Y = s*(X-1) + K + output_padding
    for mode in ("same_upper", "same_lower", "valid", "Same_Lower"):
        assert _run("ConvolutionBackpropData", [DY3, W2], strides=2, pads_begin=1, pads_end=1,
                    auto_pad=mode) == [10, 100, 20, 200, 30, 300]
    assert _run("ConvolutionBackpropData", [DY3, W2], strides=2, auto_pad="same_upper",
                output_padding=1) == [10, 100, 20, 200, 30, 300, 0]


def test_hand_backprop_data_rule1_with_output_shape():
    op = "ConvolutionBackpropData"
    # Y = 5: total = 2*2 + 2 - 5 = 1; same_upper puts the extra pad at the beginning
    assert _run(op, [DY3, W2, [5]], strides=2, auto_pad="same_upper") == [100, 20, 200, 30, 300]
    assert _run(op, [DY3, W2, [5]], strides=2, auto_pad="same_lower") == [10, 100, 20, 200, 30]
    # full shape (N, C, Y) as attribute, NCX and NXC
    assert _run(op, [DY3, W2], strides=2, auto_pad="SAME_UPPER", output_shape=[1, 1, 5]) == \
        [100, 20, 200, 30, 300]
    out = reference(op, [DY3.reshape(1, 3, 1), W2, [1, 5, 1]],
                    dict(strides=2, auto_pad="same_upper", filter_format="OIX"))
    assert out.shape == (1, 5, 1) and out.ravel().tolist() == [100, 20, 200, 30, 300]
    # output_padding enters the total: 1 + 1 = 2 -> pb = 1 either way
    for mode in ("same_upper", "same_lower"):
        assert _run(op, [DY3, W2, [5]], strides=2, auto_pad=mode, output_padding=1) == \
            [100, 20, 200, 30, 300]
    # Y = 8 > 6: total clamps at 0, the tail receives nothing
    assert _run(op, [DY3, W2, [8]], strides=2, auto_pad="same_upper") == \
        [10, 100, 20, 200, 30, 300, 0, 0]
    # valid: pads 0; none: the pad attributes; pb is the offset of position 0
    assert _run(op, [DY3, W2, [5]], strides=2, auto_pad="valid", pads_begin=1) == \
        [10, 100, 20, 200, 30]
    assert _run(op, [DY3, W2, [5]], strides=2, pads_begin=1) == [100, 20, 200, 30, 300]
    assert _run(op, [DY3, W2, [3]], strides=2, pads_begin=2) == [20, 200, 30]
    # the shape input wins over the attribute
    assert _run(op, [DY3, W2, [5]], strides=2, pads_begin=1, output_shape=[9]) == \
        [100, 20, 200, 30, 300]


def test_hand_backward_data_rule2_without_dst_shape():
    op = "ConvolutionBackwardData"
    # same_*: Y = X*s = 6, TF-style SAME on 6: total = 3 - 2 = 1
    # same_upper pb = 0: y = 2x + j
    assert _run(op, [DY3, W3], strides=2, auto_pad="same_upper") == [1, 10, 102, 20, 203, 30]
    # same_lower pb = 1: y = 2x + j - 1
    assert _run(op, [DY3, W3], strides=2, auto_pad="same_lower", pads_begin=3) == \
        [10, 102, 20, 203, 30, 300]
    # same_* ignores output_padding (Y = X*s)
    assert _run(op, [DY3, W3], strides=2, auto_pad="same_upper", output_padding=1) == \
        [1, 10, 102, 20, 203, 30]
    # valid: Y = s*(X-1) + K + output_padding, pads ignored
    assert _run(op, [DY3, W3], strides=2, auto_pad="valid", pads_begin=1) == \
        [1, 10, 102, 20, 203, 30, 300]
    assert _run(op, [DY3, W3], strides=2, auto_pad="VALID", output_padding=1) == \
        [1, 10, 102, 20, 203, 30, 300, 0]
    # none: Y = s*(X-1) + K - pb - pe + output_padding
    assert _run(op, [DY3, W3], strides=2, pads_begin=1, pads_end=1) == [10, 102, 20, 203, 30]
    assert _run(op, [DY3, W3], strides=2, pads_begin=1, pads_end=1, output_padding=1) == \
        [10, 102, 20, 203, 30, 300]


def test_hand_backward_data_rule2_with_dst_shape():
    op = "ConvolutionBackwardData"
    assert _run(op, [DY3, W3, [6]], strides=2, auto_pad="same_upper") == \
        [1, 10, 102, 20, 203, 30]
    assert _run(op, [DY3, W3, [1, 1, 6]], strides=2, auto_pad="same_lower") == \
        [10, 102, 20, 203, 30, 300]
    # Y = 5: TF total = 3 - 1 = 2 -> pb = pe = 1 for both
    for mode in ("same_upper", "same_lower"):
        assert _run(op, [DY3, W3], strides=2, auto_pad=mode, dst_shape=[5]) == \
            [10, 102, 20, 203, 30]
    # valid with Y = 7 and Y = 8 (both give X = 3); output_padding is not used
    assert _run(op, [DY3, W3, [7]], strides=2, auto_pad="valid", output_padding=1) == \
        [1, 10, 102, 20, 203, 30, 300]
    assert _run(op, [DY3, W3, [8]], strides=2, auto_pad="valid") == \
        [1, 10, 102, 20, 203, 30, 300, 0]
    assert _run(op, [DY3, W3, [5]], strides=2, pads_begin=1, pads_end=1) == \
        [10, 102, 20, 203, 30]
    # X must equal (Y + pb + pe - K) // s + 1
    with pytest.raises(ValueError, match="must equal"):
        reference(op, [DY3, W3, [9]], dict(strides=2, data_format="NCX", weights_format="OIX"))
    with pytest.raises(ValueError, match="must equal"):
        reference(op, [DY3, W3], dict(strides=2, auto_pad="same_upper", dst_shape=[4],
                                      data_format="NCX", weights_format="OIX"))
    with pytest.raises(ValueError, match="must equal"):
        reference_shape(op, [(1, 1, 3), (1, 1, 3), [9]], dict(strides=2, data_format="NCX",
                                                             weights_format="OIX"))


# src [1, 2, 3, 4, 5] (Y = 5), kernel 2, stride 2: dW[j] = sum_x src[2x + j - pb] * dy[x]
SRC5 = _v(1, 2, 3, 4, 5)


@pytest.mark.parametrize("op", WEIGHTS_OPS)
def test_hand_backward_weights(op):
    name = SHAPE_NAME[op]
    # valid / none: X = (5 - 2) // 2 + 1 = 2
    assert _run(op, [SRC5, _v(1, 10), [2]], strides=2) == [31, 42]
    assert _run(op, [SRC5, _v(1, 10)], strides=2, auto_pad="valid", pads_begin=1,
                **{name: [1, 1, 2]}) == [31, 42]
    # TF-style SAME on 5: total = 2 - 1 = 1; same_upper pb = 0, same_lower pb = 1; X = 3
    assert _run(op, [SRC5, _v(1, 10, 100), [2]], strides=2, auto_pad="same_upper") == [531, 42]
    assert _run(op, [SRC5, _v(1, 10, 100), [2]], strides=2, auto_pad="same_lower") == [420, 531]
    assert _run(op, [SRC5, _v(1, 10, 100), [2]], strides=2, pads_begin=1) == [420, 531]
    # XIO result layout (k, IC/g, OC)
    out = reference(op, [SRC5, _v(1, 10), [2, 1, 1]],
                    dict(strides=2, data_format="NCX", **{FMT_NAME[op]: "XIO"}))
    assert out.shape == (2, 1, 1) and out.ravel().tolist() == [31, 42]
    # X must equal (Y + pb + pe - K) // s + 1
    with pytest.raises(ValueError, match="must equal"):
        reference(op, [SRC5, _v(1, 10), [2]], dict(strides=2, auto_pad="same_upper",
                                                    data_format="NCX"))
    # the kernel extent is required
    with pytest.raises(ValueError):
        reference(op, [SRC5, _v(1, 10)], dict(strides=2, data_format="NCX"))


def test_hand_conv_transpose_backward_data():
    op = "ConvTransposeBackwardData"
    # diff_src[x] = sum_j diff_dst[2x + j - pb] * W[j]
    assert _run(op, [SRC5, W2], strides=2) == [210, 430]
    assert _run(op, [SRC5, W2], strides=2, auto_pad="valid", pads_end=1) == [210, 430]
    assert _run(op, [SRC5, W2], strides=2, output_padding=1) == [210, 430]
    # TF-style SAME on the diff_dst size 5: total 1
    assert _run(op, [SRC5, W2], strides=2, auto_pad="same_upper") == [210, 430, 50]
    assert _run(op, [SRC5, W2], strides=2, auto_pad="same_lower") == [100, 320, 540]
    assert _run(op, [SRC5, W2], strides=2, pads_begin=1, pads_end=0) == [100, 320, 540]
    # X must be at least 1
    with pytest.raises(ValueError):
        reference(op, [_v(1), W3], dict(data_format="NCX", weights_format="IOX"))


def test_hand_conv_transpose_backward_weights():
    op = "ConvTransposeBackwardWeights"
    # diff_W[j] = sum_x diff_dst[2x + j - pb] * src[x]
    assert _run(op, [_v(1, 10), SRC5, [2]], strides=2) == [31, 42]
    assert _run(op, [_v(1, 10, 100), SRC5, [2]], strides=2, auto_pad="same_upper") == [531, 42]
    assert _run(op, [_v(1, 10, 100), SRC5], strides=2, auto_pad="same_lower",
                weights_shape=[1, 1, 2]) == [420, 531]
    with pytest.raises(ValueError, match="must equal"):
        reference(op, [_v(1, 10), SRC5, [2]], dict(strides=2, auto_pad="same_lower",
                                                   data_format="NCX", weights_format="IOX"))


def test_hand_groups_and_channels():
    # k = 1, groups = 2, NXC: diff_src[c] = diff_dst[c] * W[c]; XIO weights (1, IC/g = 1, OC = 2)
    dy = np.array([[[1.0, 2.0], [3.0, 4.0]]])  # (N=1, X=2, C=2)
    w = np.array([[[10.0, 100.0]]])
    out = reference("ConvolutionBackwardData", [dy, w], dict(groups=2))
    assert out.tolist() == [[[10, 200], [30, 400]]]
    # groups = 1, IC = 1, OC = 2: the two output channels are summed
    out = reference("ConvolutionBackwardData", [dy, w.reshape(1, 1, 2)], {})
    assert out.tolist() == [[[210], [430]]]
    # ConvTranspose XOI weights (k, OC/g, IC): IC = 1, OC = 2 -> forward conv summing channels
    out = reference("ConvTransposeBackwardData", [dy, np.array([[[10.0], [100.0]]])], {})
    assert out.tolist() == [[[210], [430]]]


# ----------------------------------------------------------------------------
# dtypes, batch 0, defaults
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_low_precision_inputs_computed_in_float64(dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)
    dy = rng.standard_normal((2, 5, 5, 4)).astype(dt)
    w = rng.standard_normal((3, 3, 4, 4)).astype(dt)
    attrs = dict(strides=2, pads_begin=1, pads_end=1)
    got = reference("ConvolutionBackwardData", [dy, w], attrs)
    want = reference("ConvolutionBackwardData", [dy.astype(np.float64), w.astype(np.float64)],
                     attrs)
    assert got.dtype == np.float64 and got.shape == (2, 9, 9, 4)
    np.testing.assert_array_equal(got, want)


def test_batch_zero():
    w = np.ones((3, 3, 2, 4))
    out = reference("ConvolutionBackwardData", [np.zeros((0, 4, 4, 4)), w], {})
    assert out.shape == (0, 6, 6, 2)
    out = reference("ConvTransposeBackwardData", [np.zeros((0, 6, 6, 4)), np.ones((3, 3, 4, 2))],
                    {})
    assert out.shape == (0, 4, 4, 2)
    out = reference("ConvolutionBackwardWeights", [np.zeros((0, 6, 6, 2)), np.zeros((0, 4, 4, 4))],
                    dict(weights_shape=[3, 3]))
    assert out.shape == (3, 3, 2, 4) and not out.any()
    out = reference("ConvTransposeBackwardWeights",
                    [np.zeros((0, 2, 4, 4)), np.zeros((0, 4, 6, 6)), [2, 2, 3, 3]],
                    dict(data_format="NCX", weights_format="IOX", groups=2))
    assert out.shape == (2, 2, 3, 3) and not out.any()


def test_defaults_and_scalar_broadcast():
    rng = np.random.default_rng(1)
    dy = rng.integers(-3, 4, (1, 4, 5, 3)).astype(np.float64)
    w = rng.integers(-3, 4, (3, 3, 2, 3)).astype(np.float64)
    explicit = dict(strides=[1, 1], dilations=[1, 1], pads_begin=[0, 0], pads_end=[0, 0],
                    auto_pad="none", output_padding=[0, 0], groups=1, data_format="NXC",
                    weights_format="XIO")
    np.testing.assert_array_equal(reference("ConvolutionBackwardData", [dy, w], {}),
                                  reference("ConvolutionBackwardData", [dy, w], explicit))
    np.testing.assert_array_equal(
        reference("ConvolutionBackwardData", [dy, w], dict(strides=2, pads_begin=1, dilations=2)),
        reference("ConvolutionBackwardData", [dy, w],
                  dict(strides=[2, 2], pads_begin=[1, 1], dilations=[2, 2])))
    assert reference_shape("ConvolutionBackwardData", [dy.shape, w.shape, None], {}) == \
        (1, 6, 7, 2)


def test_large_layer_is_fast():
    import time

    rng = np.random.default_rng(2)
    dy = rng.standard_normal((1, 56, 56, 64)).astype(np.float32)
    w = rng.standard_normal((3, 3, 64, 64)).astype(np.float32)
    start = time.perf_counter()
    out = reference("ConvolutionBackwardData", [dy, w], dict(pads_begin=1, pads_end=1))
    reference("ConvolutionBackwardWeights", [out, dy, [3, 3]], dict(pads_begin=1, pads_end=1))
    assert time.perf_counter() - start < 5.0
