"""Bound calls: everything a repeat call of one op configuration needs, resolved once.

A `BoundCall` is memoised per (op, input shapes, dtype, attributes, shape input, thread
count, tuning mode, ISA path). It holds the resolved problem, the loaded kernel, its
run-time sizes (`convgrad_dims`) and the scratch it needs, so that a repeat call from
either front end (the numpy API, `convgrad.torch`) only checks what depends on the data
buffers themselves and calls the kernel. Building one validates the call (`resolve`,
with the user's messages); a key that does not freeze (unusual attribute values) is
never memoised, so such calls are validated every time.

The memo is dropped by `kernels.reset()` (a new kernel cache, AOT path or ISA) and in a
child process made by `fork` (the thread count may change there: convgrad.threads).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping

import numpy as np

from convgrad import kernels, settings, threads, tuning
from convgrad.codegen import Problem, resolve
from convgrad.codegen.plan import small_problem_plan, vendor_plan
from convgrad.cpu import cpu_features, cpu_vendor, selected_isa
from convgrad.kernels import Kernel, ffi, get_kernel

# Kernel scratch, kept per Python thread between calls: allocating and faulting in
# fresh pages every call costs a third of the time of a small layer.
_workspaces = threading.local()
MAX_KEPT_WORKSPACE = 256 * 2**20
SMALL_OUTPUT = 4096  # bytes
_allocate = ffi.new_allocator(should_clear_after_alloc=False)


def workspace(nbytes: int):
    """A cffi buffer of at least `nbytes` (this thread's, reused while it is large enough)."""
    buffer = getattr(_workspaces, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _allocate("char[]", max(nbytes, 64))
        if nbytes <= MAX_KEPT_WORKSPACE:
            _workspaces.buffer = buffer
    return buffer


class BoundCall:
    """One op configuration, resolved: call `run` with cffi pointers (or buffers) to the
    op's two data inputs, in the op's order, and to the result. The kernel is loaded
    (tuned, compiled) by the first run."""

    __slots__ = ("problem", "config", "kernel", "dims", "threads", "workspace_bytes",
                 "swap", "small_output", "failed", "_tune", "_arrays")

    def __init__(self, problem: Problem, num_threads: int, tune: str, arrays=None):
        self.problem = problem
        self.config = problem.config.with_isa(selected_isa())
        self.threads = num_threads
        self.kernel = None
        self.failed = False  # a background build of its kernel failed (convgrad.background)
        self._tune, self._arrays = tune, arrays
        self.dims = kernels.dims_of(problem, num_threads)  # read only by the kernels
        self.workspace_bytes = 0
        self.swap = problem.swap_inputs
        itemsize = 4 if problem.config.dtype == "f32" else 2
        # a result of a few cache lines: finding a 64-byte boundary costs more than it saves
        self.small_output = math.prod(problem.output_shape) * itemsize <= SMALL_OUTPUT

    @property
    def tunes(self) -> bool:
        """Whether loading may time candidate plans (tuning on or reuse)."""
        return self._tune != "off"

    def load(self, build: bool = True) -> Kernel | None:
        """The kernel (tuned first where the tuning mode asks, compiled if needed); with
        `build=False` (and tuning off) None where it would have to be compiled."""
        if self.kernel is None:
            plan = tuning.plan_for(self.problem, self.config, self.threads, self._tune,
                                   self._arrays)
            if plan is None and not self.tunes:
                plan = self.build_plan()
            kernel = get_kernel(self.config, plan, build=build)
            if kernel is None:
                return None
            self.workspace_bytes = kernel.workspace_size(self.dims)
            self._arrays = None
            self.kernel = kernel  # last: another thread may be reading it
        return self.kernel

    def build_plan(self) -> dict | None:
        """The plan a build of this call's kernel takes (tuning off): the rules' (None),
        but for a problem of one output pixel an image and few multiply-adds whose
        configuration has no kernel yet (in memory, an AOT folder or the cache's index;
        one that exists is taken) the rules' with small_problem_plan's tiles, cheaper to
        compile and as fast there."""
        small = small_problem_plan(self.config, self.problem)
        if small is None or get_kernel(self.config, None, build=False) is not None:
            return None
        return {**vendor_plan(self.config, cpu_vendor(), cpu_features()), **small}

    def run(self, first, second, out) -> None:
        kernel = self.kernel or self.load()
        if self.swap:
            first, second = second, first
        status = kernel.function(first, second, out, self.dims,
                                 workspace(self.workspace_bytes))
        if status:
            error = MemoryError if status == 2 else RuntimeError
            raise error(f"{self.problem.op.kind}: kernel {kernel.name} failed: "
                        f"{kernels.STATUS.get(status, status)}")

    def run_arrays(self, first: np.ndarray, second: np.ndarray, out: np.ndarray) -> None:
        """`run` on numpy arrays (C-contiguous, aligned, of the problem's shapes)."""
        self.run(ffi.from_buffer(first), ffi.from_buffer(second),
                 ffi.from_buffer(out, require_writable=True))


_calls: dict = {}
_lock = threading.Lock()
MAX_CALLS = 4096


class Unfrozen(Exception):
    pass


_TAG = object()  # starts every tagged value; no user value freezes to it


def freeze(value):
    """A hashable stand-in for an attribute value, typed so that, e.g., strides=2.0 (an
    error) never finds the entry of strides=2. Raises Unfrozen for other values."""
    kind = type(value)
    if kind is int or kind is str:  # the common case; bool and float are tagged below
        return value
    if kind is list or kind is tuple:  # resolve reads lists and tuples alike
        return tuple(map(freeze, value))
    if isinstance(value, np.ndarray):
        return (_TAG, "ndarray", value.dtype.str, value.shape,
                *map(freeze, value.ravel().tolist()))
    if value is None or isinstance(value, bool | int | float | str | np.generic):
        return (_TAG, kind.__name__, value)
    raise Unfrozen


_environment: tuple | None = None  # (CONVGRAD_TUNE, CONVGRAD_ISA) as first read


def settings_key() -> tuple:
    """What besides a call's arguments decides its kernel: the default thread count
    (convgrad.set_num_threads), the tuning mode and the ISA path. CONVGRAD_TUNE and
    CONVGRAD_ISA are read once (reading them took a quarter of a tiny call's time); after
    changing them in a running process, call convgrad.kernels.reset()."""
    global _environment
    if _environment is None:
        _environment = settings.values_of(tuning.ENV, "CONVGRAD_ISA")
    return threads.default_count, _environment


def bind(kind: str, a_shape: tuple, b_shape: tuple, dtype: str, attrs: Mapping,
         shape_input=None, num_threads: int | None = None, tune=None,
         arrays=None) -> BoundCall:
    """The memoised BoundCall of a call (validating it the first time). `arrays`, the
    op's two data inputs as numpy arrays, are timed on when tuning must tune first
    (random data of their shapes otherwise). The kernel itself is loaded by the first
    run (BoundCall.load)."""
    try:
        key = (kind, a_shape, b_shape, dtype, freeze(shape_input),
               tuple([(k, freeze(v)) for k, v in attrs.items()]),
               freeze(num_threads), freeze(tune), settings_key())
        call = _calls.get(key)
    except (Unfrozen, TypeError):  # unusual values: validated every time
        key, call = None, None
    if call is not None:
        return call
    threads.check(f"{kind}: ", num_threads)
    how = tuning.mode(tune)
    problem = resolve(kind, (a_shape, b_shape), attrs, shape_input, dtype)
    if how != "off" and arrays is None:
        arrays = tuning.random_inputs((a_shape, b_shape), dtype)
    call = BoundCall(problem, threads.for_call(num_threads), how, arrays)
    if key is not None:
        with _lock:
            if len(_calls) >= MAX_CALLS:
                _calls.clear()
            _calls[key] = call
    return call


_reset_hooks: list = []


def on_reset(hook) -> None:
    """Calls `hook()` whenever reset() runs, and in a child made by fork: the front ends'
    memos of bound calls (`dict.clear`: a hook takes no lock, which a fork may have left
    held)."""
    _reset_hooks.append(hook)


def bound_calls() -> list[BoundCall]:
    """The calls bound since the last reset, oldest first (a benchmark takes the one it
    just made, after reset(), to time other builds of its kernel)."""
    return list(_calls.values())


def reset() -> None:
    """Forgets every bound call, and reads the environment again at the next (also
    run by convgrad.kernels.reset, and in a child made by fork: the thread count may
    change there, convgrad.threads)."""
    global _environment
    _calls.clear()
    _environment = None
    for hook in _reset_hooks:
        hook()


kernels.on_reset(reset)
os.register_at_fork(after_in_child=reset)
