"""Drop-in convolution modules and `convert`, which swaps them into a model in place.

`Conv1d/2d/3d` and `ConvTranspose1d/2d/3d` subclass their torch.nn namesakes: the same
constructor, parameters, state_dict keys, initialisation and repr (and isinstance
checks against torch.nn still hold); only the convolutions run convgrad's kernels.
Bias is added by torch as in torch.nn. A non-zero `padding_mode` pads with F.pad
first, as torch.nn does, then convolves without pads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from convgrad.torch import _bridge
from convgrad.torch import functional as cgF


def _conv_forward(module: nn.modules.conv._ConvNd, rank: int, input: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if module.padding_mode != "zeros":
        channels_last = input.dim() == rank + 2 and _bridge.data_format(input) == "NXC"
        input = F.pad(input, module._reversed_padding_repeated_twice,
                      mode=module.padding_mode)
        if channels_last and _bridge.data_format(input) != "NXC":
            # F.pad's circular mode (and any mode in 1-D) returns a contiguous tensor:
            # keep the model's layout, as the convolutions' results do
            input = input.movedim(1, -1).contiguous().movedim(-1, 1)
        padding = 0
    else:
        padding = module.padding
    return cgF._conv(rank, input, weight, bias, module.stride, padding, module.dilation,
                     module.groups)


def _transpose_forward(module: nn.modules.conv._ConvTransposeNd, rank: int,
                       input: torch.Tensor, output_size: list[int] | None) -> torch.Tensor:
    if module.padding_mode != "zeros":
        raise ValueError(f"ConvTranspose{rank}d: padding_mode = {module.padding_mode!r} is "
                         "invalid; only 'zeros' is supported (as in torch.nn)")
    output_padding = module._output_padding(input, output_size, module.stride,
                                            module.padding, module.kernel_size, rank,
                                            module.dilation)
    return cgF._conv_transpose(rank, input, module.weight, module.bias, module.stride,
                               module.padding, output_padding, module.groups, module.dilation)


class Conv1d(nn.Conv1d):
    """torch.nn.Conv1d whose forward and gradients run convgrad's kernels."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return _conv_forward(self, 1, input, weight, bias)


class Conv2d(nn.Conv2d):
    """torch.nn.Conv2d whose forward and gradients run convgrad's kernels."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return _conv_forward(self, 2, input, weight, bias)


class Conv3d(nn.Conv3d):
    """torch.nn.Conv3d whose forward and gradients run convgrad's kernels."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return _conv_forward(self, 3, input, weight, bias)


class ConvTranspose1d(nn.ConvTranspose1d):
    """torch.nn.ConvTranspose1d whose forward and gradients run convgrad's kernels."""

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None
                ) -> torch.Tensor:
        return _transpose_forward(self, 1, input, output_size)


class ConvTranspose2d(nn.ConvTranspose2d):
    """torch.nn.ConvTranspose2d whose forward and gradients run convgrad's kernels."""

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None
                ) -> torch.Tensor:
        return _transpose_forward(self, 2, input, output_size)


class ConvTranspose3d(nn.ConvTranspose3d):
    """torch.nn.ConvTranspose3d whose forward and gradients run convgrad's kernels."""

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None
                ) -> torch.Tensor:
        return _transpose_forward(self, 3, input, output_size)


REPLACEMENTS: dict[type, type] = {
    nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d,
    nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d,
    nn.ConvTranspose3d: ConvTranspose3d,
}
_OURS = frozenset(REPLACEMENTS.values())


@dataclass
class ConversionReport:
    """What `convert` did: the qualified names of the modules it converted, and of the
    convolution-like modules it left alone, each with the reason."""

    converted: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, type, why)

    def __str__(self) -> str:
        lines = [f"convgrad.torch.convert: {len(self.converted)} module(s) converted"
                 + (f", {len(self.already)} already convgrad's" if self.already else "")
                 + f", {len(self.skipped)} left alone"]
        lines += [f"  converted  {name}" for name in self.converted]
        lines += [f"  left alone {name} ({kind}): {why}" for name, kind, why in self.skipped]
        return "\n".join(lines)


def _why_not(module: nn.Module) -> str | None:
    """Why a torch.nn convolution cannot run on convgrad, or None if it can."""
    tensors = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))]
    for t in tensors:
        if isinstance(t, nn.parameter.UninitializedParameter):
            return "uninitialised lazy parameters: run one forward pass first"
        if t.dtype not in _bridge.DTYPES:
            return (f"dtype {t.dtype}: convgrad runs float32, float16 and bfloat16")
        if t.device.type != "cpu":
            return f"device {t.device}: convgrad runs on CPU"
    if isinstance(module, nn.modules.conv._ConvTransposeNd) and module.padding_mode != "zeros":
        return f"padding_mode {module.padding_mode!r} (torch.nn supports only 'zeros' here)"
    return None


def _display(name: str) -> str:
    return name or "(the model itself)"


def convert(model: nn.Module) -> ConversionReport:
    """Turns every torch.nn Conv1d/2d/3d and ConvTranspose1d/2d/3d of `model` (the
    model itself included) into convgrad's module, in place: the module's class
    changes, its parameters, buffers, hooks and state stay the same objects (so an
    optimizer made before keeps working). Returns a report of what was converted and,
    with reasons, which convolutions were left alone: subclasses of the torch.nn
    classes (their forward may differ; parametrized and lazy modules are such), other
    convolution types (quantized, ...), and modules on other devices or in dtypes the
    kernels lack (float64)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model is a {type(model).__name__}; expected a "
                        "torch.nn.Module")
    report = ConversionReport()
    for name, module in model.named_modules():
        kind = type(module)
        if kind in _OURS:
            report.already.append(_display(name))
        elif kind in REPLACEMENTS:
            why = _why_not(module)
            if why is None:
                module.__class__ = REPLACEMENTS[kind]
                report.converted.append(_display(name))
            else:
                report.skipped.append((_display(name), kind.__name__, why))
        elif isinstance(module, nn.modules.conv._ConvNd):
            if isinstance(module, nn.modules.lazy.LazyModuleMixin):
                why = "lazy module not yet initialised: run one forward pass first"
            elif torch.nn.utils.parametrize.is_parametrized(module):
                why = "parametrized (torch.nn.utils.parametrize): not supported"
            else:
                why = f"a subclass of a torch.nn convolution ({kind.__module__}." \
                      f"{kind.__qualname__}); its forward may differ"
            report.skipped.append((_display(name), kind.__name__, why))
        elif "conv" in kind.__name__.lower() and not list(module.children()):
            report.skipped.append((_display(name), kind.__name__,
                                   "not a torch.nn convolution module"))
    return report
