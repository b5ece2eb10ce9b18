"""Scoring a tiny model with an MTP head: held-out perplexity and greedy MTP acceptance length.

Model-agnostic: any module with the trainers' three methods (ScoredModel) is scored the same way, the dense
Qwen3 and the Qwen3.5 hybrid alike. Evaluation runs the bf16-rounded weights in float32 math, as the numpy
executor computes.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F


class ScoredModel(Protocol):
    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The main model's final-normed hidden states [B, T, hidden]."""

    def mtp_hidden(self, h: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The MTP module's normed output at every position p from h[p] and x[p+1]."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The shared lm_head."""


@torch.no_grad()
def heldout_perplexity(model: ScoredModel, windows: torch.Tensor, batch: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    for start in range(0, len(windows), batch):
        w = windows[start : start + batch]
        logits = model.logits(model.hidden(w[:, :-1]))
        nll += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return math.exp(nll / count), count


@torch.no_grad()
def greedy_continue(model: ScoredModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    seqs = prompts
    for _ in range(new_tokens):  # full recompute per token: tiny model, short sequences
        next_token = model.logits(model.hidden(seqs)[:, -1]).argmax(-1, keepdim=True)
        seqs = torch.cat([seqs, next_token], dim=1)
    return seqs


@torch.no_grad()
def draft(model: ScoredModel, seqs: torch.Tensor, h: torch.Tensor, last: torch.Tensor, k: int) -> torch.Tensor:
    """k greedy MTP drafts per row after seqs[:, :last+2]: the main model has run up to position `last`,
    seqs[last+1] is the newest token. Draft j reuses the one MTP layer at position last+j with (g, d) of
    draft j-1 in place of (h, x): the causal mask makes positions past it irrelevant, so each draft is one
    full-length MTP pass (no cache) and rows at different positions share the batch."""
    rows = torch.arange(len(seqs), device=seqs.device)
    hidden = h.clone()
    next_tokens = torch.cat([seqs[:, 1:], seqs[:, -1:]], dim=1)  # x[p+1] at p; the last column is never read
    drafts = []
    for j in range(k):
        g = model.mtp_hidden(hidden, next_tokens)[rows, last + j]
        d = model.logits(g).argmax(-1)
        drafts.append(d)
        if j + 1 < k:
            hidden[rows, last + j + 1] = g
            next_tokens[rows, last + j + 1] = d
    return torch.stack(drafts, dim=1)


@torch.no_grad()
def acceptance_length(model: ScoredModel, seqs: torch.Tensor, prompt_len: int, k: int) -> float:
    """Mean tokens emitted per verification step (accepted drafts + the bonus token) when greedy decoding of
    `seqs` (the greedy continuations of their prompts) is sped up with k MTP drafts. Greedy verification
    emits exactly the greedy continuation, so each step's accepted count is the drafts' matching prefix."""
    h = model.hidden(seqs)
    length = seqs.shape[1]
    last = torch.full((len(seqs),), prompt_len - 1, device=seqs.device)  # the prefill's last position
    steps = emitted = 0
    while (active := last + k + 2 <= length).any():
        # finished rows draft at a clamped position (in range) and are left out of the counts
        drafts = draft(model, seqs, h, last.clamp(max=length - k - 2), k)
        positions = (last[:, None] + 2 + torch.arange(k, device=seqs.device)).clamp(max=length - 1)
        accepted = (drafts == seqs.gather(1, positions)).int().cumprod(dim=1).sum(dim=1)
        steps += int(active.sum())
        emitted += int((accepted + 1)[active].sum())
        last = last + accepted + 1
    return emitted / max(steps, 1)
