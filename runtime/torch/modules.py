"""Drop-in convolution modules and `convert`, which swaps them into a model in place.

`Conv1d/2d/3d` and `ConvTranspose1d/2d/3d` subclass their torch.nn namesakes: the same
constructor, parameters, state_dict keys, initialisation and repr (and isinstance
checks against torch.nn still hold); only the convolutions run convgrad's kernels.
Bias is added by torch as in torch.nn. A non-zero `padding_mode` pads with F.pad
first, as torch.nn does, then convolves without pads.

`convert` also converts a user's subclass of a torch.nn convolution that keeps torch's
computation (no override of the methods `_OVERRIDES` names): its class becomes one
derived from the user's class and convgrad's, made once per user class (see
`_converted_class`).
"""

from __future__ import annotations

import copyreg
import threading
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
    return cgF.conv_nd(rank, input, weight, bias, module.stride, padding, module.dilation,
                       module.groups)


def _transpose_forward(module: nn.modules.conv._ConvTransposeNd, rank: int,
                       input: torch.Tensor, output_size: list[int] | None) -> torch.Tensor:
    if module.padding_mode != "zeros":
        raise ValueError(f"ConvTranspose{rank}d: padding_mode = {module.padding_mode!r} is "
                         "invalid; only 'zeros' is supported (as in torch.nn)")
    output_padding = module._output_padding(input, output_size, module.stride,
                                            module.padding, module.kernel_size, rank,
                                            module.dilation)
    return cgF.conv_transpose_nd(rank, input, module.weight, module.bias, module.stride,
                                 module.padding, output_padding, module.groups,
                                 module.dilation)


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
_OURS = tuple(REPLACEMENTS.values())

# What torch.nn's forward goes through and convgrad's classes replace or call: a
# subclass that overrides one of these computes something else, so convert leaves it
# alone. (torch.nn's ConvTranspose forward calls F.conv_transposeNd itself, never
# _conv_forward; convgrad's replaces forward and calls _output_padding.)
_OVERRIDES: dict[type, tuple[str, ...]] = {
    base: ("forward", "_output_padding") if issubclass(base, nn.modules.conv._ConvTransposeNd)
    else ("forward", "_conv_forward")
    for base in REPLACEMENTS
}


class _ConvertedSubclass:
    """Middle base of the classes `_converted_class` makes, (the user's class, this,
    convgrad's class): the user's methods and attributes come first, then convgrad's
    `_conv_forward` (ConvTranspose: `forward`) before torch.nn's, which the user's
    class does not override; the user's class, first, is the base whose instance
    layout the new class has, so `__class__` can be assigned. A dynamically made class
    cannot be pickled by reference, so its modules pickle (and copy) as "the converted
    class of the user's class", which must itself be importable, as for pickling the
    unconverted module."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):
        reduced = super().__reduce_ex__(max(protocol, 2))
        user_class = _USER_CLASS.get(type(self))
        if (user_class is not None and isinstance(reduced, tuple) and len(reduced) >= 2
                and reduced[0] is copyreg.__newobj__ and reduced[1][0] is type(self)):
            return (_new_converted, (user_class, *reduced[1][1:]), *reduced[2:])
        return reduced  # the user's class reduces its modules its own way


_CONVERTED: dict[type, type] = {}  # the user's class -> its converted class
_USER_CLASS: dict[type, type] = {}  # and back
_CONVERTED_LOCK = threading.Lock()


def _torch_base(kind: type) -> type | None:
    """The one torch.nn class of REPLACEMENTS that `kind` derives from, or None."""
    bases = [base for base in REPLACEMENTS if issubclass(kind, base)]
    return bases[0] if len(bases) == 1 else None


def _converted_class(kind: type) -> type:
    """The class `convert` gives modules of `kind`, a subclass of one torch.nn class of
    REPLACEMENTS that overrides none of its `_OVERRIDES`: made once per class, with the
    same name (so reprs do not change), an instance of `kind` (isinstance checks and
    kind's own methods and attributes hold) and of convgrad's class."""
    with _CONVERTED_LOCK:
        converted = _CONVERTED.get(kind)
        if converted is None:
            ours = REPLACEMENTS[_torch_base(kind)]
            converted = type(kind)(kind.__name__, (kind, _ConvertedSubclass, ours), {
                "__module__": __name__, "__qualname__": kind.__qualname__,
                "__doc__": f"{kind.__module__}.{kind.__qualname__} whose convolutions run "
                           "convgrad's kernels (made by convgrad.torch.convert).",
            })
            _CONVERTED[kind] = converted
            _USER_CLASS[converted] = kind
        return converted


def _new_converted(user_class: type, *args) -> nn.Module:
    """Unpickles (and copies) a module of `_converted_class(user_class)`: the name
    pickles refer to."""
    cls = _converted_class(user_class)
    return cls.__new__(cls, *args)


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


def _why_not_subclass(module: nn.Module) -> str | None:
    """Why `convert` leaves alone a module of a subclass of a torch.nn convolution
    (not convgrad's), or None if it converts it to `_converted_class`."""
    kind = type(module)
    if isinstance(module, nn.modules.lazy.LazyModuleMixin):
        return "lazy module not yet initialised: run one forward pass first"
    if torch.nn.utils.parametrize.is_parametrized(module):
        return "parametrized (torch.nn.utils.parametrize): not supported"
    name = f"{kind.__module__}.{kind.__qualname__}"
    base = _torch_base(kind)
    if base is None:
        return f"a subclass of several torch.nn convolutions ({name})"
    overridden = [method for method in _OVERRIDES[base]
                  if getattr(kind, method) is not getattr(base, method)]
    if overridden:
        return (f"a subclass of torch.nn.{base.__name__} ({name}) that overrides "
                f"{' and '.join(overridden)}: its computation may differ")
    return None


def convert(model: nn.Module) -> ConversionReport:
    """Turns every torch.nn Conv1d/2d/3d and ConvTranspose1d/2d/3d of `model` (the
    model itself included) into convgrad's module, in place: the module's class
    changes, its parameters, buffers, hooks and state stay the same objects (so an
    optimizer made before keeps working). A subclass of those torch.nn classes that
    overrides neither `forward` nor `_conv_forward` (ConvTranspose: `forward` nor
    `_output_padding`) is converted too, to a class of the same name derived from it
    and convgrad's class (made once per subclass; isinstance checks against the
    subclass and its own methods hold; its modules pickle and copy). Returns a report
    of what was converted and, with reasons, which convolutions were left alone:
    subclasses overriding those methods (their computation may differ), parametrized
    and uninitialised lazy modules, other convolution types (quantized, ...), and
    modules on other devices or in dtypes the kernels lack (float64)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model is a {type(model).__name__}; expected a "
                        "torch.nn.Module")
    report = ConversionReport()
    for name, module in model.named_modules():
        kind = type(module)
        if isinstance(module, _OURS):
            report.already.append(_display(name))
        elif isinstance(module, tuple(REPLACEMENTS)):  # one of them or a subclass
            why = (None if kind in REPLACEMENTS else _why_not_subclass(module)) \
                or _why_not(module)
            if why is None:
                try:
                    module.__class__ = REPLACEMENTS.get(kind) or _converted_class(kind)
                except Exception as error:  # e.g. its metaclass or __init_subclass__
                    why = f"convgrad cannot derive a class from it: {error!r}"
            if why is None:
                report.converted.append(_display(name))
            else:
                report.skipped.append((_display(name), kind.__name__, why))
        elif isinstance(module, nn.modules.conv._ConvNd):
            report.skipped.append((_display(name), kind.__name__,
                                   f"a subclass of torch.nn's _ConvNd ({kind.__module__}."
                                   f"{kind.__qualname__}) but of none of the six "
                                   "convolution classes"))
        elif "conv" in kind.__name__.lower() and not list(module.children()):
            report.skipped.append((_display(name), kind.__name__,
                                   "not a torch.nn convolution module"))
    return report
