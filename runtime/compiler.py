"""Invoking the system C compiler."""

from __future__ import annotations

import contextlib
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path

from convgrad import settings
from convgrad.codegen.isa import ISA_EXTRA_FLAGS, ISA_FLAGS
from convgrad.codegen.render import THREADING_MODES
from convgrad.codegen.targets import compiler_kind, target

BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-fopenmp", "-fno-math-errno")
# nodelete: a kernel library (and the OpenMP runtime it pulls in) is never unloaded.
# cffi dlcloses libraries when they are collected, at the latest at interpreter exit,
# and unloading libgomp under its idle worker threads crashes the process.
LINK_FLAGS = ("-shared", "-Wl,-z,nodelete")


class CompilerNotFoundError(RuntimeError):
    """No C compiler is available to build a kernel that is not cached."""


class CompileError(RuntimeError):
    """The C compiler rejected a generated kernel."""


def compiler_command() -> list[str]:
    """The C compiler to run: $CC (may carry arguments), default `cc`."""
    return list(settings.current().cc)


# CONVGRAD_SANITIZE=1: kernels check every access (the process needs libasan preloaded).
# -O1 (after BASE_FLAGS' -O3, so it wins), as AddressSanitizer's documentation advises:
# the checks are placed on the C's own accesses at every level, and GCC compiles the
# instrumented kernels 4-5x faster than at -O3 (a 1x1 NCX data kernel: 14.7 s -> 3.3 s).
SANITIZE_FLAGS = ("-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer", "-g")


def compile_flags(isa: str, threading: str = "openmp") -> tuple[str, ...]:
    """Every flag a kernel is compiled and linked with: the ISA path's, or with
    CONVGRAD_TARGET (convgrad aot --target) that target's flags for this compiler plus
    what the path needs on top; CONVGRAD_CFLAGS adds more. `threading` "sequential" or
    "caller" (convgrad aot --threading, codegen's THREADING_MODES) drops every -fopenmp
    flag: no OpenMP runtime is linked."""
    current = settings.current()
    named = current.target
    flags = _compile_flags(isa, current.cflags, current.sanitize, named,
                           compiler_identity() if named else "")
    if threading not in THREADING_MODES:
        raise ValueError(f"threading {threading!r} is not one of {list(THREADING_MODES)}")
    if threading != "openmp":
        return tuple(flag for flag in flags if not flag.startswith("-fopenmp"))
    return flags


@cache
def _compile_flags(isa: str, cflags: str, sanitize: bool, named: str,
                   identity: str) -> tuple[str, ...]:
    """compile_flags, memoised by what it reads (every kernel's look-up asks)."""
    isa_flags = (target(named).flags(*compiler_kind(identity)) + ISA_EXTRA_FLAGS[isa]
                 if named else ISA_FLAGS[isa])
    return (BASE_FLAGS + isa_flags + (SANITIZE_FLAGS if sanitize else ())
            + tuple(shlex.split(cflags)) + LINK_FLAGS)


@cache
def _identity(command: tuple[str, ...]) -> str:
    executable = shutil.which(command[0])
    if executable is None:
        raise CompilerNotFoundError(
            f"C compiler {command[0]!r} not found (set CC, or build the kernels ahead of "
            "time with `convgrad aot` and point CONVGRAD_AOT_PATH at them)")
    try:
        result = subprocess.run([*command, "--version"], capture_output=True, text=True,
                                timeout=60, check=False)
    except OSError as error:
        raise CompilerNotFoundError(f"C compiler {command[0]!r} cannot run: {error}") from None
    return f"{executable}: {result.stdout.strip()}"


def compiler_identity() -> str:
    """Path and `--version` text of the compiler, part of every cache key."""
    return _identity(tuple(compiler_command()))


def compile_objects(sources: list[Path], output: Path, isa: str, shared: bool = True,
                    extra: tuple[str, ...] = (), parts: int = 1,
                    threading: str = "openmp") -> None:
    """Compiles C sources into a shared library (or, with shared=False, one object);
    `extra` flags (a precompiled prelude) do not change what is built. `parts` > 1 (a
    shared library of one kernel whose tiles carry IN_PART guards, functions.h.j2):
    that many compilations with -DCONVGRAD_PART=0, 1, ... run at once, then one link."""
    flags = compile_flags(isa, threading)
    compile_only = tuple(f for f in flags if f not in LINK_FLAGS) + ("-c",)
    if parts == 1 or not shared:
        _run([[*compiler_command(), *(flags if shared else compile_only), *extra,
               "-o", str(output), *map(str, sources)]], sources)
        return
    objects = [output.with_name(f"{output.name}.part{part}.o") for part in range(parts)]
    _run([[*compiler_command(), *compile_only, f"-DCONVGRAD_PART={part}", *extra,
           "-o", str(obj), *map(str, sources)] for part, obj in enumerate(objects)], sources)
    link_shared(objects, output, isa, threading)
    for obj in objects:
        obj.unlink(missing_ok=True)


def link_shared(objects: list[Path], output: Path, isa: str,
                threading: str = "openmp") -> None:
    """Links compiled objects into one shared library."""
    _run([[*compiler_command(), *compile_flags(isa, threading), "-o", str(output),
           *map(str, objects)]], objects)


def archive(objects: list[Path], output: Path) -> None:
    """A static library of compiled objects ($AR, default `ar`)."""
    _run([[*settings.current().ar, "rcs", str(output),
           *map(str, objects)]], objects)


# Compiler processes under way: background builds end them at exit (terminate_running).
_running: set[subprocess.Popen] = set()


def terminate_running() -> None:
    """Kills every compiler process this process started that is still running (their
    builds fail; the cache publishes only whole entries)."""
    for process in list(_running):
        with contextlib.suppress(OSError):
            process.kill()


def _run(commands: list[list[str]], sources: list[Path]) -> None:
    """Runs the commands at once; a CompileError with the first failure's output."""
    compiler_identity()  # a clear error if there is no compiler
    run_commands(commands, sources)


def run_commands(commands: list[list[str]], sources: list[Path]) -> None:
    """Runs compiler commands at once, each ended at exit while it runs
    (terminate_running); a CompileError naming `sources` with the first failure's
    output."""
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for command in commands]
    _running.update(running)
    try:
        results = [(command, *process.communicate(), process.returncode)
                   for command, process in zip(commands, running, strict=True)]
    finally:
        _running.difference_update(running)
    for command, _, stderr, returncode in results:
        if returncode != 0:
            raise CompileError(
                f"compiling {', '.join(map(str, sources))} failed ({shlex.join(command)}):\n"
                f"{stderr.strip()}")
