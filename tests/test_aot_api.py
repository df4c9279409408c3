"""The versioned C interface of an AOT folder: the ABI version (at compile time and at
run time), the layer table (it matches manifest.json), the look-up by layer name, the
size check and the element counts, from C programs built against the header."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from convgrad.codegen.render import ABI_VERSION
from convgrad.reference import reference

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "c_api"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

# The example's two layers, a 1x1 NCX weight gradient whose kernel takes its inputs
# swapped, and a name two ops share.
SHARED_ATTRS = {"pads_begin": 1, "pads_end": 1}
LAYERS = [*json.loads((EXAMPLE / "layers.json").read_text()),
          {"op": "ConvolutionBackwardWeights", "name": "pointwise",
           "inputs": [[2, 3, 4, 3], [2, 5, 4, 3], [1, 1]],
           "attrs": {"data_format": "NCX", "weights_format": "OIX"}},
          {"op": "ConvolutionBackwardData", "name": "shared",
           "inputs": [[2, 4, 4, 3], [3, 3, 5, 3], [4, 4]], "attrs": SHARED_ATTRS},
          {"op": "ConvolutionBackwardWeights", "name": "shared",
           "inputs": [[2, 4, 4, 5], [2, 4, 4, 3], [3, 3]], "attrs": SHARED_ATTRS}]

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "convgrad_kernels.h"

static void fill(float *values, int64_t count, int multiplier)
{
    for (int64_t i = 0; i < count; ++i)
        values[i] = (float)((i * multiplier) % 5 - 2);
}

/* Runs a layer found by name through the table, on buffers sized by it; prints the
 * element counts and the result. */
static int run(const char *name, const char *op, convgrad_dims dims)
{
    const convgrad_layer *layer = convgrad_find_layer(name, op);
    int64_t n[3];
    if (!layer || convgrad_check_dims(layer, &dims) != CONVGRAD_OK
        || convgrad_tensor_elements(layer, &dims, n) != CONVGRAD_OK)
        return 0;
    float *a = malloc((size_t)n[0] * 4), *b = malloc((size_t)n[1] * 4);
    float *out = malloc((size_t)n[2] * 4);
    void *workspace = malloc((size_t)layer->workspace_size(&dims));
    fill(a, n[0], 7);
    fill(b, n[1], 3);
    if (!a || !b || !out || !workspace || layer->run(a, b, out, &dims, workspace) != CONVGRAD_OK)
        return 0;
    printf("%s %lld %lld %lld", name, (long long)n[0], (long long)n[1], (long long)n[2]);
    for (int64_t i = 0; i < n[2]; ++i)
        printf(" %.1f", out[i]);
    printf("\n");
    free(a), free(b), free(out), free(workspace);
    return 1;
}

int main(int argc, char **argv)
{
    if (convgrad_check_abi(CONVGRAD_ABI_VERSION) != CONVGRAD_OK)
        return 10;
    if (convgrad_abi_version() != CONVGRAD_ABI_VERSION || convgrad_check_abi(-1) == CONVGRAD_OK)
        return 11;
    if (argc > 1 && strcmp(argv[1], "table") == 0) {
        int32_t count = -1;
        const convgrad_layer *all = convgrad_layers(&count);
        for (int32_t i = 0; i < count; ++i) {
            const convgrad_layer *l = &all[i];
            printf("%s|%s|%s|%s|%s|%s|%s|%s|%d|%d|%d|%d|%d", l->name, l->op, l->kernel,
                   l->family, l->dtype, l->data_format, l->weights_format, l->isa, l->rank,
                   l->groups, l->cin_per_group, l->cout_per_group, l->inputs_swapped);
            for (int a = 0; a < 3; ++a)
                printf("|%d,%d,%d", l->kernel_size[a], l->strides[a], l->dilations[a]);
            printf("\n");
        }
        return 0;
    }
    /* look-ups: by name alone, by name and op where two ops share it, and misses */
    const convgrad_layer *data = convgrad_find_layer("example_data", NULL);
    if (!data || strcmp(data->name, "example_data") || data != convgrad_find_layer(
            "example_data", "ConvolutionBackwardData"))
        return 20;
    const convgrad_layer *shared = convgrad_find_layer("shared", "ConvolutionBackwardWeights");
    if (convgrad_find_layer("shared", NULL) || !shared || strcmp(shared->op,
            "ConvolutionBackwardWeights") || convgrad_find_layer("example_data",
            "ConvolutionBackwardWeights") || convgrad_find_layer("missing", NULL))
        return 21;
    /* sizes: what the kernel refuses, the check refuses, and the other way round */
    const convgrad_dims dims = {.batch = 1, .src = {11, 9}, .dst = {6, 5}, .pads_begin = {1, 1},
                                .num_threads = 1, .size = sizeof(convgrad_dims)};
    convgrad_dims bad[5] = {dims, dims, dims, dims, dims};
    bad[0].src[1] = 0;
    bad[1].batch = -1;
    bad[2].pads_begin[0] = -1;
    bad[3].dst[0] = CONVGRAD_MAX_EXTENT + 1;
    bad[4].size = 0; /* a struct of an older header, or not set */
    int64_t n[3] = {-7, -7, -7};
    for (int i = 0; i < 5; ++i) {
        if (convgrad_check_dims(data, &bad[i]) != CONVGRAD_EINVAL
            || data->run(NULL, NULL, NULL, &bad[i], NULL) != CONVGRAD_EINVAL
            || convgrad_tensor_elements(data, &bad[i], n) != CONVGRAD_EINVAL || n[0] != -7)
            return 30 + i;
    }
    convgrad_dims unused_axis = dims;
    unused_axis.src[2] = -5; /* a 2-D kernel reads two entries */
    if (convgrad_check_dims(data, &dims) != CONVGRAD_OK
        || convgrad_check_dims(data, &unused_axis) != CONVGRAD_OK
        || convgrad_check_dims(NULL, &dims) != CONVGRAD_EINVAL
        || convgrad_check_dims(data, NULL) != CONVGRAD_EINVAL)
        return 40;
    const convgrad_dims pointwise = {.batch = 2, .src = {4, 3}, .dst = {4, 3}, .num_threads = 1,
                                    .size = sizeof(convgrad_dims)};
    if (!run("example_data", NULL, dims) || !run("pointwise", NULL, pointwise))
        return 50;
    return 0;
}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("api")
    (work / "layers.json").write_text(json.dumps(LAYERS))
    built = subprocess.run([sys.executable, "-m", "convgrad", "aot", str(work / "layers.json"),
                            "-o", str(work / "aot"), "-j", "2", "--threading", "sequential"],
                           cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    (work / "main.c").write_text(PROGRAM)
    return work


def _program(folder: Path, name: str, *flags: str, header: Path | None = None,
             shared: bool = False) -> subprocess.CompletedProcess:
    aot = folder / "aot"
    libraries = ([f"-L{aot}", "-lconvgrad_kernels", f"-Wl,-rpath,{aot}"] if shared
                 else [str(aot / "libconvgrad_kernels.a")])
    return subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-I", str(header or aot),
                           *flags, str(folder / "main.c"), *libraries, "-lm", "-o",
                           str(folder / name)], capture_output=True, text=True)


def _pattern(shape, multiplier: int) -> np.ndarray:
    count = int(np.prod(shape))
    return ((np.arange(count) * multiplier) % 5 - 2).astype(np.float32).reshape(shape)


def test_table_matches_the_manifest(folder):
    assert _program(folder, "table", f"-DCONVGRAD_REQUIRE_ABI_VERSION={ABI_VERSION}"
                    ).returncode == 0
    run = subprocess.run([str(folder / "table"), "table"], capture_output=True, text=True)
    assert run.returncode == 0, run.returncode
    manifest = json.loads((folder / "aot" / "manifest.json").read_text())
    assert manifest["abi_version"] == ABI_VERSION
    expected = []
    for kernel in manifest["kernels"]:
        c = kernel["config"]
        rank = len(c["kernel"])
        axes = [f"{c['kernel'][a]},{c['strides'][a]},{c['dilations'][a]}" if a < rank
                else "1,1,1" for a in range(3)]
        for user in kernel["layers"]:
            expected.append("|".join(map(str, [
                user["name"], user["op"], kernel["name"], c["family"], c["dtype"],
                c["data_format"], c["weights_format"], c["isa"], rank, c["groups"],
                c["cin_per_group"], c["cout_per_group"], int(user.get("inputs_swapped", False)),
                *axes])))
    assert run.stdout.splitlines() == expected
    assert len(expected) == len(LAYERS)


def test_program_finds_checks_and_runs_layers_exactly(folder):
    built = _program(folder, "api")
    assert built.returncode == 0, built.stderr
    run = subprocess.run([str(folder / "api")], capture_output=True, text=True)
    assert run.returncode == 0, f"exit {run.returncode}"
    lines = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()}

    data = LAYERS[0]
    dd, w = _pattern(data["inputs"][0], 7), _pattern(data["inputs"][1], 3)
    expected = reference(data["op"], [dd, w, data["inputs"][2]], data["attrs"])
    counts, values = lines["example_data"][:3], lines["example_data"][3:]
    assert [int(v) for v in counts] == [dd.size, w.size, expected.size]
    np.testing.assert_array_equal(np.array(values, dtype=np.float32), expected.ravel())

    pointwise = LAYERS[2]  # in the op's order although its kernel takes them swapped
    src, diff_dst = _pattern(pointwise["inputs"][0], 7), _pattern(pointwise["inputs"][1], 3)
    expected = reference(pointwise["op"], [src, diff_dst, [1, 1]], pointwise["attrs"])
    counts, values = lines["pointwise"][:3], lines["pointwise"][3:]
    assert [int(v) for v in counts] == [src.size, diff_dst.size, expected.size]
    np.testing.assert_array_equal(np.array(values, dtype=np.float32), expected.ravel())


def test_another_abi_version_is_refused_at_compile_time_and_at_run_time(folder):
    refused = _program(folder, "never", f"-DCONVGRAD_REQUIRE_ABI_VERSION={ABI_VERSION + 1}")
    assert refused.returncode != 0 and "CONVGRAD_REQUIRE_ABI_VERSION" in refused.stderr
    # A program compiled against a header of the next version, run with this library.
    other = folder / "other"
    other.mkdir()
    header = (folder / "aot" / "convgrad_kernels.h").read_text()
    line = f"#define CONVGRAD_ABI_VERSION {ABI_VERSION}\n"
    assert line in header
    (other / "convgrad_kernels.h").write_text(
        header.replace(line, f"#define CONVGRAD_ABI_VERSION {ABI_VERSION + 1}\n"))
    for name, include in (("same", None), ("newer", other)):
        built = _program(folder, name, header=include, shared=True)
        assert built.returncode == 0, built.stderr
    assert subprocess.run([str(folder / "same"), "table"]).returncode == 0
    assert subprocess.run([str(folder / "newer"), "table"]).returncode == 10
