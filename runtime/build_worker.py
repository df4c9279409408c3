"""A kernel-build worker: `python -m convgrad.build_worker`, run by convgrad.background.

Reads one JSON request a line on standard input, {"config": KernelConfig.to_dict(),
"plan": {choice: value} or null, "settings": {variable: value or null}}, builds that
kernel (null: the rules' plan for this CPU) into the disk cache with those environment
settings, and answers one JSON line on
standard output: {"ok": true} or {"error": "..."}. A plain process of its own: it
imports neither the user's program nor PyTorch, and renders kernels without holding
the caller's GIL.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys


def main() -> int:
    # CONVGRAD_BUILD_NICE: builds yield the cores to the program they build for, whose
    # steps run meanwhile on PyTorch's stand-ins. Sapphire Rapids, 2 threads, a new
    # cache, ResNet-50 / EfficientNet-B0: niceness 0 (the default) first step 6.9 / 6.3 s,
    # every kernel in use from step 7 / 24; niceness 10: 1.9 / 1.1 s, from step 243 / 1168
    # (the step's spinning OpenMP threads leave the builds little time).
    from convgrad import kernels, settings
    from convgrad.codegen import KernelConfig

    niceness = settings.current().build_nice
    if niceness > 0:
        with contextlib.suppress(OSError, AttributeError):
            os.nice(niceness)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            settings.adopt(request["settings"])  # the parent's, as it asked
            kernels.reset()
            kernels.get_kernel(KernelConfig.from_dict(request["config"]),
                               request.get("plan"))
            answer = {"ok": True}
        except Exception as error:  # noqa: BLE001 - sent to the caller, which reports it
            answer = {"error": f"{type(error).__name__}: {error}"}
        try:
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:  # the caller is gone (its exit): nothing to answer
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
