"""The server's side of a replay's verdict: health, page and state-slot accounting, speculative decoding's
acceptance and ordering violations, read from /health, /metrics and (with --verify-ordering)
/debug/crash-context after the last request."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

IDLE_WAIT_S = 10.0  # aborted streams and fenced page releases finish a few engine steps after the response
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


@dataclass(frozen=True)
class KVPages:
    free: int
    in_use: int
    cached: int
    total: int
    evictions: int = 0  # cached pages evicted since the server started

    @property
    def idle(self) -> bool:
        """Nothing held by a request, and every page accounted for (free or cached)."""
        return self.in_use == 0 and self.free + self.cached == self.total


@dataclass(frozen=True)
class StateSlots:
    """A hybrid model's linear-attention state slots and the saved states (snapshots) beside them."""

    free: int
    in_use: int
    fenced: int
    total: int
    snapshots: int
    snapshot_bytes: int

    @property
    def idle(self) -> bool:
        """No slot held by a request, every slot free or released behind a fence (reclaimed at the engine's
        next step, like a fenced KV page), and snapshots holding bytes iff they exist."""
        return (self.in_use == 0 and self.free + self.fenced == self.total
                and (self.snapshots == 0) == (self.snapshot_bytes == 0))


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding since the server started: verify steps, drafted and accepted tokens."""

    rounds: int
    drafted: int
    accepted: int

    def as_json(self) -> dict[str, Any]:
        return {**self.__dict__,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
                # every verify step emits its accepted drafts plus the token the target model picked
                "tokens_per_round": round((self.accepted + self.rounds) / self.rounds, 3) if self.rounds else None}


@dataclass(frozen=True)
class ServerState:
    reachable: bool
    healthy: bool
    kv: KVPages | None = None
    ordering_violations: int = 0
    states: StateSlots | None = None
    spec: SpecCounts | None = None

    @property
    def idle(self) -> bool:
        return (self.kv is None or self.kv.idle) and (self.states is None or self.states.idle)

    def as_json(self) -> dict[str, Any]:
        kv = None if self.kv is None else {**self.kv.__dict__, "idle": self.kv.idle}
        states = None if self.states is None else {**self.states.__dict__, "idle": self.states.idle}
        return {"reachable": self.reachable, "healthy": self.healthy, "kv_pages": kv, "state_slots": states,
                "spec": None if self.spec is None else self.spec.as_json(),
                "ordering_violations": self.ordering_violations}


def read_state(url: str) -> ServerState:
    try:
        healthy = httpx.get(url + "/health", timeout=10).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return ServerState(reachable=False, healthy=False)
    samples = parse_metrics(metrics)
    pages = {labels.get("state"): int(value) for (name, labels), value in samples if name == "ninfer_kv_pages"}
    evictions = sum(int(v) for (name, _), v in samples if name == "ninfer_kv_page_evictions_total")
    kv = (KVPages(**{s: pages[s] for s in ("free", "in_use", "cached", "total")}, evictions=evictions)
          if len(pages) >= 4 else None)
    violations = sum(int(v) for (name, _), v in samples if name == "ninfer_ordering_violations_total")
    return ServerState(reachable=True, healthy=healthy, kv=kv, ordering_violations=violations,
                       states=_state_slots(samples), spec=_spec_counts(samples))


def _state_slots(samples: list[tuple[tuple[str, dict[str, str]], float]]) -> StateSlots | None:
    slots = {labels.get("state"): int(value) for (name, labels), value in samples if name == "ninfer_state_slots"}
    if len(slots) < 4:  # a model without linear-attention layers
        return None
    plain = {name: int(value) for (name, _), value in samples}
    return StateSlots(**{s: slots[s] for s in ("free", "in_use", "fenced", "total")},
                      snapshots=plain.get("ninfer_state_snapshots", 0),
                      snapshot_bytes=plain.get("ninfer_state_snapshot_bytes", 0))


def _spec_counts(samples: list[tuple[tuple[str, dict[str, str]], float]]) -> SpecCounts | None:
    plain = {name: int(value) for (name, _), value in samples}
    rounds = plain.get("ninfer_spec_decode_num_drafts_total")
    if not rounds:
        return None
    return SpecCounts(rounds, plain.get("ninfer_spec_decode_num_draft_tokens_total", 0),
                      plain.get("ninfer_spec_decode_num_accepted_tokens_total", 0))


def wait_idle(url: str, timeout_s: float = IDLE_WAIT_S) -> ServerState:
    """The server's state once its pages and state slots are idle, or as it is when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = read_state(url)
        if not state.reachable or state.idle or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def crash_context(url: str) -> dict[str, Any] | None:
    """The live crash context (servers started with --verify-ordering), or None."""
    try:
        response = httpx.get(url + "/debug/crash-context", timeout=10)
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def parse_metrics(text: str) -> list[tuple[tuple[str, dict[str, str]], float]]:
    """Prometheus text format samples as ((name, labels), value)."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if line.startswith("#") or match is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
        samples.append(((match["name"], labels), float(match["value"])))
    return samples
