"""MTP speculative decoding: drafting with the checkpoint's MTP module, verification in one main forward.

Positions. The MTP row at position p consumes (h[p], x[p+1]) -- the main model's final-normed hidden state
and the token after it -- writes the MTP layer's K/V at p's slot (KV layer num_hidden_layers, in the same
pages as the main layers) and predicts x[p+2].

One step of a request whose last token x[N-1] is not yet computed and that holds drafts d1..dk for
positions N..N+k-1 (drafted at the end of its previous step):

1. Verify: one main forward over [x[N-1], d1..dk] at positions N-1..N+k-1 (1 + k rows, logits for all of
   them; on the CUDA executor a graph replay keyed by the step shape, so batch size and verify width pick
   the graph). Only the argmax ids reach the host for requests they decide (sampling.argmax_decides);
   full logits only for those that sample, penalise or report logprobs. spec_verify accepts a leading run of a drafts and emits them plus the correction or bonus
   token b: the sequence now has N' = N + a + 1 tokens and K/V for positions 0..N'-2.
2. Catch-up: one MTP forward over the same rows (same positions, slots and block tables; fixed shape, so it
   never depends on a), with the tokens shifted by one: row i gets x[N+i], which is d(i+1) for i < a and b
   for i = a. Rows 0..a -- exactly the newly accepted positions -- get correct MTP K/V from the verified
   h; rows past a are rejected and write entries past the accepted length.
3. Draft: row a's MTP logits give d'1 (for position N'); then the one MTP layer is reused k - 1 more times,
   one row per request at positions N'-1, N', ..., fed the previous MTP output as its hidden input.
   Catch-up and drafts are model/mtp.py MTPSteps: CUDA graphs per step shape on the CUDA executor
   (exec/cuda_graphs.py), op by op elsewhere.

A prefill chunk is the same with no drafts: the catch-up runs over all of its rows (the token after its
last row is the sampled one, or the next prompt token for a chunk that samples nothing), so the MTP K/V
always covers every computed position.

Rollback. Nothing is ever copied back. The verify and drafting rows write K/V past the accepted length;
after the step (Scheduler.settle) the accepted drafts count as computed, only their full pages enter the
prefix cache, and pages wholly past the computed tokens go back to the pool behind a fence (KVLedger.
rollback). Rejected entries left in the kept last page are never read: every later step writes a
position's main and MTP K/V (rope_kv) before any row attends to it, and the next catch-up rewrites the
MTP entries of whatever it accepts. The scheduler reserves `lookahead(k)` slots past a sampling chunk's
end so verify and drafting have their pages; near the context limit (or right after admission) a request
simply drafts and verifies fewer tokens.

Hybrid models (linear-attention states, engine/state_ledger.py). A request's ring holds 1 + k state
slots. The verify pass saves the state after each of its 1 + len(drafts) rows (StateRing.begin with
saved = 1 + len(drafts)); once the drafts are verified, `accept(a)` with a = the accepted drafts makes
the state after row a -- x[N-1], d1..da: exactly the tokens the sequence has computed -- the live one,
conv window included, by an index swap. A prefill chunk saves only its final state, in place. Catch-up
and drafting run only the MTP layer (full attention), so their batches carry no state slots.

Known approximation (draft quality only, never output): a prefix-cache hit of M tokens reuses the MTP
entry at position M-1, which the earlier owner computed with its own x[M].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ninfer_rt.engine.kv_ledger import KVLedger
from ninfer_rt.engine.request import Request
from ninfer_rt.engine.runner import ModelRunner, SampledTokens, SeqRows, step_batch
from ninfer_rt.engine.sampling import Sample, argmax_decides, described, final_logits, softmax
from ninfer_rt.engine.scheduler import ScheduledChunk
from ninfer_rt.engine.spec_verify import Verdict, verify_greedy, verify_sampled
from ninfer_rt.engine.spec_vocab import DraftVocab
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.model.executor import Executor, StepBatch, StepForward, Tensor, WeightRole
from ninfer_rt.model.layers import PreparedModel
from ninfer_rt.model.mtp import EagerMTPSteps, MTPSteps, PreparedMTP
from ninfer_rt.model.weights import ModelWeights
from ninfer_rt.quantize.layouts import dense_rows


def lookahead(draft_tokens: int) -> int:
    """Slots past a sampling chunk's end that one speculative step writes: k verify rows, then drafting
    k - 1 positions past the (at most k) accepted ones."""
    return 2 * draft_tokens - 1


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)  # per token, the full-vocabulary q it was drawn from (sampling only)

    def clipped(self, room: int) -> Draft:
        return Draft(self.tokens[:room], self.probs[:room])


@dataclass(frozen=True)
class HostRows:
    """A step's logit rows on the host: argmax ids if some request is decided by them, full logits only if
    some request needs them (4 bytes a row instead of the vocabulary's 600 kB for Qwen3)."""

    ids: np.ndarray | None  # int32 [rows]
    logits: np.ndarray | None  # [rows, vocab]

    def rows(self, start: int, stop: int) -> HostRows:
        return HostRows(
            None if self.ids is None else self.ids[start:stop],
            None if self.logits is None else self.logits[start:stop],
        )


@dataclass(frozen=True)
class Verified:
    """One sampling request's share of a step after verification."""

    request: Request
    drafted: int
    verdict: Verdict
    finals: list[np.ndarray] | None  # the target's final logits per verify row; None where argmax ids decided

    @property
    def num_tokens(self) -> int:
        """The request's tokens once the emitted ones are appended."""
        return self.request.num_tokens + len(self.verdict.tokens)

    def samples(self) -> list[Sample]:
        params = self.request.params
        if self.finals is None:
            return [Sample(token, None) for token in self.verdict.tokens]
        return [described(final, token, params) for final, token in zip(self.finals, self.verdict.tokens)]


class DraftHead:
    """The lm_head rows drafting scores: all of them, or the `--lm-head-draft` subset (spec_vocab.py)."""

    def __init__(self, executor: Executor, model: PreparedModel, weights: ModelWeights, vocab: DraftVocab | None) -> None:
        self.executor = executor
        self.weights = weights
        self.vocab = vocab
        self.tensor: Tensor = model.lm_head if vocab is None else self._prepare()

    def token(self, column: int) -> int:
        return column if self.vocab is None else int(self.vocab.ids[column])

    def expand(self, probs: np.ndarray) -> np.ndarray:
        """Draft-column probabilities as a full-vocabulary distribution (zero outside the subset)."""
        if self.vocab is None:
            return probs
        full = np.zeros(self.weights.config.vocab_size)
        full[self.vocab.ids] = probs
        return full

    def observe(self, tokens: Sequence[int]) -> None:
        # In place: the tensor's buffer is never freed, and graphs captured over it must stay valid.
        if self.vocab is not None and self.vocab.observe(tokens):
            self.executor.rewrite_weight(self.tensor, [self._rows()])

    def _prepare(self) -> Tensor:
        return self.executor.prepare_weight("mtp.lm_head_draft", [self._rows()], WeightRole.LINEAR)

    def _rows(self) -> np.ndarray:
        stored = self.weights.draft_head.rows_for(self.vocab.ids) if self.weights.draft_head is not None else None
        return stored if stored is not None else dense_rows(self.weights.lm_head, self.vocab.ids)


@dataclass(frozen=True)
class Drafter:
    mtp: PreparedMTP
    head: DraftHead
    draft_tokens: int  # k: drafts per step


class SpecRunner(ModelRunner):
    """ModelRunner's drop-in for `--spec mtp`: `run` returns the accepted drafts plus one token per request.
    Its step forward is the verify forward (on the CUDA executor, graphs keyed by batch x verify width);
    `mtp_steps` runs catch-up and drafting (default: op by op)."""

    def __init__(
        self,
        executor: Executor,
        model: PreparedModel,
        kv: KVCache,
        ledger: KVLedger,
        drafter: Drafter,
        step_forward: StepForward | None = None,
        mtp_steps: MTPSteps | None = None,
    ) -> None:
        super().__init__(executor, model, kv, ledger, step_forward)
        self.mtp = drafter.mtp
        self.mtp_steps = mtp_steps or EagerMTPSteps(executor, model, drafter.mtp, kv)
        self.head = drafter.head
        self.draft_tokens = drafter.draft_tokens
        self.drafts: dict[str, Draft] = {}  # made at the end of a request's step, verified in its next one

    def run(self, chunks: Sequence[ScheduledChunk]) -> list[SampledTokens]:
        parts, drafts = zip(*(self._rows(chunk) for chunk in chunks))
        batch = step_batch(parts)
        out = self.run_forward(parts, batch)
        sampling = [(chunk.request, part, draft) for chunk, part, draft in zip(chunks, parts, drafts) if chunk.samples]
        host = self._fetch(out.logits, None, [argmax_decides(request.params) for request, _, _ in sampling])
        verified, row = [], 0
        for request, part, draft in sampling:
            verified.append(self._verify(request, draft, host.rows(row, row + len(part.logit_offsets))))
            row += len(part.logit_offsets)
            if self.states is not None:  # the live state: after the pass's first row and the accepted drafts
                self.states.accept(request, verified[-1].verdict.accepted)
        self.head.observe([token for v in verified for token in v.verdict.tokens])
        self.drafts = self._draft(chunks, parts, batch, out.hidden, verified)
        return [SampledTokens(v.request, v.samples(), v.drafted) for v in verified]

    # -- verification ----------------------------------------------------------------------------------

    def _rows(self, chunk: ScheduledChunk) -> tuple[SeqRows, Draft]:
        """The chunk's rows, with the request's drafts appended to a decode (as many as its pages hold)."""
        request = chunk.request
        seq = self.ledger.sequence(request)
        start, size = request.num_computed, chunk.num_tokens
        tokens = request.token_slice(start, start + size)
        if not chunk.samples:
            return SeqRows(seq, start, tokens, [], request.request_id, self.state_rows(request, rows=size)), Draft()
        held = self.drafts.get(request.request_id, Draft()) if size == 1 else Draft()
        draft = held.clipped(max(self._room(request) - request.num_tokens, 0))
        offsets = list(range(size - 1, size + len(draft.tokens)))
        state = self.state_rows(request, saved=1 + len(draft.tokens), rows=size + len(draft.tokens))  # one per row
        return SeqRows(seq, start, tokens + draft.tokens, offsets, request.request_id, state), draft

    def _fetch(self, logits: Tensor, ids: Tensor | None, by_argmax: Sequence[bool]) -> HostRows:
        """`by_argmax[i]`: whether request i's rows are decided by their argmax ids (computed here when
        `ids` is None). One host sync per kind of data that some request needs."""
        host_ids = None
        if any(by_argmax):
            host_ids = self.executor.to_host(self.executor.argmax(logits) if ids is None else ids)[:, 0]
        host_logits = None if all(by_argmax) else self.executor.to_host(logits)
        return HostRows(host_ids, host_logits)

    def _verify(self, request: Request, draft: Draft, rows: HostRows) -> Verified:
        params = request.params
        if argmax_decides(params):
            return Verified(request, len(draft.tokens), verify_greedy(draft.tokens, rows.ids.tolist()), None)
        # Row i's target is conditioned on the drafts before it (penalties see them as output).
        finals = [
            final_logits(row, params, request.prompt_vocab, request.output_ids + draft.tokens[:i])
            for i, row in enumerate(rows.logits)
        ]
        if params.greedy:
            verdict = verify_greedy(draft.tokens, [int(np.argmax(final)) for final in finals])
        else:
            target = np.stack([softmax(final) for final in finals])
            q = np.array(draft.probs).reshape(len(draft.tokens), target.shape[1])
            verdict = verify_sampled(draft.tokens, q, target, request.generator)
        return Verified(request, len(draft.tokens), verdict, finals)

    # -- drafting --------------------------------------------------------------------------------------

    def _draft(
        self,
        chunks: Sequence[ScheduledChunk],
        parts: Sequence[SeqRows],
        batch: StepBatch,
        hidden: Tensor,
        verified: list[Verified],
    ) -> dict[str, Draft]:
        """Catch-up over the step's rows, then k - 1 single-row MTP steps for every sampling request."""
        by_request = {id(v.request): v for v in verified}
        found = [by_request.get(id(chunk.request)) for chunk in chunks]
        catch_up = replace(
            batch,
            state_slots=np.zeros(0, np.int32),  # the MTP layer keeps no linear-attention state
            state_targets=np.zeros((0, 1), np.int32),
            token_ids=np.concatenate([_next_tokens(c, p, v) for c, p, v in zip(chunks, parts, found)]).astype(np.int32),
            logit_rows=np.array(
                [batch.query_start[i] + c.num_tokens - 1 + v.verdict.accepted for i, (c, v) in enumerate(zip(chunks, found)) if v],
                np.int32,
            ),
        )
        out = self.mtp_steps.catch_up(catch_up, hidden, self.head.tensor)
        if not verified:
            return {}
        drafts = {v.request.request_id: Draft() for v in verified}
        greedy = [v.request.params.greedy for v in verified]  # drafts take no penalties: the argmax decides
        self._pick(verified, self._fetch(out.logits, out.ids, greedy), drafts)
        # Draft j (0-based) is written at position N' - 2 + j: it must stay inside the request's pages.
        steps = min([self.draft_tokens, *(self._room(v.request) - v.num_tokens + 2 for v in verified)])
        for j in range(1, steps):
            rows = [
                SeqRows(self.ledger.sequence(v.request), v.num_tokens - 2 + j, drafts[v.request.request_id].tokens[-1:], [0], v.request.request_id)
                for v in verified
            ]
            out = self.mtp_steps.draft(step_batch(rows), self.head.tensor)
            self._pick(verified, self._fetch(out.logits, out.ids, greedy), drafts)
        return drafts

    def _pick(self, verified: list[Verified], host: HostRows, drafts: dict[str, Draft]) -> None:
        """One more draft per request: the argmax for greedy requests, else a draw from q (kept for
        verification). q takes the request's temperature and top-k/p but no penalties: any q is exact."""
        for i, v in enumerate(verified):
            params, draft = v.request.params, drafts[v.request.request_id]
            if params.greedy:
                draft.tokens.append(self.head.token(int(host.ids[i])))
                continue
            q = softmax(final_logits(host.logits[i], params))
            draft.tokens.append(self.head.token(int(v.request.generator.choice(q.shape[0], p=q))))
            draft.probs.append(self.head.expand(q))

    def _room(self, request: Request) -> int:
        """Tokens the request's pages (and the context limit) can hold this step."""
        seq = self.ledger.sequence(request)
        return min(len(seq.pages) * seq.page_size, self.ledger.manager.context_limit)


def _next_tokens(chunk: ScheduledChunk, part: SeqRows, verified: Verified | None) -> list[int]:
    """The token after each of the part's rows (the MTP's x[p+1]). A sampling part's rows past its
    accepted ones get a filler: their MTP K/V lies past the accepted length and is rewritten before use."""
    request, start, size = chunk.request, chunk.request.num_computed, chunk.num_tokens
    if verified is None:  # a prefill chunk that samples nothing: the next prompt tokens
        return request.token_slice(start + 1, start + size + 1)
    following = request.token_slice(start + 1, start + size) + verified.verdict.tokens
    return following + following[-1:] * (len(part.token_ids) - len(following))
