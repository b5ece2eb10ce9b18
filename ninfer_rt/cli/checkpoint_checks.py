"""The checks `ninfer-rt check` runs on a model directory, each giving one line of the report.

Each check reads what the runtime would read, through the runtime's own readers (config, weights, tokenizer,
chat template), so a checkpoint that passes loads; a failure's detail is the reader's one-line message,
naming the field or tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ninfer_rt.cli.check_logits import (
    MAX_RELATIVE_ERROR,
    max_relative_error,
    numpy_logits,
    reference_available,
    transformers_logits,
)
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.model.weights import Checkpoint, load_checkpoint
from ninfer_rt.quantize.format import QuantizedWeight
from ninfer_rt.quantize.scheme import scheme_from_dir
from ninfer_rt.serve.chat import ChatTemplate

OK, FAIL, SKIPPED = "OK", "FAIL", "SKIPPED"
FLOAT_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 5 + 8?"},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "Is it raining in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    ]},
    {"role": "tool", "content": "light rain, 14 C"},
]


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # OK | FAIL | SKIPPED
    detail: str

    def line(self) -> str:
        return f"{self.status:<7} {self.name}: {self.detail}"


def check_config(model_dir: Path) -> tuple[CheckResult, ModelConfig | None]:
    try:
        cfg = ModelConfig.from_dir(model_dir)
        scheme = scheme_from_dir(model_dir)
    except ValueError as err:
        return CheckResult("config", FAIL, str(err)), None
    layers = f"{cfg.num_hidden_layers} layers"
    if cfg.is_hybrid:
        layers += f" ({len(cfg.linear_attention_layers)} linear + {len(cfg.full_attention_layers)} full attention)"
    quantized = f", {scheme.method} int{scheme.bits} g{scheme.group_size}" if scheme else ""
    detail = f"{cfg.architecture}, {layers}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}{quantized}"
    return CheckResult("config", OK, detail + (", MTP" if cfg.mtp_layers else "")), cfg


def check_tensors(model_dir: Path, cfg: ModelConfig) -> tuple[CheckResult, Checkpoint | None]:
    """Presence and shape (load_checkpoint, naming every offender), then each float tensor's dtype."""
    try:
        checkpoint = load_checkpoint(model_dir, cfg)
    except ValueError as err:
        return CheckResult("tensors", FAIL, str(err)), None
    wrong = [
        f"{name} is {tensor.dtype}" for name, tensor in checkpoint.items()
        if not isinstance(tensor, QuantizedWeight) and tensor.dtype not in FLOAT_DTYPES
    ]
    if wrong:
        return CheckResult("tensors", FAIL, "not bf16/fp16/fp32: " + ", ".join(wrong)), None
    quantized = sum(isinstance(t, QuantizedWeight) for t in checkpoint.values())
    dtypes = sorted({str(t.dtype) for t in checkpoint.values() if not isinstance(t, QuantizedWeight)})
    detail = f"{len(checkpoint)} tensors match config.json ({', '.join(dtypes)}"
    return CheckResult("tensors", OK, detail + (f"; {quantized} quantized linears)" if quantized else ")")), checkpoint


def check_chat_template(model_dir: Path) -> tuple[CheckResult, str | None]:
    """Renders a short conversation and, when the template takes tools, a tool call and its result."""
    try:
        tokenizer = Tokenizer(model_dir)
    except ValueError as err:
        return CheckResult("chat template", FAIL, str(err)), None
    source = tokenizer.chat_template
    if source is None:
        return CheckResult("chat template", FAIL, "the model has no chat template (chat requests cannot be served)"), None
    try:
        template = ChatTemplate(source)
        text = template.render(CONVERSATION).text
        with_tools = "tools" in source
        if with_tools:
            tool_text = template.render(TOOL_TURNS, tools=[TOOL]).text
            if "get_weather" not in tool_text or "Paris" not in tool_text:
                return CheckResult("chat template", FAIL, "renders tools but drops the tool call"), None
    except ValueError as err:
        return CheckResult("chat template", FAIL, str(err)), None
    detail = f"renders a {len(CONVERSATION)}-message conversation" + (" and a tool call" if with_tools else "")
    return CheckResult("chat template", OK, detail), text


def check_tokenizer(model_dir: Path, cfg: ModelConfig, text: str) -> tuple[CheckResult, list[int] | None]:
    """The rendered prompt tokenizes to ids the embedding has rows for and decodes back to itself."""
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode(text)
    if not ids:
        return CheckResult("tokenizer", FAIL, "the rendered conversation tokenizes to no tokens"), None
    if max(ids) >= cfg.vocab_size:
        return CheckResult("tokenizer", FAIL, f"token id {max(ids)} >= vocab_size {cfg.vocab_size} of config.json"), None
    if tokenizer.decode(ids) != text:
        return CheckResult("tokenizer", FAIL, "decoding the rendered conversation's tokens does not give it back"), None
    return CheckResult("tokenizer", OK, f"the conversation is {len(ids)} tokens and decodes back to its text"), ids


def check_logits(model_dir: Path, checkpoint: Checkpoint, tokens: Sequence[int]) -> CheckResult:
    if not tokens:
        return CheckResult("logits", SKIPPED, "--tokens 0")
    missing = reference_available()
    if missing is not None:
        return CheckResult("logits", SKIPPED, f"{missing} (the reference is transformers)")
    ours = numpy_logits(checkpoint, tokens)
    try:
        reference = transformers_logits(model_dir, checkpoint, tokens)
    except Exception as err:  # noqa: BLE001 -- any failure of the optional reference is reported, not raised
        first_line = (str(err).splitlines() or [""])[0]
        return CheckResult("logits", SKIPPED, f"transformers cannot load this checkpoint ({type(err).__name__}: {first_line})")
    if reference.shape != ours.shape:
        return CheckResult("logits", FAIL, f"transformers gives logits {list(reference.shape)}, ninfer-rt {list(ours.shape)}")
    error = max_relative_error(ours, reference)
    status = OK if error <= MAX_RELATIVE_ERROR else FAIL
    return CheckResult(
        "logits", status, f"first {len(tokens)} tokens: max relative error {error:.2e} vs transformers (bound {MAX_RELATIVE_ERROR:g})"
    )
