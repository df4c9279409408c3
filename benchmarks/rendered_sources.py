"""Digests of the C that convgrad renders for the benchmark sets: the check that a
refactoring of the planner or the templates leaves the generated kernels as they were.

    python -m benchmarks.rendered_sources --out before.json   # on the old code
    python -m benchmarks.rendered_sources --out after.json --compare before.json

Every forward convolution of every set of benchmarks.shapes (those whose shape files
are present) gives its four gradient ops' kernels (data, weights, forward,
transposed weights) in NXC and NCX, f32, bf16 and f16, on the avx512bf16, avx512 and
avx2 paths (each kernel's own path, as the runtime narrows it), with every plan the
tuner would time for an AMD and an Intel CPU (the rules' plan first). Each distinct
kernel (configuration and plan) maps to the SHA-256 of its C. --compare prints the
kernels whose C differs and those only one side renders, and exits 1 if any.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from benchmarks.shapes import DEFAULT_SHAPES_DIR, SETS, load_set
from convgrad.codegen import render
from convgrad.codegen.layers import conv_layers
from convgrad.codegen.plan import candidates, kernel_name

OPS = ("ConvolutionBackwardData", "ConvolutionBackwardWeights", "ConvTransposeBackwardData",
       "ConvTransposeBackwardWeights")
ISAS = ("avx512bf16", "avx512", "avx2")
VENDORS = ("AuthenticAMD", "GenuineIntel")


def digests(shapes_dir: Path) -> dict[str, str]:
    configs = set()
    for name in SETS:
        for conv in load_set(name, shapes_dir, None) or []:
            for dtype in ("f32", "bf16", "f16"):
                for data_format in ("NXC", "NCX"):
                    for layer in conv_layers(conv, OPS, batch=1, dtype=dtype,
                                             data_format=data_format):
                        config = layer.resolve().config
                        for isa in ISAS:
                            configs.add(config.with_isa(isa))
    found: dict[str, str] = {}
    for config in sorted(configs, key=lambda c: c.name):
        for vendor in VENDORS:
            for plan in candidates(config, vendor):
                key = kernel_name(config, plan)
                if key not in found:
                    found[key] = hashlib.sha256(render(config, plan).encode()).hexdigest()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--compare", type=Path, help="an earlier run's JSON file")
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR)
    args = parser.parse_args()
    started = time.perf_counter()
    found = digests(args.shapes_dir)
    args.out.write_text(json.dumps(found, indent=0, sort_keys=True))
    print(f"{len(found)} kernels rendered in {time.perf_counter() - started:.0f} s")
    if not args.compare:
        return 0
    before = json.loads(args.compare.read_text())
    changed = sorted(k for k in found.keys() & before.keys() if found[k] != before[k])
    for title, names in (("differ", changed), ("only before", sorted(before.keys() - found)),
                         ("only after", sorted(found.keys() - before.keys()))):
        print(f"{len(names)} {title}" + "".join(f"\n  {n}" for n in names[:40]))
    return 1 if changed or before.keys() != found.keys() else 0


if __name__ == "__main__":
    sys.exit(main())
