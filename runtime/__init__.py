"""convgrad runtime: validates numpy arrays, infers shapes and pads, and runs the
generated kernels (compiled on demand and cached on disk, or built ahead of time).
"""

import logging

from runtime.api import (
    conv_transpose_backward_data,
    conv_transpose_backward_weights,
    convolution_backprop_data,
    convolution_backprop_filters,
    convolution_backward_data,
    convolution_backward_weights,
    execute,
    get_num_threads,
    infer_shape,
    set_num_threads,
)

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
