"""The kernel cache in production conditions: many processes, killed builds, threads,
unwritable directories, a size cap, and its show/clear commands."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from cases import make_case
from checks import assert_exact

import convgrad
from convgrad import cache, kernels, pch

ROOT = Path(__file__).resolve().parent.parent

# A new kernel (its geometry is used nowhere else) that a child process builds and checks.
CHILD = textwrap.dedent("""
    import sys
    import numpy as np, convgrad
    dd = np.arange(2 * 5 * 5 * 3, dtype=np.float32).reshape(2, 5, 5, 3) % 7
    w = np.arange(3 * 2 * 3 * {channels}, dtype=np.float32).reshape(3, 2, {channels}, 3) % 5
    r = convgrad.convolution_backward_data(dd, w, strides=[2, 3], pads_begin=[1, 0])
    print(float(r.sum()), float((r * np.arange(r.size).reshape(r.shape) % 11).sum()))
""")


def _spy(folder: Path, delay: float = 0.0) -> Path:
    """A CC that logs each kernel compile, its arguments on a line (not `--version`;
    builds of the precompiled prelude, `-x c-header`, to a log of their own), optionally
    slowly, then compiles."""
    spy = folder / "cc-spy"
    spy.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in
            *" --version "*) ;;
            *" c-header "*) echo "$$" >> {folder / "headers.log"} ;;
            *) echo "$*" >> {folder / "compiles.log"}; sleep {delay} ;;
        esac
        exec cc "$@"
    """))
    spy.chmod(0o755)
    return spy


def _compiles(folder: Path, log: str = "compiles.log") -> int:
    path = folder / log
    return len(path.read_text().splitlines()) if path.exists() else 0


def _child_env(folder: Path, spy: Path) -> dict:
    return {**os.environ, "CONVGRAD_CACHE_DIR": str(folder / "cache"), "CC": str(spy),
            "CONVGRAD_AOT_PATH": ""}


def test_the_cache_folder_follows_the_environment_within_a_process(tmp_path, monkeypatch):
    """configured_dir is memoised by the variables it reads: a change of any of them
    (CONVGRAD_CACHE_DIR, XDG_CACHE_HOME, HOME) moves the cache at the next look-up."""
    monkeypatch.delenv("CONVGRAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "one"))
    assert cache.configured_dir() == tmp_path / "one" / "convgrad"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "two"))
    assert cache.configured_dir() == tmp_path / "two" / "convgrad"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.configured_dir() == tmp_path / "home" / ".cache" / "convgrad"
    monkeypatch.setenv("CONVGRAD_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache.configured_dir() == tmp_path / "explicit"
    assert cache.lookup_dir() == tmp_path / "explicit"
    assert not (tmp_path / "explicit").exists()  # a look-up creates nothing


def test_eight_processes_one_compilation(tmp_path):
    spy = _spy(tmp_path, delay=0.5)
    script = CHILD.format(channels=4)
    env = _child_env(tmp_path, spy)
    children = [subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(8)]
    outputs = [child.communicate(timeout=120) for child in children]
    assert all(child.returncode == 0 for child in children), [o[1] for o in outputs]
    assert len({out for out, _ in outputs}) == 1  # eight identical, correct results
    reference = subprocess.run([sys.executable, "-c", script], env={**env, "CC": "cc"},
                               cwd=ROOT, capture_output=True, text=True, check=True)
    assert outputs[0][0] == reference.stdout
    assert _compiles(tmp_path) == 1
    assert _compiles(tmp_path, "headers.log") <= 1  # one process builds the prelude


def test_process_killed_while_compiling_leaves_a_usable_cache(tmp_path):
    slow = _spy(tmp_path, delay=30)
    script = CHILD.format(channels=5)
    victim = subprocess.Popen([sys.executable, "-c", script], env=_child_env(tmp_path, slow),
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while _compiles(tmp_path) == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert _compiles(tmp_path) == 1, "the compile never started"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    fast = tmp_path / "fast"
    fast.mkdir()
    result = subprocess.run([sys.executable, "-c", script],
                            env=_child_env(tmp_path, _spy(fast)), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert _compiles(fast) == 1  # the lock died with its holder; the build ran again
    again = subprocess.run([sys.executable, "-c", script],
                           env=_child_env(tmp_path, _spy(fast)), cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert again.stdout == result.stdout and _compiles(fast) == 1


def test_sixteen_threads_call_kernels_concurrently(fresh_cache):
    cases = [make_case(op, spatial=(6, 5), kernel=(3, 3), in_channels=5, out_channels=7,
                       attrs=dict(pads_begin=1, strides=s), seed=seed)
             for seed, (op, s) in enumerate(
                 [("ConvolutionBackwardData", 1), ("ConvolutionBackwardWeights", 2),
                  ("ConvTransposeBackwardData", 1), ("ConvolutionBackwardData", 2)])]
    expected = [c.expected(np.float32) for c in cases]

    def work(index):
        case = cases[index % len(cases)]
        for _ in range(20):
            result = convgrad.execute(case.op, case.inputs, case.attrs, num_threads=1)
            if not np.array_equal(result, expected[index % len(cases)]):
                return False
        return True

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(work, range(16)))


def test_read_only_cache_falls_back_with_a_warning(fresh_cache, monkeypatch):
    if os.geteuid() == 0:
        # root ignores permissions: make the directory unusable another way
        fresh_cache.parent.mkdir(parents=True, exist_ok=True)
        fresh_cache.write_text("a file where the cache directory should be")
    else:
        fresh_cache.mkdir(parents=True)
        fresh_cache.chmod(0o500)
    monkeypatch.setattr(cache, "_fallbacks", {})
    case = make_case("ConvolutionBackwardData", spatial=(4, 4), kernel=(2, 2), seed=9)
    with pytest.warns(RuntimeWarning, match="not writable"):
        result = convgrad.execute(case.op, case.inputs, case.attrs)
    assert_exact(case, result)


def test_full_cache_falls_back_with_a_warning(fresh_cache, monkeypatch):
    real_compile = pch.compile_kernel
    calls = []

    def full_disk_once(sources, output, isa, cache_folder, **options):
        calls.append(output)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_compile(sources, output, isa, cache_folder, **options)

    monkeypatch.setattr(pch, "compile_kernel", full_disk_once)
    monkeypatch.setattr(cache, "_fallbacks", {})
    case = make_case("ConvolutionBackwardData", spatial=(4, 5), kernel=(2, 2), seed=10)
    with pytest.warns(RuntimeWarning, match="No space left"):
        result = convgrad.execute(case.op, case.inputs, case.attrs)
    assert_exact(case, result)
    assert len(calls) == 2 and fresh_cache not in calls[1].parents


def test_size_cap_evicts_least_recently_used(fresh_cache, monkeypatch):
    cases = [make_case("ConvolutionBackwardData", spatial=(4, 4), kernel=(k, 1), seed=k)
             for k in (1, 2, 3)]
    for case in cases[:2]:
        convgrad.execute(case.op, case.inputs, case.attrs)
    first, second = cache.entries(fresh_cache)
    os.utime(first["library"].with_suffix(".json"), (1, 1))  # the oldest use
    monkeypatch.setenv("CONVGRAD_CACHE_MAX_MB", str((first["bytes"] + second["bytes"]) / 2**20))
    convgrad.execute(cases[2].op, cases[2].inputs, cases[2].attrs)  # a third entry
    left = [e["library"] for e in cache.entries(fresh_cache)]
    assert first["library"] not in left and second["library"] in left and len(left) == 2


def test_builds_rescan_the_cache_only_past_its_cap(fresh_cache, monkeypatch):
    """Eviction's scan of the folder (after each build, 0.7 s in a cache of 8000 entries
    when it read every record) runs once per process and folder, then again only when
    the bytes built since would pass the cap."""
    scans = []
    real = cache._usage
    monkeypatch.setattr(cache, "_usage", lambda folder: scans.append(folder) or real(folder))
    for k in (1, 2, 3):
        case = make_case("ConvolutionBackwardData", spatial=(4, 4), kernel=(k, 1), seed=k)
        convgrad.execute(case.op, case.inputs, case.attrs)
    assert scans == [fresh_cache]
    assert len(cache.entries(fresh_cache)) == 3  # (a scan too)
    monkeypatch.setenv("CONVGRAD_CACHE_MAX_MB", "0.01")
    case = make_case("ConvolutionBackwardData", spatial=(4, 4), kernel=(4, 1), seed=4)
    convgrad.execute(case.op, case.inputs, case.attrs)
    assert len(scans) == 3 and len(cache.entries(fresh_cache)) == 1  # the new one kept


def test_show_and_clear_commands(fresh_cache):
    case = make_case("ConvolutionBackwardData", spatial=(4, 4), kernel=(2, 2), seed=3)
    convgrad.execute(case.op, case.inputs, case.attrs)
    for build in pch._builds.values():  # the precompiled prelude's, on GCC x86
        build.wait(timeout=120)
    headers = pch.stored(fresh_cache)[0]
    config = next(iter(kernels._loaded))[0]
    assert headers == int(pch.wanted(config.isa))
    env = {**os.environ, "CONVGRAD_CACHE_DIR": str(fresh_cache)}
    show = subprocess.run([sys.executable, "-m", "convgrad", "cache", "show"], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert "1 kernels" in show.stdout and "convgrad_bwd_data" in show.stdout
    assert f"{headers} precompiled headers" in show.stdout
    clear = subprocess.run([sys.executable, "-m", "convgrad", "cache", "clear"], env=env, cwd=ROOT,
                           capture_output=True, text=True, check=True)
    assert f"removed 1 kernels and {headers} precompiled headers" in clear.stdout
    assert cache.entries(fresh_cache) == [] and pch.stored(fresh_cache) == (0, 0)
    assert not (fresh_cache / "index").exists()


def _no_compiler_env(folder: Path) -> dict:
    """A process with CC pointing nowhere and no compiler on PATH."""
    return {**_child_env(folder, Path("/nonexistent/cc")), "PATH": str(Path(sys.executable).parent)}


def test_cached_kernel_loads_without_a_compiler(tmp_path):
    script = CHILD.format(channels=6) + "from convgrad import kernels\n" \
        "print(sorted(k.origin for k in kernels._loaded.values()))\n"
    filled = subprocess.run([sys.executable, "-c", script], env=_child_env(tmp_path, "cc"),
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert filled.returncode == 0, filled.stderr
    assert filled.stdout.splitlines()[-1] == "['compiled']"
    without = subprocess.run([sys.executable, "-c", script], env=_no_compiler_env(tmp_path),
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert without.returncode == 0, without.stderr
    assert without.stdout.splitlines() == [filled.stdout.splitlines()[0], "['cache']"]
    # A kernel the cache does not hold still fails clearly.
    other = subprocess.run([sys.executable, "-c", CHILD.format(channels=7)],
                           env=_no_compiler_env(tmp_path), cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert other.returncode == 1 and "CompilerNotFoundError" in other.stderr


def test_entries_of_several_compilers(tmp_path):
    """Each compiler has its own entry of a kernel; a process with a compiler uses its
    own, one without takes the first by name; `cache show` names each compiler."""
    script = CHILD.format(channels=3)
    spy = _spy(tmp_path)  # another compiler identity (its path), same results
    for compiler in (spy, "cc", spy, "cc"):
        result = subprocess.run([sys.executable, "-c", script], env=_child_env(tmp_path, compiler),
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
    assert _compiles(tmp_path) == 1  # the spy built once, then found its entry
    libraries = sorted((tmp_path / "cache").glob("*.so"))
    assert len(libraries) == 2
    env = _no_compiler_env(tmp_path)
    loaded = subprocess.run(
        [sys.executable, "-c", script + "from convgrad import kernels\n"
         "print([str(k.path) for k in kernels._loaded.values()])\n"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.splitlines()[-1] == repr([str(libraries[0])])
    show = subprocess.run([sys.executable, "-m", "convgrad", "cache", "show"], env=env,
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert "2 kernels" in show.stdout
    assert str(spy) in show.stdout and f"{shutil.which('cc')}: " in show.stdout


def _parts(folder: Path) -> list[str]:
    """The CONVGRAD_PART of each compile `_spy(folder)` logged that had one."""
    log = folder / "compiles.log"
    return sorted(line.split("-DCONVGRAD_PART=")[1][0]
                  for line in log.read_text().splitlines() if "-DCONVGRAD_PART=" in line)


@pytest.mark.parametrize("isa", convgrad.cpu.available_isas())
def test_kernels_built_in_two_parts_are_exact(fresh_cache, monkeypatch, isa):
    """CONVGRAD_BUILD_JOBS=2: a data kernel's tiles are split between two objects
    compiled at once (-DCONVGRAD_PART=0 and 1) and linked; a weight kernel's tiles are
    the second object (packed panels; in place, with bf16 pairs on avx512bf16)."""
    monkeypatch.setenv("CC", str(_spy(fresh_cache.parent)))
    monkeypatch.setenv("CONVGRAD_ISA", isa)
    monkeypatch.setenv("CONVGRAD_BUILD_JOBS", "2")
    cases = [  # direct tiles (strided, padded); pointwise NCX tiles; rounding tiles
        make_case("ConvolutionBackwardData", spatial=(5, 6), kernel=(3, 3), in_channels=37,
                  out_channels=9, attrs=dict(strides=2, pads_begin=1, output_padding=1)),
        make_case("ConvTransposeBackwardData", spatial=(12, 12), kernel=(1, 1),
                  in_channels=13, out_channels=20, data_format="NCX", seed=1),
        make_case("ConvolutionBackwardData", spatial=(4, 5), kernel=(2, 3), in_channels=15,
                  out_channels=6, dtype="bf16", seed=2),
        make_case("ConvolutionBackwardWeights", spatial=(6, 6), kernel=(3, 3),
                  in_channels=12, out_channels=20, seed=3),
        make_case("ConvolutionBackwardWeights", spatial=(7, 5), kernel=(1, 1),
                  in_channels=20, out_channels=12, data_format="NCX", dtype="bf16", seed=5),
    ]
    for case in cases:
        assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))
    assert _parts(fresh_cache.parent) == ["0"] * 5 + ["1"] * 5


def test_one_build_job_compiles_kernels_whole(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", str(_spy(fresh_cache.parent)))
    monkeypatch.setenv("CONVGRAD_BUILD_JOBS", "1")
    case = make_case("ConvolutionBackwardData", spatial=(5, 4), kernel=(3, 2), in_channels=11,
                     out_channels=3, attrs=dict(pads_begin=1), seed=4)
    assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))
    assert _compiles(fresh_cache.parent) >= 1 and _parts(fresh_cache.parent) == []
    monkeypatch.setenv("CONVGRAD_BUILD_JOBS", "two")
    with pytest.raises(ValueError, match="CONVGRAD_BUILD_JOBS"):
        cache.build_jobs()


# Prints the generator version and one kernel's cache key from the package imported
# (a copy of the sources, put first on the path).
KEY_CHILD = textwrap.dedent("""
    import convgrad
    from convgrad import cache
    from convgrad.codegen import KernelConfig, generator_version, render
    assert convgrad.__file__.startswith({root!r}), convgrad.__file__
    config = KernelConfig(family="bwd_weights", kernel=(1, 1), strides=(1, 1),
                          dilations=(1, 1), groups=1, cin_per_group=64,
                          cout_per_group=64, data_format="NXC", weights_format="XIO",
                          dtype="f32", isa="avx2")
    print(generator_version(), cache.source_key(render(config), "avx2"))
""")


def _package_copy(folder: Path, edit=None) -> tuple[str, str]:
    """The generator version and a weight kernel's cache key from a copy of the package's
    sources, `edit(codegen_folder)` applied to the copy first."""
    package = folder / "convgrad"
    shutil.copytree(ROOT / "runtime", package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "codegen", package / "codegen",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "templates", package / "templates",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if edit:
        edit(package / "codegen")
    result = subprocess.run([sys.executable, "-c", KEY_CHILD.format(root=str(folder))],
                            env={**os.environ, "PYTHONPATH": str(folder)}, cwd=folder,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    version, key = result.stdout.split()
    return version, key


def test_the_cache_key_follows_the_rendered_c_not_the_generator_sources(tmp_path):
    """A comment-only edit of the generator changes its version (the index's key) but not
    a kernel's cache key; a rule's value that the kernel reads changes both."""
    def comment(codegen: Path) -> None:
        rules = codegen / "rules_weights.py"
        rules.write_text(rules.read_text() + "\n# a comment-only edit\n")

    def rule(codegen: Path) -> None:
        rules = codegen / "rules_weights.py"
        text = rules.read_text()
        assert "\nCHUNK_PIXELS = 128\n" in text
        rules.write_text(text.replace("\nCHUNK_PIXELS = 128\n", "\nCHUNK_PIXELS = 96\n"))

    original = _package_copy(tmp_path / "a")
    commented = _package_copy(tmp_path / "b", comment)
    changed = _package_copy(tmp_path / "c", rule)
    assert commented[0] != original[0] and commented[1] == original[1]
    assert changed[0] != original[0] and changed[1] != original[1]


def test_an_entry_is_found_through_the_index_or_by_rendering(fresh_cache, monkeypatch):
    """The index leads from a configuration to its entry without rendering; without the
    index the kernel is rendered, its entry found under the same key (no compile), and
    the index written again. A lookup `indexed_only` (a model's first step on a new
    cache) never renders: a kernel the index does not record is missing, and in a cache
    with no index a kernel's lookup does not even work out its plan."""
    from convgrad.codegen import KernelConfig

    config = KernelConfig(family="bwd_data", kernel=(3,), strides=(2,),
                          dilations=(1,), groups=1, cin_per_group=5, cout_per_group=7,
                          data_format="NXC", weights_format="XIO", dtype="f32",
                          isa=convgrad.cpu.available_isas()[0])

    def no_render(*args, **kwargs):
        raise AssertionError("rendered although the index holds the key")

    def no_plan(*args, **kwargs):
        raise AssertionError("a plan worked out for a cache with no index")

    with monkeypatch.context() as patched:
        patched.setattr(cache, "render", no_render)
        assert cache.find(config, indexed_only=True) is None
        patched.setattr(kernels, "vendor_plan", no_plan)  # a new cache: nothing to find
        assert kernels.get_kernel(config, build=False) is None
    built, compiled = cache.build(config)
    kernels.reset()
    assert kernels.get_kernel(config, {}, build=False).path == built
    assert compiled
    index = list((fresh_cache / "index").iterdir())
    assert len(index) == 1 and built.name.split("-")[-2] == index[0].read_text()[:16]

    with monkeypatch.context() as patched:
        patched.setattr(cache, "render", no_render)
        assert cache.find(config) == built
        assert cache.find(config, indexed_only=True) == built
        patched.setenv("CONVGRAD_CFLAGS", "-O1")  # other flags, other entries
        assert cache.recorded_key(config, fresh_cache) is None
        assert cache.find(config, indexed_only=True) is None
    index[0].unlink()
    with monkeypatch.context() as patched:
        patched.setattr(cache, "render", no_render)
        assert cache.find(config, indexed_only=True) is None  # the entry stays unseen
    assert cache.build(config) == (built, False)
    assert index[0].read_text() == cache.source_key(convgrad.codegen.render(config), config.isa)


def test_a_damaged_entry_is_rebuilt_and_an_intact_one_is_not_reread(fresh_cache, monkeypatch):
    """An entry whose library was truncated (at its recorded time), or rewritten to its
    size at another time, fails its check and is compiled again (dlopen never sees it);
    an intact one is recognised by the size and
    modification time its record noted, without reading the library; a copied cache
    (new times) is checked by its digest once, then noted."""
    case = make_case("ConvolutionBackwardData", spatial=(5, 4), kernel=(2, 2),
                     in_channels=3, out_channels=11, batch=1)
    assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))
    [library] = fresh_cache.glob("convgrad_*.so")
    [kernel] = kernels._loaded.values()
    config, plan = kernel.config, kernel.plan
    intact = library.read_bytes()

    def unread(path):
        raise AssertionError(f"{path} read again")

    with monkeypatch.context() as patched:
        patched.setattr(cache, "file_digest", unread)
        assert cache.find(config, plan) == library
    for build in pch._builds.values():  # no precompiled header half-written in the copy
        build.wait(timeout=120)
    copy = fresh_cache.parent / "copy"
    shutil.copytree(fresh_cache, copy)  # new modification times: hashed, still valid,
    assert cache.is_valid(copy / library.name)
    with monkeypatch.context() as patched:  # and noted: not read the next time
        patched.setattr(cache, "file_digest", unread)
        assert cache.is_valid(copy / library.name)
    recorded = library.stat().st_mtime_ns
    for damage in (intact[: len(intact) // 2], bytes(len(intact))):
        # a new file in its place (this process maps the library: no writes into it),
        # with the recorded time
        damaged = library.with_suffix(".damaged")
        damaged.write_bytes(damage)
        os.utime(damaged, ns=(recorded, recorded))
        os.replace(damaged, library)
        assert cache.find(config, plan) is None
        kernels.reset()
        assert_exact(case, convgrad.execute(case.op, case.inputs, case.attrs))
        assert library.read_bytes() != damage and cache.find(config, plan) == library
