"""The MTP draft module (Qwen3-Next layout), over the same Executor ops as the main model.

For a row at position p whose main-model output (after the final norm) is h[p], and the token x[p+1]
that follows it: z = fc(cat(norm_embedding(embed(x[p+1])), norm_hidden(h[p]))) -- embedding first, as
vLLM's qwen3_next_mtp.py concatenates -- then one decoder layer with its own paged KV (KVCache layer
index num_hidden_layers, written at position p's slot), the MTP final norm and the shared lm_head.
An MTP step's StepBatch is therefore the main step's with token_ids shifted by one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_rt.exec.base import Executor, StepBatch, Tensor
from ninfer_rt.kv.cache import KVCache
from ninfer_rt.model.layers import ForwardOutput, PreparedLayer, PreparedModel, decoder_layer, prepare_layer
from ninfer_rt.model.weights import ModelWeights


@dataclass(frozen=True)
class PreparedMTP:
    fc: Tensor  # [hidden, 2 * hidden]
    norm_embedding: Tensor
    norm_hidden: Tensor
    layer: PreparedLayer
    norm: Tensor
    kv_layer: int  # the MTP layer's index in the KVCache (after the main layers)


def prepare_mtp(executor: Executor, weights: ModelWeights, model: PreparedModel) -> PreparedMTP:
    if weights.mtp is None:
        raise ValueError("the checkpoint has no MTP weights")
    mtp = weights.mtp
    return PreparedMTP(
        fc=executor.prepare_weight("mtp.fc", [mtp.fc]),
        norm_embedding=executor.prepare_weight("mtp.norm_embedding", [mtp.norm_embedding]),
        norm_hidden=executor.prepare_weight("mtp.norm_hidden", [mtp.norm_hidden]),
        layer=prepare_layer(executor, model.config, model.rope, mtp.layer, "mtp.layer"),
        norm=executor.prepare_weight("mtp.norm", [mtp.norm]),
        kv_layer=model.config.num_hidden_layers,
    )


def mtp_forward(
    executor: Executor,
    model: PreparedModel,
    mtp: PreparedMTP,
    batch: StepBatch,
    hidden: Tensor,
    kv: KVCache,
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
    x, residual = decoder_layer(executor, mtp.layer, eps, z, None, kv, mtp.kv_layer)
    out, _ = executor.rmsnorm(x, mtp.norm, eps, residual)
    return ForwardOutput(hidden=out, logits=executor.logits(out, model.lm_head if lm_head is None else lm_head))
