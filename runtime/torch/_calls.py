"""Running one op on torch tensors: shapes, layouts, and a memo of resolved calls.

The op table is convgrad's own (`convgrad.codegen.OPS`, keyed here by function name),
the one the numpy API reads. `execute` validates a call once per configuration (tensor
shapes, strides and dtypes, attributes, thread count), through `convgrad.bound.bind`,
and keeps what it resolved: the bound kernel, the result's shape and strides, and
whether an input must be made dense first. A repeat call allocates the result and
calls the kernel on the tensors' own memory.
"""

from __future__ import annotations

import contextlib
import threading

import torch

import convgrad
from convgrad import background, bound
from convgrad.codegen import OPS as _KINDS
from convgrad.codegen import shapes
from convgrad.codegen.layers import Layer
from convgrad.codegen.ops import OpSpec
from convgrad.kernels import ffi
from convgrad.torch import _bridge, _standin

SPECS: dict[str, OpSpec] = {spec.function: spec for spec in _KINDS.values()}


def torch_weights_format(spec: OpSpec) -> str:
    """torch's own weight layout for the op: OIX, or IOX for the ConvTranspose ops."""
    return spec.weights_formats[0]


def infer_shape(spec: OpSpec, a, b, shape, strides, pads_begin, pads_end, dilations,
                groups, output_padding) -> tuple:
    """The result shape in torch order by convgrad.infer_shape (which validates all)."""
    attrs = {"strides": list(strides), "pads_begin": list(pads_begin),
             "pads_end": list(pads_end), "dilations": list(dilations), "groups": groups,
             "data_format": "NCX", spec.weights_attr: torch_weights_format(spec)}
    if output_padding is not None:
        attrs["output_padding"] = list(output_padding)
    inputs = [tuple(a.shape), tuple(b.shape)]
    if shape is not None:
        inputs.append(list(shape))
    return tuple(convgrad.infer_shape(spec.kind, inputs, attrs))


def _is_concrete(*values) -> bool:
    return all(type(v) is int for group in values for v in group)


def result_shape(spec: OpSpec, a, b, shape, strides, pads_begin, pads_end, dilations,
                 groups, output_padding=None) -> list:
    """The result shape in torch order: infer_shape's with concrete sizes, else (dynamic
    shapes in torch.compile) the same rules as arithmetic on SymInts
    (convgrad.codegen.shapes.result_shape, whose defaults are torch's layouts)."""
    if _is_concrete(a.shape, b.shape, shape or (), pads_begin, pads_end):
        return list(infer_shape(spec, a, b, shape, strides, pads_begin, pads_end, dilations,
                                groups, output_padding))
    return list(shapes.result_shape(spec.family, spec.transpose, a.shape, b.shape, shape,
                                    strides, pads_begin, pads_end, dilations, groups,
                                    output_padding))


def layouts(spec: OpSpec, a: torch.Tensor, b: torch.Tensor) -> tuple[str, str | None]:
    """(layout the kernel reads its data in, layout of the result: the data layout, or for
    weights None (contiguous) or "NXC" (stored (A, k..., B), torch's channels_last)). The
    first data input decides; where it is both (one channel or one pixel), the second
    (the other data tensor, or channels_last weights) does."""
    fmt = _bridge.data_format(a, hint=b)
    if spec.family != "bwd_weights":
        return fmt, fmt
    return fmt, ("NXC" if _bridge.inner_weight_results(fmt, a.dim()) else None)


def new_result(spec: OpSpec, shape, out_fmt: str | None, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised result of `spec` in layout `out_fmt` (see layouts)."""
    if spec.family == "bwd_weights":
        return _bridge.new_weights(shape, like, inner=out_fmt == "NXC")
    return _bridge.new_data(shape, out_fmt, like)


_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


_recording_hooks: list = []


def on_recording(hook) -> None:
    """Calls `hook()` when aot_kernels starts noting calls (the C++ path forgets its own:
    every call goes through execute while it notes them)."""
    _recording_hooks.append(hook)


# Calls PyTorch's operators served while their kernels were not ready (convgrad.background)
standin_calls = 0
_collector: list | None = None  # compile_kernels: the calls a pass asks kernels for
_recorder: list | None = None  # aot_kernels: every call a pass makes, building nothing


@contextlib.contextmanager
def collecting(build: bool = True):
    """Within: yields a list of the calls (`Call`) made. With `build` (compile_kernels),
    every call whose kernel is not ready runs on PyTorch's operator and asks for its
    kernel in the background, whatever the compile mode; the list holds those calls.
    Without (aot_kernels), the list holds every call, loaded or not, none is built and
    one whose kernel is not loaded runs on PyTorch's operator (not counted in
    `standin_calls`)."""
    global _collector, _recorder
    previous, found = (_collector, _recorder), []
    if build:
        _collector = found
    else:
        _recorder = found
        for hook in _recording_hooks:
            hook()
    try:
        yield found
    finally:
        _collector, _recorder = previous


def _torch_order(spec: OpSpec, shape: tuple, out_fmt: str | None) -> list:
    """A kernel's result shape (in layout `out_fmt`, see layouts) in torch's order:
    (N, X..., C) is torch's (N, C, X...), weights (A, k..., B) stored channels last
    torch's (A, B, k...)."""
    if out_fmt != "NXC":
        return list(shape)
    if spec.family == "bwd_weights":
        return list(shapes.join_weights(*shapes.split_weights(shape, "OXI")))
    return list(shapes.join_data(*shapes.split_data(shape, "NXC")))


class Call:
    """One resolved configuration of an op on tensors (convgrad.torch.warmup lists them)."""

    __slots__ = ("bound", "shape", "strides", "empty", "dense_a", "dense_b", "requested",
                 "standin", "layer")

    def __init__(self, spec: OpSpec, a: torch.Tensor, b: torch.Tensor, shape, strides,
                 pads_begin, pads_end, dilations, groups, output_padding, num_threads):
        _bridge.check_pair(spec.kind, spec.inputs, a, b)
        fmt, out_fmt = layouts(spec, a, b)
        own, inner = spec.weights_formats[0], spec.weights_formats[2]
        if spec.family == "bwd_weights":
            b_fmt, weights_format = fmt, inner if out_fmt == "NXC" else own
        elif _bridge.weights_inner(b):  # torch's channels_last weights, read in place
            b_fmt, weights_format = "NXC", inner
        else:
            b_fmt, weights_format = None, own
        # an input whose memory is not the layout the kernel reads is made so first
        self.dense_a = None if _bridge.is_dense(a, fmt) else fmt
        self.dense_b = None if _bridge.is_dense(b, b_fmt) else (b_fmt or "OIX")
        self.bound = self.layer = None
        self.requested = False  # its kernel was asked for in the background
        self.standin = (spec, shape, strides, pads_begin, pads_end, dilations, groups,
                        output_padding)
        args = (spec, a, b, shape, strides, pads_begin, pads_end, dilations, groups,
                output_padding)
        if 0 in a.shape or 0 in b.shape or (shape is not None and 0 in shape):
            out_shape = result_shape(*args)  # a result with no element, or an error
        else:
            a_shape = _bridge.kernel_shape(a, fmt)
            b_shape = _bridge.kernel_shape(b, b_fmt)
            if shape is not None:  # a data shape goes as its spatial part: fmt may be NXC
                shape = (list(shape)[-(a.dim() - 2):] if spec.family == "bwd_data"
                         else list(shape))
            attrs = {"strides": list(strides), "pads_begin": list(pads_begin),
                     "pads_end": list(pads_end), "dilations": list(dilations),
                     "groups": groups, "data_format": fmt, spec.weights_attr: weights_format}
            if output_padding is not None:
                attrs["output_padding"] = list(output_padding)
            try:  # validates the call once, in the layouts the kernel reads
                self.bound = bound.bind(spec.kind, a_shape, b_shape, _DTYPE_NAMES[a.dtype],
                                        attrs, shape, num_threads)
            except (ValueError, TypeError):
                result_shape(*args)  # the error in torch's terms (NCX shapes)
                raise
            out_shape = _torch_order(spec, self.bound.problem.output_shape, out_fmt)
            # the call as an AOT layer (convgrad.torch.aot), named there
            self.layer = Layer(spec.kind, (tuple(a_shape), tuple(b_shape))
                               + (() if shape is None else (tuple(shape),)), attrs,
                               _DTYPE_NAMES[a.dtype], batch=a_shape[0])
        out = new_result(spec, out_shape, out_fmt, a)
        self.shape, self.strides = tuple(out.shape), out.stride()
        self.empty = out.numel() == 0

    def ready(self) -> bool:
        """Whether the kernel is loaded (loading it first in block mode, or where it is
        in memory, an AOT folder or the disk cache); else asks for it in the background
        once."""
        bound = self.bound
        if bound.kernel is not None:
            return True
        if bound.failed or self.requested:
            return False
        if _collector is None and (background.mode() == "block" or bound.tunes):
            bound.load()
            return True
        if bound.load(build=False) is not None:
            return True
        background.submit(bound)  # first: a bad setting raises here, on every call
        self.requested = True
        if _collector is not None:
            _collector.append(self)
        return False

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        global standin_calls
        if self.empty:
            return torch.empty_strided(self.shape, self.strides, dtype=a.dtype)
        if self.bound.kernel is None and not self.ready():
            standin_calls += 1
            return self.stand_in(a, b)
        out = torch.empty_strided(self.shape, self.strides, dtype=a.dtype)
        if self.dense_a:
            a = _bridge.dense(a, self.dense_a)
        if self.dense_b:
            b = _bridge.dense(b, self.dense_b)
        cast = ffi.cast
        self.bound.run(cast("void *", a.data_ptr()), cast("void *", b.data_ptr()),
                       cast("void *", out.data_ptr()))
        return out

    def stand_in(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The call on PyTorch's operator (a result of the kernel's layout)."""
        spec, *args = self.standin
        return _standin.compute(spec, self.shape, self.strides, a, b, *args)


def _record(call: Call, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`call` within collecting(build=False): noted, and run on its kernel where that
    is loaded, else on PyTorch's operator, building nothing."""
    if call.empty:
        return call(a, b)
    _recorder.append(call)
    return call(a, b) if call.bound.kernel is not None else call.stand_in(a, b)


_calls: dict = {}
_lock = threading.Lock()
MAX_CALLS = 4096


def lookup(name: str, a: torch.Tensor, b: torch.Tensor, shape, strides, pads_begin,
           pads_end, dilations, groups, output_padding=None) -> Call:
    """The resolved call of op `name` (a function name of the op table) on CPU tensors,
    made (validated, with the user's error messages) the first time."""
    count = _bridge.num_threads()
    if not (a.is_cpu and b.is_cpu):
        return Call(SPECS[name], a, b, shape, strides, pads_begin, pads_end, dilations,
                     groups, output_padding, count)  # raises the error
    try:
        key = (name, a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype,
               None if shape is None else tuple(shape), tuple(strides), tuple(pads_begin),
               tuple(pads_end), tuple(dilations), groups,
               None if output_padding is None else tuple(output_padding), count)
        call = _calls.get(key)
    except (TypeError, RuntimeError):  # sparse tensors have no strides; unhashable values
        key, call = None, None
    if call is None:
        call = Call(SPECS[name], a, b, shape, strides, pads_begin, pads_end, dilations,
                     groups, output_padding, count)
        if key is not None:
            with _lock:
                if len(_calls) >= MAX_CALLS:
                    _calls.clear()
                _calls[key] = call
    return call


def execute(name: str, a: torch.Tensor, b: torch.Tensor, shape, strides, pads_begin,
            pads_end, dilations, groups, output_padding=None) -> torch.Tensor:
    """Runs op `name` (a function name of the op table) on CPU tensors. The first call
    of a configuration validates it (with the user's error messages)."""
    call = lookup(name, a, b, shape, strides, pads_begin, pads_end, dilations, groups,
                  output_padding)
    if _recorder is not None:
        return _record(call, a, b)
    return call(a, b)


def recording() -> bool:
    """Whether aot_kernels notes every call (collecting(build=False))."""
    return _recorder is not None


_DENSE = {None: 0, "NXC": 1}  # how the C++ path makes an input dense (else 2: contiguous)


def native_record(call: Call) -> tuple | None:
    """What the C++ path (convgrad.torch._native) keeps of a resolved call: kernel and
    run-time sizes (addresses), scratch bytes, input order, whether the result is
    empty, its sizes and strides, how each input is made dense, the start of an error
    message and the object that owns it all. None while the kernel is not loaded (the
    stand-in serves; its build was asked for)."""
    if call.empty:
        return (0, 0, 64, False, True, list(call.shape), list(call.strides), 0, 0, "", call)
    bound = call.bound
    if bound.kernel is None and not call.ready():
        return None
    kernel = bound.kernel
    return (int(ffi.cast("uintptr_t", kernel.function)), int(ffi.cast("uintptr_t", bound.dims)),
            max(bound.workspace_bytes, 64), bound.swap, False, list(call.shape),
            list(call.strides), _DENSE.get(call.dense_a, 2), _DENSE.get(call.dense_b, 2),
            f"{bound.problem.op.kind}: kernel {kernel.name} failed: ", call)


bound.on_reset(_calls.clear)  # also in a forked child: the thread count may change there
