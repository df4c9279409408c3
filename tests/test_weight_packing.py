"""The direct data kernels repack the user's weights by the axis the user's layout keeps
contiguous (pack_weights_<packing>.h.j2): every packing, on every ISA path here, against
the independent reference, bit for bit."""

from __future__ import annotations

import pytest
from cases import TRANSPOSE, make_case
from checks import DTYPE_NAMES
from forcing import AMX_OFF, ISAS, forced_kernel

from convgrad.codegen.isa import VECTOR_LANES
from convgrad.codegen.ops import resolve
from convgrad.codegen.plan import Variant, resolve_plan

OPS = ("ConvolutionBackwardData", "ConvTransposeBackwardData")


def expected_packing(op: str, weights_format: str, taps: int, bf16_pairs: bool,
                     reduced: int) -> str:
    """From the user's layout alone: the letter of its innermost axis of more than one
    element. Both ops vectorise the channels of their result, which the user's format
    calls I (diff_src's channels; the ConvTranspose's own input channels), and reduce
    over O: "I" is read a vector at a time, "O" (or bf16 pairs of O channels, when their
    count is even) and "X" in blocks transposed in registers; bf16 pairs of "I" or "X"
    rows interleaved (then as for f32), other bf16 pairs a value at a time."""
    letters = weights_format if taps > 1 else weights_format.replace("X", "")
    inner = letters[-1]
    if bf16_pairs:
        if inner in "IX":
            return {"I": "v_pairs", "X": "tap_pairs"}[inner]
        return "r_rows" if inner == "O" and reduced % 2 == 0 else "values"
    return {"I": "v_rows", "O": "r_rows", "X": "tap_rows"}[inner]


CASES = [(op, fmt, kernel) for op in OPS
         for fmt in (("IOX", "XOI", "IXO") if op in TRANSPOSE else ("OIX", "XIO", "OXI"))
         for kernel in ((3, 2), (1, 1))]


# The packers differ by vector width only: one path of each width (f32 on avx512 and
# avx512bf16 is the same code).
WIDTHS = list({VECTOR_LANES[isa]: isa for isa in reversed(ISAS)
               if isa in VECTOR_LANES}.values())


@pytest.mark.parametrize("isa", WIDTHS)
@pytest.mark.parametrize("op,weights_format,kernel", CASES)
def test_every_weight_packing_is_exact(isa, op, weights_format, kernel):
    """Several vector blocks with a channel tail, several reduced-channel blocks with a
    tail, taps along both axes, stride and pads; f32, and on avx512bf16 bf16 in pairs
    (of an even and an odd number of reduced channels for 3x2 kernels, odd for 1x1)."""
    cases = [("f32", 37, 70, {})]
    if isa == "avx512bf16":  # bf16 multiplied in pairs (vdpbf16ps), off the AMX path
        for cin, cout in ((37, 70), (70, 37)) if kernel != (1, 1) else ((70, 37),):
            cases.append(("bf16", cin, cout, {"bf16_dot": 1, "amx": 0}))
    for dtype, cin, cout, plan in cases:
        case = make_case(op, spatial=(7, 9), kernel=kernel, in_channels=cin,
                         out_channels=cout, batch=1, data_format="NXC", dtype=dtype,
                         weights_format=weights_format,
                         attrs=dict(strides=[2, 1], pads_begin=[1, 0], pads_end=[1, 1]))
        a, b = case.inputs[:2]
        config = resolve(op, [a.shape, b.shape], case.attrs, None,
                         DTYPE_NAMES[a.dtype]).config.with_isa(isa)
        resolved = resolve_plan(config, {k: v for k, v in plan.items() if k != "amx"})
        reduced = config.cout_per_group if op not in TRANSPOSE else config.cin_per_group
        assert resolved.choices["weight_packing"] == expected_packing(
            op, weights_format, kernel[0] * kernel[1], resolved.bf16_dot, reduced)
        size, run = forced_kernel(case, plan, isa, optional=AMX_OFF, variant=Variant.DIRECT)
        run(bytearray(size))


def test_every_packing_is_reached():
    """The cases above reach each of the six packings on avx512bf16."""
    seen = set()
    for op, fmt, kernel in CASES:
        taps = kernel[0] * kernel[1]
        seen.add(expected_packing(op, fmt, taps, False, 70))
        seen.add(expected_packing(op, fmt, taps, True, 70 if taps > 1 else 37))
    assert seen == {"v_rows", "r_rows", "tap_rows", "v_pairs", "tap_pairs",
                    "values"}
