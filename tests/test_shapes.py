"""convgrad.codegen.shapes, the one home of the shape and padding rules: each function
against an independent computation (counting windows, torch.nn.functional's shapes
and results, convgrad.reference.reference_shape), over grids of sizes, kernels,
strides, dilations and pads; the arithmetic ones also on values that refuse to be
compared or converted (and on torch's unbacked SymInts, which raise on any guard), and
a converted model under torch.compile(dynamic=True) over two input sizes without a
recompile."""

from __future__ import annotations

import itertools
import warnings

import pytest

from convgrad.codegen import OPS, resolve, shapes
from convgrad.reference import reference_shape

SIZES, KERNELS, STRIDES, DILATIONS, PADS = range(1, 10), range(1, 5), (1, 2, 3), (1, 2, 3), \
    range(3)


def _windows(size: int, extent: int, stride: int, pb: int, pe: int) -> int:
    """Outputs of a forward convolution by counting its windows over the padded input."""
    return sum(1 for start in range(0, size + pb + pe, stride)
               if start + extent <= size + pb + pe)


def _axes():
    return itertools.product(SIZES, KERNELS, STRIDES, DILATIONS)


def test_extent_spans_the_dilated_taps():
    for k, d in itertools.product(KERNELS, DILATIONS):
        taps = [t * d for t in range(k)]
        assert shapes.extent(k, d) == taps[-1] - taps[0] + 1


def test_conv_output_size_counts_the_windows():
    for (y, k, s, d), pb, pe in itertools.product(_axes(), PADS, PADS):
        e = shapes.extent(k, d)
        got = shapes.conv_output_size(y, e, s, pb, pe)
        assert max(got, 0) == _windows(y, e, s, pb, pe), (y, k, s, d, pb, pe)


def test_transposed_output_size_is_the_largest_input_of_those_outputs():
    """A transposed convolution of X outputs gives the smallest input size of a forward
    convolution with X outputs, plus output_padding (below the stride)."""
    for (x, k, s, d), pb, pe in itertools.product(_axes(), PADS, PADS):
        e = shapes.extent(k, d)
        for p in range(s):
            y = shapes.transposed_output_size(x, e, s, pb, pe, p)
            if y < 1:
                continue
            assert _windows(y, e, s, pb, pe) == x, (x, k, s, d, pb, pe, p)
            if p == 0 and y > 1:
                assert _windows(y - 1, e, s, pb, pe) < x


def test_fit_pad_end_gives_exactly_the_outputs():
    for (y, k, s, d), pb in itertools.product(_axes(), PADS):
        e = shapes.extent(k, d)
        for x in range(1, _windows(y, e, s, pb, 2 * s) + 1):
            pe = shapes.fit_pad_end(x, y, e, s, pb)
            kept = y + min(pe, 0)  # a negative pad drops that many trailing inputs
            assert _windows(kept, e, s, pb, max(pe, 0)) == x, (y, k, s, d, pb, x)
            # the last window ends at the padded end: nothing read is left over
            assert (kept + pb + max(pe, 0) - e) % s == 0
    assert shapes.fit_pads_end([4, 2], [8, 5], [3, 1], [2, 3], [1, 2], [1, 0]) == [
        shapes.fit_pad_end(4, 8, shapes.extent(3, 1), 2, 1),
        shapes.fit_pad_end(2, 5, shapes.extent(1, 2), 3, 0)]


def test_tf_same_pads_give_ceil_of_size_over_stride():
    for y, k, s, d in _axes():
        e = shapes.extent(k, d)
        for upper in (True, False):
            pb, pe = shapes.tf_same_pads(y, e, s, upper)
            assert pb >= 0 and pe >= 0
            assert _windows(y, e, s, pb, pe) == -(-y // s), (y, k, s, d, upper)
            assert pe - pb == (pb + pe) % 2 if upper else pb - pe == (pb + pe) % 2
            # no more padding than those outputs need
            assert pb + pe == max((-(-y // s) - 1) * s + e - y, 0)


def test_transposed_same_pads_crop_to_the_size():
    for (x, k, s, d), y in itertools.product(_axes(), SIZES):
        e = shapes.extent(k, d)
        for p, upper in itertools.product(range(s), (True, False)):
            pb, pe = shapes.transposed_same_pads(x, y, e, s, p, upper)
            full = shapes.transposed_output_size(x, e, s, 0, 0, p)
            assert pb + pe == max(full - y, 0)
            # a transposed convolution's SAME_UPPER crops the odd one at the beginning
            assert pb - pe in (0, 1) if upper else pe - pb in (0, 1)
            if full >= y:
                assert shapes.transposed_output_size(x, e, s, pb, pe, p) == y


# --- against torch.nn.functional ------------------------------------------------------

torch_grid = pytest.mark.parametrize("rank", [1, 2])


def _torch():
    return pytest.importorskip("torch")


@torch_grid
def test_forward_and_transposed_sizes_are_torchs(rank):
    torch = _torch()
    F = torch.nn.functional
    conv = (F.conv1d, F.conv2d)[rank - 1]
    transposed = (F.conv_transpose1d, F.conv_transpose2d)[rank - 1]
    checked = 0
    for y, k, s, d, p in itertools.product(range(1, 8), (1, 2, 3), (1, 2, 3), (1, 2), (0, 1, 2)):
        size, kernel = [y, y + 1][:rank], [k, 4 - k][:rank]
        w = torch.empty(2, 3, *kernel, device="meta")
        out = shapes.conv_output_spatial(size, kernel, [s] * rank, [d] * rank, [p] * rank,
                                         [p] * rank)
        if min(out) >= 1:
            got = conv(torch.empty(1, 3, *size, device="meta"), w, None, s, p, d)
            assert list(got.shape[2:]) == out, (size, kernel, s, d, p)
        for extra in range(max(s, d)):
            want = shapes.transposed_output_spatial(size, kernel, [s] * rank, [d] * rank,
                                                    [p] * rank, [p] * rank, [extra] * rank)
            if min(want) < 1:
                continue
            got = transposed(torch.empty(1, 2, *size, device="meta"), w, None, s, p, extra,
                             1, d)
            assert list(got.shape[2:]) == want, (size, kernel, s, d, p, extra)
            checked += 1
    assert checked > 100


@torch_grid
def test_torch_same_pads_are_paddings_same(rank):
    torch = _torch()
    F = torch.nn.functional
    conv = (F.conv1d, F.conv2d)[rank - 1]
    generator = torch.Generator().manual_seed(0)
    for k, d, y in itertools.product((1, 2, 3, 4), (1, 2, 3), (5, 8)):
        kernel = [k, 5 - k][:rank]
        x = torch.randint(-3, 4, (1, 2, *[y] * rank), generator=generator).double()
        w = torch.randint(-3, 4, (3, 2, *kernel), generator=generator).double()
        begin, end = shapes.torch_same_pads(kernel, [d] * rank)
        pads = [v for b, e in zip(reversed(begin), reversed(end), strict=True) for v in (b, e)]
        with warnings.catch_warnings():  # torch: even kernels may need a padded copy
            warnings.simplefilter("ignore", UserWarning)
            same = conv(x, w, None, 1, "same", d)
        assert torch.equal(same, conv(F.pad(x, pads), w, None, 1, 0, d))
        for axis in range(rank):  # stride 1: TensorFlow's SAME_UPPER
            assert shapes.tf_same_pads(y, shapes.extent(kernel[axis], d), 1, True) == (
                begin[axis], end[axis])


def test_result_shapes_in_torchs_layout_are_torchs():
    """result_shape's defaults are torch's layouts: a convolution (fwd, its weights read
    as IOX), its transposed convolution (bwd_data) and the weight gradient."""
    torch = _torch()
    F = torch.nn.functional
    for y, k, s, d, p, groups in itertools.product((4, 7), (1, 3), (1, 2), (1, 2), (0, 1),
                                                   (1, 2)):
        x = torch.empty(2, 4, y, y + 1, device="meta")
        w = torch.empty(6, 4 // groups, k, 2, device="meta")
        attrs = ([s, s], [p, p], [p, p], [d, d], groups)
        try:
            out = F.conv2d(x, w, None, s, p, d, groups)
        except RuntimeError:  # the kernel is larger than the padded input
            continue
        assert shapes.result_shape("fwd", False, x.shape, w.shape, None, *attrs) == \
            tuple(out.shape)
        assert shapes.result_shape("bwd_weights", False, x.shape, out.shape, [k, 2],
                                   *attrs) == tuple(w.shape)
        assert shapes.result_shape("bwd_weights", False, x.shape, out.shape, w.shape,
                                   *attrs) == tuple(w.shape)
        for extra in range(max(s, d)):
            back = F.conv_transpose2d(out, w, None, s, p, extra, groups, d)
            assert shapes.result_shape("bwd_data", False, out.shape, w.shape, None, *attrs,
                                       [extra, extra]) == tuple(back.shape)
        # ConvTranspose's weight gradient: (IC, OC/g, k) from src (N, IC, X), dy (N, OC, Y)
        assert shapes.result_shape("bwd_weights", True, out.shape, x.shape, [k, 2],
                                   *attrs) == (6, 4 // groups, k, 2)


# --- against resolve and the reference ------------------------------------------------

_LAYOUTS = [("NCX", "OIX"), ("NXC", "XIO"), ("NXC", "OXI"), ("NCX", "XIO")]


def _case_shapes(spec, data_format, weights_format, y, k, s, d, pb, pe, groups):
    """(inputs in the op's order, shape input) of one 1-D case, or None where the
    forward convolution has no output."""
    x = shapes.conv_output_size(y, shapes.extent(k, d), s, pb, pe)
    if x < 1:
        return None
    ic, oc = 2 * groups, 3 * groups
    src, dst = shapes.join_data(2, ic, [y], data_format), shapes.join_data(2, oc, [x],
                                                                            data_format)
    w = shapes.join_weights(oc, ic // groups, [k], weights_format)
    if spec.family == "bwd_data":
        return (dst, w), ([y] if spec.kind == "ConvolutionBackwardData" else None)
    if spec.family == "fwd":  # ConvTranspose's weights: (IC, OC/g, k) of diff_dst's conv
        return (src, shapes.join_weights(oc, ic // groups, [k], weights_format)), None
    if spec.transpose:
        return (dst, src), w
    return (src, dst), w


@pytest.mark.parametrize("layout", _LAYOUTS, ids="-".join)
def test_result_shape_is_resolves_and_the_references(layout):
    data_format, forward_weights = layout
    checked = 0
    for spec in OPS.values():
        weights_format = forward_weights
        if spec.transpose:  # the ConvTranspose spelling of the same positions
            weights_format = {"OIX": "IOX", "XIO": "XOI", "OXI": "IXO"}[forward_weights]
        for y, k, s, d, pb, pe, groups in itertools.product(
                (3, 6, 9), (1, 2, 3), (1, 2), (1, 3), (0, 2), (0, 1), (1, 2)):
            case = _case_shapes(spec, data_format, weights_format, y, k, s, d, pb, pe, groups)
            if case is None:
                continue
            inputs, shape = case
            attrs = {"strides": [s], "pads_begin": [pb], "pads_end": [pe], "dilations": [d],
                     "groups": groups, "data_format": data_format,
                     spec.weights_attr: weights_format}
            try:
                problem = resolve(spec.kind, inputs, attrs, shape)
            except ValueError:
                continue
            want = reference_shape(spec.kind, [*inputs, shape], attrs)
            assert problem.output_shape == want
            assert shapes.result_shape(spec.family, spec.transpose, *inputs, shape, [s], [pb],
                                       [pe], [d], groups, [0], data_format,
                                       weights_format) == want, (spec.kind, inputs, attrs)
            checked += 1
    assert checked > 300


def test_split_and_join_place_the_axes_by_the_formats_letters():
    """Each format's letters say where N/C/X or O/I/X are; ConvTranspose's spellings
    (IOX, XOI, IXO) put its (IC, OC/g) where the forward names put (O, I/g)."""
    for rank in (1, 2, 3):
        for fmt in shapes.DATA_FORMATS:
            n, c, spatial = 7, 5, tuple(range(11, 11 + rank))
            shape = shapes.join_data(n, c, spatial, fmt)
            letters = fmt.replace("X", "X" * rank)
            assert shape[letters.index("N")] == n and shape[letters.index("C")] == c
            assert tuple(v for v, letter in zip(shape, letters, strict=True)
                         if letter == "X") == spatial
            assert shapes.split_data(list(shape), fmt) == (n, c, spatial)
        for fmt in shapes.WEIGHTS_FORMATS:
            outer, inner, kernel = 7, 5, tuple(range(11, 11 + rank))
            shape = shapes.join_weights(outer, inner, kernel, fmt)
            letters = fmt.replace("X", "X" * rank)
            outer_letter = "I" if fmt in ("IOX", "XOI", "IXO") else "O"
            inner_letter = "O" if outer_letter == "I" else "I"
            assert shape[letters.index(outer_letter)] == outer
            assert shape[letters.index(inner_letter)] == inner
            assert tuple(v for v, letter in zip(shape, letters, strict=True)
                         if letter == "X") == kernel
            assert shapes.split_weights(list(shape), fmt) == (outer, inner, kernel)


# --- SymInt-friendly: plain arithmetic -----------------------------------------------

class Opaque:
    """An integer that adds, subtracts, multiplies and floor-divides, but refuses to be
    compared, tested for truth or converted: what torch's SymInts cost a guard for."""

    def __init__(self, value: int):
        self.value = value

    @staticmethod
    def _of(other):
        return other.value if isinstance(other, Opaque) else other

    def __add__(self, other):
        return Opaque(self.value + self._of(other))

    def __radd__(self, other):
        return Opaque(self._of(other) + self.value)

    def __sub__(self, other):
        return Opaque(self.value - self._of(other))

    def __rsub__(self, other):
        return Opaque(self._of(other) - self.value)

    def __mul__(self, other):
        return Opaque(self.value * self._of(other))

    def __rmul__(self, other):
        return Opaque(self._of(other) * self.value)

    def __floordiv__(self, other):
        return Opaque(self.value // self._of(other))

    def __rfloordiv__(self, other):
        return Opaque(self._of(other) // self.value)

    def _refuse(self, *args):
        raise AssertionError("a shape rule compared or converted a size")

    __bool__ = __int__ = __index__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __eq__ = __ne__ = __hash__ = _refuse


def _plain(value):
    if isinstance(value, tuple | list):
        return type(value)(_plain(v) for v in value)
    return value.value if isinstance(value, Opaque) else value


def _opaque(values):
    return [Opaque(v) for v in values]


def test_the_arithmetic_rules_never_compare_or_convert_a_size():
    for y, k, s, d in itertools.product((5, 8), (1, 3), (1, 2), (1, 2)):
        pb, pe, x, p = 1, 2, 3, s - 1
        e = shapes.extent(Opaque(k), Opaque(d))
        assert _plain(e) == shapes.extent(k, d)
        assert _plain(shapes.conv_output_size(Opaque(y), e, Opaque(s), Opaque(pb),
                                              Opaque(pe))) == \
            shapes.conv_output_size(y, shapes.extent(k, d), s, pb, pe)
        assert _plain(shapes.transposed_output_size(Opaque(x), e, Opaque(s), Opaque(pb),
                                                    Opaque(pe), Opaque(p))) == \
            shapes.transposed_output_size(x, shapes.extent(k, d), s, pb, pe, p)
        assert _plain(shapes.fit_pads_end(_opaque([x]), _opaque([y]), _opaque([k]),
                                          _opaque([s]), _opaque([d]), _opaque([pb]))) == \
            shapes.fit_pads_end([x], [y], [k], [s], [d], [pb])
        assert _plain(shapes.torch_same_pads(_opaque([k]), _opaque([d]))) == \
            shapes.torch_same_pads([k], [d])
        for fmt in shapes.DATA_FORMATS:
            assert _plain(shapes.split_data(_opaque([2, 3, y, y]), fmt)) == \
                shapes.split_data([2, 3, y, y], fmt)
        for fmt in shapes.WEIGHTS_FORMATS:
            assert _plain(shapes.split_weights(_opaque([2, 3, k, k]), fmt)) == \
                shapes.split_weights([2, 3, k, k], fmt)


@pytest.mark.parametrize("spec", list(OPS.values()), ids=lambda spec: spec.kind)
def test_result_shape_never_compares_or_converts_a_size(spec):
    for y, k, s, d, pb, pe, groups in itertools.product((5, 9), (1, 3), (1, 2), (1, 2), (0, 1),
                                                        (0, 2), (1, 2)):
        for data_format, weights_format in (("NCX", "OIX"), ("NXC", "XIO")):
            case = _case_shapes(spec, data_format, weights_format, y, k, s, d, pb, pe, groups)
            if case is None:
                continue
            (a, b), shape = case
            args = ([s], [pb], [pe], [d], groups, [0], data_format, weights_format)
            want = shapes.result_shape(spec.family, spec.transpose, a, b, shape, *args)
            got = shapes.result_shape(spec.family, spec.transpose, _opaque(a), _opaque(b),
                                      None if shape is None else _opaque(shape),
                                      *([_opaque(v) if isinstance(v, list) else v
                                         for v in args[:4]] + [Opaque(groups), _opaque([0]),
                                                               data_format, weights_format]))
            assert _plain(got) == want


def test_result_shape_on_unbacked_symints_adds_no_guard():
    """torch's unbacked SymInts raise on any guard (a comparison or a bool of a size)."""
    _torch()
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n, c, h, w = (env.create_unbacked_symint() for _ in range(4))
    attrs = ([2, 1], [1, 0], [1, 2], [1, 2], 1)
    fwd = shapes.result_shape("fwd", False, [n, c, h, w], [6, c, 3, 2], None, *attrs)
    assert [str(v) for v in fwd[:2]] == [str(n), "6"]
    data = shapes.result_shape("bwd_data", False, [n, 6, h, w], [6, c, 3, 2], None, *attrs,
                               [1, 0])
    assert str(data[2]) == str(2 * (h - 1) + 3 - 1 - 1 + 1)
    weights = shapes.result_shape("bwd_weights", False, [n, c, h, w], [n, 6, *fwd[2:]],
                                  [3, 2], *attrs)
    assert weights[0] == 6 and weights[2:] == (3, 2)
    pads = shapes.fit_pads_end(fwd[2:], [h, w], [3, 2], [2, 1], [1, 2], [1, 0])
    assert len(pads) == 2
    assert not env.guards


@pytest.mark.parametrize("transpose", [False, True], ids=["Conv2d", "ConvTranspose2d"])
def test_converted_conv_under_dynamic_torch_compile_does_not_recompile(kernel_calls,
                                                                       transpose):
    """torch.compile(dynamic=True) of a converted layer, forward and backward, over two
    input sizes: one compilation (error_on_recompile), the convgrad kernels run, and the
    results equal torch.nn's."""
    torch = _torch()
    import copy

    import convgrad.torch as cgt

    torch.manual_seed(0)
    if transpose:
        layer = torch.nn.ConvTranspose2d(5, 3, 3, stride=2, padding=1, output_padding=1)
    else:
        layer = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randint(-2, 3, p.shape))
    reference = copy.deepcopy(layer)
    cgt.convert(layer)
    compiles = []

    def backend(graph, example_inputs):
        compiles.append(graph)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(graph, example_inputs)

    compiled = torch.compile(layer, backend=backend, dynamic=True, fullgraph=True)
    channels = 5 if transpose else 3
    with torch._dynamo.config.patch(error_on_recompile=True):
        for size in ((8, 7), (11, 6)):  # not square: duck sizing would tie H and W
            x = torch.randint(-2, 3, (2, channels, *size)).float()
            got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
            got, want = compiled(got_x), reference(want_x)
            assert got.shape == want.shape and torch.equal(got, want)
            grad = torch.randint(-2, 3, got.shape).float()
            got.backward(grad)
            want.backward(grad)
            assert torch.equal(got_x.grad, want_x.grad)
    assert len(compiles) == 1
    assert kernel_calls
