"""Loading compiled kernels through cffi, and the in-process table of loaded ones."""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import cffi
import numpy as np

from convgrad import cache, settings
from convgrad.cache import file_digest
from convgrad.codegen import KernelConfig, generator_version, render, source_digest
from convgrad.codegen.plan import (
    Variant,
    check_plan,
    kernel_name,
    plan_key,
    resolve_plan,
    vendor_plan,
)
from convgrad.codegen.render import render_dims_declaration
from convgrad.compiler import CompilerNotFoundError
from convgrad.cpu import available_isas, cpu_features, cpu_vendor, host_family

log = logging.getLogger("convgrad")

STATUS = {1: "invalid run-time sizes", 2: "out of memory"}

ffi = cffi.FFI()
ffi.cdef(render_dims_declaration())  # the struct exactly as the kernels declare it
# Every kernel has these two signatures: a kernel is bound by casting its address to
# them. Declaring each kernel's name to cffi instead parsed C with pycparser, 1.7 ms a
# kernel: 150 ms of MobileNetV2's first step in a new process with a warm cache.
ffi.cdef("typedef int convgrad_kernel_fn(const void *, const void *, void *, "
         "const convgrad_dims *, void *);\n"
         "typedef int64_t convgrad_workspace_fn(const convgrad_dims *);")
_lock = threading.RLock()
_loaded: dict[tuple[KernelConfig, str | None], Kernel] = {}
_loading: dict[tuple[KernelConfig, str | None], threading.Lock] = {}
_libraries: dict[Path, object] = {}


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel: call it with (a, b, out, dims) as cffi pointers."""

    config: KernelConfig
    function: object
    workspace_size: object  # bytes of scratch a call needs, from its convgrad_dims
    origin: str  # "aot", "cache" or "compiled"
    path: Path
    plan: dict = field(default_factory=dict)  # {} for the planner's rules

    @property
    def name(self) -> str:
        return kernel_name(self.config, self.plan)

    @property
    def variant(self) -> Variant:
        """The kernel's variant: the body template its plan resolved to."""
        return resolve_plan(self.config, self.plan).variant


def kernel_functions(name: str, path: Path) -> tuple[object, object]:
    """The kernel `name` of the shared library `path` and its workspace function, as cffi
    function pointers (the library is loaded once and never unloaded)."""
    with _lock:
        library = _libraries.get(path)
        if library is None:
            library = ctypes.CDLL(str(path))
            _libraries[path] = library

        def address(symbol: str) -> int:
            return ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value

        return (ffi.cast("convgrad_kernel_fn *", address(name)),
                ffi.cast("convgrad_workspace_fn *", address(f"{name}_workspace_size")))


@lru_cache(maxsize=1)
def source_checkout() -> Path | None:
    """The repository this package runs from (an editable install), or None for an
    installed package (looked up once: every kernel's first look-up asks)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "codegen").is_dir() else None


def aot_search_path() -> list[Path]:
    """Folders whose manifest.json lists ahead-of-time kernels: CONVGRAD_AOT_PATH
    (os.pathsep-separated), else a source checkout's generated/ folder."""
    explicit = settings.current().aot_path
    if explicit is not None:
        return [Path(p) for p in explicit.split(os.pathsep) if p]
    root = source_checkout()
    return [root / "generated"] if root else []


# An AOT kernel: its library, C name and plan (tuned ones are built with theirs).
_aot_index: dict[KernelConfig, tuple[Path, str, dict]] | None = None
_refused: list[str] = []  # AOT folders skipped because this CPU cannot run them
_aot_index_path: list[Path] | None = None


def _read_manifests() -> dict[KernelConfig, tuple[Path, str, dict]]:
    index: dict[KernelConfig, tuple[Path, str, dict]] = {}
    _refused.clear()
    for folder in aot_search_path():
        manifest = folder / "manifest.json"
        if not manifest.is_file():
            continue
        try:
            data = json.loads(manifest.read_text())
            # Another generator's kernels are used where it rendered the same C.
            other = data.get("generator_version") != generator_version()
            if data.get("machine", host_family()) != host_family():
                _refused.append(f"{folder} was built for {data['machine']}, not this "
                                f"{host_family()} machine")
                log.warning("ignoring AOT kernels: %s", _refused[-1])
                continue
            if data.get("isa") not in available_isas():
                missing = sorted(set(data.get("cpu_features", [])) - cpu_features())
                _refused.append(f"{folder} was built for {data.get('isa')}, which this CPU "
                                f"cannot run (it lacks {', '.join(missing) or 'that ISA'})")
                log.warning("ignoring AOT kernels: %s", _refused[-1])
                continue
            library = folder / data["library"]
            if file_digest(library) != data["library_sha256"]:
                log.warning("ignoring %s: %s does not match its recorded digest", manifest,
                            library)
                continue
            stale = 0
            for entry in data["kernels"]:
                config = KernelConfig.from_dict(entry["config"])
                plan = check_plan(entry.get("plan", {}))
                if other and entry.get("source_sha256") != source_digest(
                        render(config, plan, data.get("threading", "openmp"))):
                    stale += 1
                    continue
                index.setdefault(config, (library, kernel_name(config, plan), plan))
            if stale:
                log.warning("ignoring %d of the %d kernels of %s: built by convgrad %s, "
                            "whose C for them differs from this version's (%s)", stale,
                            len(data["kernels"]), manifest, data.get("generator_version"),
                            generator_version())
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("ignoring unreadable AOT manifest %s: %s", manifest, error)
    return index


def _aot_kernel(config: KernelConfig) -> tuple[Path, str, dict] | None:
    global _aot_index, _aot_index_path
    path = aot_search_path()
    with _lock:
        if _aot_index is None or path != _aot_index_path:
            _aot_index, _aot_index_path = _read_manifests(), path
        return _aot_index.get(config)


_reset_hooks: list = []


def _after_fork_in_child() -> None:
    """A lock held by another thread of the parent (a build in the background) stays
    held in the child, whose copy of that thread does not exist: new locks."""
    global _lock
    _lock = threading.RLock()
    _loading.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def on_reset(hook) -> None:
    """Calls `hook()` whenever reset() runs (memos that hold loaded kernels)."""
    _reset_hooks.append(hook)


def reset() -> None:
    """Forgets loaded kernels and AOT manifests (tests; after changing the env)."""
    global _aot_index
    with _lock:
        _loaded.clear()
        _aot_index = None
    for hook in _reset_hooks:
        hook()


@lru_cache(maxsize=4096)
def _plan_key(items: tuple) -> str:
    """plan_key of a plan's sorted items, memoised: a tuned call looks its kernel up by it."""
    return plan_key(dict(items))


def get_kernel(config: KernelConfig, plan: Mapping[str, int] | None = None, *,
               build: bool = True) -> Kernel | None:
    """The kernel for `config`: already loaded, from an AOT build, or from the disk
    cache (compiled there first if needed). An AOT kernel for a lesser ISA this CPU
    runs is taken before compiling. `plan` None takes the AOT kernel whatever its plan
    (a tuned build's), else the planner's rules for this CPU (vendor_plan); a given plan
    ({} for the rules on any CPU) takes exactly that one. With `build=False`, None where
    the kernel would have to be compiled first, or where the cache's index does not
    record it (a build then renders it and finds it: see cache.find)."""
    key = (config, None if plan is None else _plan_key(tuple(sorted(plan.items()))))
    kernel = _loaded.get(key)
    if kernel is not None:
        return kernel
    with _lock:  # one loader per kernel; others go on (a build in the background)
        loading = _loading.setdefault(key, threading.Lock())
    with loading:
        kernel = _loaded.get(key)
        if kernel is None:
            kernel = _load(config, None if plan is None else check_plan(plan), build)
            if kernel is not None:
                _loaded[key] = kernel
        return kernel


def _load(config: KernelConfig, plan: dict | None, build: bool = True) -> Kernel | None:
    isas = available_isas()
    for isa in isas[isas.index(config.isa):] if config.isa in isas else [config.isa]:
        found = _aot_kernel(config.with_isa(isa))
        if found is not None and (plan is None or plan_key(plan) == plan_key(found[2])):
            library, name, aot_plan = found
            log.debug("%s: ahead-of-time kernel from %s", name, library)
            return Kernel(config.with_isa(isa), *kernel_functions(name, library), "aot",
                          library, aot_plan)
    if not build and not cache.has_index():
        return None  # a new cache: nothing to find, so no plan to work out either
    if plan is None:
        plan = vendor_plan(config, cpu_vendor(), cpu_features())
    if not build:
        path = cache.find(config, plan, indexed_only=True)
        return None if path is None else Kernel(
            config, *kernel_functions(kernel_name(config, plan), path), "cache", path, plan)
    try:
        path, compiled = cache.build(config, plan)
    except CompilerNotFoundError as error:
        if not _refused:
            raise
        raise CompilerNotFoundError(f"{error}; ahead-of-time kernels were skipped: "
                                    + "; ".join(_refused)) from None
    return Kernel(config, *kernel_functions(kernel_name(config, plan), path),
                  "compiled" if compiled else "cache", path, plan)


# Results the runtime allocates start on a 64-byte boundary, as PyTorch's CPU tensors do:
# vectors stored to them never straddle cache lines, and f32 weight gradients can add
# their sums in the result itself (plan choice sums_in_output; numpy's own blocks of
# megabytes start 16 bytes past a page).
OUTPUT_ALIGN = 64


def empty_output(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an OUTPUT_ALIGN boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize  # (np.prod takes 3 us a call)
    block = np.empty(nbytes + OUTPUT_ALIGN, dtype=np.uint8)
    start = -block.ctypes.data % OUTPUT_ALIGN
    return block[start:start + nbytes].view(dtype).reshape(shape)


def call(kernel: Kernel, problem, dims, first, second, out, workspace) -> None:
    """Runs `kernel` on the problem's sizes `dims` (dims_of): `first`, `second` and `out`
    are the kernel's buffers (numpy arrays, in its argument order), `workspace` at least
    `kernel.workspace_size(dims)` bytes (a numpy uint8 array)."""
    status = kernel.function(ffi.from_buffer(first), ffi.from_buffer(second),
                             ffi.from_buffer(out, require_writable=True), dims,
                             ffi.from_buffer(workspace, require_writable=True))
    if status:
        error = MemoryError if status == 2 else RuntimeError
        raise error(f"{problem.op.kind}: kernel {kernel.name} failed: "
                    f"{STATUS.get(status, status)}")


def dims_of(problem, num_threads: int):
    """The `convgrad_dims` of a resolved problem."""
    rank = problem.config.rank
    dims = ffi.new("convgrad_dims *")
    dims.size = ffi.sizeof("convgrad_dims")
    dims.batch = problem.batch
    dims.src[0:rank] = problem.src_spatial
    dims.dst[0:rank] = problem.dst_spatial
    dims.pads_begin[0:rank] = problem.pads_begin
    dims.num_threads = num_threads
    return dims
