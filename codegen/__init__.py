"""convgrad code generator: kernel configurations, shape rules and C rendering.

Pure: no compiler, no files besides the templates, no arrays.
"""

from codegen.config import KernelConfig
from codegen.ops import OPS, Problem, resolve
from codegen.render import generator_version, render

__all__ = ["OPS", "KernelConfig", "Problem", "render", "generator_version", "resolve"]
