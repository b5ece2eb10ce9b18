"""Anthropic Messages API requests (`/v1/messages`, `/v1/messages/count_tokens`) as pydantic models, and
their translation to the chat request the rest of the server already runs.

The translation is what makes one template, one parser and one prefix cache serve both APIs: `system`
becomes a system message; a user turn's tool_result blocks become tool messages (in order, before the
turn's text, as they answer the previous assistant turn's calls); an assistant turn's thinking, text and
tool_use blocks become its reasoning_content, content and tool_calls; tools and tool_choice map to their
OpenAI forms ("any" is "required"); `thinking` sets the template's enable_thinking. An agent that sends
its history back therefore renders to the same tokens each turn, and the cache hits.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from ninfer_rt.serve.protocol import MAX_TOKENS_CEILING, ChatCompletionRequest, _bounded, _Strict, validate_body


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or ())
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)]
    stream: bool = False
    temperature: _bounded(ge=0.0, le=1.0) | None = None  # Anthropic's range
    top_p: _bounded(gt=0.0, le=1.0) | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    stop_sequences: list[str] | None = None


def as_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that renders and samples as the Messages request asks."""
    data: dict[str, Any] = {"model": body.model, "messages": _chat_messages(body)}
    if body.tools:
        data["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in body.tools
        ]
    if body.tool_choice is not None:
        data["tool_choice"] = _tool_choice(body.tool_choice)
    if body.thinking is not None:
        data["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        data.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences)
        data.update({k: getattr(body, k) for k in ("temperature", "top_p", "top_k") if getattr(body, k) is not None})
    return validate_body({k: v for k, v in data.items() if v is not None}, ChatCompletionRequest)


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name or ""}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        if message.role == "user":
            messages.extend(_user_turn(message.blocks()))
        else:
            messages.append(_assistant_turn(message.blocks()))
    return messages


def _user_turn(blocks: list[Any]) -> list[dict[str, Any]]:
    turn = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in blocks if b.type == "tool_result"]
    text = "".join(b.text for b in blocks if b.type == "text")
    if text or not turn:
        turn.append({"role": "user", "content": text})
    return turn


def _assistant_turn(blocks: list[Any]) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.type == "text")}
    thinking = [b.thinking for b in blocks if b.type == "thinking"]
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    calls = [b for b in blocks if b.type == "tool_use"]
    if calls:
        turn["tool_calls"] = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
            for b in calls
        ]
    return turn
