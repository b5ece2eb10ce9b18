"""The scheduler's PageLedger over the real KV (kv.KVManager): one SequenceKV per running request.

The scheduler runs between steps, immediately before the step that computes what it scheduled, so a tail
copy-on-write is prepared at admission (on the copy stream) and completed when the request first reserves
pages to write (the compute stream waits on the copy's fence); both halves stay the KVManager's explicit
transaction. Pages are released behind an event recorded on the compute stream, after every op of the
steps that read them.

A hybrid model's linear-attention states follow their sequence through `states` (state_ledger.py): a
ring per admitted request, released behind the same fence as its pages. A KV match is only usable at a
position where the state is known: the deepest snapshot at or before it, where the match is cut (the
pages past it are recomputed, a page it ends inside is copied like any tail hit); with no snapshot the
hybrid computes every token. `cached_tokens` is therefore the tokens whose compute was skipped.
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
        full = self.match(tokens)
        snapshot = self.states.resume_point(full, tokens) if self.states is not None else None
        match = full if self.states is None else full.truncated(snapshot.position if snapshot else 0)
        first_chunk = min(len(tokens) - match.num_tokens, token_budget)
        if not self.manager.can_admit(match, first_chunk) or (self.states is not None and not self.states.can_admit()):
            return None
        if self.states is not None:
            # restored before any page is taken: taking pages may evict the page the snapshot ends in, and
            # the snapshot with it (its state is still good for this restore, whose copy holds the record)
            self.states.admit(request, match.num_tokens, snapshot, full.num_tokens)
            first_chunk = self.states.chunk_limit(request, match.num_tokens, first_chunk)
        self.sequences[request.request_id] = self.manager.admit(
            tokens, match, self.compute, self.copy, lane=request.request_id
        )
        if not self.reserve(request, match.num_tokens + first_chunk):
            raise RuntimeError(f"{request.request_id}: can_admit promised pages that grow could not find")
        return match.num_tokens

    def match(self, tokens: list[int]) -> PrefixMatch:
        """The cached prefix of `tokens` (none without prefix caching); a hybrid's is cut at admission."""
        if not self.manager.prefix_caching:
            return PrefixMatch(self.manager.page_size)
        return self.manager.match(tokens)

    def chunk_limit(self, request: Request, size: int) -> int:
        """A chunk of `size` tokens from the request's computed ones, cut at the next snapshot point."""
        if self.states is None:
            return size
        return self.states.chunk_limit(request, request.num_computed, size)

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
        if self.states is not None:
            self.states.saved(request, seq)

    def rollback(self, request: Request) -> None:
        seq = self.sequences[request.request_id]
        keep = -(-seq.num_tokens // self.manager.page_size)
        if len(seq.pages) > keep:
            # the fence follows the step's verify and drafting writes into these pages
            self.manager.pool.release(reversed(seq.pages[keep:]), self.compute.record())
            del seq.pages[keep:]

    def release(self, request: Request, finished: bool = False) -> None:
        """Give back the request's pages (and state slots); a `finished` one's state is saved first."""
        seq = self.sequences.pop(request.request_id, None)
        if seq is None:
            return
        fence = self.compute.record()  # after every op of the steps that read the pages and the slots
        if self.states is not None:  # before the pages go: the snapshot is keyed to them
            self.states.release(request, fence, seq, finished)
        pages = list(seq.pages)  # finish() gives them back
        self.manager.finish(seq, fence)
        if self.states is not None:
            self.states.pages_dropped([page for page in pages if not self.manager.prefix.indexes(page)], self.manager.prefix)

    def sequence(self, request: Request) -> SequenceKV:
        return self.sequences[request.request_id]
