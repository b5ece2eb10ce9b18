"""The MTP draft module (Qwen3-Next layout), over the same Executor ops as the main model.

For a row at position p whose main-model output (after the final norm) is h[p], and the token x[p+1]
that follows it: z = fc(cat(norm_embedding(embed(x[p+1])), norm_hidden(h[p]))) -- embedding first, as
vLLM's qwen3_next_mtp.py concatenates -- then one decoder layer with its own paged KV (KVCache layer
index num_hidden_layers, written at position p's slot), the MTP final norm and the shared lm_head.
An MTP step's StepBatch is therefore the main step's with token_ids shifted by one.

Drafting chains MTP steps: the catch-up over a verify step's rows, then single-row draft steps, each fed
the hidden state the previous one left (`MTPSteps`). `EagerMTPSteps` runs them op by op on any executor;
the CUDA executor replays them from graphs (exec/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ninfer_rt.model.executor import Executor, PagedKV, StepBatch, Tensor, WeightRole
from ninfer_rt.model.layers import (
    ForwardOutput,
    PreparedLayer,
    PreparedModel,
    decoder_layer,
    prepare_hybrid_layer,
    prepare_layer,
)
from ninfer_rt.model.mixers import Caches, norm_role
from ninfer_rt.model.weights import ModelWeights


@dataclass(frozen=True)
class PreparedMTP:
    fc: Tensor  # [hidden, 2 * hidden]
    norm_embedding: Tensor
    norm_hidden: Tensor
    layer: PreparedLayer
    norm: Tensor

    @property
    def kv_layer(self) -> int:
        """The MTP layer's index in the KVCache (after the main model's attention layers)."""
        return self.layer.mixer.kv_layer


def prepare_mtp(executor: Executor, weights: ModelWeights, model: PreparedModel) -> PreparedMTP:
    if weights.mtp is None:
        raise ValueError("the checkpoint has no MTP weights")
    mtp, cfg = weights.mtp, model.config
    norm = norm_role(cfg)
    kv_layer = len(cfg.full_attention_layers)  # its KV follows the main model's attention layers
    if cfg.is_hybrid:  # a gated-attention layer
        layer = prepare_hybrid_layer(executor, cfg, model.rope, mtp.layer, "mtp.layer", kv_layer)
    else:
        layer = prepare_layer(executor, cfg, model.rope, mtp.layer, "mtp.layer", kv_layer)
    return PreparedMTP(
        fc=executor.prepare_weight("mtp.fc", [mtp.fc], WeightRole.LINEAR),
        norm_embedding=executor.prepare_weight("mtp.norm_embedding", [mtp.norm_embedding], norm),
        norm_hidden=executor.prepare_weight("mtp.norm_hidden", [mtp.norm_hidden], norm),
        layer=layer,
        norm=executor.prepare_weight("mtp.norm", [mtp.norm], norm),
    )


def mtp_forward(
    executor: Executor,
    model: PreparedModel,
    mtp: PreparedMTP,
    batch: StepBatch,
    hidden: Tensor,
    kv: PagedKV,
    lm_head: Tensor | None = None,
) -> ForwardOutput:
    """One MTP step: `batch.token_ids` are the next tokens x[p+1], `hidden` the main model's h[p] per row
    (or, drafting further ahead, the MTP's own output for the row before). `lm_head` defaults to the
    shared one; drafting over a reduced vocabulary passes those rows instead."""
    eps = model.config.rms_norm_eps
    executor.begin_step(batch, kv)
    embedded, _ = executor.rmsnorm(executor.embed(model.embed), mtp.norm_embedding, eps)
    previous, _ = executor.rmsnorm(hidden, mtp.norm_hidden, eps)
    z = executor.linear(executor.concat([embedded, previous]), mtp.fc)
    x, residual = decoder_layer(executor, mtp.layer, eps, z, None, Caches(kv))
    out, _ = executor.rmsnorm(x, mtp.norm, eps, residual)
    return ForwardOutput(hidden=out, logits=executor.logits(out, model.lm_head if lm_head is None else lm_head))


@dataclass(frozen=True)
class MTPOutput:
    """One MTP step's logits rows and their argmax ids (Executor.argmax); ids is None without logit rows."""

    logits: Tensor
    ids: Tensor | None


class MTPSteps(Protocol):
    """The MTP forwards of one speculative step. The hidden state handed from step to step (the catch-up's
    logit rows, then each draft step's output) stays inside: callers pass only the verify forward's.
    An output is valid until the next call (a graph replay rewrites the same buffers): read it first."""

    def catch_up(self, batch: StepBatch, hidden: Tensor, lm_head: Tensor) -> MTPOutput:
        """The MTP over a verify (or prefill) step's rows, `hidden` being that step's main-model output."""

    def draft(self, batch: StepBatch, lm_head: Tensor) -> MTPOutput:
        """One row per request, fed the previous step's hidden state at its logit rows."""


class EagerMTPSteps:
    """MTPSteps as plain op sequences: the numpy executor's, and the CUDA reference graphs must equal."""

    def __init__(self, executor: Executor, model: PreparedModel, mtp: PreparedMTP, kv: PagedKV) -> None:
        self.executor = executor
        self.model = model
        self.mtp = mtp
        self.kv = kv
        self._state: Tensor | None = None

    def catch_up(self, batch: StepBatch, hidden: Tensor, lm_head: Tensor) -> MTPOutput:
        out = mtp_forward(self.executor, self.model, self.mtp, batch, hidden, self.kv, lm_head)
        # Selected now: the next step's publish replaces the logit rows.
        self._state = self.executor.select_rows(out.hidden) if len(batch.logit_rows) else None
        return scored(self.executor, out.logits, batch)

    def draft(self, batch: StepBatch, lm_head: Tensor) -> MTPOutput:
        if self._state is None:
            raise RuntimeError("draft steps follow a catch-up with logit rows")
        out = mtp_forward(self.executor, self.model, self.mtp, batch, self._state, self.kv, lm_head)
        self._state = out.hidden
        return scored(self.executor, out.logits, batch)


def scored(executor: Executor, logits: Tensor, batch: StepBatch) -> MTPOutput:
    return MTPOutput(logits, executor.argmax(logits) if len(batch.logit_rows) else None)
