import sys, time, os, tempfile
os.environ["CONVGRAD_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, "/work/main/benchmarks")
import torch
import convgrad.torch as cgt
import train_step as ts
name = sys.argv[1]; torch.set_num_threads(2)
shape = ts.input_shape(name, None, None, None)
fmt = torch.channels_last
torch.manual_seed(0)
m = ts.MODELS[name](classes=ts.classes(name)).to(memory_format=fmt)
cgt.convert(m)
x = torch.randn(shape).contiguous(memory_format=fmt)
t = time.perf_counter()
n = cgt.compile_kernels(m, x, progress=False)
print(name, n, "kernels", round(time.perf_counter() - t, 1), "s", os.environ.get("CONVGRAD_BUILD_JOBS"))
