"""A replay's summary: the table a person reads, the verdict CI acts on, and per-request JSON lines."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ninfer_rt.replay.reuse import SLACK_TOKENS, turn_reuse
from ninfer_rt.replay.runner import RequestRecord
from ninfer_rt.replay.server import ServerState

PERCENTILES = (50, 90, 99)
_CRASH_FILE = re.compile(r"crash context written to (\S+)")


@dataclass
class Summary:
    requests: int
    errors: int
    wall_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_ratio_after_first: float | None  # cached / prompt tokens over turns 2.. of every conversation
    ttft_s: dict[str, float]  # p50/p90/p99
    itl_s: dict[str, float]
    # Streamed tokens per token-bearing chunk: a chunk is one engine step, so with MTP this estimates the
    # acceptance length; it reads above 1 without MTP too where the parser holds text back (markup).
    tokens_per_chunk: float | None
    aligned: int  # turns that asked for a residue mod 64 and got it
    misaligned: int
    first_error: str | None
    not_sent: int = 0  # turns a time limit left unsent (not failures: the replay ran out of its slot)
    crash_files: list[str] = field(default_factory=list)
    reuse: dict[str, Any] | None = None  # prefix reuse against the ideal (reuse_summary)
    server: dict[str, Any] | None = None
    server_died: str | None = None

    def failures(self, expect_idle: bool = True, min_cached_ratio: float | None = None,
                 min_requests: int = 0, min_skipped_of_ideal: float | None = None) -> list[str]:
        """Why the replay failed; empty when it passed."""
        reasons = []
        if self.requests < min_requests:
            reasons.append(f"only {self.requests} request(s) sent ({self.not_sent} left by the time limit), "
                           f"fewer than {min_requests}")
        if self.errors:
            reasons.append(f"{self.errors} request(s) failed; first: {self.first_error}")
        if self.server_died or (self.server is not None and not self.server["reachable"]):
            reasons.append(f"the server died: {self.server_died or 'unreachable after the replay'}")
        elif self.server is not None:
            if self.server["ordering_violations"]:
                reasons.append(f"{self.server['ordering_violations']} ordering violation(s) on the server")
            kv, states = self.server["kv_pages"], self.server.get("state_slots")
            if expect_idle and kv is not None and not kv["idle"]:
                reasons.append(f"KV pages not back to idle: {kv}")
            if expect_idle and states is not None and not states["idle"]:
                reasons.append(f"state slots or snapshots not back to idle: {states}")
        if min_skipped_of_ideal is not None:
            reasons += self._reuse_failures(min_skipped_of_ideal)
        if min_cached_ratio is not None and (self.cached_ratio_after_first or 0.0) < min_cached_ratio:
            reasons.append(f"cached-token ratio from turn 2 is {self.cached_ratio_after_first}, below {min_cached_ratio}")
        return reasons

    def _reuse_failures(self, min_skipped_of_ideal: float) -> list[str]:
        reuse = self.reuse or {}
        reasons = []
        if (reuse.get("skipped_of_ideal") or 0.0) < min_skipped_of_ideal:
            reasons.append(f"skipped {reuse.get('skipped_of_ideal')} of the ideal prefix tokens from turn 2, "
                           f"below {min_skipped_of_ideal}")
        if reuse.get("over_new_plus_slack"):
            reasons.append(f"{reuse['over_new_plus_slack']} turn(s) recomputed more than their new tokens + "
                           f"{SLACK_TOKENS}; first: {reuse['first_over']}")
        return reasons

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], wall_s: float, server: ServerState | None,
              server_died: str | None, not_sent: int = 0) -> Summary:
    ok = [r for r in records if r.ok]
    later = [r for r in ok if r.turn >= 2]
    later_prompt = sum(r.prompt_tokens for r in later)
    streamed = [r for r in ok if r.stream and r.token_chunks]
    errors = [r.error for r in records if r.error]
    return Summary(
        requests=len(records),
        errors=len(errors),
        wall_s=round(wall_s, 3),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok),
        completion_tokens=sum(r.completion_tokens for r in ok),
        cached_ratio_after_first=round(sum(r.cached_tokens for r in later) / later_prompt, 4) if later_prompt else None,
        ttft_s=percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_s=percentiles([gap for r in ok for gap in r.token_gaps_s]),
        tokens_per_chunk=(round(sum(r.completion_tokens for r in streamed) / sum(r.token_chunks for r in streamed), 3)
                          if streamed else None),
        aligned=sum(1 for r in ok if r.aligned is True),
        misaligned=sum(1 for r in ok if r.aligned is False),
        first_error=errors[0] if errors else None,
        not_sent=not_sent,
        crash_files=sorted({m for e in errors for m in _CRASH_FILE.findall(e)}),
        server=None if server is None else server.as_json(),
        server_died=server_died,
        reuse=reuse_summary(records),
    )


def reuse_summary(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Skipped prompt tokens from turn 2 against the ideal, and recomputed tokens per turn beside the new."""
    turns = turn_reuse(records)
    if not turns:
        return None
    by_index = {r.index: r for r in records}
    ideal = sum(by_index[t.index].prompt_tokens - t.new for t in turns)
    skipped = sum(by_index[t.index].cached_tokens for t in turns)
    over = [t for t in turns if t.over_slack]
    return {
        "turns": len(turns),
        "ideal_skipped_tokens": ideal,
        "skipped_tokens": skipped,
        "skipped_of_ideal": round(skipped / ideal, 4) if ideal else None,
        "recomputed": percentiles([t.recomputed for t in turns]),
        "new": percentiles([t.new for t in turns]),
        "over_new_plus_slack": len(over),
        "first_over": None if not over else over[0].__dict__,
    }


def results_line(summary: dict[str, Any], **run: Any) -> dict[str, Any]:
    """A line of bench/results/replay.jsonl: `run` (date, gpu, commit, model, ...) and the figures a GPU
    replay is judged by, from a summary as --summary-json writes it; latencies in milliseconds."""
    server = summary.get("server") or {}
    return {
        **run,
        "requests": summary["requests"],
        "not_sent": summary.get("not_sent", 0),
        "errors": summary["errors"],
        "first_error": summary["first_error"],
        "wall_s": summary["wall_s"],
        "ttft_ms": _ms(summary["ttft_s"]),
        "itl_ms": _ms(summary["itl_s"]),
        "cached_ratio": summary["cached_ratio_after_first"],
        "prompt_tokens": summary["prompt_tokens"],
        "cached_tokens": summary["cached_tokens"],
        "completion_tokens": summary["completion_tokens"],
        "aligned": summary["aligned"],
        "misaligned": summary["misaligned"],
        "ordering_violations": server.get("ordering_violations"),
        "server_alive": bool(server.get("reachable") and server.get("healthy")) and not summary["server_died"],
        "kv_pages": server.get("kv_pages"),  # its "idle": nothing in use, every page free or cached
        "state_slots": server.get("state_slots"),  # a hybrid's; its "idle": every slot free, snapshots consistent
        "spec": server.get("spec"),  # acceptance and tokens per verify round
        "reuse": summary.get("reuse"),
    }


def _ms(stats: dict[str, float]) -> dict[str, float]:
    return {name: round(seconds * 1000, 2) for name, seconds in stats.items()}


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """Nearest-rank percentiles (no interpolation: every reported latency is one that happened)."""
    if not values:
        return {}
    ordered = sorted(values)
    return {f"p{p}": round(ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))], 5)
            for p in PERCENTILES}


def format_table(summary: Summary) -> str:
    def ms(stats: dict[str, float]) -> str:
        return " / ".join(f"{stats[f'p{p}'] * 1000:.1f}" for p in PERCENTILES) if stats else "-"

    kv = (summary.server or {}).get("kv_pages")
    states, spec = (summary.server or {}).get("state_slots"), (summary.server or {}).get("spec")
    reuse = summary.reuse
    rows = [
        ("requests", f"{summary.requests} ({summary.errors} errors) in {summary.wall_s:.1f} s"
                     + (f", {summary.not_sent} not sent (time limit)" if summary.not_sent else "")),
        ("tokens", f"prompt {summary.prompt_tokens}, cached {summary.cached_tokens}, "
                   f"completion {summary.completion_tokens}"),
        ("cached ratio (turn >= 2)", _or_dash(summary.cached_ratio_after_first)),
        ("TTFT p50/p90/p99 ms", ms(summary.ttft_s)),
        ("ITL p50/p90/p99 ms", ms(summary.itl_s)),
        ("tokens/chunk (~acceptance)", _or_dash(summary.tokens_per_chunk)),
        ("aligned prompts", f"{summary.aligned} ok, {summary.misaligned} missed"),
        ("ordering violations", _or_dash((summary.server or {}).get("ordering_violations"))),
        ("KV pages after", "-" if kv is None else
         f"free {kv['free']}, in_use {kv['in_use']}, cached {kv['cached']}, total {kv['total']}"
         f" ({'idle' if kv['idle'] else 'NOT idle'}), {kv.get('evictions', 0)} evicted"),
    ]
    if reuse is not None:
        rows.append(("skipped of ideal (turn >= 2)", f"{reuse['skipped_of_ideal']} "
                     f"({reuse['skipped_tokens']} of {reuse['ideal_skipped_tokens']} tokens)"))
        rows.append(("recomputed p50/p99 (new)", f"{_p(reuse['recomputed'])} ({_p(reuse['new'])}), "
                     f"{reuse['over_new_plus_slack']} turn(s) over new + {SLACK_TOKENS}"))
    if spec is not None:
        rows.append(("MTP acceptance, tokens/round", f"{spec['acceptance']}, {spec['tokens_per_round']}"))
    if states is not None:
        rows.append(("state slots after", f"free {states['free']}, in_use {states['in_use']}, fenced "
                     f"{states['fenced']}, total {states['total']}, snapshots {states['snapshots']}"
                     f" ({'idle' if states['idle'] else 'NOT idle'})"))
    if summary.first_error:
        rows.append(("first error", summary.first_error))
    for path in summary.crash_files:
        rows.append(("crash context", path))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _p(stats: dict[str, float]) -> str:
    return f"{stats['p50']:g}/{stats['p99']:g}"


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def write_records(records: Sequence[RequestRecord], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for record in sorted(records, key=lambda r: r.index):
            out.write(json.dumps(record.as_json()) + "\n")
