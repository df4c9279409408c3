"""A full training step (forward + backward) of a ResNet-style model: torch.nn against the
same model converted to convgrad (`convgrad.torch.convert`), in one process.

    python benchmarks/train_step.py [--dtype f32,bf16] [--threads 1,2] [--batch 8]
                                    [--size 112] [--width 64] [--blocks 2,2,2,2]
                                    [--memory-format channels_last|contiguous]
                                    [--min-time 3] [--warmup 2] [--out DIR]

The model is ResNet-18's layout (a 7x7 stride-2 stem, max pooling, stages of basic
blocks with 3x3 convolutions, BatchNorm and ReLU, 1x1 stride-2 projections, global
pooling, a linear classifier), scaled by --width, --blocks and --size. A step is
`model(x)`, cross-entropy, `loss.backward()` with gradients reset to None; the
optimizer update is left out (it is the same torch code for both). In the converted
model every convolution's forward pass, data gradient and weight gradient runs
convgrad's kernels; everything else (BatchNorm, ReLU, pooling, the linear layer) is
PyTorch's in both. The first layer's data gradient is not computed by either (its
input needs no gradient).

For each dtype and thread count (torch.set_num_threads, which convgrad follows), both
models start from the same weights and see the same batch; a warm-up step compiles
convgrad's kernels (timed apart as "first step"); then the two take turns in blocks of
steps until each ran --min-time seconds and at least 3 timed steps, and the table
gives the medians, their ratio (torch.nn ms / convgrad ms: above 1 means convgrad's
step is faster) and, as a check, the largest relative difference of the loss and
of the convolution weights' gradients between the two. Results also go to
results.csv and results.json in --out.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

import convgrad.torch as cgt
from convgrad.cpu import selected_isa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import timed_pair  # noqa: E402  (the sibling benchmark's turn-taking timer)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "train_step"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm; a 1x1 projection where the shape changes."""

    def __init__(self, channels_in: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or channels_in != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride, bias=False),
                nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet-18's layout; `blocks` per stage, stage widths width * (1, 2, 4, 8)."""

    def __init__(self, width: int = 64, blocks: Sequence[int] = (2, 2, 2, 2),
                 classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        stages, channels = [], width
        for index, count in enumerate(blocks):
            out = width * 2**index
            for block in range(count):
                stride = 2 if index > 0 and block == 0 else 1
                stages.append(BasicBlock(channels, out, stride))
                channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(channels, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


@dataclass
class Row:
    """One (dtype, threads) measurement; the CSV columns."""

    dtype: str
    threads: int
    batch: int
    size: int
    memory_format: str
    torch_ms: float
    torch_steps: int
    convgrad_ms: float
    convgrad_steps: int
    ratio: float  # torch ms / convgrad ms
    convgrad_first_step_ms: float  # compiles (or loads) the kernels
    loss_rel_diff: float
    grad_rel_diff: float  # largest over the convolution weights


def make_step(model: nn.Module, x: torch.Tensor, labels: torch.Tensor
              ) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        for p in model.parameters():
            p.grad = None
        loss = nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        return loss.detach()
    return step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def measure(dtype_name: str, threads: int, args: argparse.Namespace) -> Row:
    torch.set_num_threads(threads)
    dtype = DTYPES[dtype_name]
    fmt = (torch.channels_last if args.memory_format == "channels_last"
           else torch.contiguous_format)
    torch.manual_seed(0)
    reference = ResNet(args.width, args.blocks).to(dtype=dtype, memory_format=fmt)
    converted = copy.deepcopy(reference)
    report = cgt.convert(converted)
    if report.skipped:
        raise SystemExit(f"convert left modules alone:\n{report}")
    x = torch.randn(args.batch, 3, args.size, args.size).to(dtype=dtype, memory_format=fmt)
    labels = torch.randint(0, 1000, (args.batch,))
    step_torch = make_step(reference, x, labels)
    step_ours = make_step(converted, x, labels)

    begin = time.perf_counter()
    loss_ours = step_ours()
    first = time.perf_counter() - begin
    loss_torch = step_torch()
    # both models are in training mode: BatchNorm uses the batch statistics and updates
    # its running ones identically in both, so the second step compares as the first
    conv_pairs = [(a.weight.grad, b.weight.grad) for a, b in
                  zip(reference.modules(), converted.modules(), strict=True)
                  if isinstance(a, nn.Conv2d)]
    grad_diff = max(_rel(ours, theirs) for theirs, ours in conv_pairs)
    loss_diff = _rel(loss_ours, loss_torch)
    for _ in range(args.warmup - 1):
        step_ours()
        step_torch()
    (t_torch, n_torch), (t_ours, n_ours) = timed_pair([step_torch, step_ours], args.min_time,
                                                    block_time=0.5)
    return Row(dtype_name, threads, args.batch, args.size, args.memory_format,
               round(t_torch * 1e3, 3), n_torch, round(t_ours * 1e3, 3), n_ours,
               round(t_torch / t_ours, 3), round(first * 1e3, 1), loss_diff, grad_diff)


def table(rows: list[Row]) -> str:
    header = (f"{'dtype':<6}{'threads':>8}{'torch.nn ms':>13}{'convgrad ms':>13}"
              f"{'ratio':>8}{'first step ms':>15}{'loss diff':>11}{'grad diff':>11}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.dtype:<6}{r.threads:>8}{r.torch_ms:>13.1f}{r.convgrad_ms:>13.1f}"
                     f"{r.ratio:>8.2f}{r.convgrad_first_step_ms:>15.0f}"
                     f"{r.loss_rel_diff:>11.1e}{r.grad_rel_diff:>11.1e}")
    return "\n".join(lines)


def _list(kind):
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
        return values
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/train_step.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", type=_list(str), default=["f32", "bf16"],
                        help="comma-separated: f32, bf16 (default f32,bf16)")
    parser.add_argument("--threads", type=_list(int), default=[1, 2],
                        help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--batch", type=int, default=8, help="default 8")
    parser.add_argument("--size", type=int, default=112, help="image side (default 112)")
    parser.add_argument("--width", type=int, default=64,
                        help="channels of the first stage (default 64)")
    parser.add_argument("--blocks", type=_list(int), default=[2, 2, 2, 2],
                        help="basic blocks per stage (default 2,2,2,2: ResNet-18)")
    parser.add_argument("--memory-format", default="channels_last",
                        choices=["channels_last", "contiguous"])
    parser.add_argument("--min-time", type=float, default=3.0,
                        help="seconds of timed steps per model and setting (default 3)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps before timing, the first compiling (default 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if any(d not in DTYPES for d in args.dtype):
        parser.error(f"--dtype {args.dtype}: expected a subset of {list(DTYPES)}")
    if min(args.threads) < 1 or min(args.blocks) < 1 or args.batch < 1 or args.size < 8 \
            or args.width < 1 or args.warmup < 1 or args.min_time < 0:
        parser.error("sizes, counts and --warmup must be positive, --min-time not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/train_step.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv)
    print(f"ResNet-style training step (forward + backward), width {args.width}, blocks "
          f"{','.join(map(str, args.blocks))}, batch {args.batch}, {args.size}x{args.size}, "
          f"{args.memory_format}; convgrad ISA path {selected_isa()}, torch {torch.__version__}")
    rows = []
    for dtype in args.dtype:
        for threads in args.threads:
            rows.append(measure(dtype, threads, args))
            print(f"  {dtype} {threads} thread(s): torch.nn {rows[-1].torch_ms:.1f} ms, "
                  f"convgrad {rows[-1].convgrad_ms:.1f} ms", flush=True)
    print()
    print(table(rows))
    print("ratio = torch.nn ms / convgrad ms (above 1: convgrad's step is faster); diffs are "
          "relative, convgrad against torch.nn on the first step")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    machine = {"cpu": _cpu(), "isa": selected_isa(), "torch": torch.__version__,
               "python": platform.python_version(), "platform": platform.platform(),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (args.out / "results.json").write_text(json.dumps(
        {"command": command, "machine": machine, "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
         "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    print(f"results in {args.out}")
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    sys.exit(main())
