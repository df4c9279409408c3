"""convgrad against PyTorch's CPU backward, side by side in one process.

    python -m benchmarks.bench [--set resnet50|resnet18_112|mobilenet_v2|mobilenet_dw|dilated|
                                      1d|3d|resnext101|gconv|all]
                               [--ops data,weights,fwd,tweights] [--threads 1,2] [--batch 8]
                               [--dtype f32|bf16|f16] [--data-format NXC|NCX]
                               [--weights-format OIX|XIO|OXI]
                               [--min-time 0.3] [--limit N] [--keep-cache] [--alone]
                               [--out DIR]

Every benchdnn forward convolution of the chosen set becomes the layers of
ConvolutionBackwardData ("data"), ConvolutionBackwardWeights ("weights"),
ConvTransposeBackwardData ("fwd": the forward convolution itself) and
ConvTransposeBackwardWeights ("tweights": the weight gradient of the transposed
convolution whose forward is this layer's backward data), built with
convgrad.codegen.layers.conv_layers and run through convgrad.execute; PyTorch runs the
same problem through torch.ops.aten.convolution_backward (torch.ops.aten.convolution
for "fwd"; transposed=True for "tweights") with the same dtype, memory layout and
thread count. Each timing is the median of at least 3 calls
and at least --min-time seconds, the two libraries' calls interleaved. GFLOP/s
count 2 x N x OC x IC/g x output pixels x kernel taps. The machine's f32 FMA peak
per core is measured by a small generated C loop right before and after each row's
timing (the clock wanders: the higher of the two counts), and every row gives the
median's and the fastest call's share of it (GFLOP/s / (peak x threads)) and the
minor page faults a call takes. With --dtype bf16 on a CPU whose AMX-BF16 tiles convgrad
may use, a second loop measures the tile peak (tdpbf16ps on tiles that stay loaded) the
same way, and each row also gives both libraries' shares of that. --alone times
convgrad by itself, its process pinned to as many CPUs as threads (PyTorch only checks
each result once, before): the kernels' own speed, apart from what another library's
calls leave behind.

Outputs: a table and the geometric mean of the ratios (convgrad GFLOP/s / PyTorch
GFLOP/s, above 1 means convgrad is faster) per op and thread count on stdout, and
results.csv, results.json (with the machine) and results.png in --out.
"""

# This module is the command line (its --help is the docstring above); the jobs are
# modules of their own: benchmarks.shapes (the sets), benchmarks.cases (each case's calls,
# timing and check), benchmarks.tensors (arrays as PyTorch's tensors), benchmarks.machine
# (peak, description, ISA limits), benchmarks.overheads (tiny call, cached load),
# benchmarks.timing (paired timing) and benchmarks.reports (table, means, CSV, plot).

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

import convgrad
from benchmarks.cases import Row, merge_rounds, prepare, run_case
from benchmarks.machine import ONEDNN_ISA, Peak, environment, limit_isa, machine_info
from benchmarks.overheads import measure_cached_load, measure_call_overhead
from benchmarks.reports import fmt, geomeans, plot, table, write_csv
from benchmarks.shapes import DEFAULT_SHAPES_DIR, DTYPES, OPS, SETS, load_file, load_sets
from benchmarks.tensors import torch
from benchmarks.timing import int_list
from convgrad.cpu import available_isas, selected_isa

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="resnet50", choices=[*SETS, "all"],
                        help="shape set (default resnet50)")
    parser.add_argument("--ops", default="data,weights",
                        help="comma-separated: data (ConvolutionBackwardData), weights "
                             "(ConvolutionBackwardWeights), fwd (ConvTransposeBackwardData: "
                             "the forward convolution), tweights "
                             "(ConvTransposeBackwardWeights); default data,weights")
    parser.add_argument("--threads", type=int_list, default=[1, 2],
                        help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--batch", type=int, default=8, help="batch, overrides mb (default 8)")
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"],
                        help="NXC: PyTorch channels_last; NCX: contiguous (default NXC)")
    parser.add_argument("--weights-format", default=None, choices=["OIX", "XIO", "OXI"],
                        help="convgrad's weights layout: OIX is PyTorch's own (its "
                             "[O][I][k...]), OXI PyTorch's channels_last, XIO the ops' "
                             "default (default XIO; IOX/XOI/IXO for the ConvTranspose ops)")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="seconds of calls per timing, at least 3 calls (default 0.3)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every case this many times, one round of all cases after "
                             "another, and report medians (default 1)")
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N shapes of each set")
    parser.add_argument("--layers", default=None,
                        help="comma-separated substrings: only the layers whose name "
                             "contains one (e.g. res2a_branch2a,conv1)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the usual kernel cache (CONVGRAD_CACHE_DIR) instead of a "
                             "fresh temporary one, so first calls may be cache loads")
    parser.add_argument("--aot", action="store_true",
                        help="let the runtime use ahead-of-time kernels (CONVGRAD_AOT_PATH "
                             "or generated/); by default they are ignored")
    parser.add_argument("--isa", default=None, choices=list(ONEDNN_ISA),
                        help="run convgrad's path for this ISA (CONVGRAD_ISA) and limit "
                             "PyTorch's oneDNN to the same (ONEDNN_MAX_CPU_ISA) and MKL too "
                             "(MKL_ENABLE_INSTRUCTIONS); default: the best this CPU runs, "
                             "unlimited")
    parser.add_argument("--tune", action="store_true",
                        help="also time each layer's tuned plan (convgrad.tuning: candidates "
                             "timed at this size and thread count first), paired with the "
                             "rules' plan apart from PyTorch; its ratio to PyTorch is the "
                             "rules' ratio times that gain")
    parser.add_argument("--alone", action="store_true",
                        help="time convgrad alone, pinned to as many CPUs as threads "
                             "(thread counts in rising order); PyTorch checks once")
    parser.add_argument("--no-torch", action="store_true",
                        help="time convgrad only (PyTorch's CPU f16 weight gradient runs at "
                             "~0.2 GFLOP/s: a full f16 set with it takes hours)")
    parser.add_argument("--shapes-file", type=Path, default=None,
                        help="a benchdnn shape file of one's own (one descriptor a line, "
                             "e.g. mb8ic3ih224oc64oh224kh3ph1n\"vgg:conv1_1\"): every "
                             "layer in it, instead of --set")
    parser.add_argument("--shapes-dir", type=Path, default=DEFAULT_SHAPES_DIR,
                        help=f"benchdnn shape files (default {DEFAULT_SHAPES_DIR})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or any(o not in OPS for o in ops):
        parser.error(f"--ops {args.ops!r}: expected a comma-separated subset of {list(OPS)}")
    args.ops = list(dict.fromkeys(ops))
    if args.alone:
        args.threads = sorted(set(args.threads))
    args.layers = [p.strip() for p in (args.layers or "").split(",") if p.strip()]
    if args.batch < 1 or (args.limit is not None and args.limit < 1) or args.min_time < 0:
        parser.error("--batch and --limit must be positive, --min-time not negative")
    if args.shapes_file is not None and not args.shapes_file.is_file():
        parser.error(f"--shapes-file {args.shapes_file}: no such file")
    if torch is None:
        parser.error("PyTorch is not installed: pip install -e '.[bench]'")
    if args.isa and args.isa not in available_isas():
        parser.error(f"--isa {args.isa}: this CPU runs {list(available_isas())}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.shapes_file is not None:
        args.set = args.shapes_file.name
        shapes = [(args.set, conv)
                  for conv in load_file(args.shapes_file, args.limit, args.layers)]
    else:
        shapes = load_sets(list(SETS) if args.set == "all" else [args.set], args.shapes_dir,
                           args.limit, args.layers)
    if not shapes:
        print("no shapes to run", file=sys.stderr)
        return 1

    saved_torch_threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        updates = {} if args.aot else {"CONVGRAD_AOT_PATH": ""}
        if args.isa:
            updates.update(limit_isa(args.isa))
        if not args.keep_cache:
            updates["CONVGRAD_CACHE_DIR"] = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="convgrad-bench-cache-"))
        stack.enter_context(environment(updates))
        stack.callback(convgrad.set_num_threads, None)
        stack.callback(torch.set_num_threads, saved_torch_threads)

        isa = selected_isa()
        peak = Peak(isa, amx=args.dtype == "bf16")
        first_peak = peak.measure()
        machine = machine_info(first_peak)
        if peak.amx:
            machine["peak_amx_bf16_gflops_per_core"] = round(peak.amx.measure(), 1)
        print(f"{machine['cpu']}, {machine['logical_cpus']} logical CPUs; convgrad "
              f"{machine['convgrad_generator']} ({machine['isa']}), torch {machine['torch']}")
        print(f"f32 FMA peak ({isa}, 1 thread): {first_peak:.1f} GFLOP/s per core; PyTorch's "
              f"oneDNN limited to {machine['onednn_max_cpu_isa']}")
        if peak.amx:
            print(f"bf16 AMX tile peak (1 thread): "
                  f"{machine['peak_amx_bf16_gflops_per_core']:.0f} GFLOP/s per core")
        overhead, tiny_config = measure_call_overhead(args)
        overhead.update(measure_cached_load(tiny_config))
        print(f"call on a tiny problem: convgrad {overhead['ours_tiny_call_us']:.1f} us, "
              f"torch {overhead['torch_tiny_call_us']:.1f} us; cached kernel load in a "
              f"fresh process: {overhead['cached_load_ms']:.1f} ms "
              f"({overhead['cached_load_origin']})")
        print(f"{len(shapes)} shapes x ops {','.join(args.ops)} x threads "
              f"{','.join(map(str, args.threads))}; batch {args.batch}, {args.dtype}, "
              f"{args.data_format}, weights {args.weights_format or 'XIO'}; ratio = convgrad "
              f"GFLOP/s / PyTorch GFLOP/s"
              f"{'; convgrad alone, pinned' if args.alone else ''}\n", flush=True)

        rng = np.random.default_rng(0)
        rounds: list[list[Row]] = []
        for number in range(args.rounds):
            rounds.append([])
            for (shape_set, conv), op in itertools.product(shapes, args.ops):
                case = prepare(conv, op, shape_set, args, rng)  # one case's arrays at a time
                rounds[-1] += run_case(case, args.threads, args, peak)
                for row in rounds[-1][-len(args.threads):]:
                    print(f"  {f'round {number + 1}: ' if args.rounds > 1 else ''}"
                          f"{row.layer} {row.op} x{row.threads}: ours "
                          f"{fmt(row.ours_gflops, 2)} (fastest {fmt(row.ours_best_gflops, 2)}), "
                          f"torch {fmt(row.torch_gflops, 2)} GFLOP/s; peak "
                          f"{fmt(row.peak_gflops, 1)}", file=sys.stderr, flush=True)
        rows = merge_rounds(rounds)
        peaks = [r.peak_gflops for r in rows if r.peak_gflops]
        amx_peaks = [r.amx_peak_gflops for r in rows if r.amx_peak_gflops]

    means = geomeans(rows)
    print(table(rows))
    if peaks:
        print(f"\nFMA peak next to the rows: {min(peaks):.1f}-{max(peaks):.1f} GFLOP/s per "
              "core")
    if amx_peaks:
        print(f"AMX tile peak next to the rows: {min(amx_peaks):.0f}-{max(amx_peaks):.0f} "
              "GFLOP/s per core")
    print("\ngeometric mean of ratios (convgrad / PyTorch):")
    for m in means:
        tuned = (f"; tuned {fmt(m['tuned_geomean_ratio'], 3)}, tuned / untuned "
                 f"{m['tuned_geomean_gain']:.3f}" if "tuned_geomean_gain" in m else "")
        print(f"  {m['op']:8} {m['threads']} thread(s): {fmt(m['geomean_ratio'], 3)} "
              f"over {m['layers']} layers{tuned}; convgrad's share of the peak (geomean) "
              f"median {fmt(m['pct_peak'], 1)} %, fastest {fmt(m['best_pct_peak'], 1)} %"
              + (f"; of the AMX peak: convgrad {fmt(m['pct_amx_peak'], 1)} %, PyTorch "
                 f"{fmt(m['torch_pct_amx_peak'], 1)} %" if "pct_amx_peak" in m else ""))

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "results.csv")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps(
        {"machine": machine, "settings": settings, "overhead": overhead,
         "geomean": means, "rows": [asdict(r) for r in rows]}, indent=1))
    title = (f"convgrad vs PyTorch {machine['torch']}: {args.set}, batch {args.batch}, "
             f"{args.dtype} {args.data_format}, {machine['cpu']}")
    written = ["results.csv", "results.json"]
    if plot(rows, means, args.out / "results.png", title):
        written.append("results.png")
    else:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')",
              file=sys.stderr)
    print(f"\nwrote {', '.join(written)} to {args.out}")
    mismatches = [r for r in rows if r.note.startswith("MISMATCH")]
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
