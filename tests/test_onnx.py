"""ONNX models in, gradient-op layers out (convgrad.onnx_layers.load_onnx).

Each model is built here with onnx.helper. The layers are checked three ways: their
ops, shapes and attributes against values worked out by hand; every kernel against the
numpy reference, bit for bit; and the ONNX semantics themselves, by the adjoint identity
<node(x, w), dy> == <x, backward_data(dy, w)> == <w, backward_weights(x, dy)> with the
forward node run by onnx's own reference evaluator (integer data, so sums are exact).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import convgrad
from convgrad.onnx_layers import load_onnx
from convgrad.reference import reference

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CBD, CBW = "ConvolutionBackwardData", "ConvolutionBackwardWeights"
TBD, TBW = "ConvTransposeBackwardData", "ConvTransposeBackwardWeights"


def _weights(rng, shape):
    return rng.integers(-3, 4, size=shape).astype(np.float32)


def _save(path: Path, nodes, x_dims, weights: dict, opset=17) -> Path:
    graph = helper.make_graph(
        nodes, "model",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_dims))],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT,
                                       [None] * len(x_dims))],
        [onnx.numpy_helper.from_array(value, name) for name, value in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _single(op_type, x_dims, w_shape, **attrs):
    """One Conv/ConvTranspose node model: (nodes, x dims, weights)."""
    w = _weights(np.random.default_rng(1), w_shape)
    return [helper.make_node(op_type, ["x", "w"], ["y"], **attrs)], x_dims, {"w": w}


def _attrs(strides, dilations, groups, fmt, pads=None, auto_pad=None, **extra):
    attrs = {"strides": strides, "dilations": dilations, "groups": groups,
             "data_format": "NCX", "weights_format": fmt, **extra}
    if pads is not None:
        attrs.update(pads_begin=pads[0], pads_end=pads[1], auto_pad="none")
    else:
        attrs["auto_pad"] = auto_pad
    return attrs


# name -> (model builder, load_onnx keywords, expected [(op, inputs, attrs)], resolved pads)
CASES = {
    "conv_grouped_strided_asymmetric": (
        lambda: _single("Conv", (2, 4, 9, 8), (6, 2, 3, 3), strides=[2, 2],
                        pads=[1, 0, 2, 1], group=2),
        {},
        [(CBD, ((2, 6, 5, 4), (6, 2, 3, 3), (9, 8)),
          _attrs([2, 2], [1, 1], 2, "OIX", pads=([1, 0], [2, 1]))),
         (CBW, ((2, 4, 9, 8), (2, 6, 5, 4), (3, 3)),
          _attrs([2, 2], [1, 1], 2, "OIX", pads=([1, 0], [2, 1])))],
        ((1, 0), (2, 1))),
    "conv_depthwise": (
        lambda: _single("Conv", (2, 4, 7, 7), (4, 1, 3, 3), pads=[1, 1, 1, 1], group=4),
        {},
        [(CBD, ((2, 4, 7, 7), (4, 1, 3, 3), (7, 7)),
          _attrs([1, 1], [1, 1], 4, "OIX", pads=([1, 1], [1, 1]))),
         (CBW, ((2, 4, 7, 7), (2, 4, 7, 7), (3, 3)),
          _attrs([1, 1], [1, 1], 4, "OIX", pads=([1, 1], [1, 1])))],
        ((1, 1), (1, 1))),
    # Extent 5; axis 0: 10 -> 5 with 3 pads, the odd one at the end.
    "conv_same_upper_dilated": (
        lambda: _single("Conv", (1, 3, 10, 7), (5, 3, 3, 3), auto_pad="SAME_UPPER",
                        dilations=[2, 2], strides=[2, 1]),
        {},
        [(CBD, ((1, 5, 5, 7), (5, 3, 3, 3), (10, 7)),
          _attrs([2, 1], [2, 2], 1, "OIX", auto_pad="same_upper")),
         (CBW, ((1, 3, 10, 7), (1, 5, 5, 7), (3, 3)),
          _attrs([2, 1], [2, 2], 1, "OIX", auto_pad="same_upper"))],
        ((1, 2), (2, 2))),
    "conv_same_lower": (
        lambda: _single("Conv", (1, 2, 6, 5), (3, 2, 2, 4), auto_pad="SAME_LOWER",
                        strides=[2, 2]),
        {},
        [(CBD, ((1, 3, 3, 3), (3, 2, 2, 4), (6, 5)),
          _attrs([2, 2], [1, 1], 1, "OIX", auto_pad="same_lower")),
         (CBW, ((1, 2, 6, 5), (1, 3, 3, 3), (2, 4)),
          _attrs([2, 2], [1, 1], 1, "OIX", auto_pad="same_lower"))],
        ((0, 2), (0, 1))),
    # IC 4, OC 3 x 2 groups; Y = 2*(5-1) + 1 + 3 - 2 = 10 and 2*(4-1) + 0 + 3 - 1 = 8.
    "conv_transpose_output_padding": (
        lambda: _single("ConvTranspose", (2, 4, 5, 4), (4, 3, 3, 3), strides=[2, 2],
                        pads=[1, 1, 1, 0], output_padding=[1, 0], group=2),
        {},
        [(TBD, ((2, 6, 10, 8), (4, 3, 3, 3)),
          _attrs([2, 2], [1, 1], 2, "IOX", pads=([1, 1], [1, 0]), output_padding=[1, 0])),
         (TBW, ((2, 4, 5, 4), (2, 6, 10, 8), (3, 3)),
          _attrs([2, 2], [1, 1], 2, "IOX", pads=([1, 1], [1, 0])))],
        ((1, 1), (1, 0))),
    # ONNX SAME_LOWER: Y = X*s, total pads K - s = 2 and 1, the odd one at the beginning.
    "conv_transpose_same_lower": (
        lambda: _single("ConvTranspose", (1, 2, 4, 3), (2, 3, 4, 3), strides=[2, 2],
                        auto_pad="SAME_LOWER"),
        {},
        [(TBD, ((1, 3, 8, 6), (2, 3, 4, 3)),
          _attrs([2, 2], [1, 1], 1, "IOX", auto_pad="same_lower")),
         (TBW, ((1, 2, 4, 3), (1, 3, 8, 6), (4, 3)),
          _attrs([2, 2], [1, 1], 1, "IOX", auto_pad="same_lower"))],
        ((1, 1), (1, 0))),
    # output_shape [6, 4] of a full 7 x 7: total pads 1 and 3, the odd one at the end.
    "conv_transpose_output_shape": (
        lambda: _single("ConvTranspose", (1, 2, 3, 3), (2, 2, 3, 3), strides=[2, 2],
                        output_shape=[6, 4], auto_pad="SAME_UPPER"),
        {},
        [(TBD, ((1, 2, 6, 4), (2, 2, 3, 3)),
          _attrs([2, 2], [1, 1], 1, "IOX", pads=([0, 1], [1, 2]))),
         (TBW, ((1, 2, 3, 3), (1, 2, 6, 4), (3, 3)),
          _attrs([2, 2], [1, 1], 1, "IOX", pads=([0, 1], [1, 2])))],
        ((0, 1), (1, 2))),
    "conv_1d": (
        lambda: _single("Conv", (3, 2, 11), (4, 2, 3), strides=[2], dilations=[2],
                        pads=[2, 1]),
        {},
        [(CBD, ((3, 4, 5), (4, 2, 3), (11,)), _attrs([2], [2], 1, "OIX", pads=([2], [1]))),
         (CBW, ((3, 2, 11), (3, 4, 5), (3,)), _attrs([2], [2], 1, "OIX", pads=([2], [1])))],
        ((2,), (1,))),
    "conv_3d": (
        lambda: _single("Conv", (1, 2, 5, 6, 4), (3, 2, 3, 2, 3), strides=[1, 2, 1],
                        pads=[1, 0, 1, 1, 1, 0]),
        {},
        [(CBD, ((1, 3, 5, 3, 3), (3, 2, 3, 2, 3), (5, 6, 4)),
          _attrs([1, 2, 1], [1, 1, 1], 1, "OIX", pads=([1, 0, 1], [1, 1, 0]))),
         (CBW, ((1, 2, 5, 6, 4), (1, 3, 5, 3, 3), (3, 2, 3)),
          _attrs([1, 2, 1], [1, 1, 1], 1, "OIX", pads=([1, 0, 1], [1, 1, 0])))],
        ((1, 0, 1), (1, 1, 0))),
}


def _symbolic_batch_model(path: Path) -> Path:
    """x (N, 3, 8, 8) -> Conv "enc" -> Relu -> unnamed ConvTranspose -> (N, 2, 8, 8)."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h"], name="enc", strides=[2, 2],
                         pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("ConvTranspose", ["r", "w2"], ["y"], strides=[2, 2],
                         pads=[1, 1, 1, 1]),
    ]
    return _save(path, nodes, ("N", 3, 8, 8),
                 {"w1": _weights(rng, (4, 3, 3, 3)), "w2": _weights(rng, (4, 2, 4, 4))})


def _load_case(name, tmp_path, **keywords):
    builder, defaults, _, _ = CASES[name]
    path = _save(tmp_path / f"{name}.onnx", *builder())
    return load_onnx(path, **{**defaults, **keywords})


def _onnx_forward(node, x, w):
    """The node on (x, w) by onnx.reference (grouped ConvTranspose one group at a time:
    the evaluator slices a grouped ConvTranspose's weights by output channels)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    groups = attrs.pop("group", 1)
    if node.op_type == "ConvTranspose" and groups > 1:
        return np.concatenate(
            [_onnx_forward(helper.make_node(node.op_type, ["x", "w"], ["y"], **attrs), xg, wg)
             for xg, wg in zip(np.split(x, groups, axis=1), np.split(w, groups, axis=0),
                               strict=True)], axis=1)
    single = helper.make_node(node.op_type, ["x", "w"], ["y"], group=groups, **attrs)
    graph = helper.make_graph(
        [single], "forward", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ReferenceEvaluator(model).run(None, {"x": x})[0]


def _run(layer, rng):
    """convgrad.execute and the numpy reference on random integers; asserts they agree."""
    arrays = [rng.integers(-3, 4, size=s).astype(np.float32) for s in layer.inputs[:2]]
    inputs = arrays + [np.array(v) for v in layer.inputs[2:]]
    result = convgrad.execute(layer.op, inputs, layer.attrs)
    expected = reference(layer.op, inputs, layer.attrs).astype(np.float32)
    assert result.shape == expected.shape == layer.resolve().output_shape
    np.testing.assert_array_equal(result, expected)
    return arrays, result


@pytest.mark.parametrize("name", CASES)
def test_layers_ops_shapes_attrs(name, tmp_path):
    layers = _load_case(name, tmp_path)
    _, _, expected, (pads_begin, pads_end) = CASES[name]
    assert [(layer.op, layer.inputs, layer.attrs) for layer in layers] == expected
    for layer in layers:
        problem = layer.resolve()
        assert (problem.pads_begin, problem.pads_end) == (pads_begin, pads_end)
        assert layer.dtype == "f32" and layer.batch == layer.inputs[0][0]
        assert layer.name == ("ConvTranspose_0" if "transpose" in name else "Conv_0")


@pytest.mark.parametrize("name", CASES)
def test_kernels_match_reference_and_onnx(name, tmp_path):
    """Every layer's kernel equals the reference; the pair is the node's exact adjoint."""
    data, weights = _load_case(name, tmp_path)
    rng = np.random.default_rng(3)
    (dy, w), diff_x = _run(data, rng)
    x = rng.integers(-3, 4, size=weights.inputs[0]).astype(np.float32)
    kernel = np.array(weights.inputs[2])
    diff_w = convgrad.execute(weights.op, [x, dy, kernel], weights.attrs)
    np.testing.assert_array_equal(
        diff_w, reference(weights.op, [x, dy, kernel], weights.attrs).astype(np.float32))
    _run(weights, rng)
    # The node's forward result by onnx's own reference implementation.
    (node,), _, _ = CASES[name][0]()
    y = _onnx_forward(node, x, w)
    assert y.shape == dy.shape
    forward = np.sum(y.astype(np.float64) * dy)
    assert forward == np.sum(x.astype(np.float64) * diff_x)
    assert forward == np.sum(w.astype(np.float64) * diff_w)


def test_ambiguous_conv_transpose_padding_is_refused(tmp_path):
    """Where ONNX's spec, shape inference and reference evaluator disagree, no layer."""
    def load(**attrs):
        nodes, x_dims, weights = _single("ConvTranspose", (1, 2, 3, 3), (2, 2, 3, 3),
                                         strides=[2, 2], **attrs)
        return load_onnx(_save(tmp_path / "model.onnx", nodes, x_dims, weights))

    with pytest.raises(ValueError, match=r"'ConvTranspose_0'.*output_shape.*ambiguous"):
        load(output_shape=[6, 4])
    with pytest.raises(ValueError, match=r"'ConvTranspose_0'.*output_padding.*ambiguous"):
        load(auto_pad="SAME_UPPER", output_padding=[1, 1])
    # An output_shape that needs no pads is the same in every reading.
    layers = load(output_shape=[7, 7])
    assert [layer.inputs[0] for layer in layers] == [(1, 2, 7, 7), (1, 2, 3, 3)]
    assert layers[0].attrs["pads_begin"] == layers[0].attrs["pads_end"] == [0, 0]


def test_symbolic_batch_needs_batch(tmp_path):
    path = _symbolic_batch_model(tmp_path / "model.onnx")
    with pytest.raises(ValueError, match=r"'enc' \(Conv\).*batch.*symbolic.*'N'"):
        load_onnx(path)
    layers = load_onnx(path, batch=4)
    assert [(layer.name, layer.op, layer.inputs) for layer in layers] == [
        ("enc", CBD, ((4, 4, 4, 4), (4, 3, 3, 3), (8, 8))),
        ("enc", CBW, ((4, 3, 8, 8), (4, 4, 4, 4), (3, 3))),
        ("ConvTranspose_2", TBD, ((4, 2, 8, 8), (4, 2, 4, 4))),
        ("ConvTranspose_2", TBW, ((4, 4, 4, 4), (4, 2, 8, 8), (4, 4))),
    ]
    assert all(layer.batch == 4 for layer in layers)
    rng = np.random.default_rng(4)
    for layer in layers:
        assert layer.attrs["pads_begin"] == layer.attrs["pads_end"] == [1, 1]
        _run(layer, rng)


def test_batch_overrides_and_nxc_permutes(tmp_path):
    layers = _load_case("conv_grouped_strided_asymmetric", tmp_path, batch=3,
                        data_format="NXC", dtype="f16")
    assert [(layer.op, layer.inputs) for layer in layers] == [
        (CBD, ((3, 5, 4, 6), (6, 2, 3, 3), (9, 8))),
        (CBW, ((3, 9, 8, 4), (3, 5, 4, 6), (3, 3))),
    ]
    for layer in layers:
        assert layer.attrs["data_format"] == "NXC" and layer.attrs["weights_format"] == "OIX"
        assert layer.dtype == "f16" and layer.resolve().config.dtype == "f16"
    transposed = _load_case("conv_transpose_output_padding", tmp_path, data_format="NXC")
    assert [layer.inputs for layer in transposed] == [
        ((2, 10, 8, 6), (4, 3, 3, 3)), ((2, 5, 4, 4), (2, 10, 8, 6), (3, 3))]
    rng = np.random.default_rng(5)
    for layer in [*layers, *transposed]:
        _run(layer.__class__(layer.op, layer.inputs, layer.attrs, "f32", layer.name), rng)


def test_bad_models_name_the_node(tmp_path):
    nodes, x_dims, weights = _single("Conv", (1, 4, 6, 6), (2, 4, 3, 3), kernel_shape=[3, 2])
    nodes[0].name = "stem"
    with pytest.raises(ValueError, match=r"'stem' \(Conv\): kernel_shape"):
        load_onnx(_save(tmp_path / "kernel.onnx", nodes, x_dims, weights))
    nodes, x_dims, weights = _single("Conv", (1, 4, "H", 6), (2, 4, 3, 3))
    with pytest.raises(ValueError, match=r"'Conv_0'.*dimension 2 of input X"):
        load_onnx(_save(tmp_path / "spatial.onnx", nodes, x_dims, weights))
    path = _save(tmp_path / "ok.onnx", *_single("Conv", (1, 4, 6, 6), (2, 4, 3, 3)))
    with pytest.raises(ValueError, match="data_format"):
        load_onnx(path, data_format="NHWC")


def test_missing_onnx_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(RuntimeError, match="pip install onnx"):
        load_onnx(tmp_path / "model.onnx")


def test_aot_command_reads_onnx(tmp_path):
    path = _symbolic_batch_model(tmp_path / "model.onnx")
    result = subprocess.run(
        [sys.executable, "-m", "convgrad", "aot", str(path), "-o", str(tmp_path / "aot"),
         "--batch", "2", "-j", "2", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exact" in result.stdout and "MISMATCH" not in result.stdout
    assert "4 of 4 layers exact" in result.stdout
