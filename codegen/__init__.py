"""convgrad code generator: kernel configurations, shape rules and C rendering.

Pure: no compiler, no files besides the templates, no arrays.
"""

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.ops import OPS, Problem, resolve
from convgrad.codegen.render import generator_version, render, render_prelude, source_digest

__all__ = ["OPS", "KernelConfig", "Problem", "render", "render_prelude", "generator_version",
           "resolve", "source_digest"]
