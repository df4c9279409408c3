"""The `convgrad` command (also `python -m convgrad`).

    convgrad aot [LAYER_FILES...] [-o DIR] [--ops ...] [--isa ...] [--tune] [--check]
    convgrad aot --torch-model MODULE:FACTORY --input-shape N,C,H,W [...] [-o DIR]
    convgrad tune show | export FILE | import FILE
    convgrad cache show | clear
    convgrad explain [LAYER_FILES...] [--layer NAME] [--op OP --inputs A B --attrs JSON]

Tables go to stdout and progress bars to stderr, both drawn by rich: one library
for both, which also leaves out colours and redraws when the stream is not a
terminal (progress is then silent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import convgrad
from convgrad import aot, aot_package, cache, kernels, pch, settings, tuning
from convgrad import explain as explain_module
from convgrad.codegen import OPS, KernelConfig, generator_version
from convgrad.codegen.config import ISAS
from convgrad.codegen.layers import DEFAULT_OPS, OP_ALIASES, Layer
from convgrad.codegen.plan import vendor_plan
from convgrad.codegen.render import THREADING_MODES
from convgrad.codegen.targets import host, target
from convgrad.cpu import available_isas, cpu_vendor


def _stdout() -> Console:
    # Not a terminal (a pipe, a log): no colours, and wide enough that no row wraps.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 1000)


def _table(header: list[str], rows: list[list[str]]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for name in header:  # a narrow terminal folds long kernel names, never cuts them
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*map(str, row))
    return table


def _progress() -> Progress:
    """A progress bar on stderr; silent when stderr is not a terminal."""
    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[item]}"),
                    console=console, disable=not console.is_terminal)


def _stages(progress: Progress):
    """A progress callback (stage, done, total, item) drawing one bar per stage."""
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int, name: str) -> None:
        if stage not in tasks:
            tasks[stage] = progress.add_task(stage, total=total, item="")
        progress.update(tasks[stage], completed=done, total=total, item=name)

    return update


def _add_aot_parser(commands) -> None:
    parser = commands.add_parser(
        "aot", help="generate and build kernels ahead of time (and check them)",
        description=aot.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layers", nargs="*", type=Path,
                        help="layer files: *.json, ONNX models (*.onnx: every Conv and "
                             "ConvTranspose node's gradient ops; needs pip install onnx) or "
                             "benchdnn descriptor files (default: the built-in ResNet-50 list)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="output folder (default: generated/ of a source checkout, else "
                             "./generated)")
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS),
                        help="comma-separated op kinds generated for benchdnn shapes (or data, "
                             "weights, fwd, tweights)")
    parser.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"])
    parser.add_argument("--weights-format", default=None,
                        choices=["OIX", "XIO", "OXI"], help="(ConvTranspose ops use IOX/XOI/IXO)")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch of benchdnn and ONNX layers (default: the file's mb or "
                             "the model's batch; required for a symbolic ONNX batch)")
    parser.add_argument("--isa", default=None, choices=ISAS[::-1],
                        help="target ISA (default: the best this machine runs); the manifest "
                             "records the CPU features it needs")
    parser.add_argument("--target", default=None,
                        help="the CPU to build for, as archspec names it (x86_64_v3, zen3, zen4, "
                             "sapphirerapids, aarch64, neoverse_n1, neoverse_v1, riscv64, ...): "
                             "the best ISA path convgrad has for it, with archspec's compiler "
                             "flags (give a cross compiler with --cc)")
    parser.add_argument("--threading", default="openmp", choices=list(THREADING_MODES),
                        help="how the folder's kernels run their parallel regions: on OpenMP "
                             "threads (default); sequential: on the calling thread; caller: "
                             "on the caller's thread pool, through the parallel_for in "
                             "convgrad_dims (docs/aot.md). The last two link no OpenMP")
    parser.add_argument("--install-prefix", type=Path, default=None, metavar="DIR",
                        help="also install the folder's header, libraries, CMake package and "
                             "pkg-config files into DIR (include/, lib/, lib/cmake/, "
                             "lib/pkgconfig/)")
    parser.add_argument("--cc", default=None,
                        help="C compiler (default: $CC, else cc), e.g. a cross compiler")
    parser.add_argument("--cflags", default=None,
                        help="extra compiler flags (default: $CONVGRAD_CFLAGS)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel compilations (default: every core)")
    parser.add_argument("--no-build", action="store_true",
                        help="build nothing: use the kernels already in the output folder "
                             "(with --check, proves they run without a compiler)")
    parser.add_argument("--check", action="store_true",
                        help="run every layer at batch 1 through the runtime, using the built "
                             "library, time it (median of --repeats calls after a warm-up; "
                             "every layer before any reference runs) and compare with "
                             "convgrad.reference bit for bit")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls per layer with --check (default: 5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads the kernels are tuned for (--tune) and the --check calls "
                             "run on (default: OMP_NUM_THREADS, else every core)")
    parser.add_argument("--tune", action="store_true",
                        help="time every kernel's candidate plans on this machine at its "
                             "largest layer's sizes and build the fastest (see "
                             "convgrad.tuning); writes tuned_plans.json into the output folder "
                             "and keeps the plans in the kernel cache")
    parser.add_argument("--plans", type=Path, default=None,
                        help="build the plans of a tuned-plans file (from --tune or `convgrad "
                             "tune export`) without timing anything")
    model = parser.add_argument_group(
        "PyTorch model (needs pip install convgrad[torch])",
        "The kernels of one training step of a model, converted by convgrad.torch.convert,\n"
        "on random inputs (convgrad.torch.aot_kernels from Python). --ops, --dtype,\n"
        "--data-format, --weights-format and --batch apply to layer files only.")
    model.add_argument("--torch-model", metavar="MODULE:FACTORY", default=None,
                       help="a callable returning a torch.nn.Module (or a module instance), "
                            "imported by module path (the current directory is searched "
                            "first), e.g. mypackage.models:make_model")
    model.add_argument("--input-shape", metavar="N,C,...", type=_shape, action="append",
                       default=None,
                       help="the shape of the model's input; once per input for several")
    model.add_argument("--input-dtype", default="f32", choices=["f32", "bf16", "f16"],
                       help="dtype of the inputs and the model (default: f32)")
    model.add_argument("--channels-last", action="store_true",
                       help="inputs and model in torch's channels_last memory format "
                            "(channels_last_3d for 5-D inputs)")
    parser.set_defaults(run=_aot)


def _shape(text: str) -> tuple[int, ...]:
    """An --input-shape, --inputs or --threads value: comma-separated positive integers."""
    try:
        shape = tuple(int(size) for size in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive sizes separated by "
                                         "commas, e.g. 8,3,112,112")
    return shape


def _torch_layers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list:
    """The layers of --torch-model's training step (parser errors for bad arguments)."""
    if not args.input_shape:
        parser.error("--torch-model needs --input-shape (once per input of the model)")
    try:
        from convgrad.torch import aot as torch_aot
    except ImportError as error:
        parser.error(f"--torch-model: {error}")
    try:
        inputs = torch_aot.example_inputs(args.input_shape, args.input_dtype,
                                          args.channels_last)
    except ValueError as error:
        parser.error(f"--input-shape: {error}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m convgrad` does
    try:
        model = torch_aot.load_model(args.torch_model)
    except ValueError as error:
        parser.error(f"--torch-model {args.torch_model}: {error}")
    try:
        return torch_aot.model_layers(model, inputs, args.channels_last)
    except (RuntimeError, ValueError, TypeError) as error:
        shapes = " ".join(",".join(map(str, shape)) for shape in args.input_shape)
        parser.error(f"--torch-model {args.torch_model}: one training step on inputs of "
                     f"shape {shapes} failed: {type(error).__name__}: {error}")


def _op_kinds(text: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """--ops: op kinds, or their short names (data, weights, fwd, tweights)."""
    ops = tuple(OP_ALIASES.get(o.strip(), o.strip()) for o in text.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        parser.error(f"--ops {text!r}: unknown op kind(s) {unknown}; expected op kinds of "
                     f"{list(OPS)} or {', '.join(OP_ALIASES)}")
    return ops


def _aot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    ops = _op_kinds(args.ops, parser)
    for name in ("jobs", "repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1 (got {value})")
    changes = {}  # the settings this command runs with (settings.using, not os.environ)
    if args.cc:
        changes["CC"] = args.cc
    if args.cflags is not None:
        changes["CONVGRAD_CFLAGS"] = args.cflags
    output = args.output or aot.default_output()
    isa = args.isa or available_isas()[0]
    named = None
    if args.target:
        try:
            named = target(args.target)
        except ValueError as error:
            parser.error(str(error))
        if args.isa and args.isa != named.isa:
            parser.error(f"--isa {args.isa} contradicts --target {named.name} (its path is "
                         f"{named.isa})")
        isa = named.isa
        changes["CONVGRAD_TARGET"] = named.name
        if named.isa not in available_isas() and (args.check or args.tune):
            parser.error(f"--check and --tune run kernels here; this machine cannot run "
                         f"{named.name}'s {named.isa} path (see README: emulated tests)")
    if args.input_shape and not args.torch_model:
        parser.error("--input-shape is the shape of --torch-model's input")
    with settings.using(settings.current().with_values(**changes)):
        return _aot_with(args, parser, ops, output, isa, named)


def _aot_with(args: argparse.Namespace, parser: argparse.ArgumentParser, ops, output: Path,
              isa: str, named) -> int:
    """_aot once its settings are in force."""
    try:
        layers = [] if args.torch_model and not args.layers else aot.read_layers(
            args.layers, ops=ops, dtype=args.dtype, data_format=args.data_format,
            weights_format=args.weights_format, batch=args.batch)
    except (OSError, ValueError, TypeError, RuntimeError) as error:
        parser.error(str(error))
    if args.torch_model:
        layers += _torch_layers(args, parser)
    out = _stdout()
    if args.tune and (args.plans or args.no_build):
        parser.error("--tune builds kernels it times: not with --plans or --no-build")
    threads = args.threads or convgrad.get_num_threads()
    tuned = {}
    if args.plans:
        try:
            records = tuning.read_plans(args.plans)
        except (OSError, ValueError) as error:
            parser.error(str(error))
        tuned = aot.plans_from(records, aot.kernels_of(layers, isa))
    if args.tune:
        print(f"convgrad {generator_version()}: tuning {len(aot.kernels_of(layers, isa))} "
              f"kernels on {threads} thread{'s' if threads > 1 else ''}", file=sys.stderr)
        started = time.perf_counter()
        with _progress() as progress:
            try:
                tuned = aot.tune(layers, isa=isa, jobs=args.jobs, threads=threads,
                                 progress=_stages(progress))
            except ValueError as error:
                parser.error(str(error))
        out.print(_table(["kernel", "tuned plan", "rules ms", "tuned ms", "gain"],
                         [[c.name, _plan_text(r["plan"], vendor_plan(c, cpu_vendor())),
                           f"{r['rules_seconds'] * 1e3:.3f}",
                           f"{r['tuned_seconds'] * 1e3:.3f}",
                           f"{r['rules_seconds'] / r['tuned_seconds']:.2f}x"]
                          for c, r in tuned.items()]))
        out.print(f"tuned {len(tuned)} kernels in {time.perf_counter() - started:.1f} s "
                  f"(batch and sizes of each kernel's largest layer, {threads} threads)")

    if args.no_build:
        configs, seconds = aot.kernels_of(layers, isa), {}
    else:
        print(f"convgrad {generator_version()}: {len(layers)} layers, isa {isa}, "
              f"{args.jobs} jobs -> {output}", file=sys.stderr)
        with _progress() as progress:
            task = progress.add_task("compiling", total=None, item="")

            def advance(done: int, total: int, name: str) -> None:
                progress.update(task, completed=done, total=total, item=name)

            result = aot.build(layers, output, isa=isa, jobs=args.jobs, progress=advance,
                               tuned=tuned, target=named, threading=args.threading)
        vendor = named.vendor if named else cpu_vendor()
        configs, seconds = result.configs, result.compile_seconds
        out.print(_table(["kernel", "layers", "plan", "compile s"],
                         [[c.name, len(users),
                           _plan_text(result.plans[c], vendor_plan(c, vendor)),
                           f"{seconds[c]:.2f}"] for c, users in configs.items()]))
        out.print(f"built {len(configs)} kernels for {len(layers)} layers into {output} "
                  f"({aot.LIBRARY}, {aot.STATIC_LIBRARY}, {aot.HEADER}) in "
                  f"{result.seconds:.1f} s")

    if args.install_prefix:
        try:
            installed = aot_package.install(output, args.install_prefix)
        except OSError as error:
            parser.error(f"--install-prefix: {error}")
        out.print(f"installed {len(installed)} files into {args.install_prefix}")
    if not args.check:
        return 0
    checked = [(config, layer) for config, users in configs.items() for layer in users]
    kernels.reset()
    try:
        with settings.using(settings.current().with_values(CONVGRAD_AOT_PATH=str(output))), \
                _progress() as progress:
            outcomes = aot.check_layers([layer for _, layer in checked], repeats=args.repeats,
                                        num_threads=threads, progress=_stages(progress))
    finally:
        kernels.reset()  # its kernels came from that folder
    rows, failures = [], 0
    for (config, layer), outcome in zip(checked, outcomes, strict=True):
        failures += not (outcome["exact"] and outcome["origin"] == "aot")
        compile_s = f"{seconds[config]:.2f}" if config in seconds else "-"
        rows.append([layer.name, layer.op, compile_s, outcome["origin"],
                     "exact" if outcome["exact"] else "MISMATCH",
                     f"{outcome['ms']:.3f}", f"{outcome['gflops']:.1f}"])
    out.print(_table(["layer", "op", "compile s", "kernel from", "vs reference", "ms",
                      "GFLOP/s"], rows))
    out.print(f"ms and GFLOP/s: batch 1, {threads} thread{'s' if threads > 1 else ''}, the "
              f"median of {args.repeats} calls after a warm-up")
    out.print(f"{len(rows) - failures} of {len(rows)} layers exact and served by the AOT "
              "library")
    return 1 if failures else 0


def _plan_text(plan: dict, rules: dict) -> str:
    """A plan as its choices; "rules" where it is the vendor's rules' plan (`rules`)."""
    text = ", ".join(f"{k}={v}" for k, v in sorted(plan.items()))
    if plan == rules:
        return f"rules ({text})" if text else "rules"
    return text or "rules (any vendor)"


def _add_tune_parser(commands) -> None:
    parser = commands.add_parser(
        "tune", help="show, export or import tuned plans",
        description="Tuned plans (convgrad.tuning) kept in the kernel cache: list them, "
                    "export them to a file a build can check in and ship, or import such a "
                    "file (then CONVGRAD_TUNE=reuse or =1 uses them without timing).")
    parser.add_argument("action", choices=["show", "export", "import"])
    parser.add_argument("file", nargs="?", type=Path, help="the file to export to or import")
    parser.set_defaults(run=_tune)


def _tune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    out = _stdout()
    if args.action == "show":
        records = tuning.all_records()
        out.print(_table(
            ["kernel", "sizes", "threads", "cpu", "plan", "rules ms", "tuned ms"],
            [[KernelConfig.from_dict(r["config"]).name, _sizes_text(r["sizes"]), r["threads"],
              r["machine"].get("cpu", "?"), _plan_text(r["plan"]),
              f"{r['rules_seconds'] * 1e3:.3f}", f"{r['tuned_seconds'] * 1e3:.3f}"]
             for r in records]))
        out.print(f"{len(records)} tuned plans in {cache.cache_dir() / 'tuned'}")
        return 0
    if args.file is None:
        parser.error(f"tune {args.action} needs a FILE")
    try:
        if args.action == "export":
            count = tuning.export_plans(args.file)
            out.print(f"exported {count} tuned plans to {args.file}")
        else:
            count = tuning.import_plans(args.file)
            out.print(f"imported {count} tuned plans from {args.file} into "
                      f"{cache.cache_dir() / 'tuned'}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"{args.file}: {error}")
    return 0


def _sizes_text(sizes: dict) -> str:
    return (f"n{sizes['batch']} " + "x".join(map(str, sizes["dst"]))
            + (f" pads {','.join(map(str, sizes['pads']))}" if any(sizes["pads"]) else ""))


def _add_cache_parser(commands) -> None:
    parser = commands.add_parser("cache", help="show or clear the kernel cache",
                                 description="Show or clear the on-disk kernel cache "
                                             "(CONVGRAD_CACHE_DIR).")
    parser.add_argument("action", choices=["show", "clear"])
    parser.set_defaults(run=_cache)


def _cache(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    folder = cache.configured_dir()
    found = cache.entries(folder) if folder.is_dir() else []
    out = _stdout()
    if args.action == "clear":
        removed = cache.evict(folder, limit=0) if found else 0
        cache.clear_index(folder)
        headers = pch.clear(folder)
        out.print(f"removed {removed} kernels and {headers} precompiled headers from {folder}")
        return 0
    headers, header_bytes = pch.stored(folder)
    out.print(f"{folder}: {len(found)} kernels, {sum(e['bytes'] for e in found) / 2**20:.1f} "
              f"MB (cap {cache.max_bytes() / 2**20:.0f} MB, CONVGRAD_CACHE_MAX_MB); "
              f"{headers} precompiled headers, {header_bytes / 2**20:.1f} MB")
    if found:
        rows = [[time.strftime("%Y-%m-%d %H:%M", time.localtime(e["used"])),
                 f"{e['bytes'] / 1024:.1f}", e["compiler"], e["library"].name]
                for e in reversed(found)]
        out.print(_table(["last used", "KB", "compiler", "kernel"], rows))
    return 0


def _add_explain_parser(commands) -> None:
    parser = commands.add_parser(
        "explain", help="which kernel, variant and plan a layer gets, and why",
        description=explain_module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layers", nargs="*", type=Path,
                        help="layer files, as for `convgrad aot` (default: the built-in "
                             "ResNet-50 list, unless --op is given)")
    parser.add_argument("--layer", action="append", default=None, metavar="NAME",
                        help="only the layers whose name contains NAME (repeatable)")
    parser.add_argument("--op", default=None, choices=sorted(OPS),
                        help="one op instead of layer files, with --inputs and --attrs")
    parser.add_argument("--inputs", nargs="+", type=_shape, default=None, metavar="N,H,...",
                        help="with --op: the two input shapes (and the shape input's value)")
    parser.add_argument("--notes", action="store_true",
                        help="each rule's constants, with the measured notes that set them")
    parser.add_argument("--attrs", type=json.loads, default={}, metavar="JSON",
                        help='with --op: attributes, e.g. \'{"strides": 2, "pads_begin": 1}\'')
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS),
                        help="comma-separated op kinds generated for benchdnn shapes (or data, "
                             "weights, fwd, tweights)")
    parser.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    parser.add_argument("--data-format", default=None, choices=["NXC", "NCX"],
                        help="data layout (default NXC; with --op, the attribute's, and "
                             "--inputs in this layout)")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch of benchdnn layers (default: the file's mb)")
    parser.add_argument("--threads", type=_shape, default=(), metavar="N[,N...]",
                        help="how the kernel's main parallel region splits the work over N "
                             "threads: tasks a thread, the largest share over the mean")
    parser.add_argument("--isa", default=None, choices=ISAS[::-1],
                        help="ISA path (default: the best this machine runs)")
    parser.add_argument("--vendor", default=None, help="the rules for a CPU of this vendor "
                        "(GenuineIntel, AuthenticAMD; default: this CPU's)")
    parser.add_argument("--plan", type=json.loads, default=None, metavar="JSON",
                        help="a plan to resolve instead of the rules' (an override the "
                             "variant does not take is an error)")
    parser.set_defaults(run=_explain)


def _explain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.op:
        if not args.inputs or len(args.inputs) not in (2, 3):
            parser.error("--op needs --inputs with two shapes (and the shape input)")
        attrs = dict(args.attrs)
        if args.data_format:
            if attrs.get("data_format", args.data_format) != args.data_format:
                parser.error(f"--data-format {args.data_format} and --attrs "
                             f"data_format {attrs['data_format']} disagree")
            attrs["data_format"] = args.data_format
        layers = [Layer(args.op, tuple(args.inputs), attrs, args.dtype, args.op)]
    else:
        layers = aot.read_layers(args.layers, ops=_op_kinds(args.ops, parser),
                                 dtype=args.dtype, data_format=args.data_format or "NXC",
                                 batch=args.batch)
    if args.layer:
        layers = [layer for layer in layers if any(n in layer.name for n in args.layer)]
    if not layers:
        parser.error("no layer matches")
    try:
        for layer in layers:
            print(explain_module.explain(layer, isa=args.isa, plan=args.plan,
                                         vendor=args.vendor, with_notes=args.notes,
                                         threads=args.threads))
    except ValueError as error:
        parser.exit(2, f"convgrad explain: error: {error}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `convgrad` command's parser (its subcommands' `run` is in their defaults)."""
    parser = argparse.ArgumentParser(
        prog="convgrad", description="Specialized C kernels for the gradient ops of "
                                     "convolution: ahead-of-time builds and the kernel cache.")
    parser.add_argument("--version", action="version",
                        version=f"convgrad {generator_version()} (this CPU: {host()}, "
                                f"paths {', '.join(available_isas())})")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    _add_aot_parser(commands)
    _add_tune_parser(commands)
    _add_cache_parser(commands)
    _add_explain_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `convgrad` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args, parser)
