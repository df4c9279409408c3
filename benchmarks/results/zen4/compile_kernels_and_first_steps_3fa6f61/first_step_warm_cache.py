import sys, time, os, cProfile, pstats
sys.path.insert(0, "/work/main/benchmarks")
import torch, copy
import convgrad.torch as cgt
import train_step as ts
name = sys.argv[1]; torch.set_num_threads(2)
cgt.set_compile_mode("block")
shape = ts.input_shape(name, None, None, None)
fmt = torch.channels_last
torch.manual_seed(0)
ref = ts.MODELS[name](classes=ts.classes(name)).to(memory_format=fmt)
conv = copy.deepcopy(ref); cgt.convert(conv)
x = torch.randn(shape).contiguous(memory_format=fmt)
labels = torch.randint(0, ts.classes(name), (shape[0],))
st, so = ts.make_step(ref, x, labels), ts.make_step(conv, x, labels)
mode = sys.argv[2]
if mode == "prof":
    pr = cProfile.Profile(); pr.enable(); so(); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
else:
    s = st if mode == "torch" else so
    for i in range(4):
        t = time.perf_counter(); s(); print(mode, i, round((time.perf_counter()-t)*1e3,1))
