"""Building a model's kernels before its first step: `compile_kernels`.

One forward and backward pass of the model on example inputs runs on copies of its
parameters and buffers (so the model's weights, gradients and BatchNorm statistics
are untouched) with every convolution that has no kernel yet served by PyTorch's own
operator; each kernel it asked for is then built, all at once on every core, with a
progress bar on a terminal. The configurations are exactly a step's: the same shapes,
layouts, dtypes and thread count, so the step that follows compiles nothing.
That pass is `step_calls`, which convgrad.torch.aot's `aot_kernels` runs too, building
nothing.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from convgrad import background
from convgrad.torch import _calls, _native


def step_calls(model: nn.Module, example_inputs: tuple, example_kwargs: dict, *,
               build: bool, caller: str = "compile_kernels") -> list[_calls.Call]:
    """The convgrad calls of one training step of `model` (forward, and backward where a
    parameter or an input needs a gradient) on `example_inputs`, run on copies of its
    parameters and buffers, within `_calls.collecting(build)`: with `build`, the calls
    whose kernels were not ready, now building in the background; without, every call,
    none built (see collecting)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model is a {type(model).__name__}; expected a "
                        "torch.nn.Module")
    params = {name: p.detach().clone().requires_grad_(p.requires_grad)
              for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    inputs = [x.detach().clone().requires_grad_(x.requires_grad)
              if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with _calls.collecting(build) as calls:
        outputs = torch.func.functional_call(model, {**params, **buffers}, tuple(inputs),
                                             example_kwargs)
        leaves = [t for t in tree_flatten(outputs)[0]
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        wanted = [t for t in (*params.values(), *inputs)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves and wanted:
            total = sum(t.float().sum() for t in leaves)
            torch.autograd.grad(total, wanted, allow_unused=True)
    return calls


def compile_kernels(model: nn.Module, *example_inputs, progress: bool | None = None,
                    **example_kwargs) -> int:
    """Builds the kernels of one training step of `model` (forward, and backward where
    a parameter or an input needs a gradient) on `example_inputs`; returns how many it
    built (those already loaded, in an AOT folder or in the disk cache are not counted).
    A kernel whose build fails is warned about and left to PyTorch's operator. The C++
    call path (convgrad.torch._native) is built alongside where it is not yet."""
    calls = step_calls(model, example_inputs, example_kwargs, build=True)
    if progress is None:
        progress = sys.stderr.isatty()
    unique = list({id(call.bound): call.bound for call in calls}.values())
    # the C++ call path (convgrad.torch._native), if it is not built yet, beside them
    native = threading.Thread(target=_native.build, name="convgrad-torch-native-build")
    native.start()
    background.wait(unique, progress=progress)
    native.join()
    return len(unique)


def standin_calls() -> int:
    """Calls PyTorch's own operators served in this process while their kernels were not
    ready (convgrad.background): benchmarks check that none did while they timed."""
    return _calls.standin_calls


def native_kernel_runs() -> int:
    """Kernels the C++ call path ran in this process (0: every call took Python's)."""
    return _native.kernel_runs()
