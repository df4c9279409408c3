"""The tools that time a converted model's steps in a new process (benchmarks.first_steps,
benchmarks.in_model) run end to end on a tiny ResNet-18, each in a process of its own as
they are meant to run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
TINY = ["resnet18", "--batch", "1", "--size", "16", "--width", "4", "--blocks", "1"]


def run(module: str, *args: str) -> list[str]:
    """The lines a benchmark module printed, run as `python -m` from the repository root
    with the tests' settings (their kernel cache among them)."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_first_steps_of_the_converted_model_and_of_torch_nn():
    """compile_kernels first, then three steps and their summary; torch.nn's steps alone."""
    lines = run("benchmarks.first_steps", *TINY, "--threads", "1", "--steps", "3",
                "--compile-kernels", "--block", "--cache", "new")
    assert lines[0].startswith("compile_kernels: ") and " kernels in " in lines[0]
    assert [line.split()[:3] for line in lines[1:4]] == [["ours", "step", str(i)]
                                                         for i in range(3)]
    words = lines[4].split()
    assert words[:3] == ["resnet18", "ours", "1T"] and float(words[words.index("warm") + 1]) > 0
    lines = run("benchmarks.first_steps", *TINY, "--which", "torch", "--threads", "1",
                "--steps", "3")
    assert lines[-1].split()[:3] == ["resnet18", "torch", "1T"] and len(lines) == 4


def test_first_steps_refuses_convgrad_options_for_torch_nn():
    done = subprocess.run([sys.executable, "-m", "benchmarks.first_steps", "resnet18",
                           "--which", "torch", "--block"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 2 and "--which ours" in done.stderr


def test_in_model_splits_a_step_into_kernels_and_the_python_around_them():
    lines = run("benchmarks.in_model", "resnet18", "1", "2", *TINY[1:])
    assert lines[0].startswith("resnet18, 1 thread(s): convgrad step ")
    kernels_ms = float(lines[1].split()[1])
    around_ms = float(lines[1].split()[-2])
    assert kernels_ms > 0 and around_ms > 0  # the Python path ran, both were timed
    kinds = {tuple(line.split()[:2]) for line in lines[2:] if not line.startswith("torch")
             and not line.startswith("    aten")}
    assert ("ConvolutionBackwardWeights", "kxk") in kinds
    assert any(line.startswith("torch.nn step ") for line in lines)
    assert any("aten::convolution_backward" in line for line in lines)
