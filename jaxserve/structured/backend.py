"""Grammars for one tokenizer: a request's ``StructuredOutputsParams`` -> llguidance grammar text,
checked at admission, compiled into a matcher off the engine thread, and cached.

The compile cache is keyed by the constraint (``StructuredOutputsParams.cache_key``) and lives in
this object, which belongs to one tokenizer, so the key is in effect (grammar, tokenizer). A
cached entry is a compiled matcher in its initial state; each request gets a ``deep_copy``.
"""

from __future__ import annotations

import copy
import json
import threading
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from jaxserve.core.locked_lru import LockedLRU
from jaxserve.core.structured_outputs import StructuredOutputsParams
from jaxserve.exceptions import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compiled grammars kept per backend (least recently used dropped first).
COMPILE_CACHE_SIZE = 256


class GrammarError(RuntimeError):
    """A grammar that passed the admission check but failed to compile (a resource limit)."""


def ll_tokenizer_from_hf(hf_tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from a Hugging Face fast tokenizer (its Rust ``tokenizers`` half,
    serialised without padding or truncation), with the tokenizer's EOS id as the end token."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InvalidRequestError("structured_outputs", "structured outputs need a fast (tokenizers) tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), eos_token=hf_tokenizer.eos_token_id)


# Keywords whose value maps names to schemas, and keywords whose value is data, not a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples")


def _close_objects(schema: Any) -> Any:
    """``disable_additional_properties``: every object schema that does not say otherwise gets
    ``additionalProperties: false`` (a copy; the request's schema is not changed)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _close_objects(sub) for name, sub in value.items()}
        elif key in _DATA:
            out[key] = value
        else:
            out[key] = _close_objects(value)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarBackend:
    """llguidance for one Hugging Face tokenizer. ``check`` runs on the caller's thread (cheap: a
    parse, no tokenizer work); ``compile`` may run on any thread (llguidance drops the GIL)."""

    def __init__(self, hf_tokenizer: Any, max_grammar_bytes: int, any_whitespace: bool = False,
                 limits: llguidance.LLParserLimits | None = None):
        self.hf_tokenizer = hf_tokenizer
        # llguidance's resource limits (its "fuel" bounds the work of building the lexer and of
        # each mask): checked at admission and at compile. None: llguidance's defaults.
        self.limits = limits
        self.max_grammar_bytes = max_grammar_bytes
        self.any_whitespace = any_whitespace
        self._end_tokens: frozenset[int] | None = None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: LockedLRU[tuple, llguidance.LLMatcher] = LockedLRU(COMPILE_CACHE_SIZE)
        self._checked: LockedLRU[tuple, str] = LockedLRU(COMPILE_CACHE_SIZE)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use: about a second for a 150k vocabulary, so only engines that serve
        structured outputs pay for it."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer_from_hf(self.hf_tokenizer)
            return self._ll_tokenizer

    @property
    def end_tokens(self) -> frozenset[int]:
        """The token ids that end a complete grammar (the tokenizer's EOS)."""
        if self._end_tokens is None:
            self._end_tokens = frozenset(self.ll_tokenizer.eos_tokens)
        return self._end_tokens

    @property
    def vocab_size(self) -> int:
        return self.ll_tokenizer.vocab_size

    # ---- grammar text --------------------------------------------------------------------------

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        """llguidance's grammar for the constraint; raises ``InvalidRequestError`` for input that is
        not even well-formed (a schema that is not JSON)."""
        kind = params.kind
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InvalidRequestError("structured_outputs.json", f"the schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("structured_outputs.json", "the schema must be a JSON object")
            if params.disable_additional_properties:
                schema = _close_objects(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=self._json_options(params))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)  # type: ignore[arg-type]
        if kind == "choice":
            # Lark string literals use JSON's escapes, so any choice text is one literal.
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in params.choice))  # type: ignore[union-attr]
        assert params.grammar is not None  # the only kind left; StructuredOutputsParams checked it is set
        try:
            lark = any_to_lark(params.grammar)  # Lark passes through; GBNF is converted
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions for bad input
            raise InvalidRequestError("structured_outputs.grammar", f"cannot read the grammar: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def _json_options(self, params: StructuredOutputsParams) -> JsonCompileOptions:
        """Whitespace between JSON tokens: a request's ``whitespace_pattern``, else any JSON
        whitespace if the engine allows it, else none (compact JSON); never any with
        ``disable_any_whitespace``."""
        if params.disable_any_whitespace:
            return {"whitespace_flexible": False}
        if params.whitespace_pattern is not None:
            return {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
        return {"whitespace_flexible": self.any_whitespace}

    # ---- admission -----------------------------------------------------------------------------

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ``InvalidRequestError`` naming the problem if the constraint cannot be compiled:
        too large, or an invalid schema, regex or grammar. Results are cached by constraint."""
        key = params.cache_key()
        error = self._checked.get(key)
        if error is None:
            error = self._find_error(params)
            self._checked.put(key, error)
        if error:
            raise InvalidRequestError(f"structured_outputs.{params.kind}", error)

    def _find_error(self, params: StructuredOutputsParams) -> str:
        size = len(params.spec_text().encode())
        if size > self.max_grammar_bytes:
            return (f"the {params.kind} constraint is {size} bytes, more than the limit of "
                    f"{self.max_grammar_bytes} (structured_outputs_max_grammar_bytes)")
        try:
            grammar = self.grammar_text(params)
        except InvalidRequestError as e:
            return e.reason
        error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=self.limits)
        return f"invalid {_KIND_NAMES[params.kind]}: {error.strip()}" if error else ""

    # ---- compile -------------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher in its initial state; raises ``GrammarError`` if compiling fails."""
        key = params.cache_key()
        template = self._compiled.get(key)
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer, self.grammar_text(params), log_level=0,
                                            limits=self.limits)
            if template.is_error():
                raise GrammarError(f"invalid {_KIND_NAMES[params.kind]}: {template.get_error()}")
            self._compiled.put(key, template)
        return template.deep_copy()


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}
