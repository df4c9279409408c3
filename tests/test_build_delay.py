"""convgrad.background holds build requests until none came for CONVGRAD_BUILD_DELAY
seconds (a model's first pass is over), so the pass's steps keep the cores; wait()
(compile_kernels) starts them at once; builds with others waiting compile each kernel
whole. The builds here are stubs that note when they started: no compiler runs."""

from __future__ import annotations

import threading
import time

import pytest

from convgrad import background


class _Call:
    """What the pool asks of a request: its config, whether it tunes, the plan to build,
    load()."""

    tunes = False
    kernel = None
    failed = False

    def __init__(self, name: str, config: str | None = None) -> None:
        self.config = config or name
        self.started: float | None = None
        self.loaded = threading.Event()

    def build_plan(self) -> None:
        return None

    def load(self) -> None:
        self.kernel = object()
        self.loaded.set()


@pytest.fixture
def pool(monkeypatch):
    """A new pool whose builds note their start instead of compiling."""
    monkeypatch.setattr(background, "_pool", None)
    calls: dict[str, _Call] = {}

    def build(config, plan=None, busy: bool = False) -> None:
        for call in calls.values():
            if call.config == config and call.started is None:
                call.started = time.monotonic()

    monkeypatch.setattr(background, "_build_elsewhere", build)

    def make(name: str, config: str | None = None) -> _Call:
        calls[name] = _Call(name, config)
        return calls[name]
    return make


def test_builds_wait_for_a_quiet_spell(pool, monkeypatch):
    monkeypatch.setenv(background.DELAY_ENV, "2")
    first, second = pool("a"), pool("b")
    background.submit(first)
    time.sleep(1.5)
    submitted = time.monotonic()
    background.submit(second)  # the quiet spell starts again
    time.sleep(1.0)  # 2.5 s after the first request, 1 s after the last
    assert first.started is None and second.started is None
    assert background.pending() == 2
    assert first.loaded.wait(20) and second.loaded.wait(20)
    assert min(first.started, second.started) >= submitted + 2
    deadline = time.monotonic() + 10
    while background.pending():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_kernel_asked_for_again_does_not_hold_builds_longer(pool, monkeypatch):
    """A call of another shape asks again for a kernel already asked for: that is not
    a new kernel of the pass, so the start stays where the first request put it."""
    monkeypatch.setenv(background.DELAY_ENV, "2")
    first, again = pool("a", config="k"), pool("b", config="k")
    background.submit(first)
    begin = time.monotonic()
    time.sleep(1.0)
    background.submit(again)
    assert first.loaded.wait(20) and again.loaded.wait(20)
    assert first.started - begin < 2.9  # not 2 s after the second request


def test_a_later_pass_is_held_like_the_first(pool, monkeypatch):
    """A second pass (another model in the process, a new cache) asks again for kernels
    an earlier pass asked for: its first request is held for the delay, not started at
    once, and its new kernels hold it on as the first pass's did."""
    monkeypatch.setenv(background.DELAY_ENV, "1")
    earlier = pool("a", config="k")
    background.submit(earlier)
    assert earlier.loaded.wait(20)
    time.sleep(1.2)  # past the earlier hold's start time
    again, new = pool("b", config="k"), pool("c", config="m")
    begin = time.monotonic()
    background.submit(again)
    time.sleep(0.6)
    background.submit(new)  # a new kernel of this pass: the hold goes on
    time.sleep(0.6)  # 1.2 s after the first request, 0.6 s after the new one
    assert again.started is None and new.started is None
    assert again.loaded.wait(20) and new.loaded.wait(20)
    assert min(again.started, new.started) >= begin + 1.6


def test_new_requests_hold_builds_at_most_max_hold(pool, monkeypatch):
    monkeypatch.setenv(background.DELAY_ENV, "1")
    monkeypatch.setattr(background, "MAX_HOLD", 1.5)
    calls = [pool(f"c{i}") for i in range(12)]
    begin = time.monotonic()
    for call in calls:  # a new kernel every 0.25 s for 3 s: never a quiet second
        background.submit(call)
        time.sleep(0.25)
    assert calls[0].loaded.wait(20)
    assert calls[0].started - begin < 2.9


def test_wait_starts_held_builds_at_once(pool, monkeypatch):
    monkeypatch.setenv(background.DELAY_ENV, "30")
    call = pool("c")
    begin = time.monotonic()
    assert background.wait([call], timeout=10)
    assert call.kernel is not None and call.started - begin < 5


def test_no_delay_starts_each_build_at_once(pool, monkeypatch):
    monkeypatch.setenv(background.DELAY_ENV, "0")
    call = pool("d")
    begin = time.monotonic()
    background.submit(call)
    assert call.loaded.wait(10) and call.started - begin < 5


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_an_invalid_delay_is_an_error(monkeypatch, value):
    monkeypatch.setenv(background.DELAY_ENV, value)
    with pytest.raises(ValueError, match="CONVGRAD_BUILD_DELAY"):
        background.build_delay()


class _Worker:
    """A build worker process that answers ok and keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.stdin = self
        self.stdout = self

    def write(self, line: str) -> None:
        import json
        self.requests.append(json.loads(line))

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        return '{"ok": true}\n'


@pytest.mark.parametrize("asked", [None, "2"])
def test_busy_builds_compile_kernels_whole(monkeypatch, asked):
    """Two parts at once (CONVGRAD_BUILD_JOBS=2, the default on 2 cores) cost CPU time
    that builds filling the cores pay: those go as one compilation, unless asked."""
    worker = _Worker()
    monkeypatch.setattr(background, "_worker", lambda: worker)
    if asked is None:
        monkeypatch.delenv("CONVGRAD_BUILD_JOBS", raising=False)
    else:
        monkeypatch.setenv("CONVGRAD_BUILD_JOBS", asked)

    class Config:
        def to_dict(self):
            return {"name": "k"}

    background._build_elsewhere(Config(), busy=False)
    background._build_elsewhere(Config(), busy=True)
    jobs = [request["settings"]["CONVGRAD_BUILD_JOBS"] for request in worker.requests]
    assert jobs == ([None, "1"] if asked is None else ["2", "2"])
