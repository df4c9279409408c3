"""Kernels built for other CPUs with a cross compiler, run under qemu's user-mode
emulation by a small C driver and compared with the numpy reference bit for bit on
integer data: aarch64's NEON path (Neoverse N1), its 256-bit SVE path (Neoverse V1,
under `qemu-aarch64 -cpu max,sve256=on`) and the portable path on riscv64. Also the C
example, built ahead of time for aarch64. This checks correctness only: emulation says
nothing about speed.

CI installs gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu, gcc-riscv64-linux-gnu and
qemu-user, so these tests never skip there. A modest sample runs by default, more with
CONVGRAD_SLOW_TESTS=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aot_driver
import numpy as np
import pytest
from cases import DTYPES, make_case

from convgrad.codegen import KernelConfig, render
from convgrad.codegen.ops import resolve
from convgrad.codegen.render import render_header
from convgrad.codegen.targets import target
from convgrad.compiler import BASE_FLAGS
from convgrad.reference import OP_KINDS

CLI = [sys.executable, "-m", "convgrad"]  # this interpreter's, venv activated or not
ROOT = Path(__file__).resolve().parent.parent

TARGETS = {
    "neoverse_n1": dict(cc="aarch64-linux-gnu-gcc",
                        qemu=["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"]),
    "neoverse_v1": dict(cc="aarch64-linux-gnu-gcc",
                        qemu=["qemu-aarch64", "-cpu", "max,sve256=on", "-L",
                              "/usr/aarch64-linux-gnu"]),
    "riscv64": dict(cc="riscv64-linux-gnu-gcc",
                    qemu=["qemu-riscv64", "-L", "/usr/riscv64-linux-gnu"]),
}


def _tools(name: str) -> dict:
    tools = TARGETS[name]
    missing = [t for t in (tools["cc"], tools["qemu"][0]) if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install gcc-aarch64-linux-gnu "
                    "gcc-riscv64-linux-gnu qemu-user)")
    return tools


def _random_cases(count: int, seed: int) -> list:
    """Integer-valued problems of every op, dtype, layout and rank, small and varied."""
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        rank = int(rng.integers(1, 4))
        op = OP_KINDS[len(cases) % len(OP_KINDS)]
        groups = int(rng.choice([1, 1, 2, 3]))
        channels = groups * int(rng.integers(1, 6)), groups * int(rng.integers(1, 24))
        if rng.random() < 0.2:  # depthwise
            channels = groups = int(rng.integers(2, 20))
            channels = (channels, channels)
        attrs = dict(strides=rng.integers(1, 3, rank).tolist(),
                     dilations=rng.integers(1, 3, rank).tolist(),
                     pads_begin=rng.integers(0, 2, rank).tolist(),
                     pads_end=rng.integers(0, 2, rank).tolist())
        try:
            case = make_case(op, spatial=tuple(rng.integers(3, 9, rank).tolist()),
                             kernel=tuple(rng.integers(1, 4, rank).tolist()), groups=groups,
                             in_channels=channels[0], out_channels=channels[1],
                             batch=int(rng.integers(1, 3)), attrs=attrs,
                             data_format=str(rng.choice(["NXC", "NCX"])),
                             dtype=str(rng.choice(list(DTYPES))), seed=len(cases))
            case.expected(np.float32)
        except ValueError:
            continue  # a geometry the op rejects
        cases.append(case)
    return cases


def _problem(case):
    a, b = case.inputs[:2]
    shape = case.inputs[2].tolist() if len(case.inputs) > 2 else None
    dtype = {np.dtype(v).name: k for k, v in DTYPES.items()}[np.dtype(a.dtype).name]
    return resolve(case.op, [a.shape, b.shape], case.attrs, shape, dtype)


def _build(configs: list[KernelConfig], folder: Path, name: str, cc: str) -> Path:
    """The kernels and the driver, cross-compiled for target `name`."""
    names = [c.name for c in configs]
    (folder / "kernels.h").write_text(render_header(names))
    (folder / "driver.c").write_text(aot_driver.driver_source(names, "kernels.h"))
    flags = [*BASE_FLAGS, *target(name).flags("gcc", "12.2"),
             *({"neoverse_v1": ["-msve-vector-bits=256"]}.get(name, []))]

    def compile_one(config: KernelConfig) -> Path:
        source = folder / f"{config.name}.c"
        source.write_text(render(config))
        obj = source.with_suffix(".o")
        run = subprocess.run([cc, *flags, "-c", "-o", str(obj), str(source)],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, configs))
    program = folder / "driver"
    run = subprocess.run([cc, *flags, f"-I{folder}", "-o", str(program), str(folder / "driver.c"),
                          *map(str, objects)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return program


def _run_cases(name: str, count: int, seed: int, tmp_path: Path) -> None:
    tools = _tools(name)
    isa = target(name).isa
    cases = _random_cases(count, seed)
    problems = [_problem(case) for case in cases]
    configs = list(dict.fromkeys(p.config.with_isa(isa) for p in problems))
    assert {c.isa for c in configs} == {isa}
    program = _build(configs, tmp_path, name, tools["cc"])
    for index, (case, problem) in enumerate(zip(cases, problems, strict=True)):
        a, b = case.inputs[:2]
        first, second = (b, a) if problem.swap_inputs else (a, b)
        expected = case.expected(a.dtype)
        rank = problem.config.rank
        pad3 = [1] * (3 - rank)
        header = [configs.index(problem.config.with_isa(isa)), problem.batch,
                  *problem.src_spatial, *pad3, *problem.dst_spatial, *pad3,
                  *problem.pads_begin, *[0] * (3 - rank), 2,
                  first.nbytes, second.nbytes, expected.nbytes]
        # spatial sizes of absent leading axes are 1 and sit after the given ones here:
        # the kernel reads only the first RANK entries of each array
        case_file, result_file = tmp_path / f"case{index}.bin", tmp_path / f"out{index}.bin"
        case_file.write_bytes(struct.pack("<15q", *header) + first.tobytes() + second.tobytes())
        run = subprocess.run([*tools["qemu"], str(program), str(case_file), str(result_file)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        data = result_file.read_bytes()
        assert struct.unpack("<i", data[:4])[0] == 0
        result = np.frombuffer(data[4:], dtype=expected.dtype).reshape(expected.shape)
        view = np.uint16 if expected.dtype.itemsize == 2 else np.uint32
        np.testing.assert_array_equal(result.view(view), expected.view(view),
                                      err_msg=f"{name}: {case.op} {problem.config.name}")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_random_kernels_under_emulation(name, tmp_path):
    _run_cases(name, 8, seed=sorted(TARGETS).index(name), tmp_path=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_many_random_kernels_under_emulation(name, tmp_path):
    _run_cases(name, 48, seed=100 + sorted(TARGETS).index(name), tmp_path=tmp_path)


_BRANCH = re.compile(r"^\s+(?:b\.?(?:ne|eq|lt|gt|le|ge|cc|cs|hi|ls|mi|pl|lo|hs|any|none|"
                     r"first|last|nfrst)|cbn?z\s+\w+,|tbn?z\s+\w+,\s*#?\d+,)\s*(\.L\d+)")


def _inner_tile_loops(assembly: str) -> dict[str, tuple[int, int, int]]:
    """Per tile function: the innermost loop with multiply-adds (the one a backward
    branch closes first), as (fmla count, stack accesses, vector registers named)."""
    loops: dict[str, tuple[int, int, int]] = {}
    function, labels = "", {}
    lines = assembly.splitlines()
    for i, line in enumerate(lines):
        if (head := re.match(r"^([A-Za-z_][\w.]*):", line)) and not line.startswith(".L"):
            function = head.group(1).split(".")[0]
        elif label := re.match(r"^(\.L\d+):", line):
            labels[label.group(1)] = i
        elif function.startswith("tile_") and function not in loops and (
                branch := _BRANCH.search(line)) and labels.get(branch.group(1), i) < i:
            body = "\n".join(lines[labels[branch.group(1)]:i + 1])
            fmla = len(re.findall(r"\bfmla\b", body))
            if fmla >= 8:
                loops[function] = (fmla, len(re.findall(r"\[sp", body)),
                                   len(set(re.findall(r"\b[vqz](\d+)\b", body))))
    return loops


@pytest.mark.parametrize("name", ["neoverse_n1", "neoverse_v1"])
@pytest.mark.parametrize("family,kernel,cin,cout,data_format", [
    ("bwd_data", 3, 64, 64, "NXC"), ("bwd_data", 1, 256, 64, "NCX"),
    ("bwd_weights", 3, 64, 64, "NXC"), ("bwd_weights", 1, 256, 64, "NCX")])
def test_aarch64_tiles_do_not_spill(name, family, kernel, cin, cout, data_format, tmp_path):
    """The register tiles of the aarch64 paths fit their 32 vector registers: no inner
    loop of a tile touches the stack (GCC's assembly, -O3, the target's flags)."""
    tools = _tools(name)
    isa = target(name).isa
    config = KernelConfig(family=family, kernel=(kernel, kernel), strides=(1, 1),
                          dilations=(1, 1), groups=1, cin_per_group=cin, cout_per_group=cout,
                          data_format=data_format, weights_format="XIO", dtype="f32", isa=isa)
    source = tmp_path / "kernel.c"
    source.write_text(render(config))
    flags = [*BASE_FLAGS, *target(name).flags("gcc", "12.2"),
             *(["-msve-vector-bits=256"] if isa == "sve256" else [])]
    run = subprocess.run([tools["cc"], *flags, "-S", "-o", str(tmp_path / "kernel.s"),
                          str(source)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    loops = _inner_tile_loops((tmp_path / "kernel.s").read_text())
    print(name, config.name, loops)
    assert loops, "no tile loop found"
    largest = max(loops.values())
    assert largest[0] >= 20  # the full tiles are there: 5x4 (NEON) or 6x4 (SVE) and up
    assert all(stack == 0 for _, stack, _ in loops.values()), loops


def test_c_example_for_aarch64_under_emulation(tmp_path):
    """The C example, built ahead of time for a Neoverse N1 with the cross compiler,
    prints under qemu what it prints built natively."""
    tools = _tools("neoverse_n1")
    env = {**os.environ, "CONVGRAD_CACHE_DIR": str(tmp_path / "cache"), "CONVGRAD_AOT_PATH": ""}
    outputs = []
    for label, extra, cc in (("aarch64", ["--target", "neoverse_n1", "--cc", tools["cc"]],
                              tools["cc"]), ("native", [], os.environ.get("CC", "cc"))):
        aot = tmp_path / label
        build = subprocess.run([*CLI, "aot", str(ROOT / "examples/c_api/layers.json"),
                                "-o", str(aot), *extra], env=env, capture_output=True,
                               text=True, timeout=600)
        assert build.returncode == 0, build.stderr[-3000:]
        program = tmp_path / f"example_{label}"
        make = subprocess.run(["make", "-s", "-C", str(ROOT / "examples/c_api"), f"AOT={aot}",
                               f"PROGRAM={program}", f"CC={cc}"], capture_output=True,
                              text=True)
        assert make.returncode == 0, make.stderr[-3000:]
        runner = tools["qemu"] if label == "aarch64" else []
        run = subprocess.run([*runner, str(program)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        outputs.append(run.stdout)
    manifest = (tmp_path / "aarch64" / "manifest.json").read_text()
    assert '"neoverse_n1"' in manifest and '"isa": "neon"' in manifest
    assert '"machine": "aarch64"' in manifest
    assert outputs[0] == outputs[1] and outputs[0].count("\n") > 100
    # this machine's runtime refuses the aarch64 folder (and says why), never loads it
    script = ("import numpy as np, convgrad\n"
              "convgrad.convolution_backward_data(np.ones((1, 6, 5, 8), np.float32), "
              "np.ones((3, 3, 4, 8), np.float32), strides=2, pads_begin=1, pads_end=1)")
    refused = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env={**env, "CONVGRAD_AOT_PATH": str(tmp_path / "aarch64"),
                                  "CC": "/nonexistent/cc",
                                  "CONVGRAD_CACHE_DIR": str(tmp_path / "empty")})
    assert refused.returncode != 0 and "built for aarch64" in refused.stderr


def test_targets_map_to_paths_and_flags():
    """archspec's names: the best path convgrad has for each, and archspec's flags."""
    assert [target(n).isa for n in ("x86_64_v3", "zen3", "icelake", "zen4", "sapphirerapids",
                                    "aarch64", "neoverse_n1", "neoverse_v1", "riscv64")] == [
        "avx2", "avx2", "avx512", "avx512bf16", "avx512bf16", "neon", "neon", "sve256",
        "portable"]
    assert target("neoverse_n1").flags("gcc", "12.2.0") == ("-mcpu=neoverse-n1",)
    assert "-march=znver3" in target("zen4").flags("gcc", "12.2.0")  # GCC 12: no znver4
    with pytest.raises(ValueError, match="neoverse_n1"):
        target("neoverse-n1x")


@pytest.mark.parametrize("args,message", [
    (["--target", "nehalem2"], "unknown target"),
    (["--target", "zen3", "--isa", "avx512"], "contradicts"),
    (["--target", "neoverse_n1", "--check"], "cannot run"),
])
def test_aot_target_errors(args, message, tmp_path):
    run = subprocess.run([*CLI, "aot", "-o", str(tmp_path), *args], capture_output=True,
                         text=True)
    assert run.returncode == 2 and message in run.stderr


@pytest.mark.parametrize("name,machine", [("neoverse_n1", "aarch64"), ("riscv64", "riscv64")])
def test_sequential_cross_folder_needs_no_openmp_and_is_exact(name, machine, tmp_path):
    """`convgrad aot --threading sequential` for a Neoverse N1 and for riscv64: the
    shared library needs only libc and libm, neither it nor the archive names OpenMP, and
    a C program linked with the archive and no -fopenmp is exact under qemu."""
    tools = _tools(name)
    env = {**os.environ, "CONVGRAD_CACHE_DIR": str(tmp_path / "cache"), "CONVGRAD_AOT_PATH": ""}
    layers = aot_driver.write_layers(tmp_path)
    folder = tmp_path / "aot"
    build = subprocess.run([*CLI, "aot", str(layers), "-o", str(folder), "-j", "2",
                            "--target", name, "--cc", tools["cc"],
                            "--threading", "sequential"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["threading"] == "sequential" and manifest["machine"] == machine
    library, archive = folder / "libconvgrad_kernels.so", folder / "libconvgrad_kernels.a"
    needs = aot_driver.dynamic_needs(library)
    assert needs <= {"libc.so.6", "libm.so.6"} and "libc.so.6" in needs, needs
    nm = shutil.which(tools["cc"].replace("-gcc", "-nm")) or "nm"
    assert not aot_driver.openmp_symbols(library, nm)
    assert not aot_driver.openmp_symbols(archive, nm)
    found = aot_driver.cases(layers, manifest)
    kernels = sorted({case.kernel for case in found})
    program = folder / "driver"
    subprocess.run([tools["cc"], "-O1", "-I", str(folder), str(aot_driver.write_driver(
        folder, kernels)), str(archive), "-lm", "-o", str(program)], check=True,
        capture_output=True)
    aot_driver.run(program, found, kernels, tmp_path, tuple(tools["qemu"]))


def test_caller_aarch64_folder_runs_on_a_cpp_pool_exactly_under_emulation(tmp_path):
    """`convgrad aot --threading caller` for a Neoverse N1: no OpenMP runtime, and the C++
    driver on examples/caller_pool's std::thread pool (1 and 3 workers) is exact under
    qemu, every kernel handing its parts to the pool."""
    tools = _tools("neoverse_n1")
    cxx = tools["cc"].replace("-gcc", "-g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"needs {cxx} (apt-get install g++-aarch64-linux-gnu)")
    env = {**os.environ, "CONVGRAD_CACHE_DIR": str(tmp_path / "cache"), "CONVGRAD_AOT_PATH": ""}
    layers = aot_driver.write_layers(tmp_path, aot_driver.POOL_LAYERS)
    folder = tmp_path / "aot"
    build = subprocess.run([*CLI, "aot", str(layers), "-o", str(folder), "-j", "2",
                            "--target", "neoverse_n1", "--cc", tools["cc"],
                            "--threading", "caller"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["threading"] == "caller" and manifest["machine"] == "aarch64"
    library, archive = folder / "libconvgrad_kernels.so", folder / "libconvgrad_kernels.a"
    needs = aot_driver.dynamic_needs(library)
    assert needs <= {"libc.so.6", "libm.so.6", "ld-linux-aarch64.so.1"}, needs
    nm = shutil.which(tools["cc"].replace("-gcc", "-nm")) or "nm"
    assert not aot_driver.openmp_symbols(library, nm)
    assert not aot_driver.openmp_symbols(archive, nm)
    found = aot_driver.cases(layers, manifest)
    kernels = sorted({case.kernel for case in found})
    program = folder / "driver"
    driver = aot_driver.write_pool_driver(folder, kernels)
    subprocess.run([cxx, "-O1", "-std=c++17", "-I", str(folder), "-I",
                    str(aot_driver.POOL_INCLUDE), str(driver), str(archive), "-pthread", "-lm",
                    "-o", str(program)], check=True, capture_output=True)
    for workers in (1, 3):
        aot_driver.run(program, aot_driver.with_threads(found, workers), kernels, tmp_path,
                       tuple(tools["qemu"]))
