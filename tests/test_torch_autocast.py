"""convgrad.torch under `torch.autocast("cpu", dtype=bf16 or f16)` against torch.nn under
the same autocast: result dtypes, values, gradients (float32 parameters get float32
.grad), nested `enabled=False` regions, mixed dtypes, the functional API, the raw ops
and torch.compile(fullgraph=True).

Single layers run on small integers (|x|, |w| <= 2, |dy| <= 1, a few terms per sum),
where every bf16/f16 result is exact: they must equal torch.nn's bit for bit. A
two-layer model runs on real values and is held to a few ulps of the autocast dtype,
relative to the result's magnitude. Every case checks which kernels ran, and in which
dtype: the low-precision kernels under autocast, float32 outside it. The shapes repeat,
so the file compiles few kernels.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import convgrad.torch as cgt  # noqa: E402

NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}
LOW = [pytest.param(dtype, id=name) for dtype, name in NAMES.items()]
EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # half an ulp at 1
FORWARD, DATA, WEIGHTS = ("ConvTransposeBackwardData", "ConvolutionBackwardData",
                          "ConvolutionBackwardWeights")


@pytest.fixture
def ran(monkeypatch):
    """Every kernel call from now on, as (op kind, dtype name)."""
    from convgrad import bound

    calls = []
    run = bound.BoundCall.run

    def spy(self, *args):
        calls.append((self.problem.op.kind, self.problem.config.dtype))
        return run(self, *args)

    monkeypatch.setattr(bound.BoundCall, "run", spy)
    return calls


# The geometries: the 2-D convolution and its transposed convolution run the same three
# kernels (per dtype); the model is the two in a row.
def conv2d():
    return nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)


def conv_transpose2d():
    return nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2)


LAYERS = {  # name -> (module factory, input shape)
    "conv2d": (conv2d, (2, 4, 8, 8)),
    "conv_transpose2d": (conv_transpose2d, (2, 6, 4, 4)),
    "conv1d-nobias": (lambda: nn.Conv1d(3, 4, 3, padding=1, bias=False), (2, 3, 7)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, stride=2, padding=1), (2, 2, 4, 4, 4)),
}


def integers(shape, generator, high=2):
    return torch.randint(-high, high + 1, shape, generator=generator).float()


def layer(name, seed=0):
    """(torch.nn module, its converted copy, an input, an output gradient): integers."""
    factory, shape = LAYERS[name]
    generator = torch.Generator().manual_seed(seed)
    reference = factory()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(integers(p.shape, generator))
    converted = copy.deepcopy(reference)
    assert cgt.convert(converted).converted == ["(the model itself)"]
    x = integers(shape, generator)
    with torch.no_grad():
        grad = integers(reference(x).shape, generator, high=1)
    return reference, converted, x, grad


def step(module, x, grad, dtype, enabled=True):
    """Output (forward under autocast) and the gradients of the input and parameters
    (backward outside autocast, as recommended)."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=enabled):
        y = module(x)
    y.backward(grad.to(y.dtype))
    return [y.detach(), x.grad, *[p.grad for p in module.parameters()]]


def assert_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", list(LAYERS))
def test_converted_layer_equals_torch_nn_under_autocast(ran, name, dtype):
    """The output has the autocast dtype (bias added in it), the gradients reach the
    float32 input and parameters in float32: all equal to torch.nn's."""
    reference, converted, x, grad = layer(name)
    want = step(reference, x, grad, dtype)
    ran.clear()
    got = step(converted, x, grad, dtype)
    assert got[0].dtype == dtype and all(g.dtype == torch.float32 for g in got[1:])
    assert_equal(got, want)
    kinds = [FORWARD, DATA, WEIGHTS]
    if name == "conv_transpose2d":
        kinds = [DATA, FORWARD, WEIGHTS]
    assert ran == [(kind, NAMES[dtype]) for kind in kinds]


@pytest.mark.parametrize("dtype", LOW)
def test_model_matches_torch_nn_within_low_precision_rounding(ran, dtype):
    """Conv2d, ReLU, ConvTranspose2d on real values; the second layer's input is in the
    autocast dtype, its weights float32: both cast. Results within a few ulps of the
    autocast dtype relative to the largest value (the bias is rounded once more than
    torch's fused one, and that moves the second layer's inputs)."""
    torch.manual_seed(1)
    reference = nn.Sequential(conv2d(), nn.ReLU(), conv_transpose2d())
    converted = copy.deepcopy(reference)
    cgt.convert(converted)
    x, grad = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    want = step(reference, x, grad, dtype)
    ran.clear()
    got = step(converted, x, grad, dtype)
    assert got[0].dtype == dtype and all(g.dtype == torch.float32 for g in got[1:])
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        bound = 8 * EPS[dtype] * w.abs().max().item()
        assert (g.float() - w.float()).abs().max().item() <= bound
    assert len(ran) == 6 and {d for _, d in ran} == {NAMES[dtype]}


def test_nested_disabled_region_runs_float32(ran):
    reference, converted, x, grad = layer("conv2d")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert converted(x).dtype == torch.bfloat16
        want = step(reference, x, grad, torch.bfloat16, enabled=False)
        ran.clear()
        got = step(converted, x, grad, torch.bfloat16, enabled=False)
    assert_equal(got, want)
    assert got[0].dtype == torch.float32
    assert ran == [(FORWARD, "f32"), (DATA, "f32"), (WEIGHTS, "f32")]


def test_backward_inside_the_region_is_not_autocast(ran):
    """A float32 forward outside autocast, its backward() inside a region: the
    gradients run float32, as torch.nn's (aten's convolution_backward is not
    autocast); and a bf16 forward's backward inside the region stays bf16."""
    reference, converted, x, grad = layer("conv2d")
    results = []
    for module in (reference, converted):
        ran.clear()
        x1 = x.clone().requires_grad_()
        y = module(x1)
        with torch.autocast("cpu", dtype=torch.float16):
            y.backward(grad)
        results.append([x1.grad, *[p.grad for p in module.parameters()]])
        module.zero_grad()
    assert_equal(results[1], results[0])
    assert ran == [(FORWARD, "f32"), (DATA, "f32"), (WEIGHTS, "f32")]
    ran.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x1 = x.clone().requires_grad_()
        y = converted(x1)
        y.backward(grad.bfloat16())
        assert converted.weight.grad.dtype == torch.float32
    assert ran == [(FORWARD, "bf16"), (DATA, "bf16"), (WEIGHTS, "bf16")]


@pytest.mark.parametrize("dtype", LOW)
def test_functional_api_under_autocast(ran, dtype):
    """cgt.functional with float32 or already low-precision inputs and float32 weight
    and bias: torch.nn.functional's dtype and values; mixed dtypes outside autocast
    still raise."""
    reference, _, x, _ = layer("conv2d")
    w, b = reference.weight.detach(), reference.bias.detach()
    args = dict(stride=2, padding=1, groups=2)
    for data in (x, x.to(dtype)):
        with torch.autocast("cpu", dtype=dtype):
            got = cgt.functional.conv2d(data, w, b, **args)
            want = F.conv2d(data, w, b, **args)
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    generator = torch.Generator().manual_seed(1)
    wt, y = integers((6, 2, 3, 3), generator), integers((2, 6, 4, 4), generator)
    with torch.autocast("cpu", dtype=dtype):
        got = cgt.functional.conv_transpose2d(y, wt, None, 2, 1, 1, 2)
        want = F.conv_transpose2d(y, wt, None, 2, 1, 1, 2)
    assert got.dtype == dtype and torch.equal(got, want)
    assert ran == [(FORWARD, NAMES[dtype])] * 2 + [(DATA, NAMES[dtype])]
    with pytest.raises(TypeError, match="expected one dtype"):
        cgt.functional.conv2d(x.to(dtype), w, b, **args)
    with pytest.raises(TypeError, match="expected one dtype"):
        cgt.functional.conv2d(x.to(dtype), w.to(dtype), b, **args)


@pytest.mark.parametrize("dtype", LOW)
def test_raw_ops_under_autocast(ran, dtype):
    """torch.ops.convgrad.<name> (through torch's dispatcher: the AutocastCPU kernel)
    and cgt.<name> (the eager path): inputs of any kernel dtype cast to the autocast
    dtype; float32 gradients for float32 leaves; mixed dtypes outside autocast raise."""
    reference, _, x, grad = layer("conv2d")
    w = reference.weight.detach()
    attrs = ([2, 2], [1, 1], [1, 1], [1, 1], 2)
    with torch.autocast("cpu", dtype=dtype):
        want = F.conv2d(x, w, None, stride=2, padding=1, groups=2)
    for op in (torch.ops.convgrad.conv_transpose_backward_data,
               lambda a, b, *attrs: cgt.conv_transpose_backward_data(
                   a, b, strides=2, pads_begin=1, pads_end=1, groups=2)):
        ran.clear()
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            got = op(x1, w1.to(dtype), *attrs)
            with torch.autocast("cpu", enabled=False):
                assert op(x1, w1, *attrs).dtype == torch.float32
        assert got.dtype == dtype and torch.equal(got, want)
        got.backward(grad.to(dtype))
        assert x1.grad.dtype == w1.grad.dtype == torch.float32
        assert ran[0] == (FORWARD, NAMES[dtype]) and ran[1] == (FORWARD, "f32")
        assert {d for _, d in ran[2:]} == {NAMES[dtype]} and len(ran) == 4
    with pytest.raises(TypeError, match="expected one dtype"):
        torch.ops.convgrad.conv_transpose_backward_data(x, w.to(dtype), *attrs)
    with pytest.raises(TypeError, match="expected one dtype"):
        cgt.conv_transpose_backward_data(x, w.to(dtype), strides=2, pads_begin=1,
                                         pads_end=1, groups=2)


def test_torch_compile_fullgraph_under_autocast(ran):
    """One graph with the autocast region inside or around it: AOTAutograd's forward
    graph casts the inputs and calls the convgrad ops, no aten convolution; the
    results equal eager convgrad's under the same autocast, a nested disabled region
    compiles float32."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def recorder(kind):
        def compiler(graph, example_inputs):
            graphs.setdefault(kind, []).append(
                {str(node.target) for node in graph.graph.nodes
                 if node.op == "call_function"})
            return make_boxed_func(graph.forward)
        return compiler

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    torch.manual_seed(1)
    model = nn.Sequential(conv2d(), nn.ReLU(), conv_transpose2d())
    cgt.convert(model)
    eager = copy.deepcopy(model)
    x = torch.randn(2, 4, 8, 8)

    def inside(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
            with torch.autocast("cpu", enabled=False):
                z = m(x)
        return y, z

    compiled = torch.compile(inside, backend=backend, fullgraph=True)
    (y, z), (y_eager, z_eager) = compiled(model, x), inside(eager, x)
    assert y.dtype == torch.bfloat16 and z.dtype == torch.float32
    assert torch.equal(y, y_eager) and torch.equal(z, z_eager)
    (y.float().sum() + z.sum()).backward()
    (y_eager.float().sum() + z_eager.sum()).backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    forward = graphs["forward"][-1]
    assert "convgrad.conv_transpose_backward_data.default" in forward
    assert "convgrad.convolution_backward_data.default" in forward
    assert "aten._to_copy.default" in forward
    assert not any("aten" in t and "convolution" in t
                   for t in forward | graphs["backward"][-1])
    assert {d for _, d in ran} == {"bf16", "f32"}

    ran.clear()
    outer = torch.compile(model, backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.float16):
        got, want = outer(x), eager(x)
    assert got.dtype == torch.float16 and torch.equal(got, want)
    assert {d for _, d in ran} == {"f16"}


def test_kernels_of_a_step_under_autocast_are_the_low_precision_ones():
    """compile_kernels/aot_kernels called inside an autocast region collect the step's
    bf16 calls (the pass runs the model as the step does)."""
    from convgrad.torch import warmup

    _, converted, x, _ = layer("conv2d")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        calls = warmup.step_calls(converted, (x.requires_grad_(),), {}, build=False)
    assert sorted((c.bound.problem.op.kind, c.bound.problem.config.dtype) for c in calls) \
        == sorted([(FORWARD, "bf16"), (DATA, "bf16"), (WEIGHTS, "bf16")])
