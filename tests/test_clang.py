"""Kernels built by clang (CC=clang): the generated C is GNU C that both GCC and clang
compile (vector extensions, lane shuffles, unroll pragmas), and clang's kernels give the
reference's bits on integer data. One case per kernel family, on every path this CPU
runs. CI installs clang (and LLVM's OpenMP runtime, libomp-dev)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from cases import make_case
from forcing import forced_kernel

import convgrad
from convgrad.codegen.plan import Variant
from convgrad.cpu import available_isas

pytestmark = pytest.mark.skipif(shutil.which("clang") is None,
                                reason="needs clang and libomp-dev")

CASES = {
    "data 3x3 strided NXC": dict(op="ConvolutionBackwardData", spatial=(6, 11), kernel=(3, 3),
                                 in_channels=70, out_channels=40,
                                 attrs=dict(strides=[2, 1], pads_begin=1, pads_end=1)),
    "data 1x1 NCX": dict(op="ConvolutionBackwardData", spatial=(12, 13), kernel=(1, 1),
                         in_channels=70, out_channels=37, data_format="NCX"),
    "data depthwise": dict(op="ConvolutionBackwardData", spatial=(5, 30), kernel=(3, 3),
                           in_channels=24, out_channels=24, groups=24,
                           attrs=dict(pads_begin=1, pads_end=1)),
    "weights 3x3 NXC bf16": dict(op="ConvolutionBackwardWeights", spatial=(9, 10),
                                 kernel=(3, 3), in_channels=20, out_channels=36, dtype="bf16",
                                 attrs=dict(pads_begin=1, pads_end=1)),
    "weights 3x3 NCX f16 groups": dict(op="ConvolutionBackwardWeights", spatial=(14, 11),
                                       kernel=(3, 3), in_channels=40, out_channels=34,
                                       groups=2, data_format="NCX", dtype="f16",
                                       attrs=dict(pads_begin=1, pads_end=0)),
    "weights depthwise 1d": dict(op="ConvolutionBackwardWeights", spatial=(40,), kernel=(5,),
                                 in_channels=16, out_channels=16, groups=16,
                                 attrs=dict(pads_begin=2, pads_end=2)),
}


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("name", sorted(CASES))
def test_clang_kernels_are_exact(isa, name, fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", "clang")
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    params = dict(CASES[name])
    op = params.pop("op")
    case = make_case(op, **params, batch=2, seed=5)
    dtype = case.inputs[0].dtype
    result = convgrad.execute(case.op, case.inputs, case.attrs, num_threads=2)
    view = np.uint16 if dtype.itemsize == 2 else np.uint32
    np.testing.assert_array_equal(result.view(view), case.expected(dtype).view(view))
    (entry,) = fresh_cache.glob("convgrad_*.json")
    assert "clang" in entry.read_text()


@pytest.mark.skipif("avx512bf16" not in available_isas(), reason="needs the avx512bf16 path")
@pytest.mark.parametrize("op,kernel,data_format,strides,channels", [
    # band copies, tiles in an OpenMP region
    ("ConvolutionBackwardWeights", (3, 3), "NCX", 1, (32, 64)),
    ("ConvolutionBackwardData", (1, 1), "NXC", 1, (32, 64)),  # the pointwise AMX path
    ("ConvolutionBackwardData", (3, 3), "NXC", 1, (32, 64)),  # the rows AMX path
    ("ConvolutionBackwardData", (3, 3), "NXC", 2, (32, 64)),  # the phases AMX path
    # few input channels: patches (forward, weights), columns (col2im's backward data)
    ("ConvTransposeBackwardData", (3, 3), "NXC", 2, (32, 3)),
    ("ConvolutionBackwardWeights", (3, 3), "NXC", 2, (3, 32)),
    ("ConvolutionBackwardData", (3, 3), "NXC", 2, (3, 32)),
])
def test_clang_compiles_the_amx_path(op, kernel, data_format, strides, channels, fresh_cache,
                                     monkeypatch):
    """Kernels carrying the AMX path, built by clang (clang compiles an OpenMP region as a
    function without the target of the one around it, so every AMX intrinsic sits in a
    function of its own with that target): exact, through AMX where the CPU has it, else
    through the other tiles."""
    monkeypatch.setenv("CC", "clang")
    attrs = dict(strides=[strides] * 2)
    if kernel != (1, 1):
        attrs.update(pads_begin=1, pads_end=1)
    case = make_case(op, spatial=(6, 7), kernel=kernel, in_channels=channels[0],
                     out_channels=channels[1], data_format=data_format, dtype="bf16",
                     batch=2, seed=6, attrs=attrs)
    few = min(channels) < 16
    plan = {"bf16_dot": 0} if op == "ConvolutionBackwardWeights" or few else {}
    weights = Variant.WEIGHTS_FLAT if few else Variant.WEIGHTS_PACKED
    size, run = forced_kernel(case, plan, "avx512bf16", threads=2,
                              variant={"ConvolutionBackwardWeights": weights,
                                       "ConvTransposeBackwardData": Variant.DIRECT,
                                       "ConvolutionBackwardData": Variant.COL2IM if few
                                       else Variant.DIRECT})
    run(np.empty(size, dtype=np.uint8))  # checks the bits
    (source,) = fresh_cache.glob("convgrad_*.c")
    assert "compute_amx" in source.read_text()
    assert "clang" in source.with_suffix(".json").read_text()
