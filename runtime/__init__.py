"""convgrad: specialized C kernels for the gradient ops of convolution.

The public API validates numpy arrays, infers shapes and pads, and runs the
generated kernels (compiled on demand and cached on disk, or built ahead of time
with `convgrad aot`). Subpackages: `convgrad.codegen` (configurations, shape rules,
C rendering; pure), `convgrad.templates` (the Jinja2 templates),
`convgrad.reference` (the slow, obviously correct numpy implementation of every
op, to validate against) and `convgrad.torch` (custom ops, modules and autograd for
PyTorch; imported on first use, needs `pip install convgrad[torch]`).
"""

import logging

from convgrad.api import (
    conv_transpose_backward_data,
    conv_transpose_backward_weights,
    convolution_backprop_data,
    convolution_backprop_filters,
    convolution_backward_data,
    convolution_backward_weights,
    execute,
    infer_shape,
)
from convgrad.threads import get_num_threads, set_num_threads

logging.getLogger("convgrad").addHandler(logging.NullHandler())


def __getattr__(name: str):
    """`convgrad.torch` is imported on first use, so that `import convgrad` never
    imports PyTorch."""
    if name == "torch":
        import importlib

        return importlib.import_module("convgrad.torch")
    raise AttributeError(f"module 'convgrad' has no attribute {name!r}")

__all__ = [
    "conv_transpose_backward_data",
    "conv_transpose_backward_weights",
    "convolution_backprop_data",
    "convolution_backprop_filters",
    "convolution_backward_data",
    "convolution_backward_weights",
    "execute",
    "get_num_threads",
    "infer_shape",
    "set_num_threads",
]
