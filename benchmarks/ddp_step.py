"""Training steps under DistributedDataParallel: torch.nn against convgrad on N ranks.

Used by `python -m benchmarks.train_step --ddp N`. Each rank is a process
(torch.multiprocessing, gloo on loopback) with `threads` threads; both models start from
the same weights on every rank, each wrapped in DistributedDataParallel, and every rank
sees its own batch. The
ranks build convgrad's kernels at once (`compile_kernels`, one shared kernel cache),
then run the two models' steps in turn, in lockstep: blocks of steps of one model, a
barrier, blocks of the other, the same count on every rank. Rank 0 reports the median
step of each, and every rank the largest difference of the converted model's weights
against rank 0's after the steps (an SGD update follows each step: the ranks agree
when the all-reduced gradients do).
"""

from __future__ import annotations

import copy
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import convgrad.torch as cgt


@dataclass(frozen=True)
class Setting:
    """What every rank runs (picklable: sent to the spawned processes)."""

    model: str
    dtype: str
    threads: int
    ranks: int
    shape: tuple[int, ...]
    classes: int
    memory_format: str  # channels_last, channels_last_3d or contiguous
    autocast: str | None
    min_time: float
    warmup: int
    port: int
    options: tuple = ()  # (name, value) pairs for the model's constructor


@dataclass(frozen=True)
class Result:
    torch_ms: float
    torch_steps: int
    convgrad_ms: float
    convgrad_steps: int
    compile_kernels_s: float
    first_step_ms: float
    weights_spread: float  # largest |w_rank - w_rank0| of the converted model, all ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _format(name: str) -> torch.memory_format:
    return {"channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d,
            "contiguous": torch.contiguous_format}[name]


def _rank(rank: int, setting: Setting, results) -> None:
    """One rank's run; once it is done, the process ends without the interpreter's shutdown.

    gloo's worker threads drop each finished collective after its caller has gone on,
    and a work whose tensors still have Python objects takes the GIL in its destructor.
    During the interpreter's shutdown that thread exits inside a destructor and the rank
    aborts (SIGABRT, "terminate called without an active exception"; about 1 run in 10
    here). Everything is reported by then, so the rank leaves with os._exit.
    """
    _run_rank(rank, setting, results)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_rank(rank: int, setting: Setting, results) -> None:
    from benchmarks.models import MODELS
    from benchmarks.train_step import DTYPES, make_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(setting.port))
    dist.init_process_group("gloo", rank=rank, world_size=setting.ranks)
    try:
        torch.set_num_threads(setting.threads)
        fmt, dtype = _format(setting.memory_format), DTYPES[setting.dtype]
        torch.manual_seed(0)
        reference = MODELS[setting.model](classes=setting.classes, **dict(setting.options))
        reference = reference.to(dtype=dtype, memory_format=fmt)
        converted = copy.deepcopy(reference)
        cgt.convert(converted)
        generator = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(setting.shape, generator=generator).to(dtype=dtype, memory_format=fmt)
        labels = torch.randint(0, setting.classes, (setting.shape[0],), generator=generator)
        begin = time.perf_counter()
        cgt.compile_kernels(converted, x, progress=False)
        compile_s = time.perf_counter() - begin
        dist.barrier()
        models = [DistributedDataParallel(m) for m in (reference, converted)]
        optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]

        def stepper(i):
            step = make_step(models[i], x, labels, setting.autocast)

            def run():
                step()
                optimizers[i].step()
            return run

        steps = [stepper(0), stepper(1)]
        begin = time.perf_counter()
        steps[1]()
        first_ms = (time.perf_counter() - begin) * 1e3
        for _ in range(setting.warmup):
            for step in steps:
                step()
        # one timed step each sets the block size; rank 0's count holds for all ranks
        block = torch.zeros(1, dtype=torch.int64)
        probe = []
        for step in steps:
            begin = time.perf_counter()
            step()
            probe.append(time.perf_counter() - begin)
        block[0] = max(1, int(0.5 / max(probe)))
        rounds = torch.tensor([max(3, int(setting.min_time / (0.5 + sum(probe))))])
        dist.broadcast(block, 0)
        dist.broadcast(rounds, 0)
        seconds: list[list[float]] = [[], []]
        for _ in range(int(rounds[0])):
            for i, step in enumerate(steps):
                dist.barrier()
                for _ in range(int(block[0])):
                    begin = time.perf_counter()
                    step()
                    seconds[i].append(time.perf_counter() - begin)
        spread = torch.zeros(1, dtype=torch.float64)
        for p in converted.parameters():
            mine = p.detach().double()
            first = mine.clone()
            dist.broadcast(first, 0)
            spread = torch.maximum(spread, (mine - first).abs().max().reshape(1))
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put(Result(
                round(statistics.median(seconds[0]) * 1e3, 3), len(seconds[0]),
                round(statistics.median(seconds[1]) * 1e3, 3), len(seconds[1]),
                round(compile_s, 2), round(first_ms, 1), float(spread[0])))
    finally:
        dist.destroy_process_group()


def measure(setting: Setting) -> Result:
    """Runs `setting` on its ranks (spawned processes) and returns rank 0's result."""
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(setting, results), nprocs=setting.ranks, join=True,
                       start_method="spawn")
    return results.get()
