"""A new process, kernels in the cache (run from the repository root): the first four
training steps of MODEL, converted, with (`ck`) or without (`none`) a
cgt.compile_kernels call first. 2 threads, batch 8, 112x112, channels_last, f32.

    python first_step_warm.py MODEL ck|none
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import train_step as ts  # noqa: E402

import convgrad.torch as cgt  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
name, mode = sys.argv[1], sys.argv[2]
shape = ts.input_shape(name, None, None, None)
model = ts.MODELS[name](classes=ts.classes(name)).to(memory_format=torch.channels_last)
x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
cgt.convert(model)
if mode == "ck":
    begin = time.perf_counter()
    built = cgt.compile_kernels(model, x, progress=False)
    print("compile_kernels", built, round((time.perf_counter() - begin) * 1e3, 1), "ms")
step = ts.make_step(model, x, torch.randint(0, ts.classes(name), (shape[0],)))
times = []
for _ in range(4):
    begin = time.perf_counter()
    step()
    times.append(round((time.perf_counter() - begin) * 1e3, 1))
print(mode, "steps", times)
