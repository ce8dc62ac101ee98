"""What a chat request's ``tools`` and ``tool_choice`` mean for generation and parsing.

``tool_choice`` resolves to one of four modes, as in vLLM: ``none`` (the template still sees the
tools; the output is plain content), ``auto`` (the model may call; the server's
``--tool-call-parser`` reads its calls, and without ``--enable-auto-tool-choice`` it is refused),
``required`` and a named function. The last two are enforced with structured outputs: the JSON
schema from ``tool_choice_schema`` constrains the output, so even a random model answers with
calls whose arguments validate against the function's ``parameters``. Leaving ``tool_choice``
out means ``auto`` when tools are given, ``none`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve import InvalidRequestError

# The schema of a function that declares no parameters: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    """A resolved ``tool_choice``: ``mode`` is none, auto, required or named (then ``function``)."""

    mode: str
    function: str | None = None


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return _function(tool).get("parameters") or ANY_OBJECT


def tool_choice_schema(tools: list[dict[str, Any]], choice: ToolChoice,
                       parallel_tool_calls: bool | None = None) -> dict[str, Any] | None:
    """The JSON schema the output must follow: for ``required`` a non-empty array of
    ``{name, arguments}`` objects, each one of the tools (``name`` a ``const``, ``arguments`` its
    ``parameters``), at most one item when ``parallel_tool_calls`` is false; for a named function
    its ``parameters``; None for the free modes. ``tools`` are OpenAI tool objects."""
    if choice.mode == "named":
        for tool in tools:
            if _function(tool).get("name") == choice.function:
                return _parameters(tool)
        raise ValueError(f"tool {choice.function!r} is not among the tools")
    if choice.mode != "required":
        return None
    variants = [{
        "type": "object",
        "properties": {"name": {"type": "string", "const": _function(tool)["name"]},
                       "arguments": _parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def resolve_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: Any, *,
                        auto_enabled: bool) -> ToolChoice:
    """The mode of a request; ``InvalidRequestError`` for a choice that cannot work (vLLM's
    messages). ``tool_choice`` is "none", "auto", "required", a named-function object
    (with ``.function.name``) or None; ``auto_enabled`` says the server has a tool parser."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoice("none")
    if not tools:
        raise InvalidRequestError("tool_choice", "when using `tool_choice`, `tools` must be set")
    if tool_choice == "auto":
        if not auto_enabled:
            raise InvalidRequestError("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                            "--tool-call-parser to be set")
        return ToolChoice("auto")
    if tool_choice == "required":
        return ToolChoice("required")
    name = tool_choice.function.name
    if name not in {_function(t).get("name") for t in tools}:
        raise InvalidRequestError("tool_choice", f"tool {name!r} has not been passed in `tools`")
    return ToolChoice("named", name)
