"""Compile time of a third of ResNet-50's kernels (NXC, this CPU's best path) with GCC flags
that might cut it, and with clang. Run from the repository's root folder:

    python flags.py            # GCC: -O3 (convgrad's), -O2, and -O3 without some passes
    python flags.py clang      # gcc against clang, -O3, without the precompiled prelude

Each kernel is rendered once and compiled whole by each variant (in an order rotated
from kernel to kernel), one after the other, on one core.
Prints the median and total seconds, and the geomean of each variant's time and text
size over -O3's.
"""

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

isa = selected_isa()
configs = list(kernels_of(read_layers([], data_format="NXC"), isa))[::3]
folder = Path(tempfile.mkdtemp())
flags = list(compile_flags(isa))
if sys.argv[1:] == ["clang"]:
    variants = {"gcc": ["gcc"], "clang": ["clang"]}
    prelude: tuple = ()
else:
    prelude = pch.include_flags(isa, folder, wait=True)
    variants = {
        "-O3": ["cc"],
        "-O2": ["cc", "-O2"],
        "-O3 no vectorizer": ["cc", "-fno-tree-loop-vectorize", "-fno-tree-slp-vectorize"],
        "-O3 no unswitching": ["cc", "-fno-unswitch-loops"],
        "-O3 no ipa-cp clones": ["cc", "-fno-ipa-cp-clone"],
        "-O3 no peel/split/version/distribute": [
            "cc", "-fno-peel-loops", "-fno-split-loops", "-fno-version-loops-for-strides",
            "-fno-tree-loop-distribution"],
    }
seconds: dict = {name: [] for name in variants}
text: dict = {name: [] for name in variants}
names = list(variants)
for index, config in enumerate(configs):
    source = folder / f"{config.name}.c"
    source.write_text(render(config))
    # each kernel's variants in a rotated order: the first compile of a file runs slower
    for name in names[index % len(names):] + names[:index % len(names)]:
        compiler, *extra = variants[name]
        library = folder / "kernel.so"
        begin = time.perf_counter()
        subprocess.run([compiler, *flags, *extra, *prelude, str(source), "-o", str(library)],
                       check=True, capture_output=True)
        seconds[name].append(time.perf_counter() - begin)
        size = subprocess.run(["size", str(library)], capture_output=True, text=True).stdout
        text[name].append(int(size.split("\n")[1].split()[0]))
first = next(iter(variants))
print(f"{len(configs)} kernels, {isa}")
for name in variants:
    time_ratio = statistics.geometric_mean(
        [a / b for a, b in zip(seconds[name], seconds[first], strict=True)])
    text_ratio = statistics.geometric_mean(
        [a / b for a, b in zip(text[name], text[first], strict=True)])
    print(f"{name:40s} median {statistics.median(seconds[name]):.3f} s, total "
          f"{sum(seconds[name]):.2f} s, time / {first} {time_ratio:.3f}, text / {first} "
          f"{text_ratio:.3f}")
