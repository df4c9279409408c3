"""Precompiled headers: the kernels' prelude parsed once per compiler and flags.

Every x86 kernel includes <immintrin.h> (about 38,000 lines with AVX-512 flags), and GCC
spends ~0.2 s of a ~0.65 s kernel compile parsing it (GCC 12, Zen 4; 0.28 s with the
avx2 path's flags). So GCC compiles kernels with `-include <folder>/convgrad_prelude.h`
and loads the precompiled `convgrad_prelude.h.gch` found beside that header instead of
parsing its text; the kernel's own #include lines of the same headers then find them
included. The prelude is rendered from the template the kernels include
(`prelude.h.j2`), so both name the same headers, and the generated C stays
self-contained: the flag is a build detail, not part of it, and the binary is the same
either way.

The precompiled header lives in the kernel cache, in a folder named by a hash of the
compiler (command and identity), the flags and the prelude's text. A cache without it
starts building it in the background (GCC, about 0.5 s) and compiles the kernel at hand
without it, so no call waits for it; `wait=True` (ahead-of-time builds, which compile
many kernels) builds it first. One process or thread builds it at a time (a marker file
created exclusively), and the build's own shell publishes it by an atomic rename when
complete, so a process that exits meanwhile leaves no partial file. GCC checks a
precompiled header against the compilation's flags and, when it does not match, reads
the header's text instead: slower, never different. Only GCC and only x86 SIMD paths
use one: clang's precompiled headers are an error when they do not match, and the
other paths' preludes are a few small C library headers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from contextlib import suppress
from pathlib import Path

from convgrad.codegen import render_prelude
from convgrad.codegen.isa import SIMD
from convgrad.codegen.targets import compiler_kind
from convgrad.compiler import (
    LINK_FLAGS,
    CompileError,
    CompilerNotFoundError,
    compile_flags,
    compile_objects,
    compiler_command,
    compiler_identity,
)

log = logging.getLogger("convgrad")

HEADER = "convgrad_prelude.h"
FOLDER = "pch"

# Builds started by this process, by folder: each is started once.
_builds: dict[Path, subprocess.Popen] = {}

# A marker older than this is from a build that died.
STALE_SECONDS = 120
# sh -c: compile into a temporary file, publish it by a rename (or remove it), then
# remove the marker that kept other processes from building it too.
_BUILD_SCRIPT = ('tmp=$1 gch=$2 marker=$3; shift 3; '
                 'if "$@" -o "$tmp"; then mv -f "$tmp" "$gch"; else rm -f "$tmp"; fi; '
                 'rm -f "$marker"')


def wanted(isa: str) -> bool:
    """Whether kernels of `isa` built by the configured compiler use a precompiled
    prelude: GCC on the x86 SIMD paths."""
    if SIMD[isa] == "generic":
        return False
    try:
        return compiler_kind(compiler_identity())[0] == "gcc"
    except CompilerNotFoundError:
        return False


def _header_flags(isa: str, threading: str = "openmp") -> tuple[str, ...]:
    """The compile flags without the link flags: what the header is compiled with."""
    return tuple(flag for flag in compile_flags(isa, threading) if flag not in LINK_FLAGS)


def header_path(isa: str, cache_folder: Path, threading: str = "openmp") -> Path:
    """Where the prelude of `isa` for this compiler and these flags lives (its
    precompiled form is this path plus `.gch`)."""
    material = json.dumps([compiler_command(), compiler_identity(),
                           _header_flags(isa, threading), render_prelude(isa, threading)])
    digest = hashlib.sha256(material.encode()).hexdigest()[:16]
    return cache_folder / FOLDER / digest / HEADER


def include_flags(isa: str, cache_folder: Path, wait: bool = False,
                  threading: str = "openmp") -> tuple[str, ...]:
    """Flags that make a kernel compile of `isa` use the precompiled prelude, or () when
    there is none (yet): the first call in a cache starts building it and, unless
    `wait`, returns () at once. A running build is left alone: it may belong to another
    process."""
    if not wanted(isa):
        return ()
    header = header_path(isa, cache_folder, threading)
    gch = header.with_name(HEADER + ".gch")
    if not gch.exists():
        try:
            build = _start(isa, header, gch, threading)
        except OSError as error:  # an unwritable cache: compile without it
            log.debug("precompiled header not built in %s: %s", header.parent, error)
            return ()
        if not wait or build is None:
            return ()
        build.wait()
        if not gch.exists():
            log.debug("precompiled header %s failed to build; compiling without it", gch)
            return ()
    return ("-include", str(header))


def compile_kernel(sources: list[Path], output: Path, isa: str, cache_folder: Path, *,
                   shared: bool = True, wait: bool = False, parts: int = 1,
                   threading: str = "openmp") -> None:
    """compiler.compile_objects (in `parts` compilations at once) with the precompiled
    prelude of `cache_folder` when there is one. A compile that fails with it is tried
    again without it, and the precompiled header is removed (to be built anew): a
    damaged one must not fail a build."""
    prelude = include_flags(isa, cache_folder, wait=wait, threading=threading)
    # only AOT builds choose the threading: the runtime's calls stay as they were
    mode = {"threading": threading} if threading != "openmp" else {}
    try:
        compile_objects(sources, output, isa, shared=shared, extra=prelude, parts=parts, **mode)
    except CompileError:
        if not prelude:
            raise
        log.warning("compiling with the precompiled header %s.gch failed; compiling "
                    "without it and removing it", prelude[1])
        Path(prelude[1] + ".gch").unlink(missing_ok=True)
        compile_objects(sources, output, isa, shared=shared, parts=parts, **mode)


def _start(isa: str, header: Path, gch: Path, threading: str) -> subprocess.Popen | None:
    """Starts the background build of `gch` from `header`, unless this or another
    process is building it (a marker file, created exclusively, says so; one older than
    STALE_SECONDS is from a build that died)."""
    running = _builds.get(header.parent)
    if running is not None:
        return running
    header.parent.mkdir(parents=True, exist_ok=True)
    marker = header.with_name(HEADER + ".building")
    with suppress(OSError):
        if time.time() - marker.stat().st_mtime > STALE_SECONDS:
            marker.unlink()
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    text = header.with_name(f".{HEADER}.{os.getpid()}.tmp")
    text.write_text(render_prelude(isa, threading))
    os.replace(text, header)
    tmp = gch.with_name(f".{gch.name}.{os.getpid()}.tmp")
    command = [*compiler_command(), *_header_flags(isa, threading), "-x", "c-header",
               str(header)]
    log.debug("building precompiled header %s", gch)
    build = subprocess.Popen(["sh", "-c", _BUILD_SCRIPT, "sh", str(tmp), str(gch), str(marker),
                              *command],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    _builds[header.parent] = build
    return build


def stored(cache_folder: Path) -> tuple[int, int]:
    """How many precompiled headers a kernel cache holds, and their bytes."""
    found = list((cache_folder / FOLDER).glob(f"*/{HEADER}.gch"))
    return len(found), sum(path.stat().st_size for path in found)


def clear(cache_folder: Path) -> int:
    """Removes a kernel cache's precompiled headers; returns how many there were."""
    count = stored(cache_folder)[0]
    shutil.rmtree(cache_folder / FOLDER, ignore_errors=True)
    return count
