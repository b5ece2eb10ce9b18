"""Tiny MTP checkpoints whose draft module agrees with the main model often, for acceptance-path tests.

Random tiny models accept almost no drafts. Here the main model is built to mostly follow a fixed token
permutation (next = perm(current)): large random embeddings dominate the residual stream and
lm_head = embed[perm^-1], while its random decoder layers, scaled by `layer_scale`, make some positions
depend on the context (so drafts get rejected there and the KV matters). The MTP module predicts exactly
perm(x[p+1]) -- fc passes the token embedding through and ignores the hidden state, its decoder layer
adds nothing -- so it agrees with the main model wherever the main model follows the permutation.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from ninfer_rt.model.weights import SINGLE_FILE
from ninfer_rt.testing.tiny import make_tiny_model


def make_agreeable_mtp_model(out_dir: Path, layer_scale: float, seed: int = 0, head_dim: int = 32) -> Path:
    model = make_tiny_model(out_dir, arch="qwen3", mtp=True, seed=seed, head_dim=head_dim)
    tensors = {name: np.asarray(t, np.float32) for name, t in load_file(str(model / SINGLE_FILE)).items()}
    rng = np.random.default_rng(seed + 1)
    vocab, hidden = tensors["model.embed_tokens.weight"].shape
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
    perm = rng.permutation(vocab)
    tensors["model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = embed[np.argsort(perm)]  # row perm[x] is embed[x]: argmax at perm[x]
    for name in tensors:
        if name.startswith("model.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] *= layer_scale
    tensors["mtp.fc.weight"] = np.concatenate([np.eye(hidden), np.zeros((hidden, hidden))], axis=1).astype(np.float32)
    for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        tensors[name] = np.zeros_like(tensors[name])
    save_file({n: t.astype(ml_dtypes.bfloat16) for n, t in tensors.items()}, str(model / SINGLE_FILE), metadata={"format": "pt"})
    return model
