"""Tensors as the kernels see them: validation and memory layouts.

A torch data tensor is logically (N, C, spatial...). In memory it is either that
(contiguous: the kernels' NCX) or (N, spatial..., C) (channels_last: the kernels' NXC,
reached by permuting the tensor, which gives a C-contiguous view). Weights are torch's
(O, I/g, k...) = OIX (IOX for ConvTranspose), contiguous. The kernels read and write
the tensors' own memory; a tensor in another layout is copied into one first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from convgrad import threads

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = "torch.float32, torch.float16 or torch.bfloat16"


def check_tensor(op: str, name: str, value, *, fake: bool = False) -> torch.Tensor:
    """A strided CPU tensor of a kernel dtype, else a TypeError/ValueError naming it.
    Fake (tracing) tensors may also live on the meta device."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} is a {type(value).__name__}; expected a torch.Tensor")
    if value.layout != torch.strided:
        raise TypeError(f"{op}: {name} has layout {value.layout}; expected a dense "
                        "(torch.strided) tensor")
    if value.dtype not in DTYPES:
        raise TypeError(f"{op}: {name} has dtype {value.dtype}; expected {_DTYPE_NAMES}")
    if value.device.type != "cpu" and not (fake and value.device.type == "meta"):
        raise ValueError(f"{op}: {name} is on device {value.device}; convgrad's kernels run "
                         "on CPU tensors only (move it with .cpu())")
    return value


def check_pair(op: str, names: tuple[str, str], a: torch.Tensor, b: torch.Tensor,
               *, fake: bool = False) -> None:
    """Both tensors valid, of one dtype, each of rank 3 to 5 and of the same rank."""
    check_tensor(op, names[0], a, fake=fake)
    check_tensor(op, names[1], b, fake=fake)
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: {names[0]} is {a.dtype} but {names[1]} is {b.dtype}; "
                        "expected one dtype")
    if a.dim() not in (3, 4, 5):
        raise ValueError(f"{op}: {names[0]} has {a.dim()} dimensions; expected 3, 4 or 5 "
                         "(N, C and 1 to 3 spatial axes)")
    if b.dim() != a.dim():
        raise ValueError(f"{op}: {names[1]} has {b.dim()} dimensions; expected {a.dim()}, "
                         f"as {names[0]} has")


def _to_last(rank: int) -> tuple[int, ...]:
    """Permutation of (N, C, spatial...) to (N, spatial..., C)."""
    return (0, *range(2, rank), 1)


def _to_first(rank: int) -> tuple[int, ...]:
    """Permutation of (N, spatial..., C) back to (N, C, spatial...)."""
    return (0, rank - 1, *range(1, rank - 1))


def _dense_nxc(t: torch.Tensor) -> bool:
    return t.permute(_to_last(t.dim())).is_contiguous()


def _strides_fall(t: torch.Tensor, order: Sequence[int]) -> bool:
    strides = [t.stride(i) for i in order]
    return all(a >= b for a, b in zip(strides, strides[1:], strict=False))


def _made_channels_last(t: torch.Tensor) -> bool:
    """Whether t's strides say channels_last even where sizes of 1 make both layouts
    dense (torch gives a one-channel channels_last tensor channel stride 1)."""
    return _strides_fall(t, _to_last(t.dim())) and not _strides_fall(t, range(t.dim()))


def data_format(t: torch.Tensor, hint: torch.Tensor | None = None) -> str:
    """The kernel layout that reads `t` in place: "NCX" (contiguous) or "NXC"
    (channels_last). A tensor dense in both (one channel, or one pixel) is NXC when
    its strides are channels_last's, or else when `hint`'s are (channels_last
    weights, or another data tensor), so that a channels_last model stays so. Any
    other layout is copied to the layout its channel stride suggests."""
    ncx, nxc = t.is_contiguous(), _dense_nxc(t)
    if ncx and nxc:
        if _made_channels_last(t):
            return "NXC"
        if hint is not None and hint.dim() >= 3 and _made_channels_last(hint):
            return "NXC"
        return "NCX"
    if ncx:
        return "NCX"
    if nxc:
        return "NXC"
    return "NXC" if t.stride(1) == 1 and t.size(1) > 1 else "NCX"


def is_dense(t: torch.Tensor, fmt: str | None) -> bool:
    """Whether the kernel reads `t` in place in layout `fmt` (NXC: channels last, also
    weights stored (A, k..., B); NCX or None: contiguous)."""
    return _dense_nxc(t) if fmt == "NXC" else t.is_contiguous()


def dense(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """`t` itself, or a copy whose memory is layout `fmt` ("NXC", "NCX", or "OIX" for
    weights), in torch's logical order either way."""
    if fmt == "NXC":
        rank = t.dim()
        return t.permute(_to_last(rank)).contiguous().permute(_to_first(rank))
    return t.contiguous()


def kernel_shape(t: torch.Tensor, fmt: str | None) -> tuple[int, ...]:
    """The shape the kernel sees `t` in: (N, spatial..., C) for NXC, else torch's."""
    if fmt == "NXC":
        return tuple(t.shape[i] for i in _to_last(t.dim()))
    return tuple(t.shape)


def new_data(shape: Sequence[int], fmt: str, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised (N, C, spatial...) tensor whose memory is in layout `fmt`."""
    if fmt == "NXC":
        rank = len(shape)
        stored = torch.empty([shape[i] for i in _to_last(rank)], dtype=like.dtype,
                             device=like.device)
        return stored.permute(_to_first(rank))
    return torch.empty(list(shape), dtype=like.dtype, device=like.device)


def new_weights(shape: Sequence[int], like: torch.Tensor, inner: bool = False) -> torch.Tensor:
    """An uninitialised weights tensor (A, B, k...): contiguous, or with `inner` stored
    (A, k..., B) as torch's channels_last weights are."""
    if inner:
        rank = len(shape)
        stored = torch.empty([shape[i] for i in _to_last(rank)], dtype=like.dtype,
                             device=like.device)
        return stored.permute(_to_first(rank))
    return torch.empty(list(shape), dtype=like.dtype, device=like.device)


def weights_inner(t: torch.Tensor) -> bool:
    """Whether weights (A, B, k...) are stored (A, k..., B) (torch's channels_last) and
    not also contiguous (one tap: the same memory either way)."""
    return not t.is_contiguous() and _dense_nxc(t)


def inner_weight_results(fmt: str, rank: int) -> bool:
    """Whether a weight gradient of data in layout `fmt` with `rank` dimensions is stored
    (A, k..., B): channels_last data (4-D, 5-D) has channels_last parameters, as
    `model.to(memory_format=torch.channels_last)` makes them (3-D tensors have none)."""
    return fmt == "NXC" and rank >= 4


def num_threads() -> int:
    """Threads of a kernel call: convgrad.set_num_threads if it was called, else
    PyTorch's intra-op thread count (torch.set_num_threads governs both libraries)."""
    return threads.default_count or torch.get_num_threads()
