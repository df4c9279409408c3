"""A small CNN (flax.nnx, optax) trained on scikit-learn's digits twice from one seed:
once with lax's convolution, once with convgrad's (`nnx.Conv(...,
conv_general_dilated=convgrad.jax.conv_general_dilated)`), whose forward pass, data
gradients and weight gradients all run convgrad's kernels as XLA custom calls.

The digits data set (1797 8x8 images of handwritten digits) ships with scikit-learn, so
nothing is downloaded. Both runs start from the same weights, see the same batches in
the same order and use the same optimizer, so their loss curves differ by float
rounding only; the script prints both curves, their largest difference, the median
time of a training step (after the first, which compiles) and both test accuracies.

    pip install -e '.[jax]' flax optax scikit-learn
    python examples/jax_digits.py [--steps 200] [--batch 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import convgrad
import convgrad.jax as cgj

SEED = 0


def load_digits_split(seed: int = SEED):
    """(x_train, y_train, x_test, y_test): 1437 training and 360 test images scaled to
    [0, 1], as (N, 8, 8, 1) float32 arrays (NHWC), split by a seeded permutation."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(labels))
    train, test = order[:1437], order[1437:]
    return images[train], labels[train], images[test], labels[test]


class CNN(nnx.Module):
    """Three convolutions (one strided, one grouped) and a linear classifier, each
    convolution run by `conv` (lax.conv_general_dilated's signature)."""

    def __init__(self, conv, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), padding="SAME", conv_general_dilated=conv,
                              rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, padding="SAME",  # 8x8 -> 4x4
                              conv_general_dilated=conv, rngs=rngs)
        self.conv3 = nnx.Conv(32, 32, (3, 3), padding="SAME", feature_group_count=4,
                              conv_general_dilated=conv, rngs=rngs)
        self.linear = nnx.Linear(32 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        x = jax.nn.relu(self.conv3(x))
        return self.linear(x.reshape(x.shape[0], -1))


def batches(count: int, steps: int, batch: int, seed: int = SEED):
    """The index arrays of `steps` batches: a seeded shuffle each epoch, the last
    incomplete batch dropped (every step has one shape, so compiles once)."""
    rng = np.random.RandomState(seed)
    out = []
    while len(out) < steps:
        order = rng.permutation(count)
        out += [order[i:i + batch] for i in range(0, count - batch + 1, batch)]
    return out[:steps]


def init_params(seed: int = SEED) -> nnx.State:
    """The CNN's initial parameters (whichever convolution it runs), made in one jitted
    call (eager initialisers compile each of their operations apart) from an RBG key
    (on the CPU, XLA compiles its initialisers in a quarter of threefry's time)."""
    def init():
        rngs = nnx.Rngs(jax.random.key(seed, impl="rbg"))
        return nnx.state(CNN(jax.lax.conv_general_dilated, rngs=rngs))

    return jax.jit(init)()


def train(conv, data, params: nnx.State, *, steps: int, batch: int = 64,
          lr: float = 1e-3, seed: int = SEED) -> dict:
    """Adam on shuffled batches from `params`; returns the loss of every step, each
    step's time (s) and the test accuracy (%)."""
    x_train, y_train, x_test, y_test = data
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: CNN(conv, rngs=nnx.Rngs(seed))))
    optimizer = optax.adam(lr)
    opt_state = jax.jit(optimizer.init)(params)

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def predict(params, x):
        return nnx.merge(graphdef, params)(x).argmax(-1)

    if conv is cgj.conv_general_dilated:  # every kernel built at once, on every core
        x, y = jnp.asarray(x_train[:batch]), jnp.asarray(y_train[:batch])
        cgj.compile_kernels(step, params, opt_state, x, y)
        cgj.compile_kernels(predict, params, jnp.asarray(x_test))
    losses, seconds = [], []
    for indices in batches(len(y_train), steps, batch, seed):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, x_train[indices], y_train[indices])
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - start)
    accuracy = float((np.asarray(predict(params, x_test)) == y_test).mean() * 100)
    return {"losses": losses, "seconds": seconds, "accuracy": accuracy}


def run(steps: int = 200, *, batch: int = 64, quiet: bool = False) -> dict:
    """Trains both models; prints and returns the curves, step times and accuracies."""
    data, params = load_digits_split(), init_params()
    results = {name: train(conv, data, params, steps=steps, batch=batch)
               for name, conv in (("lax", jax.lax.conv_general_dilated),
                                  ("convgrad", cgj.conv_general_dilated))}
    ours, theirs = results["convgrad"]["losses"], results["lax"]["losses"]
    difference = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    relative = [d / abs(b) for d, b in zip(difference, theirs, strict=True)]
    results["max_loss_difference"] = max(difference)
    results["max_relative_loss_difference"] = max(relative)
    for name in ("lax", "convgrad"):
        times = results[name]["seconds"][1:] or results[name]["seconds"]
        results[name]["median_step_ms"] = statistics.median(times) * 1e3
    if not quiet:
        print(f"{steps} steps of {batch} images, convgrad on {convgrad.get_num_threads()} "
              f"thread(s), {jax.devices()[0].platform} backend")
        print(f"{'step':>6} {'lax loss':>14} {'convgrad loss':>14} {'|difference|':>13}")
        shown = sorted({0, *range(0, steps, max(steps // 12, 1)), steps - 1})
        for i in shown:
            print(f"{i + 1:>6} {theirs[i]:>14.6f} {ours[i]:>14.6f} {difference[i]:>13.2e}")
        print(f"largest loss difference over all steps: {max(difference):.2e} "
              f"(relative {max(relative):.2e})")
        for name in ("lax", "convgrad"):
            r = results[name]
            print(f"{name:>9}: test accuracy {r['accuracy']:.2f} %, median step "
                  f"{r['median_step_ms']:.2f} ms (first step, compiling: "
                  f"{r['seconds'][0]:.2f} s)")
    return results


def set_threads(count: int) -> None:
    """convgrad's kernels on `count` threads, and XLA's CPU backend too: it sizes its
    thread pool by the cores the process may run on when it starts (its first use, so
    after `import jax` is fine), hence the affinity (Linux); one thread: no Eigen pool."""
    convgrad.set_num_threads(count)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:count])
    if count == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of convgrad's kernels and of XLA's CPU backend "
                        "(default: every core)")
    args = parser.parse_args(argv)
    if args.threads:
        set_threads(args.threads)
    run(args.steps, batch=args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
