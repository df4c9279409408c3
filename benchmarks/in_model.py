"""Where a converted model's training step goes: convgrad's kernels (timed around each
`BoundCall.run`) and the Python around them, against torch.nn's convolutions in the same
model (torch.profiler, by weight shape).

    python -m benchmarks.in_model MODEL [--threads 2] [--steps 10] [--batch N] [--size N]
        [--width N] [--blocks 1,1,1,1]

Prints per step: the converted model's median step, its kernels' time by (op, kind of
convolution: 1x1, depthwise, other), the time spent in convgrad.torch's `execute` around
the kernels (memo look-up, result allocation, pointers), and torch.nn's convolution time
by (aten op, kind). Batch 8, 112x112 unless --batch and --size say otherwise,
channels_last, f32; CONVGRAD_ISA and ONEDNN_MAX_CPU_ISA choose the paths.

The calls take convgrad.torch's Python path (CONVGRAD_TORCH_NATIVE=off, set before
convgrad is imported: run this in a process of its own): its C++ path, on by default since
this was first recorded (zen4/mobilenet_v2_in_model_2943a6d), calls the kernels without
either of the two functions timed here.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time

from benchmarks.models import MODELS, add_size_options, check_size_options, classes, input_shape


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.in_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=list(MODELS))
    parser.add_argument("threads", type=int, nargs="?", default=2, help="default 2")
    parser.add_argument("steps", type=int, nargs="?", default=10, help="default 10")
    add_size_options(parser)  # --batch, --size, --width, --blocks
    args = parser.parse_args(argv)
    if args.threads < 1 or args.steps < 1:
        parser.error("threads and steps must be positive")
    check_size_options(parser, args)
    return args


def kind(config_name: str) -> str:
    return "dw" if "_g1_" not in config_name else "1x1" if "k1x1" in config_name else "kxk"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["CONVGRAD_TORCH_NATIVE"] = "off"  # the Python path, whose calls are timed

    import torch
    from torch.profiler import profile

    import convgrad.torch as cgt
    from benchmarks.train_step import make_step, model_options
    from convgrad import bound
    from convgrad.torch import ops

    name, threads, steps = args.model, args.threads, args.steps
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    shape = input_shape(name, args.batch, args.size, None)
    memory_format = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    model = MODELS[name](classes=classes(name), **model_options(name, args))
    model = model.to(memory_format=memory_format)
    ours = copy.deepcopy(model)
    cgt.convert(ours)
    cgt.set_compile_mode("block")
    x = torch.randn(shape).contiguous(memory_format=memory_format)
    labels = torch.randint(0, classes(name), (shape[0],))
    step_torch, step_ours = make_step(model, x, labels), make_step(ours, x, labels)
    for _ in range(3):
        step_torch()
        step_ours()

    kernels: dict = collections.defaultdict(float)
    outside = [0.0]
    run, execute = bound.BoundCall.run, ops.execute

    def timed_run(self, a, b, out):
        begin = time.perf_counter()
        run(self, a, b, out)
        spent = time.perf_counter() - begin
        kernels[(self.problem.op.kind, kind(self.config.name))] += spent
        outside[0] -= spent

    def timed_execute(*call_args):
        begin = time.perf_counter()
        result = execute(*call_args)
        outside[0] += time.perf_counter() - begin
        return result

    bound.BoundCall.run, ops.execute = timed_run, timed_execute
    seconds = []
    try:
        for _ in range(steps):
            begin = time.perf_counter()
            step_ours()
            seconds.append(time.perf_counter() - begin)
    finally:
        bound.BoundCall.run, ops.execute = run, execute
    print(f"{name}, {threads} thread(s): convgrad step "
          f"{statistics.median(seconds) * 1e3:.1f} ms (median of {steps})")
    print(f"  kernels {sum(kernels.values()) / steps * 1e3:.2f} ms a step; execute() around "
          f"them {outside[0] / steps * 1e3:.2f} ms")
    for key, value in sorted(kernels.items()):
        print(f"    {key[0]:28s} {key[1]:4s} {value / steps * 1e3:6.2f} ms")

    theirs: dict = collections.defaultdict(float)
    seconds = []
    with profile(record_shapes=True) as prof:
        for _ in range(steps):
            begin = time.perf_counter()
            step_torch()
            seconds.append(time.perf_counter() - begin)
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in ("aten::mkldnn_convolution", "aten::convolution_backward"):
            continue
        weight = event.input_shapes[2 if event.key == "aten::convolution_backward" else 1]
        depthwise = len(weight) >= 4 and weight[1] == 1 and weight[2] > 1
        pointwise = len(weight) >= 4 and all(k == 1 for k in weight[2:])
        theirs[(event.key, "dw" if depthwise else "1x1" if pointwise else "kxk")] += (
            event.cpu_time_total / steps / 1e3)
    print(f"torch.nn step {statistics.median(seconds) * 1e3:.1f} ms under the profiler; "
          f"convolutions {sum(theirs.values()):.2f} ms a step")
    for key, value in sorted(theirs.items()):
        print(f"    {key[0]:28s} {key[1]:4s} {value:6.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
