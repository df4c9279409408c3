"""Ahead-of-time generation: layer lists in, a folder of C sources, one shared
library, a header and a manifest out. The runtime uses that folder's kernels
(CONVGRAD_AOT_PATH, default the repository's generated/) without a compiler.

    python -m runtime.aot [LAYER_FILES...] [-o DIR] [--ops ...] [--check]

With no layer file it builds ResNet-50's backward-data and backward-weights
layers (oneDNN benchdnn's shapes_resnet_50). Layer files are JSON lists, benchdnn
descriptor files or ONNX models (*.onnx; needs `pip install onnx`): each Conv node
gives a ConvolutionBackwardData and a ConvolutionBackwardWeights layer, each
ConvTranspose node the two ConvTranspose*Backward* layers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from codegen import OPS, KernelConfig, generator_version, render
from codegen.config import ISAS
from codegen.layers import DEFAULT_OPS, Layer, conv_layers, load_json, parse_benchdnn
from codegen.plan import ISA_FEATURES
from codegen.render import render_header
from runtime import api, kernels
from runtime.cache import file_digest
from runtime.compiler import (
    archive,
    compile_flags,
    compile_objects,
    compiler_identity,
    link_shared,
)
from runtime.cpu import available_isas, selected_isa
from runtime.onnx_layers import load_onnx

LIBRARY = "libconvgrad_kernels.so"
STATIC_LIBRARY = "libconvgrad_kernels.a"
HEADER = "convgrad_kernels.h"
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "generated"
BUILTIN_SHAPES = "shapes_resnet_50"


@dataclass
class BuildResult:
    output: Path
    configs: dict[KernelConfig, list[Layer]]
    compile_seconds: dict[KernelConfig, float]
    seconds: float


def read_layers(paths: list[Path], *, ops=DEFAULT_OPS, dtype="f32", data_format="NXC",
                weights_format=None, batch=None) -> list[Layer]:
    """Layers of JSON files (*.json), ONNX models (*.onnx: the gradient ops of every
    Conv and ConvTranspose node) and benchdnn descriptor files (anything else); the
    built-in ResNet-50 list when `paths` is empty."""

    def benchdnn(text: str) -> list[Layer]:
        return [layer for conv in parse_benchdnn(text)
                for layer in conv_layers(conv, ops, batch=batch, dtype=dtype,
                                         data_format=data_format,
                                         weights_format=weights_format)]

    if not paths:
        return benchdnn((resources.files("codegen") / "data" / BUILTIN_SHAPES).read_text())
    layers = []
    for path in paths:
        if path.suffix == ".json":
            layers += load_json(path)
        elif path.suffix == ".onnx":
            layers += load_onnx(path, dtype=dtype, batch=batch, data_format=data_format)
        else:
            layers += benchdnn(path.read_text())
    return layers


def kernels_of(layers: list[Layer], isa: str) -> dict[KernelConfig, list[Layer]]:
    """The distinct kernels the layers need, each with the layers that use it."""
    configs: dict[KernelConfig, list[Layer]] = {}
    for layer in layers:
        configs.setdefault(layer.resolve().config.with_isa(isa), []).append(layer)
    return configs


def build(layers: list[Layer], output: Path, *, isa: str, jobs: int,
          progress=None) -> BuildResult:
    """Renders, compiles and links the kernels of `layers` into `output`.

    The folder is written fully before its manifest, which is replaced
    atomically, so a reader never sees a manifest naming missing kernels."""
    started = time.perf_counter()
    configs = kernels_of(layers, isa)
    # The ISA the kernels really use (avx512bf16 is avx512 for f32/f16 kernels): the
    # compile flags and the CPU features the manifest requires.
    isa = max((config.isa for config in configs), key=ISAS.index, default=isa)
    output.mkdir(parents=True, exist_ok=True)
    sources = output / "src"
    sources.mkdir(exist_ok=True)
    seconds: dict[KernelConfig, float] = {}
    with tempfile.TemporaryDirectory(prefix="convgrad-aot-") as tmp:
        def compile_one(config: KernelConfig) -> Path:
            begin = time.perf_counter()
            c_file = sources / f"{config.name}.c"
            c_file.write_text(render(config))
            obj = Path(tmp) / f"{config.name}.o"
            compile_objects([c_file], obj, isa, shared=False)
            seconds[config] = time.perf_counter() - begin
            if progress:
                progress(len(seconds), len(configs), config.name)
            return obj

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_one, configs))
        library = Path(tmp) / LIBRARY
        link_shared(objects, library, isa)
        os.replace(shutil.copy(library, output / f".{LIBRARY}.tmp"), output / LIBRARY)
        archive(objects, Path(tmp) / STATIC_LIBRARY)
        os.replace(shutil.copy(Path(tmp) / STATIC_LIBRARY, output / f".{STATIC_LIBRARY}.tmp"),
                   output / STATIC_LIBRARY)
    aliases = {_c_identifier(layer.name): config.name
               for config, users in configs.items() for layer in users}
    (output / HEADER).write_text(render_header(list(configs), aliases))
    (output / "convgrad.mk").write_text(MAKE_FRAGMENT)
    (output / "convgrad.cmake").write_text(CMAKE_FRAGMENT)
    manifest = {
        "generator_version": generator_version(),
        "isa": isa,
        "cpu_features": sorted(ISA_FEATURES[isa]),
        "compiler": compiler_identity(),
        "flags": list(compile_flags(isa)),
        "library": LIBRARY,
        "library_sha256": file_digest(output / LIBRARY),
        "static_library": STATIC_LIBRARY,
        "header": HEADER,
        "kernels": [
            {"name": c.name, "config": c.to_dict(), "source": f"src/{c.name}.c",
             "layers": [{"op": layer.op, "name": layer.name} for layer in users]}
            for c, users in configs.items()
        ],
    }
    temporary = output / ".manifest.json.tmp"
    temporary.write_text(json.dumps(manifest, indent=1))
    os.replace(temporary, output / "manifest.json")
    return BuildResult(output, configs, seconds, time.perf_counter() - started)


MAKE_FRAGMENT = """\
# convgrad kernels built ahead of time. In a Makefile:
#   include path/to/convgrad.mk
#   CFLAGS += $(CONVGRAD_CFLAGS)
#   LDLIBS += $(CONVGRAD_LIBS)
CONVGRAD_DIR := $(dir $(lastword $(MAKEFILE_LIST)))
CONVGRAD_CFLAGS := -I$(CONVGRAD_DIR)
CONVGRAD_LIBS := $(CONVGRAD_DIR)libconvgrad_kernels.a -fopenmp
"""

CMAKE_FRAGMENT = """\
# convgrad kernels built ahead of time. In CMakeLists.txt:
#   include(path/to/convgrad.cmake)
#   target_link_libraries(my_program PRIVATE convgrad_kernels)
find_package(OpenMP REQUIRED COMPONENTS C)
add_library(convgrad_kernels STATIC IMPORTED)
set_target_properties(convgrad_kernels PROPERTIES
    IMPORTED_LOCATION "${CMAKE_CURRENT_LIST_DIR}/libconvgrad_kernels.a"
    INTERFACE_INCLUDE_DIRECTORIES "${CMAKE_CURRENT_LIST_DIR}"
    INTERFACE_LINK_LIBRARIES OpenMP::OpenMP_C)
"""


def _c_identifier(name: str) -> str:
    """A layer name as the C identifier of its alias in the header."""
    identifier = re.sub(r"\W", "_", name).strip("_").lower()
    return identifier if identifier and not identifier[0].isdigit() else f"layer_{identifier}"


def _load_reference():
    """The independent numpy oracle of the test suite (needs a source checkout)."""
    path = Path(__file__).resolve().parent.parent / "tests" / "reference.py"
    if not path.is_file():
        raise SystemExit("--check needs tests/reference.py from a convgrad source checkout")
    spec = importlib.util.spec_from_file_location("convgrad_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference


def _with_batch(shape: tuple, batch: int) -> tuple:
    return (batch, *shape[1:])


def check_layer(layer: Layer, reference, rng) -> dict:
    """Runs a layer at batch 1 on integer data and compares with the oracle bit for bit."""
    dtype = api.DTYPE_BY_NAME[layer.dtype]
    data_inputs = 2 if OPS[layer.op].family == "bwd_weights" else 1  # the rest are weights
    shapes = [_with_batch(s, 1) if i < data_inputs else s for i, s in enumerate(layer.inputs[:2])]
    arrays = [rng.integers(-2, 3, size=s).astype(np.float32).astype(dtype) for s in shapes]
    inputs = arrays + [np.array(v) for v in layer.inputs[2:]]
    full_data_shape = len(layer.inputs) > 2 and len(layer.inputs[2]) == len(layer.inputs[0])
    if OPS[layer.op].family == "bwd_data" and full_data_shape:
        inputs[2] = np.array(_with_batch(layer.inputs[2], 1))
    problem = layer.resolve()
    kernel = kernels.get_kernel(problem.config.with_isa(selected_isa()))
    begin = time.perf_counter()
    result = api.execute(layer.op, inputs, layer.attrs)
    elapsed = time.perf_counter() - begin
    expected = reference(layer.op, inputs, layer.attrs).astype(np.float32).astype(dtype)
    return {"exact": bool(np.array_equal(result, expected)), "origin": kernel.origin,
            "ms": elapsed * 1e3, "gflops": _flops(problem) / problem.batch / elapsed / 1e9}


def _flops(problem) -> int:
    """2 x multiply-adds of the op, at the problem's batch (taps that hit padding count)."""
    c = problem.config
    count = 2 * problem.batch * c.groups * c.cin_per_group * c.cout_per_group
    for x, k in zip(problem.dst_spatial, c.kernel, strict=True):
        count *= x * k
    return count


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True))
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.aot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layers", nargs="*", type=Path,
                        help="layer files: *.json, ONNX models (*.onnx: every Conv and "
                             "ConvTranspose node's gradient ops; needs pip install onnx) or "
                             "benchdnn descriptor files (default: the built-in ResNet-50 list)")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT,
                        help=f"output folder (default: {DEFAULT_OUTPUT})")
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS),
                        help="comma-separated op kinds generated for benchdnn shapes")
    parser.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    parser.add_argument("--data-format", default="NXC", choices=["NXC", "NCX"])
    parser.add_argument("--weights-format", default=None,
                        choices=["OIX", "XIO"], help="(ConvTranspose ops use IOX/XOI)")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch of benchdnn and ONNX layers (default: the file's mb or "
                             "the model's batch; required for a symbolic ONNX batch)")
    parser.add_argument("--isa", default=None, choices=ISAS[::-1],
                        help="target ISA (default: the best this machine runs); the manifest "
                             "records the CPU features it needs")
    parser.add_argument("--cc", default=None,
                        help="C compiler (default: $CC, else cc), e.g. a cross compiler")
    parser.add_argument("--cflags", default=None,
                        help="extra compiler flags (default: $CONVGRAD_CFLAGS)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-build", action="store_true",
                        help="build nothing: use the kernels already in the output folder "
                             "(with --check, proves they run without a compiler)")
    parser.add_argument("--check", action="store_true",
                        help="run every layer at batch 1 through the runtime, using the built "
                             "library, and compare with the numpy reference bit for bit")
    args = parser.parse_args(argv)

    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        parser.error(f"unknown op kind(s) {unknown}; expected {list(OPS)}")
    if args.cc:
        os.environ["CC"] = args.cc
    if args.cflags is not None:
        os.environ["CONVGRAD_CFLAGS"] = args.cflags
    isa = args.isa or available_isas()[0]
    try:
        layers = read_layers(args.layers, ops=ops, dtype=args.dtype,
                             data_format=args.data_format, weights_format=args.weights_format,
                             batch=args.batch)
    except (OSError, ValueError, TypeError, RuntimeError) as error:
        parser.error(str(error))

    def progress(done: int, total: int, name: str) -> None:
        if sys.stderr.isatty():  # a bar redrawn in place
            filled = 30 * done // total
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {name[:70]:70}",
                  end="" if done < total else "\n", file=sys.stderr, flush=True)
        elif done == total or done % max(1, total // 10) == 0:  # a line per ~10%
            print(f"compiled {done}/{total} kernels", file=sys.stderr, flush=True)

    if args.no_build:
        configs, seconds = kernels_of(layers, isa), {}
    else:
        print(f"convgrad {generator_version()}: {len(layers)} layers, isa {isa}, "
              f"{args.jobs} jobs -> {args.output}", file=sys.stderr)
        result = build(layers, args.output, isa=isa, jobs=args.jobs, progress=progress)
        configs, seconds = result.configs, result.compile_seconds
        print(_table([[c.name, len(users), f"{seconds[c]:.2f}"] for c, users in configs.items()],
                     ["kernel", "layers", "compile s"]))
        print(f"built {len(configs)} kernels for {len(layers)} layers into {args.output} "
              f"({LIBRARY}, {STATIC_LIBRARY}, {HEADER}) in {result.seconds:.1f} s")

    if not args.check:
        return 0
    os.environ["CONVGRAD_AOT_PATH"] = str(args.output)
    kernels.reset()
    reference = _load_reference()
    rng = np.random.default_rng(0)
    rows, failures = [], 0
    for config, users in configs.items():
        for layer in users:
            outcome = check_layer(layer, reference, rng)
            failures += not (outcome["exact"] and outcome["origin"] == "aot")
            compile_s = f"{seconds[config]:.2f}" if config in seconds else "-"
            rows.append([layer.name, layer.op, compile_s,
                         outcome["origin"], "exact" if outcome["exact"] else "MISMATCH",
                         f"{outcome['ms']:.2f}", f"{outcome['gflops']:.1f}"])
    print(_table(rows, ["layer", "op", "compile s", "kernel from", "vs reference",
                        "ms (mb=1)", "GFLOP/s"]))
    print(f"{len(rows) - failures} of {len(rows)} layers exact and served by the AOT library")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
