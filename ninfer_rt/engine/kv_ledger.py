"""The scheduler's PageLedger over the real KV (kv.KVManager): one SequenceKV per running request.

The scheduler runs between steps, immediately before the step that computes what it scheduled, so a tail
copy-on-write is prepared at admission (on the copy stream) and completed when the request first reserves
pages to write (the compute stream waits on the copy's fence); both halves stay the KVManager's explicit
transaction. Pages are released behind an event recorded on the compute stream, after every op of the
steps that read them.
"""

from __future__ import annotations

from ninfer_rt.cuda.streams import Stream
from ninfer_rt.engine.request import Request
from ninfer_rt.kv.manager import KVManager
from ninfer_rt.kv.prefix import PrefixMatch
from ninfer_rt.kv.sequence import SequenceKV


class KVLedger:
    def __init__(self, manager: KVManager, compute: Stream, copy: Stream) -> None:
        self.manager = manager
        self.compute = compute
        self.copy = copy
        self.sequences: dict[str, SequenceKV] = {}

    def admit(self, request: Request, token_budget: int) -> int | None:
        tokens = request.all_ids
        match = self.manager.match(tokens) if self.manager.prefix_caching else PrefixMatch(self.manager.page_size)
        first_chunk = min(len(tokens) - match.num_tokens, token_budget)
        if not self.manager.can_admit(match, first_chunk):
            return None
        self.sequences[request.request_id] = self.manager.admit(
            tokens, match, self.compute, self.copy, lane=request.request_id
        )
        if not self.reserve(request, match.num_tokens + first_chunk):
            raise RuntimeError(f"{request.request_id}: can_admit promised pages that grow could not find")
        return match.num_tokens

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
        if seq is not None:
            self.manager.finish(seq, self.compute.record())

    def sequence(self, request: Request) -> SequenceKV:
        return self.sequences[request.request_id]
