"""convgrad.torch's background compilation (convgrad.background): PyTorch's own operator
serves a call whose kernel is not built yet while the kernel compiles in the
background; later calls switch to it; results are exact on integer data whichever
served them; a failing compiler leaves the stand-in and one warning; a fork during a
build does not hang; compile_kernels builds exactly what a step then runs."""

from __future__ import annotations

import os
import stat
import time
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import convgrad.torch as cgt  # noqa: E402
from convgrad import background, cache  # noqa: E402
from convgrad.torch import _calls  # noqa: E402

# A compiler that takes 4 s more for each compilation (not for --version, which the
# cache's key asks once a process).
SLOW_CC = '#!/bin/sh\ncase "$1" in --version) exec cc "$@";; esac\nsleep 4\nexec cc "$@"\n'


def _script(path, text: str):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def background_mode(fresh_cache, monkeypatch):
    """A new kernel cache and background compilation, whatever the environment says;
    builds start at once (test_build_delay holds them)."""
    monkeypatch.setenv("CONVGRAD_COMPILE", "background")
    monkeypatch.setenv(background.DELAY_ENV, "0")
    background.set_mode(None)
    yield fresh_cache
    background.set_mode(None)


def _ints(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=generator).float()


def _pair(cin=4, cout=6, kernel=3, **kwargs):
    """A torch.nn convolution with integer weights and its converted copy."""
    reference = nn.Conv2d(cin, cout, kernel, bias=False, **kwargs)
    with torch.no_grad():
        reference.weight.copy_(_ints(*reference.weight.shape, seed=1))
    converted = nn.Conv2d(cin, cout, kernel, bias=False, **kwargs)
    converted.load_state_dict(reference.state_dict())
    cgt.convert(converted)
    return reference, converted


def _settle(timeout=120.0):
    deadline = time.monotonic() + timeout
    while background.pending():
        assert time.monotonic() < deadline, "background builds did not finish"
        time.sleep(0.05)


def test_the_stand_in_serves_while_the_build_runs_then_the_kernel(
        background_mode, monkeypatch, tmp_path, kernel_calls):
    slow = _script(tmp_path / "slow-cc", SLOW_CC)
    monkeypatch.setenv("CC", str(slow))
    reference, converted = _pair(padding=1)
    x = _ints(2, 4, 7, 6, seed=2)
    served = _calls.standin_calls
    begin = time.perf_counter()
    y = converted(x)
    assert time.perf_counter() - begin < 3.0  # the call did not wait for the compiler
    assert _calls.standin_calls == served + 1 and kernel_calls == []
    assert background.pending() == 1
    assert torch.equal(y, reference(x))
    _settle()
    y = converted(x)
    assert [call[0] for call in kernel_calls] == ["ConvTransposeBackwardData"]
    assert _calls.standin_calls == served + 1
    assert torch.equal(y, reference(x))


def test_a_background_build_takes_the_plan_of_the_call(background_mode, kernel_calls):
    """The worker builds the plan the call asked for: a one-pixel problem's kernel has
    the short tiles of small_problem_plan (bound.BoundCall.build_plan)."""
    from convgrad.codegen.variants import SMALL_PROBLEM_TILE_ROWS

    reference, converted = _pair(64, 48, kernel=1)
    x = _ints(8, 64, 1, 1, seed=4).contiguous(memory_format=torch.channels_last)
    _calls._calls.clear()
    assert torch.equal(converted(x), reference(x))  # the stand-in
    _settle()
    assert torch.equal(converted(x), reference(x)) and len(kernel_calls) == 1
    [call] = _calls._calls.values()
    assert call.bound.kernel.plan["tile_rows"] == SMALL_PROBLEM_TILE_ROWS


def test_block_mode_waits_for_the_kernel(background_mode, kernel_calls):
    cgt.set_compile_mode("block")
    reference, converted = _pair()
    x = _ints(2, 4, 6, 6, seed=3)
    served = _calls.standin_calls
    assert torch.equal(converted(x), reference(x))
    assert [call[0] for call in kernel_calls] == ["ConvTransposeBackwardData"]
    assert _calls.standin_calls == served
    with pytest.raises(ValueError, match="compile mode"):
        cgt.set_compile_mode("later")


def test_a_failing_compiler_leaves_the_stand_in_and_one_warning(
        background_mode, monkeypatch, tmp_path):
    broken = _script(tmp_path / "broken-cc", '#!/bin/sh\ncase "$1" in --version) '
                     'echo broken-cc 1.0;; *) echo "error: no" >&2; exit 1;; esac\n')
    monkeypatch.setenv("CC", str(broken))
    reference, converted = _pair(cout=5, stride=2)
    x = _ints(2, 4, 9, 8, seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert torch.equal(converted(x), reference(x))
            _settle()
    ours = [w for w in caught if "in the background failed" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
    assert any("error: no" in why or "CompileError" in why
               for why in background.failures.values())


def test_a_fork_during_a_build_does_not_hang(background_mode, monkeypatch, tmp_path):
    slow = _script(tmp_path / "slow-cc", SLOW_CC)
    monkeypatch.setenv("CC", str(slow))
    reference, converted = _pair(cout=3)
    x = _ints(1, 4, 5, 5, seed=5)
    want = reference(x)
    assert torch.equal(converted(x), want)  # a build is now running
    assert background.pending() == 1
    pid = os.fork()
    if pid == 0:  # the child: its own stand-in and builds; exits without waiting
        try:
            # as torch's DataLoader workers do: PyTorch's own OpenMP pool (which the
            # stand-in runs on) hangs in a child forked after it ran on 2 threads
            torch.set_num_threads(1)
            status = 0 if torch.equal(converted(x), want) else 3
        except BaseException:
            status = 4
        os._exit(status)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() < deadline, "the forked child hung"
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    _settle()
    assert torch.equal(converted(x), want)


def test_compile_kernels_builds_what_a_step_runs(background_mode, monkeypatch, kernel_calls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.Flatten(),
                          nn.LazyLinear(4))
    model(torch.randn(2, 3, 9, 9))  # initialise the lazy layer
    cgt.convert(model)
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 9, 9).contiguous(memory_format=torch.channels_last)
    weights = [p.detach().clone() for p in model.parameters()]
    stats = model[1].running_mean.clone()
    built = cgt.compile_kernels(model, x, progress=False)
    # conv1: forward, weight gradient (x needs none); conv2: forward, data, weights
    assert built == 5 and background.pending() == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert torch.equal(model[1].running_mean, stats) and model[0].weight.grad is None
    builds = []
    monkeypatch.setattr(cache, "build", lambda *a, **k: builds.append(a) or None)
    served = _calls.standin_calls
    model(x).sum().backward()
    assert builds == [] and _calls.standin_calls == served
    assert sorted(call[0] for call in kernel_calls) == sorted(
        ["ConvTransposeBackwardData"] * 2 + ["ConvolutionBackwardData"]
        + ["ConvolutionBackwardWeights"] * 2)
    assert cgt.compile_kernels(model, x, progress=False) == 0  # all loaded now


def test_a_build_worker_whose_caller_is_gone_exits_quietly(tmp_path):
    """A worker that answers after its caller closed the pipe (the caller exiting while a
    build ends) exits with status 0 and no traceback."""
    import json
    import subprocess
    import sys

    worker = subprocess.Popen([sys.executable, "-m", "convgrad.build_worker"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, "CC": "false"})
    worker.stdout.close()  # the caller is gone before the answer
    request = {"config": {"family": "no such family"}, "settings": {}}
    _, errors = worker.communicate(json.dumps(request).encode() + b"\n", timeout=60)
    assert worker.returncode == 0 and errors == b"", errors.decode()



def test_an_invalid_build_delay_is_an_error_on_every_call(background_mode, monkeypatch):
    """A bad CONVGRAD_BUILD_DELAY raises where the kernel is asked for, each time: it
    never leaves the call on the stand-in with its kernel never requested."""
    monkeypatch.setenv(background.DELAY_ENV, "soon")
    _, converted = _pair(cout=2)
    x = _ints(1, 4, 5, 5, seed=6)
    for _ in range(2):
        with pytest.raises(ValueError, match="CONVGRAD_BUILD_DELAY='soon' is invalid"):
            converted(x)
    assert background.pending() == 0
