"""A full training step (forward + backward) of image and video models: torch.nn against
the same model converted to convgrad (`convgrad.torch.convert`), in one process.

    python -m benchmarks.train_step [--model resnet18[,resnet50,...]] [--dtype f32,bf16]
                                    [--threads 1,2] [--batch N] [--size N] [--frames N]
                                    [--width 64] [--blocks 2,2,2,2]
                                    [--memory-format channels_last|contiguous]
                                    [--autocast bf16|f16] [--compile] [--ddp 2]
                                    [--min-time 3] [--warmup 2] [--out DIR]

The models (benchmarks/models.py, written after torchvision's architectures):
resnet18 (the default), resnet50, resnext50 (32x4d), mobilenet_v2, efficientnet_b0
(without stochastic depth and dropout) and r3d_18 (3-D convolutions, video input).
--width (channels of the first stage, default 64) and --blocks (basic blocks per stage,
default 2,2,2,2) scale resnet18 only: they are an error without resnet18 in --model.

Inputs: images are --batch x 3 x --size x --size, by default 8 x 3 x 112 x 112; videos
(r3d_18) --batch x 3 x --frames x --size x --size, by default 2 x 3 x 8 x 56 x 56 (a
video step at the images' defaults would be some 40 times theirs). A --batch or --size
given applies to every model of the run. channels_last means torch.channels_last_3d
for video (5-D) inputs and parameters.

A step is `model(x)`, cross-entropy, `loss.backward()` with gradients reset to None;
the optimizer update is left out (it is the same torch code for both). In the converted
model every convolution's forward pass, data gradient and weight gradient runs
convgrad's kernels; everything else (BatchNorm, activations, pooling, the linear layer)
is PyTorch's in both. The first layer's data gradient is not computed by either (its
input needs no gradient).

For each model, dtype and thread count (torch.set_num_threads, which convgrad follows),
both models start from the same weights and see the same batch; a warm-up step compiles
convgrad's kernels (timed apart as "first step"; with kernels compiling in the
background, also the second step, the step from which every convolution ran
convgrad's kernel ("switched") and the seconds until that step ended ("after s")); one
more step of each runs under
torch.profiler, which counts its `aten::copy_` calls ("copies torch/ours": layout
conversions and other copies; the profiler may log a few lines to stderr for each
profiled step); then the two take turns in
blocks of steps until each ran --min-time seconds and at least 3 timed steps, and the
table gives the medians, their ratio (torch.nn ms / convgrad ms: above 1 means
convgrad's step is faster) and, as a check, each library's largest relative error of
the convolution weights' gradients (Conv1d/2d/3d and their transposes) of the first
step against the same model's in float64 ("grad err torch/ours": in a deep net with
BatchNorm, rounding differences grow from layer to layer, so the two libraries differ
from each other by more than either differs from float64 on one layer). Results also
go to results.csv and results.json in --out.

--autocast bf16|f16 runs both float32 models' steps under torch.autocast("cpu", ...)
(the mixed precision PyTorch users train with; --dtype is then f32); --compile runs
both through torch.compile (its first step compiles the graph: "first step" then
includes it); --ddp N runs each model under DistributedDataParallel on N processes
(gloo on loopback, --threads threads each, one shared kernel cache, compile_kernels on
every rank at once), both models' steps in turn on every rank, and reports rank 0's
medians.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

import convgrad.torch as cgt
from benchmarks.machine import limit_isa
from benchmarks.models import MODELS, ResNet, classes, input_shape  # noqa: F401  (ResNet: kept here)
from benchmarks.timing import timed_pair
from convgrad import background, kernels
from convgrad.cpu import available_isas, selected_isa
from convgrad.torch import warmup

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "train_step"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Row:
    """One (model, dtype, threads) measurement; the CSV columns."""

    model: str
    dtype: str
    threads: int
    batch: int
    size: int
    frames: int | None  # videos only
    memory_format: str  # channels_last_3d for videos where channels_last was asked
    torch_ms: float
    torch_steps: int
    convgrad_ms: float
    convgrad_steps: int
    ratio: float  # torch ms / convgrad ms
    convgrad_first_step_ms: float  # loads the kernels, or runs torch's while they compile
    switched_at_step: int  # the first step every convolution ran convgrad's kernel in
    convgrad_second_step_ms: float  # a cold cache: the held builds run during this step
    switched_after_s: float  # seconds from the first step's start to that switched step's end
    # largest |g - g64| / max |g64| over the convolution weights' gradients of the first
    # step, g64 those of the same model and batch in float64
    torch_grad_err: float
    convgrad_grad_err: float
    torch_copies: int  # aten::copy_ calls in one step (after warm-up)
    convgrad_copies: int
    autocast: str = ""  # the torch.autocast dtype both steps ran under ("": none)
    compiled: bool = False  # both models through torch.compile
    ranks: int = 1  # DistributedDataParallel processes (1: none)


AUTOCAST = {"bf16": torch.bfloat16, "f16": torch.float16}


def make_step(model: nn.Module, x: torch.Tensor, labels: torch.Tensor,
              autocast: str | None = None) -> Callable[[], torch.Tensor]:
    """One training step of `model` (gradients reset, forward, loss, backward), under
    torch.autocast("cpu", AUTOCAST[autocast]) where `autocast` is given."""
    dtype = AUTOCAST.get(autocast, torch.bfloat16)

    def step() -> torch.Tensor:
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=dtype, enabled=autocast is not None):
            loss = nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        return loss.detach()
    return step


CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d,
                nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def steps_until_switched(step: Callable[[], object], limit_seconds: float = 600.0
                         ) -> list[float]:
    """Runs `step` until a step runs no convolution on PyTorch's stand-in (kernels
    compiling in the background: convgrad.background) and every build finished; returns
    the seconds of each step that ran, that last one included."""
    seconds, deadline = [], time.monotonic() + limit_seconds
    while time.monotonic() < deadline:
        served = warmup.standin_calls()
        begin = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - begin)
        if warmup.standin_calls() == served and not background.pending():
            break
    return seconds


def count_copies(step: Callable[[], object]) -> int:
    """`aten::copy_` calls in one call of `step` (its forward and backward passes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return sum(event.name == "aten::copy_" for event in prof.events())


def model_options(name: str, args: argparse.Namespace) -> dict:
    """The constructor's options of model `name`: --width and --blocks shape resnet18."""
    if name != "resnet18":
        return {}
    return {k: v for k, v in (("width", args.width), ("blocks", args.blocks)) if v is not None}


def build(name: str, args: argparse.Namespace) -> nn.Module:
    """Model `name`, shaped by model_options."""
    return MODELS[name](classes=classes(name), **model_options(name, args))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def measure(name: str, dtype_name: str, threads: int, args: argparse.Namespace) -> Row:
    torch.set_num_threads(threads)
    dtype = DTYPES[dtype_name]
    shape = input_shape(name, args.batch, args.size, args.frames)
    fmt, fmt_name = torch.contiguous_format, args.memory_format
    if args.memory_format == "channels_last":
        fmt, fmt_name = ((torch.channels_last_3d, "channels_last_3d") if len(shape) == 5
                         else (torch.channels_last, "channels_last"))
    torch.manual_seed(0)
    # the format of the input's rank: all convolution weights have that rank too
    reference = build(name, args).to(dtype=dtype, memory_format=fmt)
    exact = copy.deepcopy(reference).to(dtype=torch.float64)
    converted = copy.deepcopy(reference)
    report = cgt.convert(converted)
    if report.skipped:
        raise SystemExit(f"convert left modules alone:\n{report}")
    x = torch.randn(shape).to(dtype=dtype, memory_format=fmt)
    labels = torch.randint(0, classes(name), (shape[0],))
    run_torch, run_ours = reference, converted
    if args.compile:
        run_torch, run_ours = torch.compile(reference), torch.compile(converted)
    step_torch = make_step(run_torch, x, labels, args.autocast)
    step_ours = make_step(run_ours, x, labels, args.autocast)

    if args.cold_cache:  # a new kernel cache for this row: the first step a new user sees
        os.environ["CONVGRAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="convgrad-train-step-")
        kernels.reset()
    served = warmup.standin_calls()
    begin = time.perf_counter()
    step_ours()
    first = time.perf_counter() - begin
    steps = [first]  # until every convolution ran convgrad's kernel
    if warmup.standin_calls() != served or background.pending():
        steps += steps_until_switched(step_ours)
    begin = time.perf_counter()
    step_ours()
    second = steps[1] if len(steps) > 1 else time.perf_counter() - begin
    step_torch()
    make_step(exact, x.to(torch.float64), labels)()
    # both models are in training mode: BatchNorm uses the batch statistics and updates
    # its running ones identically in both, so the second step compares as the first
    errors = [max(_rel(model.weight.grad, truth.weight.grad) for model, truth in
                  zip(candidate.modules(), exact.modules(), strict=True)
                  if isinstance(model, CONVOLUTIONS)) for candidate in (reference, converted)]
    for _ in range(args.warmup - 1):
        step_ours()
        step_torch()
    copies_torch, copies_ours = count_copies(step_torch), count_copies(step_ours)
    (t_torch, n_torch), (t_ours, n_ours) = timed_pair([step_torch, step_ours], args.min_time,
                                                    block_time=0.5)
    return Row(name, dtype_name, threads, shape[0], shape[-1],
               shape[2] if len(shape) == 5 else None, fmt_name,
               round(t_torch * 1e3, 3), n_torch, round(t_ours * 1e3, 3), n_ours,
               round(t_torch / t_ours, 3), round(first * 1e3, 1), len(steps),
               round(second * 1e3, 1), round(sum(steps), 2), *errors,
               copies_torch, copies_ours, args.autocast or "", args.compile)


def measure_ddp(name: str, dtype_name: str, threads: int, args: argparse.Namespace) -> Row:
    """The row of `name` under DistributedDataParallel on --ddp ranks (ddp_step.py)."""
    from benchmarks import ddp_step

    shape = input_shape(name, args.batch, args.size, args.frames)
    fmt_name = args.memory_format
    if fmt_name == "channels_last" and len(shape) == 5:
        fmt_name = "channels_last_3d"
    options = model_options(name, args)
    setting = ddp_step.Setting(name, dtype_name, threads, args.ddp, tuple(shape),
                               classes(name), fmt_name, args.autocast, args.min_time,
                               args.warmup, ddp_step.free_port(), tuple(options.items()))
    r = ddp_step.measure(setting)
    if r.weights_spread:
        print(f"  warning: the ranks' converted weights differ by up to {r.weights_spread:g}")
    nan = float("nan")
    return Row(name, dtype_name, threads, shape[0], shape[-1],
               shape[2] if len(shape) == 5 else None, fmt_name, r.torch_ms, r.torch_steps,
               r.convgrad_ms, r.convgrad_steps, round(r.torch_ms / r.convgrad_ms, 3),
               r.first_step_ms, 1, nan, r.compile_kernels_s, nan, nan, 0, 0,
               args.autocast or "", False, args.ddp)


def table(rows: list[Row]) -> str:
    header = (f"{'model':<16}{'dtype':<10}{'threads':>8}{'torch.nn ms':>13}{'convgrad ms':>13}"
              f"{'ratio':>8}{'first step ms':>15}{'2nd step ms':>13}{'switched':>10}{'after s':>9}"
              f"{'grad err torch/ours':>21}"
              f"{'copies torch/ours':>19}")
    lines = [header, "-" * len(header)]
    for r in rows:
        copies = f"{r.torch_copies}/{r.convgrad_copies}"
        dtype = f"amp-{r.autocast}" if r.autocast else r.dtype
        if r.compiled:
            dtype += "+c"
        if r.ranks > 1:
            dtype += f"x{r.ranks}"
        lines.append(f"{r.model:<16}{dtype:<10}{r.threads:>8}{r.torch_ms:>13.1f}"
                     f"{r.convgrad_ms:>13.1f}{r.ratio:>8.2f}{r.convgrad_first_step_ms:>15.0f}"
                     f"{r.convgrad_second_step_ms:>13.0f}{r.switched_at_step:>10}"
                     f"{r.switched_after_s:>9.1f}"
                     f"{f'{r.torch_grad_err:.1e}/{r.convgrad_grad_err:.1e}':>21}{copies:>19}")
    return "\n".join(lines)


def _list(kind):
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
        return values
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_step",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=_list(str), default=["resnet18"],
                        help=f"comma-separated: {', '.join(MODELS)} (default resnet18)")
    parser.add_argument("--dtype", type=_list(str), default=None,
                        help="comma-separated: f32, bf16 (default f32,bf16; f32 with --autocast)")
    parser.add_argument("--threads", type=_list(int), default=[1, 2],
                        help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--batch", type=int,
                        help="batch of every model (default 8 for images, 2 for videos)")
    parser.add_argument("--size", type=int,
                        help="image or frame side of every model (default 112 for images, "
                             "56 for videos)")
    parser.add_argument("--frames", type=int, help="frames of videos (default 8)")
    parser.add_argument("--width", type=int,
                        help="resnet18 only: channels of the first stage (default 64)")
    parser.add_argument("--blocks", type=_list(int),
                        help="resnet18 only: basic blocks per stage (default 2,2,2,2)")
    parser.add_argument("--memory-format", default="channels_last",
                        choices=["channels_last", "contiguous"],
                        help="default channels_last (channels_last_3d for videos)")
    parser.add_argument("--autocast", choices=list(AUTOCAST),
                        help="run both float32 models under torch.autocast('cpu', dtype) "
                             "(--dtype is then f32, its default)")
    parser.add_argument("--compile", action="store_true",
                        help="run both models through torch.compile")
    parser.add_argument("--ddp", type=int, default=1, metavar="N",
                        help="run under DistributedDataParallel on N processes (gloo, "
                             "--threads threads each; default 1: no DDP)")
    parser.add_argument("--min-time", type=float, default=3.0,
                        help="seconds of timed steps per model and setting (default 3)")
    parser.add_argument("--cold-cache", action="store_true",
                        help="each row starts from a new, empty kernel cache (the first "
                             "step a new user sees)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps before timing, the first compiling (default 2)")
    parser.add_argument("--isa", default=None, choices=available_isas(),
                        help="convgrad's ISA path, with oneDNN and MKL held to the same "
                             "(ONEDNN_MAX_CPU_ISA; AMX off): compares a lesser path "
                             "(default: this CPU's best, oneDNN unlimited)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.dtype is None:  # f32 and bf16; under autocast the float32 models only
        args.dtype = ["f32"] if args.autocast else ["f32", "bf16"]
    if any(d not in DTYPES for d in args.dtype):
        parser.error(f"--dtype {args.dtype}: expected a subset of {list(DTYPES)}")
    if args.ddp < 1 or (args.ddp > 1 and args.compile):
        parser.error("--ddp must be positive, and is not combined with --compile")
    if args.autocast and args.dtype != ["f32"]:
        parser.error("--autocast runs float32 models: give --dtype f32")
    if any(m not in MODELS for m in args.model):
        parser.error(f"--model {args.model}: expected a subset of {list(MODELS)}")
    if (args.width is not None or args.blocks is not None) and "resnet18" not in args.model:
        parser.error("--width and --blocks shape resnet18 only, which --model leaves out")
    given = [v for v in (args.batch, args.frames, args.width) if v is not None]
    if min(args.threads) < 1 or min(args.blocks or [1]) < 1 or min(given, default=1) < 1 \
            or (args.size is not None and args.size < 8) or args.warmup < 1 \
            or args.min_time < 0:
        parser.error("sizes, counts and --warmup must be positive (--size at least 8), "
                     "--min-time not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.isa:  # before torch's first convolution: oneDNN reads it once
        os.environ.update(limit_isa(args.isa))
    command = "python -m benchmarks.train_step " + " ".join(sys.argv[1:] if argv is None
                                                            else argv)
    print(f"Training step (forward + backward), {args.memory_format}; convgrad ISA path "
          f"{selected_isa()}, torch {torch.__version__}")
    rows = []
    for name in args.model:
        shape = "x".join(map(str, input_shape(name, args.batch, args.size, args.frames)))
        shaped = ""
        if name == "resnet18" and (args.width is not None or args.blocks is not None):
            shaped = (f", width {args.width or 64}, blocks "
                      f"{','.join(map(str, args.blocks or [2, 2, 2, 2]))}")
        print(f"{name}{shaped}, input {shape}", flush=True)
        for dtype in args.dtype:
            for threads in args.threads:
                run = measure_ddp if args.ddp > 1 else measure
                rows.append(run(name, dtype, threads, args))
                print(f"  {dtype} {threads} thread(s): torch.nn {rows[-1].torch_ms:.1f} ms, "
                      f"convgrad {rows[-1].convgrad_ms:.1f} ms", flush=True)
    print()
    print(table(rows))
    print("ratio = torch.nn ms / convgrad ms (above 1: convgrad's step is faster); grad err: "
          "each library's convolution weight gradients of the first step against float64's")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    machine = {"cpu": _cpu(), "isa": selected_isa(), "torch": torch.__version__,
               "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
               "compile_mode": background.mode(),
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
