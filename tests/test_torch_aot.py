"""Ahead-of-time kernels of a PyTorch model (convgrad.torch.aot_kernels and `convgrad aot
--torch-model`): the folder holds every kernel of a training step, so that a process
with no compiler and an empty kernel cache runs the converted model's step on them from
the first call (no stand-in, nothing built) with torch.nn's results; the model given is
left as it was; a bad --torch-model is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import convgrad.torch as cgt  # noqa: E402
from convgrad import aot, cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = "convgrad_test_aot_models"  # the module the factories live in
MODELS_SOURCE = '''
import torch
from torch import nn


def small():
    """Two convolutions, the second strided and grouped."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, groups=2))


class TwoInputs(nn.Module):
    """One convolution per input, both of one configuration."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, a, b):
        return self.a(a).sum() + self.b(b).sum()


def not_a_model():
    return 3


def no_convolution():
    return nn.Linear(4, 2)
'''


@pytest.fixture(scope="module")
def models_path(tmp_path_factory) -> Path:
    """A folder holding the module MODELS (put on sys.path by the tests that import it)."""
    folder = tmp_path_factory.mktemp("models")
    (folder / f"{MODELS}.py").write_text(MODELS_SOURCE)
    return folder


@pytest.fixture
def models(models_path, monkeypatch):
    monkeypatch.syspath_prepend(str(models_path))
    __import__(MODELS)
    return sys.modules[MODELS]


def _channels_last_input(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 9, 9, generator=generator).contiguous(
        memory_format=torch.channels_last)


# Run in a process of its own: the AOT folder only, no compiler, an empty kernel cache.
DEPLOYMENT = textwrap.dedent(f"""
    import copy, json
    import torch
    import convgrad.torch as cgt
    from convgrad import background, bound, kernels
    from convgrad.torch import _calls
    import {MODELS} as models

    ran, submitted = [], []
    run = bound.BoundCall.run
    bound.BoundCall.run = lambda self, *args: ran.append(self.config.name) or run(self, *args)
    background.submit = submitted.append
    reference = models.small().to(memory_format=torch.channels_last)
    converted = copy.deepcopy(reference)
    cgt.convert(converted)
    x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(1)).contiguous(
        memory_format=torch.channels_last)
    outputs = []
    for model in (reference, converted):
        y = model(x)
        y.sum().backward()
        outputs.append([y, *(p.grad for p in model.parameters())])
    close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                for a, b in zip(*outputs, strict=True))
    print(json.dumps({{"standins": _calls.standin_calls, "submitted": len(submitted),
                      "ran": sorted(set(ran)), "calls": len(ran), "close": close,
                      "origins": sorted({{k.origin for k in kernels._loaded.values()}})}}))
""")


def test_aot_folder_runs_a_training_step_without_a_compiler(models, models_path, tmp_path):
    model = models.small().to(memory_format=torch.channels_last)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    result = cgt.aot_kernels(model, _channels_last_input(), output=tmp_path / "aot", jobs=1)
    # conv1: forward, weight gradient (the input needs none); conv2: forward, data, weights
    assert len(result.configs) == 5 and all(len(users) == 1 for users in result.configs.values())
    # the model is left as it was: torch.nn's modules, same values, no gradients
    assert [type(m) for m in model] == [nn.Conv2d, nn.ReLU, nn.Conv2d]
    assert all(torch.equal(state[name], value) for name, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    manifest = json.loads((tmp_path / "aot" / "manifest.json").read_text())
    assert sorted(k["name"] for k in manifest["kernels"]) == sorted(
        aot.kernel_name(c, result.plans[c]) for c in result.configs)

    env = {**os.environ, "CONVGRAD_AOT_PATH": str(tmp_path / "aot"), "CC": "/nonexistent/cc",
           "CONVGRAD_CACHE_DIR": str(tmp_path / "empty-cache"),
           "CONVGRAD_COMPILE": "background",
           "PYTHONPATH": os.pathsep.join([str(models_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", DEPLOYMENT], env=env, capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["standins"] == 0 and seen["submitted"] == 0, (seen, done.stderr)
    assert seen["origins"] == ["aot"] and seen["calls"] == 5
    assert seen["ran"] == sorted(config.name for config in result.configs)
    assert seen["close"]


def test_cli_builds_a_factory_models_kernels_for_several_inputs(models_path, tmp_path):
    """Two inputs of different sizes through convolutions of one configuration: four
    layers (forward and weight gradient of each), two kernels, checked by --check."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(models_path),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "convgrad", "aot", "--torch-model", f"{MODELS}:TwoInputs",
         "--input-shape", "2,3,6,6", "--input-shape", "1,3,5,7", "-o", str(tmp_path / "out"),
         "-j", "1", "--check", "--repeats", "1"],
        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "built 2 kernels for 4 layers" in done.stdout
    assert "4 of 4 layers exact and served by the AOT library" in done.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {k["config"]["data_format"] for k in manifest["kernels"]} == {"NCX"}
    assert sum(len(k["layers"]) for k in manifest["kernels"]) == 4


@pytest.mark.parametrize(("spec", "shape", "message"), [
    ("no_such_module_here:make", "2,3,9,9", "cannot import module 'no_such_module_here'"),
    (f"{MODELS}:missing", "2,3,9,9", f"module '{MODELS}' has no attribute 'missing'"),
    (f"{MODELS}:not_a_model", "2,3,9,9", "not_a_model() returned a int, not a torch.nn.Module"),
    (MODELS, "2,3,9,9", "expected MODULE:FACTORY"),
    (f"{MODELS}:small", None, "--torch-model needs --input-shape"),
    (f"{MODELS}:small", "2,3,x", "expected positive sizes separated by commas"),
    (f"{MODELS}:small", "2,5,9,9", "one training step on inputs of shape 2,5,9,9 failed"),
    (f"{MODELS}:no_convolution", "2,4", "runs no convgrad kernel"),
    (f"{MODELS}:small", "2,3,9", "channels_last needs 4-D or 5-D input shapes"),
])
def test_cli_reports_a_bad_torch_model_clearly(models, tmp_path, capsys, spec, shape, message):
    argv = ["aot", "--torch-model", spec, "-o", str(tmp_path / "out")]
    if shape == "2,3,9":
        argv.append("--channels-last")
    with pytest.raises(SystemExit) as exit:
        cli.main(argv + (["--input-shape", shape] if shape else []))
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_without_torch_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from convgrad import cli\n"
            "cli.main(['aot', '--torch-model', 'm:f', '--input-shape', '1,3,4,4'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 2
    assert "--torch-model: convgrad.torch needs PyTorch" in done.stderr
    assert "pip install convgrad[torch]" in done.stderr
