"""Two builds of the same kernels timed in one process, on the same arrays.

    python inproc_ab.py THREADS OPS LAYERS BASE_PYTHON

The command this record's measurements were made with, now a thin wrapper around the
maintained tool `benchmarks/ab_builds.py` (same method: ResNet-50 layers, this
checkout's kernel against BASE_PYTHON's build of the same configuration and plan,
alternating 15 times 0.15 s each in one process; ratio = speed of this checkout over
the other).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import ab_builds  # noqa: E402

if __name__ == "__main__":
    threads, ops, layers, base_python = sys.argv[1:5]
    sys.exit(ab_builds.main(["--threads", threads, "--ops", ops, "--layers", layers,
                             "--base-python", base_python]))
