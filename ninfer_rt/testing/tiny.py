"""Tiny random-weight checkpoints in Hugging Face layout, for tests and CPU experiments.

``make_tiny_model`` writes config.json, model.safetensors (bf16, optionally sharded), generation_config.json,
a byte-level BPE tokenizer.json trained on a small built-in text, and tokenizer_config.json with a
Qwen3-style ChatML template that renders history verbatim (so turn N's prompt prefixes turn N+1's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.weights import SHARD_INDEX, SINGLE_FILE, expected_tensors

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Qwen3 marks these as added but not special, so skip_special_tokens keeps them for reasoning/tool parsing.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2/3's split pattern: unlike GPT-2's, `\s*[\r\n]+` keeps a run of newlines one piece whatever follows, so
# a prompt ending in "\n\n" tokenizes as a prefix of the same text continued (prefix-cache friendly).
QWEN_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}

WEIGHT_STD = 0.02
NORM_NOISE_STD = 0.05
TINY_MAX_POSITIONS = 4096

CHAT_TEMPLATE = r"""{#- Qwen3-style ChatML. History is rendered verbatim (preserve_thinking defaults to true) so that the
    prompt of turn N is a prefix of the prompt of turn N+1 and the prefix cache hits. An assistant turn
    with reasoning_content == "" renders the empty think block that enable_thinking=false put in its prompt. -#}
{%- set preserve_thinking = preserve_thinking if preserve_thinking is defined else true %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none
              and (preserve_thinking or loop.index0 > ns.last_query_index) %}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if not loop.first or message.content %}{{- '\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

TRAINING_TEXT = '''
def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Request:
    def __init__(self, request_id: str, prompt: list[int], max_tokens: int = 256) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output: list[int] = []

    def is_finished(self) -> bool:
        return len(self.output) >= self.max_tokens


import json
import os
from pathlib import Path


def read_config(path: Path) -> dict:
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    config = read_config(Path(os.environ.get("CONFIG", "config.json")))
    for key, value in sorted(config.items()):
        print(f"{key} = {value!r}")
    if not config:
        raise ValueError("empty config")


if __name__ == "__main__":
    main()

The quick brown fox jumps over the lazy dog. A language model reads a prompt, one token at a time, and
predicts the next token. The key and value vectors of every token are kept in a cache so that the model
does not recompute them; when a conversation continues, the prompt of the new turn starts with the whole
previous conversation, and the cached pages can be reused. This is called prefix caching.
The user asked the assistant to fix a failing test. The assistant read the file, found the bug in the
loop bound, and proposed a patch. Then it ran the tests again and all of them passed.
Please write a function that returns the sum of the squares of the even numbers in a list.
Here is the answer: sum(x * x for x in numbers if x % 2 == 0). It runs in linear time.
Café, naïve, résumé, 世界, こんにちは, Привет, 🎉 — text is not only ASCII.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
'''


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "qwen3"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 128
    vocab: int = 512
    tie: bool = False
    mtp: bool = False
    yarn: float | None = None
    seed: int = 0
    shards: int = 1
    max_positions: int = TINY_MAX_POSITIONS  # before YaRN scaling


def make_tiny_model(out_dir: str | Path, **sizes: object) -> Path:
    """Writes a random tiny checkpoint to ``out_dir``; keyword arguments are the fields of TinyModelSpec."""
    spec = TinyModelSpec(**sizes)  # type: ignore[arg-type]
    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {spec.arch!r}; choose from {', '.join(ARCHITECTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(out, trained_tokenizer(spec.vocab), spec.max_positions)
    config = config_json(spec, bos_id=ids[ENDOFTEXT], eos_id=ids[IM_END])
    write_json(out / "config.json", config)
    _write_weights(out, ModelConfig.from_dict(config), spec)
    return out


def trained_tokenizer(vocab_size: int) -> Tokenizer:
    """A fresh copy of the BPE tokenizer trained on TRAINING_TEXT (the caller may add tokens to it)."""
    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


@lru_cache(maxsize=None)
def _trained_tokenizer_json(vocab_size: int) -> str:
    return train_tokenizer([TRAINING_TEXT], vocab_size).to_str()


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with Qwen's split pattern; specials get ids 0..2, the markup tokens the last ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in MARKUP_TOKENS])
    return tokenizer


def write_tokenizer_files(out: Path, tokenizer: Tokenizer, max_positions: int = TINY_MAX_POSITIONS) -> dict[str, int]:
    """tokenizer.json, generation_config.json and tokenizer_config.json; returns the special and markup ids."""
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS)}
    write_json(out / "generation_config.json", _generation_config_json(ids))
    write_json(out / "tokenizer_config.json", _tokenizer_config_json(ids, max_positions))
    return ids


def config_json(spec: TinyModelSpec, bos_id: int, eos_id: int) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": spec.tie,
        "attention_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }
    if spec.arch == "llama":
        config["mlp_bias"] = False
    if spec.yarn is not None:
        config["max_position_embeddings"] = int(spec.max_positions * spec.yarn)
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": spec.yarn,
            "original_max_position_embeddings": spec.max_positions,
        }
    if spec.mtp:
        config["mtp_num_hidden_layers"] = 1
    return config


def _generation_config_json(ids: dict[str, int]) -> dict[str, object]:
    return {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def _tokenizer_config_json(ids: dict[str, int], max_positions: int) -> dict[str, object]:
    added_tokens_decoder = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
        for token, token_id in ids.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _random_tensor(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) == 1:  # RMSNorm gains start near 1 like a trained model's, not near 0
        values = 1.0 + NORM_NOISE_STD * rng.standard_normal(shape)
    else:
        values = WEIGHT_STD * rng.standard_normal(shape)
    return values.astype(np.float32).astype(ml_dtypes.bfloat16)


def _write_weights(out: Path, cfg: ModelConfig, spec: TinyModelSpec) -> None:
    rng = np.random.default_rng(spec.seed)
    tensors = {name: _random_tensor(rng, shape) for name, shape in expected_tensors(cfg).items()}
    if spec.shards <= 1:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for shard, shard_names in enumerate(np.array_split(np.array(names), spec.shards), start=1):
        file_name = f"model-{shard:05d}-of-{spec.shards:05d}.safetensors"
        save_file({n: tensors[n] for n in shard_names}, str(out / file_name), metadata={"format": "pt"})
        weight_map.update({str(n): file_name for n in shard_names})
    total_size = sum(t.nbytes for t in tensors.values())
    write_json(out / SHARD_INDEX, {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
