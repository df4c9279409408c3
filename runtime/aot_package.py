"""An AOT folder as a package: a CMake package configuration and pkg-config files,
written into the folder (usable where it is) and installed into a prefix.

In the folder:   convgrad_kernelsConfig.cmake, convgrad_kernelsConfigVersion.cmake,
                 convgrad_kernels.pc, convgrad_kernels-static.pc (beside the libraries
                 and the header);
under a prefix:  include/convgrad_kernels.h, lib/libconvgrad_kernels.{so,a},
                 lib/cmake/convgrad_kernels/convgrad_kernelsConfig{,Version}.cmake,
                 lib/pkgconfig/convgrad_kernels{,-static}.pc,
                 share/convgrad_kernels/manifest.json.

Both are relocatable: the CMake file finds the libraries from its own folder, the .pc
files from ${pcfiledir}. The CMake package requires OpenMP, and the static .pc links
-fopenmp, only in the openmp threading mode. The CMake package's version is the
folder's ABI version (codegen.render.ABI_VERSION).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from convgrad.codegen.render import ABI_VERSION, PACKAGE_VERSION, render_aot_file

LIBRARY = "libconvgrad_kernels.so"
STATIC_LIBRARY = "libconvgrad_kernels.a"
HEADER = "convgrad_kernels.h"
CMAKE_CONFIG = "convgrad_kernelsConfig.cmake"
CMAKE_VERSION = "convgrad_kernelsConfigVersion.cmake"
PKG_CONFIG = ("convgrad_kernels.pc", "convgrad_kernels-static.pc")


def _files(threading: str, *, installed: bool) -> dict[str, str]:
    """The package files' names and texts, for the folder's layout or a prefix's."""
    openmp = threading == "openmp"
    cmake = render_aot_file(
        "package_config.cmake.j2", threading=threading, openmp=openmp,
        root="/../../.." if installed else "", lib="/lib" if installed else "",
        include="/include" if installed else "")
    prefix = "${pcfiledir}/../.." if installed else "${pcfiledir}"
    pcs = {name: render_aot_file(
        "package.pc.j2", threading=threading, openmp=openmp, static=name.endswith("-static.pc"),
        prefix=prefix, libdir="${prefix}/lib" if installed else "${prefix}",
        includedir="${prefix}/include" if installed else "${prefix}", version=PACKAGE_VERSION)
        for name in PKG_CONFIG}
    version = render_aot_file("package_version.cmake.j2", abi_version=ABI_VERSION)
    return {CMAKE_CONFIG: cmake, CMAKE_VERSION: version, **pcs}


def write_packages(folder: Path, threading: str) -> None:
    """The package files of an AOT folder, for use where it is."""
    for name, text in _files(threading, installed=False).items():
        (folder / name).write_text(text)


def install(folder: Path, prefix: Path) -> list[Path]:
    """Copies an AOT folder's header, libraries and manifest into `prefix` (include/,
    lib/, share/convgrad_kernels/) with the package files of that layout; returns the
    files written."""
    manifest = json.loads((folder / "manifest.json").read_text())
    threading = manifest.get("threading", "openmp")
    places = {HEADER: prefix / "include", LIBRARY: prefix / "lib",
              STATIC_LIBRARY: prefix / "lib",
              "manifest.json": prefix / "share" / "convgrad_kernels"}
    written = []
    for name, place in places.items():
        place.mkdir(parents=True, exist_ok=True)
        temporary = place / f".{name}.tmp"
        shutil.copy2(folder / name, temporary)
        os.replace(temporary, place / name)
        written.append(place / name)
    for name, text in _files(threading, installed=True).items():
        place = prefix / "lib" / ("cmake/convgrad_kernels" if name.endswith(".cmake")
                                  else "pkgconfig")
        place.mkdir(parents=True, exist_ok=True)
        (place / name).write_text(text)
        written.append(place / name)
    return written
