"""Ahead-of-time kernels of a PyTorch model: `aot_kernels`, and the model side of
`convgrad aot --torch-model MODULE:FACTORY --input-shape ...`.

One training step of the model, converted (`convert` on a deep copy: the model itself
is left as it was), runs on example inputs: the pass of `compile_kernels`
(warmup.step_calls), except that it builds nothing and notes every convgrad call,
loaded or not. Each distinct call becomes a layer (op, shapes, attributes, dtype:
convgrad.codegen.layers.Layer) and `convgrad.aot.build`, the writer of `convgrad aot`,
builds their distinct kernels into a folder with its manifest. A deployment whose
CONVGRAD_AOT_PATH names that folder runs the converted model's convolutions on those
kernels from the first step, with no compiler, for the same input shapes, dtypes and
memory layouts (of the inputs and of the weights: channels_last weights have kernels of
their own) and whether the inputs need a gradient; the thread count may differ. As in
compile_kernels, the step's backward starts from the gradient of the outputs' sum, read
in torch's default layout as the gradients of mean, mse_loss and cross_entropy come
(also on channels_last outputs): a loss whose gradient is channels_last calls kernels
of their own for the convolutions whose results are the outputs.
"""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from convgrad import aot, settings, tuning
from convgrad.codegen.layers import Layer
from convgrad.codegen.targets import target as named_target
from convgrad.cpu import selected_isa
from convgrad.torch import warmup
from convgrad.torch.modules import convert as convert_model

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def step_layers(model: nn.Module, *example_inputs, convert: bool = True,
                kwargs: dict | None = None) -> list[Layer]:
    """The distinct convgrad calls of one training step of `model` on `example_inputs`
    (and keyword arguments `kwargs`) as layers, in the order first made, each named
    `<index>_<op>_<first input's shape>_<second's>` (shapes in the kernel's layout).
    With `convert` (the default) the step runs on a converted deep copy of the model;
    without, on the model as it is (converted by the caller, maybe in part). Nothing
    is built and the model's parameters, gradients and buffers are left as they were."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"aot_kernels: model is a {type(model).__name__}; expected a "
                        "torch.nn.Module")
    report = None
    if convert:
        model = copy.deepcopy(model)
        report = convert_model(model)
    calls = warmup.step_calls(model, example_inputs, kwargs or {}, build=False,
                              caller="aot_kernels")
    distinct = list(dict.fromkeys(call.layer for call in calls))
    if not distinct:
        left = f"; convert left alone: {report.skipped}" if report and report.skipped else ""
        raise ValueError("aot_kernels: one training step of the model runs no convgrad "
                         f"kernel (it has no convolution convgrad converts{left})")
    return [replace(layer, name=_name(index, layer)) for index, layer in enumerate(distinct)]


def _name(index: int, layer: Layer) -> str:
    shapes = "_".join("x".join(map(str, shape)) for shape in layer.inputs[:2])
    return f"{index}_{layer.op}_{shapes}"


def aot_kernels(model: nn.Module, *example_inputs, output: str | Path,
                kwargs: dict | None = None, convert: bool = True, isa: str | None = None,
                target: str | None = None, plans: str | Path | None = None,
                jobs: int | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> aot.BuildResult:
    """Builds into folder `output` (an AOT folder, as `convgrad aot -o` writes) the
    kernels of one training step of `model` on `example_inputs` (see step_layers, and
    `convert`), for the ISA path `isa` (default: the one this process runs, see
    CONVGRAD_ISA) or the CPU `target` names (archspec's names, as `convgrad aot
    --target`), with the tuned plans of file `plans` where it has them (`convgrad aot
    --plans`), `jobs` compilations at a time (default: every core). `progress(done,
    total, kernel name)` is called after each compilation. Returns the build's summary:
    `configs` maps each distinct kernel configuration to its layers; `compile_seconds`,
    `plans` and `seconds` (the whole build) follow."""
    named = named_target(target) if target else None
    if named and isa and isa != named.isa:
        raise ValueError(f"aot_kernels: isa {isa!r} contradicts target {named.name} (its "
                         f"path is {named.isa})")
    isa = named.isa if named else isa or selected_isa()
    layers = step_layers(model, *example_inputs, convert=convert, kwargs=kwargs)
    tuned = aot.plans_from(tuning.read_plans(Path(plans)), aot.kernels_of(layers, isa)) \
        if plans else None
    current = settings.current()
    with settings.using(current.with_values(CONVGRAD_TARGET=named.name) if named else current):
        return aot.build(layers, Path(output), isa=isa, jobs=jobs or os.cpu_count() or 1,
                         progress=progress, tuned=tuned, target=named)


def load_model(spec: str) -> nn.Module:
    """The model `MODULE:FACTORY` names: FACTORY (an attribute of the imported module,
    dotted for a nested one) is called with no arguments and must return a
    torch.nn.Module; a module instance there is taken as it is. ValueError for a bad
    path or result (errors raised by the module's own code or the factory propagate)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError("expected MODULE:FACTORY, e.g. mypackage.models:make_model (a "
                         "callable returning a torch.nn.Module)")
    try:
        found = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import module {module_name!r}: {error} (is it on "
                         "PYTHONPATH?)") from error
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attribute!r}") \
                from None
    if isinstance(found, nn.Module):
        return found
    if not callable(found):
        raise ValueError(f"{spec} is a {type(found).__name__}, not a callable returning a "
                         "torch.nn.Module")
    model = found()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec}() returned a {type(model).__name__}, not a "
                         "torch.nn.Module")
    return model


def example_inputs(shapes: Sequence[Sequence[int]], dtype: str = "f32",
                   channels_last: bool = False, seed: int = 0) -> list[torch.Tensor]:
    """`convgrad aot --input-shape`: random inputs of `shapes` in dtype `dtype` ("f32",
    "bf16" or "f16"), with `channels_last` in torch's channels_last memory format
    (channels_last_3d for 5-D shapes), needing no gradient (as a batch of data).
    ValueError for shapes channels_last does not apply to."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}")
    if channels_last and any(len(shape) not in (4, 5) for shape in shapes):
        raise ValueError("channels_last needs 4-D or 5-D input shapes (torch's "
                         f"channels_last and channels_last_3d); got {list(shapes)}")
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for shape in shapes:
        x = torch.randn(tuple(shape), generator=generator).to(DTYPES[dtype])
        if channels_last:
            x = x.contiguous(memory_format=_memory_format(len(shape)))
        inputs.append(x)
    return inputs


def _memory_format(rank: int) -> torch.memory_format:
    return torch.channels_last if rank == 4 else torch.channels_last_3d


def model_layers(model: nn.Module, inputs: Sequence[torch.Tensor],
                 channels_last: bool = False) -> list[Layer]:
    """`convgrad aot --torch-model`: `model` (which this changes: the command's own) in
    the dtype of `inputs` and, with `channels_last`, in the channels_last memory format
    of the first 4-D or 5-D input, converted, then step_layers on `inputs`. The step's
    errors (inputs the model does not take) propagate."""
    model.to(inputs[0].dtype)
    ranks = [x.dim() for x in inputs if x.dim() in (4, 5)]
    if channels_last and ranks:
        model.to(memory_format=_memory_format(ranks[0]))
    convert_model(model)
    return step_layers(model, *inputs, convert=False)
