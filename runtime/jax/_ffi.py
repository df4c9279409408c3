"""The XLA FFI handler: built once per jaxlib and compiler, registered with XLA, and the
table of kernels it runs.

The handler (templates/xla_ffi.c.j2) is plain C against the FFI C API header that
jaxlib ships (`jax.ffi.include_dir()`). It is compiled into the kernel cache, keyed by
its source, that header and the compiler, and loaded with ctypes; `jax.ffi` registers
it as the custom-call target TARGET on the CPU. Each call configuration (a kernel, its
run-time sizes and its buffers' shapes) enters the handler's table once (`call_index`),
and the custom call names it by that index.
"""

from __future__ import annotations

import ctypes
import hashlib
import secrets
import threading
from functools import cache
from pathlib import Path

import jax

from convgrad import cached_build, settings
from convgrad.codegen.render import render_xla_handler
from convgrad.compiler import (
    SANITIZE_FLAGS,
    compiler_command,
    compiler_identity,
    run_commands,
)
from convgrad.kernels import Kernel, ffi

TARGET = "convgrad_conv"
_HEADER = Path("xla") / "ffi" / "api" / "c_api.h"
_lock = threading.Lock()
_indices: dict[tuple, int] = {}  # a call's configuration -> its index in the table


def _flags() -> list[str]:
    """The handler's compile flags (CONVGRAD_SANITIZE=1: with the kernels' sanitizers)."""
    flags = ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wl,-z,nodelete"]
    if settings.current().sanitize:
        flags += SANITIZE_FLAGS
    return flags


def _handler_source() -> tuple[str, str]:
    """The handler's C and the key of its build (source, jaxlib's header, compiler,
    flags)."""
    source = render_xla_handler()
    header = (Path(jax.ffi.include_dir()) / _HEADER).read_bytes()
    digest = hashlib.sha256()
    for part in (source.encode(), header, compiler_identity().encode(),
                 " ".join(_flags()).encode()):
        digest.update(part)
        digest.update(b"\0")
    return source, digest.hexdigest()[:20]


def _build(folder: Path) -> Path:
    source, key = _handler_source()

    def compile_to(c_file: Path, library: Path) -> None:
        run_commands([[*compiler_command(), *_flags(), "-I", jax.ffi.include_dir(), "-o",
                       str(library), str(c_file)]], [c_file])

    return cached_build.build(folder / "xla_ffi" / f"convgrad_xla_ffi-{key}.so", source,
                              "convgrad_xla_ffi.c", compile_to)


@cache
def handler() -> ctypes.CDLL:
    """The handler library, built if needed and registered with XLA (once a process)."""
    library = ctypes.CDLL(str(cached_build.in_cache(_build)))
    library.convgrad_xla_register.restype = ctypes.c_int64
    library.convgrad_xla_register.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    library.convgrad_xla_set_token.argtypes = [ctypes.c_int64]
    library.convgrad_xla_set_token(token())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.convgrad_xla_conv),
                                platform="cpu")
    return library


@cache
def token() -> int:
    """This process's token: a program compiled elsewhere carries another."""
    return secrets.randbits(62) + 1


def _int64s(values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def call_index(kernel: Kernel, dims: tuple[int, ...], dtype: int, workspace: int,
               shapes: tuple[tuple[int, ...], ...]) -> int:
    """The index of a call configuration in the handler's table (registered the first
    time): `kernel`, its convgrad_dims as DIMS_FIELDS integers, the XLA_FFI_DataType of
    its buffers, its scratch bytes and the shapes of its a, b and out buffers."""
    address = int(ffi.cast("uintptr_t", kernel.function))
    key = (address, dims, dtype, workspace, shapes)
    index = _indices.get(key)
    if index is None:
        library = handler()
        flat = [v for shape in shapes for v in (len(shape), *shape)]
        with _lock:
            index = _indices.get(key)
            if index is None:
                index = library.convgrad_xla_register(address, _int64s(dims), dtype,
                                                      workspace, _int64s(flat), len(flat))
                if index < 0:
                    raise RuntimeError("convgrad.jax: the FFI handler could not register a "
                                       "call (its table of 65536 calls is full)")
                _indices[key] = index
    return index
