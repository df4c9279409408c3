"""Timing shared by the benchmarks: calls of two or more libraries in turns, geometric
means, and the thread-count option's parser. Needs neither PyTorch nor jax."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence


def timed_calls(functions: Sequence[Callable[[], object]], min_time: float,
                min_repeats: int = 3, block_time: float = 0.05) -> list[list[float]]:
    """The seconds of each timed call of each function, until each ran `min_repeats`
    timed calls and `min_time` seconds in total.

    The functions take turns in blocks of calls (so a change of machine load hits all
    alike), and the first call of a block is not counted: PyTorch bundles its own
    OpenMP runtime, whose idle threads spin for a while after each call and would slow
    down the first call of the other library on a 2-core machine (and ours do the
    same to PyTorch). One function alone runs in blocks too."""
    times: list[list[float]] = [[] for _ in functions]
    while True:
        pending = [i for i, t in enumerate(times) if len(t) < min_repeats or sum(t) < min_time]
        if not pending:
            return times
        for i in pending:
            block_start, calls = time.perf_counter(), 0
            while calls < 2 or time.perf_counter() - block_start < block_time:
                begin = time.perf_counter()
                functions[i]()
                if calls:
                    times[i].append(time.perf_counter() - begin)
                calls += 1


def timed_pair(functions: Sequence[Callable[[], object]], min_time: float,
               min_repeats: int = 3, block_time: float = 0.05) -> list[tuple[float, int]]:
    """(median seconds, calls) of each function, timed in turns by `timed_calls`."""
    return [(statistics.median(t), len(t))
            for t in timed_calls(functions, min_time, min_repeats, block_time)]


def median_present(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (None if none is)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,2")
    return values
