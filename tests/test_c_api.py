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
    _assert_example_output(subprocess.run([str(program)], check=True, capture_output=True,
                                          text=True).stdout)


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("c++") is None,
                    reason="needs make and a C++ compiler")
def test_thread_pool_example_agrees_with_the_reference(tmp_path):
    """examples/caller_pool: the same layers built with --threading caller, run on the
    program's own std::thread pool of 1 and 3 workers."""
    aot = tmp_path / "aot"
    subprocess.run([sys.executable, "-m", "convgrad", "aot", str(EXAMPLE / "layers.json"),
                    "-o", str(aot), "-j", "2", "--threading", "caller"], cwd=ROOT, check=True,
                   capture_output=True)
    program = tmp_path / "pool_example"
    subprocess.run(["make", "-C", str(ROOT / "examples" / "caller_pool"), f"AOT={aot}",
                    f"PROGRAM={program}"], check=True, capture_output=True)
    for workers in ("1", "3"):
        _assert_example_output(subprocess.run([str(program), workers], check=True,
                                              capture_output=True, text=True).stdout)


def _assert_example_output(output: str) -> None:
    """The examples print diff_src then diff_weights of layers.json, value by value."""
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


SWAPPED_PROGRAM = r"""
#include <stdio.h>
#include "convgrad_kernels.h"
enum { N = 2, IC = 3, OC = 5, H = 4, W = 3 };
int main(void)
{
    static float src[N * IC * H * W], diff_dst[N * OC * H * W], diff_weights[OC * IC];
    for (int i = 0; i < N * IC * H * W; ++i)
        src[i] = (float)((i * 11) % 5 - 2);
    for (int i = 0; i < N * OC * H * W; ++i)
        diff_dst[i] = (float)((i * 7) % 5 - 2);
    const convgrad_dims dims = {.batch = N, .src = {H, W}, .dst = {H, W}, .num_threads = 1,
                               .size = sizeof(convgrad_dims)};
    if (convgrad_pointwise(src, diff_dst, diff_weights, &dims, NULL))
        return 1;
    for (int i = 0; i < OC * IC; ++i)
        printf("%.1f\n", diff_weights[i]);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_layer_alias_passes_swapped_inputs_on_and_names_each_op(tmp_path):
    """A layer whose kernel computes it with src and diff_dst swapped (1x1 NCX f32, more
    output than input channels) is called from C with them in the usual order; a name two
    ops share gets an alias per op."""
    shared = {"inputs": [[2, 4, 4, 3], [3, 3, 5, 3], [4, 4]], "attrs": {"pads_begin": 1,
                                                                        "pads_end": 1}}
    layers = [{"op": "ConvolutionBackwardWeights", "name": "pointwise",
               "inputs": [[2, 3, 4, 3], [2, 5, 4, 3], [1, 1]],
               "attrs": {"data_format": "NCX", "weights_format": "OIX"}},
              {"op": "ConvolutionBackwardData", "name": "shared", **shared},
              {"op": "ConvolutionBackwardWeights", "name": "shared",
               "inputs": [[2, 4, 4, 5], [2, 4, 4, 3], [3, 3]], "attrs": shared["attrs"]}]
    (tmp_path / "layers.json").write_text(json.dumps(layers))
    aot = tmp_path / "aot"
    subprocess.run([sys.executable, "-m", "convgrad", "aot", str(tmp_path / "layers.json"),
                    "-o", str(aot)], cwd=ROOT, check=True, capture_output=True)
    manifest = json.loads((aot / "manifest.json").read_text())
    users = {(u["op"], u["name"]): u for k in manifest["kernels"] for u in k["layers"]}
    assert users["ConvolutionBackwardWeights", "pointwise"].get("inputs_swapped")
    assert not users["ConvolutionBackwardWeights", "shared"].get("inputs_swapped")
    header = (aot / "convgrad_kernels.h").read_text()
    for alias in ("shared_convolutionbackwarddata", "shared_convolutionbackwardweights"):
        assert f"#define convgrad_{alias} " in header
    (tmp_path / "main.c").write_text(SWAPPED_PROGRAM)
    program = tmp_path / "swapped"
    subprocess.run(["cc", "-O1", "-I", str(aot), str(tmp_path / "main.c"),
                    str(aot / "libconvgrad_kernels.a"), "-fopenmp", "-lm", "-o", str(program)],
                   check=True, capture_output=True)
    output = subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout
    src = _pattern(2 * 3 * 4 * 3, 11).reshape(2, 3, 4, 3)
    diff_dst = _pattern(2 * 5 * 4 * 3, 7).reshape(2, 5, 4, 3)
    expected = reference("ConvolutionBackwardWeights", [src, diff_dst, [1, 1]],
                         layers[0]["attrs"])
    np.testing.assert_array_equal(np.array(output.split(), dtype=np.float32), expected.ravel())
