"""Two builds of the same kernels, timed in one process on the same arrays.

    python -m benchmarks.ab_builds [--set resnet50|mobilenet_v2|... | --shapes-file FILE]
                                   [--layers a,b]
                                   [--ops fwd,data,weights] [--threads 1] [--data-format NCX]
                                   [--dtype f32|bf16|f16]
                                   [--base-python PYTHON] [--base-env NAME=VALUE ...]
                                   [--reps 15] [--seconds 0.15]

For each layer of the set (names matched as bench.py --layers does) and op, the call
runs through convgrad.execute on this checkout's kernel ("ours", built into a new
cache as this process's settings say). The same configuration and plan is then built by
--base-python (another checkout's virtual environment; default this interpreter) into
a cache of its own, with --base-env added to its environment ("theirs"). The two
libraries take turns in the call's bound kernel, `--reps` times `--seconds` each,
alternating which goes first. Prints each layer's median times and the speed ratio
(theirs' time / ours: above 1, ours is faster), then their geometric mean.

Why: on a shared machine two processes minutes apart differ by up to 10%, more than
most kernel changes; interleaved in one process, that drift cancels (an A/A run reads
0.99-1.01). Examples: this checkout against the last commit's worktree
(`--base-python /tmp/base/.venv/bin/python`); a build in two parts against a whole one
(`--base-env CONVGRAD_BUILD_JOBS=1`, this process with CONVGRAD_BUILD_JOBS=2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from benchmarks.cases import layer_inputs
from benchmarks.shapes import DEFAULT_SHAPES_DIR, DTYPES, OPS, SETS, load_file, load_set
from convgrad import api, bound, kernels
from convgrad.codegen.layers import conv_layers

BUILD = """
import json, sys
from convgrad import cache
from convgrad.codegen import KernelConfig
config = KernelConfig.from_dict(json.loads(sys.argv[1]))
print(cache.build(config, json.loads(sys.argv[2]))[0])
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", default="resnet50", choices=sorted(SETS))
    parser.add_argument("--layers", default="", help="comma-separated parts of layer names")
    parser.add_argument("--ops", default="fwd", help="comma-separated, as bench.py --ops")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"])
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("--base-python", default=sys.executable)
    parser.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.15)
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR)
    parser.add_argument("--shapes-file", type=Path, default=None,
                        help="the layers of a benchdnn file of one's own instead of --set's")
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.base_env):
        parser.error("--base-env takes NAME=VALUE")
    if args.shapes_file is not None and not args.shapes_file.is_file():
        parser.error(f"--shapes-file {args.shapes_file}: no such file")
    return args


def build_base(kernel: kernels.Kernel, args: argparse.Namespace, folder: str) -> Path:
    """The library of `kernel`'s configuration and plan as --base-python builds it."""
    env = {**os.environ, "CONVGRAD_CACHE_DIR": folder,
           **dict(item.split("=", 1) for item in args.base_env)}
    done = subprocess.run([args.base_python, "-c", BUILD, json.dumps(kernel.config.to_dict()),
                           json.dumps(kernel.plan)], capture_output=True, text=True,
                          env=env, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [name for name in args.layers.split(",") if name]
    if args.shapes_file is not None:
        args.set = str(args.shapes_file)
        convs = load_file(args.shapes_file, None, names)
    else:
        convs = load_set(args.set, args.shapes_dir, None, names)
    if not convs:
        print(f"no layer of {args.set} matches {args.layers!r}")
        return 1
    rng = np.random.default_rng(0)
    ratios = []
    # both builds in new caches of their own, compiled when asked for (not in the background)
    with tempfile.TemporaryDirectory(prefix="convgrad-ab-") as folder, mock.patch.dict(
            os.environ, {"CONVGRAD_CACHE_DIR": str(Path(folder) / "ours"),
                         "CONVGRAD_COMPILE": "block"}):
        base_cache = str(Path(folder) / "theirs")
        for conv in convs:
            for op in args.ops.split(","):
                (layer,) = conv_layers(conv, (OPS[op],), batch=args.batch,
                                       dtype=args.dtype, data_format=args.data_format)
                inputs = layer_inputs(layer, rng, api.DTYPE_BY_NAME[args.dtype])

                def run(layer=layer, inputs=inputs):
                    return api.execute(layer.op, inputs, layer.attrs,
                                       num_threads=args.threads)

                bound.reset()
                run()
                [call] = bound.bound_calls()
                ours = call.kernel
                path = build_base(ours, args, base_cache)
                theirs = kernels.Kernel(ours.config, *kernels.kernel_functions(ours.name, path),
                                        "cache", path, ours.plan)
                times: dict[str, list[float]] = {"ours": [], "theirs": []}
                order = [("ours", ours), ("theirs", theirs)]
                for rep in range(args.reps):
                    for tag, kernel in order if rep % 2 else order[::-1]:
                        # each build's own workspace: the two may need different sizes
                        call.kernel = kernel
                        call.workspace_bytes = kernel.workspace_size(call.dims)
                        run()
                        begin, count = time.perf_counter(), 0
                        while time.perf_counter() - begin < args.seconds:
                            run()
                            count += 1
                        times[tag].append((time.perf_counter() - begin) / count)
                call.kernel = ours
                call.workspace_bytes = ours.workspace_size(call.dims)
                mine, base = (statistics.median(times[tag]) for tag in ("ours", "theirs"))
                ratios.append(base / mine)
                print(f"{conv.name:28s} {op:7s} {args.threads}T ours {mine * 1e3:8.3f} ms "
                      f"theirs {base * 1e3:8.3f} ms  speed ours/theirs {base / mine:.3f}",
                      flush=True)
    print("geomean speed ours/theirs",
          round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
