"""A JAX training step (loss and gradients, jitted) of a ResNet-18 and a MobileNetV2
written in plain JAX, with jax.lax.conv_general_dilated against
convgrad.jax.conv_general_dilated as the model's convolution, in one process per thread
count.

    python -m benchmarks.jax_train_step [--model resnet18,mobilenet_v2] [--dtype f32[,bf16]]
                                        [--threads 1,2] [--batch 8] [--size 112]
                                        [--width-mult 1] [--blocks N,N,...]
                                        [--min-time 3] [--pin] [--keep-cache] [--aot]
                                        [--out DIR]

The models (benchmarks.jax_models: NHWC data, HWIO weights, functions of a parameter
pytree and of the conv function, written after torchvision's architectures and
benchmarks/models.py):
- resnet18: a 7x7/2 stem, BatchNorm, ReLU and a 3x3/2 max pool, four stages of two basic
  blocks (3x3 convolutions, 1x1/2 projections where the shape changes), widths 64 to 512;
- mobilenet_v2: a 3x3/2 stem, 17 inverted residuals (1x1 expansion by 6, depthwise 3x3
  with ReLU6, linear 1x1 projection), a 1x1 to 1280 channels.
Both end in global average pooling and a 1000-way linear layer. BatchNorm uses the batch's
statistics (training mode), computed in float32 and written by hand. --width-mult scales
every channel count (rounded to a multiple of 8; ResNet-18's widths 64 x mult), --blocks
gives the blocks per stage (ResNet-18's four stages, MobileNetV2's seven rows of
inverted residuals; fewer entries keep only the first stages). With --dtype bf16 the
convolution and linear weights and the input are bfloat16 (BatchNorm's parameters and
statistics, and the loss, stay float32).

A step is jit(value_and_grad(loss))(params, x, labels): softmax cross-entropy on random
labels, the gradients of every parameter, no optimizer. Both steps get the same initial
parameters and the same batch (--batch x --size x --size x 3, default 8 x 112 x 112).
For each model, dtype and thread count: lax's first step (trace, XLA compile, one run);
convgrad's kernels built by convgrad.jax.compile_kernels (in parallel; from a new kernel
cache unless --keep-cache), then its first step the same way; the optimized HLO of
convgrad's step is checked to hold no XLA convolution (every convolution, forward and
both gradients, one convgrad custom call). One more untimed step each, then the two take
turns in blocks of steps (benchmarks.timing.timed_pair) until each ran --min-time
seconds and 3 steps, each step ending with block_until_ready; medians are reported,
ratio = lax ms / convgrad ms (above 1: convgrad's step is faster). As a check, the two
first steps' losses and global gradient norms must agree to 1e-3 relative (2e-2 in
bf16), and the largest difference of any convolution weight's gradient relative to its
largest value is reported (with bf16, also each library's against the same step in
float32, lax's on the same rounded parameters and batch). Threads as in
benchmarks/jax_ops.py (benchmarks.xla): convgrad.set_num_threads(n) and PJRT_NPROC=n
(XLA's CPU thread pool, sized once per process). Results also go to results.csv,
results.json and table.txt in --out.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import xla
from benchmarks.jax_cases import rel_diff
from benchmarks.jax_models import CLASSES, MODELS, build
from benchmarks.reports import settings, write_results
from benchmarks.timing import int_list, timed_pair

SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results" / "jax_train_step"
DTYPES = ("f32", "bf16")
TOLERANCE = {"f32": 1e-3, "bf16": 2e-2}  # losses' and gradient norms' relative difference


# --------------------------------------------------------------------------- steps

@dataclass
class Row:
    """One (model, dtype, threads) measurement; the CSV columns."""

    model: str
    dtype: str
    threads: int
    batch: int
    size: int
    convolutions: int
    lax_ms: float
    convgrad_ms: float
    ratio: float  # lax ms / convgrad ms
    lax_steps: int
    convgrad_steps: int
    lax_first_step_ms: float  # trace + XLA compile + one step
    convgrad_kernels_s: float  # compile_kernels: every kernel the step needs
    convgrad_kernel_calls: int
    convgrad_first_step_ms: float  # trace + XLA compile + one step, the kernels built
    lax_loss: float
    convgrad_loss: float
    loss_rel_diff: float
    lax_grad_norm: float
    convgrad_grad_norm: float
    grad_norm_rel_diff: float
    conv_grad_max_rel_diff: float  # max over convolution weights of max|d| / max|lax's|
    convgrad_hlo_calls: int  # convgrad custom calls in its step's optimized HLO
    convgrad_hlo_convolutions: int  # XLA convolutions left there (0: all convgrad)
    lax_hlo_convolutions: int
    # bf16 only: each library's conv_grad diff against the same step in float32 (lax's,
    # from the bf16 parameters and batch)
    lax_conv_grad_err_f32: float | None = None
    convgrad_conv_grad_err_f32: float | None = None
    note: str = ""

    @property
    def agrees(self) -> bool:
        tolerance = TOLERANCE[self.dtype]
        return self.loss_rel_diff <= tolerance and self.grad_norm_rel_diff <= tolerance


def _norm(tree) -> float:
    import jax

    return math.sqrt(sum(float(np.sum(np.square(np.asarray(leaf, np.float64))))
                         for leaf in jax.tree.leaves(tree)))


def _conv_grad_diff(ours, theirs) -> float:
    """Largest |ours - theirs| / max |theirs| over the 4-D (convolution weight) leaves."""
    import jax

    return max((rel_diff(a, b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs),
                                                strict=True) if np.ndim(b) == 4), default=0.0)


def measure(name: str, dtype_name: str, threads: int, args: argparse.Namespace) -> Row:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import convgrad.jax as cj

    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype_name]
    model = build(name, args)
    params = jax.tree.map(lambda v: jnp.asarray(v, dtype if v.ndim >= 2 else jnp.float32),
                          model.params)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((args.batch, args.size, args.size, 3),
                                        dtype=np.float32), dtype)
    labels = jnp.asarray(rng.integers(0, CLASSES, args.batch), jnp.int32)

    def step_of(conv: Callable) -> Callable:
        def loss(p, x, labels):
            logits = model.apply(p, x, conv)
            picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
            return -picked.mean()
        return jax.value_and_grad(loss)

    lax_step, ours_step = step_of(lax.conv_general_dilated), step_of(cj.conv_general_dilated)

    def first(step: Callable):
        begin = time.perf_counter()
        compiled = jax.jit(step).lower(params, x, labels).compile()
        result = jax.block_until_ready(compiled(params, x, labels))
        return compiled, result, (time.perf_counter() - begin) * 1e3

    lax_compiled, (lax_loss, lax_grads), lax_first = first(lax_step)
    begin = time.perf_counter()
    calls = cj.compile_kernels(ours_step, params, x, labels, progress=False)
    kernels_s = time.perf_counter() - begin
    ours_compiled, (ours_loss, ours_grads), ours_first = first(ours_step)
    ours_hlo, lax_hlo = xla.hlo_summary(ours_compiled), xla.hlo_summary(lax_compiled)

    lax_loss, ours_loss = float(lax_loss), float(ours_loss)
    lax_norm, ours_norm = _norm(lax_grads), _norm(ours_grads)
    conv_diff = _conv_grad_diff(ours_grads, lax_grads)
    errors_f32 = [None, None]
    if dtype != jnp.float32:  # the same step in float32, from the same rounded values
        wide = jax.tree.map(lambda v: v.astype(jnp.float32), (params, x))
        _, exact = jax.jit(lax_step)(*wide, labels)
        errors_f32 = [_conv_grad_diff(grads, exact) for grads in (lax_grads, ours_grads)]
        del exact
    del lax_grads, ours_grads

    def run(compiled) -> Callable[[], object]:
        return lambda: jax.block_until_ready(compiled(params, x, labels))

    steps = [run(lax_compiled), run(ours_compiled)]
    for step in steps:  # one more step each, untimed
        step()
    (lax_s, lax_n), (ours_s, ours_n) = timed_pair(steps, args.min_time, block_time=0.5)
    row = Row(name, dtype_name, threads, args.batch, args.size, model.convolutions,
              round(lax_s * 1e3, 3), round(ours_s * 1e3, 3), round(lax_s / ours_s, 3),
              lax_n, ours_n, round(lax_first, 1), round(kernels_s, 2), calls,
              round(ours_first, 1), lax_loss, ours_loss,
              abs(ours_loss - lax_loss) / abs(lax_loss), lax_norm, ours_norm,
              abs(ours_norm - lax_norm) / lax_norm, conv_diff, ours_hlo["convgrad_calls"],
              ours_hlo["convolutions"], lax_hlo["convolutions"], *errors_f32)
    notes = []
    if row.convgrad_hlo_convolutions:
        notes.append(f"{row.convgrad_hlo_convolutions} convolutions ran on lax")
    if not row.agrees:
        notes.append("MISMATCH: losses or gradient norms differ")
    row.note = "; ".join(notes)
    return row


def worker(args: argparse.Namespace) -> int:
    threads = xla.start_worker(args)
    rows = []
    for name in args.model:
        for dtype in args.dtype:
            rows.append(measure(name, dtype, threads, args))
            r = rows[-1]
            print(f"  {name} {dtype} x{threads}: lax {r.lax_ms:.1f} ms, convgrad "
                  f"{r.convgrad_ms:.1f} ms; first steps {r.lax_first_step_ms:.0f} / "
                  f"{r.convgrad_first_step_ms:.0f} ms, kernels {r.convgrad_kernels_s:.1f} s",
                  file=sys.stderr, flush=True)
    return xla.finish_worker(args, rows)


# --------------------------------------------------------------------------- main

def table(rows: list[Row]) -> str:
    header = (f"{'model':<14}{'dtype':<6}{'threads':>8}{'lax ms':>10}{'convgrad ms':>13}"
              f"{'ratio':>7}{'lax 1st ms':>12}{'kernels s':>11}{'convgrad 1st ms':>17}"
              f"{'loss diff':>11}{'norm diff':>11}{'conv grad diff':>16}"
              f"{'vs f32 lax/ours':>17}{'convs':>7}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        wide = "-" if r.lax_conv_grad_err_f32 is None else \
            f"{r.lax_conv_grad_err_f32:.1e}/{r.convgrad_conv_grad_err_f32:.1e}"
        lines.append(f"{r.model:<14}{r.dtype:<6}{r.threads:>8}{r.lax_ms:>10.1f}"
                     f"{r.convgrad_ms:>13.1f}{r.ratio:>7.2f}{r.lax_first_step_ms:>12.0f}"
                     f"{r.convgrad_kernels_s:>11.1f}{r.convgrad_first_step_ms:>17.0f}"
                     f"{r.loss_rel_diff:>11.1e}{r.grad_norm_rel_diff:>11.1e}"
                     f"{r.conv_grad_max_rel_diff:>16.1e}{wide:>17}"
                     f"{f'{r.convgrad_hlo_calls}/{r.convolutions}':>7}  {r.note}".rstrip())
    return "\n".join(lines)


def _names(choices: Sequence[str]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset "
                                             f"of {list(choices)}")
        return list(dict.fromkeys(values))
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.jax_train_step",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=_names(MODELS), default=list(MODELS),
                        help="comma-separated: resnet18, mobilenet_v2 (default both)")
    parser.add_argument("--dtype", type=_names(DTYPES), default=["f32"],
                        help="comma-separated: f32, bf16 (default f32)")
    xla.add_worker_arguments(parser)  # --threads, --pin, --keep-cache, --aot
    parser.add_argument("--batch", type=int, default=8, help="batch (default 8)")
    parser.add_argument("--size", type=int, default=112, help="image side (default 112)")
    parser.add_argument("--width-mult", type=float, default=1.0,
                        help="channel multiplier of both models (default 1)")
    parser.add_argument("--blocks", type=int_list, default=None,
                        help="blocks per stage: resnet18's 4 stages (default 2,2,2,2), "
                             "mobilenet_v2's 7 rows (default 1,2,3,4,3,3,1); fewer entries "
                             "keep the first stages only")
    parser.add_argument("--min-time", type=float, default=3.0,
                        help="seconds of timed steps per library and row (default 3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.batch < 2 or args.size < 8 or args.width_mult <= 0 or args.min_time < 0:
        parser.error("--batch must be at least 2 (BatchNorm), --size at least 8, "
                     "--width-mult positive, --min-time not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    command = "python -m benchmarks.jax_train_step " + " ".join(argv)
    print(f"JAX training step (loss + gradients), batch {args.batch}, {args.size}x"
          f"{args.size}, NHWC; lax against convgrad.jax", flush=True)
    results = xla.run_workers("benchmarks.jax_train_step", argv, args)
    if results is None:
        return 1
    rows = xla.rows_of(results, Row)
    machine = results[0]["machine"]
    report = "\n".join([
        xla.machine_line(machine), "", table(rows),
        "ratio = lax ms / convgrad ms (above 1: convgrad's step is faster); 1st: the first "
        "step (trace, XLA compile, run), convgrad's after its kernels were built;",
        "diffs: convgrad against lax (losses, gradient norms, worst convolution weight "
        "gradient; with bf16 each library's against float32's); convs: convgrad calls in "
        "the step's HLO / the model's convolutions"])
    print(report)
    write_results(args.out, command, report, rows, Row, machine=machine,
                  settings=settings(args), threads=[r["threads"] for r in results])
    print(f"results in {args.out}")
    return 0 if all(r.agrees and not r.convgrad_hlo_convolutions for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
