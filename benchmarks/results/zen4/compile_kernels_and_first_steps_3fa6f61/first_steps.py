"""The measurements of this record, in a new process each (run from the repository's root
folder; it imports benchmarks/train_step.py):

    python first_steps.py compile MODEL          # compile_kernels in a new kernel cache
    python first_steps.py warm MODEL torch|ours  # steps 0-3, kernels in the cache (block)
    python first_steps.py held MODEL torch|ours  # steps 0-3, a new cache, builds held

2 threads, batch 8, 112x112, channels_last, f32.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

mode, name = sys.argv[1], sys.argv[2]
if mode in ("compile", "held"):  # a new kernel cache, before convgrad is imported
    os.environ["CONVGRAD_CACHE_DIR"] = tempfile.mkdtemp()
if mode == "held":  # every convolution stays on PyTorch's stand-in
    os.environ["CONVGRAD_BUILD_DELAY"] = "1000"

import torch  # noqa: E402

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import train_step as ts  # noqa: E402

import convgrad.torch as cgt  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
shape = ts.input_shape(name, None, None, None)
model = ts.MODELS[name](classes=ts.classes(name)).to(memory_format=torch.channels_last)
x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
if mode == "compile":
    cgt.convert(model)
    begin = time.perf_counter()
    built = cgt.compile_kernels(model, x, progress=False)
    print(name, built, "kernels", round(time.perf_counter() - begin, 1), "s",
          "CONVGRAD_BUILD_JOBS =", os.environ.get("CONVGRAD_BUILD_JOBS"))
    sys.exit()
which = sys.argv[3]
if which == "ours":
    cgt.convert(model)
    if mode == "warm":
        cgt.set_compile_mode("block")
step = ts.make_step(model, x, torch.randint(0, ts.classes(name), (shape[0],)))
for i in range(4):
    begin = time.perf_counter()
    step()
    print(which, "step", i, round((time.perf_counter() - begin) * 1e3, 1), "ms")
