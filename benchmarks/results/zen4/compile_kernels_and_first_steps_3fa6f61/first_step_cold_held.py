import sys, time, os, tempfile, cProfile, pstats
os.environ["CONVGRAD_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["CONVGRAD_BUILD_DELAY"] = "1000"
sys.path.insert(0, "/work/main/benchmarks")
import torch, copy
import convgrad.torch as cgt
import train_step as ts
name = sys.argv[1]; torch.set_num_threads(2)
shape = ts.input_shape(name, None, None, None)
fmt = torch.channels_last
torch.manual_seed(0)
ref = ts.MODELS[name](classes=ts.classes(name)).to(memory_format=fmt)
conv = copy.deepcopy(ref); cgt.convert(conv)
x = torch.randn(shape).contiguous(memory_format=fmt)
labels = torch.randint(0, ts.classes(name), (shape[0],))
st, so = ts.make_step(ref, x, labels), ts.make_step(conv, x, labels)
mode = sys.argv[2]
if mode == "torch":
    for i in range(4):
        t = time.perf_counter(); st(); print("torch step", i, round((time.perf_counter()-t)*1e3,1))
elif mode == "ours":
    for i in range(4):
        t = time.perf_counter(); so(); print("ours step", i, round((time.perf_counter()-t)*1e3,1))
else:
    pr = cProfile.Profile(); pr.enable(); so(); pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
if mode == "tprof":
    so(); so()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        so()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
    st(); st()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        st()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
