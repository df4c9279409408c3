"""convgrad: specialized C kernels for the gradient ops of convolution.

The public API validates numpy arrays, infers shapes and pads, and runs the
generated kernels (compiled on demand and cached on disk, or built ahead of time
with `convgrad aot`). Subpackages: `convgrad.codegen` (configurations, shape rules,
C rendering; pure), `convgrad.templates` (the Jinja2 templates) and
`convgrad.reference` (the slow, obviously correct numpy implementation of every
op, to validate against).
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
