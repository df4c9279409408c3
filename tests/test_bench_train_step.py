"""The training-step benchmark runs end to end on a tiny model and writes its outputs;
its models (benchmarks.models) have torchvision's layouts and train in torch.nn."""

from __future__ import annotations

import csv
import json

import pytest

torch = pytest.importorskip("torch")

from benchmarks import models, train_step  # noqa: E402  (they import torch)


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
    assert row["model"] == "resnet18" and row["dtype"] == "f32"
    assert row["memory_format"] == "channels_last" and row["frames"] == ""
    assert float(row["torch_ms"]) > 0 and float(row["convgrad_ms"]) > 0
    assert int(row["convgrad_steps"]) >= 3
    # block mode (the suite's): the first step compiled, every later one ran the kernels
    assert int(row["switched_at_step"]) == 1 and float(row["convgrad_second_step_ms"]) > 0
    first = float(row["convgrad_first_step_ms"]) / 1e3
    assert abs(float(row["switched_after_s"]) - first) <= 0.0051  # both rounded
    # the same step of the same model: both libraries' weight gradients near float64's
    assert float(row["torch_grad_err"]) < 1e-4 and float(row["convgrad_grad_err"]) < 1e-4
    # one profiled step of each model: copies counted (the reference's include its
    # gradient accumulation and BatchNorm bookkeeping, so never none)
    assert int(row["torch_copies"]) > 0 and int(row["convgrad_copies"]) >= 0
    assert "copies torch/ours" in printed
    assert f"{row['torch_copies']}/{row['convgrad_copies']}" in printed
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["command"].startswith("python -m benchmarks.train_step")
    assert results["rows"][0]["threads"] == 1 and results["rows"][0]["model"] == "resnet18"


@pytest.mark.parametrize("flags,label", [(["--autocast", "bf16"], "amp-bf16"),
                                         (["--ddp", "2"], "f32x2")])
def test_train_step_under_autocast_and_ddp(tmp_path, capsys, flags, label):
    """--autocast runs both float32 models under torch.autocast and --ddp on gloo ranks
    in lockstep (spawned processes): each row is recorded with its setting."""
    threads = torch.get_num_threads()
    try:
        status = train_step.main(["--dtype", "f32", "--threads", "1", "--batch", "2",
                                  "--size", "16", "--width", "4", "--blocks", "1",
                                  "--min-time", "0", "--warmup", "1", *flags,
                                  "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    printed = capsys.readouterr().out
    assert label in printed and "warning" not in printed  # DDP: the ranks agree
    with (tmp_path / "results.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["torch_ms"]) > 0 and float(row["convgrad_ms"]) > 0
    assert row["autocast"] == ("bf16" if "--autocast" in flags else "")
    assert row["ranks"] == ("2" if "--ddp" in flags else "1")


def test_train_step_rejects_autocast_of_a_low_precision_model():
    with pytest.raises(SystemExit):
        train_step.parse_args(["--dtype", "bf16", "--autocast", "bf16"])
    assert train_step.parse_args(["--autocast", "bf16"]).dtype == ["f32"]
    assert train_step.parse_args([]).dtype == ["f32", "bf16"]


def test_converted_resnet_has_only_convgrad_convolutions():
    model = train_step.ResNet(width=4, blocks=[1, 1])
    report = train_step.cgt.convert(model)
    assert not report.skipped
    convolutions = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convolutions) == len(report.converted) == 1 + 2 + 3  # stem, 2 blocks, proj.
    assert all(type(m) is train_step.cgt.Conv2d for m in convolutions)


# convolutions (nn.Conv*) and parameters: torchvision's parameter counts of the same models
EXPECTED = {"resnet18": (20, 11_689_512), "resnet50": (53, 25_557_032),
            "resnext50": (53, 25_028_904), "mobilenet_v2": (52, 3_504_872),
            "efficientnet_b0": (81, 5_288_548), "r3d_18": (20, 33_371_472)}
# tiny inputs; batch 2, since BatchNorm in training needs two values per channel and
# the last stages pool down to 1x1
TINY = {"r3d_18": (2, 3, 4, 16, 16)}


def test_every_model_is_listed_with_its_expected_layout():
    assert set(models.MODELS) == set(EXPECTED)
    for name, (convolutions, parameters) in EXPECTED.items():
        model = models.MODELS[name]()
        assert sum(isinstance(m, train_step.CONVOLUTIONS) for m in model.modules()) \
            == convolutions, name
        assert sum(p.numel() for p in model.parameters()) == parameters, name


@pytest.mark.parametrize("name", list(EXPECTED))
def test_model_trains_one_step_in_torch(name):
    torch.manual_seed(0)
    model = models.MODELS[name](classes=models.classes(name))
    shape = TINY.get(name, (2, 3, 32, 32))
    if name == "resnet50":  # the bottleneck path, kept small
        shape = (2, 3, 16, 16)
    out = model(torch.randn(shape))
    assert out.shape == (2, models.classes(name))
    torch.nn.functional.cross_entropy(out, torch.tensor([0, 1])).backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_input_shapes_default_per_model_and_follow_the_options():
    assert models.input_shape("resnet18") == (8, 3, 112, 112)
    assert models.input_shape("efficientnet_b0", size=64) == (8, 3, 64, 64)
    assert models.input_shape("r3d_18") == (2, 3, 8, 56, 56)
    assert models.input_shape("r3d_18", batch=4, size=32, frames=16) == (4, 3, 16, 32, 32)
    assert models.classes("r3d_18") == 400 and models.classes("resnet50") == 1000
    with pytest.raises(KeyError):
        models.input_shape("vgg16")


def test_options_choose_models_and_resnet18_alone_takes_width_and_blocks(capsys):
    args = train_step.parse_args(["--model", "resnet18,r3d_18", "--width", "8"])
    assert args.model == ["resnet18", "r3d_18"] and args.batch is None
    assert train_step.build("resnet18", args).stem[0].out_channels == 8
    assert train_step.build("r3d_18", args).stem[0].out_channels == 64
    for argv in (["--model", "resnet50", "--blocks", "1"], ["--model", "vgg16"]):
        with pytest.raises(SystemExit):
            train_step.parse_args(argv)
    capsys.readouterr()
