"""convgrad inside PyTorch (`pip install convgrad[torch]`).

- `convgrad.torch.ops`: the six ops of docs/semantics.md as PyTorch custom ops
  (`torch.ops.convgrad.<name>`) on CPU tensors of float32, float16 and bfloat16,
  contiguous or channels_last, with fake implementations (torch.compile) and autograd;
  the same names here take scalar attributes.
- `convgrad.torch.functional`: conv1d/2d/3d and conv_transpose1d/2d/3d with
  torch.nn.functional's arguments.
- Modules `Conv1d/2d/3d` and `ConvTranspose1d/2d/3d`: torch.nn's, running convgrad's
  kernels for the forward pass, the data gradient and the weight gradient.
- `convert(model)`: swaps every supported convolution of a model in place and reports
  what it left alone and why.
- `compile_kernels(model, *example_inputs)`: builds a step's kernels at once, before it.
- `aot_kernels(model, *example_inputs, output=DIR)`: builds a step's kernels into an
  AOT folder (`convgrad aot --torch-model`), for a deployment with no compiler.
- Kernels not built yet: the call runs on PyTorch's own operator while the kernel
  compiles in the background (CONVGRAD_COMPILE=background, the default here), or waits
  for it (`block`); `set_compile_mode` sets it in-process.
"""

try:
    import torch
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("convgrad.torch needs PyTorch: install it with "
                      "`pip install convgrad[torch]` (torch==2.13.0)") from error

if not hasattr(torch.library, "custom_op"):  # pragma: no cover
    raise ImportError(f"convgrad.torch needs torch.library.custom_op (PyTorch >= 2.4; "
                      f"tested with 2.13.0); this is PyTorch {torch.__version__}: "
                      "`pip install convgrad[torch]`")

from convgrad.background import set_mode as set_compile_mode  # noqa: E402
from convgrad.torch import functional, ops  # noqa: E402
from convgrad.torch.aot import aot_kernels  # noqa: E402
from convgrad.torch.modules import (  # noqa: E402
    Conv1d,
    Conv2d,
    Conv3d,
    ConversionReport,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    convert,
)
from convgrad.torch.ops import (  # noqa: E402
    OPS,
    conv_transpose_backward_data,
    conv_transpose_backward_weights,
    convolution_backprop_data,
    convolution_backprop_filters,
    convolution_backward_data,
    convolution_backward_weights,
)
from convgrad.torch.warmup import compile_kernels  # noqa: E402

__all__ = [
    "OPS",
    "ConversionReport",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "aot_kernels",
    "compile_kernels",
    "conv_transpose_backward_data",
    "conv_transpose_backward_weights",
    "convert",
    "convolution_backprop_data",
    "convolution_backprop_filters",
    "convolution_backward_data",
    "convolution_backward_weights",
    "functional",
    "ops",
    "set_compile_mode",
]
