"""Kernels compiled in the background while something else serves their calls.

`convgrad.torch` runs a call whose kernel is not ready (not loaded, not in an AOT
folder, not in the disk cache) on PyTorch's own operator and asks for the kernel here:
the requests wait until none came for CONVGRAD_BUILD_DELAY seconds (the pass that made
them is over), then a few daemon threads take them in order and load each kernel
(rendering and compiling it into the disk cache, in a compiler process of its own).
Later calls find it loaded and run it. The mode is CONVGRAD_COMPILE: `background`
(convgrad.torch's default) or `block` (compile before the call returns, as the numpy
API always does; for benchmarks and AOT builds); `convgrad.torch.set_compile_mode`
overrides it.

Faults stay with the build: a kernel that fails to compile (no compiler, an error, a
full disk) is logged once as a warning and its calls keep the stand-in. The threads
are daemons, so exit never waits for a build (a compiler process already running
finishes on its own; the cache publishes only whole entries). A child made by fork
has no threads of its parent: its requests start new ones.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterable

from convgrad import compiler, settings

log = logging.getLogger("convgrad")

MODES = settings.COMPILE_MODES
ENV = "CONVGRAD_COMPILE"
_override: str | None = None


def set_mode(mode: str | None) -> None:
    """Sets the compile mode of convgrad.torch's calls ("background" or "block"); None
    returns to CONVGRAD_COMPILE (default background)."""
    global _override
    if mode is not None and mode not in MODES:
        raise ValueError(f"compile mode {mode!r} is invalid; expected one of {list(MODES)}")
    _override = mode


def mode() -> str:
    """The compile mode in force: set_mode's, else CONVGRAD_COMPILE's, else background."""
    if _override is not None:
        return _override
    return settings.current().compile_mode


def workers() -> int:
    """Build threads: the cores this process may use (each runs one compiler)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Builds wait for a quiet spell. A model's first pass asks for its kernels one layer
# after another while it runs on the stand-ins; compilers started at once take the
# cores from that pass (on 2 cores, a step's two OpenMP threads wait for each other
# behind a compiler: on Sapphire Rapids ResNet-18's first step took 3.2 s, its warm
# torch.nn step 0.14 s). Requests are held until none came for CONVGRAD_BUILD_DELAY
# seconds (the pass is over: the next one asks for nothing new; a request for a kernel
# already asked for while they are held, by a call of another shape, does not count),
# then all start together, at most MAX_HOLD seconds after the first; wait()
# (compile_kernels) starts them at once. 0 starts each at once. Each hold starts afresh:
# a second model in one process, or a new kernel cache, asks again for kernels that the
# first asked for, and its pass is held as the first one was (a process that trained
# ResNet-18 and then ResNet-50 on a new cache started ResNet-50's builds within its first
# step, which took 5.8 s instead of 0.7 s: Zen 4, 2 threads).
DELAY_ENV = "CONVGRAD_BUILD_DELAY"
# 1 s: the largest gap between requests for new kernels within a first step, on the
# stand-ins, was 0.28 s (R3D-18; ResNet-50 0.06, MobileNetV2 0.01: Zen 4, 2 threads); with
# 0.5 s a noisy machine's slower first step let the builds start within it now and then
# (R3D-18's first step 2.45 s in one of three runs, 0.72-0.86 s in the others).
DEFAULT_DELAY = settings.DEFAULT_BUILD_DELAY
# Held requests start at most this many seconds after the first of them, whatever comes
# after (a program whose inputs change shape asks for new kernels on and on).
MAX_HOLD = 10.0


def build_delay() -> float:
    """Seconds without a new request before held builds start (CONVGRAD_BUILD_DELAY)."""
    return settings.current().build_delay


class _Pool:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        self.quiet = threading.Condition(self.lock)
        self.pending: set = set()
        self.threads: list[threading.Thread] = []
        self.held: list = []  # requests waiting for a quiet spell
        self.held_since = 0.0  # monotonic time of the first of them
        self.quiet_at = 0.0  # monotonic time at which they start
        self.seen: set = set()  # kernel configurations asked for while these are held
        self.timer: threading.Thread | None = None

    def submit(self, call) -> None:
        delay = build_delay()
        with self.lock:
            if call in self.pending:
                return
            self.pending.add(call)
            if delay <= 0:
                self._start(call)
                return
            now = time.monotonic()
            if not self.held:  # a new hold: a pass (of another model, another cache) begins
                self.held_since = now
                self.seen.clear()  # so its first request sets quiet_at below
            self.held.append(call)
            if call.config not in self.seen:  # a new kernel: the pass goes on
                self.seen.add(call.config)
                self.quiet_at = min(now + delay, self.held_since + MAX_HOLD)
            if self.timer is None:
                self.timer = threading.Thread(target=self._start_when_quiet,
                                              name="convgrad-build-delay", daemon=True)
                try:
                    self.timer.start()
                except RuntimeError:  # no thread now (exit, a limit): start them at once
                    self.timer = None
                    self._start_held()

    def release(self) -> None:
        """Starts the held requests now."""
        with self.lock:
            self._start_held()

    def _start_held(self) -> None:
        """Queues every held request (the lock held)."""
        held, self.held = self.held, []
        for call in held:
            self._start(call)
        self.quiet.notify_all()

    def _start_when_quiet(self) -> None:
        with self.lock:
            try:
                while self.held and (left := self.quiet_at - time.monotonic()) > 0:
                    self.quiet.wait(left)
                self._start_held()
            finally:
                self.timer = None

    def _start(self, call) -> None:
        """Queues `call` for the build threads (the lock held)."""
        if len(self.threads) < workers():
            thread = threading.Thread(target=self._work, name="convgrad-build", daemon=True)
            thread.start()
            self.threads.append(thread)
        self.queue.put(call)

    def _work(self) -> None:
        while True:
            call = self.queue.get()
            try:
                if not call.tunes:  # tuning times plans here, in this process
                    _build_elsewhere(call.config, call.build_plan(),
                                     busy=len(self.pending) > 1)
                call.load()  # from the disk cache, which the build filled
            except Exception as error:  # noqa: BLE001 - reported; the stand-in stays
                _failed(call, error)
            finally:
                with self.lock:
                    self.pending.discard(call)
                    self.done.notify_all()


# Rendering a kernel is Python: in a thread of this process it would hold the GIL for
# ~0.1 s a kernel, which a training step's Python then waits for (a ResNet-50's first
# step took 8 s with its 68 kernels rendering beside it). So each build thread has a
# worker process of its own (convgrad.build_worker: a plain `python -m`, which neither
# forks this process's threads nor imports the user's program, as multiprocessing's
# spawn would), told the settings that decide what it builds and where.
_workers = threading.local()  # each build thread's worker process
_all_workers: set[subprocess.Popen] = set()


class BuildError(RuntimeError):
    """A worker process could not build a kernel (its error, or its death)."""


def _worker() -> subprocess.Popen:
    process = getattr(_workers, "process", None)
    if process is None or process.poll() is not None:
        _all_workers.discard(process)
        process = subprocess.Popen([sys.executable, "-m", "convgrad.build_worker"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True)
        _workers.process = process
        _all_workers.add(process)
    return process


def _build_elsewhere(config, plan=None, busy: bool = False) -> None:
    """Builds `config`'s kernel of `plan` (None: the rules') into the disk cache in this
    thread's worker process;
    `busy` (other requests are pending, building or queued): as one compilation, unless
    CONVGRAD_BUILD_JOBS says otherwise. Two parts at once make one kernel sooner, but
    cost ~20% more CPU time, which builds that already fill the cores pay:
    compile_kernels of ResNet-50 (68 kernels, Zen 4, 2 cores) took 22.4-28.3 s in two
    parts a kernel, 17.5-22.0 s with CONVGRAD_BUILD_JOBS=1 and 20.5-20.8 s by this rule
    (a noisy shared VM; the first build of a pool has no other pending)."""
    process = _worker()
    environment = settings.current().environment()
    if busy and not (environment["CONVGRAD_BUILD_JOBS"] or "").strip():
        environment["CONVGRAD_BUILD_JOBS"] = "1"
    request = {"config": config.to_dict(), "plan": plan, "settings": environment}
    try:
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
    except OSError as error:
        line = ""
        cause = error
    else:
        cause = None
    if not line:
        _all_workers.discard(process)
        process.kill()
        raise BuildError(f"the build worker process ended (exit status {process.wait()})"
                         ) from cause
    answer = json.loads(line)
    if "error" in answer:
        raise BuildError(answer["error"])


_pool: _Pool | None = None
_pool_lock = threading.Lock()
_warned: set[str] = set()
_stopping = False
failures: dict[str, str] = {}  # kernel name -> why its build failed


def _failed(call, error: BaseException) -> None:
    call.failed = True
    if _stopping:  # the compilers were ended at exit
        return
    name = call.config.name
    failures[name] = f"{type(error).__name__}: {error}"
    if name not in _warned:
        _warned.add(name)
        message = (f"convgrad: building kernel {name} in the background failed "
                   f"({failures[name]}); its calls keep running on PyTorch's operator")
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=1)


def submit(call) -> None:
    """Asks for `call`'s kernel (a convgrad.bound.BoundCall) to be loaded in the
    background, once."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool()
    _pool.submit(call)


def pending() -> int:
    """Requested kernels not loaded yet."""
    pool = _pool
    return len(pool.pending) if pool is not None else 0


def wait(calls: Iterable, progress: bool = False, timeout: float | None = None) -> bool:
    """Blocks until each of `calls` has its kernel loaded or failed (True), or `timeout`
    seconds passed (False); a rich progress bar on the terminal with `progress`."""
    calls = list(calls)
    for call in calls:
        if call.kernel is None and not call.failed:
            submit(call)
    pool = _pool
    if pool is not None:
        pool.release()  # asked for: no quiet spell to wait for
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> int:
        return sum(call.kernel is None and not call.failed for call in calls)

    bar = None
    if progress and calls:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("convgrad: compiling kernels", total=len(calls))
    try:
        while (remaining := left()) and pool is not None:
            if bar is not None:
                bar.update(task, completed=len(calls) - remaining)
            with pool.lock:
                pool.done.wait(timeout=0.25)
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True
    finally:
        if bar is not None:
            bar.stop()


def _forget_after_fork() -> None:
    """The parent's build threads, locks and worker processes are not this child's."""
    global _pool, _pool_lock, _workers
    _pool, _pool_lock = None, threading.Lock()
    _workers = threading.local()
    _all_workers.clear()


def _stop() -> None:
    """At exit: the build threads are daemons; the worker processes (and their
    compilers) are ended, queued builds dropped."""
    global _stopping
    _stopping = True
    compiler.terminate_running()
    for process in list(_all_workers):
        with contextlib.suppress(OSError):
            process.kill()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_stop)
