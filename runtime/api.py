"""The public functions of SEMANTICS.md: one per op, plus execute and infer_shape."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from convgrad import kernels, tuning
from convgrad.codegen import OPS, Problem, resolve
from convgrad.cpu import selected_isa
from convgrad.kernels import get_kernel
from convgrad.threads import check as _check_threads
from convgrad.threads import for_call as _threads_for_call

DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
          np.dtype(ml_dtypes.bfloat16): "bf16"}
DTYPE_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}

# Kernel scratch, kept per Python thread between calls: allocating and faulting in
# fresh pages every call costs a third of the time of a small layer.
_workspaces = threading.local()
MAX_KEPT_WORKSPACE = 256 * 2**20


def _workspace(nbytes: int) -> np.ndarray:
    buffer = getattr(_workspaces, "buffer", None)
    if buffer is None or buffer.size < nbytes:
        buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        if nbytes <= MAX_KEPT_WORKSPACE:
            _workspaces.buffer = buffer
    return buffer


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


# Resolved calls by their arguments: validation and shape inference are pure Python and
# cost more than a small kernel. Values are frozen with their types so that, e.g.,
# strides=2.0 (an error) never finds the entry of strides=2.
_plans: dict = {}
MAX_PLANS = 4096


class _Unfrozen(Exception):
    pass


_TAG = object()  # starts every tagged value; no user value freezes to it


def _freeze(value):
    kind = type(value)
    if kind is int or kind is str:  # the common case; bool and float are tagged below
        return value
    if kind is list or kind is tuple:  # resolve reads lists and tuples alike
        return tuple(map(_freeze, value))
    if isinstance(value, np.ndarray):
        return (_TAG, "ndarray", value.dtype.str, value.shape,
                *map(_freeze, value.ravel().tolist()))
    if value is None or isinstance(value, bool | int | float | str | np.generic):
        return (_TAG, kind.__name__, value)
    raise _Unfrozen


def _plan(op: str, a_shape, b_shape, attrs: Mapping, shape_input, dtype: str):
    """The resolved problem, the kernel configuration of a call and a dict for the
    problem's convgrad_dims by thread count, memoised."""
    isa = selected_isa()
    try:
        key = (op, a_shape, b_shape, dtype, isa, _freeze(shape_input),
               tuple([(k, _freeze(v)) for k, v in attrs.items()]))
    except (_Unfrozen, TypeError):  # unusual values: resolve validates them
        key = None
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        problem = resolve(op, (a_shape, b_shape), attrs, shape_input, dtype)
        plan = (problem, problem.config.with_isa(isa), {})  # and its dims by thread count
        if key is not None:
            if len(_plans) >= MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    return plan


def run(op_kind: str, inputs: Sequence, attrs: Mapping, *, out: np.ndarray | None = None,
        num_threads: int | None = None, tune: bool | str | None = None) -> np.ndarray:
    """Validates, infers the result shape and pads, and runs the op's kernel."""
    spec = OPS.get(op_kind) if isinstance(op_kind, str) else None
    if spec is None:
        raise ValueError(f"execute: op_kind = {op_kind!r} is invalid; expected one of "
                         f"{list(OPS)}")
    op = spec.kind
    _check_threads(f"{op}: ", num_threads)
    limit = 3 if spec.shape_name else 2
    if not 2 <= len(inputs) <= limit:
        raise ValueError(f"{op}: {len(inputs)} inputs given; expected {spec.inputs} "
                         + (f"and optionally {spec.shape_name}" if spec.shape_name else ""))
    a, b = (_data_array(op, name, x) for name, x in zip(spec.inputs, inputs, strict=False))
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: {spec.inputs[0]} is {a.dtype} but {spec.inputs[1]} is "
                        f"{b.dtype}; expected one dtype")
    shape_input = _shape_input(op, spec.shape_name, inputs[2]) if len(inputs) > 2 else None
    problem, config, dims_by_threads = _plan(op, a.shape, b.shape, attrs, shape_input,
                                             DTYPES[a.dtype])
    if out is None:
        out = kernels.empty_output(problem.output_shape, a.dtype)
    else:
        out = _check_out(op, out, problem, a.dtype, (a, b))
    if out.size == 0:  # batch 0 of a data op
        return out
    threads = _threads_for_call(num_threads)
    plan = tuning.plan_for(problem, config, threads, tuning.mode(tune), (a, b))
    kernel = get_kernel(config, plan)
    first, second = (b, a) if problem.swap_inputs else (a, b)
    dims = dims_by_threads.get(threads)
    if dims is None:  # read only by the kernels: shared by calls
        dims = dims_by_threads[threads] = kernels.dims_of(problem, threads)
    kernels.call(kernel, problem, dims, first, second, out, _workspace(kernel.workspace_size(dims)))
    return out


def execute(op_kind: str, inputs: Sequence, attrs: Mapping | None = None, *,
            out: np.ndarray | None = None, num_threads: int | None = None,
            tune: bool | str | None = None) -> np.ndarray:
    """Runs `op_kind` (a name of SEMANTICS.md's first column) on `inputs` (the data
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

    def function(*args, **kwargs):
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
        return run(kind, inputs, attrs, out=values.get("out"),
                   num_threads=values.get("num_threads"), tune=values.get("tune"))

    function.__name__ = function.__qualname__ = spec.function
    function.__signature__ = signature
    shape_doc = (f" The optional third positional argument is the `{spec.shape_name}` input; "
                 f"it wins over the `{spec.shape_name}` attribute." if spec.shape_name else "")
    function.__doc__ = (
        f"{kind}: computes `{spec.output}` from `{spec.inputs[0]}` and `{spec.inputs[1]}`."
        f"{shape_doc}\n\nAttributes are keywords with the spec's names (see SEMANTICS.md); "
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
