"""Finding a parser class by the name given on the command line (tool and reasoning parsers)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def lookup(registry: dict[str, type[T]], name: str, flag: str) -> type[T]:
    """``registry[name]``; a ``ValueError`` naming ``flag`` and the known names otherwise."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"{flag}: unknown parser {name!r} (known: {', '.join(sorted(registry))})") from None
