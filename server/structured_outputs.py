"""The request body's structured-output fields -> one ``StructuredOutputsParams``.

Three spellings reach the same constraint, as in vLLM: OpenAI's ``response_format``
(``json_object``, or ``json_schema`` with its ``schema``), vLLM's ``structured_outputs`` object
(the dataclass's own keys), and the older ``guided_json`` / ``guided_regex`` / ``guided_choice``
/ ``guided_grammar`` (with ``guided_whitespace_pattern``). A request may use one constraint; two
(from any spellings) are a 400 naming both. The options of ``structured_outputs``
(``disable_any_whitespace``, ...) also apply to a constraint given another way. ``strict`` is
accepted and has no further effect: the schema is always enforced.
"""

from __future__ import annotations

from typing import Any

from jaxserve import InvalidRequestError, StructuredOutputsParams

from .errors import APIError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# structured_outputs keys besides the constraints: options that shape it.
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def _from_response_format(req: Any) -> tuple[str, dict[str, Any]] | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "response_format", {"json_object": True}
    # json_schema (the protocol refuses other types)
    spec = fmt.json_schema
    schema = None if spec is None else spec.json_schema
    if schema is None:
        raise APIError(400, "response_format: type 'json_schema' needs json_schema.schema", param="response_format")
    return "response_format", {"json": schema}


def _from_structured_outputs(req: Any) -> tuple[tuple[str, dict[str, Any]] | None, dict[str, Any]]:
    body = req.structured_outputs
    if body is None:
        return None, {}
    fields = body.given()
    options = {k: fields.pop(k) for k in _OPTIONS if k in fields}
    if fields.get("json_object") is False:
        fields.pop("json_object")
    return (("structured_outputs", fields) if fields else None), options


def structured_outputs_from_request(req: Any) -> StructuredOutputsParams | None:
    """The request's constraint, or None without one. Raises ``APIError`` (400) for two
    constraints or one that is malformed in itself; a schema, regex or grammar the engine cannot
    compile is refused when the request is added (also a 400)."""
    sources = []
    found = _from_response_format(req)
    if found:
        sources.append(found)
    found, options = _from_structured_outputs(req)
    if found:
        sources.append(found)
    for field, kind in _GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            sources.append((field, {kind: value}))
    if req.guided_whitespace_pattern is not None:
        options.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    if not sources:
        if req.structured_outputs is None:
            return None
        sources.append(("structured_outputs", {}))  # options alone: refused below, naming the choices
    constraints = [(field, k) for field, spec in sources for k in spec]
    if len(constraints) > 1:
        names = ", ".join(f"{field}.{k}" if field == "structured_outputs" else field for field, k in constraints)
        raise APIError(400, f"structured outputs: use one constraint per request, got {names}",
                       param=constraints[1][0])
    field, spec = sources[0]
    try:
        return StructuredOutputsParams(**spec, **options)
    except InvalidRequestError as e:
        param = e.param if field == "structured_outputs" else field
        raise APIError(400, f"{param}: {e.reason}", param=param) from None
