"""Empirical tuning: a layer's plan chosen by timing the planner's candidates on the
machine and at the sizes that run it, then kept and reused, never timed again.

Every kernel configuration has candidate plans (`convgrad.codegen.plan.candidates`:
the planner's rule choice first, then variations of tile shapes, vector blocks,
reduction chunks, loop orders, thread splits and algorithm variants). Every plan
computes the same result; they differ in speed, by machine and by layer size.

- `tune_problem` compiles every candidate (in parallel), times each at the layer's
  sizes and thread count (a warm-up, then interleaved rounds, medians) and returns a
  record of the winner with what it was measured on. The rules' plan stays unless a
  candidate beats it by more than NOISE, twice: in the rounds, then in back-to-back
  pairs of calls of the two (`confirm`).
- Records live in the kernel cache (`<cache>/tuned/`), one file per configuration.
  `plan_for` looks one up for a call (memoised in the process); with tuning on it
  tunes a missing one first.
- Tuning is opt-in: `CONVGRAD_TUNE=1` (or `tune=True` on a call) uses tuned plans and
  tunes what has none; `CONVGRAD_TUNE=reuse` (`tune="reuse"`) uses tuned plans and
  never times; unset or `0` runs the planner's rules, exactly as untuned.
- `export_plans` / `import_plans` move records between machines and builds (a small
  JSON file); `convgrad aot --tune` builds tuned kernels into an AOT library.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from filelock import FileLock

from convgrad import cache, kernels, settings
from convgrad.codegen import KernelConfig, Problem, generator_version
from convgrad.codegen.isa import ISA_FEATURES
from convgrad.codegen.plan import candidates, check_plan, kernel_name, plan_key
from convgrad.codegen.targets import host
from convgrad.cpu import cpu_features, cpu_model, cpu_vendor
from convgrad.threads import get_num_threads

log = logging.getLogger("convgrad")

ENV = "CONVGRAD_TUNE"
MODES = ("off", "on", "reuse")
NOISE = 0.02  # a candidate must beat the rules' plan by more than this to replace it
FILE_FORMAT = "convgrad-tuned-plans"

_memo: dict[tuple, dict | None] = {}
_memo_lock = threading.Lock()
# Candidates timed in this process (tests prove that a tuned plan is never re-timed).
timings_run = 0


def mode(tune: bool | str | None = None) -> str:
    """"off", "on" or "reuse", from a call's `tune` argument or else CONVGRAD_TUNE."""
    if tune is None:
        return settings.current().tune
    return settings.tune_mode(tune, f"tune={tune!r}")


def sizes_of(problem: Problem) -> dict:
    """The run-time sizes a plan was timed at (besides the thread count)."""
    return {"batch": problem.batch, "src": list(problem.src_spatial),
            "dst": list(problem.dst_spatial), "pads": list(problem.pads_begin)}


def machine() -> dict:
    """What a record was measured on: the CPU model (with family, model, stepping) and
    its microarchitecture as archspec names it."""
    return {"cpu": cpu_model(), "target": host(), "system": platform.machine()}


def _matches(record: dict, config: KernelConfig, sizes: dict, threads: int) -> bool:
    try:
        same_config = KernelConfig.from_dict(record["config"]) == config
    except (KeyError, TypeError, ValueError):
        return False
    return (same_config and record.get("sizes") == sizes and record.get("threads") == threads
            and record.get("machine", {}).get("cpu") == cpu_model())


def _store_file(config: KernelConfig) -> Path:
    return cache.cache_dir() / "tuned" / f"{config.name}.json"


def _read_records(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    records = data.get("records") if isinstance(data, dict) else None
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def _write_records(path: Path, records: list[dict]) -> None:
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps({"format": FILE_FORMAT, "records": records}, indent=1))
    os.replace(temporary, path)


def find(config: KernelConfig, sizes: dict, threads: int) -> dict | None:
    """The stored record of `config` at these sizes and threads on this CPU, if any."""
    for record in _read_records(_store_file(config)):
        if _matches(record, config, sizes, threads):
            return record
    return None


def store(records: Sequence[dict]) -> int:
    """Adds records to the cache's tuned plans (replacing any of the same configuration,
    sizes, threads and CPU); returns how many were stored."""
    by_config: dict[str, list[dict]] = {}
    for record in records:
        config = KernelConfig.from_dict(record["config"])
        check_plan(record["plan"])
        by_config.setdefault(config.name, []).append(record)
    for name, new in by_config.items():
        path = cache.cache_dir() / "tuned" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.with_suffix(".lock")):
            kept = [r for r in _read_records(path) if not any(
                r.get("sizes") == n["sizes"] and r.get("threads") == n["threads"]
                and r.get("machine", {}).get("cpu") == n["machine"].get("cpu") for n in new)]
            _write_records(path, kept + new)
    with _memo_lock:
        _memo.clear()
    return sum(len(new) for new in by_config.values())


def all_records() -> list[dict]:
    """Every record in the cache's tuned plans."""
    folder = cache.cache_dir() / "tuned"
    return [r for path in sorted(folder.glob("*.json")) for r in _read_records(path)]


def export_plans(path: str | os.PathLike, records: Sequence[dict] | None = None) -> int:
    """Writes tuned plans (default: every record in the cache) to a JSON file that a
    build can check in and ship; returns how many."""
    records = all_records() if records is None else list(records)
    _write_records(Path(path), records)
    return len(records)


def read_plans(path: str | os.PathLike) -> list[dict]:
    """The records of an exported tuned-plans file (ValueError if it is not one)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise ValueError(f"{path}: not a convgrad tuned-plans file (format {FILE_FORMAT})")
    records = _read_records(Path(path))
    for record in records:
        KernelConfig.from_dict(record["config"])
        check_plan(record["plan"])
    return records


def import_plans(path: str | os.PathLike) -> int:
    """Adds the records of an exported file to the cache's tuned plans."""
    return store(read_plans(path))


def reset() -> None:
    """Forgets the plans looked up in this process (tests; after changing the cache)."""
    with _memo_lock:
        _memo.clear()


def plan_for(problem: Problem, config: KernelConfig, threads: int, how: str,
             arrays: tuple[np.ndarray, np.ndarray]) -> dict | None:
    """The plan a call runs: None (the default kernel) when tuning is off or, with
    "reuse", nothing was tuned; else the stored plan, tuned first with "on"."""
    if how == "off":
        return None
    threads = threads or get_num_threads()
    key = (config, problem.batch, problem.src_spatial, problem.dst_spatial,
           problem.pads_begin, threads, how)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    record = find(config, sizes_of(problem), threads)
    if record is None and how == "on":
        record = tune_problem(problem, config, threads, arrays)
        store([record])
    plan = check_plan(record["plan"]) if record is not None else None
    with _memo_lock:
        _memo[key] = plan
    return plan


def random_inputs(shapes: Sequence[Sequence[int]], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Normal random data for an op's two data inputs (timing does not depend on it)."""
    from convgrad.api import DTYPE_BY_NAME

    rng = np.random.default_rng(0)
    first, second = (rng.standard_normal(tuple(s), dtype=np.float32).astype(
        DTYPE_BY_NAME[dtype]) for s in shapes[:2])
    return first, second


def tune_problem(problem: Problem, config: KernelConfig, threads: int,
                 arrays: tuple[np.ndarray, np.ndarray], *, min_time: float = 0.15,
                 rounds: int = 3, jobs: int | None = None,
                 plans: Sequence[dict] | None = None) -> dict:
    """Times the candidate plans of `config` at the problem's sizes on `threads`
    threads, on `arrays` (the op's two data inputs), and returns the winner's record."""
    if plans is None:  # this CPU's: without AMX where it has none (as the untuned kernel)
        plans = candidates(config, cpu_vendor(), cpu_features())
    compiled = compile_candidates([(config, plan) for plan in plans], jobs=jobs)
    return time_candidates(problem, config, threads, compiled, arrays,
                           min_time=min_time, rounds=rounds)


def compile_candidates(pairs: Sequence[tuple[KernelConfig, dict]], *, jobs: int | None = None,
                       progress: Callable[[], None] | None = None) -> list[kernels.Kernel]:
    """Compiles (or loads from the cache) each (config, plan), `jobs` at a time."""
    def load(pair: tuple[KernelConfig, dict]) -> kernels.Kernel:
        kernel = kernels.get_kernel(pair[0], pair[1])
        if progress:
            progress()
        return kernel

    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        return list(pool.map(load, pairs))


def confirm(problem: Problem, dims, rules: kernels.Kernel, challenger: kernels.Kernel,
            first: np.ndarray, second: np.ndarray, out: np.ndarray, workspace: np.ndarray,
            *, min_time: float, pairs: int = 5) -> float:
    """The median over back-to-back pairs of calls of challenger time / rules time: a
    second look at a winner, in which a drift of the machine's speed (other tenants,
    clocks) hits both plans of a pair alike."""
    both = (rules, challenger)
    ratios = []
    started = time.perf_counter()
    while len(ratios) < pairs or time.perf_counter() - started < min_time:
        seconds = [0.0, 0.0]
        for index in (1, 0) if len(ratios) % 2 == 0 else (0, 1):  # who goes first alternates
            begin = time.perf_counter()
            kernels.call(both[index], problem, dims, first, second, out, workspace)
            seconds[index] = time.perf_counter() - begin
        ratios.append(seconds[1] / seconds[0])
    return statistics.median(ratios)


def time_candidates(problem: Problem, config: KernelConfig, threads: int,
                    compiled: Sequence[kernels.Kernel],
                    arrays: tuple[np.ndarray, np.ndarray], *,
                    min_time: float = 0.15, rounds: int = 3) -> dict:
    """Times compiled candidates (the first is the rules' plan) one after the other in
    `rounds` interleaved rounds after a warm-up, on `arrays` (the op's data inputs);
    the record of the fastest, if `confirm` agrees that it beats the rules' plan."""
    global timings_run
    first, second = (arrays[1], arrays[0]) if problem.swap_inputs else arrays
    out = kernels.empty_output(problem.output_shape, first.dtype)
    dims = kernels.dims_of(problem, threads)
    workspace = np.empty(max(max(k.workspace_size(dims) for k in compiled), 1), dtype=np.uint8)
    samples: list[list[float]] = [[] for _ in compiled]
    for kernel in compiled:  # warm-up: pages, caches, OpenMP threads
        kernels.call(kernel, problem, dims, first, second, out, workspace)
    for _ in range(rounds):
        for kernel, times in zip(compiled, samples, strict=True):
            started = time.perf_counter()
            while len(times) < 2 or time.perf_counter() - started < min_time / rounds:
                begin = time.perf_counter()
                kernels.call(kernel, problem, dims, first, second, out, workspace)
                times.append(time.perf_counter() - begin)
    timings_run += len(compiled)
    medians = [statistics.median(t) for t in samples]
    best = min(range(len(compiled)), key=medians.__getitem__)
    confirmed = None
    if medians[best] * (1 + NOISE) <= medians[0]:
        confirmed = confirm(problem, dims, compiled[0], compiled[best], first, second, out,
                            workspace, min_time=min_time)
    if confirmed is None or confirmed * (1 + NOISE) > 1.0:
        best = 0  # not clearly faster than the rules' plan: keep it
    log.info("%s: tuned at batch %d, %d threads: %s (%.3f ms, rules %.3f ms)", config.name,
             problem.batch, threads, kernel_name(config, compiled[best].plan),
             medians[best] * 1e3, medians[0] * 1e3)
    return {
        "config": config.to_dict(),
        "sizes": sizes_of(problem),
        "threads": threads,
        "plan": dict(compiled[best].plan),
        "machine": {**machine(), "isa": config.isa,
                    "features": sorted(ISA_FEATURES[config.isa])},
        "seconds": {plan_key(k.plan) or "rules": m for k, m in zip(compiled, medians,
                                                                     strict=True)},
        "plans": {plan_key(k.plan) or "rules": dict(k.plan) for k in compiled},
        "rules_seconds": medians[0],
        "tuned_seconds": medians[best],
        "confirmed_ratio": confirmed,
        "generator": generator_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
