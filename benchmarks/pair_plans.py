"""Plans of one kernel against each other, on the benchmark's layers and data.

    python -m benchmarks.pair_plans --set resnet50 --layers res3a_branch2a --op weights
        [--data-format NXC] [--dtype f32] [--isa avx2] [--threads 1,2] [--batch 8]
        [--min-time 0.5] [--repeats 2] --plan '{}' --plan '{"packed": 0}'
    python -m benchmarks.pair_plans --shapes 'mb8ic96oc4_ih1oh1kh1sh1dh0ph0_iw1ow1kw1sw1dw0pw0'
        --op fwd --threads 2 --plan '{}' --plan '{"tile_rows": 2}'   # layers of no set

For each layer and thread count, every plan (a JSON mapping of plan choices, as
convgrad.codegen.plan.check_plan takes; {} is the rules' plan) gets its own kernel,
workspace and output, and runs on the benchmark's inputs (64-byte aligned normal data,
benchmarks.cases.prepare). The calls go in blocks, each plan's block followed by one of PyTorch's
(benchmarks.timing.timed_pair), the sequence `--repeats` times over, so that a change of the
machine's load hits every plan alike. Printed: each plan's median GFLOP/s, its ratio to
the first plan's in the same repeat, and PyTorch's GFLOP/s. This is how the rules'
choices are checked before they change: a difference smaller than the spread between
repeats is none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.cases import Case, prepare
from benchmarks.machine import ONEDNN_ISA, environment, limit_isa
from benchmarks.shapes import DEFAULT_SHAPES_DIR, DTYPES, OPS, SETS, load_set
from benchmarks.tensors import torch
from benchmarks.timing import int_list, timed_pair
from convgrad import kernels
from convgrad.codegen.layers import parse_benchdnn
from convgrad.codegen.plan import check_plan
from convgrad.cpu import available_isas, selected_isa


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pair_plans", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="resnet50", choices=list(SETS))
    parser.add_argument("--layers", default="",
                        help="comma-separated substrings of the layers' names")
    parser.add_argument("--shapes", default=None,
                        help="benchdnn descriptors to run instead of --set's layers (e.g. "
                             "'mb8ic96oc4_ih1oh1kh1sh1dh0ph0_iw1ow1kw1sw1dw0pw0')")
    parser.add_argument("--op", default="weights", choices=list(OPS))
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"])
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("--isa", default=None, choices=list(ONEDNN_ISA),
                        help="convgrad's path, PyTorch's oneDNN limited to the same")
    parser.add_argument("--threads", type=int_list, default=[1, 2])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-time", type=float, default=0.5,
                        help="seconds of calls per timing of each plan (default 0.5)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="times the whole sequence of plans runs (default 2)")
    parser.add_argument("--plan", action="append", required=True, dest="plans",
                        help="a plan as JSON ({} for the rules'); give two or more")
    parser.add_argument("--no-torch", action="store_true", help="no PyTorch calls between")
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR)
    args = parser.parse_args(argv)
    try:
        args.plans = [check_plan(json.loads(text)) for text in args.plans]
    except (ValueError, json.JSONDecodeError) as error:
        parser.error(f"--plan: {error}")
    if len(args.plans) < 2 or args.repeats < 1 or args.min_time < 0:
        parser.error("give at least two --plan, --repeats >= 1 and --min-time >= 0")
    if torch is None:
        parser.error("PyTorch is not installed: pip install -e '.[bench]'")
    if args.isa and args.isa not in available_isas():
        parser.error(f"--isa {args.isa}: this CPU runs {list(available_isas())}")
    args.layers = [p.strip() for p in args.layers.split(",") if p.strip()]
    if not args.layers and not args.shapes:
        parser.error("give --layers (of --set) or --shapes")
    args.weights_format = None
    return args


def pair(case: Case, plans: list[dict], threads: int, args: argparse.Namespace
         ) -> list[list[tuple[float, float | None]]]:
    """Per repeat, per plan: (our seconds, PyTorch's seconds or None), medians."""
    problem = case.layer.resolve()
    config = problem.config.with_isa(selected_isa())
    dims = kernels.dims_of(problem, threads)
    a, b = case.inputs
    first, second = (b, a) if problem.swap_inputs else (a, b)
    calls = []
    for plan in plans:
        kernel = kernels.get_kernel(config, plan)
        workspace = np.empty(kernel.workspace_size(dims), np.uint8)
        out = kernels.empty_output(problem.output_shape, a.dtype)
        calls.append(lambda k=kernel, w=workspace, o=out: kernels.call(
            k, problem, dims, first, second, o, w))
    theirs = case.torch_call if case.torch_call and not args.no_torch else None
    torch.set_num_threads(threads)
    sequence = [f for call in calls for f in ([call, theirs] if theirs else [call])]
    for function in sequence:  # warm up at this thread count
        function()
    timings = timed_pair(sequence * args.repeats, args.min_time)
    step = 2 if theirs else 1
    per_plan = [(timings[i][0], timings[i + 1][0] if theirs else None)
                for i in range(0, len(timings), step)]
    return [per_plan[r * len(plans):(r + 1) * len(plans)] for r in range(args.repeats)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    convs = (parse_benchdnn(args.shapes) if args.shapes
             else load_set(args.set, args.shapes_dir, None, args.layers))
    if not convs:
        print(f"no layer of set {args.set} matches {args.layers}", file=sys.stderr)
        return 1
    updates = {"CONVGRAD_AOT_PATH": "", **(limit_isa(args.isa) if args.isa else {})}
    saved_torch_threads = torch.get_num_threads()  # pair() sets it per thread count
    with environment(updates), contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, saved_torch_threads)
        print(f"{selected_isa()} path, {args.op}, "
              f"{args.dtype} {args.data_format}, batch {args.batch}; ratio: GFLOP/s over "
              f"the first plan's in the same repeat")
        rng = np.random.default_rng(0)
        for conv in convs:
            case = prepare(conv, args.op, args.set, args, rng)
            flops = case.template.flops
            torch_flops = case.template.torch_flops or flops  # its own output size, if other
            for threads in args.threads:
                print(f"\n{conv.name}, {threads} thread(s)")
                for number, repeat in enumerate(pair(case, args.plans, threads, args), 1):
                    base = repeat[0][0]
                    for plan, (ours, theirs) in zip(args.plans, repeat, strict=True):
                        torch_text = f"  torch {torch_flops / theirs / 1e9:7.1f}" if theirs else ""
                        print(f"  {number}  {json.dumps(plan):36s} {flops / ours / 1e9:7.1f} "
                              f"GFLOP/s  ratio {base / ours:.3f}{torch_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
