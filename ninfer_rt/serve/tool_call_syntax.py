"""Which syntax a model writes its tool calls in, read off its chat template.

The template is what the model was trained to answer in, so it decides: a template that writes
``<function=`` (Qwen3.5, Qwen3.6, Qwen3-Coder) uses the XML-like body of tool_calls_xml.py, any other
Qwen3's JSON body. The model type would not do: a Qwen3.5 checkpoint may ship a template of either kind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer_rt.serve.tool_calls_xml import XmlToolCalls, template_writes_xml_calls


@dataclass(frozen=True)
class JsonToolCalls:
    """Qwen3's syntax: a JSON object with name and arguments."""

    def forced_opening(self, function: str | None) -> str:
        return "" if function is None else '\n{"name": "' + function + '", "arguments":'


ToolCallSyntax = JsonToolCalls | XmlToolCalls


def tool_call_syntax(template_source: str, tools: Sequence[Mapping[str, Any]] | None) -> ToolCallSyntax:
    """How a model with this chat template writes tool calls: chosen by the template's own text, since the
    template is what the model was trained to answer in (a template that writes ``<function=`` is XML)."""
    return XmlToolCalls.for_tools(tools) if template_writes_xml_calls(template_source) else JsonToolCalls()
