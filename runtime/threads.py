"""How many OpenMP threads a kernel call uses, and what survives `fork`.

GCC's OpenMP runtime (libgomp) keeps a pool of worker threads after the first
parallel region and cannot re-initialise it in a child made by `fork` (the
workers do not exist there), so the child's first parallel region waits forever.
LLVM's and Intel's runtimes reset themselves in the child. So when a process
that ran kernels on several threads forks and its kernels use libgomp, the child
(and its own children) run every kernel on one thread: correct results, never a
hang. Elsewhere, and in children forked before any parallel kernel ran, the
thread count is unchanged.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("convgrad")

_default = 0  # set_num_threads; 0: OpenMP's default (OMP_NUM_THREADS, else every core)
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
    global _default
    check("", count)
    _default = count or 0


def get_num_threads() -> int:
    """Threads a kernel call uses (OpenMP's default resolved; 1 in a child forked
    after parallel kernels ran under libgomp)."""
    if _single_after_fork:
        return 1
    if _default:
        return _default
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
    return int(env) if env.isdigit() and int(env) > 0 else (os.cpu_count() or 1)


def for_call(requested: int | None) -> int:
    """The thread count to pass a kernel for a call that asked for `requested`
    (0 lets the kernel take OpenMP's default)."""
    global _parallel_ran
    if _single_after_fork:
        return 1
    count = requested or _default
    if not _parallel_ran and (count or get_num_threads()) > 1:
        _parallel_ran = True
    return count


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return True  # cannot tell: assume the runtime that cannot re-initialise


def _after_fork_in_child() -> None:
    global _single_after_fork
    if _parallel_ran and not _single_after_fork and _libgomp_loaded():
        _single_after_fork = True
        log.info("convgrad: forked after kernels ran on several threads; libgomp cannot "
                 "restart its threads here, so this process runs kernels on one thread")


os.register_at_fork(after_in_child=_after_fork_in_child)
