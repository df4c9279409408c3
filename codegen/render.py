"""Renders C source for a kernel configuration from the Jinja2 templates."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path

import jinja2

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.isa import SIMD
from convgrad.codegen.plan import EMPTY_PLAN, render_context

PACKAGE_VERSION = "0.1.0"

# How an AOT folder's kernels run their parallel regions (convgrad aot --threading):
# OpenMP threads (the runtime's only mode); the calling thread alone; or the caller's
# thread pool, through the parallel_for in convgrad_dims. Only parallel.h.j2's spelling
# differs (parallel_<mode>.h.j2); the last two link no OpenMP runtime.
THREADING_MODES = ("openmp", "sequential", "caller")


def _threading(threading: str) -> str:
    if threading not in THREADING_MODES:
        raise ValueError(f"threading {threading!r} is not one of {list(THREADING_MODES)}")
    return threading


def _template_dir() -> Path:
    return Path(str(resources.files("convgrad.templates")))


# The version of an AOT folder's C interface (convgrad_kernels.h's CONVGRAD_ABI_VERSION):
# the kernel signature, convgrad_dims, convgrad_layer and the table's functions. Any
# change to them that a program compiled against the old header would misread raises it.
ABI_VERSION = 2


@cache
def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_template_dir()),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    environment.filters["c_string"] = c_string
    return environment


def c_string(text: str) -> str:
    """`text` as a C string literal: its UTF-8 bytes, with quotes, backslashes, `?` (no
    trigraphs) and every byte outside printable ASCII as an escape."""
    spelled = [chr(byte) if 32 <= byte < 127 and chr(byte) not in '"\\?' else f"\\{byte:03o}"
               for byte in text.encode()]
    return '"' + "".join(spelled) + '"'


@cache
def generator_version() -> str:
    """Package version plus a hash of every template and generator source file.

    Any change to the generator changes this. It names the generator in AOT manifests
    and tuned records, and keys the cache's index from a configuration to its entry;
    the entries themselves are keyed by their rendered C (`source_digest`)."""
    digest = hashlib.sha256()
    sources = sorted(_template_dir().glob("*.j2")) + sorted(Path(__file__).parent.glob("*.py"))
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return f"{PACKAGE_VERSION}+{digest.hexdigest()[:12]}"


def render(config: KernelConfig, plan: Mapping[str, int] | None = None,
           threading: str = "openmp") -> str:
    """C source of one kernel; the exported function is named
    `plan.kernel_name(config, plan)` (`config.name` for the default plan). The source
    names the package version, not `generator_version()`: an edit of the generator
    that leaves a kernel's C as it was leaves its cache key (a hash of the C) too.
    `threading` is one of THREADING_MODES (only the prelude differs)."""
    template = _environment().get_template("kernel.c.j2")
    return template.render(**render_context(config, PACKAGE_VERSION, plan or EMPTY_PLAN),
                           threading=_threading(threading))


class _Recording(jinja2.BaseLoader):
    """A loader that records the templates a render loads."""

    def __init__(self, loader: jinja2.BaseLoader):
        self.loader = loader
        self.loaded: list[str] = []

    def get_source(self, environment, template):
        if template not in self.loaded:
            self.loaded.append(template)
        return self.loader.get_source(environment, template)


def templates_of(config: KernelConfig, plan: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """The template files the kernel of `config` and `plan` renders from, in load order."""
    base = _environment()
    recording = _Recording(base.loader)
    environment = base.overlay(loader=recording, cache_size=0)
    environment.get_template("kernel.c.j2").render(
        **render_context(config, PACKAGE_VERSION, plan or EMPTY_PLAN), threading="openmp")
    return tuple(recording.loaded)


def source_digest(source: str) -> str:
    """SHA-256 of a kernel's C source: what the cache and AOT manifests key it by."""
    return hashlib.sha256(source.encode()).hexdigest()


def render_prelude(isa: str, threading: str = "openmp") -> str:
    """The #include lines every kernel of `isa` starts with (`prelude.h.j2`), the text
    a precompiled header is made of."""
    return _environment().get_template("prelude.h.j2").render(
        simd=SIMD[isa], threading=_threading(threading))


def render_dims_declaration() -> str:
    """The C declaration of `convgrad_dims`, as the kernels spell it (for cffi)."""
    return _environment().get_template("dims_struct.h.j2").render()


DIMS_FIELDS = 11  # convgrad_dims as int64 values: batch, src[3], dst[3], pads_begin[3], threads


def render_xla_handler() -> str:
    """The C source of the XLA FFI handler that runs kernels inside JAX programs
    (convgrad.jax): one handler for every kernel, which it finds in a table."""
    return _environment().get_template("xla_ffi.c.j2").render(dims_length=DIMS_FIELDS)


def render_torch_calls(status: Mapping[int, str], max_kept_workspace: int) -> str:
    """The C++ source of convgrad.torch's eager call path (a Python extension module):
    `status` the kernels' error codes and their messages, `max_kept_workspace` the
    largest scratch (bytes) a thread keeps between calls."""
    return _environment().get_template("torch_calls.cpp.j2").render(
        status=dict(status), max_kept_workspace=max_kept_workspace)


def render_header(names: list[str], aliases: dict[str, str] | None = None,
                  swapped: Iterable[str] = ()) -> str:
    """A C header declaring the given kernels (for AOT builds), and for each layer name
    in `aliases` (C identifier -> kernel name) macros naming its kernel; those in
    `swapped` (whose kernel takes its two inputs the other way round) get a function
    that passes them on swapped."""
    template = _environment().get_template("header.h.j2")
    return template.render(names=names, aliases=aliases or {}, swapped=set(swapped),
                           generator_version=generator_version(), abi_version=ABI_VERSION)


def render_table(layers: list[dict]) -> str:
    """The C source of an AOT folder's layer table and interface functions (the end of
    header.h.j2). Each layer: its "name", "op", "kernel" (C name), "alias" (C identifier
    of its alias in the header), "config" (KernelConfig) and "swapped" (its kernel takes
    the inputs swapped)."""
    def padded(values: tuple) -> str:
        return "{" + ", ".join(map(str, (*values, *(1,) * (3 - len(values))))) + "}"

    spelled = [{**layer, "kernel_size": padded(layer["config"].kernel),
                "strides": padded(layer["config"].strides),
                "dilations": padded(layer["config"].dilations)} for layer in layers]
    return _environment().get_template("kernel_table.c.j2").render(
        layers=spelled, generator_version=generator_version())


def render_aot_file(template: str, **context) -> str:
    """A file of an AOT folder other than the kernels and the header (the Makefile and
    CMake fragments), from its template."""
    return _environment().get_template(template).render(**context)
