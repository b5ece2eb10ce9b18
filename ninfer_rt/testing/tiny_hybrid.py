"""Tiny random Qwen3.5 hybrid checkpoints, written by transformers itself, in both of the family's layouts.

``causal_lm`` is what ``Qwen3_5ForCausalLM.save_pretrained`` writes (text weights under ``model.*``);
``conditional_generation`` is the published vision-language form (``Qwen3_5ForConditionalGeneration``: text
weights under ``model.language_model.*``, a vision tower under ``model.visual.*``). For one seed both hold the
same text weights. transformers neither builds nor saves the MTP layer, so its tensors (the names vLLM's
``qwen3_5_mtp.py`` loads: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.0.*`` as a full-attention decoder layer, ``mtp.norm``) are added here, with
``mtp_num_hidden_layers: 1`` in config.json. Weights are float32. The norms, ``A_log`` and ``dt_bias`` are
moved away from their initial values (zero-centred gains of 0, gated-norm gains of 1, dt_bias of 1), so that a
(1 + w) applied as w, or a gate that ignores them, shows in the logits. torch and transformers are imported
only when a checkpoint is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from ninfer_rt.model.tiny import ENDOFTEXT, IM_END, TINY_MAX_POSITIONS, trained_tokenizer, write_json, write_tokenizer_files

LAYOUTS = ("causal_lm", "conditional_generation")
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
MTP_SHARD = "model-mtp.safetensors"
INITIALIZER_RANGE = 0.02
GAIN_NOISE_STD = 0.1


@dataclass(frozen=True)
class TinyHybridSpec:
    layout: str = "causal_lm"
    hidden: int = 64
    layers: int = 8  # every 4th is full attention: 3 linear : 1 full
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32  # 25% rotary: 8 dims
    linear_key_heads: int = 2
    linear_value_heads: int = 6  # value head j reads key head j // 3
    linear_head_dim: int = 16
    intermediate: int = 128
    vocab: int = 512
    tie: bool = False
    mtp: bool = True
    seed: int = 0
    shards: int = 1
    max_positions: int = TINY_MAX_POSITIONS


def make_tiny_qwen3_5(out_dir: str | Path, **fields: Any) -> Path:
    """Writes a tiny random Qwen3.5 checkpoint to ``out_dir``; keyword arguments are TinyHybridSpec's fields."""
    spec = TinyHybridSpec(**fields)
    if spec.layout not in LAYOUTS:
        raise ValueError(f"unknown layout {spec.layout!r}; choose from {', '.join(LAYOUTS)}")
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = trained_tokenizer(spec.vocab)
    generator = torch.Generator().manual_seed(spec.seed)
    causal = _random_causal_lm(spec, tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END), generator)
    model = causal if spec.layout == "causal_lm" else _conditional_generation(causal, spec)
    total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    model.save_pretrained(out, max_shard_size=max(total_bytes // spec.shards + 1, 1) if spec.shards > 1 else "50GB")
    if spec.mtp:
        _add_mtp(out, causal, generator)
    write_tokenizer_files(out, tokenizer, spec.max_positions)
    return out


def text_config(spec: TinyHybridSpec, bos_id: int, eos_id: int) -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        linear_num_key_heads=spec.linear_key_heads,
        linear_num_value_heads=spec.linear_value_heads,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-6,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=spec.tie,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def _random_causal_lm(spec: TinyHybridSpec, bos_id: int, eos_id: int, generator: Any) -> Any:
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(spec.seed)
    model = Qwen3_5ForCausalLM(text_config(spec, bos_id, eos_id)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("linear_attn.norm.weight"):  # plain-weight gated norm, initialised to 1
                param.copy_(1.0 + GAIN_NOISE_STD * noise)
            elif name.endswith("norm.weight"):  # zero-centred norms, initialised to 0
                param.copy_(GAIN_NOISE_STD * noise)
            elif name.endswith("A_log"):  # decay rates exp(A_log) spread around 1
                param.copy_(0.5 * noise)
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * noise)
    return model


def _conditional_generation(causal: Any, spec: TinyHybridSpec) -> Any:
    """The vision-language model holding exactly ``causal``'s text weights, with a tiny vision tower."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5VisionConfig

    vision = Qwen3_5VisionConfig(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=spec.hidden, num_position_embeddings=16,
    )
    config = Qwen3_5Config(
        text_config=causal.config.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=spec.tie
    )
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(causal.model.state_dict())
    model.lm_head.load_state_dict(causal.lm_head.state_dict())
    return model


def _add_mtp(out: Path, causal: Any, generator: Any) -> None:
    tensors = _mtp_tensors(causal, generator)
    index_path = out / SHARD_INDEX
    if index_path.exists():
        save_file(tensors, str(out / MTP_SHARD), metadata={"format": "pt"})
        index = json.loads(index_path.read_text())
        index["weight_map"].update({name: MTP_SHARD for name in tensors})
        write_json(index_path, index)
    else:
        save_file({**load_file(str(out / SINGLE_FILE)), **tensors}, str(out / SINGLE_FILE), metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    write_json(config_path, config)


def _mtp_tensors(causal: Any, generator: Any) -> dict[str, np.ndarray]:
    """Random MTP tensors named as vLLM's qwen3_5_mtp.py loads them; the layer's names and shapes are those
    of one of transformers' own full-attention decoder layers."""
    import torch

    cfg = causal.config
    full_layer = causal.model.layers[cfg.layer_types.index("full_attention")]
    hidden = cfg.hidden_size
    shapes = {f"mtp.layers.0.{name}": tuple(t.shape) for name, t in full_layer.state_dict().items()}
    shapes.update({
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    })
    scale = {1: GAIN_NOISE_STD, 2: INITIALIZER_RANGE}  # zero-centred gains and linear weights
    return {
        name: (scale[len(shape)] * torch.randn(shape, generator=generator)).numpy().astype(np.float32)
        for name, shape in shapes.items()
    }
