"""Breaking changes to the click commands an API module declares (``drivetrain ckpt ...``, core's own commands).

A command's options are API (docs/versioning.md) but live in decorators, which griffe's check does not compare.
They are read statically from griffe's copy of the decorators, so the released CLI is never imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

import griffe

COMMAND_DECORATORS = {"command", "group"}


@dataclass(frozen=True)
class Param:
    """One argument or option as its decorator declares it."""

    kind: str  # "argument" or "option"
    names: tuple[str, ...]  # the argument's name, or every flag of the option ("--json")
    required: bool
    choices: frozenset[str] | None


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _param(call: ast.Call, kind: str) -> Param:
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    strings = [str(_literal(a)) for a in call.args if isinstance(_literal(a), str)]
    names = tuple(strings[:1]) if kind == "argument" else tuple(s for s in strings if s.startswith("-"))
    if kind == "argument":
        optional = "default" in keywords or _literal(keywords.get("nargs", ast.Constant(1))) == -1
        required = _literal(keywords["required"]) is True if "required" in keywords else not optional
    else:
        required = "required" in keywords and _literal(keywords["required"]) is True
    choices = None
    kind_node = keywords.get("type")
    if isinstance(kind_node, ast.Call) and ast.unparse(kind_node.func).endswith("Choice") and kind_node.args:
        values = _literal(kind_node.args[0])
        choices = frozenset(map(str, values)) if isinstance(values, list | tuple) else None
    return Param(kind=kind, names=names, required=required, choices=choices)


def _command(function: griffe.Object) -> tuple[str, list[Param]] | None:
    """The command name and parameters of a click-decorated ``function`` (decorators run bottom-up)."""
    name, params = None, []
    for decorator in function.decorators:
        call = ast.parse(str(decorator.value), mode="eval").body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        attr = call.func.attr
        if attr in COMMAND_DECORATORS:
            given = [k.value for k in call.keywords if k.arg == "name"] + call.args[:1]
            name = str(_literal(given[0])) if given else function.name
        elif attr in ("argument", "option"):
            params.append(_param(call, attr))
    return None if name is None else (name, params)


def commands(module: griffe.Object | griffe.Alias) -> Iterator[tuple[str, list[Param]]]:
    """Every click command declared in ``module`` and its submodules, keyed ``module:command``."""
    for member in module.members.values():
        if member.is_alias:
            continue
        if member.is_module:
            yield from commands(member)
        elif member.is_function:
            found = _command(member)
            if found is not None:
                yield f"{module.path}:{found[0]}", found[1]


def _option_breaks(key: str, old: list[Param], new: list[Param]) -> Iterator[str]:
    for before in (p for p in old if p.kind == "option"):
        after = next((p for p in new if p.kind == "option" and set(p.names) & set(before.names)), None)
        if after is None:
            yield f"{key}: option {'/'.join(before.names)} was removed"
            continue
        for flag in sorted(set(before.names) - set(after.names)):
            yield f"{key}: option {flag} was removed"
        if after.required and not before.required:
            yield f"{key}: option {'/'.join(after.names)} became required"
        if before.choices is not None and after.choices is not None and before.choices - after.choices:
            yield f"{key}: option {'/'.join(after.names)} lost choices {sorted(before.choices - after.choices)}"
    old_flags = {flag for p in old for flag in p.names}
    for after in (p for p in new if p.kind == "option" and p.required):
        if not set(after.names) & old_flags:
            yield f"{key}: required option {'/'.join(after.names)} was added"


def cli_breaks(old: griffe.Object | griffe.Alias, new: griffe.Object | griffe.Alias) -> list[str]:
    """One line per breaking change to the commands ``old`` declares, against ``new``."""
    before, after = dict(commands(old)), dict(commands(new))
    lines = []
    for key, params in before.items():
        if key not in after:
            lines.append(f"{key}: command was removed")
            continue
        old_args = [p for p in params if p.kind == "argument"]
        new_args = [p for p in after[key] if p.kind == "argument"]
        kept = [p.names for p in new_args[: len(old_args)]]
        if kept != [p.names for p in old_args] or any(p.required for p in new_args[len(old_args) :]):
            old_form = " ".join(n for p in old_args for n in p.names)
            new_form = " ".join(n for p in new_args for n in p.names)
            lines.append(f"{key}: arguments changed: {old_form} -> {new_form}")
        lines.extend(_option_breaks(key, params, after[key]))
    return lines
