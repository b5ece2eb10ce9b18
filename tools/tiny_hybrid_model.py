"""The Qwen3.5 hybrid that tools/train_tiny_model.py trains with --arch qwen3_5: Gated DeltaNet and gated
attention layers 3 : 1, zero-centred norms, tied embeddings, and one MTP layer of the hybrid class.

The main model is transformers' own Qwen3_5TextModel (what Qwen3_5ForCausalLM wraps): on a GPU where fla-core
imports and its gradients check out (fast_delta_rule), transformers runs its Triton delta-rule kernels;
elsewhere its torch implementation. The MTP module
follows model/mtp.py's math with transformers' parts: z = fc(cat(norm_e(embed(x[p+1])), norm_h(h[p]))) -> one
full-attention Qwen3_5DecoderLayer (gated attention) -> mtp.norm -> the tied lm_head, every norm zero-centred.
Attribute names are the checkpoint's tensor names: model.* as Qwen3_5ForCausalLM saves them, mtp.* as vLLM's
qwen3_5_mtp.py (and ninfer-rt) load them.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5TextConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm, Qwen3_5TextModel

FULL_ATTENTION_INTERVAL = 4  # layers 3, 7, ... are gated attention; the others Gated DeltaNet
ROPE_THETA = 10_000_000.0  # Qwen3.5's
PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3.5's: a quarter of each head's dims rotate
CONV_KERNEL = 4


@dataclass(frozen=True)
class HybridShape:
    hidden: int
    layers: int
    heads: int  # gated attention: q_proj rows are [q_h | gate_h] per head
    kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int  # 3 per key head, as Qwen3.5's 16 / 48
    linear_head_dim: int  # keys and values alike
    intermediate: int
    vocab: int


# 6,978,212 parameters (591,232 in the MTP module), -1.0% of the dense model's 7,050,624 = 14.0 MB in bf16. The
# linear-attention head dim is 128, the 27B's (the CUDA delta-rule kernels take key dims 64 and 128): at 64,
# fla-core's backward on Hopper hits a Triton miscompile (fla #640) and training falls back to the 3x slower
# torch rule (fast_delta_rule). The MLP width 256 keeps every projection's input a multiple of the int4 group size 128.
FULL_HYBRID_SHAPE = HybridShape(
    hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64,
    linear_key_heads=1, linear_value_heads=3, linear_head_dim=128, intermediate=256, vocab=8192,
)
TINY_HYBRID_SHAPE = HybridShape(
    hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16,
    linear_key_heads=1, linear_value_heads=3, linear_head_dim=16, intermediate=128, vocab=1024,
)


def text_config(s: HybridShape, max_positions: int, rms_eps: float, init_std: float) -> Qwen3_5TextConfig:
    layer_types = ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention" for i in range(s.layers)]
    config = Qwen3_5TextConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        layer_types=layer_types,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        linear_num_key_heads=s.linear_key_heads,
        linear_num_value_heads=s.linear_value_heads,
        linear_key_head_dim=s.linear_head_dim,
        linear_value_head_dim=s.linear_head_dim,
        linear_conv_kernel_dim=CONV_KERNEL,
        max_position_embeddings=max_positions,
        rms_norm_eps=rms_eps,
        initializer_range=init_std,
        tie_word_embeddings=True,
        use_cache=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": PARTIAL_ROTARY_FACTOR},
    )
    config._attn_implementation = "sdpa"
    return config


class HybridMTPHead(nn.Module):
    """Tensor names mtp.fc, mtp.pre_fc_norm_{embedding,hidden}, mtp.layers.0 (a gated-attention layer), mtp.norm."""

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps)
        # built as one of the main model's full-attention layers: the same class, names and shapes
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))])
        self.norm = Qwen3_5RMSNorm(hidden, eps)


class TinyQwen3_5(nn.Module):
    def __init__(self, s: HybridShape, max_positions: int, rms_eps: float, init_std: float) -> None:
        super().__init__()
        self.shape = s
        self.config = text_config(s, max_positions, rms_eps, init_std)
        self.model = Qwen3_5TextModel(self.config)
        self.mtp = HybridMTPHead(self.config)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """h: the main model's final-normed hidden states [B, T, hidden]."""
        return self.model(input_ids=tokens, use_cache=False).last_hidden_state

    def mtp_hidden(self, h: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The MTP module's normed output at every position p from h[p] and x[p+1] (embedding first)."""
        embedded = self.mtp.pre_fc_norm_embedding(self.model.embed_tokens(next_tokens))
        z = self.mtp.fc(torch.cat([embedded, self.mtp.pre_fc_norm_hidden(h)], dim=-1))
        positions = torch.arange(z.shape[1], device=z.device)[None]
        # positional: the cache argument is `cache` in newer transformers and `past_key_values` in older 5.x
        mask = create_causal_mask(self.config, z, None, None, position_ids=positions)
        # one row per mRoPE axis (text: all equal), the layout every transformers 5.x rotary embedding accepts
        rotary = self.model.rotary_emb(z, positions[None].expand(3, -1, -1))
        z = self.mtp.layers[0](z, position_embeddings=rotary, attention_mask=mask, position_ids=positions)
        return self.mtp.norm(z)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.model.embed_tokens.weight)  # tied lm_head

    def config_json(self, bos_id: int, eos_id: int) -> dict[str, Any]:
        """transformers' own config (what Qwen3_5ForCausalLM.save_pretrained writes) plus the MTP layer count."""
        config = self.config.to_diff_dict()
        config.update(
            architectures=["Qwen3_5ForCausalLM"],
            model_type="qwen3_5_text",
            layer_types=list(self.config.layer_types),
            tie_word_embeddings=True,
            mtp_num_hidden_layers=1,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            dtype="bfloat16",
        )
        config.pop("use_cache", None)  # a training setting, not the model's
        return config


@contextmanager
def torch_delta_rule() -> Iterator[None]:
    """transformers' torch delta rule for the span, in place of fla-core's kernel where fla-core is installed.
    Evaluation needs it (fla-core's chunked kernel refuses float32 inputs, and evaluation scores the bf16-rounded
    weights in float32 math, as the numpy executor does), and so does training where fla-core's gradients are
    not trusted (fast_delta_rule)."""
    chosen = modeling_qwen3_5.torch_chunk_gated_delta_rule
    modeling_qwen3_5.torch_chunk_gated_delta_rule = inspect.unwrap(chosen)
    try:
        yield
    finally:
        modeling_qwen3_5.torch_chunk_gated_delta_rule = chosen


# fla-core's gradients (bf16 autocast on the GPU) must match the torch rule's (float32 on the CPU, where
# transformers never calls fla-core) within this, relative L2 for each parameter of a linear-attention layer:
# bf16 rounding stays near 1e-2; fla #640's miscompile is off by ~0.5.
FLA_GRADIENT_TOLERANCE = 5e-2
PROBE_TOKENS = 256  # four chunks of 64


@contextmanager
def fast_delta_rule(model: TinyQwen3_5, device: str, log: Callable[[str], None]) -> Iterator[dict[str, Any]]:
    """Training's delta rule: fla-core's Triton kernels where the gradients of one of the model's own
    linear-attention layers agree with transformers' torch rule on a probe batch, the torch rule otherwise
    (~3x slower a step at the shipped shape). fla-core 0.6.0 refuses its gated backward on every Hopper GPU
    with Triton 3.4-3.7.0, a miscompile at a key block of 64 (fla #640): the probe runs with that refusal
    lifted, and the refusal is lifted for training only if the probe agrees. Yields what was chosen and why."""
    unavailable = "not on a GPU" if device != "cuda" else fla_unavailable()
    if unavailable is not None:
        log(f"delta rule: transformers' torch rule (fla-core: {unavailable})")
        yield {"delta_rule": "torch", "reason": unavailable}
        return
    with _hopper_refusal_lifted():
        layer = model.model.layers[model.config.layer_types.index("linear_attention")].linear_attn
        hidden = probe_batch(model.config.hidden_size, device)
        try:
            error = gradient_error(layer_gradients(layer, hidden), torch_reference_gradients(layer, hidden))
            failure = None if error <= FLA_GRADIENT_TOLERANCE else f"gradients off by {error:.3g} (relative L2)"
        except Exception as exc:  # noqa: BLE001 -- any failure of the probe (a refusal, a Triton compile error) means the torch rule
            failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if failure is None:
            log(f"delta rule: fla-core (gradients within {error:.2e} of the torch rule's on a probe batch)")
            yield {"delta_rule": "fla-core", "probe_gradient_error": round(error, 5)}
            return
    log(f"delta rule: transformers' torch rule (fla-core: {failure})")
    with torch_delta_rule():
        yield {"delta_rule": "torch", "reason": failure}


def fla_unavailable() -> str | None:
    """Why transformers' gated delta rule cannot be fla-core's, or None: it dispatches to
    fla.ops.gated_delta_rule.chunk_gated_delta_rule when that imports (and to its torch rule, silently, when not,
    so a probe of the dispatched rule alone cannot tell the two apart)."""
    try:
        module = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as exc:  # noqa: BLE001 -- any import failure is transformers' fallback too
        return f"does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None if hasattr(module, "chunk_gated_delta_rule") else "has no chunk_gated_delta_rule"


def probe_batch(hidden_size: int, device: str) -> torch.Tensor:
    return torch.randn(2, PROBE_TOKENS, hidden_size, device=device, generator=torch.Generator(device).manual_seed(0))


def layer_gradients(layer: nn.Module, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's gradient of mean(out^2) through `layer` (bf16 autocast on a GPU), as float32 on the CPU."""
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=hidden.is_cuda):
        out = layer(hidden)
    out.float().square().mean().backward()
    grads = [p.grad.float().cpu() for p in layer.parameters() if p.grad is not None]
    layer.zero_grad(set_to_none=True)
    return grads


def torch_reference_gradients(layer: nn.Module, hidden: torch.Tensor) -> list[torch.Tensor]:
    """layer_gradients of a float32 copy of `layer` on the CPU, through the torch rule whatever is installed."""
    with torch_delta_rule():
        return layer_gradients(copy.deepcopy(layer).float().cpu(), hidden.float().cpu())


def gradient_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest relative L2 difference over the parameters."""
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads, reference, strict=True))


@contextmanager
def _hopper_refusal_lifted() -> Iterator[None]:
    """fla-core's module flag behind the Hopper refusal, cleared for the span (absent: nothing to lift)."""
    try:
        from fla.ops.common import chunk_o
    except ImportError:
        yield
        return
    flag = getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
    chunk_o.IS_NVIDIA_HOPPER = False
    try:
        yield
    finally:
        chunk_o.IS_NVIDIA_HOPPER = flag
