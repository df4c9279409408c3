"""The benchmark command runs end to end on a tiny setting and writes its outputs."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench  # noqa: E402


def test_benchmark_writes_table_csv_json_and_plot(tmp_path, capsys):
    status = bench.main(["--set", "resnet50", "--limit", "1", "--threads", "1",
                         "--min-time", "0.01", "--batch", "1", "--out", str(tmp_path)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "FMA peak" in printed and "geometric mean" in printed
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert {row["op"] for row in rows} == {"data", "weights"}
    for row in rows:
        assert float(row["ours_gflops"]) > 0 and float(row["torch_gflops"]) > 0
        assert not row["note"].startswith("MISMATCH")
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["machine"]["peak_f32_gflops_per_core"] > 0
    assert (tmp_path / "results.png").stat().st_size > 0
