"""convgrad as a user installs it: one import package from a plain (not editable)
install, the `convgrad` command, and the main job from outside the source tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", ".pytest_cache", ".ruff_cache",
                                    ".hypothesis", "__pycache__", "*.egg-info", "build",
                                    "generated", "benchmarks", "examples")


def _installed_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A new virtual environment with convgrad's wheel, built from a copy of this tree,
    installed by a plain `pip install` (no network: the build backend and the
    dependencies are this environment's, the latter reached through a .pth file).
    Returns its python and its site-packages."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                            "--no-build-isolation", "--quiet", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True)
    assert wheel.returncode == 0, wheel.stdout + wheel.stderr
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    (site / "outer_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (built,) = (tmp_path / "dist").glob("convgrad-*.whl")
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index",
                              "--quiet", str(built)],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    return python, site


def test_plain_install_has_one_package_and_runs_the_main_job(tmp_path):
    python, site = _installed_venv(tmp_path)
    installed = {p.name for p in site.iterdir()}
    assert "convgrad" in installed
    assert not {"runtime", "codegen", "templates", "tests"} & installed, sorted(installed)
    assert (site / "convgrad" / "reference.py").is_file()
    assert (site / "convgrad" / "torch" / "ops.py").is_file()  # convgrad.torch
    assert list((site / "convgrad" / "templates").glob("*.j2"))

    work = tmp_path / "work"  # not the source tree: only the installed package is found
    work.mkdir()
    env = {**os.environ, "CONVGRAD_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("CONVGRAD_AOT_PATH", None)
    where = subprocess.run([str(python), "-c", "import convgrad, convgrad.reference; "
                            "print(convgrad.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).parent == site / "convgrad"

    command = python.parent / "convgrad"
    build = subprocess.run([str(command), "aot", "--check", "-j", "2"], cwd=work, env=env,
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "built 40 kernels for 40 layers" in build.stdout
    assert "40 of 40 layers exact and served by the AOT library" in build.stdout
    assert "median of 5 calls after a warm-up" in build.stdout
    assert build.stderr.count("\n") == 1  # one summary line; no progress off a terminal
    manifest = json.loads((work / "generated" / "manifest.json").read_text())
    assert len(manifest["kernels"]) == 40

    # The same folder, checked by a process with no compiler at all.
    no_compiler = {**env, "CC": "/nonexistent/cc", "PATH": str(python.parent),
                   "CONVGRAD_CACHE_DIR": str(tmp_path / "empty-cache")}
    check = subprocess.run([str(python), "-m", "convgrad", "aot", "--no-build", "--check"],
                           cwd=work, env=no_compiler, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "40 of 40 layers exact and served by the AOT library" in check.stdout
    assert not list((tmp_path / "empty-cache").glob("*.so"))


def test_command_help_and_errors():
    help_text = subprocess.run([sys.executable, "-m", "convgrad", "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert "aot" in help_text and "cache" in help_text
    bad = subprocess.run([sys.executable, "-m", "convgrad", "aot", "--ops", "Nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown op kind" in bad.stderr
    none = subprocess.run([sys.executable, "-m", "convgrad"], capture_output=True, text=True)
    assert none.returncode == 2 and "COMMAND" in none.stderr
    jobs = subprocess.run([sys.executable, "-m", "convgrad", "aot", "-j", "0"],
                          capture_output=True, text=True)
    assert jobs.returncode == 2 and "--jobs must be at least 1" in jobs.stderr
