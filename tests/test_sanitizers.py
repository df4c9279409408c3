"""Random configurations of every op run in kernels built with AddressSanitizer and
UndefinedBehaviorSanitizer (CONVGRAD_SANITIZE=1): an out-of-bounds access or undefined
behaviour aborts the child process and fails the test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _runtime_library(name: str) -> str | None:
    try:
        path = subprocess.run(["cc", f"-print-file-name={name}"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


ASAN, UBSAN = _runtime_library("libasan.so"), _runtime_library("libubsan.so")


def sanitized_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """A child's environment whose kernels (and front-end extensions) are built with
    AddressSanitizer and UBSan and run with their runtimes preloaded. The tests build
    their kernels at -O0 (CONVGRAD_CFLAGS, after CONVGRAD_SANITIZE's -O1): the checks
    sit on the same accesses, and GCC builds the instrumented kernels 2-4x faster (Zen
    4, the long-reduction half "data-and-dot": 68.5 s -> 30.5 s)."""
    return {**os.environ, "CONVGRAD_SANITIZE": "1", "LD_PRELOAD": f"{ASAN} {UBSAN}",
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1", "CONVGRAD_CFLAGS": "-O0",
            "CONVGRAD_CACHE_DIR": str(cache_dir), **extra}

CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from cases import DTYPES, make_case
    from convgrad.reference import OP_KINDS
    from checks import run_case
    rng = np.random.default_rng({seed})
    done = 0
    while done < {count}:
        rank = int(rng.integers(1, 4))
        groups = int(rng.choice([1, 2, 5]))
        op = OP_KINDS[done % len(OP_KINDS)]
        attrs = dict(strides=rng.integers(1, 4, rank).tolist(),
                     dilations=rng.integers(1, 3, rank).tolist(),
                     pads_begin=rng.integers(0, 3, rank).tolist(),
                     pads_end=rng.integers(0, 3, rank).tolist())
        channels = groups * int(rng.integers(1, 4)), groups * int(rng.integers(1, 20))
        if rng.random() < 0.3:  # depthwise
            channels, groups = (groups * 3, groups * 3), groups * 3
        try:
            case = make_case(op, spatial=tuple(rng.integers(3, 9, rank).tolist()),
                             kernel=tuple(rng.integers(1, 4, rank).tolist()), groups=groups,
                             in_channels=channels[0], out_channels=channels[1],
                             batch=int(rng.integers(0, 3)), attrs=attrs,
                             data_format=str(rng.choice(["NXC", "NCX"])),
                             dtype=str(rng.choice(list(DTYPES))), seed=done)
            case.expected(np.float32)
        except ValueError:
            continue  # a geometry the op rejects
        run_case(case, num_threads=int(rng.integers(1, 3)))
        done += 1
    print("ok", done)
""")


# Long reductions: many partial sums per tile, split inside rows and taps; then the other
# plans: packed panels, pixel slices, padded columns.
LONG_REDUCTIONS = {  # two halves, so that both test workers share them
    "sums-and-weights": textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from cases import make_case
    from checks import run_case
    from convgrad.codegen.plan import Variant
    for op, channels, fmt, dtype in [
            ("ConvolutionBackwardWeights", (24, 20), "NXC", "f32"),
            ("ConvTransposeBackwardWeights", (2, 20), "NXC", "f32"),
            ("ConvolutionBackwardWeights", (3, 20), "NCX", "bf16"),
            ("ConvolutionBackwardWeights", (24, 20), "NCX", "f32"),
            ("ConvTransposeBackwardWeights", (24, 20), "NCX", "f16"),
            ("ConvolutionBackwardData", (20, 150), "NXC", "f32"),
            ("ConvTransposeBackwardData", (150, 5), "NCX", "bf16")]:
        case = make_case(op, spatial=(13, 11), kernel=(3, 2), in_channels=channels[0],
                         out_channels=channels[1], batch=2, data_format=fmt, dtype=dtype,
                         attrs=dict(pads_begin=[1, 0], pads_end=[1, 1]))
        run_case(case, num_threads=2)
        if dtype == "bf16":  # both plans, whichever the vendor's rules take
            import convgrad
            from forcing import run_with_plan
            pairs = convgrad.cpu.available_isas()[0] == "avx512bf16"  # vdpbf16ps
            for plan in ({{}}, {{"bf16_dot": 0}}):  # 3 input channels: flattened rows
                weights = Variant.WEIGHTS_PAIRS if pairs and not plan else Variant.WEIGHTS_FLAT
                run_with_plan(case, plan, convgrad.cpu.available_isas()[0], 2,
                              optional=("bf16_dot",),
                              variant={{"ConvolutionBackwardWeights": weights,
                                       "ConvTransposeBackwardData": Variant.DIRECT}})
    # bf16 NXC: AMX where the CPU has it (src channels first, diff_dst pairs)
    run_case(make_case("ConvolutionBackwardWeights", spatial=(9, 7), kernel=(3, 3),
                       in_channels=64, out_channels=96, batch=3, dtype="bf16",
                       attrs=dict(pads_begin=[1, 1], pads_end=[0, 1])), num_threads=2)
    run_case(make_case("ConvolutionBackwardWeights", spatial=(9, 11), kernel=(3, 2),  # src
                       in_channels=64, out_channels=32, batch=2, dtype="bf16",  # copied by
                       attrs=dict(strides=[2, 3], pads_begin=[1, 2], pads_end=[0, 1])),  # phase
             num_threads=2)
    run_case(make_case("ConvolutionBackwardWeights", spatial=(3, 5, 4), kernel=(3, 3, 2),
                       in_channels=32, out_channels=64, batch=2, dtype="bf16",  # a src copy
                       attrs=dict(pads_begin=[2, 1, 1], pads_end=[1, 1, 0])),  # per depth
             num_threads=2)                                                    # tap
    from geometries import NCX_WEIGHT_GEOMETRY  # src read in its own order, merged runs
    for geometry in NCX_WEIGHT_GEOMETRY.values():
        run_case(make_case("ConvolutionBackwardWeights", **geometry, in_channels=38,
                           out_channels=22, data_format="NCX"), num_threads=2)
    import convgrad  # chunks packed into panels (NCX f32: diff_dst transposed in registers)
    from forcing import run_with_plan
    from geometries import PACKED_WEIGHT_GEOMETRY
    for name, fmt, dtype in (("3x3", "NXC", "f32"), ("1x1 strided", "NCX", "bf16"),
                             ("3d", "NCX", "f32"), ("pointwise", "NCX", "f32"),
                             ("3x3 dilated rows", "NXC", "f32")):
        run_with_plan(make_case("ConvolutionBackwardWeights", **PACKED_WEIGHT_GEOMETRY[name],
                                data_format=fmt, dtype=dtype),
                      {{"packed": 1, "bf16_dot": 0}}, convgrad.cpu.available_isas()[0], 2,
                      optional=("bf16_dot",), variant=Variant.WEIGHTS_PACKED)
    import convgrad  # NCX bf16 pixel pairs transposed (vdpbf16ps: forced, Intel widens)
    from forcing import run_with_plan
    from geometries import BF16_PAIR_GEOMETRY
    if convgrad.cpu.available_isas()[0] == "avx512bf16":  # (pairs need vdpbf16ps)
        for geometry in BF16_PAIR_GEOMETRY.values():
            run_with_plan(make_case("ConvolutionBackwardWeights", **geometry, batch=2,
                                    data_format="NCX", dtype="bf16"), {{}},
                          "avx512bf16", 2, variant=Variant.WEIGHTS_PAIRS)
        for name, fmt in (("3x3", "NXC"), ("1x1 groups", "NCX")):  # a block of images
            run_with_plan(make_case("ConvolutionBackwardWeights", **BF16_PAIR_GEOMETRY[name],
                                    batch=3, data_format=fmt, dtype="bf16"),
                          {{"amx": 0, "image_block_kb": 1}}, "avx512bf16", 2,
                          optional=("amx",), variant=Variant.WEIGHTS_PAIRS)
    from geometries import BF16_CHANNEL_PAIR_GEOMETRY  # and data gradients' channel pairs
    for geometry in BF16_CHANNEL_PAIR_GEOMETRY.values():
        run_with_plan(make_case("ConvolutionBackwardData", **geometry, batch=2,
                                data_format="NCX", dtype="bf16"), {{"amx": 0}},
                      convgrad.cpu.available_isas()[0], 2, optional=("amx",),
                      variant=Variant.DIRECT)
    if "avx2" in convgrad.cpu.available_isas():  # avx2: pixel chunks beyond L2, 2-vector blocks
        run_with_plan(make_case("ConvolutionBackwardWeights", spatial=(52, 5), kernel=(3, 3),
                                in_channels=280, out_channels=128, batch=2,
                                attrs=dict(pads_begin=1, pads_end=1)), {{}}, "avx2", 2,
                      variant=Variant.WEIGHTS_PACKED)
    for fmt in ("IOX", "IXO", "XOI"):  # the forward op's packers: taps, reduced channels
        run_case(make_case("ConvTransposeBackwardData", spatial=(6, 7), kernel=(3, 3),  # or
                           in_channels=37, out_channels=70, batch=2,  # vector channels inner
                           weights_format=fmt), num_threads=2)
    from geometries import SLICED_WEIGHT_GEOMETRY  # pixel slices, more threads than slices
    for name, fmt, dtype in (("1x1", "NXC", "f32"), ("3x3", "NCX", "f16")):
        run_case(make_case("ConvolutionBackwardWeights", **SLICED_WEIGHT_GEOMETRY[name],
                           data_format=fmt, dtype=dtype), num_threads=5)
    print("ok")
"""),
    "data-and-dot": textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from cases import make_case
    from checks import run_case
    from forcing import run_with_plan
    from convgrad.codegen.plan import Variant
    # overlapping runs of each w tap (and, forced, padded columns instead); a dilated
    # narrow row cut at its edges (no tap reaches every column; 24% of the padded row's
    # multiply-adds would be by zeros); wide rows with 70 channels (avx2: 3 x 4 tiles)
    for width, channels, dilation in ((7, 180, 1), (7, 180, 2), (40, 70, 2)):
        case = make_case("ConvolutionBackwardData", spatial=(5, width), kernel=(2, 3),
                         in_channels=channels, out_channels=70, batch=2,
                         attrs=dict(strides=[2, 1], dilations=[1, dilation],
                                    pads_begin=[1, 3], pads_end=[0, 1]))
        run_case(case, num_threads=2)
        if dilation == 1:
            run_with_plan(case, {{"overlap_runs": 0}}, None, 2, variant=Variant.DIRECT)
    run_case(make_case("ConvolutionBackwardData", spatial=(5, 9), kernel=(3, 3),  # bf16 rows
                       in_channels=37, out_channels=70, batch=2, dtype="bf16",   # rounded
                       attrs=dict(pads_begin=1, pads_end=1)), num_threads=2)   # after runs
    for op in ("ConvolutionBackwardData", "ConvTransposeBackwardData"):  # NCX 1x1 in place
        run_case(make_case(op, spatial=(12, 13), kernel=(1, 1), in_channels=70,
                           out_channels=37, batch=2, data_format="NCX"), num_threads=2)
    # bf16: AMX where the CPU has it (a band of rows copied, from and to channels-first
    # data through channels-last copies)
    run_case(make_case("ConvTransposeBackwardData", spatial=(9, 7), kernel=(2, 3),
                       in_channels=64, out_channels=96, batch=3, dtype="bf16",
                       data_format="NCX", attrs=dict(pads_begin=[1, 1], pads_end=[0, 1])),
             num_threads=2)
    run_case(make_case("ConvTransposeBackwardData", spatial=(4, 9, 8), kernel=(3, 3, 2),
                       in_channels=64, out_channels=32, batch=2, dtype="bf16",  # a copy per
                       attrs=dict(strides=[1, 2, 3], pads_begin=[2, 1, 2],  # depth tap and
                                  pads_end=[1, 1, 0])), num_threads=2)  # phase of the stride
    run_case(make_case("ConvolutionBackwardData", spatial=(4, 9, 8), kernel=(3, 3, 2),  # by
                       in_channels=32, out_channels=64, batch=2, dtype="bf16",  # phase of
                       attrs=dict(strides=[2, 2, 3], pads_begin=[1, 1, 2],  # the stride
                                  pads_end=[1, 0, 0])), num_threads=2)
    for op in ("ConvolutionBackwardWeights", "ConvolutionBackwardData"):  # OIX transposes
        run_case(make_case(op, spatial=(6, 7), kernel=(3, 3), in_channels=37, out_channels=70,
                           batch=2, weights_format="OIX"), num_threads=2)
    import convgrad  # bf16 pairs of OXI rows and of OIX taps, an odd last pair
    if convgrad.cpu.available_isas()[0] == "avx512bf16":
        for fmt in ("OXI", "OIX"):
            run_with_plan(make_case("ConvolutionBackwardData", spatial=(6, 7), kernel=(3, 3),
                                    in_channels=37, out_channels=69, batch=2, dtype="bf16",
                                    weights_format=fmt), {{"amx": 0}}, "avx512bf16", 2,
                          optional=("amx",), variant=Variant.DIRECT)
    run_case(make_case("ConvolutionBackwardWeights", spatial=(40, 33), kernel=(1, 1),  # swapped
                       in_channels=20, out_channels=37, batch=2, data_format="NCX",
                       weights_format="OIX"), num_threads=2)
    run_case(make_case("ConvolutionBackwardWeights", spatial=(13, 17), kernel=(3, 3),
                       in_channels=5, out_channels=37, batch=3, data_format="NCX",  # src in
                       attrs=dict(dilations=[1, 2], pads_begin=1, pads_end=[0, 2])),  # place
             num_threads=2)
    run_case(make_case("ConvolutionBackwardData", spatial=(3, 37), kernel=(2, 3),  # sliding
                       in_channels=40, out_channels=40, groups=40,
                       attrs=dict(pads_begin=[1, 2], pads_end=[0, 1])), num_threads=2)
    import convgrad  # the pixel-dot plan of NCX weight gradients, forced
    from forcing import run_with_plan
    from geometries import DOT_WEIGHT_GEOMETRY
    for name in ("1x1", "3x3"):
        run_with_plan(make_case("ConvolutionBackwardWeights", **DOT_WEIGHT_GEOMETRY[name],
                                data_format="NCX"), {{"ncx_dot": 1, "group_lanes": 0}},
                      convgrad.cpu.available_isas()[0], 2, optional=("group_lanes",),
                      variant=Variant.WEIGHTS_DOT)
    # depthwise weights, a sliding window of src columns (dilated, a channel tail), each
    # row's vector blocks in turn
    run_with_plan(make_case("ConvolutionBackwardWeights", spatial=(5, 30), kernel=(3, 3),
                            in_channels=44, out_channels=44, groups=44, batch=2,
                            attrs=dict(dilations=[1, 2], pads_begin=1, pads_end=[1, 2])),
                  {{"slide": 1, "row_vb_inner": 1}}, convgrad.cpu.available_isas()[0], 2,
                  variant=Variant.DEPTHWISE_WEIGHTS)
    # depthwise weights with every tap of a kd in registers, groups of one row (strides,
    # dilation, one-sided pads, a channel tail)
    from geometries import ALL_TAPS_GEOMETRY
    run_with_plan(make_case("ConvolutionBackwardWeights", **ALL_TAPS_GEOMETRY["strided"]),
                  {{"all_taps": 1, "row_group_kb": 1}}, convgrad.cpu.available_isas()[0], 2,
                  variant=Variant.DEPTHWISE_WEIGHTS)
    # across groups, an operand spread; 1x6: whole loads of partial vectors but in src's
    # last row
    from geometries import GROUP_LANES_GEOMETRY
    for name, fmt, dtype in (("3x2 1d", "NCX", "f16"), ("1x6", "NXC", "f32")):
        for op in ("ConvolutionBackwardWeights", "ConvolutionBackwardData"):
            run_case(make_case(op, **GROUP_LANES_GEOMETRY[name], data_format=fmt,
                               dtype=dtype), num_threads=2)
    run_with_plan(make_case("ConvolutionBackwardData", **GROUP_LANES_GEOMETRY["1x6"]),
                  {{"group_lanes": 1, "spread_whole_mb": 0}}, convgrad.cpu.available_isas()[0], 3,
                  variant=Variant.ACROSS_GROUPS)
    # depthwise weights with stride: rows sweep whole pixels, a channel tail
    run_with_plan(make_case("ConvolutionBackwardWeights", spatial=(6, 21), kernel=(3, 3),
                            in_channels=72, out_channels=72, groups=72, batch=2,
                            attrs=dict(strides=[1, 2], pads_begin=1, pads_end=1)),
                  {{"pixel_sweep": 1}}, convgrad.cpu.available_isas()[0], 2,
                  variant=Variant.DEPTHWISE_WEIGHTS)
    # depthwise results stored past the caches (and, a float off a line, not)
    from forcing import run_streamed
    from geometries import STREAM_GEOMETRY
    run_streamed(make_case("ConvolutionBackwardData", **STREAM_GEOMETRY["strided"], batch=2),
                 {{"stream_kb": 1}}, convgrad.cpu.available_isas()[0],
                 variant=Variant.ACROSS_GROUPS)
    # channels-first 1x1 data gradients with strides: the compact copy's result spread
    # into staging planes and streamed into the result (on a line, a float off one)
    run_streamed(make_case("ConvolutionBackwardData", spatial=(12, 17), kernel=(1, 1),
                           in_channels=40, out_channels=35, batch=3, data_format="NCX",
                           attrs=dict(strides=[2, 2], output_padding=[1, 1])),
                 {{"stream_kb": 1}}, convgrad.cpu.available_isas()[0],
                 variant=Variant.DIRECT)
    # NCX data gradients a block of images at a time (one per thread; the last block
    # short), padded rows in the block's copy; and a band of rows at a time (one row, a
    # few rows cut short, padded rows in the band's copy)
    from geometries import IMAGE_BLOCK_GEOMETRY
    for name, dtype in (("3x3 padded", "f32"), ("strided", "f32"), ("strided", "bf16")):
        run_with_plan(make_case("ConvolutionBackwardData", **IMAGE_BLOCK_GEOMETRY[name],
                                batch=5, data_format="NCX", dtype=dtype),
                      {{"band_kb": 0, "image_block_kb": 1, "col2im": 0}},
                      convgrad.cpu.available_isas()[0], 3, optional=("col2im",),
                      variant=Variant.DIRECT)
    for name, plan in (("3x3 padded", {{"band_kb": 3}}), ("strided", {{"band_kb": 1}}),
                       ("1d", {{"band_kb": 1}}),
                       ("3x3 padded", {{"band_kb": 1, "pad_columns": 1, "overlap_runs": 0}})):
        run_with_plan(make_case("ConvolutionBackwardData", **IMAGE_BLOCK_GEOMETRY[name],
                                batch=5, data_format="NCX", dtype="f16"),
                      {{**plan, "col2im": 0}}, convgrad.cpu.available_isas()[0], 3,
                      optional=("col2im",), variant=Variant.DIRECT)
    # few result channels by col2im: row shares inside an image, dilated taps, edges
    from geometries import COL2IM_GEOMETRY
    for name, fmt in (("conv1", "NXC"), ("1d", "NCX"), ("3d", "NXC")):
        run_with_plan(make_case("ConvolutionBackwardData", **COL2IM_GEOMETRY[name],
                                data_format=fmt), {{"col2im": 1}},
                      convgrad.cpu.available_isas()[0], 3, variant=Variant.COL2IM)
    print("ok")
"""),
}


def _run_sanitized(script: str) -> subprocess.CompletedProcess:
    env = sanitized_env(ROOT / ".pytest_cache" / "convgrad-sanitized", CONVGRAD_AOT_PATH="")
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(ASAN is None or UBSAN is None, reason="needs gcc's libasan and libubsan")
@pytest.mark.parametrize("seed", [1, 2])
def test_random_configurations_under_sanitizers(seed):
    result = _run_sanitized(CHILD.format(tests=str(ROOT / "tests"), seed=seed, count=12))
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "ok 12"


@pytest.mark.skipif(ASAN is None or UBSAN is None, reason="needs gcc's libasan and libubsan")
@pytest.mark.parametrize("half", sorted(LONG_REDUCTIONS))
def test_long_reductions_under_sanitizers(half):
    result = _run_sanitized(LONG_REDUCTIONS[half].format(tests=str(ROOT / "tests")))
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "ok"


OVERFLOW = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from cases import make_case
    from checks import problem_of
    from convgrad import kernels
    case = make_case("ConvolutionBackwardData", spatial=(6, 7), kernel=(3, 3),
                     in_channels=16, out_channels=16, batch=1,
                     attrs=dict(pads_begin=1, pads_end=1))
    problem = problem_of(case)
    kernel = kernels.get_kernel(problem.config)
    dims = kernels.dims_of(problem, 1)
    short = np.empty(int(np.prod(problem.output_shape)) // 2, dtype=np.float32)
    workspace = np.empty(max(1, kernel.workspace_size(dims)), dtype=np.uint8)
    print("calling", flush=True)
    kernels.call(kernel, problem, dims, *case.inputs[:2], short, workspace)
    print("not caught")
""")


@pytest.mark.skipif(ASAN is None or UBSAN is None, reason="needs gcc's libasan and libubsan")
def test_sanitized_kernels_catch_a_write_past_the_output():
    """The tests' sanitized builds (sanitized_env: -O0) do check: a kernel handed an
    output half its size, past the runtime's checks, aborts in AddressSanitizer."""
    result = _run_sanitized(OVERFLOW.format(tests=str(ROOT / "tests")))
    assert "calling" in result.stdout and "not caught" not in result.stdout, result.stdout
    assert result.returncode != 0 and "heap-buffer-overflow" in result.stderr, \
        result.stderr[-2000:]
