"""How many OpenMP threads a kernel call uses, and what survives `fork`.

GCC's OpenMP runtime (libgomp) keeps a pool of worker threads after the first
parallel region and cannot re-initialise it in a child made by `fork` (the
workers do not exist there), so the child's first parallel region waits forever.
LLVM's and Intel's runtimes (libomp, libiomp5) reset themselves in the child,
unless KMP_INIT_AT_FORK is false: scikit-learn and joblib set it so on import, and
then their children hang as libgomp's do. So when a process that ran kernels on
several threads forks and its kernels use libgomp, or libomp told not to reset,
the child (and its own children) run every kernel on one thread: correct results,
never a hang. Elsewhere, and in children forked before any parallel kernel ran,
the thread count is unchanged.
"""

from __future__ import annotations

import logging
import os

from convgrad import settings

log = logging.getLogger("convgrad")

# The count set_num_threads set; 0: the default (OMP_NUM_THREADS, else every usable core).
# Public so that what reads it on every call reads the attribute itself: bound's memo
# key, convgrad.torch's thread count and its C++ call path (torch_calls.cpp.j2, by
# name). Set it only through set_num_threads.
default_count = 0
_parallel_ran = False  # a kernel was called with more than one thread in this process
_single_after_fork = False  # forked after that, under libgomp: one thread from now on


def check(where: str, count) -> None:
    """A thread count must be a positive int (None: the default)."""
    if count is None:
        return
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"{where}num_threads = {count!r} is invalid; expected a positive "
                        "integer")
    if count < 1:
        raise ValueError(f"{where}num_threads = {count!r} is invalid; expected a positive "
                         "integer")


def set_num_threads(count: int | None) -> None:
    """Threads every kernel call uses unless the call says otherwise (None: default)."""
    global default_count
    check("", count)
    default_count = count or 0


def get_num_threads() -> int:
    """Threads a kernel call uses: set_num_threads' count, else OMP_NUM_THREADS, else the
    cores this process may run on (1 in a child forked after parallel kernels ran under
    libgomp)."""
    if _single_after_fork:
        return 1
    if default_count:
        return default_count
    return settings.current().omp_num_threads or _usable_cores()


def _usable_cores() -> int:
    """The cores of this process's affinity mask (what libgomp's default counts)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def for_call(requested: int | None) -> int:
    """The thread count to pass a kernel for a call that asked for `requested`: never 0
    (OpenMP's default), because that default is the calling thread's and may change (an
    omp_set_num_threads, torch.set_num_threads, another thread such as XLA's), while the
    call's workspace is sized once for the count it was bound with: a kernel run on more
    threads than its workspace holds would write past it."""
    global _parallel_ran
    count = 1 if _single_after_fork else requested or get_num_threads()
    if count > 1:
        _parallel_ran = True
    return count


def _runtime_cannot_restart() -> str | None:
    """The loaded OpenMP runtime that cannot restart its threads in a forked child, if
    any: libgomp always, LLVM's or Intel's when KMP_INIT_AT_FORK is false."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            libraries = maps.read()
    except OSError:
        return "an unknown OpenMP runtime"  # cannot tell: assume it cannot restart
    if "libgomp" in libraries:
        return "libgomp"
    kmp_reset = settings.current().kmp_init_at_fork
    if ("libomp" in libraries or "libiomp" in libraries) and kmp_reset.lower() in (
            "false", "0", "no", "off", ".false."):
        return "LLVM's OpenMP runtime with KMP_INIT_AT_FORK=" + kmp_reset
    return None


def _after_fork_in_child() -> None:
    global _single_after_fork
    if not _parallel_ran or _single_after_fork:
        return
    runtime = _runtime_cannot_restart()
    if runtime:
        _single_after_fork = True
        log.info("convgrad: forked after kernels ran on several threads; %s cannot restart "
                 "its threads here, so this process runs kernels on one thread", runtime)


os.register_at_fork(after_in_child=_after_fork_in_child)
