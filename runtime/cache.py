"""The on-disk kernel cache: one shared library per kernel, keyed by its C source.

An entry's key hashes the kernel's rendered C, every flag and the CPU features the
ISA path needs; its file name adds a short hash of the compiler that built it, whose
identity the entry's record keeps. An edit of the generator that leaves a kernel's C
unchanged (a comment, a rule that other kernels read) leaves its entry valid. Finding
an entry without rendering goes through a small index, `index/<kernel name>-<hash of
the generator version>` (the kernel's name is unique for its configuration and plan),
which holds the entry's key: written once a process has rendered the kernel, it lets later processes
skip rendering (a few milliseconds a kernel) until the generator changes.

So a cached kernel is found without running the compiler: a process with no compiler
loads any valid entry of the key (the first by name), and one with a compiler uses (or
builds) its own compiler's entry. A build happens under a per-entry file lock
(released by the OS if the process dies) in a private temporary directory and is
published by atomic renames, the record of the library's digest last, so no process
ever uses a half-written library. An entry whose record is missing or does not match
is a miss and is rebuilt. A cache directory that cannot be written (read-only, full)
is replaced by a temporary one with a warning. Past CONVGRAD_CACHE_MAX_MB, the least
recently used entries are evicted (a build checks the folder's size from a running
estimate, rescanning it at most once a minute unless the estimate passes the cap).
`convgrad cache show | clear` lists or empties it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Mapping
from contextlib import suppress
from functools import cache
from pathlib import Path

import platformdirs
from filelock import FileLock

from convgrad import pch, settings
from convgrad.codegen import KernelConfig, generator_version, render, source_digest
from convgrad.codegen.isa import ISA_FEATURES
from convgrad.codegen.plan import compile_parts, kernel_name
from convgrad.compiler import (
    CompilerNotFoundError,
    compile_flags,
    compiler_command,
    compiler_identity,
)

log = logging.getLogger("convgrad")

DEFAULT_MAX_MB = 1024
# Errors that mean "this directory cannot take the entry", not "the build failed".
UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def configured_dir() -> Path:
    """CONVGRAD_CACHE_DIR, else $XDG_CACHE_HOME/convgrad, else ~/.cache/convgrad."""
    current = settings.current()
    if current.cache_dir:
        return Path(current.cache_dir)
    return _platform_dir(current.xdg_cache_home, current.home)


@cache
def _platform_dir(xdg_cache_home: str | None, home: str | None) -> Path:
    """platformdirs' cache folder, memoised by the variables it reads (every kernel's
    look-up in a process's first step asks)."""
    del xdg_cache_home, home  # the memo's key
    return Path(platformdirs.user_cache_dir("convgrad", appauthor=False))


_fallbacks: dict[Path, Path] = {}


def fallback_dir(unusable: Path, reason: str) -> Path:
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
        return fallback_dir(configured, error.strerror or str(error))
    if not os.access(configured, os.W_OK | os.X_OK):
        return fallback_dir(configured, "read-only")
    return configured


def lookup_dir() -> Path:
    """The folder to look entries up in: `cache_dir` without creating or checking it (a
    look-up only reads; a folder that does not exist holds no entry)."""
    configured = configured_dir()
    return _fallbacks.get(configured, configured)


def has_index() -> bool:
    """Whether the cache's index exists: a new cache has none until its first build,
    and then no look-up without rendering (`find(indexed_only=True)`) can succeed."""
    return (lookup_dir() / "index").is_dir()


def max_bytes() -> int:
    limit = settings.current().cache_max_mb
    return int(limit * 2**20) if limit is not None else DEFAULT_MAX_MB * 2**20


@cache
def _key_material(isa: str, flags: tuple[str, ...]) -> str:
    """Everything but the C source and the compiler that the binary depends on
    (memoised per ISA and flags)."""
    return json.dumps({"flags": flags, "features": sorted(ISA_FEATURES[isa])},
                      sort_keys=True)


def source_key(source: str, isa: str) -> str:
    """The key of the entry of a kernel of C `source` on `isa`: a hash of the source,
    the flags and the ISA's CPU features (everything but the compiler)."""
    material = source_digest(source) + _key_material(isa, compile_flags(isa))
    return hashlib.sha256(material.encode()).hexdigest()


@cache
def _generator_tag() -> str:
    return hashlib.sha256(generator_version().encode()).hexdigest()[:16]


@cache
def _flags_tag(isa: str, flags: tuple[str, ...]) -> str:
    return hashlib.sha256(_key_material(isa, flags).encode()).hexdigest()[:8]


def _index_path(config: KernelConfig, folder: Path, plan: Mapping[str, int] | None) -> Path:
    """The index record that leads from a configuration and plan to its entry without
    rendering: named by the kernel (its name is unique for the configuration and plan),
    the generator version and the compile flags (a key depends on them: a sanitized or
    CONVGRAD_CFLAGS build has entries of its own). Names, not a hash of the
    configuration: this runs once per kernel in a process's first step."""
    tag = _flags_tag(config.isa, compile_flags(config.isa))
    return folder / "index" / f"{kernel_name(config, plan)}-{_generator_tag()}-{tag}"


def cache_key(config: KernelConfig, plan: Mapping[str, int] | None = None,
              folder: Path | None = None) -> str:
    """The key of the kernel's entry (`source_key` of its C), read from the index of
    `folder` (default the cache) where a process recorded it, else found by rendering
    the kernel and recorded there."""
    folder = folder or cache_dir()
    recorded = recorded_key(config, folder, plan)
    if recorded is not None:
        return recorded
    key = source_key(render(config, plan), config.isa)
    _record_index(_index_path(config, folder, plan), key)
    return key


def recorded_key(config: KernelConfig, folder: Path,
                 plan: Mapping[str, int] | None = None) -> str | None:
    """The kernel's key as the index of `folder` records it, or None (not rendered yet
    with this generator version, or a damaged record)."""
    with suppress(OSError, ValueError):
        recorded = _index_path(config, folder, plan).read_text()
        if len(recorded) == 64:
            int(recorded, 16)
            return recorded
    return None


def clear_index(folder: Path) -> None:
    """Removes the index (`convgrad cache clear`); lookups that may build render again
    to rebuild it (`find(indexed_only=True)` reports its kernels missing until then)."""
    shutil.rmtree(folder / "index", ignore_errors=True)


def _record_index(index: Path, key: str) -> None:
    """Writes an index record (a cache that cannot be written goes without)."""
    with suppress(OSError):
        index.parent.mkdir(exist_ok=True)
    _write_atomically(index, key)


def _write_atomically(path: Path, text: str) -> None:
    """`path` holds `text` whole or is left as it was (also where it cannot be written)."""
    with suppress(OSError):
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp-",
                                         delete=False) as f:
            f.write(text)
        try:
            os.replace(f.name, path)
        except OSError:
            os.unlink(f.name)
            raise


def compiler_tag() -> str:
    """A short hash of the compiler command and identity (path and --version): the
    last part of an entry's name. Raises CompilerNotFoundError without a compiler."""
    return _compiler_tag(tuple(compiler_command()), compiler_identity())


@cache
def _compiler_tag(command: tuple[str, ...], identity: str) -> str:
    return hashlib.sha256(json.dumps([list(command), identity]).encode()).hexdigest()[:8]


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _entry_stem(config: KernelConfig, folder: Path, plan: Mapping[str, int] | None = None,
                key: str | None = None) -> str:
    """An entry's name up to its compiler tag: the same for every compiler (`key`: its
    cache key where known, else looked up)."""
    return f"{kernel_name(config, plan)}-{(key or cache_key(config, plan, folder))[:16]}"


def library_path(config: KernelConfig, folder: Path | None = None,
                 plan: Mapping[str, int] | None = None, key: str | None = None) -> Path:
    """This compiler's entry for `config` (CompilerNotFoundError without a compiler;
    `key`: its cache key where known, else looked up)."""
    folder = folder or cache_dir()
    return folder / f"{_entry_stem(config, folder, plan, key)}-{compiler_tag()}.so"


def cached_libraries(config: KernelConfig, folder: Path | None = None,
                     plan: Mapping[str, int] | None = None,
                     key: str | None = None) -> list[Path]:
    """The valid entries of `config` built by any compiler, in name order."""
    folder = folder or cache_dir()
    found = folder.glob(f"{_entry_stem(config, folder, plan, key)}-*.so")
    return sorted(p for p in found if is_valid(p))


def _file_stat(path: Path) -> list[int]:
    """(bytes, modification time in ns) of a file: what a truncation or an in-place
    rewrite changes and a rename keeps."""
    info = path.stat()
    return [info.st_size, info.st_mtime_ns]


def is_valid(library: Path) -> bool:
    """Whether a cached library is complete: its digest, recorded after the library
    was published, matches. A truncated or foreign file would crash dlopen. Where the
    file still has the size and modification time its record noted, it is the file
    that was hashed, and is not read again (hashing each library cost a new process
    about 0.2 ms a kernel: MobileNetV2's 89 kernels, Sapphire Rapids); a copied cache
    (new times) is hashed."""
    try:
        record = json.loads(library.with_suffix(".json").read_text())
        stat = _file_stat(library)
        if record.get("file_stat") == stat:
            return True
        if record["sha256"] != file_digest(library):
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    _write_atomically(library.with_suffix(".json"), json.dumps({**record, "file_stat": stat}))
    return True


def _touch(library: Path) -> None:
    """Marks an entry as used now (eviction removes the least recently used)."""
    with suppress(OSError):  # a read-only cache still serves its entries
        os.utime(library.with_suffix(".json"))


def build_jobs() -> int:
    """Compilations a lazy build of one kernel runs at once: CONVGRAD_BUILD_JOBS, by
    default 2 when this process may use two cores or more, else 1. With 2, a kernel of
    two parts (plan.compile_parts: data kernels, weight kernels from row segments) is
    compiled as two objects at once (functions.h.j2): its first call is 20-30% sooner
    on an idle machine (Zen 4, GCC 12), for ~20% more CPU time in all, which a machine
    busy compiling (a parallel test run) pays."""
    jobs = settings.current().build_jobs
    if jobs is None:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            jobs = os.cpu_count() or 1
    return min(2, jobs)


def find(config: KernelConfig, plan: Mapping[str, int] | None = None, *,
         indexed_only: bool = False) -> Path | None:
    """The kernel's valid cached library, without building one (None if there is none),
    marked as used. With `indexed_only`, a kernel whose key the index does not record
    is reported missing without rendering it (~12 ms a kernel, which a model's first
    step would wait for in its lookups on a new cache); a build renders it and finds
    an entry the index had lost."""
    folder = lookup_dir()
    key = recorded_key(config, folder, plan) if indexed_only else None
    if indexed_only and key is None:
        return None
    return _cached(config, folder, plan, key)


def _cached(config: KernelConfig, folder: Path, plan: Mapping[str, int] | None,
            key: str | None = None) -> Path | None:
    """This compiler's valid entry of the kernel in `folder`, or with no compiler any
    compiler's (the first by name), marked as used; None if there is none (`key`: its
    cache key where known, else looked up)."""
    name = kernel_name(config, plan)
    try:
        target = library_path(config, folder, plan, key)
    except CompilerNotFoundError:
        found = cached_libraries(config, folder, plan, key)
        if not found:
            return None
        log.debug("%s: no compiler; using cached %s", name, found[0])
        target = found[0]
    else:
        if not is_valid(target):
            return None
        log.debug("%s: found in cache %s", name, target)
    _touch(target)
    return target


def build(config: KernelConfig, plan: Mapping[str, int] | None = None) -> tuple[Path, bool]:
    """Path of the kernel's shared library (of `plan`, default the planner's rules),
    compiled first if the cache has no valid one, and whether this call compiled it."""
    folder = cache_dir()
    try:
        return _build_in(config, folder, plan)
    except OSError as error:
        if error.errno not in UNWRITABLE:
            raise
        return _build_in(config, fallback_dir(configured_dir(), error.strerror), plan)


def _build_in(config: KernelConfig, folder: Path,
              plan: Mapping[str, int] | None) -> tuple[Path, bool]:
    found = _cached(config, folder, plan)
    if found is not None:
        return found, False
    name = kernel_name(config, plan)
    tag = compiler_tag()  # CompilerNotFoundError: nothing to use
    started = time.perf_counter()
    source = render(config, plan)
    key = source_key(source, config.isa)
    _record_index(_index_path(config, folder, plan), key)
    target = folder / f"{_entry_stem(config, folder, plan, key)}-{tag}.so"
    with FileLock(target.with_suffix(".lock")):
        if is_valid(target):  # another process built it meanwhile
            return target, False
        with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
            c_file = Path(tmp) / f"{name}.c"
            c_file.write_text(source)
            built = Path(tmp) / "kernel.so"
            pch.compile_kernel([c_file], built, config.isa, folder,
                               parts=min(build_jobs(), compile_parts(config, plan)))
            record = Path(tmp) / "record.json"
            record.write_text(json.dumps({"sha256": file_digest(built),
                                          "file_stat": _file_stat(built),
                                          "config": config.to_dict(),
                                          "plan": dict(plan or {}),
                                          "generator": generator_version(),
                                          "compiler": compiler_identity(),
                                          "compiler_command": compiler_command(),
                                          "flags": list(compile_flags(config.isa))}))
            os.replace(c_file, target.with_suffix(".c"))  # kept for debugging
            os.replace(built, target)
            os.replace(record, target.with_suffix(".json"))  # last: marks it complete
        log.info("%s: compiled in %.2f s -> %s", name, time.perf_counter() - started, target)
    _evict_after_build(folder, target)
    return target, True


_PARTS = (".so", ".c", ".json", ".lock")


def _usage(folder: Path) -> list[tuple[float, int, Path]]:
    """(last use, bytes, library) of each entry, least recently used first, from one
    scan of the folder's metadata: eviction runs after every build, and reading each
    entry's record made it cost 0.7 s a build in a cache of 8000 entries."""
    sizes: dict[str, int] = {}
    used: dict[str, float] = {}
    libraries = set()
    with os.scandir(folder) as found:
        for item in found:
            stem, _, suffix = item.name.rpartition(".")
            if not item.name.startswith("convgrad_") or f".{suffix}" not in _PARTS:
                continue
            try:
                info = item.stat()
            except OSError:
                continue  # removed meanwhile
            sizes[stem] = sizes.get(stem, 0) + info.st_size
            if suffix == "json":
                used[stem] = info.st_mtime
            elif suffix == "so":
                libraries.add(stem)
    # an entry without its record is incomplete: first to go
    return sorted((used.get(stem, 0.0), sizes[stem], folder / f"{stem}.so")
                  for stem in libraries)


def entries(folder: Path) -> list[dict]:
    """Cache entries, least recently used first."""
    return [{"library": library, "parts": [library.with_suffix(s) for s in _PARTS],
             "bytes": size, "used": used, "compiler": _recorded_compiler(library)}
            for used, size, library in _usage(folder)]


def _recorded_compiler(library: Path) -> str:
    """The first line of the recorded identity of the compiler that built an entry."""
    try:
        identity = json.loads(library.with_suffix(".json").read_text())["compiler"]
        return str(identity).splitlines()[0]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return "unknown"


# After a build, the folder is scanned for eviction only where the running estimate of its
# bytes (the last scan's total plus what this process built since) passes the cap, or
# where that scan is older than RESCAN_SECONDS (other processes add entries too).
RESCAN_SECONDS = 60.0
_scanned: dict[Path, tuple[int, float]] = {}  # folder: (bytes, time.monotonic() of the scan)


def _evict_after_build(folder: Path, target: Path) -> None:
    added = 0
    for suffix in _PARTS:
        with suppress(OSError):
            added += target.with_suffix(suffix).stat().st_size
    total, at = _scanned.get(folder, (0, float("-inf")))
    if time.monotonic() - at < RESCAN_SECONDS and total + added <= max_bytes():
        _scanned[folder] = (total + added, at)
        return
    evict(folder, keep=target)


def evict(folder: Path, keep: Path | None = None, limit: int | None = None) -> int:
    """Removes least recently used entries until the cache fits `limit` bytes
    (CONVGRAD_CACHE_MAX_MB). A process that has an evicted library loaded keeps
    using it: unlinking does not unmap it."""
    limit = max_bytes() if limit is None else limit
    found = _usage(folder)
    total = sum(size for _, size, _ in found)
    removed = 0
    for _, size, library in found:
        if total <= limit:
            break
        if library == keep:
            continue
        for suffix in _PARTS:
            library.with_suffix(suffix).unlink(missing_ok=True)
        total -= size
        removed += 1
    _scanned[folder] = (total, time.monotonic())
    return removed
