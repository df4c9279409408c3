"""convgrad.torch under DistributedDataParallel: two gloo ranks on loopback, one new kernel
cache shared by both, compile_kernels on both at once. The ranks end with equal weights,
equal to a single process's run over both ranks' batches, and each kernel was compiled
once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

RANK = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    import convgrad.torch as cgt
    rank, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.ReLU(),
                          nn.Conv2d(8, 4, 1)).to(memory_format=torch.channels_last)
    cgt.convert(model)
    x = torch.randint(-2, 3, (4, 3, 8, 8)).float().contiguous(memory_format=torch.channels_last)
    mine = x[2 * rank:2 * rank + 2]
    built = cgt.compile_kernels(model, mine, progress=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.25)
    for _ in range(2):
        optimizer.zero_grad()
        ddp(mine).square().sum().backward()
        optimizer.step()
    with open(out, "w") as f:
        json.dump({"weights": [p.detach().flatten().tolist() for p in model.parameters()],
                   "built": built}, f)
    dist.destroy_process_group()
    # gloo's workers may still drop finished all-reduces whose tensors have Python
    # objects; in the interpreter's shutdown that aborts the rank now and then (a torch
    # teardown race, see benchmarks/ddp_step.py), so the rank skips the shutdown
    os._exit(0)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_agree_and_share_one_cache(tmp_path):
    import torch
    from torch import nn

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "CONVGRAD_CACHE_DIR": str(tmp_path / "cache"), "CONVGRAD_COMPILE": "background",
           "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, out in enumerate(outs)]
    for process in ranks:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
    results = [json.loads(out.read_text()) for out in outs]
    assert results[0]["weights"] == results[1]["weights"]
    # both ranks asked for the step's kernels (3 layers: forward, data and weight
    # gradients, the first layer's data gradient not needed); each is in the shared
    # cache once, complete (its record written last), nothing left half-built
    assert results[0]["built"] == results[1]["built"] >= 5
    cache = tmp_path / "cache"
    libraries = sorted(p.name for p in cache.rglob("convgrad_*.so"))  # kernels only
    assert len(libraries) == len(set(libraries)) == results[0]["built"]
    assert all(p.with_suffix(".json").is_file() for p in cache.rglob("convgrad_*.so"))
    assert not list(cache.rglob(".build-*"))
    # a single process over both batches (the mean of the ranks' gradients) agrees
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.ReLU(),
                          nn.Conv2d(8, 4, 1)).to(memory_format=torch.channels_last)
    x = torch.randint(-2, 3, (4, 3, 8, 8)).float().contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    for _ in range(2):
        optimizer.zero_grad()
        (model(x[:2]).square().sum() + model(x[2:]).square().sum()).mul(0.5).backward()
        optimizer.step()
    for got, expected in zip(results[0]["weights"], model.parameters(), strict=True):
        torch.testing.assert_close(torch.tensor(got), expected.detach().flatten(),
                                   rtol=1e-4, atol=1e-4)
