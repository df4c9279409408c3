"""Loading compiled kernels through cffi, and the in-process table of loaded ones."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import cffi

from convgrad import cache
from convgrad.cache import file_digest
from convgrad.codegen import KernelConfig, generator_version
from convgrad.codegen.render import render_dims_declaration
from convgrad.compiler import CompilerNotFoundError
from convgrad.cpu import available_isas, cpu_features

log = logging.getLogger("convgrad")

STATUS = {1: "invalid run-time sizes", 2: "out of memory"}

ffi = cffi.FFI()
ffi.cdef(render_dims_declaration())  # the struct exactly as the kernels declare it
_lock = threading.RLock()
_declared: set[str] = set()
_loaded: dict[KernelConfig, Kernel] = {}
_libraries: dict[Path, object] = {}


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel: call it with (a, b, out, dims) as cffi pointers."""

    config: KernelConfig
    function: object
    workspace_size: object  # bytes of scratch a call needs, from its convgrad_dims
    origin: str  # "aot", "cache" or "compiled"
    path: Path


def _bind(config: KernelConfig, path: Path) -> tuple[object, object]:
    with _lock:
        if config.name not in _declared:
            ffi.cdef(f"int {config.name}(const void *, const void *, void *, "
                     f"const convgrad_dims *, void *);\n"
                     f"int64_t {config.name}_workspace_size(const convgrad_dims *);")
            _declared.add(config.name)
        library = _libraries.get(path)
        if library is None:
            library = ffi.dlopen(str(path))
            _libraries[path] = library
        return (getattr(library, config.name),
                getattr(library, f"{config.name}_workspace_size"))


def source_checkout() -> Path | None:
    """The repository this package runs from (an editable install), or None for an
    installed package."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "codegen").is_dir() else None


def aot_search_path() -> list[Path]:
    """Folders whose manifest.json lists ahead-of-time kernels: CONVGRAD_AOT_PATH
    (os.pathsep-separated), else a source checkout's generated/ folder."""
    explicit = os.environ.get("CONVGRAD_AOT_PATH")
    if explicit is not None:
        return [Path(p) for p in explicit.split(os.pathsep) if p]
    root = source_checkout()
    return [root / "generated"] if root else []


_aot_index: dict[KernelConfig, Path] | None = None
_refused: list[str] = []  # AOT folders skipped because this CPU cannot run them
_aot_index_path: list[Path] | None = None


def _read_manifests() -> dict[KernelConfig, Path]:
    index: dict[KernelConfig, Path] = {}
    _refused.clear()
    for folder in aot_search_path():
        manifest = folder / "manifest.json"
        if not manifest.is_file():
            continue
        try:
            data = json.loads(manifest.read_text())
            if data.get("generator_version") != generator_version():
                log.warning("ignoring %s: built by convgrad %s, this is %s", manifest,
                            data.get("generator_version"), generator_version())
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
            for entry in data["kernels"]:
                index.setdefault(KernelConfig.from_dict(entry["config"]), library)
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("ignoring unreadable AOT manifest %s: %s", manifest, error)
    return index


def _aot_library(config: KernelConfig) -> Path | None:
    global _aot_index, _aot_index_path
    path = aot_search_path()
    if _aot_index is None or path != _aot_index_path:
        _aot_index, _aot_index_path = _read_manifests(), path
    return _aot_index.get(config)


def reset() -> None:
    """Forgets loaded kernels and AOT manifests (tests; after changing the env)."""
    global _aot_index
    with _lock:
        _loaded.clear()
        _aot_index = None


def get_kernel(config: KernelConfig) -> Kernel:
    """The kernel for `config`: already loaded, from an AOT build, or from the disk
    cache (compiled there first if needed). An AOT kernel for a lesser ISA this CPU
    runs is taken before compiling."""
    kernel = _loaded.get(config)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _loaded.get(config)
        if kernel is None:
            kernel = _load(config)
            _loaded[config] = kernel
        return kernel


def _load(config: KernelConfig) -> Kernel:
    isas = available_isas()
    for isa in isas[isas.index(config.isa):] if config.isa in isas else [config.isa]:
        library = _aot_library(config.with_isa(isa))
        if library is not None:
            functions = _bind(config.with_isa(isa), library)
            log.debug("%s: ahead-of-time kernel from %s", config.name, library)
            return Kernel(config.with_isa(isa), *functions, "aot", library)
    try:
        path, compiled = cache.build(config)
    except CompilerNotFoundError as error:
        if not _refused:
            raise
        raise CompilerNotFoundError(f"{error}; ahead-of-time kernels were skipped: "
                                    + "; ".join(_refused)) from None
    return Kernel(config, *_bind(config, path), "compiled" if compiled else "cache", path)
