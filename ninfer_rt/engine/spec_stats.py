"""Acceptance statistics of speculative decoding: per request (generate's stats line) and per server.

A verify step proposes k drafts at positions 0..k-1 and accepts a leading run of them. The mean
acceptance length is the tokens a verify step emits on average (accepted drafts + the correction or bonus
token, so 1.0 means no draft was ever accepted and k + 1 is the ceiling); the per-position acceptance rate
is accepted / proposed at each draft position.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceCounts:
    steps: int = 0  # verify steps that checked at least one draft
    proposed: list[int] = field(default_factory=list)  # per draft position
    accepted: list[int] = field(default_factory=list)  # per draft position

    def add(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        grow = drafted - len(self.proposed)
        if grow > 0:
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        self.steps += 1
        for position in range(drafted):
            self.proposed[position] += 1
            self.accepted[position] += position < accepted

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + sum(self.accepted) / self.steps if self.steps else 0.0

    @property
    def position_rates(self) -> list[float]:
        return [a / p for a, p in zip(self.accepted, self.proposed)]

    def describe(self) -> str:
        rates = "/".join(f"{rate:.2f}" for rate in self.position_rates)
        return f"acceptance {self.mean_acceptance_length:.2f} tok/step (per position {rates})"
