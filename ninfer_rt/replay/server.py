"""The server's side of a replay's verdict: health, page accounting and ordering violations, read from
/health, /metrics and (with --verify-ordering) /debug/crash-context after the last request."""

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

    @property
    def idle(self) -> bool:
        """Nothing held by a request, and every page accounted for (free or cached)."""
        return self.in_use == 0 and self.free + self.cached == self.total


@dataclass(frozen=True)
class ServerState:
    reachable: bool
    healthy: bool
    kv: KVPages | None = None
    ordering_violations: int = 0

    def as_json(self) -> dict[str, Any]:
        kv = None if self.kv is None else {**self.kv.__dict__, "idle": self.kv.idle}
        return {"reachable": self.reachable, "healthy": self.healthy, "kv_pages": kv,
                "ordering_violations": self.ordering_violations}


def read_state(url: str) -> ServerState:
    try:
        healthy = httpx.get(url + "/health", timeout=10).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return ServerState(reachable=False, healthy=False)
    samples = parse_metrics(metrics)
    pages = {labels.get("state"): int(value) for (name, labels), value in samples if name == "ninfer_kv_pages"}
    kv = KVPages(**{s: pages[s] for s in ("free", "in_use", "cached", "total")}) if len(pages) >= 4 else None
    violations = sum(int(v) for (name, _), v in samples if name == "ninfer_ordering_violations_total")
    return ServerState(reachable=True, healthy=healthy, kv=kv, ordering_violations=violations)


def wait_idle(url: str, timeout_s: float = IDLE_WAIT_S) -> ServerState:
    """The server's state once its pages are idle, or as it is when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = read_state(url)
        if not state.reachable or state.kv is None or state.kv.idle or time.monotonic() > deadline:
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
