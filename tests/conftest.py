"""Test setup: a kernel cache the tests own, and no ahead-of-time kernels unless a
test asks for them."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("CONVGRAD_CACHE_DIR", str(ROOT / ".pytest_cache" / "convgrad-kernels"))
os.environ["CONVGRAD_AOT_PATH"] = ""


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CONVGRAD_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="heavy sweep: set CONVGRAD_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache of the test's own, and no kernel loaded in this process."""
    from convgrad import kernels

    monkeypatch.setenv("CONVGRAD_CACHE_DIR", str(tmp_path / "cache"))
    kernels.reset()
    yield tmp_path / "cache"
    kernels.reset()
