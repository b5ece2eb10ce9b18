"""Quality of quantized weights on a trained model: int8 and int4 perplexity against bf16 (tools/eval_ppl.py's
windows and scoring) and teacher-forced top-1 agreement (the quantized model's argmax equals bf16's on the
same prefixes). The model is quantized with `ninfer-rt quantize` into a temporary directory per bit width,
calibrated on --calibration-tokens of the *training* split of the same sources (never the scored held-out
text; 0: weight-only scale search). Prints one JSON line per variant and exits 1 when a target is missed
(int8 within 0.5% of bf16 perplexity, int4 within 3%).

  python tools/eval_quant.py                                   # the shipped model, numpy executor
  python tools/eval_quant.py --model DIR --device cuda --max-tokens 65536
  python tools/eval_quant.py --calibration-tokens 0            # weight-only: no calibration forward
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from eval_ppl import heldout_text, window_batch
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.model.layers import forward
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.quantize_checkpoint.writer import quantize_checkpoint
from ninfer_rt.shipped import default_model_dir
from ninfer_rt.testing.tiny import ENDOFTEXT
from tiny_corpus import eval_windows, python_sources, read_texts, source_roots, split, token_stream

PPL_TARGETS = {8: 0.005, 4: 0.03}  # allowed relative perplexity increase over bf16


@dataclass
class Scores:
    nll: float  # summed over every scored token
    tokens: int
    argmax: np.ndarray  # [windows, seq_len]: each position's top-1 prediction

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens)


def score(model_dir: Path, windows: np.ndarray, device: str) -> Scores:
    """Teacher-forced scoring of every window: summed NLL (float64 log-softmax) and per-position argmax."""
    seq_len = windows.shape[1] - 1
    engine = Engine.load(model_dir, EngineConfig(
        # One window's pages: 'auto' would take every free byte and starve the next variant's engine.
        device=device, max_context=seq_len + 1, max_concurrency=1, kv_capacity=str(seq_len // 64 + 2), logit_rows=seq_len))
    nll, argmax = 0.0, []
    for window in windows:
        output = forward(engine.executor, engine.runner.model, window_batch(window[:-1], engine.kv.spec.page_size), engine.kv)
        logits = engine.executor.to_host(output.logits).astype(np.float64)
        peak = logits.max(axis=-1, keepdims=True)
        log_norm = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=-1))
        nll += float((log_norm - logits[np.arange(seq_len), window[1:]]).sum())
        argmax.append(logits.argmax(axis=-1))
    return Scores(nll, windows.shape[0] * seq_len, np.stack(argmax))


def write_calibration_text(scratch: Path, tokens: int) -> str:
    """Training-split sources (disjoint from heldout_text's files), about 8 bytes per wanted token."""
    train, _ = split(python_sources(source_roots()))
    path = scratch / "calibration.txt"
    path.write_text("\n\n".join(read_texts(train, max_bytes=tokens * 8)))
    return str(path)


@click.command()
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="bf16 model directory [default: the shipped tiny model].")
@click.option("--group-size", default=128, show_default=True, type=int)
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=16384, show_default=True, type=click.IntRange(min=1), help="Tokens scored.")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--calibration-tokens", default=32768, show_default=True, type=click.IntRange(min=0),
              help="Training-split tokens for `quantize --calibration-text`; 0 quantizes without calibration.")
def main(model_dir: Path | None, group_size: int, seq_len: int, max_tokens: int, device: str, calibration_tokens: int) -> None:
    model_dir = model_dir or default_model_dir()
    tokenizer = Tokenizer(model_dir)
    texts = heldout_text(max_bytes=max_tokens * 8)
    windows = eval_windows(token_stream([tokenizer.encode(t) for t in texts], tokenizer.token_to_id(ENDOFTEXT)), seq_len, max_tokens)
    baseline = score(model_dir, windows, device)
    print(json.dumps({"variant": "bf16", "ppl": round(baseline.ppl, 4), "tokens": baseline.tokens}))
    failed = False
    with tempfile.TemporaryDirectory(prefix="eval_quant-") as scratch:
        calibration = write_calibration_text(Path(scratch), calibration_tokens) if calibration_tokens else None
        for bits, target in PPL_TARGETS.items():
            quantized_dir = quantize_checkpoint(
                model_dir, Path(scratch) / f"int{bits}", bits, group_size,
                calibration_text=calibration, calibration_tokens=calibration_tokens,
            )
            scores = score(quantized_dir, windows, device)
            increase = scores.ppl / baseline.ppl - 1
            passed = increase <= target
            failed |= not passed
            print(json.dumps({
                "variant": f"int{bits}-g{group_size}", "ppl": round(scores.ppl, 4), "ppl_increase": round(increase, 5),
                "target": target, "pass": passed, "top1_agreement": round(float((scores.argmax == baseline.argmax).mean()), 4),
                "tokens": scores.tokens, "device": device, "calibration_tokens": calibration_tokens,
            }))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
