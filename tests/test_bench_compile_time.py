"""The compile-time benchmark runs end to end on a small layer list."""

from __future__ import annotations

from pathlib import Path

from benchmarks import compile_flags, compile_time
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


def test_compile_flags_times_each_variant_on_the_same_kernels(capsys):
    """benchmarks.compile_flags compiles each kernel once per variant and reports each
    variant's time and text size against the first's (1.000 for the first itself)."""
    assert compile_flags.main(["--limit", "1", "--variants=-O3,-O2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"1 kernels, {selected_isa()}"
    assert [line.split()[0] for line in lines[1:]] == ["-O3", "-O2"]
    assert lines[1].endswith("time / -O3 1.000, text / -O3 1.000")
