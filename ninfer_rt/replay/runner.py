"""Replaying a trace against a running server through the OpenAI API.

Each lane is an asyncio task that sends its turns in order; lanes run concurrently, at most `lanes` requests
in flight. A conversation's next prompt is its previous messages plus the reply the server actually gave
(content, reasoning_content and tool_calls as returned) plus the turn's new content. Token-id
conversations (the completions route) re-send their previous prompt plus new ids: the API does not
return the reply's ids, and the shared prefix is then exactly the previous prompt, whose length the trace
controls to the token.

A lane stops at its first failed request (its conversation cannot go on without the reply); a server that
stops answering stops every lane. With a time limit, no turn starts after it (turns in flight finish), so a
replay that must fit a fixed slot of machine time still ends with a summary.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ninfer_rt.replay.sse_lines import sse_lines
from ninfer_rt.replay.trace import ALIGN_PAGE, Turn, synth_ids, synth_words, text_of, tool_specs

MAX_ALIGN_ATTEMPTS = 4  # words that merge into fewer tokens than expected need another round, rarely two


class ServerDied(RuntimeError):
    """The server stopped answering (connection refused, reset, or unhealthy)."""


@dataclass(frozen=True)
class ReplayConfig:
    url: str
    api_key: str | None = None
    model: str | None = None  # None: the first model /v1/models lists
    lanes: int | None = None  # most requests in flight; None: one per lane in the trace
    timeout_s: float = 600.0  # a 115k-token cold prefill on a slow GPU takes minutes
    time_limit_s: float | None = None  # no turn starts later than this after the replay began


@dataclass
class RequestRecord:
    """One request's outcome: a line of the per-request JSON output."""

    index: int  # position in the trace
    lane: str
    conversation: str
    turn: int  # 1-based within its conversation
    route: str
    stream: bool
    status: int | None = None  # HTTP status; None if no response came
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    token_gaps_s: list[float] = field(default_factory=list)  # between token-bearing stream chunks
    token_chunks: int = 0
    align: int | None = None  # the residue the trace asked for, if any
    # The prompt starts with the conversation's previous prompt (and its reply, on the chat route): neither
    # a reset nor a new system prompt came between them, so a perfect prefix cache skips all of that.
    extends_previous: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def aligned(self) -> bool | None:
        return None if self.align is None else self.prompt_tokens % ALIGN_PAGE == self.align

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items()}
        out["aligned"] = self.aligned
        return out


@dataclass
class _Conversation:
    messages: list[dict[str, Any]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    turns: int = 0
    last_tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        self.messages, self.ids, self.last_tool_calls = [], [], []

    def set_system(self, text: str) -> None:
        if self.messages and self.messages[0]["role"] == "system":
            self.messages[0] = {"role": "system", "content": text}
        else:
            self.messages.insert(0, {"role": "system", "content": text})


@dataclass
class _Reply:
    """What came back: the parts an agent re-sends, usage and timings."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""  # completions route
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None


class Replayer:
    def __init__(self, config: ReplayConfig, on_record: Callable[[RequestRecord], None] = lambda r: None) -> None:
        self.config = config
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self.server_died: str | None = None
        self.not_sent = 0  # turns the time limit left unsent
        self._deadline = float("inf")
        self._conversations: dict[str, _Conversation] = {}
        self._model = config.model or ""
        self._client: httpx.AsyncClient | None = None

    async def run(self, turns: list[Turn]) -> list[RequestRecord]:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        timeout = httpx.Timeout(self.config.timeout_s, connect=10.0)
        async with httpx.AsyncClient(base_url=self.config.url, headers=headers, timeout=timeout) as client:
            self._client = client
            if self.config.time_limit_s is not None:
                self._deadline = time.monotonic() + self.config.time_limit_s
            if not self._model:
                try:
                    self._model = await self._discover_model()
                except httpx.TransportError as exc:
                    self.server_died = f"server unreachable: {exc!r}"
                    return self.records
            lanes: dict[str, list[tuple[int, Turn]]] = {}
            for index, turn in enumerate(turns):
                lanes.setdefault(turn.lane, []).append((index, turn))
            slots = asyncio.Semaphore(self.config.lanes or len(lanes) or 1)
            await asyncio.gather(*(self._run_lane(lane, slots) for lane in lanes.values()))
        return self.records

    async def _discover_model(self) -> str:
        response = await self._http().get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def _http(self) -> httpx.AsyncClient:
        assert self._client is not None, "run() owns the client"
        return self._client

    async def _run_lane(self, lane: list[tuple[int, Turn]], slots: asyncio.Semaphore) -> None:
        for position, (index, turn) in enumerate(lane):
            if self.server_died is not None:
                return
            if turn.think_s:
                await asyncio.sleep(turn.think_s)
            if time.monotonic() > self._deadline:
                self.not_sent += len(lane) - position
                return
            async with slots:
                record = await self._one(index, turn)
            self.records.append(record)
            self.on_record(record)
            if not record.ok:
                return

    async def _one(self, index: int, turn: Turn) -> RequestRecord:
        conversation = self._conversations.setdefault(turn.conversation, _Conversation())
        if turn.reset:
            conversation.reset()
        conversation.turns += 1
        record = RequestRecord(index, turn.lane, turn.conversation, conversation.turns, turn.route, turn.stream,
                               align=turn.align, extends_previous=conversation.turns > 1 and not turn.reset
                               and turn.system is None)
        try:
            if turn.route == "completions":
                await self._completion_turn(turn, conversation, record)
            else:
                await self._chat_turn(turn, conversation, record)
        except (httpx.TransportError, ServerDied) as exc:
            record.error = f"server unreachable: {exc!r}"
            self.server_died = record.error
        except _RequestFailed as exc:
            record.status, record.error = exc.status, exc.message
        return record

    # -- chat -------------------------------------------------------------------------------------------

    async def _chat_turn(self, turn: Turn, conversation: _Conversation, record: RequestRecord) -> None:
        if turn.system is not None:
            conversation.set_system(text_of(turn.system, turn.seed + 1_000_000))
        conversation.messages.extend(turn.messages)
        new = await self._aligned_new_messages(turn, conversation)
        body: dict[str, Any] = {
            "model": self._model,
            "messages": conversation.messages + new,
            "max_tokens": turn.max_tokens,
            "stream": turn.stream,
            "ignore_eos": turn.ignore_eos,
        }
        if turn.tools:
            body["tools"] = tool_specs(turn.tools)
        if turn.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": turn.thinking}
        if turn.stream:
            body["stream_options"] = {"include_usage": True}
        reply = await self._send("/v1/chat/completions", body, record)
        if reply.reasoning is None and turn.thinking is False:
            reply.reasoning = ""  # the empty think block the prompt had, as a non-streamed reply says
        conversation.messages.extend([*new, _assistant_message(reply)])
        conversation.last_tool_calls = reply.tool_calls

    async def _aligned_new_messages(self, turn: Turn, conversation: _Conversation) -> list[dict[str, Any]]:
        """The turn's new messages; with `align`, padded with words until /tokenize puts the prompt length
        on the requested residue."""
        extra = 0
        new = _new_messages(turn, conversation, extra)
        if turn.align is None:
            return new
        for _ in range(MAX_ALIGN_ATTEMPTS):
            count = await self._tokenize(turn, conversation.messages + new)
            if count is None or count % ALIGN_PAGE == turn.align:
                return new
            extra += (turn.align - count) % ALIGN_PAGE
            new = _new_messages(turn, conversation, extra)
        return new

    async def _tokenize(self, turn: Turn, messages: list[dict[str, Any]]) -> int | None:
        """The prompt length the server will see, or None if it has no /tokenize (alignment is then best
        effort; the record's `aligned` says whether it happened)."""
        body: dict[str, Any] = {"model": self._model, "messages": messages}
        if turn.tools:
            body["tools"] = tool_specs(turn.tools)
        if turn.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": turn.thinking}
        response = await self._http().post("/tokenize", json=body)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise _RequestFailed(response.status_code, f"/tokenize: {_error_message(response)}")
        return int(response.json()["count"])

    # -- completions (token ids) -------------------------------------------------------------------------

    async def _completion_turn(self, turn: Turn, conversation: _Conversation, record: RequestRecord) -> None:
        assert isinstance(turn.content, int)
        new = synth_ids(turn.content, turn.seed)
        if turn.align is not None:
            new += synth_ids((turn.align - len(conversation.ids) - len(new)) % ALIGN_PAGE, turn.seed + 1)
        prompt = conversation.ids + new
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": turn.max_tokens,
            "stream": turn.stream,
            "ignore_eos": turn.ignore_eos,
        }
        if turn.stream:
            body["stream_options"] = {"include_usage": True}
        await self._send("/v1/completions", body, record)
        conversation.ids = prompt

    # -- HTTP ---------------------------------------------------------------------------------------------

    async def _send(self, path: str, body: dict[str, Any], record: RequestRecord) -> _Reply:
        start = time.monotonic()
        if body["stream"]:
            reply = await self._stream(path, body, record, start)
        else:
            response = await self._http().post(path, json=body)
            record.status = response.status_code
            if response.status_code != 200:
                raise _RequestFailed(response.status_code, _error_message(response))
            reply = _whole_reply(response.json())
            record.ttft_s = time.monotonic() - start
        record.latency_s = time.monotonic() - start
        usage = reply.usage
        record.prompt_tokens = usage.get("prompt_tokens", 0)
        record.completion_tokens = usage.get("completion_tokens", 0)
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        record.finish_reason = reply.finish_reason
        return reply

    async def _stream(self, path: str, body: dict[str, Any], record: RequestRecord, start: float) -> _Reply:
        reply = _Reply()
        last_token: float | None = None
        async with self._http().stream("POST", path, json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                raise _RequestFailed(response.status_code, _error_message(response))
            async for line in sse_lines(response.aiter_text()):
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return reply
                chunk = json.loads(data)
                if "error" in chunk:  # a failure after the 200 went out arrives as an event
                    raise _RequestFailed(response.status_code, chunk["error"]["message"], "error event")
                if _merge_chunk(reply, chunk):
                    now = time.monotonic()
                    if last_token is None:
                        record.ttft_s = now - start
                    else:
                        record.token_gaps_s.append(now - last_token)
                    last_token = now
                    record.token_chunks += 1
        raise _RequestFailed(response.status_code, "the stream ended without [DONE]", "truncated stream")


class _RequestFailed(Exception):
    def __init__(self, status: int, message: str, what: str | None = None) -> None:
        self.status = status
        self.message = f"{what or f'HTTP {status}'}: {message}"
        super().__init__(self.message)


def _new_messages(turn: Turn, conversation: _Conversation, extra_words: int) -> list[dict[str, Any]]:
    """The turn's new content as messages: tool results answering the last reply's tool calls (a tool
    turn), or a user message. `extra_words` pads the first of them (alignment)."""
    text = text_of(turn.content, turn.seed)
    if extra_words:
        text = f"{text} {synth_words(extra_words, turn.seed + 2_000_000)}"
    if turn.role == "tool" and conversation.last_tool_calls:
        results = [text] + ["done"] * (len(conversation.last_tool_calls) - 1)
        return [{"role": "tool", "tool_call_id": call["id"], "content": result}
                for call, result in zip(conversation.last_tool_calls, results)]
    return [{"role": "user", "content": text}]


def _assistant_message(reply: _Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in reply.tool_calls]
    return message


def _whole_reply(body: dict[str, Any]) -> _Reply:
    choice = body["choices"][0]
    reply = _Reply(usage=body.get("usage") or {}, finish_reason=choice.get("finish_reason"))
    if "message" in choice:
        message = choice["message"]
        reply.content = message.get("content") or ""
        reply.reasoning = message.get("reasoning_content")
        reply.tool_calls = message.get("tool_calls") or []
    else:
        reply.text = choice.get("text", "")
    return reply


def _merge_chunk(reply: _Reply, chunk: dict[str, Any]) -> bool:
    """Fold one SSE chunk into the reply; True if it carried generated text (a token-bearing chunk)."""
    if chunk.get("usage"):
        reply.usage = chunk["usage"]
    if not chunk.get("choices"):
        return False
    choice = chunk["choices"][0]
    reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    if "delta" not in choice:
        reply.text += choice.get("text") or ""
        return bool(choice.get("text"))
    delta = choice["delta"]
    carried = False
    if delta.get("content"):
        reply.content += delta["content"]
        carried = True
    if delta.get("reasoning_content"):
        reply.reasoning = (reply.reasoning or "") + delta["reasoning_content"]
        carried = True
    for call in delta.get("tool_calls") or []:
        _merge_tool_call(reply.tool_calls, call)
        carried = True
    return carried


def _merge_tool_call(calls: list[dict[str, Any]], part: dict[str, Any]) -> None:
    # OpenAI streams a call's arguments in pieces under one index; the first piece carries id and name.
    index = part.get("index", len(calls))
    if index < len(calls):
        calls[index]["function"]["arguments"] += part.get("function", {}).get("arguments", "")
        return
    calls.append({"id": part.get("id", f"call_{index}"), "type": "function",
                  "function": {"name": part["function"]["name"], "arguments": part["function"].get("arguments", "")}})


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
