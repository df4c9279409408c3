"""An AOT folder as a package, in each threading mode: the C example built through the
CMake package (`find_package(convgrad_kernels CONFIG)`, the shared and the static
target) and through pkg-config (convgrad_kernels.pc and convgrad_kernels-static.pc),
from the folder and from an install prefix (`--install-prefix`), runs exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aot_driver
import numpy as np
import pytest

from convgrad.codegen.render import ABI_VERSION
from convgrad.reference import reference

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "c_api"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def _pattern(shape, multiplier: int) -> np.ndarray:
    return ((np.arange(int(np.prod(shape))) * multiplier) % 5 - 2).astype(np.float32)


def _assert_example_output(program: Path, sequential: bool) -> None:
    """The example's output is the reference's; a sequential program needs no OpenMP."""
    needs = aot_driver.dynamic_needs(program)
    if sequential:
        assert not any("omp" in need for need in needs), needs
    run = subprocess.run([str(program)], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.split("diff_weights\n")
    layers = {layer["name"]: layer for layer in json.loads((EXAMPLE / "layers.json").read_text())}
    data, weights = layers["example_data"], layers["example_weights"]
    dd = _pattern(data["inputs"][0], 7).reshape(data["inputs"][0])
    w = _pattern(data["inputs"][1], 3).reshape(data["inputs"][1])
    src = _pattern(weights["inputs"][0], 11).reshape(weights["inputs"][0])
    np.testing.assert_array_equal(
        np.array(first.split()[1:], dtype=np.float32),
        reference(data["op"], [dd, w, data["inputs"][2]], data["attrs"]).ravel())
    np.testing.assert_array_equal(
        np.array(second.split(), dtype=np.float32),
        reference(weights["op"], [src, dd, weights["inputs"][2]], weights["attrs"]).ravel())


def _cmake(project: Path, build: Path, package: str, version: int = ABI_VERSION) -> None:
    project.mkdir()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(example C)\n"
        f"find_package(convgrad_kernels {version} CONFIG REQUIRED)\n"
        f"add_executable(example_shared {EXAMPLE / 'main.c'})\n"
        "target_link_libraries(example_shared PRIVATE convgrad_kernels::convgrad_kernels)\n"
        f"add_executable(example_static {EXAMPLE / 'main.c'})\n"
        "target_link_libraries(example_static PRIVATE convgrad_kernels::static)\n")
    for command in (["cmake", "-S", str(project), "-B", str(build), package],
                    ["cmake", "--build", str(build)]):
        run = subprocess.run(command, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def _pkg_config(pc_path: Path, package: str) -> list[str]:
    run = subprocess.run(["pkg-config", "--cflags", "--libs", package], capture_output=True,
                         text=True, env={**os.environ, "PKG_CONFIG_PATH": str(pc_path)})
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


@pytest.mark.parametrize("threading", ["openmp", "sequential", "caller"])
def test_example_through_cmake_package_and_pkg_config(threading, tmp_path):
    missing = [tool for tool in ("cmake", "pkg-config") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    folder, prefix = tmp_path / "aot", tmp_path / "prefix"
    built = subprocess.run([sys.executable, "-m", "convgrad", "aot", str(EXAMPLE / "layers.json"),
                            "-o", str(folder), "-j", "2", "--threading", threading,
                            "--install-prefix", str(prefix)], cwd=ROOT, capture_output=True,
                           text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    sequential = threading != "openmp"  # no OpenMP runtime linked
    config = (prefix / "lib/cmake/convgrad_kernels/convgrad_kernelsConfig.cmake").read_text()
    assert ("OpenMP" in config) == (not sequential)
    # one mode finds the folder with CMake and the prefix with pkg-config, the others the
    # other way round: each layout is used by each tool
    cmake_from, pc_from = ((f"-DCMAKE_PREFIX_PATH={prefix}", folder) if sequential
                           else (f"-Dconvgrad_kernels_DIR={folder}", prefix / "lib/pkgconfig"))
    if threading == "caller":  # the package's version is the ABI's: another is refused
        with pytest.raises(AssertionError, match="convgrad_kernels"):
            _cmake(tmp_path / "other", tmp_path / "other-build", cmake_from, ABI_VERSION + 1)
    _cmake(tmp_path / "project", tmp_path / "build", cmake_from)
    for name in ("example_shared", "example_static"):
        program = tmp_path / "build" / name
        linked = aot_driver.dynamic_needs(program)
        assert ("libconvgrad_kernels.so" in linked) == (name == "example_shared"), linked
        _assert_example_output(program, sequential)
    for package in ("convgrad_kernels", "convgrad_kernels-static"):
        flags = _pkg_config(pc_from, package)
        rpath = [f"-Wl,-rpath,{flag[2:]}" for flag in flags if flag.startswith("-L")]
        program = tmp_path / package
        run = subprocess.run(["cc", "-O1", "-std=c11", str(EXAMPLE / "main.c"), *flags, *rpath,
                              "-o", str(program)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert ("libconvgrad_kernels.so" in aot_driver.dynamic_needs(program)) == (
            package == "convgrad_kernels")
        _assert_example_output(program, sequential)
