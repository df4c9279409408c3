"""PyTorch's own convolutions standing in for a kernel that is still being compiled.

`compute(spec, out, a, b, ...)` writes into `out` (allocated as the kernel's result
would be) what the op computes, with torch's operators: the forward convolution for
ConvTransposeBackwardData, a transposed convolution cropped or zero-extended to the
result for the data gradients, and `aten.convolution_backward`'s weight gradient for
the weight gradients (the ConvTranspose one with its data tensors' roles swapped).
Asymmetric pads are explicit `F.pad`s (negative ones crop). Low-precision inputs are
widened to float32 first, so the result is rounded once, as the kernels round it; the
sums run in oneDNN's order, so a stand-in's result can differ from the kernel's in the
last bits of float32 (bf16/f16: in the rounding of a value near a tie).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from convgrad.codegen.ops import OpSpec


def _pads(begin: Sequence[int], end: Sequence[int]) -> list[int]:
    """F.pad's argument: (begin, end) per spatial axis, the last axis first."""
    pads: list[int] = []
    for b, e in zip(reversed(list(begin)), reversed(list(end)), strict=True):
        pads += [b, e]
    return pads


def _weight_gradient(x: torch.Tensor, dy: torch.Tensor, shape, strides, pads_begin,
                     pads_end, dilations, groups) -> torch.Tensor:
    """The weight gradient (O, I/g, k...) of a convolution of `x` giving `dy`."""
    rank = x.dim() - 2
    padding = list(pads_begin)
    if list(pads_begin) != list(pads_end):
        x, padding = F.pad(x, _pads(pads_begin, pads_end)), [0] * rank
    weight = torch.empty(shape, dtype=x.dtype)
    return torch.ops.aten.convolution_backward(
        dy, x, weight, None, list(strides), padding, list(dilations), False, [0] * rank,
        groups, [False, True, False])[1]


def _forward_gives(size: Sequence[int], result: Sequence[int], weight: torch.Tensor,
                   strides, pads, dilations) -> bool:
    """Whether a convolution (symmetric `pads`) of an input of spatial `size` has the
    spatial size `result`."""
    kernel = weight.shape[2:]
    return all((x + 2 * p - d * (k - 1) - 1) // s + 1 == y for x, y, k, s, p, d in zip(
        size, result, kernel, strides, pads, dilations, strict=True))


def compute(spec: OpSpec, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, shape,
            strides, pads_begin, pads_end, dilations, groups, output_padding=None) -> None:
    """`out` = the op `spec` of (a, b) by torch's operators (see the module's text).
    Symmetric pads go to the operators as their padding; only asymmetric ones are
    copies (F.pad)."""
    del shape, output_padding  # the result's shape (out) says all they say
    a, b = a.detach().float(), b.detach().float()
    rank = a.dim() - 2
    symmetric = list(pads_begin) == list(pads_end)
    if spec.family == "fwd":  # a: the convolution's input, b: its (O, I/g, k...) weight
        padding = list(pads_begin)
        if not symmetric:
            a, padding = F.pad(a, _pads(pads_begin, pads_end)), [0] * rank
        result = torch.ops.aten.convolution(a, b, None, list(strides), padding,
                                            list(dilations), False, [0] * rank, groups)
    elif spec.family == "bwd_data" and symmetric and _forward_gives(
            out.shape[2:], a.shape[2:], b, strides, pads_begin, dilations):
        # a: diff_dst, b: the weight; the result is the input gradient of the convolution
        # that gives diff_dst from an input of its shape (only the shape is read)
        like = out if out.dtype == torch.float32 else torch.empty_like(out, dtype=torch.float32)
        result = torch.ops.aten.convolution_backward(
            a, like, b, None, list(strides), list(pads_begin), list(dilations), False,
            [0] * rank, groups, [True, False, False])[0]
    elif spec.family == "bwd_data":  # a: diff_dst, b: the (O, I/g, k...) weight
        full = torch.ops.aten.convolution(a, b, None, list(strides), [0] * rank,
                                          list(dilations), True, [0] * rank, groups)
        # the result's position i is the full transposed convolution's i + pads_begin
        result = F.pad(full, _pads([-p for p in pads_begin],
                                   [y - f + p for y, f, p in zip(
                                       out.shape[2:], full.shape[2:], pads_begin,
                                       strict=True)]))
    elif spec.transpose:  # ConvTransposeBackwardWeights: a src (N, IC, X), b diff_dst
        result = _weight_gradient(b, a, tuple(out.shape), strides, pads_begin, pads_end,
                                  dilations, groups)
    else:  # a src, b diff_dst
        result = _weight_gradient(a, b, tuple(out.shape), strides, pads_begin, pads_end,
                                  dilations, groups)
    out.copy_(result)
