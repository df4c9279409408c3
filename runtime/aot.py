"""Ahead-of-time generation: layer lists in, a folder of C sources, one shared
library, a header and a manifest out. The runtime uses that folder's kernels
(CONVGRAD_AOT_PATH, default a source checkout's generated/) without a compiler.

    convgrad aot [LAYER_FILES...] [-o DIR] [--ops ...] [--check]

With no layer file it builds ResNet-50's backward-data and backward-weights
layers (oneDNN benchdnn's shapes_resnet_50). Layer files are JSON lists, benchdnn
descriptor files or ONNX models (*.onnx; needs `pip install onnx`): each Conv node
gives a ConvolutionBackwardData and a ConvolutionBackwardWeights layer, each
ConvTranspose node the two ConvTranspose*Backward* layers. With --torch-model
MODULE:FACTORY and --input-shape, the layers are the convolutions of one training step
of that PyTorch model, converted by convgrad.torch (convgrad.torch.aot).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from convgrad import api, kernels, pch, tuning
from convgrad.aot_package import HEADER, LIBRARY, STATIC_LIBRARY, write_packages
from convgrad.cache import cache_dir, file_digest
from convgrad.codegen import OPS, KernelConfig, generator_version, render, source_digest
from convgrad.codegen.config import ISAS
from convgrad.codegen.isa import ISA_FEATURES
from convgrad.codegen.layers import DEFAULT_OPS, Layer, conv_layers, load_json, parse_benchdnn
from convgrad.codegen.plan import candidates, check_plan, kernel_name, vendor_plan
from convgrad.codegen.render import ABI_VERSION, render_aot_file, render_header, render_table
from convgrad.codegen.targets import Target
from convgrad.compiler import (
    archive,
    compile_flags,
    compile_objects,
    compiler_identity,
    link_shared,
)
from convgrad.cpu import available_isas, cpu_vendor, host_family, selected_isa
from convgrad.kernels import source_checkout
from convgrad.onnx_layers import load_onnx
from convgrad.reference import reference

TABLE_SOURCE = "convgrad_table.c"  # in src/: the layer table and the interface functions
TUNED_PLANS = "tuned_plans.json"
BUILTIN_SHAPES = "shapes_resnet_50"


def default_output() -> Path:
    """generated/ of the source checkout this package runs from, else ./generated."""
    root = source_checkout()
    return root / "generated" if root else Path("generated")


@dataclass
class BuildResult:
    output: Path
    configs: dict[KernelConfig, list[Layer]]
    compile_seconds: dict[KernelConfig, float]
    seconds: float
    plans: dict[KernelConfig, dict]


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
        return benchdnn((resources.files("convgrad.codegen") / "data" / BUILTIN_SHAPES).read_text())
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


def representative(users: list[Layer]) -> Layer:
    """The layer a shared kernel is tuned for: the one with the most multiply-adds."""
    return max(users, key=lambda layer: _flops(layer.resolve()))


def tune(layers: list[Layer], *, isa: str, jobs: int, threads: int,
         progress=None) -> dict[KernelConfig, dict]:
    """Tunes every kernel the layers need on this machine (convgrad.tuning), at the
    sizes of its largest layer and on `threads` threads: every candidate is compiled,
    `jobs` at a time, then timed one kernel after the other (parallel timing would
    distort it). Returns the tuning records, also stored in the kernel cache."""
    if isa not in available_isas():
        raise ValueError(f"--tune times kernels on this machine, which cannot run isa {isa}")
    configs = kernels_of(layers, isa)
    pairs = [(config, plan) for config in configs for plan in candidates(config, cpu_vendor())]
    done = [0]

    def compiled_one() -> None:
        done[0] += 1
        if progress:
            progress("compiling candidates", done[0], len(pairs), "")

    loaded = tuning.compile_candidates(pairs, jobs=jobs, progress=compiled_one)
    by_config: dict[KernelConfig, list[kernels.Kernel]] = {}
    for (config, _), kernel in zip(pairs, loaded, strict=True):
        by_config.setdefault(config, []).append(kernel)
    records = {}
    for index, (config, users) in enumerate(configs.items()):
        layer = representative(users)
        if progress:
            progress("timing", index, len(configs), layer.name)
        records[config] = tuning.time_candidates(
            layer.resolve(), config, threads, by_config[config],
            tuning.random_inputs(layer.inputs, layer.dtype))
    if progress:
        progress("timing", len(configs), len(configs), "")
    tuning.store(list(records.values()))
    return records


def plans_from(records: list[dict], configs) -> dict[KernelConfig, dict]:
    """The tuned record of each configuration found in `records` (an exported file)."""
    found = {}
    for record in records:
        config = KernelConfig.from_dict(record["config"])
        if config in configs:
            found.setdefault(config, record)
    return found


def build(layers: list[Layer], output: Path, *, isa: str, jobs: int,
          progress=None, tuned: dict[KernelConfig, dict] | None = None,
          target: Target | None = None, threading: str = "openmp") -> BuildResult:
    """Renders, compiles and links the kernels of `layers` into `output`, each with
    its tuned plan where `tuned` has a record for it, else the planner's rules for the
    target's vendor (this CPU's without a target). `threading` (THREADING_MODES):
    "openmp" kernels run their parallel regions on OpenMP threads, "sequential" ones on
    the calling thread, "caller" ones on the pool the call's convgrad_dims names; the
    last two are built without OpenMP (the library needs only libc and libm).

    The folder is written fully before its manifest, which is replaced
    atomically, so a reader never sees a manifest naming missing kernels."""
    started = time.perf_counter()
    configs = kernels_of(layers, isa)
    tuned = tuned or {}
    vendor = target.vendor if target else cpu_vendor()
    plans = {c: check_plan(tuned[c]["plan"]) if c in tuned else vendor_plan(c, vendor)
             for c in configs}
    # The ISA the kernels really use (avx512bf16 is avx512 for f32/f16 kernels): the
    # compile flags and the CPU features the manifest requires.
    isa = max((config.isa for config in configs), key=ISAS.index, default=isa)
    output.mkdir(parents=True, exist_ok=True)
    sources = output / "src"
    sources.mkdir(exist_ok=True)
    seconds: dict[KernelConfig, float] = {}
    digests: dict[KernelConfig, str] = {}
    names = {config: kernel_name(config, plan) for config, plan in plans.items()}
    aliases = _layer_aliases(configs)
    (output / HEADER).write_text(render_header(
        list(names.values()), {alias: names[config] for alias, config, _ in aliases.values()},
        [alias for alias, _, swapped in aliases.values() if swapped]))
    table = sources / TABLE_SOURCE
    table.write_text(render_table([
        {"name": name, "op": op, "kernel": names[config], "alias": alias, "config": config,
         "swapped": swapped} for (op, name), (alias, config, swapped) in aliases.items()]))
    # Many kernels follow: build the precompiled prelude first (in the kernel cache).
    pch.include_flags(isa, cache_dir(), wait=True, threading=threading)
    with tempfile.TemporaryDirectory(prefix="convgrad-aot-") as tmp:
        def compile_one(config: KernelConfig) -> Path:
            begin = time.perf_counter()
            name = kernel_name(config, plans[config])
            c_file = sources / f"{name}.c"
            source = render(config, plans[config], threading)
            digests[config] = source_digest(source)
            c_file.write_text(source)
            obj = Path(tmp) / f"{name}.o"
            pch.compile_kernel([c_file], obj, isa, cache_dir(), shared=False,
                               threading=threading)
            seconds[config] = time.perf_counter() - begin
            if progress:
                progress(len(seconds), len(configs), name)
            return obj

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_one, configs))
        objects.append(Path(tmp) / table.with_suffix(".o").name)
        compile_objects([table], objects[-1], isa, shared=False, extra=("-I", str(output)),
                        threading=threading)
        library = Path(tmp) / LIBRARY
        link_shared(objects, library, isa, threading)
        os.replace(shutil.copy(library, output / f".{LIBRARY}.tmp"), output / LIBRARY)
        archive(objects, Path(tmp) / STATIC_LIBRARY)
        os.replace(shutil.copy(Path(tmp) / STATIC_LIBRARY, output / f".{STATIC_LIBRARY}.tmp"),
                   output / STATIC_LIBRARY)
    for name in ("convgrad.mk", "convgrad.cmake"):
        (output / name).write_text(render_aot_file(f"{name}.j2", openmp=threading == "openmp"))
    write_packages(output, threading)
    manifest = {
        "generator_version": generator_version(),
        "target": target.to_dict() if target else None,
        "machine": target.family if target else host_family(),
        "isa": isa,
        "cpu_features": sorted(ISA_FEATURES[isa]),
        "compiler": compiler_identity(),
        "threading": threading,
        "flags": list(compile_flags(isa, threading)),
        "library": LIBRARY,
        "library_sha256": file_digest(output / LIBRARY),
        "static_library": STATIC_LIBRARY,
        "header": HEADER,
        "abi_version": ABI_VERSION,
        "kernels": [
            {"name": names[c], "config": c.to_dict(), "source": f"src/{names[c]}.c",
             "source_sha256": digests[c], "plan": plans[c],
             **({"tuning": {k: v for k, v in tuned[c].items() if k != "config"}}
                if c in tuned else {}),
             "layers": [{"op": layer.op, "name": layer.name,
                         **({"inputs_swapped": True}
                            if aliases[layer.op, layer.name][2] else {})}
                        for layer in users]}
            for c, users in configs.items()
        ],
    }
    if tuned:
        tuning.export_plans(output / TUNED_PLANS, [tuned[c] for c in configs if c in tuned])
    temporary = output / ".manifest.json.tmp"
    temporary.write_text(json.dumps(manifest, indent=1))
    os.replace(temporary, output / "manifest.json")
    return BuildResult(output, configs, seconds, time.perf_counter() - started, plans)


def _layer_aliases(configs: dict[KernelConfig, list[Layer]],
                   ) -> dict[tuple[str, str], tuple[str, KernelConfig, bool]]:
    """Per (op, layer name): its alias in the header (the name as a C identifier, with
    the op where several ops share the name, as a benchdnn list's layers do), its
    kernel, and whether that kernel takes the layer's two inputs swapped."""
    ops_of: dict[str, set[str]] = {}
    for users in configs.values():
        for layer in users:
            ops_of.setdefault(layer.name, set()).add(layer.op)
    return {(layer.op, layer.name): (
        _c_identifier(layer.name if len(ops_of[layer.name]) == 1 else f"{layer.name}_{layer.op}"),
        config, layer.resolve().operands_swapped)
        for config, users in configs.items() for layer in users}


def _c_identifier(name: str) -> str:
    """A layer name as the C identifier of its alias in the header."""
    identifier = re.sub(r"\W", "_", name).strip("_").lower()
    return identifier if identifier and not identifier[0].isdigit() else f"layer_{identifier}"


def _with_batch(shape: tuple, batch: int) -> tuple:
    return (batch, *shape[1:])


def median_seconds(call: Callable[[], object], repeats: int, warmups: int = 1) -> float:
    """The median wall time of `repeats` calls of `call` made back to back, right after
    `warmups` untimed calls (which fault in its memory and wake its threads)."""
    for _ in range(warmups):
        call()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _check_inputs(layer: Layer, seed) -> list:
    """A layer's inputs at batch 1: integer data of the layer's dtype (exact in every
    dtype and in any summation order), then its shape input if any."""
    rng = np.random.default_rng(seed)
    dtype = api.DTYPE_BY_NAME[layer.dtype]
    data_inputs = 2 if OPS[layer.op].family == "bwd_weights" else 1  # the rest are weights
    shapes = [_with_batch(s, 1) if i < data_inputs else s for i, s in enumerate(layer.inputs[:2])]
    arrays = [rng.integers(-2, 3, size=s).astype(np.float32).astype(dtype) for s in shapes]
    inputs = arrays + [np.array(v) for v in layer.inputs[2:]]
    full_data_shape = len(layer.inputs) > 2 and len(layer.inputs[2]) == len(layer.inputs[0])
    if OPS[layer.op].family == "bwd_data" and full_data_shape:
        inputs[2] = np.array(_with_batch(layer.inputs[2], 1))
    return inputs


def check_layers(layers: list[Layer], *, repeats: int = 5, num_threads: int | None = None,
                 seed: int = 0, progress=None) -> list[dict]:
    """Runs every layer at batch 1 on integer data through the runtime, times it (the
    median of `repeats` calls after a warm-up, see median_seconds) and compares it with
    the numpy reference bit for bit. Returns per layer the kernel's origin, "ms",
    "gflops" and "exact".

    Every layer is timed before any reference runs, and the references run with BLAS
    on one thread: a multithreaded BLAS call leaves its threads spinning for a while,
    and a kernel timed right after one shares the cores with them (on 2 cores 10-20x
    slower). The order keeps the times true whatever BLAS numpy uses; the limit keeps
    the reference from waking BLAS threads at all, so nothing timed after this call
    (a second check in the same process) meets them either."""
    outcomes = []
    for index, layer in enumerate(layers):
        if progress:
            progress("timing", index, len(layers), layer.name)
        problem = layer.resolve()
        kernel = kernels.get_kernel(problem.config.with_isa(selected_isa()))
        inputs = _check_inputs(layer, (seed, index))
        out = api.execute(layer.op, inputs, layer.attrs, num_threads=num_threads)
        elapsed = median_seconds(partial(api.execute, layer.op, inputs, layer.attrs, out=out,
                                         num_threads=num_threads), repeats)
        outcomes.append({"origin": kernel.origin, "ms": elapsed * 1e3,
                         "gflops": _flops(problem) / problem.batch / elapsed / 1e9})
    if progress:
        progress("timing", len(layers), len(layers), "")
    with threadpool_limits(limits=1, user_api="blas"):
        for index, (layer, outcome) in enumerate(zip(layers, outcomes, strict=True)):
            if progress:
                progress("checking", index, len(layers), layer.name)
            inputs = _check_inputs(layer, (seed, index))
            dtype = api.DTYPE_BY_NAME[layer.dtype]
            result = api.execute(layer.op, inputs, layer.attrs, num_threads=num_threads)
            expected = reference(layer.op, inputs, layer.attrs).astype(np.float32).astype(dtype)
            outcome["exact"] = bool(np.array_equal(result, expected))
    if progress:
        progress("checking", len(layers), len(layers), "")
    return outcomes


def _flops(problem) -> int:
    """2 x multiply-adds of the op, at the problem's batch (taps that hit padding count)."""
    return 2 * problem.multiply_adds
