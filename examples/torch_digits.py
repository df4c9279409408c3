"""A small CNN trained on scikit-learn's digits twice from one seed: once with torch.nn's
convolutions, once converted to convgrad's (`convgrad.torch.convert`), whose forward
pass, data gradients and weight gradients all run convgrad's kernels.

The digits data set (1797 8x8 images of handwritten digits) ships with scikit-learn, so
nothing is downloaded. Both runs start from the same weights, see the same batches in
the same order and use the same optimizer; the script prints both loss curves, their
largest difference and both test accuracies, and writes a plot of the curves.

    pip install -e '.[torch]' scikit-learn matplotlib
    python examples/torch_digits.py [--epochs 12] [--threads 1] [--channels-last]
                                    [--plot digits_losses.png]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from torch import nn

import convgrad.torch as cgt

SEED = 0


def load_digits_split(seed: int = SEED):
    """(x_train, y_train, x_test, y_test): 1437 training and 360 test images scaled to
    [0, 1], as (N, 1, 8, 8) float32 tensors, split by a seeded permutation."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    digits = load_digits()
    images = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.RandomState(seed).permutation(len(labels)))
    train, test = order[:1437], order[1437:]
    return images[train], labels[train], images[test], labels[test]


def make_model(seed: int = SEED) -> nn.Module:
    """Three convolutions (one strided, one grouped) and a linear classifier."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),  # 8x8 -> 4x4
        nn.Conv2d(32, 32, 3, padding="same", groups=4), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def train(model: nn.Module, data, *, epochs: int, batch: int = 64, lr: float = 1e-3,
          seed: int = SEED, channels_last: bool = False) -> tuple[list[float], float]:
    """Adam on shuffled batches; returns the loss of every step and the test accuracy (%).

    With these settings runs whose sums round differently stay together: a change of one
    ulp in the initial weights moves torch.nn's own loss curve by at most 6e-3 relative
    (median 3e-4) over 276 steps on Sapphire Rapids; at lr 0.05 with SGD and momentum,
    by 3e-2 within 300 steps."""
    x_train, y_train, x_test, y_test = data
    if channels_last:
        model.to(memory_format=torch.channels_last)
        x_train = x_train.contiguous(memory_format=torch.channels_last)
        x_test = x_test.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(epochs):
        for indices in torch.randperm(len(y_train), generator=order).split(batch):
            loss = nn.functional.cross_entropy(model(x_train[indices]), y_train[indices])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
    return losses, accuracy


def run(epochs: int = 12, *, channels_last: bool = False, plot: str | None = None,
        quiet: bool = False) -> dict:
    """Trains both models; prints and returns the curves and the accuracies."""
    data = load_digits_split()
    results = {}
    for name in ("torch.nn", "convgrad"):
        model = make_model()
        if name == "convgrad":
            # every step on convgrad's kernels, the first included: the comparison is of
            # the kernels (by default a kernel still compiling leaves its first calls to
            # PyTorch's own operator)
            cgt.set_compile_mode("block")
            report = cgt.convert(model)
            if not quiet:
                print(report)
        start = time.perf_counter()
        losses, accuracy = train(model, data, epochs=epochs, channels_last=channels_last)
        results[name] = {"losses": losses, "accuracy": accuracy,
                         "seconds": time.perf_counter() - start}
    ours, theirs = results["convgrad"]["losses"], results["torch.nn"]["losses"]
    difference = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    relative = [d / abs(b) for d, b in zip(difference, theirs, strict=True)]
    results["max_loss_difference"] = max(difference)
    results["max_relative_loss_difference"] = max(relative)
    if not quiet:
        steps = len(ours)
        print(f"\n{steps} steps ({epochs} epochs of {steps // epochs} batches), "
              f"{torch.get_num_threads()} thread(s), "
              f"{'channels_last' if channels_last else 'contiguous'}")
        print(f"{'step':>6} {'torch.nn loss':>14} {'convgrad loss':>14} {'|difference|':>13}")
        shown = sorted({0, *range(0, steps, max(steps // 12, 1)), steps - 1})
        for i in shown:
            print(f"{i + 1:>6} {theirs[i]:>14.6f} {ours[i]:>14.6f} {difference[i]:>13.2e}")
        print(f"largest loss difference over all steps: {max(difference):.2e} "
              f"(relative {max(relative):.2e})")
        for name in ("torch.nn", "convgrad"):
            print(f"{name:>9}: test accuracy {results[name]['accuracy']:.2f} % "
                  f"(training took {results[name]['seconds']:.1f} s)")
    if plot:
        _plot(theirs, ours, difference, plot)
        if not quiet:
            print(f"plot written to {plot}")
    return results


def _plot(theirs: list[float], ours: list[float], difference: list[float], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                         height_ratios=(3, 1.4))
    steps = range(1, len(ours) + 1)
    top.plot(steps, theirs, label="torch.nn", linewidth=2.5, alpha=0.6)
    top.plot(steps, ours, label="convgrad.torch (converted)", linewidth=1, linestyle="--")
    top.set_ylabel("training loss (cross-entropy)")
    top.set_yscale("log")
    top.legend()
    top.set_title("Small CNN on scikit-learn's digits, same seed and batches")
    bottom.semilogy(steps, [max(d, 1e-9) for d in difference], linewidth=1)
    bottom.set_ylabel("|loss difference|\n(equal: drawn at 1e-9)")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (convgrad follows it)")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--plot", default="digits_losses.png",
                        help="where to write the plot ('' for none)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.epochs, channels_last=args.channels_last, plot=args.plot or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
