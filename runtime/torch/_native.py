"""convgrad.torch's eager call path in C++: built once, cached like kernels, and the sites
the call path runs on.

The extension (templates/torch_calls.cpp.j2, a Python extension module linked against
libtorch) holds, for one op with its fixed attributes (a *site*), every call Python
resolved on it: kernel, run-time sizes, result layout. A repeat call of a converted
module crosses from Python into C++ once: the result is allocated, the bias added and
the kernel run there, and the autograd node is C++ too, whose backward runs the gradient
ops' sites (the forward convolution and the weight gradient; the other ops' backward
formulas stay Python's). Results are the bits of Python's path (tests/test_torch_native.py).

It is compiled by the C++ compiler ($CXX, default c++) once per source, torch, Python,
compiler and flags into the kernel cache's `torch_calls/` folder, in a background
thread that waits until the kernels asked for are built (so it never delays them) and
runs the compiler at low priority; `convgrad.torch.compile_kernels` builds it with the
kernels. Until it is loaded, and where it cannot be built (no C++ compiler, no torch
headers: one warning), Python's path serves every call. CONVGRAD_TORCH_NATIVE=off turns
it off (the test suite's default; tests/test_torch_native.py turns it on).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path

import torch

from convgrad import background, bound, cached_build, settings
from convgrad import cache as kernel_cache
from convgrad.codegen.render import render_torch_calls
from convgrad.compiler import SANITIZE_FLAGS, run_commands
from convgrad.kernels import STATUS
from convgrad.torch import _calls

log = logging.getLogger("convgrad")

ENV = "CONVGRAD_TORCH_NATIVE"
MODULE = "_convgrad_torch"
FOLDER = "torch_calls"

_module = None  # the loaded extension
_lock = threading.Lock()
_builder: threading.Thread | None = None
_failed = False


_enabled: bool | None = None  # CONVGRAD_TORCH_NATIVE as read (again after bound.reset)


def enabled() -> bool:
    """Whether the C++ path may serve calls: CONVGRAD_TORCH_NATIVE is not "off" (or "0").
    Read once (again after convgrad.kernels.reset())."""
    global _enabled
    if _enabled is None:
        _enabled = settings.current().torch_native
    return _enabled


def _compiler() -> list[str]:
    return list(settings.current().cxx)


def _flags() -> list[str]:
    """Compile and link flags: torch's headers and libraries, and its C++ ABI."""
    from torch.utils import cpp_extension

    library = Path(torch.__file__).resolve().parent / "lib"
    flags = ["-O2", "-std=gnu++20", "-fPIC", "-shared", "-Wno-deprecated-declarations",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):  # as cpp_extension passes them
        value = getattr(torch._C, f"_PYBIND11_{name}", None)
        if value is not None:
            flags.append(f'-DPYBIND11_{name}="{value}"')
    flags += [f"-I{path}" for path in cpp_extension.include_paths()]
    flags += [f"-I{sysconfig.get_paths()['include']}", f"-L{library}", "-lc10", "-ltorch",
              "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{library}"]
    if settings.current().sanitize:
        # -O0 after the kernels' -O1: the checks are the same, and GCC instruments
        # torch's headers in half the time (Zen 4: 84 s -> 41 s; unsanitized -O2: 24 s).
        flags += (*SANITIZE_FLAGS, "-O0")
    return flags


@functools.cache
def _identity(command: tuple[str, ...]) -> str:
    executable = shutil.which(command[0])
    if executable is None:
        raise FileNotFoundError(f"C++ compiler {command[0]!r} not found (set CXX)")
    result = subprocess.run([*command, "--version"], capture_output=True, text=True,
                            timeout=60, check=False)
    return f"{executable}: {result.stdout.strip()}"


def _source_and_key() -> tuple[str, list[str], str]:
    """The C++ source, the compile command (without file names) and the build's key."""
    source = render_torch_calls(STATUS, bound.MAX_KEPT_WORKSPACE)
    command = [*_compiler(), *_flags()]
    digest = hashlib.sha256()
    for part in (source, _identity(tuple(_compiler())), " ".join(command), torch.__version__,
                 str(torch.version.git_version), sys.version):
        digest.update(part.encode())
        digest.update(b"\0")
    return source, command, digest.hexdigest()[:20]


def _library(folder: Path, key: str) -> Path:
    """Where the build of `key` lives in a kernel cache folder."""
    return folder / FOLDER / f"{MODULE}-{key}.so"


def _build(folder: Path, low_priority: bool) -> Path:
    """The extension's library in `folder` (compiled first if it is not there)."""
    source, command, key = _source_and_key()

    def compile_to(cpp: Path, library: Path) -> None:
        started = time.perf_counter()
        full = [*command[:1], "-o", str(library), str(cpp), *command[1:]]
        if low_priority and shutil.which("nice"):
            full = ["nice", "-n", "10", *full]
        run_commands([full], [cpp])  # ended at exit, as kernel builds are
        log.info("convgrad.torch: built the C++ call path in %.1f s",
                 time.perf_counter() - started)

    return cached_build.build(_library(folder, key), source, "convgrad_torch.cpp",
                              compile_to)


def _load(low_priority: bool) -> None:
    global _module
    path = cached_build.in_cache(lambda folder: _build(folder, low_priority))
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _module = module


def _load_soft(low_priority: bool) -> None:
    """_load, a failure turned into one warning (Python's path keeps serving)."""
    global _failed
    try:
        _load(low_priority)
    except Exception as error:  # a missing compiler, headers, a full disk...
        _failed = True
        message = (f"convgrad.torch: the C++ call path could not be built, so calls take "
                   f"the Python path (correct, with more overhead a call): {error}")
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _build_when_quiet() -> None:
    """The background build: after the kernels asked for (they matter more)."""
    time.sleep(background.build_delay())
    while background.pending():
        time.sleep(0.2)
    _load_soft(low_priority=True)


def extension():
    """The loaded extension, else None: a cached build is loaded at once, else the build
    starts in the background (once a process)."""
    global _builder
    if _module is not None or _failed or _builder is not None or not enabled():
        return _module
    with _lock:
        if _module is None and not _failed and _builder is None:
            try:
                _, _, key = _source_and_key()
                cached = _library(kernel_cache.cache_dir(), key)
            except Exception:  # no compiler: _load_soft warns once
                cached = None
            if cached is not None and cached.is_file():
                _load_soft(low_priority=False)
            else:
                _builder = threading.Thread(target=_build_when_quiet, daemon=True,
                                            name="convgrad-torch-native")
                _builder.start()
    return _module


def build() -> bool:
    """Builds (or loads) the extension now, in this thread; whether it is loaded."""
    if _module is None and not _failed and enabled():
        with _lock:
            if _module is None and not _failed:
                builder = _builder
                if builder is not None:
                    builder.join()
                else:
                    _load_soft(low_priority=False)
    return _module is not None


def kernel_runs() -> int:
    """Kernels the C++ path ran in this process."""
    return 0 if _module is None else _module.kernel_runs()


# The sites: one per op and fixed attributes, made once the extension is loaded.

_sites: dict = {}
MAX_SITES = 4096  # beyond (attributes that change call after call), Python's path serves
_NO_SHAPE = frozenset({"conv_transpose_backward_data"})
_DATA_OPS = ("convolution_backward_data", "convolution_backprop_data")
_WEIGHTS_OPS = ("convolution_backward_weights", "convolution_backprop_filters")


class _Context:
    """What a Python backward formula reads of autograd's context."""

    __slots__ = ("saved_tensors", "attrs", "needs_input_grad")

    def __init__(self, saved, attrs, needs) -> None:
        self.saved_tensors, self.attrs, self.needs_input_grad = saved, attrs, needs


def site(name: str, static: tuple, formulas: dict):
    """The site of op `name` (a function name of the op table) with fixed attributes
    `static` = (strides, pads_begin, pads_end, dilations, groups[, output_padding]), each
    a tuple; None while the extension is not loaded (or too many sites exist).
    `formulas`: the ops' Python backward formulas (convgrad.torch.ops), for the ops
    whose backward is not C++."""
    if not enabled():
        return None
    found = _sites.get((name, static))
    if found is not None:
        return found
    module = extension()
    if module is None or len(_sites) >= MAX_SITES:
        return None
    zeros = (0,) * len(static[0])
    if name in _NO_SHAPE:  # the forward convolution
        kind = module.BACKWARD_OF_FORWARD
        grads = ((_DATA_OPS[0], (*static, zeros)), (_WEIGHTS_OPS[0], static))
    elif name in _WEIGHTS_OPS:
        kind = module.BACKWARD_OF_WEIGHTS
        grads = ((_DATA_OPS[0], (*static, zeros)), ("conv_transpose_backward_data", static))
    else:
        kind, grads = module.BACKWARD_IN_PYTHON, ()
    attrs = [list(value) if isinstance(value, tuple) else value for value in static]
    shaped = name not in _NO_SHAPE
    formula = formulas[name]

    def resolve(a, b, shape):
        return None if _calls.recording() else _calls.native_record(
            _calls.lookup(name, a, b, shape, *attrs))

    def fallback(a, b, shape):
        return _calls.execute(name, a, b, shape, *attrs)

    def python_backward(a, b, grad, need_a, need_b):
        context = _Context((a, b), ((None,) if shaped else ()) + tuple(attrs),
                           (need_a, need_b))
        return tuple(formula(context, grad)[:2])

    made = module.Site(f"convgrad::{name}", kind, resolve, fallback, python_backward)
    _sites[(name, static)] = made
    if grads:  # after: the gradient ops' sites may lead back to this one
        made.set_gradients(*(site(*grad, formulas) for grad in grads))
    return made


def _forget() -> None:
    global _enabled
    _enabled = None
    if _module is not None:
        _module.reset()


bound.on_reset(_forget)  # also in a forked child
_calls.on_recording(_forget)  # aot_kernels notes every call: Python's path serves them
