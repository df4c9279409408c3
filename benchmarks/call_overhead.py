"""What a tiny cached call costs: convgrad's call path against PyTorch's, in one process.

    python -m benchmarks.call_overhead [--channels 8] [--size 4] [--threads 1]
                                       [--repeats 7] [--calls 2000] [--out DIR]

The problem is a 1x1 convolution of one 8-channel 4x4 image (batch 1): the kernel's own
work is a few hundred multiply-adds, so each figure is the call path. Rows:

- numpy API: `convgrad.conv_transpose_backward_data` (the forward convolution) on
  numpy arrays, against `torch.nn.functional.conv2d` on tensors;
- forward: a converted `nn.Conv2d` (convgrad.torch) against torch.nn's, in grad mode;
- forward+backward: the module's output summed and back-propagated (data and weight
  gradients), against torch.nn's.

convgrad.torch's repeat calls run on its C++ call path where that is built (it is built
first here, as compile_kernels does); CONVGRAD_TORCH_NATIVE=off times the Python path.
The table's header says which path ran.

Each figure is the median over --repeats blocks of --calls calls (after a warm-up),
the libraries taking turns block by block. Results also go to results.json in --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import convgrad
import convgrad.torch as cgt
from convgrad.cpu import cpu_model, selected_isa
from convgrad.torch import warmup

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "call_overhead"


def per_call_us(functions: list[Callable[[], object]], calls: int, repeats: int
                ) -> list[float]:
    """Median microseconds a call of each function, blocks of `calls` taking turns."""
    for function in functions:
        for _ in range(max(calls // 10, 10)):
            function()
    times: list[list[float]] = [[] for _ in functions]
    for _ in range(repeats):
        for index, function in enumerate(functions):
            begin = time.perf_counter()
            for _ in range(calls):
                function()
            times[index].append((time.perf_counter() - begin) / calls * 1e6)
    return [statistics.median(t) for t in times]


def measure(channels: int, size: int, calls: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, size, size, channels), dtype=np.float32)  # NXC
    w = rng.standard_normal((1, 1, channels, channels), dtype=np.float32)  # XOI
    xt = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    wt = torch.from_numpy(np.ascontiguousarray(w.transpose(3, 2, 0, 1)))
    theirs = torch.nn.Conv2d(channels, channels, 1, bias=False)
    ours = torch.nn.Conv2d(channels, channels, 1, bias=False)
    ours.load_state_dict(theirs.state_dict())
    cgt.convert(ours)
    grad_x = xt.clone().requires_grad_()
    # the kernels of a step, built first (with a new cache, PyTorch's operator would
    # serve the timed calls while they compile in the background)
    cgt.compile_kernels(ours, grad_x)
    served = warmup.standin_calls()

    def step(module):
        def run():
            module(grad_x).sum().backward()
        return run

    rows = []
    for name, (mine, other) in {
        "numpy API vs F.conv2d": (lambda: convgrad.conv_transpose_backward_data(x, w),
                                  lambda: F.conv2d(xt, wt)),
        "convgrad.torch forward vs torch.nn": (lambda: ours(xt), lambda: theirs(xt)),
        "convgrad.torch forward+backward vs torch.nn": (step(ours), step(theirs)),
    }.items():
        a, b = per_call_us([mine, other], calls, repeats)
        rows.append({"call": name, "convgrad_us": round(a, 2), "torch_us": round(b, 2),
                     "ratio": round(a / b, 2)})
    if warmup.standin_calls() != served:
        raise SystemExit("PyTorch's operator served some of convgrad.torch's calls")
    return rows


def call_path() -> str:
    """Which of convgrad.torch's call paths served the timed calls."""
    return "C++" if warmup.native_kernel_runs() else "Python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.call_overhead",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=int, default=8, help="default 8")
    parser.add_argument("--size", type=int, default=4, help="image side (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="default 1")
    parser.add_argument("--calls", type=int, default=2000, help="calls a block (default 2000)")
    parser.add_argument("--repeats", type=int, default=7, help="blocks (default 7)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if min(args.channels, args.size, args.threads, args.calls, args.repeats) < 1:
        parser.error("every value must be positive")
    torch.set_num_threads(args.threads)
    convgrad.set_num_threads(args.threads)
    rows = measure(args.channels, args.size, args.calls, args.repeats)
    print(f"Tiny cached call: 1x1 conv, {args.channels} channels, {args.size}x{args.size}, "
          f"batch 1, f32, {args.threads} thread(s); {cpu_model()}, convgrad ISA path "
          f"{selected_isa()}, torch {torch.__version__}, convgrad.torch's {call_path()} "
          "call path")
    width = max(len(r["call"]) for r in rows)
    print(f"{'call':<{width}}{'convgrad us':>13}{'torch us':>10}{'ratio':>8}")
    for r in rows:
        print(f"{r['call']:<{width}}{r['convgrad_us']:>13.1f}{r['torch_us']:>10.1f}"
              f"{r['ratio']:>8.2f}")
    print("ratio = convgrad us / torch us (below 1: convgrad's call is cheaper)")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.call_overhead " + " ".join(
        sys.argv[1:] if argv is None else argv)
    (args.out / "results.json").write_text(json.dumps({
        "command": command,
        "machine": {"cpu": cpu_model(), "isa": selected_isa(), "torch": torch.__version__,
                    "python": platform.python_version(), "call_path": call_path(),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows}, indent=2) + "\n")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
