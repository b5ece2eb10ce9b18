"""The scheduler's PageLedger over the real KV (kv.KVManager): one SequenceKV per running request.

The scheduler runs between steps, immediately before the step that computes what it scheduled, so a tail
copy-on-write is prepared at admission (on the copy stream) and completed when the request first reserves
pages to write (the compute stream waits on the copy's fence); both halves stay the KVManager's explicit
transaction. Pages are released behind an event recorded on the compute stream, after every op of the
steps that read them.

A hybrid model's linear-attention states follow their sequence through `states` (state_ledger.py): a
ring per admitted request, released behind the same fence as its pages. A KV match is only usable at a
position where the state is known, and until state snapshots are wired (SnapshotStore.deepest_at_or_before
giving the deepest saved state at or before the match, restored into the live slot) that is position 0
only: a hybrid matches no prefix, so its prefill computes every token and reports none as cached. The
pages it fills are still indexed, ready for the snapshots that will make them resumable.
"""

from __future__ import annotations

from ninfer_rt.cuda.streams import Stream
from ninfer_rt.engine.request import Request
from ninfer_rt.engine.state_ledger import StateLedger
from ninfer_rt.kv.manager import KVManager
from ninfer_rt.kv.prefix import PrefixMatch
from ninfer_rt.kv.sequence import SequenceKV


class KVLedger:
    def __init__(self, manager: KVManager, compute: Stream, copy: Stream, states: StateLedger | None = None) -> None:
        self.manager = manager
        self.compute = compute
        self.copy = copy
        self.states = states  # None: the model has no linear-attention layers
        self.sequences: dict[str, SequenceKV] = {}

    def admit(self, request: Request, token_budget: int) -> int | None:
        tokens = request.all_ids
        match = self.match(tokens)
        first_chunk = min(len(tokens) - match.num_tokens, token_budget)
        if not self.manager.can_admit(match, first_chunk) or (self.states is not None and not self.states.can_admit()):
            return None
        self.sequences[request.request_id] = self.manager.admit(
            tokens, match, self.compute, self.copy, lane=request.request_id
        )
        if self.states is not None:
            self.states.admit(request, match.num_tokens)
        if not self.reserve(request, match.num_tokens + first_chunk):
            raise RuntimeError(f"{request.request_id}: can_admit promised pages that grow could not find")
        return match.num_tokens

    def match(self, tokens: list[int]) -> PrefixMatch:
        """The cached prefix admission may skip: none without prefix caching, and none for a hybrid (no
        state is known past position 0 until snapshots are restored; see the module docstring)."""
        if not self.manager.prefix_caching or self.states is not None:
            return PrefixMatch(self.manager.page_size)
        return self.manager.match(tokens)

    def reserve(self, request: Request, num_tokens: int) -> bool:
        seq = self.sequences[request.request_id]
        self.manager.complete_copy(seq, self.compute)
        new_tokens = num_tokens - seq.num_tokens
        if not self.manager.can_grow(seq, new_tokens):
            return False
        self.manager.grow(seq, new_tokens, self.compute)
        return True

    def commit(self, request: Request) -> None:
        seq = self.sequences[request.request_id]
        self.manager.commit(seq, request.token_slice(seq.num_tokens, request.num_computed))

    def rollback(self, request: Request) -> None:
        seq = self.sequences[request.request_id]
        keep = -(-seq.num_tokens // self.manager.page_size)
        if len(seq.pages) > keep:
            # the fence follows the step's verify and drafting writes into these pages
            self.manager.pool.release(reversed(seq.pages[keep:]), self.compute.record())
            del seq.pages[keep:]

    def release(self, request: Request) -> None:
        seq = self.sequences.pop(request.request_id, None)
        if seq is None:
            return
        fence = self.compute.record()  # after every op of the steps that read the pages and the slots
        self.manager.finish(seq, fence)
        if self.states is not None:
            self.states.release(request, fence)

    def sequence(self, request: Request) -> SequenceKV:
        return self.sequences[request.request_id]
