"""The compile-time benchmark runs end to end on a small layer list."""

from __future__ import annotations

from pathlib import Path

from benchmarks import compile_time
from convgrad import pch
from convgrad.cpu import selected_isa

ROOT = Path(__file__).resolve().parent.parent


def test_compile_time_reports_every_mode_per_family(capsys):
    modes = "plain,pch,cache" if pch.wanted(selected_isa()) else "plain,cache"
    status = compile_time.main([str(ROOT / "examples" / "c_api" / "layers.json"),
                                "--modes", modes])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 kernels, NXC")
    rows = {tuple(line.split()[:3]) for line in lines[2:]}
    assert rows == {(mode, family, "1") for mode in modes.split(",")
                    for family in ("data", "weights")}
    assert all(0 < float(line.split()[3]) < 60 for line in lines[2:])

