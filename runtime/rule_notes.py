"""Which planner rule derived each choice of a resolved plan, and the measured notes of
the constants that rule reads (`convgrad explain --notes`).

The rules are pure functions of a configuration and a plan (codegen/rules_*.py); a
variant's record (codegen/choices.py) gathers what some of them return. A choice is
attributed to the first of its variant's rules (VariantSpec.rules: RULES) that returns
it with that value: a dict of choices, or one value under the rule's own name
(`pad_columns_below`). The rest are the variant's own (BODY: its VariantSpec.fill); its
fixed values (choices.fixed) are no derived choice.
A rule's notes are the comment blocks above the module constants it reads, directly
or through the module's private helpers: each carries the measurements that set it.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache

from convgrad.codegen.config import KernelConfig
from convgrad.codegen.plan import SPECS, KernelPlan, Variant

Rule = Callable[..., object]

# The rules of each variant: its spec's (codegen/variant.py).
RULES: Mapping[Variant, tuple[Rule, ...]] = types.MappingProxyType(
    {spec.variant: spec.rules for spec in SPECS})
BODY = "VariantSpec.fill"  # choices the variant's own code sets (no rule function)


@dataclass(frozen=True)
class Note:
    """A module constant a rule reads: where it is, its value and the comment above it."""

    name: str
    module: str
    value: object
    comment: str


def rule_name(rule: Rule) -> str:
    """A rule's name as explain prints it: `module.function`."""
    return f"{rule.__module__.rsplit('.', 1)[-1]}.{rule.__name__}"


def attribute(config: KernelConfig, resolved: KernelPlan) -> dict[str, list[str]]:
    """{rule name: the choices of `resolved` it derived}, BODY's last."""
    left = dict(resolved.choices)
    found: dict[str, list[str]] = {}
    for rule in resolved.spec.rules:
        value = rule(config, resolved.overrides)
        given = value if isinstance(value, Mapping) else {rule.__name__: value}
        mine = [k for k, v in given.items() if k in left and _same(left[k], v)]
        for key in mine:
            del left[key]
        if mine:
            found[rule_name(rule)] = sorted(mine)
    if left:
        found[BODY] = sorted(left)
    return found


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, list):  # records keep tuples
        return a == tuple(tuple(x) if isinstance(x, list) else x for x in b)
    return a == b


def notes(rule: Rule) -> list[Note]:
    """The constants `rule` reads (through its module's private helpers too), each with
    the comment block above its assignment."""
    seen: dict[str, Note] = {}
    _collect(rule, seen, set())
    return sorted(seen.values(), key=lambda note: (note.module, note.name))


def _collect(function: types.FunctionType, seen: dict[str, Note], visited: set) -> None:
    if function in visited:
        return
    visited.add(function)
    scope = function.__globals__
    for name in _names(function.__code__):
        value = scope.get(name)
        if name.isupper() and name not in seen and not callable(value):
            module = _defining_module(name, scope["__name__"])
            seen[name] = Note(name, module.rsplit(".", 1)[-1], value,
                              _comments(module).get(name, ""))
        elif (isinstance(value, types.FunctionType) and value.__name__.startswith("_")
              and value.__module__ == function.__module__):
            _collect(value, seen, visited)


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # comprehensions, nested functions
            names |= _names(const)
    return names


def _defining_module(name: str, module: str) -> str:
    """The module of `module`'s package whose top level assigns `name` (`module` itself,
    or one it imports `name` from)."""
    if name in _comments(module):
        return module
    package = sys.modules[module].__package__
    for other in sorted(sys.modules):
        if (other.startswith(f"{package}.")
                and str(getattr(sys.modules[other], "__file__", "")).endswith(".py")
                and name in _comments(other)):
            return other
    return module


@cache
def _comments(module: str) -> dict[str, str]:
    """{constant: the comment lines right above its top-level assignment, and those on
    its own lines}. A constant with neither, right under another, shares that one's."""
    source = inspect.getsource(sys.modules[module])
    lines = source.splitlines()
    inline: dict[int, str] = {}  # line number -> the comment ending it
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and lines[token.start[0] - 1].lstrip()[:1] != "#":
            inline[token.start[0]] = token.string.lstrip("# ").rstrip()
    found, previous, shared = {}, None, ""
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            previous = None
            continue
        block, row = [], node.lineno - 2
        while row >= 0 and lines[row].startswith("#"):
            block.insert(0, lines[row].lstrip("# ").rstrip())
            row -= 1
        block += [inline[n] for n in range(node.lineno, node.end_lineno + 1) if n in inline]
        if block:
            shared = " ".join(block)
        elif previous is None or previous.end_lineno != node.lineno - 1:
            shared = ""
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Name):
                found[target.id] = shared
        previous = node
    return found
