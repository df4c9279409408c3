"""NaN, inf and denormal values through the kernels: a NaN reaches exactly the results
it touches, an inf at a padded border or meeting the AMX copies' zeros gives the op's
result (no 0 x inf from padding), a bf16 denormal result is kept, and AMX flushes
denormals as the README says.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import DTYPES, make_case
from checks import assert_equal_with_nans
from forcing import HAS_AMX, ISAS

import convgrad
from convgrad.reference import OP_KINDS


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
def test_nan_reaches_exactly_the_results_it_touches(op, dtype, data_format):
    """A NaN in each data input: NaN where the reference has one, exact values elsewhere
    (padding, pair partners and unused vector lanes must not spread it)."""
    case = make_case(op, spatial=(7, 6), kernel=(3, 2), in_channels=5, out_channels=18,
                     batch=2, data_format=data_format, dtype=dtype,
                     attrs=dict(strides=[2, 1], pads_begin=[1, 0], pads_end=[1, 1]))
    first = case.inputs[0]
    first[(0,) * first.ndim] = np.nan
    if case.inputs[1].ndim == first.ndim and case.inputs[1].shape[0] == first.shape[0]:
        second = case.inputs[1]  # weight gradients: a NaN in diff_dst too
        second[(1,) + (2,) * (second.ndim - 1)] = np.nan
    result = convgrad.execute(case.op, case.inputs, case.attrs)
    expected = case.expected(result.dtype)
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    assert_equal_with_nans(result, expected)


@pytest.mark.parametrize("op", ["ConvolutionBackwardWeights", "ConvTransposeBackwardWeights"])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
@pytest.mark.parametrize("in_channels,groups", [(16, 1), (2, 1), (4, 4)])
@pytest.mark.parametrize("column", [0, 2])
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_weight_gradient_of_inf_at_a_padded_border(op, dtype, data_format, in_channels, groups,
                                                   column):
    """Copies that are zero outside the image multiply the padding by diff_dst; an inf
    there (column 0) must not turn taps that only reach padding into NaN (0 x inf). Sums
    without a NaN skip the scan for it: an inf inside (column 2) gives the op's result."""
    case = make_case(op, spatial=(6, 6), kernel=(3, 3), in_channels=in_channels,
                     out_channels=16 if groups == 1 else 4, groups=groups, batch=1,
                     data_format=data_format, dtype=dtype,
                     attrs=dict(pads_begin=[1, 1], pads_end=[1, 1]))
    diff = case.inputs[1]  # diff_dst (the ConvTranspose op's own src) of the weight gradient
    diff[(0, 2, column, 0) if data_format == "NXC" else (0, 0, 2, column)] = np.inf
    result = convgrad.execute(case.op, case.inputs, case.attrs)
    expected = case.expected(result.dtype)
    assert np.isinf(expected).any()
    assert_equal_with_nans(result, expected)


@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
def test_bf16_denormal_result_is_kept(data_format):
    """1.5 x 2^-126 - 1.25 x 2^-126 over two multiply steps: the f32 sum is denormal and
    rounds to the bf16 denormal 2^-128 in either layout (vcvtneps2bf16 alone flushes it)."""
    tiny = 2.0 ** -126
    diff_dst = np.zeros((1, 5, 1, 4), np.float32)
    diff_dst[..., 0], diff_dst[..., 2] = 1.5 * tiny, -1.25 * tiny
    weights = np.zeros((1, 1, 16, 4), np.float32)  # XIO
    weights[..., 0] = weights[..., 2] = 1.0
    bf16 = DTYPES["bf16"]
    first = diff_dst.astype(bf16)
    if data_format == "NCX":
        first = np.ascontiguousarray(np.moveaxis(first, -1, 1))
    result = convgrad.execute("ConvolutionBackwardData",
                             [first, weights.astype(bf16), np.array([5, 1])],
                             dict(data_format=data_format, weights_format="XIO"))
    np.testing.assert_array_equal(result.astype(np.float32), np.float32(0.25 * tiny))


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("op", ["ConvolutionBackwardWeights", "ConvolutionBackwardData"])
def test_amx_tiles_never_multiply_inf_by_padding(isa, op):
    """An inf in src at the image's corner (weight gradients), or in the weights (data
    gradients), meets the AMX copies' zeros where the convolution has no product; such
    calls take the other tiles, whose result (here NaN and inf exactly where products of
    the inf are) the AMX kernel then gives too."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    case = make_case(op, spatial=(5, 7), kernel=(3, 3), in_channels=32, out_channels=32,
                     batch=1, data_format="NXC", dtype="bf16", seed=25,
                     attrs=dict(pads_begin=1, pads_end=1))
    a, b = case.inputs[:2]
    if op == "ConvolutionBackwardWeights":
        a[0, 0, 0, 3] = np.inf  # src
    else:
        b[0, 0, 5, 2] = np.inf  # weights (XIO): tap (0, 0)
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
    config = problem.config.with_isa(isa)
    results = []
    for plan in ({"bf16_dot": 0}, {"bf16_dot": 0, "amx": 0}):
        kernel = kernels.get_kernel(config, plan)
        dims = kernels.dims_of(problem, 2)
        first, second = (b, a) if problem.swap_inputs else (a, b)
        out = np.zeros(problem.output_shape, a.dtype)
        kernels.call(kernel, problem, dims, first, second, out,
                     np.empty(kernel.workspace_size(dims), dtype=np.uint8))
        results.append(out.astype(np.float32))
    assert np.isinf(results[1]).any()
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
@pytest.mark.parametrize("where", ["src", "weights", "diff_dst"])
def test_amx_patches_keep_inf_where_the_products_are(isa, where):
    """The AMX patches of a forward convolution over 3 channels: an inf in src at the
    image's corner multiplies only its own products (the patches' zeros meet finite
    weights, and the AMX path runs: its workspace is its own); an inf weight would meet
    the zeros where a tap reads past the input, so that call takes the other tiles. The
    weight gradient's patches meet an inf in diff_dst: a NaN sum, and the other tiles
    compute the call. Each gives the result of the kernel without AMX, infs and NaNs
    where they are."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    op = "ConvolutionBackwardWeights" if where == "diff_dst" else "ConvTransposeBackwardData"
    channels = dict(in_channels=3, out_channels=32) if where == "diff_dst" else dict(
        in_channels=32, out_channels=3)
    case = make_case(op, spatial=(9, 8), kernel=(3, 3), **channels, batch=1,
                     data_format="NXC", dtype="bf16", seed=26,
                     attrs=dict(strides=[2, 2], pads_begin=1, pads_end=1))
    a, b = case.inputs[:2]
    if where == "src":
        a[0, 0, 0, 1] = np.inf
    elif where == "diff_dst":
        b[0, 0, 0, 5] = np.inf  # output pixel (0, 0): its taps above and left read padding
    else:
        # XOI: tap (0, 0), which reads above the input for the first output row; the
        # forward op's input channel 2 into its output channel 5
        b[0, 0, 2, 5] = -np.inf
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "bf16")
    config = problem.config.with_isa(isa)
    results, sizes = [], []
    for plan in ({"bf16_dot": 0}, {"bf16_dot": 0, "amx": 0}):
        kernel = kernels.get_kernel(config, plan)
        dims = kernels.dims_of(problem, 2)
        first, second = (b, a) if problem.swap_inputs else (a, b)
        out = np.zeros(problem.output_shape, a.dtype)
        sizes.append(kernel.workspace_size(dims))
        kernels.call(kernel, problem, dims, first, second, out,
                     np.empty(sizes[-1], dtype=np.uint8))
        results.append(out.astype(np.float32))
    assert (sizes[0] != sizes[1]) == HAS_AMX
    assert np.isinf(results[1]).any()
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx512bf16"])
def test_amx_tiles_flushes_denormals(isa):
    """AMX reads bf16 denormals as zero and flushes denormal f32 sums, as vdpbf16ps does
    (README): on a CPU with AMX, 1.5 x 2^-126 - 1.25 x 2^-126 gives 0, and a denormal
    input multiplies as 0; without AMX the widened tiles keep the denormal 2^-128 and the
    input (vdpbf16ps, Zen 4's rule, would flush them too)."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    tiny, bf16 = 2.0 ** -126, DTYPES["bf16"]
    diff_dst = np.zeros((1, 5, 1, 32), np.float32)
    diff_dst[0, :2, 0, 0], diff_dst[0, :2, 0, 2] = 1.5 * tiny, -1.25 * tiny
    diff_dst[0, 2:, 0, 0] = 0.5 * tiny  # a bf16 denormal
    weights = np.zeros((1, 1, 32, 32), np.float32)  # XIO
    weights[..., 0] = weights[..., 2] = 1.0
    first, second = diff_dst.astype(bf16), weights.astype(bf16)
    problem = resolve("ConvolutionBackwardData", [first.shape, second.shape],
                      dict(data_format="NXC", weights_format="XIO"), [5, 1], "bf16")
    config = problem.config.with_isa(isa)
    dims = kernels.dims_of(problem, 1)
    for plan, flushed in (({"bf16_dot": 0}, HAS_AMX), ({"amx": 0, "bf16_dot": 0}, False)):
        kernel = kernels.get_kernel(config, plan)
        out = np.empty(problem.output_shape, bf16)
        workspace = np.empty(kernel.workspace_size(dims), np.uint8)
        kernels.call(kernel, problem, dims, first, second, out, workspace)
        expected = np.zeros(problem.output_shape, np.float32)
        if not flushed:
            expected[0, :2, 0, :] = 0.25 * tiny
            expected[0, 2:, 0, :] = 0.5 * tiny
        np.testing.assert_array_equal(out.astype(np.float32), expected)
