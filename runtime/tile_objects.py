"""Tile objects: data kernels' register tiles, compiled once per cache and shared.

The register tiles (data_tile.h.j2) are half of a data kernel's compile time (GCC 12,
Zen 4: 0.3 of 0.6 s for a 3x3 kernel), and they depend only on their shape, dtype, ISA
path and step options: the kernel's sizes reach them as arguments. So a lazy build
compiles the kernel's own C with -DCONVGRAD_TILE_OBJECTS (its tiles then are hidden
symbols it does not define), and links it with one object per tile that
`codegen.render_tiles` spells. Each object is kept in the cache's `tiles` folder, named
by a hash of its C, the flags and the compiler, so the kernels that use a tile share
one compile of it: ResNet-50's 20 data kernels use 21 distinct tiles 133 times. The
kernel's C (kept beside its library) still defines every tile without that macro: it
builds on its own, as ahead-of-time builds compile it.

A tile object appears by an atomic rename once complete; two processes that need one
at once may both compile it (the same bytes). Objects are a few KB each, and the
distinct tiles are few, so the cache's size limit leaves them alone; `convgrad cache
clear` removes them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from convgrad import pch
from convgrad.compiler import CompileError, compile_flags, compiler_identity, link_shared

log = logging.getLogger("convgrad")

FOLDER = "tiles"
DEFINE = "-DCONVGRAD_TILE_OBJECTS"


def object_path(source: str, isa: str, cache_folder: Path) -> Path:
    """Where the cache keeps the object of a tile of C `source` on `isa`."""
    material = "\0".join([source, isa, *compile_flags(isa), DEFINE, compiler_identity()])
    return cache_folder / FOLDER / f"{hashlib.sha256(material.encode()).hexdigest()[:32]}.o"


def _compile_tile(source: str, path: Path, isa: str, cache_folder: Path) -> None:
    """Compiles one tile into `path` (published by a rename when complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        c_file = Path(tmp) / "tile.c"
        c_file.write_text(source)
        built = Path(tmp) / "tile.o"
        pch.compile_kernel([c_file], built, isa, cache_folder, shared=False, defines=(DEFINE,))
        os.replace(built, path)


def build_kernel(c_file: Path, tiles: Mapping[str, str], output: Path, isa: str,
                 cache_folder: Path, jobs: int) -> None:
    """Builds the shared library `output` of the kernel of C `c_file` that links the
    tile objects of `tiles` (render_tiles): compiles the kernel's own code and the
    tiles the cache lacks, `jobs` compilations at a time, then links them. A link that
    fails (a damaged object) compiles the tiles anew and links again."""
    paths = [object_path(source, isa, cache_folder) for source in tiles.values()]
    kernel_object = output.with_name(output.name + ".o")

    def compile_own() -> None:
        pch.compile_kernel([c_file], kernel_object, isa, cache_folder, shared=False,
                           defines=(DEFINE,))

    def compile_missing(fresh: bool = False) -> list:
        return [lambda s=source, p=path: _compile_tile(s, p, isa, cache_folder)
                for source, path in zip(tiles.values(), paths, strict=True)
                if fresh or not path.exists()]

    _run_all([compile_own, *compile_missing()], jobs)
    try:
        link_shared([kernel_object, *paths], output, isa)
    except CompileError as error:
        log.warning("linking %s with the cached tile objects failed; compiling them anew "
                    "(%s)", c_file.name, str(error).splitlines()[0])
        _run_all(compile_missing(fresh=True), jobs)
        link_shared([kernel_object, *paths], output, isa)
    kernel_object.unlink(missing_ok=True)


def _run_all(tasks: list, jobs: int) -> None:
    """Runs the tasks, `jobs` at a time; the first failure is raised after all end."""
    if len(tasks) <= 1 or jobs <= 1:
        for task in tasks:
            task()
        return
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in [pool.submit(task) for task in tasks]:
            future.result()


def stored(cache_folder: Path) -> tuple[int, int]:
    """How many tile objects a kernel cache holds, and their bytes."""
    found = list((cache_folder / FOLDER).glob("*.o"))
    return len(found), sum(path.stat().st_size for path in found)


def clear(cache_folder: Path) -> int:
    """Removes a kernel cache's tile objects; returns how many there were."""
    count = stored(cache_folder)[0]
    shutil.rmtree(cache_folder / FOLDER, ignore_errors=True)
    return count
