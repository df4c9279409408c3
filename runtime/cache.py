"""The on-disk kernel cache: one shared library per kernel, keyed by content hash.

A key hashes the configuration, the generator version (templates and generator
sources), the compiler identity, every flag and the CPU features the ISA path
needs. A build happens under a per-key file lock (released by the OS if the
process dies) in a private temporary directory and is published by an atomic
rename, so no process ever sees a half-written library.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from codegen import KernelConfig, generator_version, render
from codegen.plan import ISA_FEATURES
from runtime.compiler import compile_flags, compile_objects, compiler_identity

log = logging.getLogger("convgrad")


def cache_dir() -> Path:
    """CONVGRAD_CACHE_DIR, else $XDG_CACHE_HOME/convgrad, else ~/.cache/convgrad."""
    explicit = os.environ.get("CONVGRAD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "convgrad"


def cache_key(config: KernelConfig) -> str:
    material = {
        "config": config.to_dict(),
        "generator": generator_version(),
        "compiler": compiler_identity(),
        "flags": compile_flags(config.isa),
        "features": sorted(ISA_FEATURES[config.isa]),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@contextmanager
def _locked(path: Path):
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def library_path(config: KernelConfig) -> Path:
    return cache_dir() / f"{config.name}-{cache_key(config)[:16]}.so"


def is_valid(library: Path) -> bool:
    """Whether a cached library is complete: its digest, recorded after the library
    was published, matches. A truncated or foreign file would crash dlopen."""
    try:
        record = json.loads(library.with_suffix(".json").read_text())
        return record["sha256"] == file_digest(library)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build(config: KernelConfig) -> Path:
    """Path of the kernel's shared library, compiling it if the cache has no valid one."""
    target = library_path(config)
    if is_valid(target):
        log.debug("%s: found in cache %s", config.name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_suffix(".lock")):
        if is_valid(target):  # another process built it meanwhile
            return target
        started = time.perf_counter()
        source = render(config)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            c_file = Path(tmp) / f"{config.name}.c"
            c_file.write_text(source)
            built = Path(tmp) / "kernel.so"
            compile_objects([c_file], built, config.isa)
            record = Path(tmp) / "record.json"
            record.write_text(json.dumps({"sha256": file_digest(built),
                                          "config": config.to_dict(),
                                          "generator": generator_version()}))
            os.replace(c_file, target.with_suffix(".c"))  # kept for debugging
            os.replace(built, target)
            os.replace(record, target.with_suffix(".json"))  # last: marks the entry complete
        log.info("%s: compiled in %.2f s -> %s", config.name, time.perf_counter() - started,
                 target)
    return target
