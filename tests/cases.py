"""Builders of test problems: integer-valued inputs of every op, consistent shapes."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from convgrad.reference import reference, reference_shape

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
SHAPE_NAMES = {
    "ConvolutionBackpropData": "output_shape",
    "ConvolutionBackwardData": "dst_shape",
    "ConvolutionBackpropFilters": "filter_shape",
    "ConvolutionBackwardWeights": "weights_shape",
    "ConvTransposeBackwardWeights": "weights_shape",
}
WEIGHTS_ATTR = {
    "ConvolutionBackpropData": "filter_format",
    "ConvolutionBackpropFilters": "filter_format",
}
TRANSPOSE = ("ConvTransposeBackwardData", "ConvTransposeBackwardWeights")
DATA_OPS = ("ConvolutionBackpropData", "ConvolutionBackwardData", "ConvTransposeBackwardData")


@dataclass
class Case:
    """One call: op kind, inputs (arrays, then maybe the shape input) and attributes."""

    op: str
    inputs: list
    attrs: dict = field(default_factory=dict)

    def expected(self, dtype) -> np.ndarray:
        """The reference result, rounded once from the exact value to `dtype` (a new
        array each call; the reference's own result is kept for repeat calls on the same
        op, attributes and input bytes, as tests make checking each thread count or plan)."""
        key = _content_key(self)
        exact = _REFERENCE_RESULTS.get(key)
        if exact is None:
            exact = reference(self.op, self.inputs, self.attrs)
            _REFERENCE_RESULTS[key] = exact
            if len(_REFERENCE_RESULTS) > 16:
                _REFERENCE_RESULTS.popitem(last=False)
        else:
            _REFERENCE_RESULTS.move_to_end(key)
        return exact.astype(np.float32).astype(dtype)


# The reference results of the last few cases, by content: the independent reference
# (numpy, float64) costs more than a kernel call, and tests check one case's result
# several times (each thread count, plan or address).
_REFERENCE_RESULTS: OrderedDict = OrderedDict()


def _content_key(case: Case) -> tuple:
    """The case's op, attributes and every input's dtype, shape and bytes (so a test that
    changes an input after making the case gets that input's reference)."""
    arrays = []
    for value in case.inputs:
        array = np.ascontiguousarray(value)
        arrays.append((array.dtype.str, array.shape, hashlib.sha1(array.tobytes()).digest()))
    return case.op, repr(sorted(case.attrs.items())), tuple(arrays)


def _data_shape(n, c, spatial, data_format):
    return (n, *spatial, c) if data_format == "NXC" else (n, c, *spatial)


def _weights_shape(a, b, kernel, fmt):
    """(A, B, k) in the given format: OIX/IOX lead with A, B; XIO/XOI end with B, A;
    OXI/IXO (torch's channels_last weights) are A, k, B."""
    if fmt in ("OXI", "IXO"):
        return (a, *kernel, b)
    return (a, b, *kernel) if fmt in ("OIX", "IOX") else (*kernel, b, a)


def _integers(rng, shape, dtype, low=-3, high=3, density=1.0):
    values = rng.integers(low, high + 1, size=shape)
    if density < 1.0:
        values = values * (rng.random(shape) < density)
    return values.astype(np.float32).astype(dtype)


def make_case(op, *, spatial, kernel, in_channels=4, out_channels=6, batch=2, groups=1,
              data_format="NXC", weights_format=None, dtype="f32", attrs=None,
              shape_mode="attribute", seed=0) -> Case:
    """A consistent problem for `op`.

    `spatial` is the size of the op's first data input. Channels are the forward
    convolution's (in = src / diff_src channels, out = diff_dst channels) for the
    convolution ops, and the ConvTranspose op's own (in = its src) for those.
    `shape_mode` says how the shape is passed: "absent", "attribute", "input"
    (the optional third input), "full" (full shape attribute) or "full_input".
    """
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype]
    attrs = dict(attrs or {})
    attrs["data_format"] = data_format
    if weights_format:
        attrs[WEIGHTS_ATTR.get(op, "weights_format")] = weights_format
    wfmt = weights_format or ("XOI" if op in TRANSPOSE else "XIO")
    # Sparse diff_dst in low precision keeps every exact sum representable.
    density = 1.0 if dtype == "f32" else 0.5
    ic, oc = in_channels, out_channels
    shape_value = None
    if op in ("ConvolutionBackpropData", "ConvolutionBackwardData"):
        first = _integers(rng, _data_shape(batch, oc, spatial, data_format), np_dtype,
                          density=density)
        second = _integers(rng, _weights_shape(oc, ic // groups, kernel, wfmt), np_dtype)
        if shape_mode != "absent":
            no_shape = {k: v for k, v in attrs.items() if k != SHAPE_NAMES[op]}
            no_shape["groups"] = groups
            full = reference_shape(op, [first.shape, second.shape], no_shape)
            spatial_out = full[1:-1] if data_format == "NXC" else full[2:]
            shape_value = list(full) if shape_mode.startswith("full") else list(spatial_out)
    elif op == "ConvTransposeBackwardData":
        first = _integers(rng, _data_shape(batch, oc, spatial, data_format), np_dtype,
                          density=density)
        second = _integers(rng, _weights_shape(ic, oc // groups, kernel, wfmt), np_dtype)
    else:
        # The weight-gradient ops: the second input's size is the forward result of the
        # first, the same rule as ConvTransposeBackwardData's result (SEMANTICS.md 3-5).
        conv = op not in TRANSPOSE
        c0, c1 = (ic, oc) if conv else (ic, oc)
        first = _integers(rng, _data_shape(batch, c0 if conv else c1, spatial, data_format),
                          np_dtype)
        probe_w = _weights_shape(1, first.shape[-1 if data_format == "NXC" else 1] // groups,
                                 kernel, "IOX")
        probe_attrs = {k: v for k, v in attrs.items()
                       if k in ("strides", "dilations", "pads_begin", "pads_end", "auto_pad",
                                "data_format")}
        probe_attrs["weights_format"] = "IOX"
        probe_attrs["groups"] = 1
        probe_w = (1, probe_w[1] * groups, *kernel)
        fwd = reference_shape("ConvTransposeBackwardData", [first.shape, probe_w], probe_attrs)
        fwd_spatial = fwd[1:-1] if data_format == "NXC" else fwd[2:]
        second = _integers(rng, _data_shape(batch, c1 if conv else c0, fwd_spatial,
                                            data_format), np_dtype, density=density)
        if not conv:  # ConvTransposeBackwardWeights takes (src, diff_dst): src is the small one
            first, second = second, first
        w_a, w_b = (oc, ic // groups) if conv else (ic, oc // groups)
        full = _weights_shape(w_a, w_b, kernel, wfmt)
        shape_value = list(full) if shape_mode.startswith("full") else list(kernel)
    inputs = [first, second]
    if shape_value is not None:
        if shape_mode in ("input", "full_input"):
            inputs.append(np.array(shape_value, dtype=np.int64))
        else:
            attrs[SHAPE_NAMES[op]] = shape_value
    attrs["groups"] = groups
    return Case(op, inputs, attrs)


def rotating(items: list, index: int, keep: int) -> list:
    """`keep` of `items`, starting at `index` (cyclically): a grid that takes the subset
    of its index in each row still runs every item in some row, at a fraction of the
    product's kernels (each a compilation; the suite's time goes to them)."""
    return [items[(index + k) % len(items)] for k in range(keep)]
