"""Stop strings over a streamed text, matched across token boundaries.

A stop string can arrive split over several tokens ("</an" + "swer>"), so text that could still become the
start of a stop string is held back until the next delta decides it. When a stop string completes, the
output ends exactly before it; the held-back text is released only if the stream ends without a match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StopStringMatcher:
    stops: Sequence[str]
    _held: str = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string completed)."""
        text = self._held + delta
        cut = self._earliest_stop(text)
        if cut is not None:
            self._held = ""
            return text[:cut], True
        hold = self._longest_partial_stop(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """The held-back text, at the end of a stream that did not stop on a string."""
        text, self._held = self._held, ""
        return text

    def _earliest_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _longest_partial_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
