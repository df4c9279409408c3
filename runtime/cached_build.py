"""A library compiled once from one source into the kernel cache: the front ends'
extensions (convgrad.jax's XLA FFI handler, convgrad.torch's C++ call path).

`build` publishes `<cache>/<folder>/<name>` the first time (under a file lock, compiled
in a temporary folder and renamed into place, its source kept beside it for debugging);
later calls, in this process or another, find it. `in_cache` runs a build in the kernel
cache, or in its replacement folder where the cache cannot take it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from convgrad import cache as kernel_cache


def build(target: Path, source: str, source_name: str,
          compile_to: Callable[[Path, Path], None]) -> Path:
    """`target` (a library path keyed by everything it is built from), compiled first if
    it is not there: `compile_to(source_file, library_file)` builds it from `source`
    written as `source_name`; it raises on failure, and nothing is published then."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_suffix(".lock")):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            source_file = Path(tmp) / source_name
            source_file.write_text(source)
            built = Path(tmp) / "library.so"
            compile_to(source_file, built)
            os.replace(source_file, target.with_suffix(source_file.suffix))  # for debugging
            os.replace(built, target)
    return target


def in_cache(build_in: Callable[[Path], Path]) -> Path:
    """`build_in(folder)` in the kernel cache, or where the cache is unwritable (a full
    disk, a read-only folder) in its replacement folder (warned once)."""
    try:
        return build_in(kernel_cache.cache_dir())
    except OSError as error:
        if error.errno not in kernel_cache.UNWRITABLE:
            raise
        return build_in(kernel_cache.fallback_dir(kernel_cache.configured_dir(),
                                                  error.strerror or str(error)))
