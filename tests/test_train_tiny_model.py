"""tools/train_tiny_model.py, run for seconds on the CPU with a toy shape, writes a checkpoint that ninfer-rt and
transformers both load with the same logits, whose MTP module is the runtime's, and whose acceptance figures
mean what speculative decoding would see: the dense Qwen3 (--arch qwen3) and the Qwen3.5 hybrid (--arch qwen3_5)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forward_helpers import SeqStep, hf_outputs, make_runtime, relative_error, step_batch
from ninfer_rt.model.hybrid_config import FULL_ATTENTION, LINEAR_ATTENTION
from ninfer_rt.model.hybrid_weights import GatedAttentionWeights
from ninfer_rt.model.mtp import mtp_forward, prepare_mtp
from ninfer_rt.model.weights import load_model_weights

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))
import train_tiny_model as trainer  # noqa: E402 -- lives in tools/, importable once TOOLS is on the path

EXPECTED_FILES = {
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "token_freq.json",
    "train_summary.json",
}
TOLERANCE = 1e-4
PAGES = [0, 1, 2, 3]
SAME_SIZE_CLASS = 0.10  # the hybrid's parameter budget: the dense model's, +-10%


def train_toy(out: Path, arch: str, minutes: str) -> Path:
    command = [sys.executable, str(TOOLS / "train_tiny_model.py"), "--out", str(out), "--arch", arch]
    command += ["--minutes", minutes, "--max-files", "20", "--tiny-shape", "--device", "cpu", "--warmup-steps", "10"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=600)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads((out / "train_summary.json").read_text())
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_toy(tmp_path_factory.mktemp("trained"), "qwen3", "0.1")


@pytest.fixture(scope="module")
def trained_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_toy(tmp_path_factory.mktemp("trained_hybrid"), "qwen3_5", "0.05")


@pytest.fixture(params=["qwen3", "qwen3_5"])
def either(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """(arch, its toy run's output), for what both architectures must do alike."""
    return request.param, request.getfixturevalue("trained" if request.param == "qwen3" else "trained_hybrid")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def summary(out: Path) -> dict:
    return json.loads((out / "train_summary.json").read_text())


def tokens_of(out: Path, count: int) -> list[int]:
    """Real text tokens (not random ids): a trained model's logits are only meaningful on text."""
    from ninfer_rt.model.tokenizer import Tokenizer

    text = (REPO / "ninfer_rt" / "model" / "layers.py").read_text()
    return Tokenizer(out).encode(text)[:count]


def torch_model(out: Path, arch: str = "qwen3") -> torch.nn.Module:
    """The trainer's own model of `arch` (toy shape), holding the checkpoint's weights."""
    from safetensors.torch import load_file

    architecture = trainer.ARCHITECTURES[arch]()
    model = architecture.build(architecture.tiny_shape)
    model.load_state_dict({k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()})
    return model.eval()


def test_the_run_writes_exactly_the_checkpoint_files_the_lead_copies_back(either: tuple[str, Path]) -> None:
    _, out = either
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES


def test_the_summary_reports_perplexity_and_acceptance_for_one_to_four_drafts(either: tuple[str, Path]) -> None:
    arch, out = either
    s = summary(out)
    assert s["arch"] == arch and s["parameters"] == trainer.parameter_count(torch_model(out, arch))
    assert s["steps"] > 0 and s["train_tokens"] > 0 and math.isfinite(s["heldout_ppl"]) and s["heldout_ppl"] > 1
    assert s["corpus"]["heldout_files"] > 0 and s["heldout_tokens"] > 0
    for k in range(1, 5):
        assert 1.0 <= s["mtp_acceptance_length"][str(k)] <= k + 1


def test_the_token_frequency_file_counts_every_training_token_by_id(either: tuple[str, Path]) -> None:
    _, out = either
    freq = json.loads((out / "token_freq.json").read_text())
    assert freq["vocab_size"] == len(freq["counts"]) == trainer.TINY_SHAPE.vocab
    assert sum(freq["counts"]) == freq["total_tokens"] == summary(out)["corpus"]["train_tokens"]


def test_the_hybrid_gets_the_same_tokenizer_chat_template_and_token_counts(trained: Path, trained_hybrid: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "token_freq.json"):
        assert (trained_hybrid / name).read_bytes() == (trained / name).read_bytes(), name


def test_ninfer_rt_loads_it_with_tied_embeddings_and_one_mtp_layer(trained: Path) -> None:
    weights = load_model_weights(trained)
    assert weights.config.tie_word_embeddings and weights.config.mtp_layers == 1
    assert weights.mtp is not None and weights.lm_head is weights.embed


def test_transformers_loads_it_as_its_architecture_and_its_logits_match_the_numpy_executor(either: tuple[str, Path]) -> None:
    import transformers

    arch, trained = either
    model = transformers.AutoModelForCausalLM.from_pretrained(str(trained))
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}[arch]
    tokens = tokens_of(trained, 48)
    ours = make_runtime(trained).run_sequence(tokens, [40, 1, 1, 1, 1, 1, 1, 1, 1], PAGES)
    reference, _ = hf_outputs(trained, tokens)
    assert relative_error(ours, reference) < TOLERANCE


def test_the_trainers_model_computes_what_the_runtime_computes_main_and_mtp(either: tuple[str, Path]) -> None:
    arch, trained = either
    tokens = tokens_of(trained, 41)
    model = torch_model(trained, arch)
    with torch.no_grad():
        ids = torch.tensor([tokens[:-1]])
        h = model.hidden(ids)
        main = model.logits(h)[0].numpy()
        mtp = model.logits(model.mtp_hidden(h, torch.tensor([tokens[1:]])))[0].numpy()

    runtime = make_runtime(trained)
    out = runtime.step([SeqStep(tokens[:-1], 0, PAGES)])
    prepared = prepare_mtp(runtime.executor, runtime.weights, runtime.model)
    mtp_batch = step_batch([SeqStep(tokens[1:], 0, PAGES)])  # the MTP step: the main step shifted by one
    ours_mtp = mtp_forward(runtime.executor, runtime.model, prepared, mtp_batch, out.hidden, runtime.kv)
    assert relative_error(runtime.executor.to_host(out.logits), main) < TOLERANCE
    assert relative_error(runtime.executor.to_host(ours_mtp.logits), mtp) < TOLERANCE


def reference_acceptance(model: torch.nn.Module, seq: list[int], prompt_len: int, k: int) -> float:
    """Speculative greedy decoding of one sequence, step by step with exact-length MTP inputs: the main model
    has run through position `last`; drafts chain (MTP hidden, drafted token); verification accepts the
    drafts' prefix that equals the greedy continuation, then emits one more token."""
    with torch.no_grad():
        h = model.hidden(torch.tensor([seq]))[0]
        last, steps, emitted = prompt_len - 1, 0, 0
        while last + k + 2 <= len(seq):
            hidden, inputs, drafts = list(h[: last + 1]), list(seq[1 : last + 2]), []
            for _ in range(k):
                g = model.mtp_hidden(torch.stack(hidden)[None], torch.tensor([inputs]))[0, -1]
                drafts.append(int(model.logits(g).argmax()))
                hidden.append(g)
                inputs.append(drafts[-1])
            accepted = 0
            while accepted < k and drafts[accepted] == seq[last + 2 + accepted]:
                accepted += 1
            steps, emitted, last = steps + 1, emitted + accepted + 1, last + accepted + 1
    return emitted / steps


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batched_acceptance_equals_step_by_step_speculative_decoding(either: tuple[str, Path], k: int) -> None:
    arch, trained = either
    model = torch_model(trained, arch)
    prompts = torch.tensor([tokens_of(trained, 60)[i : i + 12] for i in (0, 20, 40)])
    seqs = trainer.greedy_continue(model, prompts, 20)
    expected = [reference_acceptance(model, row, 12, k) for row in seqs.tolist()]
    # rows are weighted by their step counts in the batched figure, so compare row by row
    for row, value in zip(seqs, expected):
        assert trainer.acceptance_length(model, row[None], 12, k) == pytest.approx(value)


def test_held_out_files_never_appear_in_training_and_tests_are_left_out() -> None:
    from tiny_corpus import python_sources, source_roots, split

    train, heldout = split(python_sources(source_roots()))
    assert heldout and not {f.relative for f in train} & {f.relative for f in heldout}
    assert all("ninfer_rt" not in str(f.path) and not {"test", "tests"} & set(f.path.parts) for f in train + heldout)


def test_eval_ppl_through_the_engine_reproduces_the_trainers_held_out_perplexity(either: tuple[str, Path]) -> None:
    _, trained = either
    # same held-out files, tokenizer and windows (64 + 1 tokens, 4096 scored) as the trainer's --tiny-shape eval
    command = [sys.executable, str(TOOLS / "eval_ppl.py"), "--model", str(trained), "--seq-len", "64", "--max-tokens", "4096"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=600)
    assert result.returncode == 0, result.stderr
    engine = json.loads(result.stdout)
    assert engine["tokens"] == summary(trained)["heldout_tokens"]
    assert engine["ppl"] == pytest.approx(summary(trained)["heldout_ppl"], rel=1e-2)


def test_the_hybrid_checkpoint_is_a_qwen3_5_text_model_of_three_linear_to_one_full_layers(trained_hybrid: Path) -> None:
    raw = json.loads((trained_hybrid / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and raw["architectures"] == ["Qwen3_5ForCausalLM"]
    assert raw["mtp_num_hidden_layers"] == 1 and raw["dtype"] == "bfloat16"
    weights = load_model_weights(trained_hybrid)
    cfg = weights.config
    assert cfg.is_hybrid and cfg.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert cfg.linear_attention.value_heads_per_key_head == 3 and cfg.rotary_dim == cfg.head_dim // 4
    assert cfg.tie_word_embeddings and weights.lm_head is weights.embed
    assert cfg.mtp_layers == 1 and isinstance(weights.mtp.layer.mixer, GatedAttentionWeights)


def test_the_full_hybrid_is_in_the_dense_models_size_class_with_shapes_the_cuda_kernels_run() -> None:
    from ninfer_rt.cuda.attention_prefill_plan import PREFILL_HEAD_DIMS
    from ninfer_rt.cuda.linear_attn_ops import GdnHeads

    hybrid = trainer.ARCHITECTURES["qwen3_5"]()
    with torch.device("meta"):
        dense_count = trainer.parameter_count(trainer.TinyQwen3(trainer.FULL_SHAPE))
        hybrid_count = trainer.parameter_count(hybrid.build(hybrid.full_shape))
    assert abs(hybrid_count / dense_count - 1) <= SAME_SIZE_CLASS
    s = hybrid.full_shape
    assert s.linear_value_heads == 3 * s.linear_key_heads and s.layers % 4 == 0 and s.head_dim in PREFILL_HEAD_DIMS
    GdnHeads(s.linear_key_heads, s.linear_value_heads, s.linear_head_dim, s.linear_head_dim, 1e-6)  # raises if not instantiated


def test_the_fla_probe_measures_gradients_against_the_torch_rule_in_float32_on_the_cpu() -> None:
    import tiny_hybrid_model as hybrid

    model = hybrid.TinyQwen3_5(hybrid.TINY_HYBRID_SHAPE, 256, 1e-6, 0.02)
    layer = model.model.layers[0].linear_attn
    hidden = hybrid.probe_batch(model.config.hidden_size, "cpu")
    reference = hybrid.torch_reference_gradients(layer, hidden)
    assert len(reference) == len(list(layer.parameters()))
    assert hybrid.gradient_error(hybrid.layer_gradients(layer, hidden), reference) < 1e-6
    miscompiled = [g * 1.5 for g in reference]  # off as fla #640's backward is, ~0.5
    assert hybrid.gradient_error(miscompiled, reference) > hybrid.FLA_GRADIENT_TOLERANCE


@pytest.mark.parametrize(("module", "reason"), [
    (None, "does not import (ImportError: no fla here)"),  # transformers' dispatch falls back to the torch rule
    (object(), "has no chunk_gated_delta_rule"),
])
def test_where_fla_core_cannot_be_transformers_delta_rule_the_torch_rule_is_named_without_a_probe(
    module: object, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a probe of transformers' dispatched rule would compare its torch fallback with itself and pass as fla-core
    import importlib

    import tiny_hybrid_model as hybrid

    def fake_import(name: str) -> object:
        if module is None:
            raise ImportError("no fla here")
        return module

    monkeypatch.setattr(importlib, "import_module", fake_import)
    model = hybrid.TinyQwen3_5(hybrid.TINY_HYBRID_SHAPE, 256, 1e-6, 0.02)
    messages: list[str] = []
    with hybrid.fast_delta_rule(model, "cuda", messages.append) as chosen:  # returns before any GPU work
        assert chosen == {"delta_rule": "torch", "reason": reason}
    assert messages == [f"delta rule: transformers' torch rule (fla-core: {reason})"]
