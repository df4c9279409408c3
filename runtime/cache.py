"""The on-disk kernel cache: one shared library per kernel, keyed by content hash.

A key hashes the configuration, the generator version (templates and generator
sources), the compiler identity, every flag and the CPU features the ISA path
needs. A build happens under a per-key file lock (released by the OS if the
process dies) in a private temporary directory and is published by atomic
renames, the record of the library's digest last, so no process ever uses a
half-written library. An entry whose record is missing or does not match is a
miss and is rebuilt. A cache directory that cannot be written (read-only, full)
is replaced by a temporary one with a warning. Past CONVGRAD_CACHE_MAX_MB, the
least recently used entries are evicted.

    python -m runtime.cache show | clear
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from contextlib import contextmanager, suppress
from functools import cache
from pathlib import Path

from codegen import KernelConfig, generator_version, render
from codegen.plan import ISA_FEATURES
from runtime.compiler import compile_flags, compile_objects, compiler_identity

log = logging.getLogger("convgrad")

DEFAULT_MAX_MB = 1024
# Errors that mean "this directory cannot take the entry", not "the build failed".
UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def configured_dir() -> Path:
    """CONVGRAD_CACHE_DIR, else $XDG_CACHE_HOME/convgrad, else ~/.cache/convgrad."""
    explicit = os.environ.get("CONVGRAD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "convgrad"


_fallbacks: dict[Path, Path] = {}


def _fallback_dir(unusable: Path, reason: str) -> Path:
    """A private temporary cache used instead of an unwritable one (warned once)."""
    if unusable not in _fallbacks:
        _fallbacks[unusable] = Path(tempfile.mkdtemp(prefix="convgrad-cache-"))
        warnings.warn(f"convgrad: kernel cache {unusable} is not writable ({reason}); "
                      f"using {_fallbacks[unusable]} for this process", RuntimeWarning,
                      stacklevel=3)
    return _fallbacks[unusable]


def cache_dir() -> Path:
    """The cache directory in use: the configured one, or its fallback."""
    configured = configured_dir()
    if configured in _fallbacks:
        return _fallbacks[configured]
    try:
        configured.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return _fallback_dir(configured, error.strerror or str(error))
    if not os.access(configured, os.W_OK | os.X_OK):
        return _fallback_dir(configured, "read-only")
    return configured


def max_bytes() -> int:
    value = os.environ.get("CONVGRAD_CACHE_MAX_MB", "")
    return int(float(value) * 2**20) if value.strip() else DEFAULT_MAX_MB * 2**20


@cache
def _key_material(isa: str, cc: str, flags: tuple[str, ...]) -> str:
    """Everything but the configuration that the binary depends on (memoised per
    ISA, compiler and flags)."""
    return json.dumps({"generator": generator_version(), "compiler": compiler_identity(),
                       "flags": flags, "features": sorted(ISA_FEATURES[isa])}, sort_keys=True)


def cache_key(config: KernelConfig) -> str:
    material = json.dumps(config.to_dict(), sort_keys=True) + _key_material(
        config.isa, os.environ.get("CC", ""), compile_flags(config.isa))
    return hashlib.sha256(material.encode()).hexdigest()


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


def library_path(config: KernelConfig, folder: Path | None = None) -> Path:
    return (folder or cache_dir()) / f"{config.name}-{cache_key(config)[:16]}.so"


def is_valid(library: Path) -> bool:
    """Whether a cached library is complete: its digest, recorded after the library
    was published, matches. A truncated or foreign file would crash dlopen."""
    try:
        record = json.loads(library.with_suffix(".json").read_text())
        return record["sha256"] == file_digest(library)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _touch(library: Path) -> None:
    """Marks an entry as used now (eviction removes the least recently used)."""
    with suppress(OSError):  # a read-only cache still serves its entries
        os.utime(library.with_suffix(".json"))


def build(config: KernelConfig) -> tuple[Path, bool]:
    """Path of the kernel's shared library, compiled first if the cache has no valid
    one, and whether this call compiled it."""
    folder = cache_dir()
    try:
        return _build_in(config, folder)
    except OSError as error:
        if error.errno not in UNWRITABLE:
            raise
        return _build_in(config, _fallback_dir(configured_dir(), error.strerror))


def _build_in(config: KernelConfig, folder: Path) -> tuple[Path, bool]:
    target = library_path(config, folder)
    if is_valid(target):
        log.debug("%s: found in cache %s", config.name, target)
        _touch(target)
        return target, False
    with _locked(target.with_suffix(".lock")):
        if is_valid(target):  # another process built it meanwhile
            return target, False
        started = time.perf_counter()
        source = render(config)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
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
            os.replace(record, target.with_suffix(".json"))  # last: marks it complete
        log.info("%s: compiled in %.2f s -> %s", config.name, time.perf_counter() - started,
                 target)
    evict(folder, keep=target)
    return target, True


def entries(folder: Path) -> list[dict]:
    """Cache entries, least recently used first."""
    found = []
    for library in folder.glob("convgrad_*.so"):
        parts = [library.with_suffix(s) for s in (".so", ".c", ".json", ".lock")]
        try:
            used = library.with_suffix(".json").stat().st_mtime
        except OSError:
            used = 0.0  # incomplete: first to go
        size = sum(p.stat().st_size for p in parts if p.exists())
        found.append({"library": library, "parts": parts, "bytes": size, "used": used})
    return sorted(found, key=lambda e: e["used"])


def evict(folder: Path, keep: Path | None = None, limit: int | None = None) -> int:
    """Removes least recently used entries until the cache fits `limit` bytes
    (CONVGRAD_CACHE_MAX_MB). A process that has an evicted library loaded keeps
    using it: unlinking does not unmap it."""
    limit = max_bytes() if limit is None else limit
    found = entries(folder)
    total = sum(e["bytes"] for e in found)
    removed = 0
    for entry in found:
        if total <= limit:
            break
        if entry["library"] == keep:
            continue
        for part in entry["parts"]:
            part.unlink(missing_ok=True)
        total -= entry["bytes"]
        removed += 1
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.cache",
                                     description="Show or clear the convgrad kernel cache.")
    parser.add_argument("command", choices=["show", "clear"])
    args = parser.parse_args(argv)
    folder = configured_dir()
    found = entries(folder) if folder.is_dir() else []
    if args.command == "clear":
        removed = evict(folder, limit=0) if found else 0
        print(f"removed {removed} kernels from {folder}")
        return 0
    print(f"{folder}: {len(found)} kernels, {sum(e['bytes'] for e in found) / 2**20:.1f} MB "
          f"(cap {max_bytes() / 2**20:.0f} MB, CONVGRAD_CACHE_MAX_MB)")
    for entry in reversed(found):
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["used"]))
        print(f"  {used}  {entry['bytes'] / 1024:8.1f} KB  {entry['library'].name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
