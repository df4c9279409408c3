"""The models of benchmarks.jax_train_step (its docstring describes them), in plain JAX:
a ResNet-18 and a MobileNetV2 as functions of a parameter pytree and of the conv
function, NHWC data and HWIO weights, written after torchvision's architectures and
benchmarks/models.py (whose torch.nn modules this does not import). Parameters start in
float32 from one numpy generator (`Init`); jax is imported when a model is applied.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

MODELS = ("resnet18", "mobilenet_v2")
CLASSES = 1000
# MobileNetV2's inverted residual rows: expansion, channels, blocks, first stride
MOBILENET_ROWS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                  (6, 160, 3, 2), (6, 320, 1, 1))
RESNET_BLOCKS = (2, 2, 2, 2)


def divisible(value: float, divisor: int = 8) -> int:
    """torchvision's _make_divisible: the nearest multiple of `divisor`, not below 90%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class Init:
    """Parameters from one numpy generator, in float32 (cast to the model's dtype later)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def conv(self, k: int, c_in: int, c_out: int, groups: int = 1) -> np.ndarray:
        """HWIO weights, He-normal in fan-out (torchvision's kaiming_normal_)."""
        std = math.sqrt(2.0 / (c_out * k * k // groups))
        return (self.rng.standard_normal((k, k, c_in // groups, c_out)) * std).astype(np.float32)

    @staticmethod
    def bn(channels: int) -> dict:
        return {"scale": np.ones(channels, np.float32), "bias": np.zeros(channels, np.float32)}

    def dense(self, c_in: int, c_out: int) -> dict:
        bound = 1 / math.sqrt(c_in)
        return {"w": self.rng.uniform(-bound, bound, (c_in, c_out)).astype(np.float32),
                "b": np.zeros(c_out, np.float32)}


def _conv(conv: Callable, x, w, stride: int = 1, groups: int = 1):
    pad = w.shape[0] // 2
    return conv(x, w, (stride, stride), [(pad, pad), (pad, pad)],
                dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups)


def _batch_norm(x, p, eps: float = 1e-5):
    import jax.numpy as jnp
    from jax import lax

    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=(0, 1, 2))
    var = jnp.square(x32 - mean).mean(axis=(0, 1, 2))
    return ((x32 - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]).astype(x.dtype)


def _head(x, p):
    import jax.numpy as jnp

    pooled = x.astype(jnp.float32).mean(axis=(1, 2)).astype(x.dtype)
    return (pooled @ p["w"]).astype(jnp.float32) + p["b"]


@dataclass
class Model:
    """A model's static structure (`apply` closes over it) and its initial parameters."""

    name: str
    params: dict
    apply: Callable  # (params, x, conv) -> logits (float32)
    convolutions: int


def resnet18(width_mult: float = 1.0, blocks: Sequence[int] = RESNET_BLOCKS) -> Model:
    init, width = Init(), divisible(64 * width_mult)
    params = {"stem": init.conv(7, 3, width), "stem_bn": init.bn(width), "blocks": []}
    strides, channels = [], width
    for stage, count in enumerate(blocks):
        base = width * 2 ** stage
        for number in range(count):
            stride = 2 if stage > 0 and number == 0 else 1
            block = {"conv1": init.conv(3, channels, base), "bn1": init.bn(base),
                     "conv2": init.conv(3, base, base), "bn2": init.bn(base)}
            if stride != 1 or channels != base:
                block["down"], block["down_bn"] = init.conv(1, channels, base), init.bn(base)
            params["blocks"].append(block)
            strides.append(stride)
            channels = base
    params["head"] = init.dense(channels, CLASSES)

    def apply(p, x, conv):
        import jax
        from jax import lax

        x = jax.nn.relu(_batch_norm(_conv(conv, x, p["stem"], 2), p["stem_bn"]))
        x = lax.reduce_window(x, -np.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                              ((0, 0), (1, 1), (1, 1), (0, 0)))
        for block, stride in zip(p["blocks"], strides, strict=True):
            out = jax.nn.relu(_batch_norm(_conv(conv, x, block["conv1"], stride), block["bn1"]))
            out = _batch_norm(_conv(conv, out, block["conv2"]), block["bn2"])
            if "down" in block:
                x = _batch_norm(_conv(conv, x, block["down"], stride), block["down_bn"])
            x = jax.nn.relu(out + x)
        return _head(x, p["head"])

    count = 1 + sum(2 + ("down" in b) for b in params["blocks"])
    return Model("resnet18", params, apply, count)


def mobilenet_v2(width_mult: float = 1.0, blocks: Sequence[int] | None = None) -> Model:
    init = Init()
    rows = MOBILENET_ROWS if blocks is None else [
        (t, c, n, s) for (t, c, _, s), n in zip(MOBILENET_ROWS, blocks, strict=False)]
    channels = divisible(32 * width_mult)
    params = {"stem": init.conv(3, 3, channels), "stem_bn": init.bn(channels), "blocks": []}
    shapes = []  # (stride, expanded, residual) per block
    for expand, c, count, first_stride in rows:
        out = divisible(c * width_mult)
        for number in range(count):
            stride, hidden = first_stride if number == 0 else 1, channels * expand
            block = {}
            if expand != 1:
                block["expand"], block["expand_bn"] = init.conv(1, channels, hidden), \
                    init.bn(hidden)
            block["dw"], block["dw_bn"] = init.conv(3, hidden, hidden, hidden), init.bn(hidden)
            block["project"], block["project_bn"] = init.conv(1, hidden, out), init.bn(out)
            params["blocks"].append(block)
            shapes.append((stride, hidden, stride == 1 and channels == out))
            channels = out
    last = divisible(1280 * max(1.0, width_mult))
    params["last"], params["last_bn"] = init.conv(1, channels, last), init.bn(last)
    params["head"] = init.dense(last, CLASSES)

    def apply(p, x, conv):
        import jax

        def relu6(v):
            return jax.nn.relu6(v)

        x = relu6(_batch_norm(_conv(conv, x, p["stem"], 2), p["stem_bn"]))
        for block, (stride, hidden, residual) in zip(p["blocks"], shapes, strict=True):
            out = x
            if "expand" in block:
                out = relu6(_batch_norm(_conv(conv, out, block["expand"]), block["expand_bn"]))
            out = relu6(_batch_norm(_conv(conv, out, block["dw"], stride, hidden),
                                    block["dw_bn"]))
            out = _batch_norm(_conv(conv, out, block["project"]), block["project_bn"])
            x = x + out if residual else out
        x = relu6(_batch_norm(_conv(conv, x, p["last"]), p["last_bn"]))
        return _head(x, p["head"])

    count = 2 + sum(2 + ("expand" in b) for b in params["blocks"])
    return Model("mobilenet_v2", params, apply, count)


def build(name: str, args: argparse.Namespace) -> Model:
    if name == "resnet18":
        return resnet18(args.width_mult, args.blocks or RESNET_BLOCKS)
    return mobilenet_v2(args.width_mult, args.blocks)
