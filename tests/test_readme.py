"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest


def test_readme_python_example_runs():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["diff_src"].shape == (8, 56, 56, 32)
    assert namespace["diff_weights"].shape == (3, 3, 32, 64)


def test_readme_pytorch_example_runs(capsys):
    pytest.importorskip("torch")
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("## PyTorch: `convgrad.torch`", 1)[1]
    example = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "3 module(s) converted, 0 left alone" in printed
    assert "torch.Size([4, 8, 32, 32]) True" in printed
    assert namespace["dx"].shape == (4, 16, 32, 32)
    assert namespace["dw"].shape == (32, 4, 3, 3)
    assert all(p.grad is not None for p in namespace["model"].parameters())
