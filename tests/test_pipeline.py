"""The compile / cache / load pipeline and the ahead-of-time command."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from cases import make_case
from checks import assert_exact

import convgrad
from convgrad import aot, cache, kernels, pch
from convgrad.codegen import KernelConfig, render
from convgrad.cpu import selected_isa

ROOT = Path(__file__).resolve().parent.parent


def _case(seed=0):
    return make_case("ConvolutionBackwardData", spatial=(5, 4), kernel=(3, 3),
                     in_channels=3, out_channels=5, attrs=dict(strides=2, pads_begin=1),
                     seed=seed)


def _kernel_for(case):
    shapes = [x.shape for x in case.inputs[:2]]
    problem = convgrad.api.resolve(case.op, shapes, case.attrs, case.inputs[2:] and
                                  case.inputs[2].tolist() or None)
    return kernels.get_kernel(problem.config.with_isa(selected_isa()))


def test_first_call_compiles_then_memory_then_disk(fresh_cache, monkeypatch):
    case = _case()
    assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))
    kernel = _kernel_for(case)
    assert kernel.origin == "compiled"
    assert kernel.path.parent == fresh_cache and kernel.path.exists()
    assert kernel.path.with_suffix(".c").read_text() == render(kernel.config, kernel.plan)

    # Same process: no rendering, no compiling.
    def forbidden(*args, **kwargs):
        raise AssertionError("must not render or compile again")

    monkeypatch.setattr(cache, "render", forbidden)
    monkeypatch.setattr(pch, "compile_kernel", forbidden)
    assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))
    # After forgetting loaded kernels: loaded from disk, still no compiling.
    kernels.reset()
    assert _kernel_for(case).origin == "cache"
    assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))


def _write_compiler_spy(folder: Path) -> Path:
    """A CC that logs every invocation, then runs the real compiler."""
    spy = folder / "cc-spy"
    log = folder / "cc.log"
    spy.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\nexec cc \"$@\"\n")
    spy.chmod(0o755)
    return spy


def test_new_process_loads_from_disk_without_compiling(fresh_cache, tmp_path):
    spy = _write_compiler_spy(tmp_path)
    script = textwrap.dedent("""
        import numpy as np, convgrad
        from convgrad import kernels
        dd = np.ones((1, 4, 4, 2), np.float32); w = np.ones((3, 3, 2, 2), np.float32)
        convgrad.convolution_backward_data(dd, w, strides=2)
        print(next(iter(kernels._loaded.values())).origin)
    """)
    env = {**os.environ, "CONVGRAD_CACHE_DIR": str(fresh_cache), "CC": str(spy)}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, cwd=ROOT) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    assert [r.stdout.strip() for r in runs] == ["compiled", "cache"]
    calls = (tmp_path / "cc.log").read_text().splitlines()
    # Kernel compiles; the first process also starts building the precompiled prelude.
    compiles = [c for c in calls if c.strip() != "--version" and "c-header" not in c]
    assert len(compiles) == 1, calls


def test_processes_exit_cleanly_after_parallel_kernels(tmp_path):
    """Unloading OpenMP under its idle worker threads at exit once crashed the process."""
    script = ("import numpy as np, convgrad\n"
              "convgrad.convolution_backward_weights(np.ones((2, 6, 6, 4), np.float32), "
              "np.ones((2, 4, 4, 4), np.float32), weights_shape=[3, 3], num_threads=2)\n")
    for _ in range(6):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("damage", ["foreign", "truncated"])
def test_corrupted_cache_entry_is_rebuilt(fresh_cache, damage):
    case = _case(seed=4)
    shapes = [x.shape for x in case.inputs[:2]]
    config = convgrad.api.resolve(case.op, shapes, case.attrs).config.with_isa(selected_isa())
    path, compiled = cache.build(config)  # built, never loaded by this process
    assert compiled
    if damage == "foreign":
        path.write_bytes(b"not a shared library")
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))
    assert _kernel_for(case).origin == "compiled"


def test_missing_compiler_gives_clear_error(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/convgrad-cc")
    from convgrad import compiler
    compiler._identity.cache_clear()
    case = _case(seed=1)
    with pytest.raises(compiler.CompilerNotFoundError, match="not found"):
        convgrad.execute(case.op, case.inputs, case.attrs)
    compiler._identity.cache_clear()


def test_compile_error_shows_compiler_output(fresh_cache, monkeypatch):
    monkeypatch.setenv("CONVGRAD_CFLAGS", "-DCONVGRAD_BROKEN -include /nonexistent/header.h")
    from convgrad import compiler
    case = _case(seed=2)
    with pytest.raises(compiler.CompileError, match="header.h"):
        convgrad.execute(case.op, case.inputs, case.attrs)


LAYERS = [
    {"op": "ConvolutionBackpropData", "inputs": [[2, 6, 5, 8], [3, 3, 4, 8]],
     "attrs": {"strides": 2, "pads_begin": 1, "pads_end": 1, "output_padding": 1},
     "name": "upsample"},
    {"op": "ConvTransposeBackwardWeights", "inputs": [[2, 3, 6, 5], [2, 4, 11, 9], [3, 3]],
     "attrs": {"strides": 2, "pads_begin": 1, "pads_end": 1, "data_format": "NCX",
               "weights_format": "IOX"}, "dtype": "bf16", "name": "ct-weights"},
]


def test_aot_manifest_names_the_isa_its_kernels_use(tmp_path):
    """An f32 build on an AVX512-BF16 CPU is an avx512 build: its manifest must not
    demand avx512_bf16 (avx512bf16 adds nothing for f32)."""
    from convgrad.codegen.isa import ISA_FEATURES

    layer_file = tmp_path / "layers.json"
    layer_file.write_text(json.dumps(LAYERS[:1]))  # one f32 layer
    out = tmp_path / "aot"
    subprocess.run([sys.executable, "-m", "convgrad", "aot", str(layer_file), "-o", str(out)],
                   check=True, cwd=ROOT, capture_output=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {entry["config"]["isa"] for entry in manifest["kernels"]} == {manifest["isa"]}
    assert manifest["cpu_features"] == sorted(ISA_FEATURES[manifest["isa"]])


def test_aot_build_runs_without_a_compiler(tmp_path, monkeypatch, caplog):
    layer_file = tmp_path / "layers.json"
    layer_file.write_text(json.dumps(LAYERS))
    out = tmp_path / "aot"
    subprocess.run([sys.executable, "-m", "convgrad", "aot", str(layer_file), "-o", str(out),
                    "-j", "2"], check=True, cwd=ROOT, capture_output=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["kernels"]) == 2
    assert (out / aot.LIBRARY).exists() and (out / aot.HEADER).exists()
    for entry in manifest["kernels"]:
        assert (out / entry["source"]).exists()
        assert entry["name"] in (out / aot.HEADER).read_text()

    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        import numpy as np, convgrad
        from convgrad import kernels
        from convgrad.reference import reference
        import ml_dtypes
        rng = np.random.default_rng(0)
        for layer in json.load(open({str(layer_file)!r})):
            dtype = {{"bf16": ml_dtypes.bfloat16}}.get(layer.get("dtype"), np.float32)
            inputs = [rng.integers(-2, 3, s).astype(dtype) for s in layer["inputs"][:2]]
            inputs += layer["inputs"][2:]
            got = convgrad.execute(layer["op"], inputs, layer["attrs"])
            want = reference(layer["op"], inputs, layer["attrs"]).astype(dtype)
            assert np.array_equal(got, want), layer["name"]
        print(sorted({{k.origin for k in kernels._loaded.values()}}))
    """)
    env = {**os.environ, "CONVGRAD_AOT_PATH": str(out), "CC": "/nonexistent/cc",
           "CONVGRAD_CACHE_DIR": str(tmp_path / "empty-cache")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['aot']"

    # Another generator version's folder: its kernels whose C this version renders alike
    # are used; one whose recorded C differs is left out, with a warning.
    manifest["generator_version"] = "0.0.0+another"
    manifest["kernels"][1]["source_sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("CONVGRAD_AOT_PATH", str(out))
    with caplog.at_level(logging.WARNING, logger="convgrad"):
        index = kernels._read_manifests()
    assert list(index) == [KernelConfig.from_dict(manifest["kernels"][0]["config"])]
    assert "ignoring 1 of the 2 kernels" in caplog.text


def test_aot_main_job_checks_resnet_layers(tmp_path):
    """The README's main command on a subset: builds, checks bit for bit, prints a table."""
    shapes = tmp_path / "shapes"
    shapes.write_text('mb2ic16ih9oc8oh9kh3ph1n"tiny:3x3"\n'
                      'g1mb2ic8ih10iw10oc16oh5ow5kh1kw1sh2sw2ph0pw0n"tiny:1x1s2"\n')
    result = subprocess.run([sys.executable, "-m", "convgrad", "aot", str(shapes), "-o",
                             str(tmp_path / "out"), "--check"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert "4 of 4 layers exact and served by the AOT library" in result.stdout
    assert result.stdout.count("exact") >= 4


def test_aot_check_times_no_kernel_while_blas_threads_may_run(tmp_path, monkeypatch, capsys):
    """`aot --check` times every kernel before any numpy reference runs, and runs the
    references with BLAS on one thread: a kernel timed among the spinning threads a
    multithreaded BLAS call leaves behind read 10-20x slower on 2 cores."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from convgrad import cli

    def blas_threads() -> list[int]:
        return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]

    if not blas_threads():
        pytest.skip("numpy's BLAS is not one threadpoolctl knows")
    events = []
    median_seconds, reference = aot.median_seconds, aot.reference

    def timed(*args, **kwargs):
        events.append(("time", blas_threads()))
        return median_seconds(*args, **kwargs)

    def referenced(*args, **kwargs):
        events.append(("reference", blas_threads()))
        return reference(*args, **kwargs)

    monkeypatch.setattr(aot, "median_seconds", timed)
    monkeypatch.setattr(aot, "reference", referenced)
    monkeypatch.setenv("CONVGRAD_AOT_PATH", "")  # --check sets it; restored after the test
    shapes = tmp_path / "shapes"
    shapes.write_text('mb2ic16ih9oc8oh9kh3ph1n"tiny:3x3"\n'
                      'g1mb2ic8ih10iw10oc16oh5ow5kh1kw1sh2sw2ph0pw0n"tiny:1x1s2"\n')
    try:
        with threadpool_limits(limits=2, user_api="blas"):  # BLAS would use 2 threads
            code = cli.main(["aot", str(shapes), "-o", str(tmp_path / "out"), "--check",
                             "-j", "2", "--repeats", "2"])
    finally:
        kernels.reset()
    assert code == 0 and "4 of 4 layers exact" in capsys.readouterr().out
    assert [kind for kind, _ in events] == ["time"] * 4 + ["reference"] * 4
    assert all(threads == [1] * len(threads) for kind, threads in events if kind == "reference")


def test_aot_kernels_for_another_cpu_are_refused_clearly(tmp_path, monkeypatch):
    layer_file = tmp_path / "layers.json"
    layer_file.write_text(json.dumps(LAYERS[:1]))
    out = tmp_path / "aot"
    subprocess.run([sys.executable, "-m", "convgrad", "aot", str(layer_file), "-o", str(out),
                    "--isa", "avx2"], check=True, cwd=ROOT, capture_output=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["isa"] == "avx2" and "avx2" in manifest["cpu_features"]
    # This process now believes its CPU runs only the portable path, and has no compiler.
    from convgrad import compiler, cpu
    monkeypatch.setattr(kernels, "available_isas", lambda: ("portable",))
    monkeypatch.setattr(cpu, "available_isas", lambda: ("portable",))
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset())
    monkeypatch.setenv("CONVGRAD_AOT_PATH", str(out))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("CONVGRAD_CACHE_DIR", str(tmp_path / "cache"))
    compiler._identity.cache_clear()
    kernels.reset()
    layer = LAYERS[0]
    inputs = [np.ones(s, np.float32) for s in layer["inputs"]]
    try:
        with pytest.raises(compiler.CompilerNotFoundError, match="built for avx2.*cannot run"):
            convgrad.execute(layer["op"], inputs, layer["attrs"])
    finally:
        compiler._identity.cache_clear()
        kernels.reset()


AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}


def test_isa_paths_follow_cpu_features():
    """avx512bf16 needs AVX512-BF16 on top of AVX-512; without it bf16 falls back to the
    f32-widening avx512 path, and f32/f16 kernels are the avx512 ones either way."""
    from convgrad.codegen import KernelConfig
    from convgrad.codegen.isa import ISA_FLAGS, runnable_isas
    from convgrad.codegen.rules_common import uses_bf16_dot

    assert runnable_isas(AVX512) == ["avx512", "avx2", "portable"]
    assert runnable_isas(AVX512 | {"avx512_bf16"})[0] == "avx512bf16"
    assert runnable_isas({"avx512_bf16"}) == ["portable"]
    assert "-mavx512bf16" in ISA_FLAGS["avx512bf16"] and "-mavx512bf16" not in ISA_FLAGS["avx512"]
    config = KernelConfig("bwd_data", (3,), (1,), (1,), 1, 16, 16, "NXC", "OIX", "bf16")
    assert uses_bf16_dot(config.with_isa("avx512bf16"))
    assert not uses_bf16_dot(config.with_isa("avx512"))
    for dtype in ("f32", "f16"):
        other = KernelConfig(**{**config.to_dict(), "dtype": dtype})
        assert other.with_isa("avx512bf16").isa == "avx512"
    generated = render(config.with_isa("avx512bf16"))
    assert "_mm512_dpbf16_ps" in generated
    assert "_mm512_dpbf16_ps" not in render(config.with_isa("avx512"))


def test_few_vector_channels_take_the_avx2_path_on_avx512():
    """Vectors over at most 8 channels (conv1's 3 input channels in its data gradient,
    4-8 channels per group) run 8-lane kernels; bf16 keeps vdpbf16ps."""
    from convgrad.codegen import KernelConfig

    def config(family, groups, cin, cout, dtype="f32"):
        return KernelConfig(family, (3, 3), (1, 1), (1, 1), groups, cin, cout, "NXC", "OIX",
                            dtype)

    assert config("bwd_data", 1, 3, 64).with_isa("avx512").isa == "avx2"
    assert config("bwd_data", 1, 64, 3).with_isa("avx512").isa == "avx512"
    assert config("fwd", 1, 64, 3).with_isa("avx512").isa == "avx2"
    assert config("bwd_weights", 4, 16, 8).with_isa("avx512").isa == "avx2"
    assert config("bwd_weights", 4, 8, 9).with_isa("avx512").isa == "avx512"
    assert config("bwd_weights", 8, 1, 1).with_isa("avx512").isa == "avx2"  # depthwise
    assert config("bwd_weights", 9, 1, 1).with_isa("avx512").isa == "avx512"
    assert config("bwd_data", 1, 3, 64).with_isa("avx512bf16").isa == "avx2"
    assert config("bwd_data", 1, 3, 64, "bf16").with_isa("avx512bf16").isa == "avx512bf16"
    assert config("bwd_data", 1, 3, 64).with_isa("avx2").isa == "avx2"
    assert config("bwd_data", 1, 3, 64).with_isa("portable").isa == "portable"


@pytest.mark.skipif("avx512bf16" not in convgrad.cpu.available_isas(),
                    reason="this CPU has no AVX512-BF16")
def test_bf16_uses_the_dot_path_on_this_cpu():
    case = make_case("ConvolutionBackwardData", spatial=(5, 6), kernel=(3, 3),
                     in_channels=16, out_channels=32, dtype="bf16")
    problem = convgrad.api.resolve(case.op, [x.shape for x in case.inputs[:2]], case.attrs,
                                  case.inputs[2] if len(case.inputs) > 2 else None, "bf16")
    config = problem.config.with_isa(selected_isa())
    assert config.isa == "avx512bf16"
    assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))
    assert kernels.get_kernel(config).config.isa == "avx512bf16"
