"""Every op on every ISA path this CPU runs (CONVGRAD_ISA), against the reference:
the API grid on the other paths, several vector blocks with channel tails, torch's
channels-last weights, OIX weights through register transposes. Paths the CPU lacks are
not among the parameters (forcing.ISAS).
"""

from __future__ import annotations

import pytest
from cases import TRANSPOSE, make_case, rotating
from checks import run_case
from forcing import ISAS
from geometries import GEOMETRY, GRID

from convgrad.codegen import KernelConfig
from convgrad.reference import OP_KINDS


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", OP_KINDS)
@pytest.mark.parametrize("in_channels,out_channels,data_format,dtype",
                         [(37, 70, "NXC", "f32"), (70, 37, "NCX", "bf16"), (16, 64, "NXC", "f16"),
                          (37, 70, "NXC", "bf16")])
def test_isa_paths_and_channel_tails(isa, op, in_channels, out_channels, data_format, dtype,
                                     monkeypatch):
    """Every ISA path this CPU runs, with several vector blocks and channel tails."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, spatial=(7, 9), kernel=(3, 2), in_channels=in_channels,
                     out_channels=out_channels, batch=1, data_format=data_format, dtype=dtype,
                     attrs=dict(strides=[2, 1], dilations=[1, 2], pads_begin=[1, 0],
                                pads_end=[1, 1]))
    run_case(case)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op", OP_KINDS)
def test_channels_last_weights_on_every_path(isa, op, monkeypatch):
    """torch's channels_last weights, (O, k..., I/g) = OXI (IXO for the ConvTranspose
    ops), read and written in place on every ISA path: several vector blocks with channel
    tails, grouped 3-D, depthwise; f32, bf16 and f16. (AMX: test_amx_tiles_*.)"""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    fmt = "IXO" if op in TRANSPOSE else "OXI"
    for dtype, groups, channels, kernel, spatial, data_format in (
            ("f32", 1, (37, 70), (3, 2), (7, 9), "NXC"),
            ("bf16", 2, (6, 10), (2, 1, 3), (3, 4, 5), "NCX"),
            ("f16", 24, (24, 24), (3, 3), (6, 5), "NXC")):
        case = make_case(op, spatial=spatial, kernel=kernel, in_channels=channels[0],
                         out_channels=channels[1], groups=groups, batch=2,
                         data_format=data_format, weights_format=fmt, dtype=dtype,
                         attrs=dict(pads_begin=1, pads_end=0))
        run_case(case)


def _other_paths(dtype: str) -> list[str]:
    """ISA paths other than the one the full grid runs for `dtype` (an ISA that adds
    nothing for a dtype is its base path there: avx512bf16 for f32 is avx512)."""
    def path(isa: str) -> str:
        return KernelConfig("fwd", (1,), (1,), (1,), 1, 64, 64, "NXC", "OIX", dtype).with_isa(
            isa).isa
    return [isa for isa in ISAS[1:] if path(isa) == isa and path(isa) != path(ISAS[0])]


@pytest.mark.parametrize("op,rank,data_format,weights_format,dtype,isa",
                         [(*g, isa) for g in GRID if g[4] != "f16" and g[2] == "NXC"
                          for isa in _other_paths(g[4])])
def test_isa_grid(op, rank, data_format, weights_format, dtype, isa, monkeypatch):
    """The grid on the other ISA paths (the best path runs the full grid)."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, **GEOMETRY[rank], groups=2, in_channels=4, out_channels=6,
                     data_format=data_format, weights_format=weights_format, dtype=dtype)
    run_case(case)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("op,weights_format", [("ConvolutionBackwardWeights", "OIX"),
                                               ("ConvTransposeBackwardWeights", "IOX"),
                                               ("ConvolutionBackwardData", "OIX"),
                                               ("ConvolutionBackpropData", "OIX")])
@pytest.mark.parametrize("data_format,dtype,kernel", [  # two of the kernels each, rotating
    (*formats, kernel)
    for i, formats in enumerate([("NXC", "f32"), ("NCX", "bf16"), ("NXC", "f16")])
    for kernel in rotating([(3, 2), (3, 3), (1, 1)], i, 2)])
def test_oix_weights_through_register_transposes(isa, op, weights_format, data_format, dtype,
                                                 kernel, monkeypatch):
    """OIX weights go in and out through VL x VL register transposes: weight gradients
    leave their sums in blocks of (i, tap) values x output channels, several blocks of
    output channels; data gradients pack blocks of vector channels x taps (more taps than
    an avx2 vector's lanes with 3x3). Tails of both on every ISA path."""
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    case = make_case(op, spatial=(6, 7), kernel=kernel, in_channels=37, out_channels=70,
                     data_format=data_format, weights_format=weights_format, dtype=dtype,
                     seed=3)
    run_case(case)
