"""bench.py's fixed costs: one call on a tiny problem (both libraries) and a fresh
process's load of a kernel that is in the disk cache."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

import convgrad
from benchmarks.cases import prepare
from benchmarks.shapes import ROOT, TINY
from benchmarks.tensors import torch
from convgrad.aot import median_seconds
from convgrad.codegen import KernelConfig
from convgrad.cpu import selected_isa


def measure_call_overhead(args: argparse.Namespace, calls: int = 2000
                          ) -> tuple[dict, KernelConfig]:
    """Median microseconds of one call on a tiny problem (1 thread), both libraries,
    and the KernelConfig of convgrad's kernel for it."""
    tiny_args = argparse.Namespace(**{**vars(args), "batch": 1, "no_torch": False})
    case = prepare(TINY, "data", "overhead", tiny_args, np.random.default_rng(1))
    convgrad.set_num_threads(1)
    torch.set_num_threads(1)
    ours = case.ours
    result = {}
    for name, call in (("ours", lambda: ours(1)), ("torch", case.torch_call)):
        seconds = median_seconds(call, calls, warmups=50)
        result[f"{name}_tiny_call_us"] = round(seconds * 1e6, 2)
    result["tiny_problem"] = (f"ConvolutionBackwardData 1x1, N=1, 4x4, 16->16 channels, "
                              f"{args.dtype} {args.data_format}, 1 thread")
    config = case.layer.resolve().config.with_isa(selected_isa())
    return result, config


_LOAD_SNIPPET = """
import json, sys, time
from convgrad.codegen import KernelConfig
from convgrad import kernels
config = KernelConfig.from_dict(json.loads(sys.argv[1]))
begin = time.perf_counter()
kernel = kernels.get_kernel(config)
print(json.dumps({"ms": (time.perf_counter() - begin) * 1e3, "origin": kernel.origin}))
"""


def measure_cached_load(config: KernelConfig, processes: int = 3) -> dict:
    """Milliseconds for a fresh process to get a kernel that is in the disk cache
    (cache key, compiler identity, digest check, dlopen), median of `processes`
    processes."""
    env = dict(os.environ)
    samples, origin = [], ""
    for _ in range(processes):
        out = subprocess.run([sys.executable, "-c", _LOAD_SNIPPET,
                              json.dumps(config.to_dict())], capture_output=True, text=True,
                             check=True, env=env, cwd=ROOT).stdout
        record = json.loads(out.strip().splitlines()[-1])
        samples.append(record["ms"])
        origin = record["origin"]
    return {"cached_load_ms": round(statistics.median(samples), 2),
            "cached_load_origin": origin}
