"""Where a converted model's training step goes: convgrad's kernels (timed around each
`BoundCall.run`) and the Python around them, against torch.nn's convolutions in the same
model (torch.profiler, by weight shape). Run from the repository's root folder:

    python in_model.py MODEL THREADS [STEPS]   # e.g. mobilenet_v2 2 10

Prints per step: the converted model's median step, its kernels' time by (op, kind of
convolution: 1x1, depthwise, other), the time spent in convgrad's `execute` around the
kernels, and torch.nn's convolution time by (aten op, kind). Batch 8, 112x112,
channels_last, f32; CONVGRAD_ISA and ONEDNN_MAX_CPU_ISA choose the paths.
"""

import collections
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import train_step as ts  # noqa: E402

import convgrad.torch as cgt  # noqa: E402
from convgrad import bound  # noqa: E402
from convgrad.torch import _calls, ops  # noqa: E402

name, threads = sys.argv[1], int(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
torch.set_num_threads(threads)
torch.manual_seed(0)
shape = ts.input_shape(name, None, None, None)
model = ts.MODELS[name](classes=ts.classes(name)).to(memory_format=torch.channels_last)
ours = copy.deepcopy(model)
cgt.convert(ours)
cgt.set_compile_mode("block")
x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
labels = torch.randint(0, ts.classes(name), (shape[0],))
step_torch, step_ours = ts.make_step(model, x, labels), ts.make_step(ours, x, labels)
for _ in range(3):
    step_torch()
    step_ours()


def kind(config_name: str) -> str:
    return "dw" if "_g1_" not in config_name else "1x1" if "k1x1" in config_name else "kxk"


kernels: dict = collections.defaultdict(float)
outside = [0.0]
run, execute = bound.BoundCall.run, _calls.execute


def timed_run(self, a, b, out):
    begin = time.perf_counter()
    run(self, a, b, out)
    spent = time.perf_counter() - begin
    kernels[(self.problem.op.kind, kind(self.config.name))] += spent
    outside[0] -= spent


def timed_execute(*args):
    begin = time.perf_counter()
    result = execute(*args)
    outside[0] += time.perf_counter() - begin
    return result


bound.BoundCall.run, ops.execute = timed_run, timed_execute
seconds = []
for _ in range(steps):
    begin = time.perf_counter()
    step_ours()
    seconds.append(time.perf_counter() - begin)
bound.BoundCall.run, ops.execute = run, execute
print(f"{name}, {threads} thread(s): convgrad step {statistics.median(seconds) * 1e3:.1f} ms "
      f"(median of {steps})")
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
