"""Bad input (SEMANTICS.md, "Bad input"): every violation raises ValueError (wrong value
or shape) or TypeError (wrong type or dtype), with a message that names the op and the
attribute or input at fault.

Validation happens before any kernel is compiled, so these tests run no C. The fuzz
tests at the end stop valid calls just before the kernel (see `no_kernels`).
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from cases import DATA_OPS, SHAPE_NAMES, TRANSPOSE, WEIGHTS_ATTR, make_case
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import convgrad
from convgrad import api, bound
from convgrad.reference import OP_KINDS, reference_shape

FUNCTIONS = {spec.kind: getattr(convgrad, spec.function) for spec in api.OPS.values()}
INPUTS = {spec.kind: spec.inputs for spec in api.OPS.values()}
SHAPE_OPS = tuple(sorted(SHAPE_NAMES))
WEIGHT_OPS = tuple(op for op in OP_KINDS if op not in DATA_OPS)
# Ops with the "X must equal (Y + pb + pe - K) // s + 1" rule on their shape.
X_RULE_OPS = ("ConvolutionBackwardData", *WEIGHT_OPS)


def weights_attr(op):
    return WEIGHTS_ATTR.get(op, "weights_format")


def base(op, shape_mode=None, **kwargs):
    """A valid call: 2-D, groups 2, NXC, the default weights format."""
    if shape_mode is None:
        shape_mode = "absent" if op == "ConvTransposeBackwardData" else "attribute"
    params = dict(spatial=(5, 4), kernel=(3, 2), in_channels=4, out_channels=6, groups=2,
                  batch=2, shape_mode=shape_mode)
    params.update(kwargs)
    return make_case(op, **params)


def shapes_of(inputs):
    """`infer_shape`'s input_shapes for a list of execute inputs."""
    return [x.shape for x in inputs[:2]] + [np.asarray(v).tolist() for v in inputs[2:]]


def names(prefix, *words):
    """A regex: the message starts with `prefix:` and mentions every word."""
    return "(?s)^" + re.escape(prefix) + ":" + "".join(f"(?=.*{re.escape(w)})" for w in words)


def expect(case, error, *words, infer=True, function=True):
    """`execute`, the op's function and `infer_shape` all reject `case` the same way."""
    pattern = names(case.op, *words)
    with pytest.raises(error, match=pattern):
        convgrad.execute(case.op, case.inputs, case.attrs)
    if function:
        with pytest.raises(error, match=pattern):
            FUNCTIONS[case.op](*case.inputs, **case.attrs)
    if infer:
        with pytest.raises(error, match=pattern):
            convgrad.infer_shape(case.op, shapes_of(case.inputs), case.attrs)


def with_attrs(case, **attrs):
    case.attrs.update(attrs)
    return case


def test_base_cases_are_valid():
    """The cases the tests below break are accepted as they are."""
    for op in OP_KINDS:
        for mode in (["absent"] if op == "ConvTransposeBackwardData" else
                     ["attribute", "input", "full", "full_input"]):
            case = base(op, mode)
            assert convgrad.infer_shape(op, shapes_of(case.inputs), case.attrs) == \
                reference_shape(op, shapes_of(case.inputs), case.attrs)


# --------------------------------------------------------------------------- channels


@pytest.mark.parametrize("op", OP_KINDS)
def test_channels_not_divisible_by_groups(op):
    # 4 input and 6 output channels: 5 divides neither.
    expect(with_attrs(base(op), groups=5), ValueError, "groups", "5")


@pytest.mark.parametrize("op", DATA_OPS)
def test_weights_disagree_with_data_channels(op):
    case = base(op)
    other = base(op, out_channels=4)  # 4 output channels in the weights, 6 in the data
    case.inputs[1] = other.inputs[1]
    expect(case, ValueError, INPUTS[op][1])


def test_transpose_weights_disagree_with_groups():
    """IOX/XOI weights hold OC/g: with another groups they no longer match diff_dst."""
    case = base("ConvTransposeBackwardData", groups=1)
    expect(with_attrs(case, groups=2), ValueError, "weights shape", "groups 2")


@pytest.mark.parametrize("op", WEIGHT_OPS)
@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("mode", ["full", "full_input"])
def test_full_weights_shape_disagrees_with_data_channels(op, axis, mode):
    """XIO/XOI full weights shapes end with the two channel counts."""
    case = base(op, mode)
    shape = list(np.asarray(case.inputs[2] if mode == "full_input"
                            else case.attrs[SHAPE_NAMES[op]]).tolist())
    shape[axis] += 1
    if mode == "full_input":
        case.inputs[2] = np.array(shape)
    else:
        case.attrs[SHAPE_NAMES[op]] = shape
    expect(case, ValueError, SHAPE_NAMES[op])


@pytest.mark.parametrize("op", WEIGHT_OPS)
def test_batches_disagree(op):
    case = base(op)
    case.inputs[1] = base(op, batch=3).inputs[1]
    expect(case, ValueError, f"{INPUTS[op][1]} batch")


# --------------------------------------------------------------------------- per-axis values


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("name", ["strides", "dilations"])
@pytest.mark.parametrize("value", [0, -1, [1, 0], [-2, 1]])
def test_strides_and_dilations_below_one(op, name, value):
    expect(with_attrs(base(op), **{name: value}), ValueError, name)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("name", ["pads_begin", "pads_end"])
@pytest.mark.parametrize("value", [-1, [0, -2]])
def test_negative_pads(op, name, value):
    expect(with_attrs(base(op), **{name: value}), ValueError, name)


@pytest.mark.parametrize("op,name", [
    (op, name) for op in OP_KINDS
    for name in ("strides", "dilations", "pads_begin", "pads_end", "output_padding")
    if name != "output_padding" or op in DATA_OPS])
@pytest.mark.parametrize("value", [[1], [1, 1, 1], []])
def test_per_axis_wrong_count(op, name, value):
    expect(with_attrs(base(op), **{name: value}), ValueError, name, "2 values")


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("name,value", [
    ("strides", 1.5), ("strides", 2.0), ("strides", "2"), ("strides", [1, 2.0]),
    ("strides", True), ("strides", [1, True]), ("strides", None), ("strides", np.float32(1)),
    ("dilations", float("nan")), ("dilations", [[1], [1]]), ("dilations", {1: 1, 2: 1}),
    ("pads_begin", [0.0, 0]), ("pads_end", {0, 1}), ("pads_end", b"\x00\x00"),
    ("groups", "2"), ("groups", 2.0), ("groups", True), ("groups", [2]), ("groups", None),
    ("groups", np.float64(2)),
])
def test_non_integer_attributes(op, name, value):
    expect(with_attrs(base(op), **{name: value}), TypeError, name)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("name,value", [("groups", 0), ("groups", -2), ("groups", 2**40),
                                        ("strides", 2**40), ("pads_begin", [0, 2**40])])
def test_out_of_range_integers(op, name, value):
    expect(with_attrs(base(op), **{name: value}), ValueError, name)


@pytest.mark.parametrize("op", OP_KINDS)
def test_integer_like_attributes_are_accepted(op):
    case = with_attrs(base(op), groups=np.int64(2), strides=np.array([1, 1]),
                      dilations=(1, np.int32(1)), pads_begin=np.uint8(0))
    assert convgrad.infer_shape(op, shapes_of(case.inputs), case.attrs)


@pytest.mark.parametrize("op", DATA_OPS)
@pytest.mark.parametrize("attrs", [
    dict(strides=2, output_padding=2),
    dict(strides=2, dilations=3, output_padding=[3, 0]),
    dict(output_padding=[0, 1]),
    dict(output_padding=-1),
])
def test_output_padding_not_below_stride_or_dilation(op, attrs):
    case = base(op, shape_mode="absent", **{"attrs": attrs})
    expect(case, ValueError, "output_padding")


@pytest.mark.parametrize("op", DATA_OPS)
def test_output_padding_below_dilation_is_accepted(op):
    case = base(op, shape_mode="absent", attrs=dict(dilations=[2, 1], output_padding=[1, 0]))
    assert convgrad.infer_shape(op, shapes_of(case.inputs), case.attrs) == \
        reference_shape(op, shapes_of(case.inputs), case.attrs)


# --------------------------------------------------------------------------- strings


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("value", ["same", "SAME", "upper", "none ", "pad"])
def test_unknown_auto_pad(op, value):
    expect(with_attrs(base(op), auto_pad=value), ValueError, "auto_pad", repr(value))


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("value", [1, None, b"valid", ["valid"]])
def test_auto_pad_of_wrong_type(op, value):
    expect(with_attrs(base(op), auto_pad=value), TypeError, "auto_pad")


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("value", ["VALID", "Same_Upper", "EXPLICIT", "None"])
def test_auto_pad_is_case_insensitive(op, value):
    case = base(op, attrs=dict(auto_pad=value))
    assert convgrad.infer_shape(op, shapes_of(case.inputs), case.attrs) == \
        reference_shape(op, shapes_of(case.inputs), case.attrs)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("value", ["nxc", "Ncx", "NHWC", "NCHW", "", "NXC "])
def test_unknown_data_format(op, value):
    expect(with_attrs(base(op), data_format=value), ValueError, "data_format", repr(value))


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("value", [None, 0, ["NXC"]])
def test_data_format_of_wrong_type(op, value):
    expect(with_attrs(base(op), data_format=value), TypeError, "data_format")


def _bad_weights_formats(op):
    own, other = (("IOX", "XOI"), ("OIX", "XIO")) if op in TRANSPOSE else \
        (("OIX", "XIO"), ("IOX", "XOI"))
    return [f.lower() for f in own] + list(other) + ["HWIO", "OIHW", ""]


@pytest.mark.parametrize("op,value", [(op, v) for op in OP_KINDS
                                      for v in _bad_weights_formats(op)])
def test_unknown_weights_format(op, value):
    name = weights_attr(op)
    expect(with_attrs(base(op), **{name: value}), ValueError, name, repr(value))


@pytest.mark.parametrize("op", OP_KINDS)
def test_weights_format_of_wrong_type(op):
    name = weights_attr(op)
    expect(with_attrs(base(op), **{name: 1}), TypeError, name)


@pytest.mark.parametrize("op", OP_KINDS)
def test_weights_format_under_the_other_name(op):
    """filter_format and weights_format are not aliases: each op has its own."""
    other = "weights_format" if weights_attr(op) == "filter_format" else "filter_format"
    case = with_attrs(base(op), **{other: "XOI" if op in TRANSPOSE else "XIO"})
    expect(case, ValueError, "attribute", other, infer=True, function=False)
    with pytest.raises(TypeError, match=names(op, other)):
        FUNCTIONS[op](*case.inputs, **case.attrs)


# --------------------------------------------------------------------------- shape attribute


def _set_shape(case, mode, value):
    if mode == "input":
        case.inputs[2] = np.array(value, dtype=np.int64)
    else:
        case.attrs[SHAPE_NAMES[case.op]] = value
    return case


def _get_shape(case, mode):
    value = case.inputs[2] if mode == "input" else case.attrs[SHAPE_NAMES[case.op]]
    return list(np.asarray(value).tolist())


@pytest.mark.parametrize("op", ("ConvolutionBackpropData", "ConvolutionBackwardData"))
@pytest.mark.parametrize("mode", ["attribute", "input"])
@pytest.mark.parametrize("axis,what", [(0, "batch"), (-1, "channels")])  # NXC: N ... C
def test_full_data_shape_with_wrong_batch_or_channels(op, mode, axis, what):
    case = base(op, "full_input" if mode == "input" else "full")
    shape = _get_shape(case, mode)
    shape[axis] += 1
    expect(_set_shape(case, mode, shape), ValueError, SHAPE_NAMES[op], what)


@pytest.mark.parametrize("op", SHAPE_OPS)
@pytest.mark.parametrize("mode", ["attribute", "input"])
@pytest.mark.parametrize("value", [[5], [5, 5, 5], [1, 5, 5, 5, 4, 1], []])
def test_shape_of_wrong_length(op, mode, value):
    case = base(op, mode)
    expect(_set_shape(case, mode, value), ValueError, SHAPE_NAMES[op], "2 spatial sizes")


@pytest.mark.parametrize("op", SHAPE_OPS)
@pytest.mark.parametrize("mode", ["attribute", "input"])
@pytest.mark.parametrize("value", [[0, 3], [3, -1], [2**40, 3]])
def test_shape_with_bad_sizes(op, mode, value):
    case = base(op, mode)
    expect(_set_shape(case, mode, value), ValueError, SHAPE_NAMES[op])


@pytest.mark.parametrize("op", X_RULE_OPS)
@pytest.mark.parametrize("mode", ["attribute", "input"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("auto_pad", ["none", "valid"])
def test_shape_violating_the_size_rule(op, mode, axis, auto_pad):
    """X must equal (Y + pb + pe - K) // s + 1 (SEMANTICS.md rules 2, 3 and 5)."""
    case = with_attrs(base(op, mode), auto_pad=auto_pad)
    shape = _get_shape(case, mode)
    shape[axis] += 1  # a larger result (rule 2) or kernel (rules 3, 5): X changes
    # The input whose size is checked: the forward convolution's output.
    checked = INPUTS[op][1] if op in WEIGHT_OPS and op not in TRANSPOSE else INPUTS[op][0]
    expect(_set_shape(case, mode, shape), ValueError, f"{checked} spatial shape",
           SHAPE_NAMES[op])


@pytest.mark.parametrize("op", WEIGHT_OPS)
def test_missing_weights_shape(op):
    case = base(op)
    del case.attrs[SHAPE_NAMES[op]]
    expect(case, ValueError, SHAPE_NAMES[op])
    expect(with_attrs(case, **{SHAPE_NAMES[op]: None}), ValueError, SHAPE_NAMES[op])


@pytest.mark.parametrize("op", SHAPE_OPS)
@pytest.mark.parametrize("value", [np.array([3.0, 2.0]), np.array([3, 2], dtype=np.float32),
                                   np.array([[3, 2]]), np.array([True, True]), np.array(3)])
def test_shape_input_that_is_not_a_1d_integer_array(op, value):
    case = base(op, "input")
    case.inputs[2] = value
    expect(case, TypeError, SHAPE_NAMES[op])


@pytest.mark.parametrize("op", SHAPE_OPS)
@pytest.mark.parametrize("mode", ["attribute", "input"])
@pytest.mark.parametrize("value", [[3.0, 2.0], ["3", "2"], 3, "32", {3: 1, 2: 1}])
def test_shape_that_is_not_an_integer_sequence(op, mode, value):
    case = base(op, mode)
    if mode == "input":
        case.inputs[2] = value
    else:
        case.attrs[SHAPE_NAMES[op]] = value
    expect(case, TypeError, SHAPE_NAMES[op])


def test_data_result_too_small():
    case = base("ConvolutionBackpropData", "absent", attrs=dict(pads_begin=[4, 0],
                                                                  pads_end=[4, 0]))
    expect(case, ValueError, "input_delta spatial shape")
    case = base("ConvTransposeBackwardData", kernel=(6, 2))  # kernel larger than diff_dst
    expect(case, ValueError, "diff_dst spatial shape")


@pytest.mark.parametrize("op", WEIGHT_OPS)
def test_data_sizes_inconsistent_with_each_other(op):
    """The weight-gradient ops: one data input's size follows from the other's."""
    case = base(op)
    other = base(op, spatial=(6, 4))
    small = 0 if op == "ConvTransposeBackwardWeights" else 1
    case.inputs[small] = other.inputs[small]
    expect(case, ValueError, INPUTS[op][small], "spatial shape")


# --------------------------------------------------------------------------- arrays


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("other", ["f16", "bf16"])
def test_mixed_dtypes(op, index, other):
    case = base(op)
    dtype = np.float16 if other == "f16" else ml_dtypes.bfloat16
    case.inputs[index] = case.inputs[index].astype(dtype)
    expect(case, TypeError, INPUTS[op][0], INPUTS[op][1], infer=False)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int64, np.complex64, np.bool_,
                                   np.dtype(">f4")])
def test_unsupported_dtype(op, index, dtype):
    case = base(op)
    case.inputs[index] = case.inputs[index].astype(dtype)
    expect(case, TypeError, INPUTS[op][index], "dtype", infer=False)


@pytest.mark.parametrize("op", OP_KINDS)
def test_unsupported_dtype_everywhere(op):
    case = base(op)
    case.inputs[:2] = [x.astype(np.float64) for x in case.inputs[:2]]
    expect(case, TypeError, INPUTS[op][0], "float64", infer=False)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("kind", ["list", "scalar", "none", "memoryview"])
def test_input_that_is_not_an_ndarray(op, index, kind):
    case = base(op)
    x = case.inputs[index]
    case.inputs[index] = {"list": x.tolist(), "scalar": 1.0, "none": None,
                          "memoryview": memoryview(x)}[kind]
    expect(case, TypeError, INPUTS[op][index], "numpy.ndarray", infer=False)


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("shape", [(5, 4), (2, 5, 4, 1, 1, 6), (6,), ()])
def test_wrong_data_rank(op, shape):
    case = base(op)
    case.inputs[0] = np.zeros(shape, dtype=np.float32)
    expect(case, ValueError, f"{INPUTS[op][0]} rank")


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("change", ["more", "fewer"])
def test_second_input_rank_disagrees_with_data(op, change):
    case = base(op)
    x = case.inputs[1]
    case.inputs[1] = x[..., None] if change == "more" else x[..., 0]
    expect(case, ValueError, f"{INPUTS[op][1]} rank")


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("axis", ["channel", "spatial"])
def test_zero_sized_channel_or_spatial_dimension(op, index, axis):
    case = base(op)
    x = case.inputs[index]
    # NXC data (N, X..., C) and XIO/XOI weights (X..., I, O) both end with a channel
    # axis; axis 1 is spatial in both.
    ax = -1 if axis == "channel" else 1
    shape = list(x.shape)
    shape[ax] = 0
    case.inputs[index] = np.zeros(shape, dtype=x.dtype)
    expect(case, ValueError, INPUTS[op][index], "shape")


@pytest.mark.parametrize("op", OP_KINDS)
def test_zero_batch_is_allowed(op):
    case = base(op, batch=0)
    shape = convgrad.infer_shape(op, shapes_of(case.inputs), case.attrs)
    assert shape == reference_shape(op, shapes_of(case.inputs), case.attrs)
    if op in DATA_OPS:  # an empty result: no kernel runs
        result = convgrad.execute(op, case.inputs, case.attrs)
        assert result.shape == shape and result.size == 0


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("index", [0, 1])
def test_negative_sizes_in_infer_shape(op, index):
    case = base(op)
    shapes = shapes_of(case.inputs)
    shapes[index] = tuple(-v if i == len(shapes[index]) - 1 else v
                          for i, v in enumerate(shapes[index]))
    with pytest.raises(ValueError, match=names(op, INPUTS[op][index], "non-negative")):
        convgrad.infer_shape(op, shapes, case.attrs)


# --------------------------------------------------------------------------- out=


def _out_case(op):
    case = base(op)
    shape = convgrad.infer_shape(op, shapes_of(case.inputs), case.attrs)
    return case, shape


def _expect_out(case, out, error, *words):
    with pytest.raises(error, match=names(case.op, "out", *words)):
        convgrad.execute(case.op, case.inputs, case.attrs, out=out)
    with pytest.raises(error, match=names(case.op, "out", *words)):
        FUNCTIONS[case.op](*case.inputs, **case.attrs, out=out)


@pytest.mark.parametrize("op", OP_KINDS)
def test_out_wrong_shape(op):
    case, shape = _out_case(op)
    _expect_out(case, np.zeros((shape[0] + 1, *shape[1:]), np.float32), ValueError, "shape")
    _expect_out(case, np.zeros(math.prod(shape), np.float32), ValueError, "shape")
    if shape[::-1] != shape:
        _expect_out(case, np.zeros(shape[::-1], np.float32), ValueError, "shape")


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16, np.int32])
def test_out_wrong_dtype(op, dtype):
    case, shape = _out_case(op)
    _expect_out(case, np.zeros(shape, dtype), TypeError, "dtype")


@pytest.mark.parametrize("op", OP_KINDS)
def test_out_not_an_ndarray(op):
    case, shape = _out_case(op)
    _expect_out(case, np.zeros(shape, np.float32).tolist(), TypeError, "numpy.ndarray")


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("layout", ["strided", "fortran", "transposed"])
def test_out_not_c_contiguous(op, layout):
    case, shape = _out_case(op)
    if layout == "strided":
        out = np.zeros((*shape[:-1], 2 * shape[-1]), np.float32)[..., ::2]
    elif layout == "fortran":
        out = np.zeros(shape, np.float32, order="F")
    else:
        out = np.zeros(shape[::-1], np.float32).T
    assert out.shape == tuple(shape) and not out.flags.c_contiguous
    _expect_out(case, out, ValueError, "C-contiguous")


def _misaligned(shape, dtype=np.float32) -> np.ndarray:
    """A C-contiguous array starting one byte past an element boundary."""
    itemsize = np.dtype(dtype).itemsize
    block = np.zeros(math.prod(shape) * itemsize + itemsize, np.uint8)
    start = (-block.ctypes.data) % itemsize + 1
    array = block[start:start + math.prod(shape) * itemsize].view(dtype).reshape(shape)
    assert not array.flags.aligned and array.flags.c_contiguous
    return array


@pytest.mark.parametrize("op", OP_KINDS)
def test_out_misaligned(op):
    """An out array at an odd byte offset (a view of a byte buffer) is refused: the
    kernels write its elements as C floats."""
    case, shape = _out_case(op)
    _expect_out(case, _misaligned(shape), ValueError, "multiple of its element size")


@pytest.mark.parametrize("op", OP_KINDS)
def test_misaligned_inputs_are_read_exactly(op):
    """Inputs at an odd byte offset are copied to aligned memory first: exact results."""
    case = base(op)
    expected = convgrad.execute(case.op, case.inputs, case.attrs)
    for index in (0, 1):
        x = case.inputs[index]
        case.inputs[index] = _misaligned(x.shape, x.dtype)
        case.inputs[index][...] = x
        assert api._data_array(op, "x", case.inputs[index]).flags.aligned
        np.testing.assert_array_equal(convgrad.execute(case.op, case.inputs, case.attrs),
                                      expected)


@pytest.mark.parametrize("op", OP_KINDS)
def test_out_read_only(op):
    case, shape = _out_case(op)
    out = np.zeros(shape, np.float32)
    out.flags.writeable = False
    _expect_out(case, out, ValueError, "writeable")


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("index", [0, 1])
def test_out_overlapping_an_input(op, index):
    case, shape = _out_case(op)
    x = case.inputs[index]
    size = math.prod(shape)
    buffer = np.zeros(x.size + size, np.float32)
    # The input, then the result starting on the input's last element.
    case.inputs[index] = buffer[:x.size].reshape(x.shape)
    case.inputs[index][...] = x
    out = buffer[x.size - 1:x.size - 1 + size].reshape(shape)
    _expect_out(case, out, ValueError, "overlaps")


# --------------------------------------------------------------------------- execute


@pytest.mark.parametrize("kind", ["Convolution", "convolutionbackwarddata",
                                  "ConvolutionBackwardData ", "", None, 3, ("x",)])
def test_unknown_op_kind(kind):
    case = base("ConvolutionBackwardData")
    with pytest.raises(ValueError, match=names("execute", "op_kind", repr(kind))):
        convgrad.execute(kind, case.inputs, case.attrs)
    with pytest.raises(ValueError, match=names("infer_shape", "op_kind", repr(kind))):
        convgrad.infer_shape(kind, shapes_of(case.inputs), case.attrs)


def _unknown_names(op):
    yield from ["stride", "padding", "Strides", "group", "kernel", "", 1]
    if op not in DATA_OPS:
        yield "output_padding"
    if op == "ConvTransposeBackwardData":
        yield "weights_shape"
    other_shapes = set(SHAPE_NAMES.values()) - {SHAPE_NAMES.get(op)}
    yield sorted(other_shapes)[0]


@pytest.mark.parametrize("op,name", [(op, n) for op in OP_KINDS for n in _unknown_names(op)])
def test_unknown_attribute_name(op, name):
    case = base(op)
    case.attrs[name] = 1
    pattern = names(op, "attribute", repr(name))
    with pytest.raises(ValueError, match=pattern):
        convgrad.execute(op, case.inputs, case.attrs)
    with pytest.raises(ValueError, match=pattern):
        convgrad.infer_shape(op, shapes_of(case.inputs), case.attrs)
    if isinstance(name, str) and name.isidentifier():
        with pytest.raises(TypeError, match=names(op, repr(name))):
            FUNCTIONS[op](*case.inputs, **case.attrs)


@pytest.mark.parametrize("op", OP_KINDS)
def test_wrong_number_of_inputs(op):
    case = base(op, "absent" if op == "ConvTransposeBackwardData" else "input")
    shape = [5, 5] if op in DATA_OPS else [3, 2]
    extra = [*case.inputs[:2], np.array(shape), np.array(shape)]
    if op == "ConvTransposeBackwardData":
        extra = extra[:3]  # no shape input at all
    for inputs in (extra, case.inputs[:1], []):
        with pytest.raises(ValueError, match=names(op, f"{len(inputs)} inputs")):
            convgrad.execute(op, inputs, case.attrs)
        with pytest.raises(ValueError, match=names(op, f"{len(inputs)} input shapes")):
            convgrad.infer_shape(op, shapes_of(inputs) if len(inputs) > 1 else
                                [x.shape for x in inputs], case.attrs)
    with pytest.raises(TypeError, match=names(op)):
        FUNCTIONS[op](*extra, *extra)
    with pytest.raises(TypeError, match=names(op, INPUTS[op][1])):
        FUNCTIONS[op](case.inputs[0])


@pytest.mark.parametrize("attrs", [[("groups", 1)], "groups", 1])
def test_attrs_that_are_not_a_mapping(attrs):
    case = base("ConvolutionBackwardData")
    with pytest.raises(TypeError, match="attrs"):
        convgrad.execute(case.op, case.inputs, attrs)
    with pytest.raises(TypeError, match=names(case.op, "attrs")):
        convgrad.infer_shape(case.op, shapes_of(case.inputs), attrs)


@pytest.mark.parametrize("inputs", [None, 1, "ab", {0: 1, 1: 2}])
def test_inputs_that_are_not_a_list(inputs):
    op = "ConvolutionBackwardData"
    with pytest.raises(TypeError, match="inputs"):
        convgrad.execute(op, inputs, {})
    with pytest.raises(TypeError, match=names(op, "input_shapes")):
        convgrad.infer_shape(op, inputs, {})


@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("value,error", [(0, ValueError), (-1, ValueError),
                                         ("2", TypeError), (1.0, TypeError),
                                         (True, TypeError)])
def test_bad_num_threads(op, value, error):
    case = base(op)
    with pytest.raises(error, match=names(op, "num_threads")):
        convgrad.execute(op, case.inputs, case.attrs, num_threads=value)


@pytest.mark.parametrize("value,error", [(0, ValueError), (-3, ValueError),
                                         ("2", TypeError), (True, TypeError)])
def test_bad_set_num_threads(value, error):
    before = convgrad.get_num_threads()
    with pytest.raises(error, match="num_threads"):
        convgrad.set_num_threads(value)
    assert convgrad.get_num_threads() == before


# --------------------------------------------------------------------------- fuzz

_KNOWN_NAMES = sorted({name for spec in api.OPS.values() for name in spec.attributes})
_WORDS = ["NXC", "NCX", "nxc", "OIX", "XIO", "IOX", "XOI", "none", "valid", "same_upper",
          "SAME_LOWER", "explicit", "", "x"]

_scalars = st.one_of(
    st.integers(-3, 4), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.sampled_from(_WORDS), st.booleans(), st.none(), st.binary(max_size=3),
    st.sampled_from([np.int64(2), np.float32(1.0), np.bool_(True), np.uint8(1)]))
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.tuples(inner, inner),
        st.dictionaries(st.integers(0, 3), inner, max_size=3),
        st.lists(st.integers(-3, 2**40), max_size=6).map(np.array),
        st.lists(st.floats(-3, 3), max_size=4).map(np.array)),
    max_leaves=8)
_attrs = st.dictionaries(
    st.one_of(st.sampled_from(_KNOWN_NAMES), st.text(max_size=4), st.integers(0, 2)),
    _values, max_size=6)
_shape = st.lists(st.integers(-1, 7), min_size=0, max_size=6)
_any_shape = st.one_of(_shape, _shape.map(tuple), _values)


def _axes(values):
    """A per-axis value for 2 spatial axes: a scalar or a pair."""
    return st.one_of(values, st.lists(values, min_size=2, max_size=2))


# Values that are often valid, so that accepted calls get compared with the reference.
_GOOD = {
    "strides": _axes(st.integers(1, 3)), "dilations": _axes(st.integers(1, 2)),
    "pads_begin": _axes(st.integers(0, 2)), "pads_end": _axes(st.integers(0, 2)),
    "output_padding": _axes(st.integers(0, 1)), "groups": st.sampled_from([1, 2, 3]),
    "auto_pad": st.sampled_from(["none", "explicit", "", "same_upper", "SAME_LOWER",
                                 "valid"]),
    "data_format": st.sampled_from(["NXC", "NCX"]),
    "filter_format": st.sampled_from(["OIX", "XIO"]),
    "weights_format": st.sampled_from(["OIX", "XIO", "IOX", "XOI"]),
}


def _good_attrs(draw, op):
    """Some of the op's geometry attributes, with good values."""
    return {name: draw(_GOOD[name]) for name in api.OPS[op].attributes
            if name in _GOOD and name not in ("groups", "data_format")
            and not name.endswith("_format") and draw(st.booleans())}


def _plausible_attrs(draw, op):
    """Some of the op's attributes, mostly with good values, now and then garbage."""
    attrs = {}
    for name in api.OPS[op].attributes:
        if draw(st.integers(0, 2)) == 0:
            good = _GOOD.get(name, st.lists(st.integers(1, 7), min_size=2, max_size=4))
            attrs[name] = draw(st.one_of(good, good, good, _values))
    return attrs


def _mode(draw, op):
    return draw(st.sampled_from(["absent"] if op == "ConvTransposeBackwardData"
                                else ["attribute", "input", "full", "full_input"]))


@st.composite
def _infer_calls(draw):
    op = draw(st.sampled_from(OP_KINDS))
    style = draw(st.sampled_from(["garbage", "attrs", "attrs", "shapes"]))
    if style == "garbage":
        kind = draw(st.one_of(st.sampled_from(OP_KINDS), _scalars))
        shapes = draw(st.one_of(st.lists(_any_shape, max_size=4), _values))
        return kind, shapes, draw(st.one_of(_attrs, _values))
    # A valid call (as far as the reference knows), then mutated.
    try:
        case = base(op, _mode(draw, op), attrs=_good_attrs(draw, op),
                    groups=draw(_GOOD["groups"]),
                    in_channels=draw(st.sampled_from([6, 12])),
                    out_channels=draw(st.sampled_from([6, 12])),
                    data_format=draw(_GOOD["data_format"]),
                    spatial=tuple(draw(st.lists(st.integers(3, 8), min_size=2, max_size=2))))
    except ValueError:
        assume(False)
    shapes = [list(s) for s in shapes_of(case.inputs)]
    attrs = dict(case.attrs)
    if style == "attrs" and draw(st.booleans()):
        attrs.update(_plausible_attrs(draw, op))
    for _ in range(draw(st.integers(0 if style == "attrs" else 1, 2))):
        index = draw(st.integers(0, len(shapes) - 1))
        if isinstance(shapes[index], list) and shapes[index] and draw(st.booleans()):
            axis = draw(st.integers(0, len(shapes[index]) - 1))
            shapes[index][axis] = draw(st.integers(-2, 9))
        else:
            shapes[index] = draw(_any_shape)
    return op, shapes, attrs


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(_infer_calls())
def test_fuzz_infer_shape(call):
    """Garbage in: only ValueError or TypeError out; what is accepted agrees with the
    reference (which is laxer about types, never about shapes)."""
    kind, shapes, attrs = call
    try:
        result = convgrad.infer_shape(kind, shapes, attrs)
    except (ValueError, TypeError):
        return
    assert isinstance(result, tuple) and len(result) in (3, 4, 5)
    assert all(type(v) is int and v >= 0 for v in result)
    assert result == reference_shape(kind, shapes, attrs)


class _KernelReached(Exception):
    """A call passed every check; the fuzz stops it before compiling anything."""


@contextmanager
def no_kernels():
    def stop(config, plan=None):
        raise _KernelReached(config.name)

    with mock.patch.object(bound, "get_kernel", stop):
        yield


_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int32]


@st.composite
def _execute_calls(draw):
    op = draw(st.sampled_from(OP_KINDS))
    mode = draw(st.sampled_from(["absent"] if op == "ConvTransposeBackwardData"
                                else ["attribute", "input", "full_input"]))
    case = base(op, mode, spatial=(4, 3), kernel=(2, 2), batch=1)
    inputs, attrs = list(case.inputs), dict(case.attrs)
    out = None
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["attr", "dtype", "shape", "input", "out", "count"]))
        index = draw(st.integers(0, 1))
        if what == "attr":
            attrs.update(_plausible_attrs(draw, op))
        elif what == "dtype" and isinstance(inputs[index], np.ndarray):
            with np.errstate(all="ignore"):
                inputs[index] = inputs[index].astype(draw(st.sampled_from(_DTYPES)))
        elif what == "shape":
            shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=6))
            inputs[index] = np.zeros(shape, dtype=draw(st.sampled_from(_DTYPES)))
        elif what == "input":
            inputs[index] = draw(_values)
        elif what == "out":
            shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=5))
            out = np.zeros(shape, dtype=draw(st.sampled_from(_DTYPES)))
        elif what == "count" and len(inputs) > 2 and draw(st.booleans()):
            inputs[2] = draw(_any_shape)
        elif what == "count":
            inputs.append(draw(_any_shape))
    return op, inputs, attrs, out


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(_execute_calls())
def test_fuzz_execute(call):
    """Garbage arrays and attributes into execute: only ValueError or TypeError, or a
    call that reaches its kernel with the shape infer_shape gives."""
    op, inputs, attrs, out = call
    with no_kernels():
        try:
            result = convgrad.execute(op, inputs, attrs, out=out)
        except (ValueError, TypeError):
            return
        except _KernelReached:
            shapes = [x.shape for x in inputs[:2]] + list(inputs[2:])
            expected = convgrad.infer_shape(op, shapes, attrs)
            if out is not None:
                assert out.shape == expected
            return
    # Only an empty result returns without a kernel.
    assert result.size == 0
    assert result.shape == convgrad.infer_shape(op, [x.shape for x in inputs[:2]]
                                               + list(inputs[2:]), attrs)


def test_cached_valid_call_never_accepts_a_lookalike_invalid_one():
    """Resolved calls are memoised by their arguments: values that compare equal in
    Python (2 and 2.0, 1 and True, a numpy integer and a list) must not share entries."""
    import convgrad
    dd = np.ones((1, 4, 4, 2), np.float32)
    w = np.ones((1, 1, 2, 2), np.float32)
    convgrad.convolution_backward_data(dd, w, strides=2)
    convgrad.convolution_backward_data(dd, w, strides=np.int64(2))
    convgrad.convolution_backward_data(dd, w, groups=1)
    for bad in ({"strides": 2.0}, {"strides": ["int64", 2]}, {"groups": True},
                {"strides": [2.0, 2]}):
        with pytest.raises(TypeError):
            convgrad.convolution_backward_data(dd, w, **bad)
