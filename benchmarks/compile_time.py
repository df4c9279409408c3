"""Compile time of a layer list's kernels, with and without the precompiled prelude.

    python -m benchmarks.compile_time [LAYER_FILES...] [--data-format NXC|NCX]
                                      [--isa avx512|avx2|...] [--modes plain,pch,parts,cache]

Renders every kernel of the layers (default: the built-in ResNet-50 list, as
`convgrad aot` reads it) and compiles each one, kernel after kernel, once per mode:
`plain` parses the headers as text, `pch` loads the precompiled prelude of a private
cache folder (built first), both compiling the kernel's C whole, as `convgrad aot`
does; `parts` also compiles a kernel of two parts (data kernels, weight kernels from
row segments) as two objects at once (a lazy build with CONVGRAD_BUILD_JOBS=2, the
default on two cores or more). `cache` is a lazy build on one core
(CONVGRAD_BUILD_JOBS=1), rendering included, in a new cache folder of its own with its
precompiled prelude: what a first call waits for on one core. Prints the median,
least, most and total seconds per kernel family; run it on an otherwise idle machine.
A kernel's first call adds loading and one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from convgrad import cache, pch
from convgrad.aot import kernels_of, read_layers
from convgrad.codegen import render
from convgrad.codegen.plan import compile_parts
from convgrad.compiler import compile_objects
from convgrad.cpu import selected_isa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layers", nargs="*", type=Path)
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"])
    parser.add_argument("--isa", default=None, help="ISA path (default: this CPU's best)")
    parser.add_argument("--modes", default="plain,pch,parts")
    args = parser.parse_args(argv)
    isa = args.isa or selected_isa()
    modes = args.modes.split(",")
    configs = kernels_of(read_layers(args.layers, data_format=args.data_format), isa)
    seconds: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="convgrad-compile-time-") as tmp:
        folder = Path(tmp)
        if "cache" in modes:
            _lazy_builds(configs, folder / "cache", seconds)
            modes = [mode for mode in modes if mode != "cache"]
        preludes: dict[str, tuple[str, ...]] = {}  # by the kernels' own ISA path
        for config in configs:
            if config.isa not in preludes:
                preludes[config.isa] = pch.include_flags(config.isa, folder, wait=True)
                if {"pch", "parts"} & set(modes) and not preludes[config.isa]:
                    print(f"no precompiled prelude for {config.isa} with this compiler")
                    return 1
            prelude = preludes[config.isa]
            source = folder / f"{config.name}.c"
            source.write_text(render(config))
            family = "weights" if config.family == "bwd_weights" else "data"
            for mode in modes:
                begin = time.perf_counter()
                compile_objects([source], folder / "kernel.so", config.isa,
                                extra=prelude if mode != "plain" else (),
                                parts=compile_parts(config) if mode == "parts" else 1)
                seconds.setdefault((mode, family), []).append(time.perf_counter() - begin)
    print(f"{len(configs)} kernels, {args.data_format}, {isa}, seconds per kernel:")
    print(f"{'mode':6s} {'family':8s} {'n':>3s} {'median':>7s} {'min':>6s} {'max':>6s} "
          f"{'total':>7s}")
    for (mode, family), values in seconds.items():
        print(f"{mode:6s} {family:8s} {len(values):3d} {statistics.median(values):7.3f} "
              f"{min(values):6.3f} {max(values):6.3f} {sum(values):7.2f}")
    return 0


def _lazy_builds(configs: list, folder: Path, seconds: dict) -> None:
    """`cache` mode: cache.build of each kernel in the new cache `folder`, one core."""
    with mock.patch.dict(os.environ, CONVGRAD_CACHE_DIR=str(folder), CONVGRAD_BUILD_JOBS="1"):
        for isa in dict.fromkeys(config.isa for config in configs):
            pch.include_flags(isa, folder, wait=True)
        for config in configs:
            family = "weights" if config.family == "bwd_weights" else "data"
            begin = time.perf_counter()
            cache.build(config)
            seconds.setdefault(("cache", family), []).append(time.perf_counter() - begin)


if __name__ == "__main__":
    raise SystemExit(main())
