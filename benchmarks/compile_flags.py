"""Compile time of a share of ResNet-50's kernels (NXC, this CPU's best path) with GCC flags
that might cut it, or GCC against clang.

    python -m benchmarks.compile_flags [clang] [--every 3] [--limit N] [--variants=-O3,-O2]

Without `clang`: -O3 (convgrad's own flags), -O2, and -O3 without some passes, with the
precompiled prelude; with `clang`: gcc against clang at -O3, without the prelude. Every
--every'th kernel of the list (default 3: a third), at most --limit of them, is rendered
once and compiled whole by each variant (in an order rotated from kernel to kernel, as
the first compile of a file runs slower), one after the other, on one core.
Prints the median and total seconds, and the geomean of each variant's time and text
size over the first variant's.

First recorded as a script of its own (benchmarks/results/zen4/compile_flags_2943a6d,
whose README keeps the commands it ran).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from convgrad import pch
from convgrad.aot import kernels_of, read_layers
from convgrad.codegen import render
from convgrad.compiler import compile_flags
from convgrad.cpu import selected_isa

GCC_VARIANTS = {
    "-O3": ["cc"],
    "-O2": ["cc", "-O2"],
    "-O3 no vectorizer": ["cc", "-fno-tree-loop-vectorize", "-fno-tree-slp-vectorize"],
    "-O3 no unswitching": ["cc", "-fno-unswitch-loops"],
    "-O3 no ipa-cp clones": ["cc", "-fno-ipa-cp-clone"],
    "-O3 no peel/split/version/distribute": [
        "cc", "-fno-peel-loops", "-fno-split-loops", "-fno-version-loops-for-strides",
        "-fno-tree-loop-distribution"],
}
CLANG_VARIANTS = {"gcc": ["gcc"], "clang": ["clang"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_flags",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("compilers", nargs="?", choices=["clang"],
                        help="clang: gcc against clang instead of GCC's flags")
    parser.add_argument("--every", type=int, default=3,
                        help="every N-th kernel of the list (default 3)")
    parser.add_argument("--limit", type=int, default=None, help="at most N kernels")
    parser.add_argument("--variants", default=None,
                        help="comma-separated names of the variants to run (default all; "
                             "give them as --variants=-O3,-O2)")
    args = parser.parse_args(argv)
    known = CLANG_VARIANTS if args.compilers == "clang" else GCC_VARIANTS
    names = args.variants.split(",") if args.variants else list(known)
    if any(name not in known for name in names) or not names:
        parser.error(f"--variants: expected names among {list(known)}")
    args.variants = {name: known[name] for name in names}
    if args.every < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--every and --limit must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    isa = selected_isa()
    configs = list(kernels_of(read_layers([], data_format="NXC"), isa))[::args.every]
    configs = configs[:args.limit] if args.limit else configs
    variants = args.variants
    with tempfile.TemporaryDirectory(prefix="convgrad-compile-flags-") as tmp:
        folder = Path(tmp)
        flags = list(compile_flags(isa))
        prelude = () if args.compilers == "clang" else pch.include_flags(isa, folder, wait=True)
        seconds: dict = {name: [] for name in variants}
        text: dict = {name: [] for name in variants}
        names = list(variants)
        for index, config in enumerate(configs):
            source = folder / f"{config.name}.c"
            source.write_text(render(config))
            for name in names[index % len(names):] + names[:index % len(names)]:
                compiler, *extra = variants[name]
                library = folder / "kernel.so"
                begin = time.perf_counter()
                subprocess.run([compiler, *flags, *extra, *prelude, str(source), "-o",
                                str(library)], check=True, capture_output=True)
                seconds[name].append(time.perf_counter() - begin)
                size = subprocess.run(["size", str(library)], capture_output=True,
                                      text=True).stdout
                text[name].append(int(size.split("\n")[1].split()[0]))
    first = names[0]
    print(f"{len(configs)} kernels, {isa}")
    for name in names:
        time_ratio = statistics.geometric_mean(
            [a / b for a, b in zip(seconds[name], seconds[first], strict=True)])
        text_ratio = statistics.geometric_mean(
            [a / b for a, b in zip(text[name], text[first], strict=True)])
        print(f"{name:40s} median {statistics.median(seconds[name]):.3f} s, total "
              f"{sum(seconds[name]):.2f} s, time / {first} {time_ratio:.3f}, text / {first} "
              f"{text_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
