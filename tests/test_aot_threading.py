"""`convgrad aot --threading`: a sequential folder needs no OpenMP runtime (its shared
library needs only libc and libm, neither it nor the archive names an OpenMP symbol), a
C program linked without -fopenmp runs it exactly, and its results are the openmp
folder's bit for bit. The aarch64 build under qemu is in test_cross.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import aot_driver
import pytest

from convgrad.codegen import KernelConfig, render

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("readelf") is None,
                                reason="needs a C compiler and readelf")


def _build(layers: Path, output: Path, threading: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "convgrad", "aot", str(layers), "-o",
                          str(output), "-j", "2", "--threading", threading], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((output / "manifest.json").read_text())


def test_sequential_folder_needs_no_openmp_and_matches_the_openmp_one(tmp_path):
    layers = aot_driver.write_layers(tmp_path)
    results = {}
    for threading in ("openmp", "sequential"):
        folder = tmp_path / threading
        manifest = _build(layers, folder, threading)
        assert manifest["threading"] == threading
        assert ("-fopenmp" in manifest["flags"]) == (threading == "openmp")
        library, archive = folder / "libconvgrad_kernels.so", folder / "libconvgrad_kernels.a"
        needs = aot_driver.dynamic_needs(library)
        if threading == "sequential":
            assert needs <= {"libc.so.6", "libm.so.6"}, needs
            assert not aot_driver.openmp_symbols(library)
            assert not aot_driver.openmp_symbols(archive)
            assert "-fopenmp" not in (folder / "convgrad.mk").read_text()
            assert "OpenMP" not in (folder / "convgrad.cmake").read_text()
        else:
            assert any("gomp" in need or "omp" in need for need in needs), needs
            assert aot_driver.openmp_symbols(archive)
        found = aot_driver.cases(layers, manifest)
        kernels = sorted({case.kernel for case in found})
        driver = aot_driver.write_driver(folder, kernels)
        program = folder / "driver"
        openmp = ["-fopenmp"] if threading == "openmp" else []
        subprocess.run(["cc", "-O1", "-I", str(folder), str(driver), str(archive), *openmp,
                        "-lm", "-o", str(program)], check=True, capture_output=True)
        results[threading] = aot_driver.run(program, found, kernels, tmp_path)
    assert results["openmp"] == results["sequential"]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_caller_folder_runs_on_the_programs_own_pool_exactly(tmp_path):
    """A --threading caller folder links no OpenMP runtime; a C++ program runs its kernels on
    its own std::thread pool (examples/caller_pool), with 1, 2 and 3 workers, each
    result the reference's bit for bit; with more than one worker every kernel hands its
    parts to the pool."""
    layers = aot_driver.write_layers(tmp_path, aot_driver.POOL_LAYERS)
    folder = tmp_path / "caller"
    manifest = _build(layers, folder, "caller")
    assert manifest["threading"] == "caller" and "-fopenmp" not in manifest["flags"]
    library, archive = folder / "libconvgrad_kernels.so", folder / "libconvgrad_kernels.a"
    # the loader itself for the call's pool (a thread-local variable: __tls_get_addr)
    needs = aot_driver.dynamic_needs(library)
    assert needs <= {"libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2"}, needs
    assert not aot_driver.openmp_symbols(library) and not aot_driver.openmp_symbols(archive)
    found = aot_driver.cases(layers, manifest)
    kernels = sorted({case.kernel for case in found})
    driver = aot_driver.write_pool_driver(folder, kernels)
    program = folder / "driver"
    subprocess.run(["c++", "-O1", "-std=c++17", "-I", str(folder), "-I",
                    str(aot_driver.POOL_INCLUDE), str(driver), str(archive), "-pthread", "-lm",
                    "-o", str(program)], check=True, capture_output=True)
    runs = [aot_driver.run(program, aot_driver.with_threads(found, workers), kernels, tmp_path)
            for workers in (1, 2, 3)]
    assert runs[0] == runs[1] == runs[2]

def test_only_the_openmp_spelling_names_openmp():
    """Every parallel region is written as parts (parallel.h.j2); only the openmp mode's
    spelling of them and the prelude's include name OpenMP."""
    named = [path.name for path in sorted((ROOT / "templates").glob("*.j2"))
             if any(word in path.read_text() for word in ("#pragma omp", "omp_", "_OPENMP"))]
    assert named == ["parallel_openmp.h.j2", "prelude.h.j2"]


def test_sequential_source_refuses_openmp_and_openmp_source_is_unchanged(tmp_path):
    """The sequential source names no OpenMP function; compiled with -fopenmp by mistake
    it stops the build instead of racing. The openmp source is the runtime's."""
    config = KernelConfig(family="bwd_data", kernel=(3, 3), strides=(1, 1), dilations=(1, 1),
                          groups=1, cin_per_group=16, cout_per_group=32, data_format="NXC",
                          weights_format="XIO", dtype="f32", isa="portable")
    sequential = render(config, threading="sequential")
    assert "omp_" not in sequential and "#pragma omp" not in sequential
    assert render(config, threading="openmp") == render(config)
    source = tmp_path / "kernel.c"
    source.write_text(sequential)
    run = subprocess.run(["cc", "-fopenmp", "-c", "-o", str(tmp_path / "kernel.o"),
                          str(source)], capture_output=True, text=True)
    assert run.returncode != 0 and "--threading sequential" in run.stderr
    with pytest.raises(ValueError, match="threading"):
        render(config, threading="tbb")
