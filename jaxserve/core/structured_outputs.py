"""Structured outputs: the constraint a request's output must satisfy (vLLM 0.11's
``StructuredOutputsParams``), and the hooks through which the scheduler asks about its grammar.

Pure Python: the grammar engine (llguidance) lives in ``jaxserve.structured``; the scheduler sees
only the ``StructuredOutputHooks`` protocol, so the core never imports it.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Protocol

from jaxserve.exceptions import InvalidRequestError

# The constraint fields, exactly one of which a request sets.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on the output: ``json`` (a JSON schema, dict or text), ``regex`` (Rust regex
    syntax, matched in full), ``choice`` (one of these strings), ``grammar`` (a Lark grammar in
    llguidance's dialect; GBNF is converted), or ``json_object`` (any JSON object).

    ``disable_any_whitespace`` allows no whitespace between JSON tokens (by default any JSON
    whitespace is allowed there); ``disable_additional_properties`` makes objects of ``json``
    that do not say otherwise closed (``additionalProperties: false``); ``whitespace_pattern``
    is a regex for the whitespace between JSON tokens.
    Invariant after construction: exactly one constraint is set, with the right type.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        chosen = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequestError(
                "structured_outputs",
                f"exactly one of {', '.join(CONSTRAINT_KINDS)} must be set, got "
                f"{', '.join(chosen) if chosen else 'none'}")
        self._check_types()

    def _check_types(self) -> None:
        def fail(field: str, reason: str) -> None:
            raise InvalidRequestError(f"structured_outputs.{field}", reason)

        if self.json is not None and not isinstance(self.json, (str, dict)):
            fail("json", f"must be a JSON schema (an object or its text), got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            fail("regex", "must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            fail("grammar", "must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                fail("choice", "must be a non-empty list of strings")
            if any(not isinstance(c, str) for c in self.choice):
                fail("choice", f"must be a list of strings, got {self.choice!r}")
        if self.json_object is not None and self.json_object is not True and self.json_object is not False:
            fail("json_object", f"must be a boolean, got {self.json_object!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            fail("whitespace_pattern", "must be a string")

    @property
    def kind(self) -> str:
        """The name of the one constraint set (``json``, ``regex``, ...)."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    def spec_text(self) -> str:
        """The constraint as text: the schema, regex or grammar itself, or the choices as JSON."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, dict):
            return _json.dumps(value, sort_keys=True)
        if self.kind in ("choice", "json_object"):
            return _json.dumps(value)
        return value

    def cache_key(self) -> tuple:
        """Equal for two requests whose grammars are the same (their compile is shared)."""
        return (self.kind, self.spec_text(), self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)


# The states of a request's grammar, as the scheduler sees them.
GRAMMAR_PENDING = "pending"
GRAMMAR_READY = "ready"
GRAMMAR_FAILED = "failed"


class StructuredOutputHooks(Protocol):
    """What the scheduler needs from the grammar engine (``jaxserve.structured``)."""

    def grammar_status(self, request_id: str) -> str:
        """``GRAMMAR_PENDING`` while compiling, then ``GRAMMAR_READY`` or ``GRAMMAR_FAILED``."""
        ...

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the request's matcher; True if the request must stop: its grammar took the end
        token it forces once complete (stopping even a request that ignores EOS), or rejected a
        token."""
        ...

    def release(self, request_id: str) -> None:
        """The request is finished: drop its matcher."""
        ...

    def validate_tokens(self, request_id: str, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar accepts next, without advancing it
        (speculative decoding cuts a request's drafts at the first invalid one)."""
        ...
