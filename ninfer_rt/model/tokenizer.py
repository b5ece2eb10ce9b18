"""The model's tokenizer (``tokenizer.json`` via ``tokenizers``), its special tokens, EOS ids and chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """The model directory's tokenizer files are missing or malformed."""


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tokenizer_json = model_dir / "tokenizer.json"
        if not tokenizer_json.exists():
            raise TokenizerError(f"{model_dir}: no tokenizer.json")
        self._tok = _HFTokenizer.from_file(str(tokenizer_json))
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        self.special_tokens: dict[str, int] = self._special_tokens(tokenizer_config)
        self.eos_token_ids: tuple[int, ...] = self._eos_ids(tokenizer_config, generation_config)
        self.bos_token_id: int | None = self._token_id(_token_content(tokenizer_config.get("bos_token")))
        self.chat_template: str | None = _chat_template(model_dir, tokenizer_config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _special_tokens(self, tokenizer_config: dict[str, Any]) -> dict[str, int]:
        specials = {
            entry["content"]: int(token_id)
            for token_id, entry in tokenizer_config.get("added_tokens_decoder", {}).items()
            if entry.get("special")
        }
        for token_id, token in self._tok.get_added_tokens_decoder().items():
            if token.special:
                specials.setdefault(token.content, token_id)
        return specials

    def _eos_ids(self, tokenizer_config: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
        # generation_config's list is what HF generate() stops on; the tokenizer's eos_token is added if absent.
        ids = list(_as_id_list(generation_config.get("eos_token_id")))
        tokenizer_eos = self._token_id(_token_content(tokenizer_config.get("eos_token")))
        if tokenizer_eos is not None:
            ids.append(tokenizer_eos)
        return tuple(dict.fromkeys(ids))


class IncrementalDetokenizer:
    """Turns a token stream into text deltas that never end inside a UTF-8 sequence.

    Byte-level BPE can split one character over several tokens; decoding such a prefix yields U+FFFD.
    Like vLLM, this decodes a small window (tokens already emitted as context + new tokens) and emits the
    new suffix only once it no longer ends in U+FFFD. The context window also keeps decoders that strip a
    leading space (SentencePiece) from dropping spaces between deltas.
    """

    # how many prompt tokens seed the context window, as in vLLM
    PROMPT_CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT_TOKENS :])
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(self._ids)  # tokens before this are already emitted as text

    def add(self, token_id: int) -> str:
        """Feeds one token; returns the text it completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Emits whatever is held back at the end of the stream, even if it is not valid UTF-8."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config.json stores special tokens either as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    # A standalone chat_template.jinja is what transformers >= 4.43 writes and prefers.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template
