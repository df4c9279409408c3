"""convgrad.torch's custom ops: torch.library.opcheck, values and gradients (first and
second order) against references written with torch's own convolutions only, layouts
and zero-copy views, errors, and `import convgrad` without PyTorch.

All values are small integers in float32, so every sum is exact and results are
compared bit for bit. The ops share one geometry (4 -> 6 channels in 2 groups, kernel
3x2, strides (2, 1), dilations (1, 2)) with test_torch_modules.py, so the kernels they
compile are reused there.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import convgrad.torch as cgt  # noqa: E402
from convgrad.torch import OPS  # noqa: E402

STRIDES, DILATIONS, GROUPS, KERNEL = [2, 1], [1, 2], 2, [3, 2]
PADS_BEGIN, PADS_END = [1, 0], [2, 1]  # asymmetric on both axes
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def ints(*shape, channels_last=False, dtype=torch.float32, seed=None):
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    t = torch.randint(-2, 3, shape, generator=generator).to(dtype)
    return to_layout(t, channels_last)


def to_layout(t, channels_last):
    if not channels_last:
        return t.contiguous()
    rank = t.dim() - 2
    return t.movedim(1, -1).contiguous().movedim(-1, 1) if rank else t


def torch_pads(pads_begin, pads_end):
    """F.pad's argument: the last axis first."""
    pads = []
    for b, e in zip(reversed(pads_begin), reversed(pads_end), strict=True):
        pads += [b, e]
    return pads


def extent(k, d):
    return d * (k - 1) + 1


# References from torch's convolutions (SEMANTICS.md, "What each op computes").

def ref_conv_transpose_backward_data(diff_dst, weights, strides, pads_begin, pads_end,
                                     dilations, groups):
    rank = diff_dst.dim() - 2
    return CONV[rank](F.pad(diff_dst, torch_pads(pads_begin, pads_end)), weights,
                      stride=strides, dilation=dilations, groups=groups)


def ref_convolution_backward_data(diff_dst, weights, shape, strides, pads_begin, pads_end,
                                  dilations, groups, output_padding):
    """The transposed convolution without pads, then output y is full[y + pb]."""
    rank = diff_dst.dim() - 2
    full = CONV_T[rank](diff_dst, weights, stride=strides, dilation=dilations, groups=groups)
    if shape is None:
        shape = [s * (x - 1) + extent(k, d) - b - e + p for x, k, s, d, b, e, p in
                 zip(diff_dst.shape[2:], weights.shape[2:], strides, dilations, pads_begin,
                     pads_end, output_padding, strict=True)]
    ends = [y - length + b for y, length, b in zip(shape, full.shape[2:], pads_begin,
                                                  strict=True)]
    return F.pad(full, torch_pads([-b for b in pads_begin], ends))


def _weight_grad(read, result_grad, weights_shape, strides, pads_begin, pads_end, dilations,
                 groups):
    """d/dW of <conv(pad(read), W), result_grad>, itself differentiable."""
    rank = read.dim() - 2
    weights = torch.zeros(weights_shape, dtype=read.dtype, requires_grad=True)
    out = CONV[rank](F.pad(read, torch_pads(pads_begin, pads_end)), weights, stride=strides,
                     dilation=dilations, groups=groups)
    return torch.autograd.grad(out, weights, result_grad, create_graph=True)[0]


def ref_convolution_backward_weights(src, diff_dst, kernel, strides, pads_begin, pads_end,
                                     dilations, groups):
    shape = [diff_dst.shape[1], src.shape[1] // groups, *kernel]
    return _weight_grad(src, diff_dst, shape, strides, pads_begin, pads_end, dilations,
                        groups)


def ref_conv_transpose_backward_weights(src, diff_dst, kernel, strides, pads_begin,
                                        pads_end, dilations, groups):
    shape = [src.shape[1], diff_dst.shape[1] // groups, *kernel]
    return _weight_grad(diff_dst, src, shape, strides, pads_begin, pads_end, dilations,
                        groups)


def _cases(channels_last, pads_begin=PADS_BEGIN, pads_end=PADS_END, dtype=torch.float32):
    """(op name, args, reference) for every op; the first two args are the tensors."""
    cl = channels_last
    x = ints(2, 4, 9, 8, channels_last=cl, seed=1, dtype=dtype)  # the convolution's input
    # its weight (OC, IC/g, k) = ConvTranspose's (IC, OC/g, k)
    w = ints(6, 2, 3, 2, seed=2, dtype=dtype)
    attrs = (STRIDES, pads_begin, pads_end, DILATIONS, GROUPS)
    y = ref_conv_transpose_backward_data(x, w, *attrs)  # (2, 6, 5, 7)
    dy = ints(*y.shape, channels_last=cl, seed=3, dtype=dtype)
    # A transposed convolution's input whose result is longer than the forward's input:
    # output_padding (1, 1) (axis 1: stride 1 < padding 1 < dilation 2).
    dz = ints(2, 6, 4, 6, channels_last=cl, seed=4, dtype=dtype)
    return [
        ("conv_transpose_backward_data", (x, w, *attrs), ref_conv_transpose_backward_data),
        ("convolution_backward_data", (dy, w, [9, 8], *attrs, [0, 0]),
         ref_convolution_backward_data),
        ("convolution_backward_data", (dz, w, None, *attrs, [1, 1]),
         ref_convolution_backward_data),
        # ConvolutionBackpropData with output_shape: any size, pads_begin is the offset.
        ("convolution_backprop_data", (dy, w, [7, 12], *attrs, [0, 0]),
         ref_convolution_backward_data),
        ("convolution_backward_weights", (x, dy, KERNEL, *attrs),
         ref_convolution_backward_weights),
        ("convolution_backprop_filters", (x, dy, KERNEL, *attrs),
         ref_convolution_backward_weights),
        ("conv_transpose_backward_weights", (dy, x, KERNEL, *attrs),
         ref_conv_transpose_backward_weights),
    ]


CASES = [(cl, i) for cl in (False, True) for i in range(len(_cases(False)))]


def _case_id(case):
    channels_last, index = case
    name = _cases(False)[index][0]
    return f"{name}-{index}-{'NXC' if channels_last else 'NCX'}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_op_value_and_gradients_match_torch_exactly(case):
    channels_last, index = case
    name, args, reference = _cases(channels_last)[index]
    a, b = (t.clone().requires_grad_() for t in args[:2])
    out = OPS[name](a, b, *args[2:])
    expected = reference(*args)
    assert out.shape == expected.shape
    assert torch.equal(out, expected)
    if channels_last and name in ("conv_transpose_backward_data", "convolution_backward_data",
                                  "convolution_backprop_data"):
        assert out.movedim(1, -1).is_contiguous()  # the result keeps the input's layout
    grad = ints(*out.shape, channels_last=channels_last, seed=5)
    grads = torch.autograd.grad(out, (a, b), grad)
    ra, rb = (t.clone().requires_grad_() for t in args[:2])
    expected_grads = torch.autograd.grad(reference(ra, rb, *args[2:]), (ra, rb), grad)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("pads", ["asymmetric", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCX", "NXC"])
def test_the_stand_in_computes_every_op_exactly(channels_last, dtype, pads):
    """PyTorch's operators standing in for a kernel that is being compiled (convgrad's
    background mode) give every op's result, in the kernel's shape and layout: exact on
    integer data, with asymmetric pads (copies) and symmetric ones (the operators' own
    padding; backward data as the input gradient where the shapes are a convolution's,
    else a cropped transposed convolution)."""
    from convgrad.torch import _calls

    pads_begin, pads_end = (PADS_BEGIN, PADS_END) if pads == "asymmetric" else ([1, 1], [1, 1])
    for name, args, reference in _cases(channels_last, pads_begin, pads_end, dtype):
        a, b = args[:2]
        rest = [None, *args[2:]] if name == "conv_transpose_backward_data" else list(args[2:])
        rest += [None] * (7 - len(rest))  # shape, the attributes, output_padding
        call = _calls.Call(_calls.SPECS[name], a, b, *rest, num_threads=1)
        out = call.stand_in(a, b)
        expected = reference(*(t.float() for t in args[:2]), *args[2:]).to(dtype)
        assert out.shape == expected.shape and out.stride() == call.strides, name
        assert out.dtype == dtype, name
        assert torch.equal(out, expected), name


def test_gradients_of_gradients_match_torch_exactly():
    """Double backward: the forward convolution's weight gradient, differentiated by
    its input (the autograd of an autograd op is again convgrad ops)."""
    x = ints(2, 4, 9, 8, seed=6).requires_grad_()
    w = ints(6, 2, 3, 2, seed=7).requires_grad_()
    attrs = (STRIDES, PADS_BEGIN, PADS_END, DILATIONS, GROUPS)
    probe = ints(6, 2, 3, 2, seed=8)
    results = []
    for forward in (OPS["conv_transpose_backward_data"], ref_conv_transpose_backward_data):
        y = forward(x, w, *attrs)
        (grad_w,) = torch.autograd.grad(y, w, torch.ones_like(y), create_graph=True)
        results.append(torch.autograd.grad((grad_w * probe).sum(), x))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][0].abs().sum() > 0


@pytest.mark.parametrize("channels_last", [False, True], ids=["NCX", "NXC"])
def test_opcheck_passes_for_every_op(channels_last):
    seen = set()
    for name, args, _ in _cases(channels_last):
        a, b = (t.clone().requires_grad_() for t in args[:2])
        torch.library.opcheck(OPS[name], (a, b, *args[2:]))
        seen.add(name)
    assert seen == set(OPS)


def test_opcheck_passes_in_bfloat16_and_1d_3d():
    """(The geometry of test_torch_modules.py's "grouped" 1-D bf16 channels_last and 3-D
    f32 modules: the same kernels.)"""
    x = ints(2, 4, 9, channels_last=True, dtype=torch.bfloat16).requires_grad_()
    w = ints(6, 2, 3, dtype=torch.bfloat16).requires_grad_()
    torch.library.opcheck(OPS["conv_transpose_backward_data"], (x, w, [2], [1], [2], [1], 2))
    x3 = ints(1, 4, 5, 6, 4).requires_grad_()
    dy3 = ints(1, 6, 3, 5, 3).requires_grad_()
    torch.library.opcheck(OPS["convolution_backward_weights"],
                          (x3, dy3, [3, 2, 2], [2, 1, 1], [1, 0, 0], [1, 1, 0], [1, 2, 1], 2))


@pytest.mark.parametrize("dtype, channels_last",
                         [(torch.float32, False), (torch.float32, True),
                          (torch.float16, False), (torch.bfloat16, True)],
                         ids=["f32-NCX", "f32-NXC", "f16-NCX", "bf16-NXC"])
def test_tensors_reach_the_kernel_without_copies(kernel_calls, dtype, channels_last):
    calls = kernel_calls
    x = ints(2, 4, 9, 8, channels_last=channels_last, dtype=dtype)
    w = ints(6, 2, 3, 2, dtype=dtype)
    y = cgt.conv_transpose_backward_data(x, w, strides=STRIDES, pads_begin=PADS_BEGIN,
                                         pads_end=PADS_END, dilations=DILATIONS, groups=GROUPS)
    dw = cgt.convolution_backward_weights(x, y, KERNEL, strides=STRIDES,
                                          pads_begin=PADS_BEGIN, pads_end=PADS_END,
                                          dilations=DILATIONS, groups=GROUPS)
    layout = "NXC" if channels_last else "NCX"
    assert calls == [
        ("ConvTransposeBackwardData", [x.data_ptr(), w.data_ptr()], y.data_ptr(), layout),
        ("ConvolutionBackwardWeights", [x.data_ptr(), y.data_ptr()], dw.data_ptr(), layout)]
    assert y.dtype == dw.dtype == dtype
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
    reference = ref_conv_transpose_backward_data(x.float(), w.float(), STRIDES, PADS_BEGIN,
                                                 PADS_END, DILATIONS, GROUPS)
    assert torch.equal(y.float(), reference)  # small integer sums: exact in every dtype


def test_one_channel_tensors_keep_channels_last():
    """A tensor dense in both layouts (one channel) is read as channels_last when its
    strides, or its weights', are channels_last's, so a channels_last model whose input
    has one channel stays channels_last."""
    x = torch.randint(-2, 3, (2, 1, 6, 6)).float()
    w = torch.randint(-2, 3, (8, 1, 3, 3)).float()
    # .contiguous(memory_format=...) keeps a tensor that is already dense in both
    # layouts as it is; tensors allocated channels_last have its strides (as torch's
    # own convolutions make them).
    x_last = torch.empty(x.shape, memory_format=torch.channels_last).copy_(x)
    w_last = torch.empty(w.shape, memory_format=torch.channels_last).copy_(w)
    assert x_last.stride() != x.stride() and w_last.stride() != w.stride()
    results = {}
    for xs, ws in ((x, w), (x_last, w), (x, w_last), (x_last, w_last)):
        y = OPS["conv_transpose_backward_data"](xs, ws, [1, 1], [1, 1], [1, 1], [1, 1], 1)
        results[xs is x_last, ws is w_last] = y
    assert results[False, False].is_contiguous()
    for key in ((True, False), (False, True), (True, True)):
        assert results[key].is_contiguous(memory_format=torch.channels_last)
        assert not results[key].is_contiguous()
        assert torch.equal(results[key], results[False, False])


def test_other_strides_are_copied_and_still_right():
    x = ints(2, 4, 18, 8, seed=9)[:, :, ::2]  # a strided view: neither layout
    w = ints(6, 2, 3, 2, seed=10)
    y = cgt.conv_transpose_backward_data(x, w, strides=STRIDES, pads_begin=PADS_BEGIN,
                                         pads_end=PADS_END, dilations=DILATIONS, groups=GROUPS)
    assert torch.equal(y, ref_conv_transpose_backward_data(x, w, STRIDES, PADS_BEGIN,
                                                           PADS_END, DILATIONS, GROUPS))


def test_batch_zero_gives_an_empty_result():
    x = torch.zeros(0, 4, 9, 8)
    y = cgt.conv_transpose_backward_data(x, ints(6, 2, 3, 2), strides=STRIDES,
                                         pads_begin=PADS_BEGIN, pads_end=PADS_END,
                                         dilations=DILATIONS, groups=GROUPS)
    assert y.shape == (0, 6, 5, 7)


def test_bad_input_raises_errors_that_name_the_argument():
    x, w = ints(2, 4, 9, 8), ints(6, 2, 3, 2)
    with pytest.raises(TypeError, match="diff_dst has dtype torch.float64"):
        cgt.conv_transpose_backward_data(x.double(), w.double(), groups=2)
    with pytest.raises(TypeError, match="diff_dst is torch.float32 but weights is "
                                        "torch.bfloat16"):
        cgt.conv_transpose_backward_data(x, w.bfloat16(), groups=2)
    with pytest.raises(ValueError, match=r"strides = \[0, 0\] is invalid"):
        cgt.conv_transpose_backward_data(x, w, strides=0, groups=2)
    with pytest.raises(ValueError, match="groups"):
        cgt.conv_transpose_backward_data(x, w, groups=3)
    with pytest.raises(ValueError, match="pads_begin = .* expected 2 values"):
        cgt.conv_transpose_backward_data(x, w, pads_begin=[1, 1, 1], groups=2)
    with pytest.raises(TypeError, match="strides = 1.5 is invalid"):
        cgt.conv_transpose_backward_data(x, w, strides=1.5, groups=2)
    with pytest.raises(ValueError, match="weights_shape = None"):
        cgt.convolution_backward_weights(x, x, None)
    with pytest.raises(ValueError, match="diff_dst spatial shape"):  # convgrad's own check
        cgt.convolution_backward_data(ints(2, 6, 5, 7), w, [20, 8], strides=STRIDES,
                                      groups=2)
    with pytest.raises(ValueError, match="on device meta; convgrad's kernels run on CPU"):
        cgt.functional.conv2d(x.to("meta"), w.to("meta"), groups=2)
    with pytest.raises(TypeError, match="input has dtype torch.float64"):
        cgt.functional.conv2d(x.double(), w.double(), groups=2)
    with pytest.raises(ValueError, match="padding='same' is invalid with strides"):
        cgt.functional.conv2d(x, w, stride=2, padding="same", groups=2)
    with pytest.raises(ValueError, match="padding = 'full' is invalid"):
        cgt.functional.conv2d(x, w, padding="full", groups=2)


def test_functional_takes_begin_end_pairs():
    x, w = ints(2, 4, 9, 8, seed=11), ints(6, 2, 3, 2, seed=12)
    y = cgt.functional.conv2d(x, w, None, STRIDES, ((1, 2), (0, 1)), DILATIONS, GROUPS)
    assert torch.equal(y, ref_conv_transpose_backward_data(x, w, STRIDES, PADS_BEGIN,
                                                           PADS_END, DILATIONS, GROUPS))


def test_convgrad_imports_without_torch_and_convgrad_torch_names_the_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import convgrad\n"
            "assert 'convgrad.torch' not in sys.modules\n"
            "try:\n"
            "    import convgrad.torch\n"
            "except ImportError as error:\n"
            "    print(error)\n"
            "else:\n"
            "    raise SystemExit('imported')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "pip install convgrad[torch]" in result.stdout
    plain = subprocess.run([sys.executable, "-c", "import sys, convgrad; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert plain.stdout.strip() == "False", plain.stderr


def test_fake_shape_rules_agree_with_infer_shape():
    """The fake implementations' arithmetic (convgrad.codegen.shapes.result_shape, used
    for symbolic sizes under torch.compile's dynamic shapes) gives convgrad.infer_shape's
    shapes wherever that accepts the call. No kernel runs."""
    from convgrad.codegen import shapes
    from convgrad.torch import _calls

    checked = 0
    for spec in _calls.SPECS.values():
        for (y, k, s, d, pb, pe, op), groups in itertools.product(
                itertools.product([5, 8], [1, 3], [1, 2], [1, 2], [0, 2], [0, 1], [0, 1]),
                [1, 2]):
            a_channels, b_shape = 4, None
            if spec.family == "fwd":  # a: (N, OC, Y); b: (IC, OC/g, k)
                b_shape = (6, a_channels // groups, k)
            elif spec.family == "bwd_data":  # a: (N, OC, X); b: (OC, IC/g, k)
                b_shape = (a_channels, 6 // groups, k)
            a = torch.empty(2, a_channels, y, device="meta")
            variants = [None] if spec.family == "fwd" else [None, [y + 1], [y - 1]]
            for shape in variants:
                if spec.family == "bwd_weights":
                    shape = [k]
                    x = (y + pb + pe - (d * (k - 1) + 1)) // s + 1
                    if x < 1:
                        continue
                    b = torch.empty(2, 6, x, device="meta")
                    if spec.kind == "ConvTransposeBackwardWeights":
                        a, b = torch.empty(2, 6, x, device="meta"), \
                            torch.empty(2, a_channels, y, device="meta")
                else:
                    b = torch.empty(b_shape, device="meta")
                args = (shape, [s], [pb], [pe], [d], groups,
                        [op] if spec.family == "bwd_data" else None)
                try:
                    want = _calls.infer_shape(spec, a, b, *args)
                except ValueError:
                    continue
                assert list(want) == list(shapes.result_shape(
                    spec.family, spec.transpose, a.shape, b.shape, *args)), \
                    (spec.kind, tuple(a.shape), tuple(b.shape), args)
                checked += 1
    assert checked > 500


def test_the_torch_ops_are_the_op_table():
    """convgrad.torch registers exactly the ops of the one op table the numpy API reads
    (convgrad.codegen.OPS): an op per function name, with the table's input and shape
    names, and the same table entries; an entry added to either side alone fails here."""
    import convgrad
    from convgrad.codegen import OPS as TABLE
    from convgrad.torch import _calls

    assert set(OPS) == {spec.function for spec in TABLE.values()}
    for spec in TABLE.values():
        assert _calls.SPECS[spec.function] is spec
        schema = getattr(torch.ops.convgrad, spec.function).default._schema
        names = [argument.name for argument in schema.arguments]
        assert names[:2] == list(spec.inputs), spec.kind
        assert (spec.shape_name in names) == (spec.shape_name is not None), spec.kind
        assert ("output_padding" in names) == (spec.family == "bwd_data"), spec.kind
        assert getattr(cgt, spec.function).__name__ == spec.function
        assert getattr(convgrad, spec.function).__name__ == spec.function
