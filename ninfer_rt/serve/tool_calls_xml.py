"""Tool calls as Qwen3.5 / Qwen3.6 (and Qwen3-Coder) templates write them: an XML-like body, not JSON.

Inside ``<tool_call>`` ... ``</tool_call>`` the template writes::

    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>

and, rendering history, iterates ``arguments`` as a mapping: a string value is written verbatim, any other
value as its ``tojson``. Which syntax a model uses is read off its chat template: a template that contains
``<function=`` writes (and so was trained on) this form; any other writes Qwen3's JSON body.

Values are typed from the tool's JSON schema, so the client gets ``{"days": 3}``, not ``{"days": "3"}``:
integer, number, boolean, null, object and array values are parsed (JSON spellings, and Python's
True/False/None, which a template rendering with ``|string`` writes); a value that does not parse as its
type, a string parameter and a parameter the schema does not describe stay the exact text. A value written
the way the template writes it renders back to the same text; other spellings of the same value (``2.50``,
``{"a":1}``) come back in the template's spelling on the next turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FUNCTION_MARKER = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
_FUNCTION_OPENING = re.compile(r"\s*<function=([^>\n]+)>")
_NOT_PARSED = object()
_PYTHON_SPELLINGS = {"True": True, "False": False, "None": None}
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "object": (dict,),
    "array": (list,),
}


def template_writes_xml_calls(template_source: str) -> bool:
    return FUNCTION_MARKER in template_source


@dataclass(frozen=True)
class XmlToolCalls:
    """The XML-like syntax, with the parameter schemas of the request's tools (function name -> properties)."""

    properties: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def for_tools(cls, tools: Sequence[Mapping[str, Any]] | None) -> XmlToolCalls:
        properties: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function", tool)
            properties[function["name"]] = (function.get("parameters") or {}).get("properties") or {}
        return cls(properties)

    def forced_opening(self, function: str | None) -> str:
        """The body's opening, written up to the first parameter, for a call the server forces."""
        return "" if function is None else "\n" + FUNCTION_MARKER + function + ">\n"


@dataclass
class XmlCallPiece:
    """What a body emitted: the call's name once, then fragments of its arguments JSON."""

    arguments: str = ""
    name: str | None = None


class XmlCallBody:
    """One tool-call body, fed its text as it grows. The call opens once ``<function=NAME>`` is complete;
    each parameter is emitted, typed, once its ``</parameter>`` arrives, as a fragment of the arguments JSON
    (``{"a": 1`` then ``, "b": "x"``, the closing brace at the end), so fragments concatenate to it."""

    def __init__(self, syntax: XmlToolCalls) -> None:
        self._syntax = syntax
        self.name: str | None = None
        self._schema: Mapping[str, Any] = {}
        self._pos = 0  # where the next parameter may start
        self._emitted_any = False
        self._done = False  # </function> seen: later text is not parameters

    @property
    def opened(self) -> bool:
        return self.name is not None

    def update(self, body: str) -> list[XmlCallPiece]:
        pieces: list[XmlCallPiece] = []
        if self.name is None:
            opening = _FUNCTION_OPENING.match(body)
            if opening is None:
                return pieces
            self.name = opening.group(1).strip()
            self._schema = self._syntax.properties.get(self.name, {})
            self._pos = opening.end()
            pieces.append(XmlCallPiece(name=self.name))
        while not self._done and (parameter := self._next_parameter(body)) is not None:
            pieces.append(self._parameter_piece(*parameter))
        return pieces

    def close(self, body: str) -> list[XmlCallPiece]:
        """The body ended (or was cut off): a parameter left open takes the text it got; the JSON is closed."""
        pieces = self.update(body)
        if not self._done:
            start = body.find(PARAMETER_OPEN, self._pos)
            key_end = body.find(">", start) if start >= 0 else -1
            if key_end >= 0:
                rest = body[key_end + 1 :]
                value = rest[: rest.find(FUNCTION_CLOSE)] if FUNCTION_CLOSE in rest else rest
                pieces.append(self._parameter_piece(body[start + len(PARAMETER_OPEN) : key_end], _unglue(value)))
        pieces.append(XmlCallPiece(arguments="}" if self._emitted_any else "{}"))
        return pieces

    def _next_parameter(self, body: str) -> tuple[str, str] | None:
        """The next complete parameter as (key, value text), advancing past it; None if it is not complete."""
        start = body.find(PARAMETER_OPEN, self._pos)
        function_end = body.find(FUNCTION_CLOSE, self._pos)
        if function_end >= 0 and (start < 0 or function_end < start):
            self._done = True
            return None
        key_end = body.find(">", start) if start >= 0 else -1
        end = body.find(PARAMETER_CLOSE, key_end) if key_end >= 0 else -1
        if end < 0:
            return None
        self._pos = end + len(PARAMETER_CLOSE)
        return body[start + len(PARAMETER_OPEN) : key_end], _unglue(body[key_end + 1 : end])

    def _parameter_piece(self, key: str, text: str) -> XmlCallPiece:
        value = typed_value(text, self._schema.get(key))
        fragment = ("{" if not self._emitted_any else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self._emitted_any = True
        return XmlCallPiece(arguments=fragment + json.dumps(value, ensure_ascii=False))


def _unglue(value: str) -> str:
    """The value without the one newline the template writes on each side of it."""
    return value.removeprefix("\n").removesuffix("\n")


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """`text` as the schema's type when it parses as one; otherwise the text itself."""
    types = (schema or {}).get("type")
    for name in [types] if isinstance(types, str) else list(types or ()):
        if name in _JSON_TYPES:
            value = _parse_scalar_or_json(text)
            if _is_type(value, name):
                return value
    return text


def _parse_scalar_or_json(text: str) -> Any:
    stripped = text.strip()
    if stripped in _PYTHON_SPELLINGS:
        return _PYTHON_SPELLINGS[stripped]
    try:
        return json.loads(stripped)
    except ValueError:
        return _NOT_PARSED


def _is_type(value: Any, name: str) -> bool:
    if value is _NOT_PARSED or (isinstance(value, bool) and name in ("integer", "number")):
        return False
    return isinstance(value, _JSON_TYPES[name])


def arguments_as_mapping(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages with each tool call's JSON-text arguments (what the OpenAI API carries) decoded to the
    mapping this syntax's templates iterate. Raises ValueError naming the call whose arguments are not a
    JSON object."""
    prepared: list[Mapping[str, Any]] = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not calls:
            prepared.append(message)
            continue
        decoded = [_call_with_mapping(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
        prepared.append({**message, "tool_calls": decoded})
    return prepared


def _call_with_mapping(call: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments is not a JSON object")
    return {**call, "function": {**function, "arguments": arguments}}
