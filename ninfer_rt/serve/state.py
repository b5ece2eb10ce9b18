"""What the server's parts share: its configuration, its state, and the backend it generates through.

The backend (the engine loop on its own thread, serve/backend.py) is built in the background at start-up,
so `ServerState.backend` stays None while the model loads; a failure it cannot continue from is
`BackendFailed`, which makes the server unhealthy.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.engine.reply_warmup import WarmupStats
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.kv.snapshots import SnapshotStats
from ninfer_rt.kv.states import SlotStats
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.protocol import APIError

if TYPE_CHECKING:
    from ninfer_rt.serve.intake import Intake

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class Generation:
    """One prompt and its sampling parameters, validated once, at the edge, against what the backend
    announces (vocabulary, context limit): the backend runs it as it is."""

    prompt_ids: list[int]
    params: SamplingParams
    text_round_trip: bool = False  # the client sends the reply back as text (a chat, a text prompt)


class GenerationBackend(Protocol):
    """What the app needs from the engine side."""

    tokenizer: Tokenizer
    context_limit: int  # prompt + output tokens one request may hold
    vocab_size: int  # prompt token ids must be in [0, vocab_size)

    def generate(self, generation: Generation, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs; closing the iterator early aborts the request and frees its pages."""

    def kv_stats(self) -> PoolStats: ...

    def load(self) -> EngineLoad:
        """Requests the engine holds now, sampled at scrape time."""

    def crash_context(self) -> dict[str, Any]:
        """The engine's crash context now: last ops per stream, lane frontier, KV transactions and pages."""

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class EngineLoad:
    running: int  # admitted: holding pages, prefilling or decoding
    waiting: int  # queued in the engine for a lane or for pages (preempted ones too)
    state_slots: SlotStats | None = None  # a hybrid model's Gated DeltaNet state slots
    snapshots: SnapshotStats | None = None  # and its state snapshots
    warmups: WarmupStats | None = None  # and its re-tokenized replies' warm-ups (engine/reply_warmup.py)


class BackendFailed(RuntimeError):
    """The engine hit an error it cannot continue from (a sticky CUDA error, an ordering violation): the
    server must restart."""

    def __init__(self, message: str, ordering_violation: bool = False) -> None:
        super().__init__(message)
        self.ordering_violation = ordering_violation


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    preserve_thinking: bool = True
    max_concurrency: int = 2
    max_queue: int = 64  # requests waiting beyond the running lanes before 429
    verify_ordering: bool = False  # also serves /debug/crash-context, for replay harnesses to assert on
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)  # from generation_config.json
    max_body_bytes: int = 16 * 32768 + (1 << 20)  # intake.default_max_body_bytes of the default context
    intake_workers: int = 1  # processes that decode, template and tokenize request bodies


@dataclass
class ServerState:
    backend: GenerationBackend | None = None  # set once the backend and the intake workers are up
    intake: Intake | None = None
    fatal: str | None = None
    load_error: Exception | None = None  # why the backend never loaded (the start-up line says it)
    in_flight: int = 0
    on_fatal: Callable[[], None] = lambda: None  # set by the runner: stop the server so the process exits


def sampling_defaults(model_dir: str | Path) -> dict[str, float]:
    """The sampling parameters the checkpoint recommends (generation_config.json), used when a client omits them."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    defaults = {key: config[key] for key in SAMPLING_DEFAULT_KEYS if isinstance(config.get(key), (int, float))}
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def ready(state: ServerState) -> GenerationBackend:
    """The backend, or a 503 while the model loads or after the server became unhealthy."""
    if state.fatal is not None:
        raise APIError(503, f"the server is unhealthy: {state.fatal}", type="server_error")
    if state.backend is None:
        raise APIError(503, "the model is still loading", type="server_error", headers={"Retry-After": "5"})
    return state.backend
