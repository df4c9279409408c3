"""The training-step benchmark runs end to end on a tiny model and writes its outputs."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_step  # noqa: E402


def test_train_step_benchmark_writes_table_csv_and_json(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        status = train_step.main(["--dtype", "f32", "--threads", "1", "--batch", "2",
                                  "--size", "16", "--width", "4", "--blocks", "1",
                                  "--min-time", "0", "--warmup", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    printed = capsys.readouterr().out
    assert "torch.nn ms" in printed and "convgrad ms" in printed
    with (tmp_path / "results.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["dtype"] == "f32" and row["memory_format"] == "channels_last"
    assert float(row["torch_ms"]) > 0 and float(row["convgrad_ms"]) > 0
    assert int(row["convgrad_steps"]) >= 3
    # the same step of the same model: the loss and the weight gradients agree
    assert float(row["loss_rel_diff"]) < 1e-5 and float(row["grad_rel_diff"]) < 1e-4
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["command"].startswith("python benchmarks/train_step.py")
    assert results["rows"][0]["threads"] == 1


def test_converted_resnet_has_only_convgrad_convolutions():
    model = train_step.ResNet(width=4, blocks=[1, 1])
    report = train_step.cgt.convert(model)
    assert not report.skipped
    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convolutions) == len(report.converted) == 1 + 2 + 3  # stem, 2 blocks, proj.
    assert all(type(m) is train_step.cgt.Conv2d for m in convolutions)
