"""The precompiled prelude: kernels compiled with GCC on the x86 SIMD paths load the
headers they include from a precompiled header in the kernel cache, built in the
background on a cache's first compile, and a damaged one never fails a build."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from cases import make_case
from checks import assert_exact

import convgrad
from convgrad import cache, kernels, pch
from convgrad.codegen import KernelConfig, render, render_prelude
from convgrad.codegen.isa import SIMD
from convgrad.compiler import compile_flags, compiler_command
from convgrad.cpu import available_isas

X86_SIMD = [isa for isa in available_isas() if SIMD[isa] != "generic"]
needs_gcc_x86 = pytest.mark.skipif(not X86_SIMD or not pch.wanted(X86_SIMD[0]),
                                   reason="the precompiled prelude is for GCC on x86 SIMD paths")


def _config(isa: str, kernel=(3, 3), channels=8) -> KernelConfig:
    return KernelConfig(family="bwd_data", kernel=kernel, strides=(1, 1), dilations=(1, 1),
                        groups=1, cin_per_group=channels, cout_per_group=channels,
                        data_format="NXC", weights_format="XIO", dtype="f32", isa=isa)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_kernels_start_with_the_prelude(isa):
    """The precompiled text is the text every kernel includes first, so loading the
    precompiled header leaves nothing of it for the kernel to parse."""
    prelude = render_prelude(isa)
    assert ("#include <immintrin.h>" in prelude) == (SIMD[isa] != "generic")
    source = render(_config(isa))
    comment_end = source.index("*/") + len("*/\n")
    assert source[comment_end:].startswith(prelude)
    assert "#include" not in source[comment_end + len(prelude):]


def test_only_gcc_on_x86_simd_paths_use_one(monkeypatch):
    assert not pch.wanted("portable")
    if shutil.which("clang") is None:
        pytest.skip("clang is not installed")
    monkeypatch.setenv("CC", "clang")
    assert not pch.wanted("avx2")  # clang's precompiled headers are an error on mismatch


@needs_gcc_x86
@pytest.mark.parametrize("isa", X86_SIMD)
def test_the_precompiled_header_is_used(isa, tmp_path):
    flags = pch.include_flags(isa, tmp_path, wait=True)
    header = pch.header_path(isa, tmp_path)
    assert flags == ("-include", str(header))
    gch = Path(f"{header}.gch")
    assert gch.stat().st_size > 1_000_000
    assert not list(header.parent.glob(".*.tmp")) and not list(header.parent.glob("*.building"))
    source = tmp_path / "kernel.c"
    source.write_text(render(_config(isa)))
    # GCC's -H marks a precompiled header it loads with "!" and an unusable one with "x".
    result = subprocess.run([*compiler_command(), *compile_flags(isa), *flags, "-H",
                             "-o", str(tmp_path / "kernel.so"), str(source)],
                            capture_output=True, text=True, check=True)
    lines = result.stderr.splitlines()
    assert lines[0] == f"! {gch}"
    # The kernel's own #include lines find their headers included: none is read again.
    assert [line.split("/")[-1] for line in lines[1:]] == [
        "stdint.h", "stdlib.h", "string.h", "omp.h", "immintrin.h"], lines


@needs_gcc_x86
def test_first_compile_does_not_wait_and_later_ones_use_it(fresh_cache, monkeypatch):
    used = []
    real_compile = pch.compile_objects

    def spy(sources, output, isa, shared=True, extra=(), parts=1):
        used.append(extra)
        real_compile(sources, output, isa, shared=shared, extra=extra, parts=parts)

    monkeypatch.setattr(pch, "compile_objects", spy)
    monkeypatch.setattr(pch, "_builds", {})
    cases = [make_case("ConvolutionBackwardData", spatial=(6, 7), kernel=(3, 2), seed=seed,
                       in_channels=5 + seed, out_channels=11) for seed in range(2)]
    assert_exact(cases[0], convgrad.execute(cases[0].op, cases[0].inputs, cases[0].attrs))
    assert used == [()]  # compiled at once, while the header builds
    for build in pch._builds.values():
        build.wait(timeout=120)
    assert_exact(cases[1], convgrad.execute(cases[1].op, cases[1].inputs, cases[1].attrs))
    assert used[1][0] == "-include" and Path(used[1][1]).parent.parent == fresh_cache / "pch"


@needs_gcc_x86
def test_a_damaged_precompiled_header_is_removed_not_fatal(fresh_cache, monkeypatch, caplog):
    isa = X86_SIMD[-1]  # f32 kernels run the avx2 or avx512 path, not avx512bf16's
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    pch.include_flags(isa, fresh_cache, wait=True)
    gch = Path(f"{pch.header_path(isa, fresh_cache)}.gch")
    gch.write_bytes(gch.read_bytes()[:4096])  # truncated: GCC stops with an error on it
    kernels.reset()
    case = make_case("ConvolutionBackwardData", spatial=(5, 4), kernel=(2, 3), seed=7,
                     in_channels=9, out_channels=3)
    with caplog.at_level("WARNING", logger="convgrad"):
        result = convgrad.execute(case.op, case.inputs, case.attrs)
    assert_exact(case, result)
    assert "precompiled header" in caplog.text and not gch.exists()
    kernel = next(iter(kernels._loaded.values()))
    assert cache.cached_libraries(kernel.config, plan=kernel.plan)
