"""convgrad.torch's C++ call path (convgrad.torch._native) against Python's.

The extension is built once into the test kernel cache (the first test that needs it
waits for it). With it on, a converted module's forward, its gradients, gradients of
gradients, the functional API, the raw ops and autocast give the very bits Python's path
gives (CONVGRAD_TORCH_NATIVE=off), and their kernels run from C++ (its own counter; the
Python spy on BoundCall.run sees none). A kernel not built yet is stood in for by
PyTorch's operator through Python's path; aot_kernels still notes every call; a missing
C++ compiler leaves Python's path with one warning; errors keep their messages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import convgrad.torch as cgt  # noqa: E402
from convgrad import background, bound  # noqa: E402
from convgrad.torch import _calls, _native  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")


@pytest.fixture
def native(monkeypatch):
    """The C++ path on (built first, once per test cache); yields its kernel-run counter."""
    monkeypatch.setenv(_native.ENV, "on")
    assert _native.build(), "the C++ call path did not build"
    return _native.kernel_runs


def python_path(monkeypatch):
    monkeypatch.setenv(_native.ENV, "off")


def on(monkeypatch):
    monkeypatch.setenv(_native.ENV, "on")


GEOMETRIES = {  # name -> (module factory, input shape)
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1), (2, 4, 9)),
    "conv2d_groups": (lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2,
                                        bias=False), (2, 4, 7, 6)),
    "conv2d_1x1": (lambda: nn.Conv2d(8, 8, 1), (1, 8, 4, 4)),
    "conv3d": (lambda: nn.Conv3d(3, 4, 2, stride=(1, 2, 1)), (1, 3, 4, 5, 3)),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1,
                                                    output_padding=1, groups=2), (2, 6, 4, 5)),
}


def step(model, x, dtype, create_graph=False):
    """Output, input gradient and every parameter gradient of one step (and with
    create_graph, of a second step through the first's gradients)."""
    x = x.clone().to(dtype).requires_grad_()
    y = model(x)
    loss = (y.float() ** 2).sum()
    grads = torch.autograd.grad(loss, [x, *model.parameters()], create_graph=create_graph)
    if create_graph:
        again = sum((g.float() ** 2).sum() for g in grads)
        grads = grads + torch.autograd.grad(again, [x, *model.parameters()])
    return [y.detach(), *[g.detach() for g in grads]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCX", "NXC"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_cxx_path_gives_python_paths_bits(native, monkeypatch, name, channels_last, dtype):
    make, shape = GEOMETRIES[name]
    torch.manual_seed(0)
    model = make().to(dtype)
    cgt.convert(model)
    x = torch.randn(shape)
    if channels_last and len(shape) in (4, 5):
        x = x.to(memory_format=torch.channels_last if len(shape) == 4
                 else torch.channels_last_3d)
    python_path(monkeypatch)
    expected = step(model, x, dtype)
    on(monkeypatch)
    before = native()
    step(model, x, dtype)  # learns the calls
    got = step(model, x, dtype)
    assert native() - before >= 6, "the kernels did not run from C++"
    for e, g in zip(expected, got, strict=True):
        assert e.dtype == g.dtype and e.stride() == g.stride()
        assert torch.equal(e, g)


def test_cxx_path_runs_every_kernel_of_a_step_and_python_runs_none(native, kernel_calls):
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    cgt.convert(model)
    x = torch.randn(2, 3, 6, 6)
    step(model, x, torch.float32)  # resolves each call once, through Python
    kernel_calls.clear()
    before = native()
    step(model, x, torch.float32)
    # two layers: forward, data and weight gradients each (the first layer's input
    # needs a gradient in step())
    assert native() - before == 6
    assert kernel_calls == []
    assert type(model(x.requires_grad_()).grad_fn).__name__ == "CppFunction"


def test_gradients_of_gradients_match_python_path(native, monkeypatch):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(),
                          nn.ConvTranspose2d(4, 2, 2, stride=2))
    cgt.convert(model)
    x = torch.randn(1, 3, 5, 5)
    python_path(monkeypatch)
    expected = step(model, x, torch.float32, create_graph=True)
    on(monkeypatch)
    got = step(model, x, torch.float32, create_graph=True)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_autocast_through_cxx_path_matches_python_path(native, monkeypatch, dtype):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 2, 1))
    cgt.convert(model)
    x = torch.randn(2, 4, 6, 6)

    def autocast_step():
        with torch.autocast("cpu", dtype=dtype):
            return step(model, x, torch.float32)

    python_path(monkeypatch)
    expected = autocast_step()
    on(monkeypatch)
    before = native()
    got = autocast_step()
    assert native() > before
    assert got[0].dtype == dtype and got[2].dtype == torch.float32
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_raw_ops_and_functional_api_match_python_path(native, monkeypatch):
    torch.manual_seed(3)
    dy = torch.randn(2, 6, 5, 5)
    w = torch.randn(6, 4, 3, 3)
    src = torch.randn(2, 4, 5, 5)

    def calls():
        return [cgt.convolution_backward_data(dy, w, [5, 5], pads_begin=1, pads_end=1),
                cgt.convolution_backward_weights(src, dy, [3, 3], pads_begin=1, pads_end=1),
                cgt.conv_transpose_backward_data(src, w, pads_begin=1, pads_end=1),
                cgt.functional.conv2d(src, w, padding=1)]

    python_path(monkeypatch)
    expected = calls()
    on(monkeypatch)
    before = native()
    got = calls()
    assert native() - before == 4
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_errors_keep_their_messages(native):
    conv = nn.Conv2d(4, 6, 3)
    cgt.convert(conv)
    conv(torch.randn(1, 4, 5, 5))  # known configuration
    with pytest.raises(ValueError, match="channels"):
        conv(torch.randn(1, 5, 5, 5))
    with pytest.raises(TypeError, match="dtype"):
        conv(torch.randn(1, 4, 5, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="layout"):
        conv(torch.randn(1, 4, 5, 5).to_sparse())
    conv.bias = nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match="bias has 5 values"):
        conv(torch.randn(1, 4, 5, 5))


def test_kernels_not_built_yet_run_on_pytorchs_operator(native, fresh_cache, monkeypatch):
    """A new kernel cache in background mode: the C++ path hands the calls to Python's
    stand-in while the kernels build, then runs them itself. The build request is held
    until the first call returned (a build that finished first would leave nothing to
    stand in for), on a geometry no other test uses."""
    monkeypatch.setenv("CONVGRAD_COMPILE", "background")
    monkeypatch.setenv("CONVGRAD_BUILD_DELAY", "0")
    assert _native.build()  # loaded already: the new cache has kernels only
    asked = []
    submit = background.submit
    monkeypatch.setattr(background, "submit", asked.append)
    conv = nn.Conv2d(3, 7, 3, padding=1)
    reference = nn.Conv2d(3, 7, 3, padding=1)
    reference.load_state_dict(conv.state_dict())
    cgt.convert(conv)
    x = torch.randn(1, 3, 7, 5)
    served = _calls.standin_calls
    torch.testing.assert_close(conv(x), reference(x))
    assert _calls.standin_calls == served + 1 and len(asked) == 1
    submit(asked[0])
    started = time.monotonic()
    while background.pending() and time.monotonic() - started < 300:
        time.sleep(0.1)
    before = native()
    torch.testing.assert_close(conv(x), reference(x))
    assert native() == before + 1


def test_aot_kernels_still_notes_every_call(native, tmp_path, monkeypatch):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1))
    cgt.convert(model)
    x = torch.randn(1, 3, 6, 6)
    step(model, x, torch.float32)  # every call known to the C++ path
    from convgrad.torch.warmup import step_calls

    with_native = step_calls(model, (x.requires_grad_(),), {}, build=False)
    python_path(monkeypatch)
    without = step_calls(model, (x,), {}, build=False)
    assert len(with_native) == len(without) == 6


def test_missing_compiler_leaves_python_path_with_one_warning(fresh_cache, monkeypatch):
    monkeypatch.setenv(_native.ENV, "on")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    for name, value in (("_module", None), ("_failed", False), ("_builder", None)):
        monkeypatch.setattr(_native, name, value)
    monkeypatch.setattr(_native, "_sites", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not _native.build()
        assert not _native.build()
        conv = nn.Conv2d(2, 3, 1)
        reference = nn.Conv2d(2, 3, 1)
        reference.load_state_dict(conv.state_dict())
        cgt.convert(conv)
        x = torch.randn(1, 2, 3, 3)
        torch.testing.assert_close(conv(x), reference(x))
    messages = [str(w.message) for w in caught if "C++ call path" in str(w.message)]
    assert len(messages) == 1 and "not found" in messages[0]
    bound.reset()


def test_compiled_module_traces_the_registered_ops_which_run_from_cxx(native):
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
    cgt.convert(model)
    x = torch.randn(1, 3, 5, 5)
    eager = model(x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    before = native()  # the registered op's CPU kernel runs from C++ too
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    assert native() == before + 1


def test_opcheck_passes_for_every_op_on_the_cxx_path(native):
    """torch.library.opcheck (schema, fake, autograd registration, aot_dispatch) with the
    registered ops' CPU kernel on the C++ path, which must run there."""
    torch.manual_seed(4)
    dy, w, src = torch.randn(1, 6, 4, 4), torch.randn(6, 4, 3, 3), torch.randn(1, 4, 4, 4)
    common = ([1, 1], [1, 1], [1, 1], [1, 1], 1)
    cases = {
        "convolution_backward_data": (dy, w, [4, 4], *common, [0, 0]),
        "convolution_backprop_data": (dy, w, [4, 4], *common, [0, 0]),
        "convolution_backward_weights": (src, dy, [3, 3], *common),
        "convolution_backprop_filters": (src, dy, [3, 3], *common),
        "conv_transpose_backward_data": (src, w, *common),
        "conv_transpose_backward_weights": (dy, src, [3, 3], *common),
    }
    assert set(cases) == set(cgt.OPS)
    before = native()
    for name, (a, b, *attrs) in cases.items():
        torch.library.opcheck(cgt.OPS[name], (a.clone().requires_grad_(),
                                              b.clone().requires_grad_(), *attrs))
    assert native() > before


SANITIZED = textwrap.dedent("""
    import torch
    from torch import nn
    import convgrad.torch as cgt
    from convgrad.torch import _native
    assert _native.build(), "the C++ call path did not build"
    for channels_last in (True,):  # as models train (both layouts: the tests above)
        ref = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, groups=2), nn.ReLU(),
                            nn.Conv2d(6, 3, 1))
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randint(-2, 3, p.shape))
        ours = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, groups=2), nn.ReLU(),
                             nn.Conv2d(6, 3, 1))
        ours.load_state_dict(ref.state_dict())
        cgt.convert(ours)
        x = torch.randint(-2, 3, (2, 4, 5, 5)).float()
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        for _ in range(2):  # the second step on the calls the C++ path keeps
            xs = [x.clone().requires_grad_() for _ in range(2)]
            outs = [m(v) for m, v in zip((ours, ref), xs)]
            for out in outs:
                (out * out).sum().backward()
            assert torch.equal(outs[0], outs[1]) and torch.equal(xs[0].grad, xs[1].grad)
            for a, b in zip(ours.parameters(), ref.parameters()):
                assert torch.equal(a.grad, b.grad)
                a.grad = b.grad = None
    assert _native.kernel_runs() >= 10, _native.kernel_runs()
    print("ok")
""")


def test_cxx_path_and_kernels_clean_under_sanitizers(tmp_path):
    """The extension and the kernels built with AddressSanitizer and UBSan
    (CONVGRAD_SANITIZE=1) run training steps on integer data, equal to torch.nn's: any
    bad access aborts the child."""
    from test_sanitizers import ASAN, UBSAN, sanitized_env

    if ASAN is None or UBSAN is None:
        pytest.skip("the C compiler has no AddressSanitizer or UBSan runtime")
    env = sanitized_env(tmp_path / "cache", CONVGRAD_COMPILE="block", **{_native.ENV: "on"})
    result = subprocess.run([sys.executable, "-c", SANITIZED], capture_output=True,
                            text=True, env=env, timeout=900, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    assert list((tmp_path / "cache" / _native.FOLDER).glob("*.so"))  # the sanitized build
