"""Test setup: a kernel cache the tests own, no ahead-of-time kernels unless a test
asks for them, and kernels compiled in one part unless a test asks for two."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("CONVGRAD_CACHE_DIR", str(ROOT / ".pytest_cache" / "convgrad-kernels"))
os.environ["CONVGRAD_AOT_PATH"] = ""
# Two test workers keep both cores compiling: a kernel compiled in two parts at once
# would only add CPU time. test_cache.py builds kernels in two parts.
os.environ.setdefault("CONVGRAD_BUILD_JOBS", "1")
# convgrad.torch's calls wait for their kernels (tests that check which kernel ran);
# tests/test_torch_background.py sets background compilation itself.
os.environ.setdefault("CONVGRAD_COMPILE", "block")
# convgrad.torch's C++ call path serves tests/test_torch_native.py's calls; the others take
# Python's path, whose kernel calls they spy on (the extension builds once, there).
os.environ.setdefault("CONVGRAD_TORCH_NATIVE", "off")


def pytest_collection_modifyitems(config, items):
    """Heavy sweeps (marked slow) are deselected, not skipped, unless CONVGRAD_SLOW_TESTS=1:
    the default run reports them apart from tests that could not run. The sanitizer
    tests (1-2 minutes each: test_sanitizers.py and the front ends' tests named
    "...under_sanitizers") go first, so that test workers fill the time around them
    instead of running them alone at the end."""
    items.sort(key=lambda item: item.path.name != "test_sanitizers.py"
               and "under_sanitizers" not in item.name)  # stable
    if os.environ.get("CONVGRAD_SLOW_TESTS") == "1":
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


def pytest_report_header(config):
    if os.environ.get("CONVGRAD_SLOW_TESTS") != "1":
        return "heavy sweeps (marked slow) deselected: set CONVGRAD_SLOW_TESTS=1 to run them"
    return None


@pytest.fixture(autouse=True)
def _environment_reread_after_each_test():
    """convgrad reads CONVGRAD_ISA and CONVGRAD_TUNE once (convgrad.bound.settings_key):
    after each test (and after monkeypatch restored them, which this fixture, set up
    first, follows) the next call reads them again. A compile mode set in-process
    (examples/torch_digits.py sets "block") is dropped too."""
    yield
    from convgrad import background, bound

    bound.reset()
    background.set_mode(None)  # a test (or an example run in-process) may have set one


@pytest.fixture(autouse=True)
def _environment_reread_when_set(_environment_reread_after_each_test, monkeypatch):
    """A test's monkeypatch.setenv/delenv of any variable takes effect at once."""
    from convgrad import bound

    setenv, delenv = monkeypatch.setenv, monkeypatch.delenv

    def set_and_reread(name, value, prepend=None):
        setenv(name, value, prepend)
        bound.reset()

    def delete_and_reread(name, raising=True):
        delenv(name, raising)
        bound.reset()

    monkeypatch.setenv, monkeypatch.delenv = set_and_reread, delete_and_reread


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache of the test's own, and no kernel loaded in this process."""
    from convgrad import kernels

    monkeypatch.setenv("CONVGRAD_CACHE_DIR", str(tmp_path / "cache"))
    kernels.reset()
    yield tmp_path / "cache"
    kernels.reset()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every kernel call from now on, from either front end, as (op kind, [first, second]
    input addresses in the op's order, result address, data layout)."""
    from convgrad import bound
    from convgrad.kernels import ffi

    calls = []
    run = bound.BoundCall.run

    def address(pointer) -> int:
        return int(ffi.cast("uintptr_t", pointer))

    def spy(self, first, second, out):
        calls.append((self.problem.op.kind, [address(first), address(second)], address(out),
                      self.problem.config.data_format))
        return run(self, first, second, out)

    monkeypatch.setattr(bound.BoundCall, "run", spy)
    return calls
