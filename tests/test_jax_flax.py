"""Flax and Equinox on convgrad's kernels: flax.nnx.Conv given
`conv_general_dilated=convgrad.jax.conv_general_dilated`, and Equinox models converted
by `convgrad.jax.equinox.convert`, compute what they compute on lax (on integer data
and weights, whose sums are exact: equal results and equal gradients, of the input and
of every parameter), with every convolution on a kernel; and examples/jax_digits.py
trains the same curve on both.

Each test checks that its convolutions ran convgrad's primitives (`convgrad_...` in the
jaxpr) and a kernel that could not be built (which lowers to lax's convolution with a
warning) fails it. The shapes are few and small: each configuration compiles three
kernels the first time it is seen.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import convgrad.jax as cgj  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error:convgrad.jax. kernel")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def integers(shape, seed: int) -> jax.Array:
    """float32 integers in [-3, 3]."""
    return jnp.asarray(np.random.RandomState(seed).randint(-3, 4, shape), jnp.float32)


def kernel_primitives(jaxpr) -> set[str]:
    """The names of convgrad's primitives in a (closed) jaxpr, inner jaxprs included."""
    return set(re.findall(r"\bconvgrad_\w+", str(jaxpr)))


ALL_THREE = {"convgrad_ConvTransposeBackwardData", "convgrad_ConvolutionBackwardData",
             "convgrad_ConvolutionBackwardWeights"}


def integer_leaves(tree, seed: int = 1):
    """`tree` with integers in [-3, 3] for its jax.ShapeDtypeStruct leaves."""
    leaves, structure = jax.tree.flatten(tree)
    return jax.tree.unflatten(structure, [
        integers(leaf.shape, seed + i) if isinstance(leaf, jax.ShapeDtypeStruct) else leaf
        for i, leaf in enumerate(leaves)])


def assert_trees_equal(ours, theirs):
    leaves, reference = jax.tree.leaves(ours), jax.tree.leaves(theirs)
    assert len(leaves) == len(reference)
    for a, b in zip(leaves, reference, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- flax.nnx.Conv -------------------------------------------------------------------

FLAX_CASES = {
    # name: (input shape NXC, nnx.Conv keyword arguments); the 2-D ones have the
    # channels, kernel sizes, strides and groups of the digits example's second and
    # third layers, so that their kernels serve both
    "2d-strided-same": ((2, 8, 8, 16), dict(out_features=32, kernel_size=(3, 3),
                                            strides=2, padding="SAME")),
    "2d-grouped-pairs": ((2, 5, 6, 32), dict(out_features=32, kernel_size=(3, 3),
                                             padding=((1, 2), (0, 1)),
                                             feature_group_count=4)),
    "1d-valid-depthwise-dilated": ((2, 9, 4), dict(out_features=4, kernel_size=(3,),
                                                   padding="VALID", kernel_dilation=2,
                                                   feature_group_count=4)),
}


def flax_conv(in_features: int, kwargs: dict, function):
    """An nnx.Conv running `function`, of integer parameters (made from shapes: no random
    initialisation to compile)."""
    from flax import nnx

    layer = nnx.eval_shape(lambda: nnx.Conv(in_features, rngs=nnx.Rngs(0),
                                            conv_general_dilated=function, **kwargs))
    layer.kernel = nnx.Param(integers(layer.kernel.shape, 1))
    layer.bias = nnx.Param(integers(layer.bias.shape, 2))
    return layer


@pytest.mark.parametrize("name", list(FLAX_CASES))
def test_flax_nnx_conv_equals_lax(name):
    nnx = pytest.importorskip("flax.nnx")
    shape, kwargs = FLAX_CASES[name]
    layers = {which: nnx.split(flax_conv(shape[-1], kwargs, function))
              for which, function in (("lax", jax.lax.conv_general_dilated),
                                      ("convgrad", cgj.conv_general_dilated))}
    x = integers(shape, 3)
    out_shape = jax.eval_shape(lambda: nnx.merge(*layers["lax"])(x)).shape
    cotangent = integers(out_shape, 4)

    def results(graphdef, params, x):
        def loss(params, x):
            y = nnx.merge(graphdef, params)(x)
            return jnp.sum(y * cotangent), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return y, grads

    graphdef, params = layers["convgrad"]
    ours = jax.jit(results, static_argnums=0)(graphdef, params, x)
    theirs = jax.jit(results, static_argnums=0)(*layers["lax"], x)
    assert_trees_equal(ours, theirs)
    assert kernel_primitives(jax.make_jaxpr(results, static_argnums=0)(*layers["convgrad"], x)) \
        == ALL_THREE
    assert not kernel_primitives(jax.make_jaxpr(results, static_argnums=0)(*layers["lax"], x))


def test_flax_explain_says_convgrad():
    """What nnx.Conv passes (NHWC, HWIO, its dimension numbers) takes a kernel."""
    pytest.importorskip("flax.nnx")
    seen = []

    def spy(*args, **kwargs):
        seen.append(cgj.explain(*args, **{k: v for k, v in kwargs.items()
                                          if k != "out_sharding"}))
        return cgj.conv_general_dilated(*args, **kwargs)

    shape, kwargs = FLAX_CASES["2d-grouped-pairs"]
    jax.eval_shape(flax_conv(shape[-1], kwargs, spy), jax.ShapeDtypeStruct(shape, jnp.float32))
    assert seen == ["convgrad ConvTransposeBackwardData (NXC, XIO weights)"]


# --- Equinox ---------------------------------------------------------------------------

EQUINOX_CASES = {
    # name: (unbatched input shape NCX, layer class name, its keyword arguments)
    "conv2d-reflect-grouped": ((4, 7, 7), "Conv2d", dict(
        in_channels=4, out_channels=6, kernel_size=3, padding=1, padding_mode="REFLECT",
        groups=2)),
    "conv1d-circular-strided-dilated": ((4, 9), "Conv1d", dict(
        in_channels=4, out_channels=3, kernel_size=3, stride=2, padding="SAME",
        dilation=2, padding_mode="CIRCULAR")),
    "conv-transpose2d-strided": ((4, 4, 4), "ConvTranspose2d", dict(
        in_channels=4, out_channels=2, kernel_size=3, stride=2, padding=1,
        output_padding=1)),
    "conv-transpose1d-circular-grouped": ((4, 5), "ConvTranspose1d", dict(
        in_channels=4, out_channels=6, kernel_size=3, stride=2, padding="SAME",
        padding_mode="CIRCULAR", groups=2)),
}


@pytest.mark.parametrize("name", list(EQUINOX_CASES))
def test_equinox_convert_equals_equinox(name):
    eqx = pytest.importorskip("equinox")
    import convgrad.jax.equinox as cge

    shape, class_name, kwargs = EQUINOX_CASES[name]
    layer = eqx.filter_eval_shape(getattr(eqx.nn, class_name), **kwargs,
                                  key=jax.random.key(0))
    layer = integer_leaves(layer)  # weight and bias
    converted = cge.convert(layer)
    assert type(converted) is getattr(cge, class_name)
    assert isinstance(converted, getattr(eqx.nn, class_name))
    assert_trees_equal(converted, layer)  # the same parameters
    x = integers((3, *shape), 3)  # a batch of three, mapped over: Equinox's way
    out_shape = jax.eval_shape(jax.vmap(layer), x).shape
    cotangent = integers(out_shape, 4)

    @eqx.filter_jit
    def results(model, x):
        def loss(model, x):
            y = jax.vmap(model)(x)
            return jnp.sum(y * cotangent), y

        (_, y), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, x)
        return y, grads, jax.grad(lambda x: loss(model, x)[0])(x)

    assert_trees_equal(results(converted, x), results(layer, x))
    assert kernel_primitives(eqx.filter_make_jaxpr(results)(converted, x)[0]) == ALL_THREE
    assert not kernel_primitives(eqx.filter_make_jaxpr(results)(layer, x)[0])


def test_equinox_missing_says_how_to_install(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "equinox", None)  # import equinox raises ImportError
    monkeypatch.delitem(sys.modules, "convgrad.jax.equinox", raising=False)
    with pytest.raises(ImportError, match="pip install equinox"):
        importlib.import_module("convgrad.jax.equinox")


def test_equinox_convert_model():
    """A whole model: only Equinox's own conv layers change, nothing else does, and
    converting again changes nothing more."""
    eqx = pytest.importorskip("equinox")
    import convgrad.jax.equinox as cge

    def make(key):
        keys = jax.random.split(key, 3)
        return eqx.nn.Sequential([
            eqx.nn.Conv2d(4, 6, 3, padding=1, padding_mode="REFLECT", groups=2,
                          key=keys[0]),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.ConvTranspose2d(6, 2, 3, stride=2, key=keys[1]),  # 7x7 -> 15x15
            eqx.nn.Lambda(jnp.ravel), eqx.nn.Linear(2 * 15 * 15, 3, key=keys[2])])

    model = integer_leaves(eqx.filter_eval_shape(make, jax.random.key(0)))
    converted = cge.convert(model)
    assert [type(layer).__module__ for layer in converted.layers] == [
        "convgrad.jax.equinox", "equinox.nn._sequential", "convgrad.jax.equinox",
        "equinox.nn._sequential", "equinox.nn._linear"]
    assert type(model.layers[0]) is eqx.nn.Conv2d  # the original is unchanged
    again = cge.convert(converted)
    assert jax.tree.structure(again) == jax.tree.structure(converted)
    x = integers((2, 4, 7, 7), 0)
    forward = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))
    np.testing.assert_array_equal(forward(converted, x), forward(model, x))
    jaxpr = jax.make_jaxpr(lambda x: jax.vmap(converted)(x))(x)
    assert kernel_primitives(jaxpr) == {
        "convgrad_ConvTransposeBackwardData", "convgrad_ConvolutionBackwardData"}


# --- examples/jax_digits.py --------------------------------------------------------------

def test_digits_example_trains_alike_on_lax_and_convgrad(capsys, caplog):
    """The same curve (the runs differ only by float rounding: at 30 steps within
    3e-7 on Sapphire Rapids), both decreasing, and every kind of kernel lowered."""
    for name in ("flax", "optax", "sklearn"):
        pytest.importorskip(name)
    sys.path.insert(0, str(EXAMPLES))
    try:
        import jax_digits
    finally:
        sys.path.remove(str(EXAMPLES))

    with caplog.at_level("DEBUG", logger="convgrad"):
        results = jax_digits.run(30)
    printed = capsys.readouterr().out
    ours, theirs = results["convgrad"]["losses"], results["lax"]["losses"]
    assert len(ours) == len(theirs) == 30
    for name, curve in (("convgrad", ours), ("lax", theirs)):  # (once flat at ~2.29)
        assert sum(curve[-5:]) / 5 < 0.8 * curve[0], f"{name}: {curve}; lax: {theirs}"
    assert results["max_relative_loss_difference"] < 1e-3
    assert abs(results["convgrad"]["accuracy"] - results["lax"]["accuracy"]) <= 2
    lowered = {m.split(" runs kernel ")[0].removeprefix("convgrad.jax: ")
               for m in caplog.messages if " runs kernel " in m}
    assert lowered == {"ConvTransposeBackwardData", "ConvolutionBackwardData",
                       "ConvolutionBackwardWeights"}
    assert "largest loss difference over all steps" in printed
    assert printed.count("median step") == 2
