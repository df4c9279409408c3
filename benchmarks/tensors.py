"""convgrad's arrays as PyTorch's tensors and back, in the same dtype and memory layout."""

from __future__ import annotations

import ml_dtypes
import numpy as np

try:
    import torch
except ImportError:  # the benchmarks that need PyTorch say so (bench.parse_args)
    torch = None


def torch_dtype(dtype: str) -> torch.dtype:
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]


def memory_format(rank: int, data_format: str) -> tuple[torch.memory_format, str]:
    """PyTorch's memory format for a data format, and a description of it."""
    if data_format == "NCX":
        return torch.contiguous_format, "contiguous"
    if rank == 2:
        return torch.channels_last, "channels_last"
    if rank == 3:
        return torch.channels_last_3d, "channels_last_3d"
    return torch.contiguous_format, "contiguous NCW (PyTorch has no channels_last for 1D)"


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    if array.dtype == ml_dtypes.bfloat16:  # torch.from_numpy does not know ml_dtypes
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def data_to_torch(array: np.ndarray, data_format: str, fmt: torch.memory_format
                  ) -> torch.Tensor:
    """A convgrad data array as a PyTorch (N, C, *X) tensor in memory format `fmt`."""
    tensor = _from_numpy(array)
    if data_format == "NXC":
        rank = array.ndim - 2
        tensor = tensor.permute(0, rank + 1, *range(1, rank + 1))
    return tensor.contiguous(memory_format=fmt)


def weights_to_torch(array: np.ndarray, weights_format: str, fmt: torch.memory_format
                     ) -> torch.Tensor:
    """convgrad weights (OIX, XIO or OXI) as a PyTorch (O, I/g, *K) tensor."""
    tensor = _from_numpy(array)
    rank = array.ndim - 2
    if weights_format == "XIO":
        tensor = tensor.permute(rank + 1, rank, *range(rank))
    elif weights_format == "OXI":
        tensor = tensor.permute(0, rank + 1, *range(1, rank + 1))
    return tensor.contiguous(memory_format=fmt)


def data_from_torch(tensor: torch.Tensor, data_format: str) -> np.ndarray:
    """A PyTorch (N, C, *X) result as f32 numpy in convgrad's data format."""
    if data_format == "NXC":
        tensor = tensor.permute(0, *range(2, tensor.dim()), 1)
    return tensor.float().contiguous().numpy()


def weights_from_torch(tensor: torch.Tensor, weights_format: str) -> np.ndarray:
    """A PyTorch (O, I/g, *K) result as f32 numpy in convgrad's weights format."""
    if weights_format == "XIO":
        tensor = tensor.permute(*range(2, tensor.dim()), 1, 0)
    elif weights_format == "OXI":
        tensor = tensor.permute(0, *range(2, tensor.dim()), 1)
    return tensor.float().contiguous().numpy()
