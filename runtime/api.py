"""The public functions of the contract (docs/semantics.md): one per op, plus execute and
infer_shape."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from convgrad import kernels
from convgrad.bound import BoundCall, Unfrozen, bind, freeze, on_reset, settings_key
from convgrad.codegen import OPS, Problem, resolve

DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
          np.dtype(ml_dtypes.bfloat16): "bf16"}
DTYPE_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}

def _data_array(op: str, name: str, value) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{op}: {name} is a {type(value).__name__}; expected a numpy.ndarray")
    if value.dtype not in DTYPES:
        raise TypeError(f"{op}: {name} has dtype {value.dtype}; expected float32, float16 "
                        "or bfloat16 (ml_dtypes)")
    # C-contiguous and aligned to its element size (a view at an odd byte offset is
    # copied): the kernels read elements as C types
    flags = value.flags
    if flags.c_contiguous and flags.aligned:
        return value
    return np.require(value, requirements=["C_CONTIGUOUS", "ALIGNED"])


def _shape_input(op: str, name: str, value):
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TypeError(f"{op}: {name} is a {value.dtype} array of shape {value.shape}; "
                            "expected a 1-D integer array")
        return value.tolist()
    return value


def _check_out(op: str, out, problem: Problem, dtype: np.dtype, inputs) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{op}: out is a {type(out).__name__}; expected a numpy.ndarray")
    if out.dtype != dtype:
        raise TypeError(f"{op}: out has dtype {out.dtype}; expected {dtype}")
    if out.shape != problem.output_shape:
        raise ValueError(f"{op}: out has shape {out.shape}; expected {problem.output_shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{op}: out must be a writeable C-contiguous array")
    if not out.flags.aligned:
        raise ValueError(f"{op}: out must start on a multiple of its element size "
                         f"({out.dtype.itemsize} bytes); got address {out.ctypes.data:#x}")
    if any(np.may_share_memory(out, x) for x in inputs):
        raise ValueError(f"{op}: out overlaps an input array")
    return out


def run(op_kind: str, inputs: Sequence, attrs: Mapping, *, out: np.ndarray | None = None,
        num_threads: int | None = None, tune: bool | str | None = None) -> np.ndarray:
    """Validates, infers the result shape and pads, and runs the op's kernel. A repeat
    call of one configuration finds its bound call (convgrad.bound) and checks only the
    arrays themselves."""
    return _run(op_kind, inputs, attrs, out, num_threads, tune)[0]


def _run(op_kind, inputs, attrs, out, num_threads, tune) -> tuple[np.ndarray, BoundCall]:
    spec = OPS.get(op_kind) if isinstance(op_kind, str) else None
    if spec is None:
        raise ValueError(f"execute: op_kind = {op_kind!r} is invalid; expected one of "
                         f"{list(OPS)}")
    op = spec.kind
    limit = 3 if spec.shape_name else 2
    if not 2 <= len(inputs) <= limit:
        raise ValueError(f"{op}: {len(inputs)} inputs given; expected {spec.inputs} "
                         + (f"and optionally {spec.shape_name}" if spec.shape_name else ""))
    a = _data_array(op, spec.inputs[0], inputs[0])
    b = _data_array(op, spec.inputs[1], inputs[1])
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: {spec.inputs[0]} is {a.dtype} but {spec.inputs[1]} is "
                        f"{b.dtype}; expected one dtype")
    shape_input = _shape_input(op, spec.shape_name, inputs[2]) if len(inputs) > 2 else None
    call = bind(op, a.shape, b.shape, DTYPES[a.dtype], attrs, shape_input, num_threads, tune,
                (a, b))
    if out is None:
        out = _new_result(call, a.dtype)
    else:
        out = _check_out(op, out, call.problem, a.dtype, (a, b))
    if out.size:  # not batch 0 of a data op
        call.run_arrays(a, b, out)
    return out, call


def _new_result(call: BoundCall, dtype: np.dtype) -> np.ndarray:
    shape = call.problem.output_shape
    return np.empty(shape, dtype) if call.small_output else kernels.empty_output(shape, dtype)


def execute(op_kind: str, inputs: Sequence, attrs: Mapping | None = None, *,
            out: np.ndarray | None = None, num_threads: int | None = None,
            tune: bool | str | None = None) -> np.ndarray:
    """Runs `op_kind` (a name of docs/semantics.md's first column) on `inputs` (the data
    arrays, then optionally the shape input) with `attrs` (spec attribute names).
    `tune`: True runs the plan tuned for these sizes and threads on this CPU, tuning
    it first if there is none (convgrad.tuning); "reuse" only uses tuned plans; False
    the planner's rules; None (default) follows CONVGRAD_TUNE."""
    if attrs is not None and not isinstance(attrs, Mapping):
        raise TypeError(f"execute: attrs is a {type(attrs).__name__}; expected a dict")
    if not isinstance(inputs, Sequence) or isinstance(inputs, str):
        raise TypeError(f"execute: inputs is a {type(inputs).__name__}; expected a list")
    return run(op_kind, list(inputs), attrs or {}, out=out, num_threads=num_threads,
               tune=tune)


def infer_shape(op_kind: str, input_shapes: Sequence, attrs: Mapping | None = None
                ) -> tuple[int, ...]:
    """The result shape of `op_kind` without computing it. `input_shapes` holds the
    shapes of the two data inputs, then optionally the shape input's value."""
    if not isinstance(op_kind, str) or op_kind not in OPS:
        raise ValueError(f"infer_shape: op_kind = {op_kind!r} is invalid; expected one of "
                         f"{list(OPS)}")
    spec = OPS[op_kind]
    if attrs is not None and not isinstance(attrs, Mapping):
        raise TypeError(f"{op_kind}: attrs is a {type(attrs).__name__}; expected a dict")
    if not isinstance(input_shapes, Sequence | np.ndarray) or isinstance(input_shapes, str):
        raise TypeError(f"{op_kind}: input_shapes is a {type(input_shapes).__name__}; "
                        "expected a list of shapes")
    shapes = list(input_shapes)
    limit = 3 if spec.shape_name else 2
    if not 2 <= len(shapes) <= limit:
        raise ValueError(f"{op_kind}: {len(shapes)} input shapes given; expected the shapes "
                         f"of {spec.inputs}"
                         + (f" and optionally the {spec.shape_name} input" if spec.shape_name
                            else ""))
    shape_input = shapes[2] if len(shapes) == 3 else None
    return resolve(op_kind, shapes[:2], attrs or {}, shape_input).output_shape


MAX_REPEATS = 1024  # bound calls kept per op function


def _op_function(kind: str):
    """Builds the public function of one op, keyword attributes and all."""
    spec = OPS[kind]
    keyword = inspect.Parameter.KEYWORD_ONLY
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter(name, positional) for name in spec.inputs]
    if spec.shape_name:
        parameters.append(inspect.Parameter(f"{spec.shape_name}_input", positional,
                                            default=None))
    for name, default in spec.defaults.items():
        parameters.append(inspect.Parameter(name, keyword, default=default))
    parameters += [inspect.Parameter("out", keyword, default=None),
                   inspect.Parameter("num_threads", keyword, default=None),
                   inspect.Parameter("tune", keyword, default=None)]
    signature = inspect.Signature(parameters)

    names = [p.name for p in parameters]
    positional_names = names[:len(spec.inputs) + bool(spec.shape_name)]
    defaults = {p.name: p.default for p in parameters}
    # Bound calls by this function's arguments (shapes, dtypes, the other values frozen,
    # the settings): a repeat call checks only its arrays' layout and runs the kernel.
    repeats: dict = {}
    on_reset(repeats.clear)

    def function(*args, **kwargs):
        key = None
        if len(args) >= 2 and "out" not in kwargs:
            a, b = args[0], args[1]
            if type(a) is np.ndarray and type(b) is np.ndarray:
                try:
                    key = (a.shape, b.shape, a.dtype, b.dtype, freeze(args[2:]),
                           tuple([(k, freeze(v)) for k, v in kwargs.items()]),
                           settings_key())
                    call = repeats.get(key)
                except (Unfrozen, TypeError):  # unusual values: the checks below
                    key = call = None
                if call is not None:
                    fa, fb = a.flags, b.flags
                    if fa.c_contiguous and fa.aligned and fb.c_contiguous and fb.aligned:
                        out = _new_result(call, a.dtype)
                        if out.size:
                            call.run_arrays(a, b, out)
                        return out
        # signature.bind's checks, without its cost on every call
        if len(args) > len(positional_names):
            raise TypeError(f"{kind}: takes at most {len(positional_names)} positional "
                            f"arguments ({', '.join(positional_names)}); {len(args)} given")
        values = dict(zip(positional_names, args, strict=False))
        for name, value in kwargs.items():
            if name not in defaults:
                raise TypeError(f"{kind}: got an unexpected keyword argument {name!r}")
            if name in values:
                raise TypeError(f"{kind}: got multiple values for argument {name!r}")
            values[name] = value
        missing = [name for name in spec.inputs if name not in values]
        if missing:
            raise TypeError(f"{kind}: missing required argument(s) {missing}")
        inputs = [values[name] for name in spec.inputs]
        shape_input = values.get(f"{spec.shape_name}_input") if spec.shape_name else None
        if shape_input is not None:
            inputs.append(shape_input)
        attrs = {name: values[name] for name in spec.attributes if name in values}
        out, call = _run(kind, inputs, attrs, values.get("out"), values.get("num_threads"),
                         values.get("tune"))
        if key is not None:
            if len(repeats) >= MAX_REPEATS:
                repeats.clear()
            repeats[key] = call
        return out

    function.__name__ = function.__qualname__ = spec.function
    function.__signature__ = signature
    shape_doc = (f" The optional third positional argument is the `{spec.shape_name}` input; "
                 f"it wins over the `{spec.shape_name}` attribute." if spec.shape_name else "")
    function.__doc__ = (
        f"{kind}: computes `{spec.output}` from `{spec.inputs[0]}` and `{spec.inputs[1]}`."
        f"{shape_doc}\n\nAttributes are keywords with the spec's names: strides, pads_begin, "
        f"pads_end, dilations, auto_pad, groups, data_format, {spec.weights_attr}"
        + (", output_padding" if spec.family == "bwd_data" else "")
        + (f", {spec.shape_name}" if spec.shape_name else "")
        + " (convgrad's docs/semantics.md gives their meaning and defaults); "
        "a scalar per-axis value applies to every spatial axis. `out` is an optional "
        "preallocated C-contiguous result, `num_threads` the OpenMP threads of this call, "
        "`tune` True/\"reuse\"/False to use (and with True make) a plan tuned for this "
        "layer on this machine (default: CONVGRAD_TUNE; see convgrad.tuning).")
    return function


convolution_backprop_data = _op_function("ConvolutionBackpropData")
convolution_backward_data = _op_function("ConvolutionBackwardData")
convolution_backprop_filters = _op_function("ConvolutionBackpropFilters")
convolution_backward_weights = _op_function("ConvolutionBackwardWeights")
conv_transpose_backward_data = _op_function("ConvTransposeBackwardData")
conv_transpose_backward_weights = _op_function("ConvTransposeBackwardWeights")
