"""The first training steps of a model in a new process, torch.nn's or the model converted
to convgrad, with nothing run before them: what a user's script sees when it starts.

    python -m benchmarks.first_steps MODEL [--which torch|ours] [--threads 2] [--steps 12]
        [--cache warm|new|held] [--compile-kernels] [--block] [--batch N] [--size N]
        [--width N] [--blocks 1,1,1,1]

MODEL is one of benchmarks.models' (batch 8, 112x112 unless --batch and --size say
otherwise; --width and --blocks shape resnet18 as in benchmarks.train_step), channels_last,
f32, torch.set_num_threads(--threads). --cache warm (the default) uses the usual kernel
cache, `new` a new, empty one, `held` a new one with every build held back
(CONVGRAD_BUILD_DELAY=1000: every convolution stays on PyTorch's stand-in); the
environment is set before convgrad is imported, so run this in a process of its own.
--compile-kernels times convgrad.torch.compile_kernels first (--steps 0: only that);
--block makes the converted model's first calls wait for their kernels
(set_compile_mode("block")) instead of compiling in the background.

Prints each step's milliseconds, then (from 3 steps) the first, the second and the median
of the later steps ("warm"), and first / warm.

This replaces the scripts of three records (their commands stay in their README files):
first_step.py (sapphirerapids/first_step_new_process_b9c8591: --steps 12),
first_steps.py (zen4/compile_kernels_and_first_steps_3fa6f61: compile = --which ours
--cache new --compile-kernels --steps 0; warm = --block --steps 4; held = --cache held
--steps 4) and first_step_warm.py (zen4/first_step_warm_cache_ff8e595: ck =
--compile-kernels --steps 4, none = --steps 4).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from benchmarks.models import MODELS, add_size_options, check_size_options, classes, input_shape


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_steps",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=list(MODELS))
    parser.add_argument("--which", default="ours", choices=["torch", "ours"],
                        help="torch.nn's model or the converted one (default ours)")
    parser.add_argument("--threads", type=int, default=2, help="default 2")
    parser.add_argument("--steps", type=int, default=12, help="steps timed (default 12)")
    parser.add_argument("--cache", default="warm", choices=["warm", "new", "held"])
    parser.add_argument("--compile-kernels", action="store_true",
                        help="time convgrad.torch.compile_kernels before the steps")
    parser.add_argument("--block", action="store_true",
                        help="the converted model's calls wait for their kernels")
    add_size_options(parser)  # --batch, --size, --width, --blocks
    args = parser.parse_args(argv)
    if args.which == "torch" and (args.compile_kernels or args.block or args.cache != "warm"):
        parser.error("--compile-kernels, --block and --cache are for --which ours")
    if args.threads < 1 or args.steps < 0:
        parser.error("--threads must be positive, --steps not negative")
    check_size_options(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cache in ("new", "held"):  # before convgrad is imported
        os.environ["CONVGRAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="convgrad-first-steps-")
    if args.cache == "held":
        os.environ["CONVGRAD_BUILD_DELAY"] = "1000"

    import torch

    import convgrad.torch as cgt
    from benchmarks.train_step import make_step, model_options

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    name = args.model
    shape = input_shape(name, args.batch, args.size, None)
    memory_format = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    model = MODELS[name](classes=classes(name), **model_options(name, args))
    model = model.to(memory_format=memory_format)
    x = torch.randn(shape).contiguous(memory_format=memory_format)
    if args.which == "ours":
        cgt.convert(model)
        if args.block:
            cgt.set_compile_mode("block")
        if args.compile_kernels:
            begin = time.perf_counter()
            built = cgt.compile_kernels(model, x, progress=False)
            print(f"compile_kernels: {built} kernels in "
                  f"{(time.perf_counter() - begin) * 1e3:.1f} ms (CONVGRAD_BUILD_JOBS = "
                  f"{os.environ.get('CONVGRAD_BUILD_JOBS')})", flush=True)
    step = make_step(model, x, torch.randint(0, classes(name), (shape[0],)))
    times = []
    for number in range(args.steps):
        begin = time.perf_counter()
        step()
        times.append((time.perf_counter() - begin) * 1e3)
        print(f"{args.which} step {number} {times[-1]:.1f} ms", flush=True)
    if len(times) >= 3:
        warm = sorted(times[2:])[len(times[2:]) // 2]  # the upper median, as recorded
        print(f"{name} {args.which} {args.threads}T first {times[0]:.1f} second "
              f"{times[1]:.1f} warm {warm:.1f} ratio {times[0] / warm:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
