"""`torch.nn.functional`'s convolutions, computed by convgrad's kernels.

`conv1d/2d/3d` and `conv_transpose1d/2d/3d` take the arguments of their
torch.nn.functional namesakes, in the same order, and are differentiable in input
and weight (bias is added by torch, so its gradient is torch's sum). Every convolution
(forward, data gradient, weight gradient) runs a convgrad op:

- convolution: forward = ConvTransposeBackwardData (torch's weight read as IOX), data
  gradient = ConvolutionBackwardData, weight gradient = ConvolutionBackwardWeights;
- transposed convolution: forward = ConvolutionBackwardData (torch's ConvTranspose
  weight read as OIX), data gradient = ConvTransposeBackwardData, weight gradient =
  ConvolutionBackwardWeights with the data tensors' roles swapped.

One extension: `padding` of the convolutions may also be a sequence of (begin, end)
pairs, one per spatial axis (asymmetric pads, which torch expresses only with F.pad).

Under `torch.autocast("cpu", dtype=...)` input and weight may differ in dtype, as in
torch.nn.functional: the ops cast both to the autocast dtype (convgrad.torch.ops), and
the bias is cast to it too before it is added, so the result has that dtype as
torch's has. Outside autocast all three must have one dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from convgrad import bound
from convgrad.codegen.shapes import torch_same_pads
from convgrad.torch import _bridge
from convgrad.torch.ops import dispatch, forward_site, native_ready

Padding = int | Sequence[int] | Sequence[Sequence[int]] | str


def _tuple(op: str, name: str, value, rank: int, minimum: int) -> list[int]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        values = list(value)
        if len(values) != rank:
            raise ValueError(f"{op}: {name} = {value!r} is invalid; expected {rank} values")
    else:
        values = [value] * rank
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{op}: {name} = {value!r} is invalid; expected integers")
        if v < minimum:
            raise ValueError(f"{op}: {name} = {value!r} is invalid; expected values of at "
                             f"least {minimum}")
    return values


def _inputs(op: str, rank: int, input, weight, bias) -> bool:
    """Validates the tensors (of one dtype, except under autocast, which casts them);
    returns whether input is unbatched (C, spatial...)."""
    mixed = torch.is_autocast_enabled("cpu")
    _bridge.check_tensor(op, "input", input)
    _bridge.check_tensor(op, "weight", weight)
    if input.dim() not in (rank + 1, rank + 2):
        raise ValueError(f"{op}: input has shape {tuple(input.shape)}; expected "
                         f"{rank + 2} dimensions (N, C, {rank} spatial) or {rank + 1} "
                         "(unbatched)")
    if weight.dim() != rank + 2:
        raise ValueError(f"{op}: weight has shape {tuple(weight.shape)}; expected "
                         f"{rank + 2} dimensions")
    if weight.dtype != input.dtype and not mixed:
        raise TypeError(f"{op}: weight is {weight.dtype} but input is {input.dtype}; "
                        "expected one dtype")
    if bias is not None:
        _bridge.check_tensor(op, "bias", bias)
        if bias.dtype != input.dtype and not mixed:
            raise TypeError(f"{op}: bias is {bias.dtype} but input is {input.dtype}; "
                            "expected one dtype")
        if bias.dim() != 1:
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}; expected one "
                             "value per output channel")
    return input.dim() == rank + 1


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None, op: str) -> torch.Tensor:
    """y + bias per channel; under autocast in y's dtype (the autocast dtype), as torch's
    convolutions add it there, not promoted to a float32 bias's."""
    if bias is None:
        return y
    if bias.shape[0] != y.shape[1]:
        raise ValueError(f"{op}: bias has {bias.shape[0]} values; expected {y.shape[1]}, one "
                         "per output channel")
    if bias.dtype is not y.dtype and torch.is_autocast_enabled("cpu"):
        bias = bias.to(y.dtype)
    return y + bias.view(1, -1, *[1] * (y.dim() - 2))


def _pads(op: str, padding, rank: int, kernel: Sequence[int], strides: Sequence[int],
          dilations: Sequence[int]) -> tuple[list, list]:
    """(pads_begin, pads_end) of torch's padding argument (or of (begin, end) pairs)."""
    if isinstance(padding, str):
        if padding == "valid":
            return [0] * rank, [0] * rank
        if padding == "same":
            if any(s != 1 for s in strides):
                raise ValueError(f"{op}: padding='same' is invalid with strides {strides}; "
                                 "torch allows it only for stride 1")
            return torch_same_pads(kernel, dilations)
        raise ValueError(f"{op}: padding = {padding!r} is invalid; expected 'valid', 'same', "
                         "an integer or a sequence of them")
    if isinstance(padding, Sequence) and any(isinstance(p, Sequence) for p in padding):
        if len(padding) != rank or not all(isinstance(p, Sequence) and len(p) == 2
                                           for p in padding):
            raise ValueError(f"{op}: padding = {padding!r} is invalid; expected {rank} "
                             "(begin, end) pairs")
        begin = _tuple(op, "padding", [p[0] for p in padding], rank, 0)
        end = _tuple(op, "padding", [p[1] for p in padding], rank, 0)
        return begin, end
    pads = _tuple(op, "padding", padding, rank, 0)
    return pads, list(pads)


def _one_dtype(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the tensors' dtypes need no check: one for all, or under autocast (which
    casts them all to its dtype) each one the kernels have."""
    if weight.dtype is input.dtype and (bias is None or bias.dtype is input.dtype):
        return True
    return (torch.is_autocast_enabled("cpu") and weight.dtype in _bridge.DTYPES
            and (bias is None or bias.dtype in _bridge.DTYPES))


# The op arguments of a module's convolution by its attributes and kernel, and the
# C++ path's site of them (ops.forward_site, once it is loaded): checking and expanding
# them costs as much as a small kernel, and a model repeats them.
_conv_args: dict = {}
MAX_CONV_ARGS = 4096
bound.on_reset(_conv_args.clear)  # its sites: the C++ path may be turned off


def conv_nd(rank: int, input, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """conv1d, conv2d or conv3d by `rank` (the spatial dimensions), with their arguments
    (convgrad.torch.modules' Conv*d call it with their own)."""
    op = f"conv{rank}d"
    if not torch.compiler.is_compiling():
        try:
            key = (rank, stride, padding, dilation, groups, weight.shape)
            known = _conv_args.get(key)
        except TypeError:  # lists: checked every time
            key, known = None, None
        if (known is not None and input.dim() == rank + 2 and input.dtype in _bridge.DTYPES
                and input.is_cpu and _one_dtype(input, weight, bias)
                and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0]))):
            args, site = known
            if site is None:
                site = known[1] = forward_site(args)
            if site is not None and native_ready(input, weight, bias):
                return site(input, weight, None, bias)  # the bias added in C++
            y = dispatch("conv_transpose_backward_data", input, weight, *args)
            return _add_bias(y, bias, op)
    unbatched = _inputs(op, rank, input, weight, bias)
    strides = _tuple(op, "stride", stride, rank, 1)
    dilations = _tuple(op, "dilation", dilation, rank, 1)
    pads_begin, pads_end = _pads(op, padding, rank, weight.shape[2:], strides, dilations)
    args = (strides, pads_begin, pads_end, dilations, groups)
    if not torch.compiler.is_compiling() and key is not None:
        if len(_conv_args) >= MAX_CONV_ARGS:
            _conv_args.clear()
        _conv_args[key] = [args, None]
    x = input.unsqueeze(0) if unbatched else input
    y = dispatch("conv_transpose_backward_data", x, weight, *args)
    y = _add_bias(y, bias, op)
    return y.squeeze(0) if unbatched else y


def conv_transpose_nd(rank: int, input, weight, bias, stride, padding, output_padding,
                      groups, dilation) -> torch.Tensor:
    """conv_transpose1d, 2d or 3d by `rank` (the spatial dimensions), with their arguments
    (convgrad.torch.modules' ConvTranspose*d call it with their own)."""
    op = f"conv_transpose{rank}d"
    unbatched = _inputs(op, rank, input, weight, bias)
    strides = _tuple(op, "stride", stride, rank, 1)
    dilations = _tuple(op, "dilation", dilation, rank, 1)
    pads = _tuple(op, "padding", padding, rank, 0)
    extra = _tuple(op, "output_padding", output_padding, rank, 0)
    x = input.unsqueeze(0) if unbatched else input
    y = dispatch("convolution_backward_data", x, weight, None, strides, pads, pads, dilations,
                 groups, extra)
    y = _add_bias(y, bias, op)
    return y.squeeze(0) if unbatched else y


def conv1d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: int | Sequence[int] = 1, padding: Padding = 0,
           dilation: int | Sequence[int] = 1, groups: int = 1) -> torch.Tensor:
    """torch.nn.functional.conv1d on convgrad's kernels (padding may also be
    (begin, end) pairs)."""
    return conv_nd(1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: int | Sequence[int] = 1, padding: Padding = 0,
           dilation: int | Sequence[int] = 1, groups: int = 1) -> torch.Tensor:
    """torch.nn.functional.conv2d on convgrad's kernels (padding may also be
    (begin, end) pairs)."""
    return conv_nd(2, input, weight, bias, stride, padding, dilation, groups)


def conv3d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           stride: int | Sequence[int] = 1, padding: Padding = 0,
           dilation: int | Sequence[int] = 1, groups: int = 1) -> torch.Tensor:
    """torch.nn.functional.conv3d on convgrad's kernels (padding may also be
    (begin, end) pairs)."""
    return conv_nd(3, input, weight, bias, stride, padding, dilation, groups)


def conv_transpose1d(input: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, stride: int | Sequence[int] = 1,
                     padding: int | Sequence[int] = 0,
                     output_padding: int | Sequence[int] = 0, groups: int = 1,
                     dilation: int | Sequence[int] = 1) -> torch.Tensor:
    """torch.nn.functional.conv_transpose1d on convgrad's kernels."""
    return conv_transpose_nd(1, input, weight, bias, stride, padding, output_padding,
                             groups, dilation)


def conv_transpose2d(input: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, stride: int | Sequence[int] = 1,
                     padding: int | Sequence[int] = 0,
                     output_padding: int | Sequence[int] = 0, groups: int = 1,
                     dilation: int | Sequence[int] = 1) -> torch.Tensor:
    """torch.nn.functional.conv_transpose2d on convgrad's kernels."""
    return conv_transpose_nd(2, input, weight, bias, stride, padding, output_padding,
                             groups, dilation)


def conv_transpose3d(input: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, stride: int | Sequence[int] = 1,
                     padding: int | Sequence[int] = 0,
                     output_padding: int | Sequence[int] = 0, groups: int = 1,
                     dilation: int | Sequence[int] = 1) -> torch.Tensor:
    """torch.nn.functional.conv_transpose3d on convgrad's kernels."""
    return conv_transpose_nd(3, input, weight, bias, stride, padding, output_padding,
                             groups, dilation)
