"""The dense tiny model tools/train_tiny_model.py trains by default: a Qwen3 (q/k norms, NeoX RoPE, GQA,
SwiGLU, tied lm_head) with one MTP layer in the Qwen3-Next layout, its shapes, and its config.json. Attribute
names give the Hugging Face tensor names (model.*, mtp.*), so the state dict is the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from ninfer_rt.testing.tiny import ENDOFTEXT, IM_END, TINY_MAX_POSITIONS

ROPE_THETA = 1_000_000.0
RMS_EPS = 1e-6

@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


# ~7.05M parameters = 14.1 MB in bf16 (one file under 16 MB), fast enough for 64 CPU tokens in well under 10 s.
FULL_SHAPE = Shape(hidden=256, layers=6, heads=4, kv_heads=2, head_dim=64, intermediate=640, vocab=8192)
TINY_SHAPE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1024)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' Qwen3RMSNorm: normalize in float32, cast back, then scale
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim)
        self.k_norm = RMSNorm(s.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.s
        q = self.q_norm(self.q_proj(x).view(b, t, s.heads, s.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, s.kv_heads, s.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # explicit GQA expansion (head i reads kv head i // group, as HF's repeat_kv): every SDPA backend takes it
        group = s.heads // s.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # the norms and RoPE ran in float32; attention runs in the projections' dtype (bf16 under autocast)
        out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))


class MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """The main model; attribute names give the HF tensor names model.embed_tokens / model.layers.i / model.norm."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden)


class MTPHead(nn.Module):
    """Qwen3-Next MTP layout: tensor names mtp.fc, mtp.pre_fc_norm_{embedding,hidden}, mtp.layers.0, mtp.norm."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * s.hidden, s.hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(s.hidden)
        self.pre_fc_norm_hidden = RMSNorm(s.hidden)
        self.layers = nn.ModuleList([DecoderLayer(s)])
        self.norm = RMSNorm(s.hidden)


class TinyQwen3(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.shape = s
        self.model = Body(s)
        self.mtp = MTPHead(s)
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64) / s.head_dim)
        angles = torch.outer(torch.arange(TINY_MAX_POSITIONS, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        # not persistent: the checkpoint holds weights only, as HF's does
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """h: the main model's final-normed hidden states [B, T, hidden]."""
        cos, sin = self._rope(tokens.shape[1])
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def mtp_hidden(self, h: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The MTP module's normed output at every position p from h[p] and x[p+1] (embedding first)."""
        cos, sin = self._rope(h.shape[1])
        embedded = self.mtp.pre_fc_norm_embedding(self.model.embed_tokens(next_tokens))
        z = self.mtp.fc(torch.cat([embedded, self.mtp.pre_fc_norm_hidden(h)], dim=-1))
        return self.mtp.norm(self.mtp.layers[0](z, cos, sin))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.model.embed_tokens.weight)  # tied lm_head

    def _rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:length], self.sin[:length]


def config_json(s: Shape, tokenizer: Tokenizer) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": TINY_MAX_POSITIONS,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "num_nextn_predict_layers": 1,
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "torch_dtype": "bfloat16",
    }
