"""Equinox models on convgrad's kernels: `convert(model)`.

`equinox.nn.Conv` (Conv1d/2d/3d) and `equinox.nn.ConvTranspose` (ConvTranspose1d/2d/3d)
call `jax.lax.conv_general_dilated` themselves, so unlike flax.nnx.Conv they take no
convolution function. `convert` returns a copy of a model (any pytree) in which each of
them is a subclass of its class with the same fields, parameters and padding rules
whose `__call__` runs `convgrad.jax.conv_general_dilated` with the arguments Equinox
passes to lax: the same results, and on the CPU convgrad's kernels for the forward pass
and both gradients (what no kernel covers runs lax; see `convgrad.jax.explain`).

    import convgrad.jax.equinox as cge
    model = cge.convert(model)  # then jit, grad and vmap it as before

A converted eqx.nn.Conv2d is this module's `Conv2d`, a subclass of it (isinstance
holds; likewise for the others), with the original's leaves: `eqx.tree_serialise_leaves`
files load into either. Layers of user subclasses of these classes are left as they are
(their `__call__` may compute something else).
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, cast

try:
    import equinox as eqx
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("convgrad.jax.equinox needs Equinox: pip install equinox") from error

import jax
import jax.numpy as jnp

from convgrad.jax import conv_general_dilated

T = TypeVar("T")

__all__ = ["Conv", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose", "ConvTranspose1d",
           "ConvTranspose2d", "ConvTranspose3d", "convert"]


def _copy_fields(new, module) -> None:
    for field in dataclasses.fields(module):
        setattr(new, field.name, getattr(module, field.name))


def _check_rank(module, x: jax.Array, name: str) -> None:
    rank = module.num_spatial_dims + 1
    if x.ndim != rank:
        raise ValueError(f"Input to `{name}` needs to have rank {rank}, but input has "
                         f"shape {x.shape}.")


class Conv(eqx.nn.Conv):
    """An `equinox.nn.Conv` (the same fields) whose convolution runs on convgrad."""

    def __init__(self, conv: eqx.nn.Conv):
        """A copy of `conv`, sharing its weight and bias arrays."""
        _copy_fields(self, conv)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """As `equinox.nn.Conv.__call__`: `x` of shape (in_channels, dim_1, ..., dim_N),
        unbatched (vmap it for a batch); returns (out_channels, new_dim_1, ...)."""
        del key
        _check_rank(self, x, "Conv")
        padding = self.padding
        if self.padding_mode != "ZEROS":  # reflect, replicate, wrap: padded before
            x, padding = self._nonzero_pad(x), "VALID"
        y = conv_general_dilated(jnp.expand_dims(x, 0), self.weight, self.stride, padding,
                                 rhs_dilation=self.dilation,
                                 feature_group_count=self.groups)
        y = jnp.squeeze(y, axis=0)
        return y + cast(jax.Array, self.bias) if self.use_bias else y


class ConvTranspose(eqx.nn.ConvTranspose):
    """An `equinox.nn.ConvTranspose` (the same fields) whose convolution runs on
    convgrad (the input-dilated convolution Equinox computes, on the data-gradient
    kernel)."""

    def __init__(self, conv: eqx.nn.ConvTranspose):
        """A copy of `conv`, sharing its weight and bias arrays."""
        _copy_fields(self, conv)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """As `equinox.nn.ConvTranspose.__call__`: `x` unbatched, of shape
        (in_channels, dim_1, ..., dim_N); returns (out_channels, new_dim_1, ...)."""
        del key
        _check_rank(self, x, "ConvTranspose")
        padding = self._padding_transpose()
        if self.padding_mode == "CIRCULAR":
            x, padding = self._circular_pad(x, padding)
        y = conv_general_dilated(jnp.expand_dims(x, 0), self.weight,
                                 (1,) * self.num_spatial_dims, padding,
                                 lhs_dilation=self.stride, rhs_dilation=self.dilation,
                                 feature_group_count=self.groups)
        y = jnp.squeeze(y, axis=0)
        return y + cast(jax.Array, self.bias) if self.use_bias else y


class Conv1d(Conv, eqx.nn.Conv1d):
    """An `equinox.nn.Conv1d` on convgrad (see `Conv`)."""


class Conv2d(Conv, eqx.nn.Conv2d):
    """An `equinox.nn.Conv2d` on convgrad (see `Conv`)."""


class Conv3d(Conv, eqx.nn.Conv3d):
    """An `equinox.nn.Conv3d` on convgrad (see `Conv`)."""


class ConvTranspose1d(ConvTranspose, eqx.nn.ConvTranspose1d):
    """An `equinox.nn.ConvTranspose1d` on convgrad (see `ConvTranspose`)."""


class ConvTranspose2d(ConvTranspose, eqx.nn.ConvTranspose2d):
    """An `equinox.nn.ConvTranspose2d` on convgrad (see `ConvTranspose`)."""


class ConvTranspose3d(ConvTranspose, eqx.nn.ConvTranspose3d):
    """An `equinox.nn.ConvTranspose3d` on convgrad (see `ConvTranspose`)."""


# Equinox's classes (exactly: a user's subclass may compute something else) -> ours
_REPLACEMENTS: dict[type, type] = {
    eqx.nn.Conv: Conv, eqx.nn.Conv1d: Conv1d, eqx.nn.Conv2d: Conv2d, eqx.nn.Conv3d: Conv3d,
    eqx.nn.ConvTranspose: ConvTranspose, eqx.nn.ConvTranspose1d: ConvTranspose1d,
    eqx.nn.ConvTranspose2d: ConvTranspose2d, eqx.nn.ConvTranspose3d: ConvTranspose3d}


def convert(model: T) -> T:
    """A copy of `model` (an Equinox module or any pytree) with every `equinox.nn.Conv`,
    Conv1d/2d/3d, ConvTranspose and ConvTranspose1d/2d/3d replaced by a layer with the
    same fields and arrays that runs convgrad's kernels. Nothing is copied but the
    layers' containers; the model itself is unchanged. Converting twice changes nothing
    more."""

    def is_layer(node) -> bool:
        return type(node) in _REPLACEMENTS

    def replace(node):
        return _REPLACEMENTS[type(node)](node) if is_layer(node) else node

    return jax.tree_util.tree_map(replace, model, is_leaf=is_layer)
