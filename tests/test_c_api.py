"""The C API: an ahead-of-time build used from a C program with no Python involved."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convgrad.reference import reference

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "c_api"


def _pattern(count: int, multiplier: int) -> np.ndarray:
    """The fill of main.c: (i * multiplier) % 5 - 2 (C's % is non-negative here)."""
    return ((np.arange(count) * multiplier) % 5 - 2).astype(np.float32)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_example_c_program_agrees_with_the_reference(tmp_path):
    aot = tmp_path / "aot"
    subprocess.run([sys.executable, "-m", "convgrad", "aot", str(EXAMPLE / "layers.json"),
                    "-o", str(aot), "-j", "2"], cwd=ROOT, check=True, capture_output=True)
    for name in ("libconvgrad_kernels.a", "libconvgrad_kernels.so", "convgrad_kernels.h",
                 "convgrad.mk", "convgrad.cmake", "manifest.json"):
        assert (aot / name).exists(), name
    program = tmp_path / "example"
    subprocess.run(["make", "-C", str(EXAMPLE), f"AOT={aot}", f"PROGRAM={program}"],
                   check=True, capture_output=True)
    output = subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout
    sections = output.split("diff_weights\n")
    diff_src = np.array(sections[0].split()[1:], dtype=np.float32)
    diff_weights = np.array(sections[1].split(), dtype=np.float32)

    layers = {layer["name"]: layer for layer in json.loads((EXAMPLE / "layers.json").read_text())}
    data, weights = layers["example_data"], layers["example_weights"]
    dd = _pattern(int(np.prod(data["inputs"][0])), 7).reshape(data["inputs"][0])
    w = _pattern(int(np.prod(data["inputs"][1])), 3).reshape(data["inputs"][1])
    src = _pattern(int(np.prod(weights["inputs"][0])), 11).reshape(weights["inputs"][0])
    expected_src = reference(data["op"], [dd, w, data["inputs"][2]], data["attrs"])
    expected_w = reference(weights["op"], [src, dd, weights["inputs"][2]], weights["attrs"])
    np.testing.assert_array_equal(diff_src, expected_src.ravel())
    np.testing.assert_array_equal(diff_weights, expected_w.ravel())


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_cmake_fragment_links_the_example(tmp_path):
    aot = tmp_path / "aot"
    subprocess.run([sys.executable, "-m", "convgrad", "aot", str(EXAMPLE / "layers.json"),
                    "-o", str(aot)], cwd=ROOT, check=True, capture_output=True)
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(example C)\n"
        f"include({aot}/convgrad.cmake)\n"
        f"add_executable(example {EXAMPLE / 'main.c'})\n"
        "target_link_libraries(example PRIVATE convgrad_kernels)\n")
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(project), "-B", str(build)], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    result = subprocess.run([str(build / "example")], check=True, capture_output=True,
                            text=True)
    assert result.stdout.startswith("diff_src\n")
