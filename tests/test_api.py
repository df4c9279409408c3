"""The public API (convgrad.execute and the per-op functions) against the independent
numpy reference, on the kernels the rules pick on this CPU's best ISA path.

Inputs are small integers, so f32 sums are exact and compared bit for bit; f16 and
bf16 results are compared exactly with the exact sum rounded once to the dtype
(checks.assert_exact). Forced plans and the other ISA paths: test_variants_*.py; the
planner's rules alone: test_rules.py; NaN, inf and denormals: test_nonfinite.py.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from cases import DATA_OPS, DTYPES, SHAPE_NAMES, make_case
from checks import assert_exact, run_case
from forcing import forced_kernel
from geometries import GEOMETRY, GRID, weights_formats
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import convgrad
from convgrad import api, bound, threads
from convgrad.reference import OP_KINDS

FUNCTIONS = {spec.kind: getattr(convgrad, spec.function) for spec in api.OPS.values()}


@pytest.mark.parametrize("op,rank,data_format,weights_format,dtype", GRID)
def test_grid(op, rank, data_format, weights_format, dtype):
    """op x rank x data layout x weights layout x dtype, grouped, strided, dilated."""
    geometry = GEOMETRY[rank]
    case = make_case(op, **geometry, groups=2, in_channels=4, out_channels=6,
                     data_format=data_format, weights_format=weights_format, dtype=dtype)
    run_case(case)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("groups,in_channels,out_channels", [(1, 3, 5), (3, 6, 9), (8, 8, 8),
                                                             (4, 4, 8)])
def test_groups(op, groups, in_channels, out_channels):
    """Groups 1, > 1 and depthwise (with and without a channel multiplier)."""
    case = make_case(op, spatial=(6, 5), kernel=(3, 3), groups=groups, in_channels=in_channels,
                     out_channels=out_channels, attrs=dict(pads_begin=1, pads_end=1), seed=3)
    run_case(case)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("rank,data_format,dtype", [(1, "NXC", "f32"), (2, "NCX", "bf16"),
                                                    (3, "NXC", "f16"), (2, "NXC", "f32")])
@pytest.mark.parametrize("channels", [20, 70])
def test_depthwise(op, rank, data_format, dtype, channels):
    """Depthwise kernels vectorise across groups: a tail vector, several vector blocks."""
    geometry = GEOMETRY[rank]
    case = make_case(op, **geometry, groups=channels, in_channels=channels,
                     out_channels=channels, batch=1, data_format=data_format, dtype=dtype)
    run_case(case)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("pads,groups", [(0, 1), (0, 2), (1, 1)])
@pytest.mark.parametrize("spatial,batch", [((5, 7), 3), ((6, 7), 2), ((3, 3), 2)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_pointwise(op, pads, groups, spatial, batch, dtype):
    """1x1 stride 1: without pads every pixel of the batch is one run (data gradients) or
    the pixels are regrouped into rows of an even width (weight gradients: 84 pixels into
    2 rows of 42, 18 into one row; 105 pixels stay as they are); with pads, neither."""
    case = make_case(op, spatial=spatial, kernel=(1, 1), in_channels=34, out_channels=18,
                     groups=groups, batch=batch, dtype=dtype,
                     attrs=dict(pads_begin=pads, pads_end=pads))
    run_case(case)


AUTO_PADS = ["none", "explicit", "", "same_upper", "same_lower", "valid", "SAME_UPPER", "Valid"]


SHAPE_MODES = [(op, mode) for op in OP_KINDS
               for mode in ["absent", "attribute", "input", "full", "full_input"]
               # ConvTransposeBackwardData has no shape; the weight gradients need theirs.
               if (mode == "absent") == (op == "ConvTransposeBackwardData")
               or (mode == "absent" and op in DATA_OPS)]


@pytest.mark.parametrize("op,shape_mode", SHAPE_MODES)
@pytest.mark.parametrize("auto_pad", AUTO_PADS)
def test_auto_pad_and_shape(op, auto_pad, shape_mode):
    """Every auto_pad spelling with the shape absent, as attribute or input, spatial or full."""
    attrs = dict(strides=[2, 3], dilations=[1, 2], pads_begin=[2, 1], pads_end=[0, 3],
                 auto_pad=auto_pad)
    case = make_case(op, spatial=(7, 8), kernel=(3, 2), attrs=attrs, shape_mode=shape_mode,
                     seed=5)
    run_case(case)


@pytest.mark.parametrize("op", DATA_OPS)
@pytest.mark.parametrize("output_padding", [[1, 0], [0, 2], 1])
def test_output_padding(op, output_padding):
    attrs = dict(strides=[2, 3], dilations=[1, 1], output_padding=output_padding)
    case = make_case(op, spatial=(4, 3), kernel=(3, 3), attrs=attrs, shape_mode="absent")
    run_case(case)


@pytest.mark.parametrize("op", sorted(SHAPE_NAMES))
def test_shape_input_wins_over_attribute(op):
    case = make_case(op, spatial=(6, 6), kernel=(3, 3), shape_mode="input",
                     attrs=dict(pads_begin=1, pads_end=1))
    wrong = [7, 7] if op in DATA_OPS else [1, 1]
    case.attrs[SHAPE_NAMES[op]] = wrong  # the input must win
    result = convgrad.execute(case.op, case.inputs, case.attrs)
    case.attrs.pop(SHAPE_NAMES[op])
    assert_exact(case, result)


@pytest.mark.parametrize("op", OP_KINDS)
def test_functions_match_execute(op):
    """The per-op functions take the same inputs and keyword attributes."""
    case = make_case(op, spatial=(5, 6), kernel=(2, 3), groups=2, shape_mode="input",
                     attrs=dict(strides=2, pads_begin=[1, 0]))
    result = FUNCTIONS[op](*case.inputs, **case.attrs)
    assert_exact(case, result)


@pytest.mark.parametrize("op", OP_KINDS)
def test_out_argument(op):
    case = make_case(op, spatial=(5, 4), kernel=(3, 3), attrs=dict(pads_begin=1, pads_end=1))
    expected = convgrad.execute(case.op, case.inputs, case.attrs)
    out = np.full_like(expected, 99)
    result = convgrad.execute(case.op, case.inputs, case.attrs, out=out)
    assert result is out
    assert_exact(case, out)


@pytest.mark.parametrize("op", OP_KINDS)
def test_empty_batch(op):
    case = make_case(op, spatial=(5, 4), kernel=(3, 3), batch=0,
                     attrs=dict(pads_begin=1, pads_end=1))
    result = convgrad.execute(case.op, case.inputs, case.attrs)
    expected = case.expected(np.float32)
    assert result.shape == expected.shape
    if op in DATA_OPS:
        assert result.size == 0
    else:
        assert np.all(result == 0)  # a sum over no samples


@pytest.mark.parametrize("op", OP_KINDS)
def test_non_contiguous_inputs(op):
    case = make_case(op, spatial=(5, 4), kernel=(3, 3), attrs=dict(pads_begin=1))
    case.inputs[0] = np.asfortranarray(case.inputs[0])
    run_case(case)


@pytest.mark.parametrize("dtype,base", [("bf16", 256), ("f16", 2048)])
def test_rounding_is_to_nearest_even(dtype, base):
    """Sums base + 1, base + 2, ... fall on and between representable values (spacing 2
    there), so ties must go to the even neighbour."""
    np_dtype = DTYPES[dtype]
    offsets = np.arange(1, 17, dtype=np.float32)
    diff_dst = np.stack([np.full_like(offsets, base), offsets], axis=-1)[None]  # N, W, C=2
    weights = np.ones((1, 1, 2), dtype=np.float32)  # X=1, I=1, O=2
    result = convgrad.convolution_backward_data(diff_dst.astype(np_dtype),
                                               weights.astype(np_dtype))
    exact = base + offsets
    # Odd sums lie halfway between two neighbours; the even one is the multiple of 4.
    expected = np.where(exact % 2 == 0, exact,
                        np.where((exact - 1) % 4 == 0, exact - 1, exact + 1))
    np.testing.assert_array_equal(result[0, :, 0].astype(np.float32), expected)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("groups,in_channels,out_channels", [(1, 21, 38), (64, 64, 64),
                                                             (1, 3, 38)])
def test_thread_counts_agree(op, threads, groups, in_channels, out_channels):
    """Large enough that kernels use every thread asked for (tiny ones take one); 3
    input channels: backward data by col2im, threads sharing an image's rows."""
    rng = np.random.default_rng(1)
    case = make_case(op, spatial=(40, 38), kernel=(3, 3), in_channels=in_channels,
                     out_channels=out_channels, groups=groups, batch=4,
                     attrs=dict(pads_begin=1, pads_end=1))
    # Non-integer data: the order of the sums shows in the bits.
    case.inputs[:2] = [rng.standard_normal(x.shape).astype(np.float32) for x in case.inputs[:2]]
    one = convgrad.execute(case.op, case.inputs, case.attrs, num_threads=1)
    many = convgrad.execute(case.op, case.inputs, case.attrs, num_threads=threads)
    np.testing.assert_array_equal(one, many)
    # f32 sums of ~6000 products of normal values: rounding, bounded loosely
    np.testing.assert_allclose(one, case.expected(np.float32), rtol=1e-4, atol=2e-3)


@pytest.mark.parametrize("data_format", ["NCX", "NXC"])
def test_a_call_bound_under_another_openmp_default_runs_in_its_workspace(data_format):
    """A call binds a concrete thread count and sizes its workspace for it: bound while
    this thread's OpenMP default is 1 (torch.set_num_threads(1) sets it so), then run on
    a thread whose default is every core (XLA's threads run convgrad.jax's calls), it
    takes the count it was bound with (it took the run thread's default and wrote past a
    workspace of one thread's sums: heap corruption on NCX, a wrong training curve in
    convgrad.jax)."""
    if threads.get_num_threads() < 2:
        pytest.skip("needs two usable cores")
    gomp = ctypes.CDLL("libgomp.so.1")
    case = make_case("ConvolutionBackwardWeights", spatial=(40, 38), kernel=(3, 3),
                     in_channels=64, out_channels=64, batch=4, data_format=data_format,
                     attrs=dict(pads_begin=1, pads_end=1))
    before = gomp.omp_get_max_threads()
    gomp.omp_set_num_threads(1)
    try:
        here = convgrad.execute(case.op, case.inputs, case.attrs)
        call = bound.bind(case.op, case.inputs[0].shape, case.inputs[1].shape, "f32",
                          case.attrs)
    finally:
        gomp.omp_set_num_threads(before)
    assert call.dims.num_threads == threads.get_num_threads()
    there = []
    worker = threading.Thread(target=lambda: there.append(
        convgrad.execute(case.op, case.inputs, case.attrs)))
    worker.start()
    worker.join()
    expected = case.expected(np.float32)
    np.testing.assert_array_equal(here, expected)
    np.testing.assert_array_equal(there[0], expected)


@pytest.mark.parametrize("op,data_format", [("ConvolutionBackwardWeights", "NCX"),
                                            ("ConvolutionBackwardWeights", "NXC"),
                                            ("ConvolutionBackwardData", "NCX"),
                                            ("ConvTransposeBackwardData", "NXC")])
def test_kernels_align_a_workspace_at_any_address(op, data_format):
    """A caller's workspace of exactly workspace_size bytes may start at any address: the
    kernel aligns its parts inside it (no vector straddles cache lines) and writes
    nothing past its end."""
    case = make_case(op, spatial=(10, 12), kernel=(1, 1) if op.endswith("Weights") else (3, 3),
                     in_channels=40, out_channels=24, data_format=data_format, seed=13,
                     attrs={} if op.endswith("Weights") else dict(pads_begin=1, pads_end=1))
    size, run = forced_kernel(case, threads=2)
    for offset in (0, 4, 24, 36, 63):
        block = np.full(size + offset + 64, 0xA5, dtype=np.uint8)
        run(block[offset:offset + size])
        assert (block[offset + size:] == 0xA5).all() and (block[:offset] == 0xA5).all()


def test_results_start_on_64_byte_boundaries():
    """The arrays execute() allocates for results of more than 4 KB start on a 64-byte
    boundary (as PyTorch's do), whatever numpy would give; smaller ones are numpy's own."""
    for op, spatial in (("ConvolutionBackwardWeights", (40, 50)),
                        ("ConvolutionBackwardData", (33, 17)), ("ConvolutionBackwardData", (1, 1))):
        case = make_case(op, spatial=spatial, kernel=(1, 1), in_channels=64, out_channels=32)
        result = run_case(case)
        assert result.flags.c_contiguous
        assert result.nbytes <= 4096 or result.ctypes.data % 64 == 0
        assert_exact(case, result)


@pytest.mark.parametrize("op", ["ConvolutionBackwardData", "ConvTransposeBackwardData"])
@pytest.mark.parametrize("data_format", ["NXC", "NCX"])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_reduced_channels_in_several_chunks(op, data_format, dtype):
    """300 reduced channels over 7 taps take several passes over the image (the weight
    chunk of one pass stays in L2), and stride 2 over a 1-row kernel leaves output rows
    no tap reaches: the last pass must still write (and round) them."""
    case = make_case(op, spatial=(3, 5), kernel=(1, 7), in_channels=64, out_channels=300,
                     batch=1, data_format=data_format, dtype=dtype,
                     attrs=dict(strides=[2, 1], pads_begin=[0, 3], pads_end=[0, 3]))
    run_case(case)


@pytest.mark.parametrize("op", ["ConvolutionBackwardWeights", "ConvTransposeBackwardWeights"])
@pytest.mark.parametrize("in_channels", [2, 40])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_weight_gradient_with_rows_no_tap_reads(op, in_channels, dtype):
    """Stride 3 over a 1-row kernel: two src rows in three are never read, so converted
    copies skip them (2 input channels: the w-padded copy, which reads every row)."""
    case = make_case(op, spatial=(8, 7), kernel=(1, 3), in_channels=in_channels,
                     out_channels=20, batch=2, dtype=dtype,
                     attrs=dict(strides=[3, 2], pads_begin=[0, 1], pads_end=[0, 1]))
    run_case(case)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_inputs_at_odd_addresses(op, dtype):
    """Data one element past an aligned address: the bf16 path reads channel pairs in
    place as 32-bit words (the sanitizer run checks those reads too)."""
    case = make_case(op, spatial=(5, 6), kernel=(3, 3), in_channels=16, out_channels=32,
                     dtype=dtype)
    for index, array in enumerate(case.inputs[:2]):
        buffer = np.empty(array.size + 1, array.dtype)
        case.inputs[index] = buffer[1:].reshape(array.shape)
        case.inputs[index][...] = array
    run_case(case)


def test_infer_shape_matches_results():
    for op in OP_KINDS:
        case = make_case(op, spatial=(6, 5), kernel=(3, 2), groups=2,
                         attrs=dict(strides=2, pads_begin=1))
        shapes = [case.inputs[0].shape, case.inputs[1].shape]
        if len(case.inputs) > 2:
            shapes.append(list(case.inputs[2]))
        assert convgrad.infer_shape(op, shapes, case.attrs) == case.expected(np.float32).shape


@st.composite
def random_cases(draw):
    op = draw(st.sampled_from(OP_KINDS))
    rank = draw(st.integers(1, 3))
    kernel = tuple(draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)))
    strides = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    dilations = draw(st.lists(st.integers(1, 2), min_size=rank, max_size=rank))
    groups = draw(st.sampled_from([1, 2, 3]))
    in_channels = groups * draw(st.integers(1, 3))
    out_channels = groups * draw(st.integers(1, 3))
    spatial = tuple(draw(st.lists(st.integers(4, 7), min_size=rank, max_size=rank)))
    auto_pad = draw(st.sampled_from(["none", "same_upper", "same_lower", "valid"]))
    pads = draw(st.lists(st.integers(0, 2), min_size=2 * rank, max_size=2 * rank))
    attrs = dict(strides=strides, dilations=dilations, auto_pad=auto_pad,
                 pads_begin=pads[:rank], pads_end=pads[rank:])
    return dict(op=op, spatial=spatial, kernel=kernel, groups=groups,
                in_channels=in_channels, out_channels=out_channels, attrs=attrs,
                data_format=draw(st.sampled_from(["NXC", "NCX"])),
                weights_format=draw(st.sampled_from(weights_formats(op))),
                dtype=draw(st.sampled_from(list(DTYPES))),
                shape_mode=draw(st.sampled_from(["attribute", "input", "full"])),
                seed=draw(st.integers(0, 1000)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_cases())
def test_random_configurations(params):
    """Random geometries, layouts, dtypes and ways of giving the shape; a geometry the
    reference rejects (such as a kernel larger than the padded input) is no example, and
    hypothesis is told so (assume) and draws another."""
    try:
        case = make_case(**params)
        case.expected(np.float32)
    except ValueError:
        case = None
    assume(case is not None)
    run_case(case)
