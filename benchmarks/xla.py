"""What the JAX benchmarks (jax_ops, jax_train_step) share: a worker process per thread
count, with XLA's CPU client sized for it, their options and records, and a summary of
the optimized HLO a function compiled to.

XLA's CPU client sizes its intra-op (Eigen) thread pool once, when it is created, from
the environment variable PJRT_NPROC (else NPROC, else every CPU this process may run
on), so a script runs itself once per thread count (`run_workers`: `--worker FILE`,
PJRT_NPROC=n); convgrad's threads come from convgrad.set_num_threads(n), read when a
function is traced (`start_worker`). Imports jax only inside the workers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import convgrad
from benchmarks.machine import jax_machine_info, pin
from benchmarks.shapes import ROOT
from benchmarks.timing import int_list

# --------------------------------------------------------------------------- processes


def thread_env(threads: int) -> dict[str, str]:
    """What a process needs in its environment to run XLA's CPU client on `threads`
    threads (read once, when jax creates the client)."""
    return {"PJRT_NPROC": str(threads)}


def check_thread_env(threads: int) -> None:
    """Refuses to run a worker whose XLA would not run on `threads` threads."""
    given = os.environ.get("PJRT_NPROC")
    if given != str(threads):
        raise SystemExit(f"worker for {threads} thread(s) started with PJRT_NPROC={given!r}; "
                         "run the script without --worker")
    if "jax" in sys.modules and _backend_started():
        raise SystemExit("jax's CPU client was created before PJRT_NPROC was set")


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """--threads, --pin, --keep-cache, --aot and the hidden --worker FILE."""
    parser.add_argument("--threads", type=int_list, default=[1, 2],
                        help="comma-separated thread counts, one process each (default 1,2)")
    parser.add_argument("--pin", action="store_true",
                        help="run each thread count's process on that many CPUs only "
                             "(sched_setaffinity, as taskset does)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the usual kernel cache instead of a new temporary one")
    parser.add_argument("--aot", action="store_true",
                        help="let convgrad use ahead-of-time kernels (ignored by default)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def kernel_environment(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict:
    """The workers' convgrad settings: no AOT kernels unless --aot, a new kernel cache
    (shared by the thread counts' processes) unless --keep-cache."""
    env = {} if args.aot else {"CONVGRAD_AOT_PATH": ""}
    if not args.keep_cache:
        env["CONVGRAD_CACHE_DIR"] = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="convgrad-jax-bench-cache-"))
    return env


def run_workers(module: str, argv: Sequence[str], args: argparse.Namespace
                ) -> list[dict] | None:
    """Runs `python -m module argv --threads n --worker FILE` once per thread count of
    --threads, each in a process with XLA's thread count set, convgrad's kernel settings
    (`kernel_environment`) and the repository's root on PYTHONPATH (so that the
    benchmarks package imports from any folder); the JSON each wrote, None if one
    failed."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    results = []
    with contextlib.ExitStack() as stack:
        env = kernel_environment(args, stack)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="convgrad-jax-bench-"))
        for count in args.threads:
            out = Path(tmp) / f"worker_{count}.json"
            command = [sys.executable, "-m", module, *argv, "--threads", str(count),
                       "--worker", str(out)]
            status = subprocess.run(command, env={**os.environ, **env, **thread_env(count),
                                         "PYTHONPATH": path},
                                    check=False).returncode
            if status != 0 or not out.is_file():
                print(f"the {count}-thread run failed (exit status {status})", file=sys.stderr)
                return None
            results.append(json.loads(out.read_text()))
    return results


def rows_of(results: Sequence[dict], row_type: type) -> list:
    """The rows of every worker's JSON (run_workers'), as `row_type`."""
    return [row_type(**r) for result in results for r in result["rows"]]


def machine_line(machine: dict) -> str:
    """The first line of a report: the CPU, jax and convgrad of a worker's machine."""
    return (f"{machine['cpu']}, {machine['logical_cpus']} logical CPUs; jax {machine['jax']}, "
            f"convgrad {machine['convgrad_generator']} ({machine['isa']})")


def start_worker(args: argparse.Namespace) -> int:
    """In a worker: checks XLA's thread count, pins with --pin, gives convgrad as many
    threads (before any trace: the kernels' calls keep it); the thread count."""
    if len(args.threads) != 1:
        raise SystemExit("--worker runs one thread count")
    threads = args.threads[0]
    check_thread_env(threads)
    if args.pin:
        pin(threads)
    convgrad.set_num_threads(threads)
    return threads


def thread_info(threads: int) -> dict:
    """How many threads each library was given in this worker."""
    return {"threads": threads, "pjrt_nproc": os.environ.get("PJRT_NPROC"),
            "convgrad_threads": convgrad.get_num_threads(),
            "cpus_allowed": len(os.sched_getaffinity(0))}


def finish_worker(args: argparse.Namespace, rows: Sequence, **record) -> int:
    """Writes a worker's JSON for run_workers: the machine, the threads, `record`, the
    rows (dataclasses)."""
    Path(args.worker).write_text(json.dumps(
        {"machine": jax_machine_info(), "threads": thread_info(args.threads[0]), **record,
         "rows": [asdict(r) for r in rows]}))
    return 0


# --------------------------------------------------------------------------- HLO

def hlo_summary(compiled) -> dict:
    """What the optimized HLO runs: convgrad's custom calls and XLA's convolutions
    anywhere (inside fusions too), and the entry computation's fusions by kind and
    convolutions left unfused (XLA's runtime, Eigen, runs those)."""
    text = compiled.as_text()
    entry = text[text.find("\nENTRY"):]
    summary = {"convgrad_calls": entry.count('custom_call_target="convgrad_conv"'),
               "convolutions": len(re.findall(r"= \S+ convolution\(", text)),
               "ops": {}}
    for line in entry.splitlines():
        if " fusion(" in line:
            kind = re.search(r'"kind":"(\w+)"', line) or re.search(r"kind=k(\w+)", line)
            name = kind.group(1).strip("_").lower() if kind else "fusion"
            name = name if name.endswith("fusion") else f"{name} fusion"
        elif re.search(r"= \S+ convolution\(", line):
            name = "convolution"
        else:
            continue
        summary["ops"][name] = summary["ops"].get(name, 0) + 1
    return summary


def hlo_text(summary: dict) -> str:
    parts = [f"{count} {name}" for name, count in sorted(summary["ops"].items())]
    if summary["convgrad_calls"]:
        parts.insert(0, f"{summary['convgrad_calls']} convgrad")
    return ", ".join(parts)
