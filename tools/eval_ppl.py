"""Perplexity of a model through the engine's executor: the yardstick for int8 KV and quantized weights.

Text comes from --text-file, or by default from the held-out split of this machine's Python sources (the
same file-level split tools/train_tiny_model.py trains without, see tools/tiny_corpus.py). The token
stream is cut into non-overlapping windows of --seq-len + 1 tokens; each window is one fresh sequence
prefilled in a single step on the engine's executor and paged KV (so --kv-dtype int8 is measured through
the KV cache's own quantization), scoring every next-token prediction; a hybrid's window starts from the
empty prefix's zero state in one of the engine's state slots. Prints one JSON object.

  python tools/eval_ppl.py                       # the shipped model, held-out sources, numpy executor
  python tools/eval_ppl.py --model DIR --kv-dtype int8 --max-tokens 65536
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import click
import numpy as np

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.layers import forward
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.shipped import default_model_dir
from ninfer_rt.testing.tiny import ENDOFTEXT
from tiny_corpus import eval_windows, python_sources, read_texts, source_roots, split, token_stream


def window_batch(tokens: np.ndarray, page_size: int, state_slot: int | None) -> StepBatch:
    """One sequence of len(tokens) starting at position 0 on pages 0, 1, ..., asking for every row's logits;
    a hybrid's linear layers read and write `state_slot`."""
    count = len(tokens)
    positions = np.arange(count, dtype=np.int32)
    slots = np.array([] if state_slot is None else [state_slot], np.int32)
    pages = np.arange(-(-count // page_size), dtype=np.int32)
    return StepBatch(
        token_ids=tokens.astype(np.int32),
        positions=positions,
        query_start=np.array([0, count], np.int32),
        context_lens=np.array([count], np.int32),
        block_tables=pages[None, :],
        slot_mapping=positions,  # pages are consecutive from 0, so slot == position
        logit_rows=positions,
        lanes=("eval_ppl",),
        state_slots=slots,
        state_targets=slots[:, None],  # the state after the window's last row replaces the one read
    )


def window_nll(engine: Engine, window: np.ndarray, states: StateSlotPool | None, state_slot: int | None) -> float:
    """Summed negative log-likelihood of window[1:] given its prefixes (float64 log-softmax)."""
    if states is not None:  # a fresh sequence: the empty prefix's state
        states.zero(state_slot, engine.executor.compute)
    batch = window_batch(window[:-1], engine.kv.spec.page_size, state_slot)
    output = forward(engine.executor, engine.runner.model, batch, engine.kv, states)
    logits = engine.executor.to_host(output.logits).astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    log_norm = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=-1))
    return float((log_norm - logits[np.arange(len(logits)), window[1:]]).sum())


def state_pool(engine: Engine) -> StateSlotPool | None:
    """A hybrid's state slots (None: no linear-attention layers)."""
    return None if engine.ledger.states is None else engine.ledger.states.pool


def perplexity(engine: Engine, windows: np.ndarray) -> tuple[float, int]:
    """(perplexity, scored tokens) over `windows` [N, seq_len + 1]; each window reuses the same pages (and
    state slot)."""
    states = state_pool(engine)
    slot = None if states is None else states.acquire(engine.executor.compute)
    nll = sum(window_nll(engine, window, states, slot) for window in windows)
    scored = windows.shape[0] * (windows.shape[1] - 1)
    return math.exp(nll / scored), scored


def heldout_text(max_bytes: int) -> list[str]:
    _, heldout = split(python_sources(source_roots()))
    return read_texts(heldout, max_bytes)


@click.command()
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Model directory [default: the shipped tiny model].")
@click.option("--text-file", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Score this text instead of the held-out Python sources.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=16384, show_default=True, type=click.IntRange(min=1), help="Tokens scored.")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--kv-dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "int8"]))
def main(model_dir: Path | None, text_file: Path | None, seq_len: int, max_tokens: int, device: str, kv_dtype: str) -> None:
    model_dir = model_dir or default_model_dir()
    tokenizer = Tokenizer(model_dir)
    texts = [text_file.read_text()] if text_file else heldout_text(max_bytes=max_tokens * 8)
    stream = token_stream([tokenizer.encode(t) for t in texts], tokenizer.token_to_id(ENDOFTEXT))
    windows = eval_windows(stream, seq_len, max_tokens)
    engine = Engine.load(
        model_dir, EngineConfig(device=device, kv_dtype=kv_dtype, max_context=seq_len + 1, max_concurrency=1, logit_rows=seq_len)
    )
    start = time.perf_counter()
    ppl, scored = perplexity(engine, windows)
    result = {
        "model": str(model_dir),
        "source": str(text_file) if text_file else "held-out Python sources",
        "ppl": round(ppl, 4),
        "tokens": scored,
        "windows": len(windows),
        "seq_len": seq_len,
        "device": device,
        "kv_dtype": kv_dtype,
        "seconds": round(time.perf_counter() - start, 1),
    }
    click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
