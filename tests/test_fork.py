"""Kernel calls in processes forked after the parent ran kernels on several threads.

libgomp (GCC's OpenMP runtime) cannot restart its worker threads in a forked child,
so such a child runs kernels on one thread (convgrad.threads); LLVM's libomp (kernels
built by clang) restarts them, so its children keep their threads, unless
KMP_INIT_AT_FORK is false (scikit-learn sets it so). Either way a child must never
hang and its results must be exact. CI installs clang and libomp."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import faulthandler, multiprocessing, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    import convgrad
    from cases import make_case

    def case(op, seed):  # enough work for two threads (kernel.c.j2's MIN_THREAD_FLOPS)
        return make_case(op, spatial=(24, 20), kernel=(3, 3), in_channels=16, out_channels=32,
                         attrs=dict(pads_begin=1, strides=1), seed=seed)

    parent = case("ConvolutionBackwardWeights", 1)
    fresh = case("ConvolutionBackwardData", 2)  # first loaded in the children
    if {parallel_first}:
        convgrad.execute(parent.op, parent.inputs, parent.attrs, num_threads=2)

    def child(queue, threads):
        faulthandler.dump_traceback_later(50, exit=True)  # a hung child shows where
        results = [np.array_equal(convgrad.execute(c.op, c.inputs, c.attrs, num_threads=threads),
                                  c.expected(np.float32)) for c in (parent, fresh)]
        queue.put((all(results), convgrad.get_num_threads()))

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    children = [context.Process(target=child, args=(queue, t), daemon=True)  # killed at exit
                for t in (None, 2, None)]
    for process in children:
        process.start()
    outcomes = [queue.get(timeout=60) for _ in children]  # a hung child fails here
    for process in children:
        process.join(10)
    print(outcomes, [p.exitcode for p in children], convgrad.get_num_threads())
""")


def _run(tmp_path, parallel_first: bool, compiler: str = "cc", **extra: str) -> str:
    script = SCRIPT.format(tests=str(ROOT / "tests"), parallel_first=parallel_first)
    env = {"OMP_NUM_THREADS": "2", "CONVGRAD_AOT_PATH": "", "CC": compiler,
           "CONVGRAD_CACHE_DIR": str(ROOT / ".pytest_cache" / "convgrad-kernels"), **extra}
    # scikit-learn and joblib set KMP_INIT_AT_FORK=FALSE in os.environ when imported
    inherited = {k: v for k, v in os.environ.items() if k != "KMP_INIT_AT_FORK"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=tmp_path, timeout=180, env={**inherited, **env})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_children_forked_after_parallel_kernels_are_exact_on_one_thread(tmp_path):
    # gcc's libgomp. Without the fork handler each child waits forever for lost workers.
    outcomes = _run(tmp_path, parallel_first=True)
    print("children forked after a 2-thread call used 1 thread each:", outcomes)
    assert outcomes == "[(True, 1), (True, 1), (True, 1)] [0, 0, 0] 2"


@pytest.mark.skipif(shutil.which("clang") is None, reason="needs clang and libomp-dev")
def test_children_run_on_one_thread_when_llvm_openmp_is_told_not_to_reset(tmp_path):
    # KMP_INIT_AT_FORK=FALSE (as scikit-learn and joblib set it): libomp's children hang
    # in their first parallel region as libgomp's do, so they run kernels on one thread.
    outcomes = _run(tmp_path, parallel_first=True, compiler="clang", KMP_INIT_AT_FORK="FALSE")
    assert outcomes == "[(True, 1), (True, 1), (True, 1)] [0, 0, 0] 2"


@pytest.mark.skipif(shutil.which("clang") is None, reason="needs clang and libomp-dev")
def test_children_keep_their_threads_under_llvm_openmp(tmp_path):
    outcomes = _run(tmp_path, parallel_first=True, compiler="clang")
    print("children of a process that ran clang/libomp kernels on 2 threads used 2:", outcomes)
    assert outcomes == "[(True, 2), (True, 2), (True, 2)] [0, 0, 0] 2"


def test_children_forked_before_any_parallel_kernel_keep_their_threads(tmp_path):
    outcomes = _run(tmp_path, parallel_first=False)
    print("children forked before any parallel call used 2 threads each:", outcomes)
    assert outcomes == "[(True, 2), (True, 2), (True, 2)] [0, 0, 0] 2"
