"""convgrad.torch's modules against torch.nn's: output, input gradient, weight gradient
and bias gradient of Conv1d/2d/3d and ConvTranspose1d/2d/3d, converted with `convert`;
`convert`'s report; and converted models under torch.compile.

float32 cases use small integers, so every sum is exact and results must equal
torch.nn's bit for bit. bfloat16 cases use real values; each result and gradient is
compared with a float64 computation from the same bf16 inputs, within the error of
f32 sums rounded to bf16: |got - exact| <= 2^-7 * (the same computation on absolute
values), which allows a rounding of the convolution and one of the bias addition
(2^-10 for f16 in the slow sweep). torch.nn's own results are held to the same
bound (f16: 4 x, see check_module).

Each geometry (channels, groups, kernel, strides, dilations) is tested as a convolution
and as the transposed convolution that runs the same three kernels, and its variants
(pads, padding modes, bias) reuse them too, so the default run compiles few kernels.
The full product of geometries, layouts and dtypes runs with CONVGRAD_SLOW_TESTS=1.
"""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import convgrad.torch as cgt  # noqa: E402

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
SPATIAL = {1: (11,), 2: (9, 8), 3: (7, 6, 5)}


def axes(values, rank):
    return tuple(values[:rank])


# name -> (module factories of a rank, each (label, constructor)); the modules of one
# geometry compile the same kernels.
def geometries(rank):
    def a(values):
        return axes(values, rank)

    grouped = dict(kernel_size=a((3, 2, 2)), stride=a((2, 1, 1)), dilation=a((1, 2, 1)),
                   groups=2)
    depthwise = dict(kernel_size=a((4, 3, 2)), dilation=a((1, 2, 1)), groups=6)
    plain = dict(kernel_size=3, stride=2)
    return {
        "grouped": [
            ("conv-pads", lambda: CONV[rank](4, 6, padding=a((1, 0, 2)), **grouped)),
            ("conv-reflect-nobias", lambda: CONV[rank](4, 6, padding=a((1, 2, 1)),
                                                       padding_mode="reflect", bias=False,
                                                       **grouped)),
            ("convT-outpad", lambda: CONV_T[rank](6, 4, padding=a((1, 0, 1)),
                                                  output_padding=a((1, 1, 0)), **grouped)),
        ],
        "depthwise": [
            ("conv-same", lambda: CONV[rank](6, 6, padding="same", **depthwise)),
            ("conv-valid-nobias", lambda: CONV[rank](6, 6, padding="valid", bias=False,
                                                     **depthwise)),
            ("convT-nobias", lambda: CONV_T[rank](6, 6, padding=a((2, 1, 0)), bias=False,
                                                  **depthwise)),
        ],
        "plain": [
            ("conv-circular", lambda: CONV[rank](3, 5, padding=1, padding_mode="circular",
                                                 **plain)),
            ("conv-replicate", lambda: CONV[rank](3, 5, padding=(1,) * rank,
                                                  padding_mode="replicate", **plain)),
            ("convT", lambda: CONV_T[rank](5, 3, padding=1, output_padding=1, **plain)),
        ],
    }


# The default run: per module type every geometry, and f32 and bf16 each in both
# layouts; 2-D grouped f32 channels_last shares its kernels with test_torch_ops.py.
FAST_LAYOUTS = {"grouped": [("f32", False), ("bf16", True)],
                "depthwise": [("f32", True), ("bf16", False)],
                "plain": [("f32", False)]}
FAST_EXTRA = {(2, "grouped"): [("f32", True)]}
ALL_LAYOUTS = [(d, cl) for d in ("f32", "bf16", "f16") for cl in (False, True)]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _params(slow: bool):
    cases = []
    for rank in (1, 2, 3):
        for geometry, modules in geometries(rank).items():
            layouts = FAST_LAYOUTS[geometry] + FAST_EXTRA.get((rank, geometry), [])
            if slow:
                layouts = [x for x in ALL_LAYOUTS if x not in layouts]
            for (dtype, channels_last), (label, _) in itertools.product(layouts, modules):
                marks = [pytest.mark.slow] if slow else []
                cases.append(pytest.param(
                    rank, geometry, label, dtype, channels_last, marks=marks,
                    id=f"{rank}d-{geometry}-{label}-{dtype}-{'NXC' if channels_last else 'NCX'}"))
    return cases


def to_layout(t, channels_last):
    return t.movedim(1, -1).contiguous().movedim(-1, 1) if channels_last else t.contiguous()


def in_layout(t, channels_last):
    return t.movedim(1, -1).is_contiguous() if channels_last else t.is_contiguous()


def fill(module, generator, integers):
    with torch.no_grad():
        for p in module.parameters():
            if integers:
                p.copy_(torch.randint(-2, 3, p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator))


def sample(shape, generator, integers):
    if integers:
        return torch.randint(-2, 3, shape, generator=generator).float()
    return torch.randn(shape, generator=generator)


def run(module, x, grad, channels_last):
    """Output and gradients (input, then each parameter) of one forward/backward."""
    x = to_layout(x, channels_last).requires_grad_()
    y = module(x)
    y.backward(to_layout(grad, channels_last))
    return [y.detach(), x.grad, *[p.grad for p in module.parameters()]]


def check_module(rank, factory, dtype_name, channels_last, seed=0):
    generator = torch.Generator().manual_seed(seed)
    integers = dtype_name == "f32"
    reference = factory()
    fill(reference, generator, integers)
    converted = copy.deepcopy(reference)
    report = cgt.convert(converted)
    assert report.converted == ["(the model itself)"] and not report.skipped
    assert type(converted).__name__ == type(reference).__name__
    assert isinstance(converted, type(reference))
    channels = reference.in_channels
    x = sample((2, channels, *SPATIAL[rank]), generator, integers)
    dtype = DTYPES[dtype_name]
    with torch.no_grad():
        out_shape = reference(x).shape
    grad = sample(out_shape, generator, integers)

    if integers:
        want = run(reference, x, grad, channels_last)
        got = run(converted, x, grad, channels_last)
        assert in_layout(got[0], channels_last)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32 and g.shape == w.shape
            assert torch.equal(g, w)
        return

    # Low precision: the same bf16 (f16) values, against float64.
    x, grad = x.to(dtype).float(), grad.to(dtype).float()
    for module in (reference, converted):
        module.to(dtype)
    exact = copy.deepcopy(reference).double()
    magnitude = copy.deepcopy(reference).double()
    with torch.no_grad():
        for p in magnitude.parameters():
            p.abs_()
    want = run(exact, x.double(), grad.double(), channels_last)
    size = run(magnitude, x.double().abs(), grad.double().abs(), channels_last)
    bound = [2.0 ** (-7 if dtype == torch.bfloat16 else -10) * s + 1e-30 for s in size]
    ours = run(converted, x.to(dtype), grad.to(dtype), channels_last)
    theirs = run(reference, x.to(dtype), grad.to(dtype), channels_last)
    assert in_layout(ours[0], channels_last)
    names = ["output", "input grad"] + [f"{n} grad" for n, _ in reference.named_parameters()]
    for name, o, t, w, b in zip(names, ours, theirs, want, bound, strict=True):
        assert o.dtype == dtype and o.shape == w.shape, name
        error = (o.double() - w).abs()
        assert torch.all(error <= b), f"{name}: worst {(error / b).max():.2f} x the bound"
        # torch.nn's own results are held to 4 x the bound: its CPU f16 transposed
        # convolution errs up to 1.44 x (it rounds to f16 before the end), and on a CPU
        # without AVX512-BF16 (Zen 3) its bf16 depthwise data gradients up to 1.82 x.
        slack = 4
        assert torch.all((t.double() - w).abs() <= slack * b), \
            f"torch.nn's {name} beyond the bound"


@pytest.mark.parametrize("rank, geometry, label, dtype, channels_last",
                         _params(False) + _params(True))
def test_converted_module_matches_torch_nn(rank, geometry, label, dtype, channels_last):
    factory = dict(geometries(rank)[geometry])[label]
    check_module(rank, factory, dtype, channels_last)


def test_module_runs_only_convgrad_kernels_for_its_convolutions(kernel_calls):
    torch.manual_seed(0)
    for module, transposed in ((cgt.Conv2d(4, 6, 3, groups=2), False),
                               (cgt.ConvTranspose2d(6, 4, 3, groups=2), True)):
        kernel_calls.clear()
        x = torch.randn(2, module.in_channels, 9, 8, requires_grad=True)
        module(x).sum().backward()
        forward, data = "ConvTransposeBackwardData", "ConvolutionBackwardData"
        if transposed:
            forward, data = data, forward
        assert [call[0] for call in kernel_calls] == [forward, data,
                                                      "ConvolutionBackwardWeights"]


def test_unbatched_input_and_output_size():
    torch.manual_seed(1)
    for reference, kwargs in ((nn.Conv2d(3, 5, 3, stride=2, padding=1), {}),
                              (nn.ConvTranspose2d(5, 3, 3, stride=2, padding=1),
                               {"output_size": [18, 15]})):
        converted = copy.deepcopy(reference)
        cgt.convert(converted)
        x = torch.randn(reference.in_channels, 9, 8)
        assert torch.allclose(converted(x, **kwargs), reference(x, **kwargs), atol=1e-5)
    assert converted(x, output_size=[18, 15]).shape == (3, 18, 15)


def test_convert_swaps_in_place_and_reports_what_it_left_alone():
    class MyConv(nn.Conv2d):
        def forward(self, input):
            return super().forward(input)

    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.Sequential(nn.ReLU(), nn.ConvTranspose2d(4, 4, 2, stride=2)),
        nn.Conv1d(4, 4, 1).double(),
        MyConv(4, 4, 1),
        nn.LazyConv2d(4, 1),
        nn.utils.parametrize.register_parametrization(nn.Conv2d(4, 4, 1), "weight",
                                                      nn.Identity()),
        cgt.Conv3d(2, 2, 1),
    )
    weight = model[0].weight
    keys = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report = cgt.convert(model)
    assert report.converted == ["0", "1.1"]
    assert report.already == ["6"]
    reasons = {name: why for name, _, why in report.skipped}
    assert set(reasons) == {"2", "3", "4", "5"}
    assert "torch.float64" in reasons["2"]
    assert "subclass" in reasons["3"] and "MyConv" in reasons["3"]
    assert "overrides forward" in reasons["3"]
    assert "lazy" in reasons["4"]
    assert "parametrized" in reasons["5"]
    assert "left alone 3 (MyConv)" in str(report)
    assert type(model[0]) is cgt.Conv2d and type(model[1][1]) is cgt.ConvTranspose2d
    assert type(model[2]) is nn.Conv1d
    assert model[0].weight is weight and list(model.state_dict()) == keys
    # An optimizer made before the conversion still trains the converted modules.
    before = weight.detach().clone()
    model[1](model[0](torch.randn(2, 1, 5, 5))).square().sum().backward()
    optimizer.step()
    assert not torch.equal(weight.detach(), before)
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        cgt.convert("model")


class Conv3DSimple(nn.Conv3d):
    """torchvision's R3D-18 convolution: only __init__ and a staticmethod."""

    def __init__(self, in_planes, out_planes, midplanes=None, stride=1, padding=1):
        super().__init__(in_channels=in_planes, out_channels=out_planes,
                         kernel_size=(3, 3, 3), stride=stride, padding=padding, bias=False)

    @staticmethod
    def get_downsample_stride(stride):
        return stride, stride, stride


class Upsample(nn.ConvTranspose1d):
    """A subclass adding a class attribute and a method, neither forward nor
    _output_padding."""

    factor = 2

    def describe(self):
        return f"x{self.factor}"


class ForwardOverride(nn.Conv2d):
    def forward(self, input):
        return super().forward(input) * 2


class ConvForwardOverride(nn.Conv2d):
    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(input, weight, bias)


class OutputPaddingOverride(nn.ConvTranspose2d):
    def _output_padding(self, *args, **kwargs):
        return super()._output_padding(*args, **kwargs)


def test_convert_converts_subclasses_that_keep_torch_nn_computation(kernel_calls):
    """A subclass overriding neither forward nor _conv_forward (ConvTranspose: nor
    _output_padding) gets a class of its name derived from it and convgrad's: an
    instance of the subclass with its own methods, the same results as torch.nn's
    (f32 integers: exact), and it copies, pickles and converts again as "already"."""
    generator = torch.Generator().manual_seed(5)
    model = nn.Sequential(Conv3DSimple(2, 3, stride=2), nn.Sequential(Upsample(3, 2, 3)))
    fill(model, generator, integers=True)
    reference = copy.deepcopy(model)
    text = repr(model)
    report = cgt.convert(model)
    assert report.converted == ["0", "1.0"] and not report.skipped and not report.already
    conv, up = model[0], model[1][0]
    for module, user_class, ours in ((conv, Conv3DSimple, cgt.Conv3d),
                                     (up, Upsample, cgt.ConvTranspose1d)):
        assert type(module) is not user_class
        assert isinstance(module, user_class) and isinstance(module, ours)
        assert type(module).__name__ == user_class.__name__
    assert type(conv)._conv_forward is cgt.Conv3d._conv_forward
    assert type(up).forward is cgt.ConvTranspose1d.forward
    assert conv.get_downsample_stride(2) == (2, 2, 2) and up.describe() == "x2"
    assert repr(model) == text and list(model.state_dict()) == list(reference.state_dict())
    # One class per user class: another module of it gets the same.
    other = Conv3DSimple(3, 3)
    cgt.convert(other)
    assert type(other) is type(conv)

    kernel_calls.clear()
    x = sample((2, 2, 5, 4, 3), generator, integers=True)
    with torch.no_grad():
        grad = sample(reference[0](x).shape, generator, integers=True)
    for got, want in zip(run(conv, x, grad, False), run(reference[0], x, grad, False),
                         strict=True):
        assert torch.equal(got, want)
    x = sample((2, 3, 6), generator, integers=True)
    with torch.no_grad():
        grad = sample(reference[1][0](x).shape, generator, integers=True)
    for got, want in zip(run(up, x, grad, False), run(reference[1][0], x, grad, False),
                         strict=True):
        assert torch.equal(got, want)
    assert len(kernel_calls) == 6  # each module's forward, data and weight gradients

    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(copied[0]) is type(conv) and type(copied[1][0]) is type(up)
        assert copied[0].weight is not conv.weight
        assert torch.equal(copied[0].weight, conv.weight)
    restored = copy.deepcopy(reference)
    restored.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(),
                                                 model.state_dict().values(), strict=True))

    again = cgt.convert(model)
    assert again.already == ["0", "1.0"] and not again.converted and not again.skipped


def test_convert_leaves_alone_subclasses_that_override_the_computation():
    model = nn.Sequential(ForwardOverride(2, 2, 1), ConvForwardOverride(2, 2, 1),
                          OutputPaddingOverride(2, 2, 1), Conv3DSimple(2, 2).double())
    report = cgt.convert(model)
    assert not report.converted
    reasons = {name: why for name, _, why in report.skipped}
    assert "ForwardOverride" in reasons["0"] and "overrides forward" in reasons["0"]
    assert "overrides _conv_forward" in reasons["1"]
    assert "overrides _output_padding" in reasons["2"]
    assert "torch.float64" in reasons["3"]  # _why_not's checks apply to subclasses too
    assert "left alone 1 (ConvForwardOverride)" in str(report)
    assert [type(m) for m in model] == [ForwardOverride, ConvForwardOverride,
                                        OutputPaddingOverride, Conv3DSimple]


def test_converted_module_on_another_device_or_dtype_fails_clearly():
    module = cgt.Conv2d(2, 2, 3)
    with pytest.raises(TypeError, match="input has dtype torch.float64"):
        copy.deepcopy(module).double()(torch.randn(1, 2, 5, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="device meta"):
        copy.deepcopy(module).to("meta")(torch.randn(1, 2, 5, 5, device="meta"))
    with pytest.raises(ValueError, match="zeros"):
        cgt.ConvTranspose2d(2, 2, 3, padding_mode="reflect")


def _model(seed):
    """Two layers that run the 2-D "plain" geometry's kernels (a convolution and the
    transposed convolution of the same shape), so compiling them costs nothing new."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 5, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(5, 3, 3, stride=2, padding=1, output_padding=1), nn.Flatten(),
        nn.Linear(3 * 8 * 8, 3))


def _step(model, x):
    x = x.clone().requires_grad_()
    loss = model(x).square().sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return loss.detach(), x.grad, grads


def test_converted_model_under_torch_compile_traces_convgrad_ops():
    """fullgraph=True: one graph; AOTAutograd's forward and backward graphs call the
    convgrad ops and no aten convolution; results equal eager torch.nn's."""
    model = _model(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape))
    reference = copy.deepcopy(model)
    cgt.convert(model)
    graphs = {}

    def recorder(kind):
        def compiler(graph, example_inputs):
            graphs[kind] = {str(node.target) for node in graph.graph.nodes
                            if node.op == "call_function"}
            return make_boxed_func(graph.forward)
        return compiler

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randint(-2, 3, (2, 3, 8, 8)).float()
    got, want = _step(compiled, x), _step(reference, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(g, w) for g, w in zip(got[2], want[2], strict=True))
    assert "convgrad.conv_transpose_backward_data.default" in graphs["forward"]
    assert "convgrad.convolution_backward_data.default" in graphs["forward"]
    assert {"convgrad.convolution_backward_data.default",
            "convgrad.conv_transpose_backward_data.default",
            "convgrad.convolution_backward_weights.default"} <= graphs["backward"]
    assert not any("convolution.default" in t and "aten" in t
                   for t in graphs["forward"] | graphs["backward"])


def test_converted_model_under_inductor_gives_the_same_results(kernel_calls):
    """The default backend (inductor), two batch sizes (the second traces the batch
    as a symbolic size)."""
    model = _model(4)
    reference = copy.deepcopy(model)
    cgt.convert(model)
    compiled = torch.compile(model, fullgraph=True)
    for batch in (2, 3):
        x = torch.randn(batch, 3, 8, 8)
        got, want = _step(compiled, x), _step(reference, x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        for g, w in zip(got[2], want[2], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert {call[0] for call in kernel_calls} == {
        "ConvTransposeBackwardData", "ConvolutionBackwardData", "ConvolutionBackwardWeights"}


@pytest.mark.parametrize("rank", [2, 3])
def test_channels_last_weights_are_read_and_written_in_place(kernel_calls, rank):
    """A channels_last model's weights ((O, k..., I) in memory: OXI) reach the forward and
    data-gradient kernels in place, and its weight gradient is written by the kernel in
    the parameter's memory format, so autograd keeps it as the parameter's .grad: no
    copy of either in the step (torch.profiler), and the results exact."""
    fmt = torch.channels_last if rank == 2 else torch.channels_last_3d
    generator = torch.Generator().manual_seed(3)
    reference = (nn.Conv2d if rank == 2 else nn.Conv3d)(4, 6, 3, padding=1, bias=False)
    with torch.no_grad():
        reference.weight.copy_(sample(reference.weight.shape, generator, integers=True))
    reference = reference.to(memory_format=fmt)
    conv = copy.deepcopy(reference)
    cgt.convert(conv)
    x = sample((2, 4) + (5,) * rank, generator, integers=True).to(memory_format=fmt)
    grad = sample((2, 6) + (5,) * rank, generator, integers=True).to(memory_format=fmt)
    with torch.profiler.profile() as profile:
        conv(x.requires_grad_()).backward(grad)
    copies = [e for e in profile.events() if e.name == "aten::copy_"]
    weight = conv.weight
    by_kind = {call[0]: call for call in kernel_calls}
    assert by_kind["ConvTransposeBackwardData"][1][1] == weight.data_ptr()  # forward
    assert by_kind["ConvolutionBackwardData"][1][1] == weight.data_ptr()
    assert by_kind["ConvolutionBackwardWeights"][2] == weight.grad.data_ptr()
    assert weight.grad.is_contiguous(memory_format=fmt) and not weight.grad.is_contiguous()
    assert copies == []
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).backward(grad)
    assert torch.equal(weight.grad, reference.weight.grad)
    assert torch.equal(x.grad, x_ref.grad)
