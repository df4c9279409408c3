"""PyTorch's own convolutions standing in for a kernel that is still being compiled.

`compute(spec, out_shape, out_strides, a, b, ...)` returns what the op computes, with
the shape, strides and dtype of the kernel's result (torch's own result where it has them,
else a copy), with torch's operators: the forward convolution for
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
from convgrad.codegen.shapes import conv_output_spatial


def _pads(begin: Sequence[int], end: Sequence[int]) -> list[int]:
    """F.pad's argument: (begin, end) per spatial axis, the last axis first."""
    pads: list[int] = []
    for b, e in zip(reversed(list(begin)), reversed(list(end)), strict=True):
        pads += [b, e]
    return pads


def _weight_gradient(x: torch.Tensor, dy: torch.Tensor, like: torch.Tensor, strides,
                     pads_begin, pads_end, dilations, groups) -> torch.Tensor:
    """The weight gradient (O, I/g, k...) of a convolution of `x` giving `dy`, in the
    memory format of `like` (a weight of its shape, only its shape and strides read)."""
    rank = x.dim() - 2
    padding = list(pads_begin)
    if list(pads_begin) != list(pads_end):
        x, padding = F.pad(x, _pads(pads_begin, pads_end)), [0] * rank
    return torch.ops.aten.convolution_backward(
        dy, x, like, None, list(strides), padding, list(dilations), False, [0] * rank,
        groups, [False, True, False])[1]


def compute(spec: OpSpec, out_shape: Sequence[int], out_strides: Sequence[int],
            a: torch.Tensor, b: torch.Tensor, shape, strides, pads_begin, pads_end,
            dilations, groups, output_padding=None) -> torch.Tensor:
    """The op `spec` of (a, b) by torch's operators (see the module's text), with shape
    `out_shape`, strides `out_strides` and a's dtype. Symmetric pads go to the
    operators as their padding; only asymmetric ones are copies (F.pad)."""
    del shape, output_padding  # the result's shape says all they say
    dtype = a.dtype
    a, b = a.detach().float(), b.detach().float()
    rank = a.dim() - 2
    symmetric = list(pads_begin) == list(pads_end)

    def like() -> torch.Tensor:
        """The result's layout in float32, which torch's gradients follow (only read)."""
        return torch.empty_strided(out_shape, out_strides, dtype=torch.float32)

    if spec.family == "fwd":  # a: the convolution's input, b: its (O, I/g, k...) weight
        padding = list(pads_begin)
        if not symmetric:
            a, padding = F.pad(a, _pads(pads_begin, pads_end)), [0] * rank
        result = torch.ops.aten.convolution(a, b, None, list(strides), padding,
                                            list(dilations), False, [0] * rank, groups)
    elif spec.family == "bwd_data" and symmetric and list(a.shape[2:]) == conv_output_spatial(
            out_shape[2:], b.shape[2:], strides, dilations, pads_begin, pads_end):
        # a: diff_dst, b: the weight; the result is the input gradient of the convolution
        # that gives diff_dst from an input of its shape (only the shape is read)
        result = torch.ops.aten.convolution_backward(
            a, like(), b, None, list(strides), list(pads_begin), list(dilations), False,
            [0] * rank, groups, [True, False, False])[0]
    elif spec.family == "bwd_data":  # a: diff_dst, b: the (O, I/g, k...) weight
        full = torch.ops.aten.convolution(a, b, None, list(strides), [0] * rank,
                                          list(dilations), True, [0] * rank, groups)
        # the result's position i is the full transposed convolution's i + pads_begin
        result = F.pad(full, _pads([-p for p in pads_begin],
                                   [y - f + p for y, f, p in zip(
                                       out_shape[2:], full.shape[2:], pads_begin,
                                       strict=True)]))
    elif spec.transpose:  # ConvTransposeBackwardWeights: a src (N, IC, X), b diff_dst
        result = _weight_gradient(b, a, like(), strides, pads_begin, pads_end, dilations,
                                  groups)
    else:  # a src, b diff_dst
        result = _weight_gradient(a, b, like(), strides, pads_begin, pads_end, dilations,
                                  groups)
    if (result.dtype == dtype and tuple(result.shape) == tuple(out_shape)
            and tuple(result.stride()) == tuple(out_strides)):
        return result
    out = torch.empty_strided(out_shape, out_strides, dtype=dtype)
    out.copy_(result)  # into the kernel's layout (and rounded once, for low precision)
    return out
