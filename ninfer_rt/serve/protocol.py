"""OpenAI request bodies as pydantic models, and OpenAI-shaped errors.

Models are strict about the types of the fields they know ("5" is not an integer: a client sending it has a
bug worth hearing about) and ignore fields they don't (clients send metadata, store, parallel_tool_calls,
...; refusing those would break agents for no gain). Everything invalid becomes an `APIError` that the app
turns into ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

MAX_TOKENS_CEILING = 2**31 - 1  # anything above is nonsense whatever the context; keeps ints machine-sized
MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 64  # far beyond any real request (a tool schema nests a few levels); deeper is an attack
INT32_MAX = 2**31 - 1


def _bounded(**limits: float) -> Any:
    """A float field within OpenAI's documented range; NaN and infinities (which Python's json accepts as
    NaN / Infinity) are refused with the field named."""
    return Annotated[float, Field(allow_inf_nan=False, **limits)]


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self) -> Any:
        # intake workers raise these in another process: pickle every field, not just the message
        return (APIError, (self.status, self.message, self.type, self.param, self.code, self.headers))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# -- chat ------------------------------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON text, as the API carries it


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # "developer" is what newer OpenAI clients call the system role
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "assistant" and self.content is None and not self.tool_calls and self.reasoning_content is None:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as HF chat templates expect it: string content, tool calls with JSON-text arguments."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError('function parameters must be a JSON Schema of type "object"')
        return parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    temperature: _bounded(ge=0.0, le=2.0) | None = None
    top_p: _bounded(gt=0.0, le=1.0) | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: _bounded(ge=0.0, le=1.0) | None = None
    presence_penalty: _bounded(ge=-2.0, le=2.0) = 0.0
    frequency_penalty: _bounded(ge=-2.0, le=2.0) = 0.0
    repetition_penalty: _bounded(gt=0.0, le=10.0) = 1.0
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: int = 1

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported; send separate requests for more choices")
        return n

    @field_validator("stop")
    @classmethod
    def _as_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        return [stop] if isinstance(stop, str) else stop


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _possible_tool_choice(cls, choice: Any, info: ValidationInfo) -> Any:
        # tools is declared first, so it is validated (or already failed) by now
        names = {tool.function.name for tool in info.data.get("tools") or ()}
        if _forces_a_call(choice) and not names:
            raise ValueError("tool_choice forces a tool call, but the request has no tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools")
        return choice

    @property
    def forces_tool_call(self) -> bool:
        return _forces_a_call(self.tool_choice)

    @property
    def forced_function(self) -> str | None:
        """The function the reply must call: the named one, or for "required" the only tool there is."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        if self.tool_choice == "required" and self.tools and len(self.tools) == 1:
            return self.tools[0].function.name
        return None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _forces_a_call(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, NamedToolChoice)


class CompletionRequest(_SamplingFields):
    # one prompt (text or token ids) or a batch of them, one choice each
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)  # ids range-checked in jobs.py
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = 16  # OpenAI's default here
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo or self.suffix is not None:
            raise ValueError("echo and suffix are not supported")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a text or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says why not."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        data = None  # nested past the interpreter's limit: reported as too deep below
    if data is None or _depth_exceeds(data, MAX_JSON_DEPTH):
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def parse_body(raw: bytes, model: type[_Strict]) -> Any:
    """The request body as `model`, or a 400 that says what is wrong and where."""
    return validate_body(decode_body(raw), model)


def validate_body(data: dict[str, Any], model: type[_Strict]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _depth_exceeds(data: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` deep; iterative, so no input can exhaust the stack."""
    pending: list[tuple[Any, int]] = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _validation_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    detail = first["msg"].removeprefix("Value error, ")
    message = f"{param}: {detail}" if param else detail
    if exc.error_count() > 1:
        message += f" (and {exc.error_count() - 1} more problems)"
    return bad_request(message, param=param)
