"""convgrad.settings: every environment variable parsed and checked in one module, and
snapshots that the CLI and build workers install instead of writing os.environ."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from convgrad import cli, settings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "c_api" / "layers.json"

BAD = {"CONVGRAD_ISA": "avx1024", "CONVGRAD_TUNE": "sometimes", "CONVGRAD_COMPILE": "later",
       "CONVGRAD_BUILD_DELAY": "-1", "CONVGRAD_BUILD_JOBS": "two", "CONVGRAD_BUILD_NICE": "x",
       "CONVGRAD_CACHE_MAX_MB": "lots", "CONVGRAD_SANITIZE": "yes please",
       "CONVGRAD_TORCH_NATIVE": "maybe"}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_raises_one_error_naming_its_variable(name):
    with pytest.raises(ValueError, match=name):
        settings.parse({name: BAD[name]})


def test_values_parse_into_typed_fields():
    parsed = settings.parse({"CONVGRAD_ISA": " AVX2 ", "CONVGRAD_TUNE": "1",
                             "CONVGRAD_BUILD_DELAY": "0.25", "CONVGRAD_BUILD_JOBS": "3",
                             "CONVGRAD_CACHE_MAX_MB": "12.5", "CC": "ccache gcc -g",
                             "OMP_NUM_THREADS": "4,2", "CONVGRAD_TORCH_NATIVE": "off"})
    assert (parsed.isa, parsed.tune, parsed.build_delay, parsed.build_jobs) == (
        "avx2", "on", 0.25, 3)
    assert parsed.cache_max_mb == 12.5 and parsed.cc == ("ccache", "gcc", "-g")
    assert parsed.omp_num_threads == 4 and parsed.torch_native is False
    empty = settings.parse({})
    assert (empty.isa, empty.tune, empty.compile_mode, empty.build_jobs, empty.aot_path) == (
        "", "off", "background", None, None)
    assert empty.cc == ("cc",) and empty.cxx == ("c++",) and empty.sanitize is False


def test_current_follows_the_environment_and_a_snapshot_wins(monkeypatch):
    monkeypatch.setenv("CONVGRAD_BUILD_DELAY", "3")
    assert settings.current().build_delay == 3.0
    monkeypatch.setenv("CONVGRAD_BUILD_DELAY", "4")
    assert settings.current().build_delay == 4.0
    snapshot = settings.current().with_values(CONVGRAD_BUILD_DELAY="0", CONVGRAD_ISA=None)
    with settings.using(snapshot):
        monkeypatch.setenv("CONVGRAD_BUILD_DELAY", "5")
        assert settings.current() is snapshot and settings.current().build_delay == 0.0
        assert settings.values_of("CONVGRAD_BUILD_DELAY", "CONVGRAD_ISA") == ("0", None)
    assert settings.current().build_delay == 5.0
    with pytest.raises(KeyError, match="NOT_A_SETTING"):
        snapshot.with_values(NOT_A_SETTING="1")
    assert settings.parse(snapshot.environment()) == snapshot


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for path in sorted([*ROOT.glob("runtime/**/*.py"), *ROOT.glob("codegen/**/*.py")]):
        if path.name == "settings.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"os\.environ\b|os\.getenv\b|os\.putenv\b", code):
                readers.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not readers, "\n".join(readers)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_cli_runs_with_its_options_without_writing_the_environment(tmp_path, monkeypatch):
    """`convgrad aot --cc ... --cflags ... --check` compiles with those options and checks
    its kernels from the folder it built, and leaves os.environ as it was."""
    for name in ("CC", "CONVGRAD_CFLAGS", "CONVGRAD_AOT_PATH", "CONVGRAD_TARGET"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    output = tmp_path / "aot"
    assert cli.main(["aot", str(EXAMPLE), "-o", str(output), "-j", "2", "--cc", "gcc",
                     "--cflags=-DCONVGRAD_TEST_FLAG=1", "--check", "--repeats", "1"]) == 0
    manifest = (output / "manifest.json").read_text()
    assert "-DCONVGRAD_TEST_FLAG=1" in manifest and '"gcc' in manifest.replace("/usr/bin/", "")
    assert dict(os.environ) == before
    assert settings.current().aot_path is None
