"""Trains ninfer-rt's shipped tiny model: a Qwen3 with one MTP layer (tools/tiny_dense_model.py), on the Python
sources of this machine; with --arch qwen3_5 the Qwen3.5 hybrid of the same size class
(tools/tiny_hybrid_model.py: Gated DeltaNet and gated attention 3 : 1, an MTP layer of the hybrid class),
through the same pipeline and evaluation.

One time-boxed run does everything and writes a Hugging Face-layout checkpoint into --out:
  1. corpus: stdlib + site-packages .py files (tools/tiny_corpus.py), split by file into train / held-out;
  2. a byte-level BPE tokenizer (Qwen's split pattern, ChatML + think/tool tokens from ninfer_rt.testing.tiny);
  3. training until --minutes of wall clock have passed (the text past the tokenizer's sample is encoded on a
     thread meanwhile, so data preparation costs little of the run's wall clock): loss = CE(next token) + 0.3 * CE(MTP's token p+2),
     the MTP module in the Qwen3-Next layout z = fc(cat(norm_e(embed(x[p+1])), norm_h(h[p]))) -> one decoder
     layer -> norm -> the tied lm_head, trained jointly with the main model;
  4. model.safetensors (bf16, tensor names model.* / mtp.*), config.json (qwen3, or qwen3_5_text with
     layer_types and mtp_num_hidden_layers 1), generation_config.json,
     tokenizer.json, tokenizer_config.json, token_freq.json (per-id counts for --lm-head-draft);
  5. with the bf16 weights, in float32 math: held-out perplexity, and greedy MTP acceptance length for
     k = 1..4 drafts; train_summary.json holds every figure and timing, also printed as JSON.

Run from the repository root: PYTHONPATH=. python tools/train_tiny_model.py --out DIR --minutes 6 [--arch qwen3_5]
torch (and for the hybrid transformers, with fla-core on a GPU for speed: tools/tiny_hybrid_model.py's
fast_delta_rule checks its gradients first) is needed here only; the runtime never imports either.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from ninfer_rt.testing.tiny import (
    ENDOFTEXT,
    IM_END,
    TINY_MAX_POSITIONS,
    train_tokenizer,
    write_json,
    write_tokenizer_files,
)
from tiny_corpus import eval_windows, python_sources, read_texts, source_roots, split
from tiny_dense_model import FULL_SHAPE, RMS_EPS, TINY_SHAPE, Shape, TinyQwen3, config_json
from tiny_model_eval import acceptance_length, greedy_continue, heldout_perplexity
from tiny_training_stream import BackgroundEncoder, TrainingStream, encode, prefix_bytes

MTP_LOSS_WEIGHT = 0.3
INIT_STD = 0.02
MAX_DRAFTS = 4
REFRESH_STEPS = 50  # how often the training loop picks up newly encoded chunks


@dataclass(frozen=True)
class RunConfig:
    minutes: float
    seq_len: int
    batch_size: int
    lr: float
    warmup_steps: int
    corpus_mb: float
    heldout_mb: float
    tokenizer_mb: float
    max_files: int | None
    eval_tokens: int
    accept_prompts: int
    accept_prompt_len: int
    accept_new_tokens: int
    seed: int
    device: str
    compile: bool


@dataclass(frozen=True)
class Architecture:
    """What differs between the trained architectures; data, training, evaluation and files are shared."""

    name: str
    full_shape: Any
    tiny_shape: Any
    build: Callable[[Any], nn.Module]  # shape -> a model with hidden / mtp_hidden / logits and .shape
    config_json: Callable[[Any, Tokenizer], dict]  # (model, tokenizer) -> config.json
    exact_math: Callable[[], AbstractContextManager]  # evaluation's float32 math
    # training's kernels: (model, device, log) -> a context yielding a dict of what was chosen, for the summary
    training_math: Callable[[nn.Module, str, Callable[[str], None]], AbstractContextManager[dict]]


def dense_architecture() -> Architecture:
    return Architecture(
        "qwen3", FULL_SHAPE, TINY_SHAPE, TinyQwen3, lambda model, tok: config_json(model.shape, tok), nullcontext,
        lambda model, device, log: nullcontext({}),
    )


def hybrid_architecture() -> Architecture:
    import tiny_hybrid_model as hybrid  # transformers is needed for this architecture only

    def config(model: Any, tokenizer: Tokenizer) -> dict:
        return model.config_json(tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END))

    return Architecture(
        "qwen3_5",
        hybrid.FULL_HYBRID_SHAPE,
        hybrid.TINY_HYBRID_SHAPE,
        lambda shape: hybrid.TinyQwen3_5(shape, TINY_MAX_POSITIONS, RMS_EPS, INIT_STD),
        config,
        hybrid.torch_delta_rule,
        hybrid.fast_delta_rule,
    )


ARCHITECTURES = {"qwen3": dense_architecture, "qwen3_5": hybrid_architecture}


def init_weights(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=INIT_STD)
    # GPT-2's residual scaling: each residual branch's output projection shrinks with depth
    depth = model.shape.layers + 1
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            param.data.mul_(1.0 / math.sqrt(2 * depth))


def parameter_count(model: nn.Module, prefix: str = "") -> int:
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith(prefix))


# -- data --------------------------------------------------------------------------------------------------


# -- training ----------------------------------------------------------------------------------------------


def losses(model: nn.Module, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token CE, MTP CE) over windows of T + 2 tokens: h[p] predicts x[p+1]; MTP(h[p], x[p+1]) -> x[p+2]."""
    t = windows.shape[1] - 2
    inputs, nexts, next_nexts = windows[:, :t], windows[:, 1 : t + 1], windows[:, 2:]
    h = model.hidden(inputs)
    main = F.cross_entropy(model.logits(h).float().flatten(0, 1), nexts.flatten())
    mtp = F.cross_entropy(model.logits(model.mtp_hidden(h, nexts)).float().flatten(0, 1), next_nexts.flatten())
    return main, mtp


def lr_at(cfg: RunConfig, step: int, progress: float) -> float:
    """Linear warm-up over steps, then cosine to 10% over the *time* budget (the run stops on wall clock)."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    return cfg.lr * warm * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]  # norm gains: no weight decay
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=cfg.device == "cuda")


def train(model: nn.Module, stream: TrainingStream, cfg: RunConfig, log: Callable[[str], None]) -> dict:
    step_fn = torch.compile(losses) if cfg.compile else losses
    optimizer = make_optimizer(model, cfg)
    offsets = torch.arange(cfg.seq_len + 2, device=cfg.device)
    generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    autocast = torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=cfg.device == "cuda")
    budget_s = cfg.minutes * 60.0
    start = time.perf_counter()
    step = 0
    model.train()
    while (elapsed := time.perf_counter() - start) < budget_s:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step, elapsed / budget_s)
        if step % REFRESH_STEPS == 0:
            stream.refresh()
        tokens = stream.tokens
        starts = torch.randint(0, len(tokens) - cfg.seq_len - 2, (cfg.batch_size, 1), device=cfg.device, generator=generator)
        windows = tokens[starts + offsets].long()
        with autocast:
            main, mtp = step_fn(model, windows)
        (main + MTP_LOSS_WEIGHT * mtp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0 or step == 1:
            seen = step * cfg.batch_size * cfg.seq_len  # .item() below syncs: only every 100 steps
            log(
                f"step {step} {elapsed:.0f}s loss {main.item():.3f} mtp {mtp.item():.3f} "
                f"{seen / max(elapsed, 1e-9):,.0f} tok/s, {len(tokens):,} tokens encoded"
            )
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    return {
        "steps": step,
        "train_seconds": round(time.perf_counter() - start, 1),
        "train_tokens": step * cfg.batch_size * cfg.seq_len,
        "final_train_loss": round(main.item(), 4),
        "final_train_mtp_loss": round(mtp.item(), 4),
    }


# -- evaluation (bf16 weights, float32 math: what the numpy executor computes) ------------------------------


def evaluate(model: nn.Module, heldout: np.ndarray, cfg: RunConfig) -> dict:
    model.eval()  # the parameters are float32 holding bf16-rounded values (write_weights): float32 math
    windows = torch.from_numpy(eval_windows(heldout, cfg.seq_len, cfg.eval_tokens)).to(cfg.device)
    ppl, tokens = heldout_perplexity(model, windows, batch=max(1, cfg.batch_size // 2))
    prompts = windows[: cfg.accept_prompts, : cfg.accept_prompt_len]
    seqs = greedy_continue(model, prompts, cfg.accept_new_tokens)
    accept = {str(k): round(acceptance_length(model, seqs, cfg.accept_prompt_len, k), 3) for k in range(1, MAX_DRAFTS + 1)}
    return {
        "heldout_ppl": round(ppl, 3),
        "heldout_tokens": tokens,
        "heldout_windows": len(windows),
        "mtp_acceptance_length": accept,
        "acceptance_setup": {
            "prompts": len(prompts),
            "prompt_tokens": cfg.accept_prompt_len,
            "greedy_tokens": cfg.accept_new_tokens,
        },
    }


# -- checkpoint --------------------------------------------------------------------------------------------


def write_weights(out: Path, model: nn.Module, config: dict) -> None:
    """Rounds the weights to bf16 in place (evaluation then scores exactly what is shipped) and saves them."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    tensors = {name: t.detach().to(torch.bfloat16).cpu().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config)


def write_token_freq(out: Path, stream: np.ndarray, vocab: int) -> None:
    counts = np.bincount(stream, minlength=vocab)
    write_json(out / "token_freq.json", {"vocab_size": vocab, "total_tokens": int(counts.sum()), "counts": counts.tolist()})


# -- the run -----------------------------------------------------------------------------------------------


class Timer:
    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks[name] = round(now - self._last, 1)
        self._last = now


def log(message: str) -> None:
    click.echo(f"[train_tiny_model] {message}", err=True)


def prepare_data(cfg: RunConfig, shape: Shape, timer: Timer) -> tuple[Tokenizer, TrainingStream, np.ndarray, dict]:
    train_files, heldout_files = split(python_sources(source_roots()))
    if cfg.max_files is not None:
        train_files, heldout_files = train_files[: cfg.max_files], heldout_files[: max(2, cfg.max_files // 4)]
    train_texts = read_texts(train_files, int(cfg.corpus_mb * 1e6))
    heldout_texts = read_texts(heldout_files, int(cfg.heldout_mb * 1e6))
    timer.mark("read_s")
    log(f"read {len(train_texts)} train / {len(heldout_texts)} held-out files")
    first = prefix_bytes(train_texts, int(cfg.tokenizer_mb * 1e6))
    tokenizer = train_tokenizer(first, shape.vocab)
    timer.mark("tokenizer_train_s")
    # the tokenizer's sample is encoded now, the rest while the model trains
    stream = TrainingStream(encode(tokenizer, first), BackgroundEncoder(tokenizer, train_texts[len(first) :]), cfg.device)
    heldout_stream = encode(tokenizer, heldout_texts)
    timer.mark("first_encode_s")
    corpus = {
        "train_files": len(train_texts),
        "train_chars": sum(map(len, train_texts)),
        "heldout_files": len(heldout_texts),
        "heldout_tokens": len(heldout_stream),
        "tokenizer_vocab": tokenizer.get_vocab_size(with_added_tokens=True),
    }
    return tokenizer, stream, heldout_stream, corpus


def run(out: Path, arch: Architecture, shape: Any, cfg: RunConfig) -> dict:
    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    timer = Timer()
    tokenizer, stream, heldout_stream, corpus = prepare_data(cfg, shape, timer)
    write_tokenizer_files(out, tokenizer)
    model = arch.build(shape)
    init_weights(model)
    model.to(cfg.device)
    log(f"{parameter_count(model):,} parameters ({parameter_count(model, 'mtp.'):,} in the MTP module) on {cfg.device}")
    with arch.training_math(model, cfg.device, log) as kernels:
        training = train(model, stream, cfg, log)
    timer.mark("train_loop_s")
    train_tokens = stream.complete()
    corpus["train_tokens"] = len(train_tokens)
    corpus["epochs"] = round(training["train_tokens"] / len(train_tokens), 2)
    write_token_freq(out, train_tokens, shape.vocab)
    write_weights(out, model, arch.config_json(model, tokenizer))
    timer.mark("write_s")
    with arch.exact_math():
        evaluation = evaluate(model, heldout_stream, cfg)
    timer.mark("eval_s")
    summary = {
        "arch": arch.name,
        "shape": asdict(shape),
        "parameters": parameter_count(model),
        "mtp_parameters": parameter_count(model, "mtp."),
        "checkpoint_bytes": (out / "model.safetensors").stat().st_size,
        "trained_context": cfg.seq_len,
        "device": torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "training_kernels": kernels,
        "run": asdict(cfg),
        "corpus": corpus,
        **training,
        **evaluation,
        "timings_s": timer.marks,
    }
    write_json(out / "train_summary.json", summary)
    return summary


# Settings that differ between the real run and the toy CPU run (--tiny-shape); flags override either.
FULL_DEFAULTS = {"seq_len": 512, "eval_tokens": 1_000_000, "accept_prompts": 32, "accept_prompt_len": 128, "accept_new_tokens": 128}
TINY_DEFAULTS = {"seq_len": 64, "eval_tokens": 4096, "accept_prompts": 4, "accept_prompt_len": 32, "accept_new_tokens": 24}


@click.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--minutes", default=6.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
    help="Wall-clock budget of the training loop alone.",
)
@click.option(
    "--arch", "arch_name", type=click.Choice(sorted(ARCHITECTURES)), default="qwen3", show_default=True,
    help="qwen3: the dense model; qwen3_5: the Gated DeltaNet hybrid of the same size class.",
)
@click.option("--tiny-shape", is_flag=True, help="A toy shape and evaluation, for CPU tests.")
@click.option("--max-files", type=int, default=None, help="Use at most this many training files.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--seq-len", type=int, default=None, help="[default: 512; 64 with --tiny-shape]")
@click.option("--batch-size", type=int, default=None, help="[default: 128 on cuda, 8 on cpu]")
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--warmup-steps", default=200, show_default=True)
@click.option("--corpus-mb", default=200.0, show_default=True, help="Training text to read (MB).")
@click.option("--heldout-mb", default=3.0, show_default=True)
@click.option(
    "--tokenizer-mb", default=16.0, show_default=True,
    help="Text the tokenizer learns from; encoded up front, the rest while training.",
)
@click.option("--eval-tokens", type=int, default=None, help="Held-out tokens scored [default: 1M; 4096 tiny].")
@click.option("--accept-prompts", type=int, default=None, help="Held-out prompts for MTP acceptance [default: 32; 4 tiny].")
@click.option("--accept-prompt-len", type=int, default=None, help="[default: 128; 32 tiny]")
@click.option("--accept-new-tokens", type=int, default=None, help="Greedy tokens per prompt [default: 128; 24 tiny].")
@click.option("--compile", "use_compile", is_flag=True, help="torch.compile the loss (costs budget to compile).")
@click.option("--seed", default=0, show_default=True)
def main(out_dir: Path, arch_name: str, tiny_shape: bool, device: str, use_compile: bool, **options: Any) -> None:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = TINY_DEFAULTS if tiny_shape else FULL_DEFAULTS
    resolved = {name: value if value is not None else preset.get(name) for name, value in options.items()}
    if resolved["batch_size"] is None:
        resolved["batch_size"] = 128 if device == "cuda" else 8
    cfg = RunConfig(device=device, compile=use_compile, **resolved)
    arch = ARCHITECTURES[arch_name]()
    click.echo(json.dumps(run(out_dir, arch, arch.tiny_shape if tiny_shape else arch.full_shape, cfg), indent=2))


if __name__ == "__main__":
    main()
