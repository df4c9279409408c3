"""Long reductions: kernels add short partial sums in a fixed order.

Exact on integer data on every path (the partial sums must add every product once),
and on real-valued data at most twice PyTorch's error against a float64 computation
(and within a fixed budget); likewise data gradients, whose reduction runs over
output channels x taps.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import make_case
from checks import run_case

import convgrad
from convgrad.reference import reference

WEIGHT_OPS = ["ConvolutionBackwardWeights", "ConvTransposeBackwardWeights"]


@pytest.mark.parametrize("isa", convgrad.cpu.available_isas())
@pytest.mark.parametrize("op", WEIGHT_OPS)
@pytest.mark.parametrize("in_channels,data_format,dtype",
                         [(24, "NXC", "f32"), (2, "NXC", "f32"), (24, "NCX", "bf16"),
                          (3, "NXC", "bf16"), (24, "NXC", "f16")])
def test_weight_gradient_partial_sums_are_exact(isa, op, in_channels, data_format, dtype,
                                                monkeypatch):
    """Hundreds of pixels per tile call: partial sums flush many times, mid-chunk and at
    its end, on rows of odd length (pixel pairs with a zero partner)."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, spatial=(19, 23), kernel=(3, 3), in_channels=in_channels,
                     out_channels=20, batch=3, data_format=data_format, dtype=dtype,
                     attrs=dict(pads_begin=1, pads_end=1))
    run_case(case)


@pytest.mark.parametrize("isa", convgrad.cpu.available_isas())
@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("channels,data_format,dtype",
                         [((150, 20), "NXC", "f32"), ((20, 150), "NCX", "f32"),
                          ((150, 5), "NXC", "bf16"), ((3, 150), "NXC", "f16")])
def test_data_gradient_partial_sums_are_exact(isa, op, channels, data_format, dtype,
                                              monkeypatch):
    """150 reduced channels x 6 taps: several partial sums per tile, splitting taps, and
    tiles with few accumulators (two chains each)."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    reduced, kept = channels if op == "ConvolutionBackwardData" else channels[::-1]
    case = make_case(op, spatial=(6, 7), kernel=(3, 2), in_channels=kept,
                     out_channels=reduced, batch=2, data_format=data_format, dtype=dtype,
                     attrs=dict(pads_begin=[1, 0], pads_end=[1, 1]))
    run_case(case)


def test_pointwise_weight_gradient_partial_sums_are_exact():
    """1x1 stride 1: the batch's pixels regrouped into long rows."""
    case = make_case("ConvolutionBackwardWeights", spatial=(30, 31), kernel=(1, 1),
                     in_channels=16, out_channels=24, batch=3)
    run_case(case)


def _relative_error(result: np.ndarray, exact: np.ndarray) -> float:
    return float(np.abs(result.astype(np.float64) - exact).max() / np.abs(exact).max())


# (name, src shape NCX, weights OIX, pad): long reductions over pixels (weights) and
# over output channels x taps (data)
LAYERS = [
    ("1-D k5 512 ch", (2, 512, 300), (512, 512, 5), 2),
    ("1-D k3 32 ch, long rows", (2, 32, 30000), (32, 32, 3), 1),
    ("3x3 64 ch 28x28", (8, 64, 28, 28), (64, 64, 3, 3), 1),
    ("3x3 512 ch 7x7", (4, 512, 7, 7), (512, 512, 3, 3), 1),
    ("1x1 256->64 28x28", (8, 256, 28, 28), (64, 256, 1, 1), 0),
    ("3-D 3x3x3 32 ch 10^3", (2, 32, 10, 10, 10), (32, 32, 3, 3, 3), 1),
]


@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvolutionBackwardWeights"])
@pytest.mark.parametrize("name,src_shape,weights_shape,pad", LAYERS, ids=[x[0] for x in LAYERS])
def test_error_at_most_twice_pytorch(op, name, src_shape, weights_shape, pad):
    torch = pytest.importorskip("torch")
    rank = len(src_shape) - 2
    rng = np.random.default_rng(0)
    src = rng.standard_normal(src_shape).astype(np.float32)
    weights = rng.standard_normal(weights_shape).astype(np.float32)
    ones, pads = [1] * rank, [pad] * rank
    forward = torch.ops.aten.convolution(torch.from_numpy(src), torch.from_numpy(weights), None,
                                         ones, pads, ones, False, [0] * rank, 1)
    diff_dst = rng.standard_normal(tuple(forward.shape)).astype(np.float32)
    data = op == "ConvolutionBackwardData"
    theirs = torch.ops.aten.convolution_backward(
        torch.from_numpy(diff_dst), torch.from_numpy(src), torch.from_numpy(weights), None,
        ones, pads, ones, False, [0] * rank, 1, [data, not data, False])[0 if data else 1]
    attrs = {"pads_begin": pads, "pads_end": pads, "data_format": "NCX", "weights_format": "OIX"}
    first, shape = (diff_dst, src_shape) if data else (src, weights_shape)
    second = weights if data else diff_dst
    inputs = [first, second, np.array(shape[2:])]
    exact = reference(op, [first.astype(np.float64), second.astype(np.float64), inputs[2]],
                      attrs)
    ours = convgrad.execute(op, inputs, attrs)
    ours_error, their_error = _relative_error(ours, exact), _relative_error(theirs.numpy(), exact)
    print(f"{op} {name}: convgrad {ours_error:.2e}, PyTorch {their_error:.2e}")
    assert ours_error <= 2 * their_error
    # One chain per result over the whole reduction once gave up to 5.4e-6 (weights, long
    # rows) and 3.0e-6 (data, 512 channels x 9 taps); partial sums stay within ~8 f32
    # epsilons of the largest value here.
    assert ours_error <= 1e-6


def _resnet50_layers() -> list:
    from convgrad.aot import read_layers

    return read_layers([], ops=("ConvolutionBackwardData", "ConvolutionBackwardWeights"),
                       data_format="NCX", weights_format="OIX", batch=8)


@pytest.mark.slow
@pytest.mark.parametrize("layer", _resnet50_layers(), ids=lambda x: f"{x.name}-{x.op}")
def test_resnet50_error_at_most_twice_pytorch_on_every_path(layer, monkeypatch):
    """Every ResNet-50 layer (batch 8, real-valued data), both ops, every path this CPU
    runs: convgrad's relative error against float64 at most twice PyTorch's."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    first = rng.standard_normal(layer.inputs[0]).astype(np.float32)
    second = rng.standard_normal(layer.inputs[1]).astype(np.float32)
    shape = np.array(layer.inputs[2])
    attrs = layer.attrs
    exact = reference(layer.op, [first.astype(np.float64), second.astype(np.float64), shape],
                      attrs)
    rank = len(shape)
    data = layer.op == "ConvolutionBackwardData"
    if data:  # first: diff_dst, second: weights
        diff_dst, weights = first, second
        src = np.zeros(exact.shape, np.float32)
    else:  # first: src, second: diff_dst
        src, diff_dst = first, second
        weights = np.zeros(exact.shape, np.float32)
    theirs = torch.ops.aten.convolution_backward(
        torch.from_numpy(diff_dst), torch.from_numpy(src), torch.from_numpy(weights), None,
        attrs["strides"], attrs["pads_begin"], attrs["dilations"], False, [0] * rank,
        attrs["groups"], [data, not data, False])[0 if data else 1].numpy()
    their_error = _relative_error(theirs, exact)
    for isa in convgrad.cpu.available_isas():
        monkeypatch.setenv("CONVGRAD_ISA", isa)
        ours_error = _relative_error(convgrad.execute(layer.op, [first, second, shape], attrs),
                                     exact)
        print(f"{layer.name} {layer.op} {isa}: convgrad {ours_error:.2e}, "
              f"PyTorch {their_error:.2e}")
        assert ours_error <= 2 * their_error, isa
