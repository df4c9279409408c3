"""Kernels forced onto a plan and an ISA path, run on a workspace of their own and checked
against the reference: the ISA paths this CPU runs, whether it has AMX tiles, and the
helpers that test_variants_*.py, test_nonfinite.py and the sanitizer, clang and
weight-packing tests share.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from checks import DTYPE_NAMES, assert_exact

import convgrad
from convgrad.codegen.isa import AMX_FEATURES
from convgrad.codegen.plan import resolve_plan

ISAS = convgrad.cpu.available_isas()  # the paths this CPU runs, its best first
HAS_AMX = convgrad.cpu.cpu_features() >= AMX_FEATURES
# Plans that keep a kernel off its AMX path say amx=0 only where it has one.
AMX_OFF = ("amx",)


def placed(array: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `array` whose data starts `offset` bytes past a 64-byte boundary."""
    from convgrad import kernels

    block = kernels.empty_output((array.nbytes + 64,), np.uint8)
    copy = block[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def taken(config, plan, optional=()):
    """`plan` without those of its `optional` overrides that the variant `config` takes
    under it does not read (such as amx=0 where a kernel has no AMX path): any other
    override the variant does not take stays, for resolve_plan to refuse."""
    reads = resolve_plan(config, plan, strict=False).reads
    return {k: v for k, v in plan.items() if k in reads or k not in optional}


def forced_kernel(case, plan=None, isa=None, threads=1, *, optional=(), variant=None):
    """`case`'s kernel (with a forced plan and ISA path where given, less the `optional`
    overrides its variant does not take): the workspace bytes it needs, and a function
    that runs it on a given workspace and checks the bits. A forced plan names the
    `variant` it is meant to run (a Variant, or one per op kind), and the kernel must
    be of it."""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, DTYPE_NAMES[a.dtype])
    config = problem.config.with_isa(isa) if isa else problem.config
    plan = None if plan is None else taken(config, plan, optional)
    kernel = kernels.get_kernel(config, plan)
    assert plan is None or kernel.plan == plan
    assert_variant(case, kernel, plan, variant)
    first, second = (b, a) if problem.swap_inputs else (a, b)
    dims = kernels.dims_of(problem, threads)

    def run(workspace):
        out = np.empty(problem.output_shape, dtype=a.dtype)
        kernels.call(kernel, problem, dims, first, second, out, workspace)
        assert_exact(case, out)

    return kernel.workspace_size(dims), run


def assert_variant(case, kernel, plan, variant) -> None:
    """A kernel of a forced plan is of the `variant` (a Variant, or a mapping from op
    kinds to one) the test names."""
    if plan is None and variant is None:
        return
    assert variant is not None, "a test that forces a plan names the variant it runs"
    expected = variant[case.op] if isinstance(variant, Mapping) else variant
    assert kernel.variant is expected, (kernel.variant, expected)


def run_with_plan(case, plan, isa, threads, *, optional=(), variant):
    """Runs `case` with a forced plan on one ISA path and checks the result's bits and
    the kernel's variant (`optional`, `variant`: as forced_kernel)."""
    size, run = forced_kernel(case, plan, isa, threads, optional=optional, variant=variant)
    run(np.empty(size, dtype=np.uint8))


def run_streamed(case, plan, isa, *, variant):
    """Runs `case` (f32, a result of at least 1 KB) with a forced plan on 1 and 2 threads
    into a result on a cache line, and on 2 into one a float past it; checks the bits.
    (stream_kb goes where the kernel does not stream: the portable path, other ops.)"""
    from convgrad import kernels
    from convgrad.codegen.ops import resolve

    a, b = case.inputs[:2]
    problem = resolve(case.op, [a.shape, b.shape], case.attrs, None, "f32")
    config = problem.config.with_isa(isa)
    kernel = kernels.get_kernel(config, taken(config, plan, ("stream_kb",)))
    assert_variant(case, kernel, plan, variant)
    first, second = (b, a) if problem.swap_inputs else (a, b)
    size = int(np.prod(problem.output_shape))
    assert size * 4 >= 1024
    for threads, offset in ((1, 0), (2, 0), (2, 1)):  # offset: floats past a line
        dims = kernels.dims_of(problem, threads)
        block = kernels.empty_output((size + 1,), np.float32)
        out = block[offset:offset + size].reshape(problem.output_shape)
        out[...] = np.nan
        kernels.call(kernel, problem, dims, first, second, out,
                     np.empty(kernel.workspace_size(dims), np.uint8))
        assert_exact(case, out)
