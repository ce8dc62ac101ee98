"""Command-line flags generated from dataclass fields: one ``--field-name`` per field, its help
the docstring under the field. Shared by ``EngineConfig`` and the server's ``FrontendArgs``, so a
new field is a new flag with no second list to keep in sync.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from typing import Any, Literal, get_args, get_origin, get_type_hints

# vLLM's short spellings of some flags, besides the long one every field gets.
CLI_SHORT_FLAGS: dict[str, str] = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp"}


@dataclasses.dataclass(frozen=True)
class Flag:
    """One field as the command line sees it."""

    field: dataclasses.Field
    kind: Any  # the resolved type hint
    doc: str

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


_FLAGS: dict[type, tuple[Flag, ...]] = {}


def dataclass_flags(cls: type) -> tuple[Flag, ...]:
    """``cls``'s init fields in order, with their types and docstrings."""
    if cls not in _FLAGS:
        _FLAGS[cls] = _make_flags(cls)
    return _FLAGS[cls]


def _make_flags(cls: type) -> tuple[Flag, ...]:
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    return tuple(Flag(f, hints[f.name], docs.get(f.name, "")) for f in dataclasses.fields(cls) if f.init)


def add_flags(parser: Any, flags: tuple[Flag, ...] | list[Flag], skip: tuple[str, ...] = ()) -> None:
    """Add one argparse option per flag to ``parser`` (a parser or an argument group)."""
    for flag in flags:
        if flag.name in skip:
            continue
        names = [flag.option] + ([CLI_SHORT_FLAGS[flag.name]] if flag.name in CLI_SHORT_FLAGS else [])
        default = flag.field.default
        # A docstring that explains its default says more than the bare value (often None).
        help_text = flag.doc if "default" in flag.doc.lower() else f"{flag.doc} (default: {default})"
        kind = flag.kind
        if "cli_type" in flag.field.metadata:  # a field whose flag takes more than one spelling
            parser.add_argument(*names, dest=flag.name, type=flag.field.metadata["cli_type"], default=default,
                                help=help_text)
        elif kind is bool or kind == (bool | None):
            parser.add_argument(*names, dest=flag.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif get_origin(kind) is Literal:
            parser.add_argument(*names, dest=flag.name, choices=get_args(kind), default=default, help=help_text)
        elif list in (get_origin(kind), *map(get_origin, get_args(kind))):  # list[str]: one or more values
            parser.add_argument(*names, dest=flag.name, nargs="+", default=default, help=help_text)
        else:
            base = next((t for t in (int, float, str) if t is kind or t in get_args(kind)), str)
            parser.add_argument(*names, dest=flag.name, type=base, default=default, help=help_text)


def flags_for(flags: tuple[Flag, ...] | list[Flag], values: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """The command line that gives ``values`` from the defaults (the flags of changed fields)."""
    out = []
    for flag in flags:
        value = values[flag.name]
        if flag.name in skip or value == flag.field.default:
            continue
        if isinstance(value, bool):
            out.append(flag.option if value else "--no-" + flag.option[2:])
        elif isinstance(value, list):
            out += [flag.option, *map(str, value)]
        elif value is not None:
            out += [flag.option, str(value)]
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal under each field) of ``cls`` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        class_def = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(class_def, ast.ClassDef)
        body = class_def.body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)):
                docs[node.target.id] = str(nxt.value.value)
    return docs
