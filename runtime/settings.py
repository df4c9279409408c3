"""Every environment variable convgrad reads, parsed and checked in one place.

`current()` is a frozen `Settings` of the environment as it is now (parsed again only
when one of the variables changed since the last call); a bad value raises ValueError
naming the variable. Code that must change a setting for what it calls (the CLI, the
PyTorch AOT helper, a build worker) installs a snapshot with `using()`/`use()` instead
of writing os.environ, and a build worker receives the parent's snapshot as its raw
values (`Settings.values`). Hot paths that key a memo on a few settings read just
those (`values_of`).

| variable | field | meaning |
|---|---|---|
| CONVGRAD_ISA | isa | force an ISA path ("" = the CPU's best) |
| CONVGRAD_TUNE | tune | off, on or reuse (tuning.py) |
| CONVGRAD_COMPILE | compile_mode | background or block (convgrad.torch's calls) |
| CONVGRAD_BUILD_DELAY | build_delay | seconds without a new request before builds start |
| CONVGRAD_BUILD_JOBS | build_jobs | compilations of one lazy build (None = by cores) |
| CONVGRAD_BUILD_NICE | build_nice | niceness of the build workers |
| CONVGRAD_CACHE_DIR, XDG_CACHE_HOME, HOME | cache_dir, xdg_cache_home, home | the kernel cache |
| CONVGRAD_CACHE_MAX_MB | cache_max_mb | the cache's size limit (None = default) |
| CONVGRAD_AOT_PATH | aot_path | folders of AOT kernels (None = unset) |
| CONVGRAD_TARGET, CONVGRAD_CFLAGS, CONVGRAD_SANITIZE | target, cflags, sanitize | compile flags |
| CONVGRAD_TORCH_NATIVE | torch_native | convgrad.torch's C++ call path on or off |
| CC, CXX, AR, PATH | cc, cxx, ar, path | the tools |
| OMP_NUM_THREADS, KMP_INIT_AT_FORK | omp_num_threads, kmp_init_at_fork | OpenMP's |
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from convgrad.codegen.config import ISAS

NAMES = ("CONVGRAD_ISA", "CONVGRAD_TUNE", "CONVGRAD_COMPILE", "CONVGRAD_BUILD_DELAY",
         "CONVGRAD_BUILD_JOBS", "CONVGRAD_BUILD_NICE", "CONVGRAD_CACHE_DIR", "XDG_CACHE_HOME",
         "HOME", "CONVGRAD_CACHE_MAX_MB", "CONVGRAD_AOT_PATH", "CONVGRAD_TARGET",
         "CONVGRAD_CFLAGS", "CONVGRAD_SANITIZE", "CONVGRAD_TORCH_NATIVE", "CC", "CXX", "AR",
         "PATH", "OMP_NUM_THREADS", "KMP_INIT_AT_FORK")
COMPILE_MODES = ("background", "block")
DEFAULT_BUILD_DELAY = 1.0  # background.py says why


@dataclass(frozen=True)
class Settings:
    values: tuple[str | None, ...]  # the raw values, in NAMES' order (None: unset)
    isa: str
    tune: str
    compile_mode: str
    build_delay: float
    build_jobs: int | None
    build_nice: int
    cache_dir: str | None
    xdg_cache_home: str | None
    home: str | None
    cache_max_mb: float | None
    aot_path: str | None
    target: str
    cflags: str
    sanitize: bool
    torch_native: bool
    cc: tuple[str, ...]
    cxx: tuple[str, ...]
    ar: tuple[str, ...]
    path: str | None
    omp_num_threads: int | None
    kmp_init_at_fork: str

    def environment(self) -> dict[str, str | None]:
        """The raw values by name (what a build worker is sent)."""
        return dict(zip(NAMES, self.values, strict=True))

    def with_values(self, **changes: str | None) -> Settings:
        """These settings with some variables' raw values replaced (None: unset)."""
        unknown = set(changes) - set(NAMES)
        if unknown:
            raise KeyError(f"not a setting: {sorted(unknown)}")
        return parse({**self.environment(), **changes})


def tune_mode(value: object, where: str) -> str:
    """"off", "on" or "reuse" from a CONVGRAD_TUNE value or a call's `tune` argument."""
    if value in (True, "1", "on", "true", "yes"):
        return "on"
    if value in (False, "", "0", "off", "false", "no"):
        return "off"
    if value == "reuse":
        return "reuse"
    raise ValueError(f"{where} is invalid; expected on (1), reuse or off (0)")


def _choice(name: str, value: str, choices: tuple[str, ...], default: str) -> str:
    value = value.strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r} is invalid; expected one of {list(choices)}")
    return value


def _count(name: str, value: str, least: int) -> int | None:
    value = value.strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < least:
        kind = "a positive integer" if least else "an integer (0 or more)"
        raise ValueError(f"{name} must be {kind}, not {value!r}")
    return int(value)


def _number(name: str, value: str, what: str) -> float | None:
    value = value.strip()
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0 <= number < math.inf:
        raise ValueError(f"{name}={value!r} is invalid; expected {what} (0 or more)")
    return number


def _switch(name: str, value: str, on: tuple[str, ...], off: tuple[str, ...]) -> bool:
    value = value.strip().lower()
    if value not in on + off:
        raise ValueError(f"{name}={value!r} is invalid; expected on or off")
    return value in on


def _tool(value: str, default: str) -> tuple[str, ...]:
    return tuple(shlex.split(value.strip() or default))


def parse(environment: Mapping[str, str | None]) -> Settings:
    """The settings of these raw values (a name missing or None: unset)."""
    values = tuple(environment.get(name) for name in NAMES)
    raw = dict(zip(NAMES, values, strict=True))
    text = {name: value or "" for name, value in raw.items()}
    isa = text["CONVGRAD_ISA"].strip().lower()
    if isa and isa not in ISAS:
        raise ValueError(f"CONVGRAD_ISA={isa!r} is not one of {list(ISAS)}")
    tune = text["CONVGRAD_TUNE"].strip().lower()
    delay = _number("CONVGRAD_BUILD_DELAY", text["CONVGRAD_BUILD_DELAY"], "seconds")
    threads = text["OMP_NUM_THREADS"].split(",")[0].strip()
    return Settings(
        values=values,
        isa=isa,
        tune=tune_mode(tune, f"CONVGRAD_TUNE={tune!r}"),
        compile_mode=_choice("CONVGRAD_COMPILE", text["CONVGRAD_COMPILE"], COMPILE_MODES,
                             "background"),
        build_delay=DEFAULT_BUILD_DELAY if delay is None else delay,
        build_jobs=_count("CONVGRAD_BUILD_JOBS", text["CONVGRAD_BUILD_JOBS"], 1),
        build_nice=_count("CONVGRAD_BUILD_NICE", text["CONVGRAD_BUILD_NICE"], 0) or 0,
        cache_dir=raw["CONVGRAD_CACHE_DIR"],
        xdg_cache_home=raw["XDG_CACHE_HOME"],
        home=raw["HOME"],
        cache_max_mb=_number("CONVGRAD_CACHE_MAX_MB", text["CONVGRAD_CACHE_MAX_MB"],
                             "megabytes"),
        aot_path=raw["CONVGRAD_AOT_PATH"],
        target=text["CONVGRAD_TARGET"].strip(),
        cflags=text["CONVGRAD_CFLAGS"],
        sanitize=_switch("CONVGRAD_SANITIZE", text["CONVGRAD_SANITIZE"], ("1",), ("", "0")),
        torch_native=_switch("CONVGRAD_TORCH_NATIVE", text["CONVGRAD_TORCH_NATIVE"],
                             ("", "on", "1"), ("off", "0")),
        cc=_tool(text["CC"], "cc"),
        cxx=_tool(text["CXX"], "c++"),
        ar=_tool(text["AR"], "ar"),
        path=raw["PATH"],
        omp_num_threads=int(threads) if threads.isdigit() and int(threads) > 0 else None,
        kmp_init_at_fork=text["KMP_INIT_AT_FORK"].strip(),
    )


_override: Settings | None = None
_parsed: tuple[tuple[str | None, ...], Settings] | None = None


def current() -> Settings:
    """The settings in force: an installed snapshot (use, using), else the environment's
    now."""
    global _parsed
    if _override is not None:
        return _override
    values = tuple(map(os.environ.get, NAMES))
    parsed = _parsed
    if parsed is None or parsed[0] != values:
        parsed = (values, parse(dict(zip(NAMES, values, strict=True))))
        _parsed = parsed  # one assignment: threads see the old pair or the new one
    return parsed[1]


def values_of(*names: str) -> tuple[str | None, ...]:
    """The raw values of a few variables, for a memo key on a hot path (current()
    reads them all)."""
    if _override is not None:
        environment = _override.environment()
        return tuple(environment[name] for name in names)
    return tuple(map(os.environ.get, names))


def use(settings: Settings | None) -> None:
    """Installs `settings` for the whole process (None: the environment's again)."""
    global _override
    _override = settings


@contextlib.contextmanager
def using(settings: Settings) -> Iterator[Settings]:
    """Within: `settings` are in force for the whole process."""
    previous = _override
    use(settings)
    try:
        yield settings
    finally:
        use(previous)


def adopt(environment: Mapping[str, str | None]) -> Settings:
    """A build worker takes its parent's settings: installed, and the parent's PATH in
    this process's environment (the compilers it starts look their tools up there)."""
    settings = parse(environment)
    use(settings)
    if settings.path is not None:
        os.environ["PATH"] = settings.path
    return settings

