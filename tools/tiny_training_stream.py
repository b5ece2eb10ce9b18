"""The training text of tools/train_tiny_model.py as tokens: encoded in batches (`encode`), the bulk of it on a
thread while training runs (`BackgroundEncoder`), and the token stream on the training device, growing as
chunks arrive (`TrainingStream`)."""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch
from tokenizers import Tokenizer

from ninfer_rt.testing.tiny import ENDOFTEXT
from tiny_corpus import token_stream

ENCODE_BATCH = 256  # files per encode_batch call: big enough for the Rust side to use every core
BACKGROUND_CHUNK_FILES = 1024  # files per chunk handed to the training loop (~15 MB of text)


def encode(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # _fast skips offsets
    encoded = []
    for start in range(0, len(texts), ENCODE_BATCH):
        encoded += [e.ids for e in encode_batch(texts[start : start + ENCODE_BATCH], add_special_tokens=False)]
    return token_stream(encoded, tokenizer.token_to_id(ENDOFTEXT))


def prefix_bytes(texts: list[str], max_bytes: int) -> list[str]:
    out, total = [], 0
    for text in texts:
        if total >= max_bytes:
            break
        out.append(text)
        total += len(text)
    return out


class BackgroundEncoder:
    """Encodes training text on a thread while the GPU trains on what is ready: encode_batch releases the
    GIL and spreads over every core, which the training loop leaves idle."""

    def __init__(self, tokenizer: Tokenizer, texts: list[str]) -> None:
        self._chunks: queue.Queue[np.ndarray] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(tokenizer, texts), daemon=True)
        self._thread.start()

    def _run(self, tokenizer: Tokenizer, texts: list[str]) -> None:
        try:
            for start in range(0, len(texts), BACKGROUND_CHUNK_FILES):
                self._chunks.put(encode(tokenizer, texts[start : start + BACKGROUND_CHUNK_FILES]))
        except BaseException as exc:  # re-raised on the training thread by ready()
            self._error = exc

    def ready(self) -> list[np.ndarray]:
        """The chunks encoded since the last call (never blocks)."""
        if self._error is not None:
            raise RuntimeError("encoding the training text failed") from self._error
        chunks = []
        while not self._chunks.empty():
            chunks.append(self._chunks.get_nowait())
        return chunks

    def finish(self) -> list[np.ndarray]:
        self._thread.join()
        return self.ready()


class TrainingStream:
    """The training tokens on the device, growing as the background encoder delivers chunks."""

    def __init__(self, first: np.ndarray, encoder: BackgroundEncoder, device: str) -> None:
        self.device = device
        self.host = [first]
        self.tokens = torch.from_numpy(first.astype(np.int32)).to(device)
        self._encoder = encoder

    def refresh(self) -> None:
        self._append(self._encoder.ready())

    def complete(self) -> np.ndarray:
        """Waits for the encoder; every training token on the host."""
        self._append(self._encoder.finish())
        return np.concatenate(self.host)

    def _append(self, chunks: list[np.ndarray]) -> None:
        if chunks:
            self.host += chunks
            fresh = torch.from_numpy(np.concatenate(chunks).astype(np.int32)).to(self.device)
            self.tokens = torch.cat([self.tokens, fresh])
