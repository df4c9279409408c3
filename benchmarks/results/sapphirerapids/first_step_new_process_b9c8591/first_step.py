"""One new process's training steps: python first_step.py MODEL THREADS torch|ours.

Prints the first step, the second and the median of steps 3-12 (ms), and first / warm.
Run from the repository's root folder (it imports benchmarks/models.py).
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
from models import MODELS, classes  # noqa: E402
from train_step import make_step  # noqa: E402

name, threads, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
torch.manual_seed(0)
model = MODELS[name](classes=classes(name)).to(memory_format=torch.channels_last)
if which == "ours":
    import convgrad.torch as cgt

    cgt.convert(model)
x = torch.randn(8, 3, 112, 112).to(memory_format=torch.channels_last)
labels = torch.randint(0, classes(name), (8,))
step = make_step(model, x, labels)
times = []
for _ in range(12):
    begin = time.perf_counter()
    step()
    times.append((time.perf_counter() - begin) * 1e3)
warm = sorted(times[2:])[len(times[2:]) // 2]
print(f"{name} {which} {threads}T first {times[0]:.1f} second {times[1]:.1f} "
      f"warm {warm:.1f} ratio {times[0] / warm:.2f}")
