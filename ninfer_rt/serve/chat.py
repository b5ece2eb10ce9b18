"""The model's own chat template, rendered the way Hugging Face transformers renders it.

Same Jinja settings as ``apply_chat_template`` (trim_blocks, lstrip_blocks, loopcontrols, an immutable
sandbox since the template comes with the checkpoint), the same globals (``raise_exception``,
``strftime_now``), the same ``tojson``, and the same variables: messages, tools, add_generation_prompt,
the special tokens, plus whatever extra kwargs the client sends (enable_thinking, preserve_thinking, ...).
Matching HF exactly matters: the model was trained on these bytes, and an agent's next turn must render
its history to the same tokens for the prefix cache to hit.

One preparation HF leaves to the caller: templates that write tool calls in the XML-like form (Qwen3.5,
Qwen3.6) iterate each call's ``arguments`` as a mapping, while the OpenAI API carries a JSON text; for those
templates the text is decoded here, in its key order, so the call renders as the model wrote it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer_rt.serve.tool_call_syntax import ToolCallSyntax, tool_call_syntax
from ninfer_rt.serve.tool_calls_xml import XmlToolCalls, arguments_as_mapping

# Variables the server sets itself, and the template's globals; a client's chat_template_kwargs may not
# override them.
RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"}
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed on it: the client's request is bad."""


class ReservedVariables(ChatTemplateError):
    """Extra template variables that would replace the server's own."""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    # what add_generation_prompt appended, e.g. "<|im_start|>assistant\n<think>\n": says whether the
    # model starts inside reasoning, or whether this turn's think block is already closed
    generation_prompt: str
    # how the model is asked to write tool calls, with the tools' parameter schemas where it matters
    tool_syntax: ToolCallSyntax


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # HF's override of Jinja's tojson: no HTML escaping, non-ASCII kept, same defaults as json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from None
        self._source = source
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> RenderedPrompt:
        """`variables` and `kwargs` are extra template variables (enable_thinking, ...); `variables` may hold
        any name a client sends, even one that is a parameter of this method."""
        kwargs = {**(variables or {}), **kwargs}
        clashes = RESERVED_VARIABLES & kwargs.keys()
        if clashes:
            raise ReservedVariables(f"chat_template_kwargs may not set {', '.join(sorted(clashes))}")
        syntax = tool_call_syntax(self._source, tools)
        if isinstance(syntax, XmlToolCalls):
            try:
                messages = arguments_as_mapping(messages)
            except ValueError as exc:
                raise ChatTemplateError(str(exc)) from None
        text = self._render(messages, tools, add_generation_prompt, kwargs)
        if not add_generation_prompt:
            return RenderedPrompt(text, "", syntax)
        history = self._render(messages, tools, False, kwargs)
        generation_prompt = text[len(history) :] if text.startswith(history) else ""
        return RenderedPrompt(text, generation_prompt, syntax)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        try:
            # one mapping, not keywords: a variable may be named like a parameter of render() ("self")
            return self._template.render({
                **kwargs,
                **self._special,
                "messages": list(messages),
                "tools": list(tools) if tools else None,
                "add_generation_prompt": add_generation_prompt,
            })
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError, RecursionError) as exc:
            # e.g. a message without the field the template reads: the conversation, not the server, is wrong
            raise ChatTemplateError(f"chat template cannot render these messages: {exc}") from None
