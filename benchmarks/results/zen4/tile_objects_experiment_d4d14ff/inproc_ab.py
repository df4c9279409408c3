"""Two builds of the same kernels timed in one process, on the same arrays.

    python inproc_ab.py THREADS OPS LAYERS BASE_PYTHON

Runs each ResNet-50 layer (names matched as bench.py --layers does; OPS as bench.py
--ops) through convgrad.execute with this checkout's kernel, builds the same
configuration and plan with the interpreter BASE_PYTHON (another checkout's virtual
environment) into a cache of its own, and swaps the two libraries into the call's
bound kernel, alternating, 15 times 0.15 s each. Prints each layer's median times and
the speed ratio (this checkout / the other), then their geometric mean. One process
and interleaved runs: the machine's drift between processes minutes apart (±10% here)
cancels out.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import bench  # noqa: E402

from convgrad import api, bound, kernels  # noqa: E402
from convgrad.codegen.layers import conv_layers  # noqa: E402

BUILD = """
import json, sys
from convgrad import cache
from convgrad.codegen import KernelConfig
config = KernelConfig.from_dict(json.loads(sys.argv[1]))
print(cache.build(config, json.loads(sys.argv[2]))[0])
"""


def main() -> None:
    threads, ops, names, base_python = (int(sys.argv[1]), sys.argv[2].split(","),
                                        sys.argv[3].split(","), sys.argv[4])
    rng = np.random.default_rng(0)
    ratios = []
    with tempfile.TemporaryDirectory() as base_cache:
        for conv in bench.load_set("resnet50", bench.DEFAULT_SHAPES_DIR, None, names):
            for op in ops:
                (layer,) = conv_layers(conv, (bench.OPS[op],), batch=8)
                a, b = (bench._aligned(rng.standard_normal(s, dtype=np.float32))
                        for s in layer.inputs[:2])
                inputs = [a, b, *([list(layer.inputs[2])] if len(layer.inputs) > 2 else [])]

                def run(layer=layer, inputs=inputs):
                    return api.execute(layer.op, inputs, layer.attrs, num_threads=threads)

                bound._calls.clear()
                run()
                [call] = list(bound._calls.values())
                ours = call.kernel
                path = Path(subprocess.run(
                    [base_python, "-c", BUILD, json.dumps(ours.config.to_dict()),
                     json.dumps(ours.plan)], capture_output=True, text=True, check=True,
                    env={**os.environ, "CONVGRAD_CACHE_DIR": base_cache}).stdout.strip())
                theirs = kernels.Kernel(ours.config, *kernels._bind(ours.name, path),
                                        "cache", path, ours.plan)
                times: dict[str, list[float]] = {"ours": [], "theirs": []}
                for rep in range(15):
                    order = [("ours", ours), ("theirs", theirs)]
                    for tag, kernel in order if rep % 2 else order[::-1]:
                        call.kernel = kernel
                        run()
                        begin, count = time.perf_counter(), 0
                        while time.perf_counter() - begin < 0.15:
                            run()
                            count += 1
                        times[tag].append((time.perf_counter() - begin) / count)
                call.kernel = ours
                mine, base = (statistics.median(times[t]) for t in ("ours", "theirs"))
                ratios.append(base / mine)
                print(f"{conv.name:28s} {op:5s} {threads}T ours {mine * 1e3:7.3f} ms "
                      f"theirs {base * 1e3:7.3f} ms  speed ours/theirs {base / mine:.3f}",
                      flush=True)
    print("geomean speed ours/theirs",
          round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3))


if __name__ == "__main__":
    main()
