import sys, time
t0 = time.perf_counter()
import torch, copy
sys.path.insert(0, "/work/main/benchmarks")
from models import MODELS, classes
from train_step import make_step
name, th, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(th)
torch.manual_seed(0)
m = MODELS[name](classes=classes(name)).to(memory_format=torch.channels_last)
if which == "ours":
    import convgrad.torch as cgt
    cgt.convert(m)
x = torch.randn(8, 3, 112, 112).to(memory_format=torch.channels_last)
labels = torch.randint(0, classes(name), (8,))
step = make_step(m, x, labels)
ts = []
for i in range(12):
    t = time.perf_counter(); step(); ts.append((time.perf_counter() - t) * 1e3)
warm = sorted(ts[2:])[len(ts[2:]) // 2]
if len(sys.argv) > 4:
    import cProfile, pstats
print(f"{name} {which} {th}T first {ts[0]:.1f} second {ts[1]:.1f} warm {warm:.1f} ratio {ts[0]/warm:.2f}")
