"""convgrad.jax: the six ops against the reference, conv_general_dilated and
conv_transpose against lax, the transformations, the fallbacks and the FFI's errors.

Data are small integers, so every sum is exact: results are compared bit for bit (with
the reference, and with lax's convolution at HIGHEST precision, whose sums are exact
too). Every test that expects a kernel checks the jaxpr holds convgrad's primitive, and
every fallback that it does not.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from cases import make_case, rotating  # noqa: E402
from jax import lax  # noqa: E402

import convgrad.jax as cj  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("ConvolutionBackpropData", "ConvolutionBackwardData", "ConvolutionBackpropFilters",
       "ConvolutionBackwardWeights", "ConvTransposeBackwardData",
       "ConvTransposeBackwardWeights")
FUNCTIONS = {op: getattr(cj, name) for op, name in zip(OPS, (
    "convolution_backprop_data", "convolution_backward_data", "convolution_backprop_filters",
    "convolution_backward_weights", "conv_transpose_backward_data",
    "conv_transpose_backward_weights"), strict=True)}


def primitives(fn, *args) -> list[str]:
    """Names of convgrad's primitives in the jaxpr of fn(*args), sub-jaxprs included."""
    return [eqn.primitive.name for eqn in cj._equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if eqn.primitive.name.startswith("convgrad_")]


def ints(rng, shape, dtype=np.float32, low=-3, high=3):
    return jnp.asarray(rng.integers(low, high + 1, size=shape).astype(np.float32)
                       .astype(dtype))


# --- the six ops --------------------------------------------------------------------

SIX = [(op, fmt, rank) for rank in (1, 2, 3) for op in OPS for fmt in ("NXC", "NCX")]


@pytest.mark.parametrize("op,data_format,rank",
                         [c for i, c in enumerate(SIX) if c[2] == 2 or i % 4 == 0])
def test_op_matches_reference(op, data_format, rank):
    spatial, kernel = {1: ((9,), (3,)), 2: ((7, 6), (3, 2)), 3: ((5, 6, 5), (2, 3, 2))}[rank]
    attrs = {"strides": 2, "pads_begin": 1, "pads_end": 0} if rank != 3 else {"dilations": 2}
    case = make_case(op, spatial=spatial, kernel=kernel, data_format=data_format,
                     attrs=attrs, groups=2 if rank == 2 else 1)
    function = FUNCTIONS[op]
    keys = {k: v for k, v in case.attrs.items()}
    got = jax.jit(lambda a, b: function(a, b, **keys))(*case.inputs[:2])
    assert primitives(lambda a, b: function(a, b, **keys), *case.inputs[:2])
    np.testing.assert_array_equal(np.asarray(got), case.expected(np.float32))


def test_a_call_traced_under_another_openmp_default_runs_in_its_workspace():
    """A function traced while the tracing thread's OpenMP default is 1 (as after
    torch.set_num_threads(1)) runs its kernel on XLA's thread, whose default is every
    core, on the count its workspace was sized for (it took XLA's thread's default,
    wrote past a one-thread workspace, and the digits example's curve went flat)."""
    import ctypes

    from convgrad import threads
    if threads.get_num_threads() < 2:
        pytest.skip("needs two usable cores")
    gomp = ctypes.CDLL("libgomp.so.1")
    case = make_case("ConvolutionBackwardWeights", spatial=(40, 38), kernel=(3, 3),
                     in_channels=64, out_channels=64, batch=4, data_format="NCX",
                     attrs=dict(pads_begin=1, pads_end=1))
    keys = dict(case.attrs)
    function = jax.jit(lambda a, b: cj.convolution_backward_weights(a, b, **keys))
    before = gomp.omp_get_max_threads()
    gomp.omp_set_num_threads(1)
    try:
        compiled = function.lower(*case.inputs[:2]).compile()
    finally:
        gomp.omp_set_num_threads(before)
    np.testing.assert_array_equal(np.asarray(compiled(*case.inputs[:2])),
                                  case.expected(np.float32))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("op", rotating(list(OPS), 1, 2))
def test_op_low_precision(op, dtype):
    case = make_case(op, spatial=(6, 6), kernel=(3, 3), dtype=dtype,
                     attrs={"auto_pad": "same_upper"} if op != OPS[0] else {})
    got = jax.jit(lambda a, b: FUNCTIONS[op](a, b, **case.attrs))(*case.inputs[:2])
    expected = case.expected({"f16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype])
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32),
                                  expected.astype(np.float32))


def test_op_shape_input_and_errors():
    case = make_case("ConvolutionBackwardData", spatial=(5, 5), kernel=(3, 3),
                     attrs={"strides": 2, "pads_begin": 1, "pads_end": 1}, shape_mode="input")
    a, b, shape = case.inputs
    attrs = {k: v for k, v in case.attrs.items() if k != "dst_shape"}
    got = cj.convolution_backward_data(a, b, shape, **attrs)
    np.testing.assert_array_equal(np.asarray(got), case.expected(np.float32))
    with pytest.raises(ValueError, match="strides"):
        cj.convolution_backward_data(a, b, strides=0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        cj.convolution_backward_data(a, b, stride=2)
    with pytest.raises(TypeError, match="float32, float16, bfloat16"):
        cj.convolution_backward_data(a.astype(jnp.int32), b.astype(jnp.int32))


# --- conv_general_dilated and conv_transpose against lax --------------------------------

# (lhs shape, rhs shape, strides, padding, lhs dilation, rhs dilation, dimension numbers,
#  feature groups): every padding form, strides, both dilations, groups, depthwise, and
#  dimension numbers as strings, as ConvDimensionNumbers and a layout no kernel reads
LAX_CASES = {
    "same": ((2, 9, 9, 4), (3, 3, 4, 6), (1, 1), "SAME", None, None,
             ("NHWC", "HWIO", "NHWC"), 1),
    "valid_stride2_nchw": ((2, 4, 9, 8), (6, 4, 3, 3), (2, 2), "VALID", None, None,
                           ("NCHW", "OIHW", "NCHW"), 1),
    "pairs_dilated_groups": ((2, 8, 8, 6), (3, 3, 3, 4), (1, 2), [(2, 1), (0, 2)], None,
                             (2, 1), ("NHWC", "HWIO", "NHWC"), 2),
    "depthwise": ((2, 8, 8, 4), (3, 3, 1, 4), (2, 2), "SAME", None, None,
                  ("NHWC", "HWIO", "NHWC"), 4),
    "transposed": ((2, 5, 5, 4), (3, 3, 4, 6), (1, 1), [(2, 1), (1, 2)], (2, 2), None,
                   ("NHWC", "HWIO", "NHWC"), 1),
    "transposed_groups_nchw": ((2, 4, 5, 4), (6, 2, 2, 3), (1, 1), [(1, 1), (2, 2)], (2, 3),
                               None, ("NCHW", "OIHW", "NCHW"), 2),
    "odd_layouts": ((2, 7, 4, 6), (4, 3, 2, 5), (1, 1), "SAME_LOWER", None, None,
                    ("NWCH", "IHWO", "NHCW"), 1),
    "conv1d_ohwi": ((2, 11, 4), (6, 3, 4), (3,), [(1, 1)], None, (2,), ("NWC", "OWI", "NWC"),
                    1),
}


def _lax_call(name, conv=lax.conv_general_dilated, **extra):
    lhs, rhs, strides, padding, lhs_dil, rhs_dil, dn, groups = LAX_CASES[name]
    return (lambda x, w: conv(x, w, strides, padding, lhs_dil, rhs_dil, dn, groups, **extra),
            lhs, rhs)


def _loss_grads(fn, x, w, ct):
    out, vjp = jax.vjp(fn, x, w)
    return (out, *vjp(ct))


@pytest.mark.parametrize("name", list(LAX_CASES))
def test_conv_general_dilated_matches_lax(name):
    rng = np.random.default_rng(1)
    ours, lhs, rhs = _lax_call(name, cj.conv_general_dilated)
    theirs, _, _ = _lax_call(name, precision=lax.Precision.HIGHEST)
    x, w = ints(rng, lhs), ints(rng, rhs)
    ct = ints(rng, jax.eval_shape(theirs, x, w).shape)
    assert "convgrad" in cj.explain(x, w, *LAX_CASES[name][2:])
    names = primitives(lambda x, w, ct: _loss_grads(ours, x, w, ct), x, w, ct)
    assert len(names) == 3  # the forward op and its two gradients, nothing else
    got = jax.jit(lambda x, w, ct: _loss_grads(ours, x, w, ct))(x, w, ct)
    expected = _loss_grads(theirs, x, w, ct)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_conv_general_dilated_dimension_number_objects_and_bf16():
    rng = np.random.default_rng(2)
    x = ints(rng, (2, 8, 8, 4), jnp.bfloat16)
    w = ints(rng, (3, 3, 4, 8), jnp.bfloat16)
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
    expected = lax.conv_general_dilated(x.astype(jnp.float32), w.astype(jnp.float32), (1, 1),
                                        "SAME", dimension_numbers=dn)
    got = jax.jit(lambda x, w: cj.conv_general_dilated(x, w, (1, 1), "SAME",
                                                       dimension_numbers=dn))(x, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(expected.astype(jnp.bfloat16), np.float32))
    # preferred_element_type float32: the float32 kernel on the (exactly) widened inputs
    wide = cj.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn,
                                   preferred_element_type=jnp.float32)
    assert wide.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(expected))


@pytest.mark.parametrize("padding", ["SAME", "VALID", ((1, 1), (0, 1))])
@pytest.mark.parametrize("transpose_kernel", [False, True])
def test_conv_transpose_matches_lax(padding, transpose_kernel):
    rng = np.random.default_rng(3)
    x, w = ints(rng, (2, 5, 5, 4)), ints(rng, (3, 3, 4, 6))
    if transpose_kernel:
        w = ints(rng, (3, 3, 6, 4))
    consistent = not isinstance(padding, str)
    args = dict(strides=(2, 2), padding=padding, transpose_kernel=transpose_kernel,
                use_consistent_padding=consistent)
    got = jax.jit(lambda x, w: cj.conv_transpose(x, w, **args))(x, w)
    expected = lax.conv_transpose(x, w, precision=lax.Precision.HIGHEST, **args)
    assert primitives(lambda x, w: cj.conv_transpose(x, w, **args), x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


# --- transformations -----------------------------------------------------------------

def _same(x, w):
    return cj.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=LAX_CASES["same"][6])


def _same_lax(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=LAX_CASES["same"][6],
                                    precision=lax.Precision.HIGHEST)


def test_grad_of_grad_and_checkpoint():
    rng = np.random.default_rng(4)
    x, w = ints(rng, (2, 9, 9, 4)), ints(rng, (3, 3, 4, 6))

    def second_order(conv):
        def inner(x, w):
            gx = jax.grad(lambda x: (conv(x, w) ** 2).sum())(x)
            return (gx * gx).sum()
        return jax.grad(inner, argnums=(0, 1))

    for got, expected in zip(jax.jit(second_order(_same))(x, w), second_order(_same_lax)(x, w),
                             strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    checkpointed = jax.grad(lambda x, w: (jax.checkpoint(_same)(x, w) ** 2).sum(), (0, 1))
    for got, expected in zip(jax.jit(checkpointed)(x, w),
                             jax.grad(lambda x, w: (_same_lax(x, w) ** 2).sum(), (0, 1))(x, w),
                             strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_vmap_folds_the_mapped_axis_into_the_batch():
    rng = np.random.default_rng(5)
    xs, w = ints(rng, (3, 2, 9, 9, 4)), ints(rng, (3, 3, 4, 6))
    for axis in (0, 1):
        mapped = jax.vmap(_same, in_axes=(axis, None))
        jaxpr = jax.make_jaxpr(mapped)(xs, w)
        (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name.startswith("convgrad_")]
        assert eqn.invars[0].aval.shape == (6, 9, 9, 4)  # one call for the whole map
        np.testing.assert_array_equal(np.asarray(jax.jit(mapped)(xs, w)),
                                      np.asarray(jax.vmap(_same_lax, in_axes=(axis, None))(xs, w)))
    # single images, as Equinox maps them
    single = jax.vmap(lambda x: _same(x[None], w)[0])
    np.testing.assert_array_equal(np.asarray(jax.jit(single)(xs[0])),
                                  np.asarray(_same_lax(xs[0], w)))
    # mapped weights and the weight gradient: one kernel call per element
    ws = jnp.stack([w, w + 1, w - 1])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(_same))(xs, ws)),
                                  np.asarray(jax.vmap(_same_lax)(xs, ws)))
    per_example = jax.vmap(jax.grad(lambda x, w: (_same(x, w) ** 2).sum(), 1), (0, None))
    reference = jax.vmap(jax.grad(lambda x, w: (_same_lax(x, w) ** 2).sum(), 1), (0, None))
    np.testing.assert_array_equal(np.asarray(jax.jit(per_example)(xs, w)),
                                  np.asarray(reference(xs, w)))


def test_shard_map_on_two_host_devices():
    script = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        import convgrad.jax as cj
        assert len(jax.devices()) == 2
        mesh = jax.make_mesh((2,), ("d",))
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.integers(-3, 4, (4, 9, 9, 4)).astype(np.float32))
        w = jnp.asarray(rng.integers(-3, 4, (3, 3, 4, 6)).astype(np.float32))
        dn = ("NHWC", "HWIO", "NHWC")
        loss = lambda w, x: (cj.conv_general_dilated(x, w, (1, 1), "SAME",
                                                     dimension_numbers=dn) ** 2).sum()
        step = jax.shard_map(lambda w, x: jax.lax.psum(jax.grad(loss)(w, x), "d"),
                             mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
        got = jax.jit(step)(jax.device_put(w, NamedSharding(mesh, P())),
                            jax.device_put(x, NamedSharding(mesh, P("d"))))
        one = jax.jit(jax.grad(loss), device=jax.devices()[0])(w, x)
        assert np.array_equal(np.asarray(got), np.asarray(one))
        print("ok")
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=300, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_compile_kernels_builds_every_kernel_of_a_step():
    rng = np.random.default_rng(6)
    x, w = ints(rng, (2, 9, 9, 4)), ints(rng, (3, 3, 4, 6))
    step = jax.grad(lambda x, w: (_same(x, w) ** 2).sum(), (0, 1))
    assert cj.compile_kernels(step, jax.ShapeDtypeStruct(x.shape, x.dtype), w) == 3
    assert all(call.kernel is not None for call in cj.kernel_calls(step, x, w))


def test_plans_are_kept_per_distinct_static_arguments():
    """An eager call finds its plan without lax's shape rule (milliseconds); a value of
    another type (float strides, which lax rejects) is planned anew, not taken for 1."""
    x, w = jnp.ones((1, 5, 5, 2)), jnp.ones((3, 3, 2, 2))
    args = (x.shape, w.shape, x.dtype, w.dtype, (1, 1), "SAME", None, None,
            ("NHWC", "HWIO", "NHWC"), 1, 1, None)
    assert cj._lax.plan(*args) is cj._lax.plan(*args)
    assert cj._lax.plan(*args[:4], [1, 1], *args[5:]) is cj._lax.plan(*args)
    with pytest.raises(TypeError):
        cj.conv_general_dilated(x, w, (1.5, 1.5), "SAME",
                                dimension_numbers=("NHWC", "HWIO", "NHWC"))


# --- what runs lax --------------------------------------------------------------------

FALLBACKS = {
    "complex64": (dict(dtype=jnp.complex64), {}, "dtype complex64"),
    "batch_groups": (dict(shape=(4, 9, 9, 4), rhs=(3, 3, 4, 6)), {"batch_group_count": 2},
                     "batch_group_count=2"),
    "negative_padding": (dict(), {"padding": [(-1, 0), (0, 0)]}, "negative padding"),
    "stride_with_input_dilation": (dict(), {"window_strides": (2, 1), "lhs_dilation": (2, 1),
                                            "padding": [(1, 1), (1, 1)]}, "window strides"),
    "f16_preferring_bf16": (dict(dtype=jnp.float16),
                            {"preferred_element_type": jnp.bfloat16},
                            "preferred_element_type bfloat16"),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallback_runs_lax_and_says_why(name, caplog):
    arrays, overrides, reason = FALLBACKS[name]
    rng = np.random.default_rng(7)
    dtype = arrays.get("dtype", jnp.float32)
    x = ints(rng, arrays.get("shape", (2, 9, 9, 4))).astype(dtype)
    w = ints(rng, arrays.get("rhs", (3, 3, 4, 6))).astype(dtype)
    args = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    args.update(overrides)
    assert reason in cj.explain(x, w, **args)
    assert not primitives(lambda x, w: cj.conv_general_dilated(x, w, **args), x, w)
    with caplog.at_level(logging.DEBUG, logger="convgrad"):
        got = cj.conv_general_dilated(x, w, **args)
    assert any("lax.conv_general_dilated" in r.getMessage() and reason in r.getMessage()
               for r in caplog.records)
    expected = lax.conv_general_dilated(x, w, **args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_float64_runs_lax():
    with jax.enable_x64(True):
        x = jnp.ones((1, 5, 5, 2), jnp.float64)
        w = jnp.ones((3, 3, 2, 2), jnp.float64)
        assert "dtype float64" in cj.explain(x, w, (1, 1), "SAME", None, None,
                                             ("NHWC", "HWIO", "NHWC"))
        got = cj.conv_general_dilated(x, w, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))
        assert got.dtype == jnp.float64 and float(got[0, 2, 2, 0]) == 18.0


def test_bad_shapes_raise_lax_errors_at_trace_time():
    x, w = jnp.ones((1, 5, 5, 3)), jnp.ones((3, 3, 4, 6))  # 3 channels, weights want 4
    with pytest.raises(ValueError, match="feature"):
        jax.jit(lambda x, w: cj.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))).trace(x, w)


# --- the FFI handler's checks ------------------------------------------------------------

def _raw_call(index, token, out_shape, x, w, scratch=1):
    from convgrad.jax import _ffi

    results = (jax.ShapeDtypeStruct(out_shape, jnp.float32),
               jax.ShapeDtypeStruct((scratch,), jnp.uint8))
    return jax.block_until_ready(jax.ffi.ffi_call(_ffi.TARGET, results)(
        x, w, call=np.int64(index), token=np.int64(token))[0])


def test_ffi_handler_rejects_wrong_buffers_with_an_error():
    from convgrad.jax import _ffi, _primitives

    rng = np.random.default_rng(8)
    x, w = ints(rng, (2, 9, 9, 4)), ints(rng, (3, 3, 4, 6))
    plan = cj._lax.plan(x.shape, w.shape, x.dtype, w.dtype, (1, 1), "SAME", None, None,
                        ("NHWC", "HWIO", "NHWC"), 1, 1, None)
    call = _primitives.bound_call(plan.conv, x.shape, w.shape, x.dtype)
    kernel = call.load()
    d = call.dims
    dims = (d.batch, *d.src[0:3], *d.dst[0:3], *d.pads_begin[0:3], d.num_threads)
    out = call.problem.output_shape
    ws = call.workspace_bytes
    index = _ffi.call_index(kernel, dims, 11, ws, (x.shape, w.shape, out))
    token = _ffi.token()
    good = _raw_call(index, token, out, x, w, max(ws, 1))
    np.testing.assert_array_equal(np.asarray(good), np.asarray(_same_lax(x, w)))
    with pytest.raises(Exception, match="the second operand has size 7 on axis 3"):
        _raw_call(index, token, out, x, ints(rng, (3, 3, 4, 7)), max(ws, 1))
    with pytest.raises(Exception, match="the result has size 5 on axis 1"):
        _raw_call(index, token, (2, 5, 9, 6), x, w, max(ws, 1))
    with pytest.raises(Exception, match="the first operand has rank 3"):
        _raw_call(index, token, out, x[0], w, max(ws, 1))
    with pytest.raises(Exception, match="XLA dtype 16"):
        _raw_call(index, token, out, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                  max(ws, 1))
    with pytest.raises(Exception, match="compiled in another process"):
        _raw_call(index, token + 1, out, x, w, max(ws, 1))
    with pytest.raises(Exception, match="no registered kernel"):
        _raw_call(10**6, token, out, x, w, max(ws, 1))
    if ws > 1:
        with pytest.raises(Exception, match="scratch result is smaller"):
            _raw_call(index, token, out, x, w, 1)
    # sizes the kernel itself refuses (a negative batch) come back as an FFI error
    bad = _ffi.call_index(kernel, (-1, *dims[1:]), 11, ws, (x.shape, w.shape, out))
    with pytest.raises(Exception, match="the kernel rejected its run-time sizes"):
        _raw_call(bad, token, out, x, w, max(ws, 1))


def test_import_without_jax_names_the_extra():
    script = ("import sys; sys.modules['jax'] = None\n"
              "try:\n    import convgrad.jax\nexcept ImportError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=ROOT, check=True)
    assert "convgrad[jax]" in result.stdout


# --- accuracy ---------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [
    ((4, 14, 14, 64), (3, 3, 64, 64), (1, 1), "SAME", 1),
    ((4, 14, 14, 32), (3, 3, 1, 32), (2, 2), "SAME", 32),
])
def test_gradient_error_against_float64_at_most_twice_lax(layer):
    """On random float32 data, each of the forward result and the two gradients is at most
    twice as far from the float64 result as lax's float32 one."""
    lhs, rhs, strides, padding, groups = layer
    dn = ("NHWC", "HWIO", "NHWC")
    rng = np.random.default_rng(9)
    x64, w64 = rng.standard_normal(lhs), rng.standard_normal(rhs)
    out_shape = jax.eval_shape(lambda x, w: lax.conv_general_dilated(
        x, w, strides, padding, dimension_numbers=dn, feature_group_count=groups),
        jnp.zeros(lhs), jnp.zeros(rhs)).shape
    ct64 = rng.standard_normal(out_shape)

    def results(conv, x, w, ct):
        fn = lambda x, w: conv(x, w, strides, padding, dimension_numbers=dn,  # noqa: E731
                               feature_group_count=groups)
        return jax.jit(lambda x, w, ct: _loss_grads(fn, x, w, ct))(x, w, ct)

    with jax.enable_x64(True):
        exact = [np.asarray(r) for r in results(lax.conv_general_dilated, jnp.asarray(x64),
                                                jnp.asarray(w64), jnp.asarray(ct64))]
    f32 = [jnp.asarray(v, jnp.float32) for v in (x64, w64, ct64)]
    ours = results(cj.conv_general_dilated, *f32)
    theirs = results(lax.conv_general_dilated, *f32)
    assert primitives(lambda x, w: cj.conv_general_dilated(
        x, w, strides, padding, dimension_numbers=dn, feature_group_count=groups), *f32[:2])
    for name, e, o, t in zip(("forward", "input gradient", "weight gradient"), exact, ours,
                             theirs, strict=True):
        scale = np.abs(e).max()
        ours_error = np.abs(np.asarray(o, np.float64) - e).max() / scale
        lax_error = np.abs(np.asarray(t, np.float64) - e).max() / scale
        assert ours_error <= 2 * lax_error + 1e-7, (name, ours_error, lax_error)


SANITIZED = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from jax import lax
    import convgrad.jax as cj
    rng = np.random.default_rng(0)
    dn = ("NHWC", "HWIO", "NHWC")
    for lhs, rhs, s, p, ld, g in [((2, 7, 7, 4), (3, 3, 2, 6), (2, 2), "SAME", None, 2),
                                   ((2, 5, 5, 4), (3, 3, 4, 6), (1, 1), [(2, 1), (1, 2)],
                                    (2, 2), 1)]:
        x = jnp.asarray(rng.integers(-3, 4, lhs).astype(np.float32))
        w = jnp.asarray(rng.integers(-3, 4, rhs).astype(np.float32))
        f = lambda x, w: (cj.conv_general_dilated(x, w, s, p, ld, None, dn, g) ** 2).sum()
        r = lambda x, w: (lax.conv_general_dilated(x, w, s, p, ld, None, dn, g) ** 2).sum()
        got, expected = jax.jit(jax.grad(f, (0, 1)))(x, w), jax.grad(r, (0, 1))(x, w)
        assert all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(got, expected))
    print("ok")
""")


def test_handler_and_kernels_clean_under_sanitizers(tmp_path):
    """The FFI handler and the kernels built with AddressSanitizer and UBSan
    (CONVGRAD_SANITIZE=1) run a jitted step: any bad access aborts the child."""
    from test_sanitizers import ASAN, UBSAN, sanitized_env

    if ASAN is None or UBSAN is None:
        pytest.skip("the C compiler has no AddressSanitizer or UBSan runtime")
    env = sanitized_env(tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", SANITIZED], capture_output=True,
                            text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    assert list((tmp_path / "cache" / "xla_ffi").glob("*.so"))  # the sanitized handler
