"""A qwen3_6_27b artifact bound to the hybrid model: a tiny one, written by the project's writer from a tiny
checkpoint, reads back its quantized values, holds the inventory, and computes the logits of the same
quantized weights loaded from safetensors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ninfer_rt.artifact import Artifact, ArtifactError
from ninfer_rt.artifact import qwen3_6_27b as inv
from ninfer_rt.artifact.layouts import GROUPED_FORMATS, PLANE_ALIGNMENT, RowSplitGeometry
from ninfer_rt.artifact.quantized import BOUND_BITS, binds_quantized
from ninfer_rt.artifact.writer import dequantized
from ninfer_rt.model.artifact_binding import load_artifact_model
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.quantize.format import QuantizedWeight
from ninfer_rt.testing.tiny_artifact import write_dequantized_checkpoint, write_tiny_artifact

pytest.importorskip("transformers")
DRAFT_ROWS = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    from ninfer_rt.testing.tiny_hybrid import make_tiny_qwen3_5

    root = tmp_path_factory.mktemp("tiny_artifact")
    source = make_tiny_qwen3_5(root / "source", hidden=128, intermediate=256, layers=4)
    tokens = Tokenizer(source).vocab_size
    tensors = write_tiny_artifact(source, root / "tiny.ninfer", DRAFT_ROWS, tokens)
    return root / "tiny.ninfer", write_dequantized_checkpoint(source, root / "dequantized"), tensors


def test_the_artifact_holds_the_inventory_in_writer_order(tiny) -> None:
    path, _, _ = tiny
    with Artifact(path) as artifact:
        names = list(artifact.objects)
    resources = [inv.FRONTEND_PREFIX + name for name in inv.FRONTEND_RESOURCES]
    assert names == resources + list(inv.inventory(4))
    assert len(inv.inventory(64)) == 1118  # the 27B artifact's tensor count


def test_every_tensor_reads_back_its_quantized_values(tiny) -> None:
    path, _, tensors = tiny
    with Artifact(path) as artifact:
        for entry in tensors:
            assert artifact.objects[entry.name].format == entry.format
            np.testing.assert_array_equal(artifact.tensor_values(entry.name), dequantized(entry.format, entry.values))


def _logits(weights) -> np.ndarray:  # noqa: ANN001 -- ModelWeights
    from forward_helpers import runtime_for

    tokens = np.random.default_rng(0).integers(0, 300, 40).tolist()
    return runtime_for(weights).run_sequence(tokens, [23, 1, 16], list(range(8)))


def test_logits_equal_those_of_the_same_weights_from_safetensors(tiny, tmp_path: Path) -> None:
    from ninfer_rt.model.weights import load_model_weights

    path, checkpoint, _ = tiny
    bound = load_artifact_model(path, cache_root=tmp_path, quantized=False)
    reference = load_model_weights(checkpoint)
    assert bound.weights.config == reference.config.__class__(**{**reference.config.__dict__, **_artifact_facts(bound)})
    np.testing.assert_array_equal(_logits(bound.weights), _logits(reference))


def test_the_quantized_binding_computes_the_logits_of_the_decoded_one(tiny, tmp_path: Path) -> None:
    # The same weight values (a bound weight dequantizes to the decoded values exactly), but not the same
    # GEMMs: a quantized GDN layer's [q | k | v | z] and its bf16 [b | a] run as two matmuls, where the
    # decoded binding runs one, so BLAS sums in another order: float32 rounding apart, no more.
    path, _, _ = tiny
    quantized = load_artifact_model(path, cache_root=tmp_path).weights
    decoded = load_artifact_model(path, cache_root=tmp_path, quantized=False).weights
    assert isinstance(quantized.lm_head, QuantizedWeight) and isinstance(quantized.layers[0].down_proj, QuantizedWeight)
    got, want = _logits(quantized), _logits(decoded)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _artifact_facts(bound) -> dict:
    """The fields the artifact fixes that the tiny checkpoint's config.json states otherwise (its stop ids are
    generation_config.json's, the artifact's only statement of them)."""
    cfg = bound.weights.config
    return {"max_position_embeddings": cfg.max_position_embeddings, "rope_scaling": cfg.rope_scaling,
            "model_type": cfg.model_type, "torch_dtype": cfg.torch_dtype, "architecture": cfg.architecture,
            "eos_token_ids": cfg.eos_token_ids}


def test_the_tokenizer_and_template_come_from_the_resources(tiny, tmp_path: Path) -> None:
    path, checkpoint, _ = tiny
    bound = load_artifact_model(path, cache_root=tmp_path)
    ours, theirs = Tokenizer(bound.frontend_dir), Tokenizer(checkpoint)
    assert ours.encode("hello world") == theirs.encode("hello world")
    assert ours.chat_template == theirs.chat_template and ours.eos_token_ids == theirs.eos_token_ids


def test_the_draft_head_scores_its_token_id_table_with_its_own_rows(tiny, tmp_path: Path) -> None:
    from ninfer_rt.engine.spec_vocab import DraftVocab
    from ninfer_rt.model.artifact_binding import draft_frequencies

    path, _, _ = tiny
    bound = load_artifact_model(path, cache_root=tmp_path)
    with Artifact(path) as artifact:
        ids = artifact.tensor_values(inv.DRAFT_HEAD_TOKEN_IDS).tolist()
        rows = artifact.tensor_values(inv.DRAFT_HEAD)
    head = bound.weights.draft_head
    assert head is not None
    vocab = DraftVocab(DRAFT_ROWS, bound.weights.config.vocab_size, draft_frequencies(bound))
    assert vocab.ids.tolist() == sorted(ids)
    stored = head.rows_for(vocab.ids)
    assert stored is not None
    np.testing.assert_array_equal(stored.astype(np.float32), rows[[ids.index(t) for t in vocab.ids]])
    outside = next(t for t in range(bound.weights.config.vocab_size) if t not in ids)
    assert head.rows_for(np.array([ids[0], outside])) is None


SMALL_ENGINE = ["--kv-capacity", "16", "--max-context", "1024"]


def _cli(*args: str):  # noqa: ANN202 -- click's Result
    from click.testing import CliRunner

    from ninfer_rt.cli import main

    return CliRunner().invoke(main, list(args))


def test_generate_from_the_artifact_writes_the_checkpoints_greedy_text(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path, checkpoint, _ = tiny
    greedy = ["--prompt", "hello world", "--max-tokens", "8", "--temperature", "0", *SMALL_ENGINE]
    ours, theirs = _cli("generate", "--model", str(path), *greedy), _cli("generate", "--model", str(checkpoint), *greedy)
    assert ours.exit_code == 0, ours.output
    assert ours.stdout == theirs.stdout and ours.stdout != ""


def test_mtp_speculation_over_the_draft_head_keeps_the_greedy_text(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    greedy = ["--model", str(tiny[0]), "--prompt", "hello world", "--max-tokens", "8", "--temperature", "0", *SMALL_ENGINE]
    plain, drafted = _cli("generate", *greedy), _cli("generate", *greedy, "--spec", "mtp", "--lm-head-draft", str(DRAFT_ROWS))
    assert drafted.exit_code == 0, drafted.output
    assert drafted.stdout == plain.stdout


def _rewritten(source: Path, out: Path, edit) -> Path:  # noqa: ANN001 -- bytes -> bytes
    out.write_bytes(edit(source.read_bytes()))
    return out


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda data: data[: len(data) // 2], "past the"),
        (lambda data: data.replace(b'"model_id":"qwen3_6_27b"', b'"model_id":"qwen3_6_28b"'), "model_id 'qwen3_6_28b'"),
        (lambda data: data.replace(b'"text/final_norm"', b'"text/final_nurm"'), "missing ['text/final_norm']"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_artifact_is_one_line_naming_it_and_exit_2(tiny, tmp_path: Path, monkeypatch, edit, named: str, command: str) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bad = _rewritten(tiny[0], tmp_path / "bad.ninfer", edit)
    extra = ["--prompt", "x"] if command == "generate" else []
    result = _cli(command, "--model", str(bad), *extra)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and named in lines[0], result.output


def test_serve_answers_chat_from_the_artifact_under_its_file_stem(tiny, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    import httpx
    from server_helpers import free_port, wait_healthy

    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": os.getcwd()}
    process = subprocess.Popen(
        [sys.executable, "-m", "ninfer_rt.serve", "--model", str(tiny[0]), "--device", "cpu", "--port", str(port),
         "--kv-capacity", "64", "--max-context", "1024"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["tiny"]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)


def _weight_bytes(node) -> int:  # noqa: ANN001 -- any part of ModelWeights
    if isinstance(node, (QuantizedWeight, np.ndarray)):
        return node.nbytes
    if isinstance(node, list):
        return sum(_weight_bytes(item) for item in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, ModelConfig):
        return sum(_weight_bytes(getattr(node, f.name)) for f in dataclasses.fields(node))
    return 0


def test_the_quantized_binding_holds_the_payloads_not_bf16_inflations(tiny, tmp_path: Path) -> None:
    """Resident weight bytes: each grouped tensor's code and scale planes as stored (alignment padding
    aside), plus the stated overheads: Q5/Q6 codes widened to a byte ((8 - b) / 8 byte per weight), the
    GDN query_key's Q4 codes widened where it joins the Q5 value rows in the fused qkv (1/2 byte per
    weight), the embedding and the draft head decoded to bf16 (read by row), as is a tensor whose K is not
    whole groups (here the GDN output, K = 96; the 27B's are all whole), the draft ids as int64."""
    path, _, _ = tiny
    weights = load_artifact_model(path, cache_root=tmp_path).weights
    expected = 0
    with Artifact(path) as artifact:
        for name, fmt in inv.inventory(4).items():
            if name.startswith("vision/"):
                continue  # not bound
            obj = artifact.object(name)
            if name in (inv.EMBEDDING, inv.DRAFT_HEAD) or fmt in GROUPED_FORMATS and not binds_quantized(obj):
                expected += 2 * int(np.prod(obj.shape))
            elif fmt in GROUPED_FORMATS:
                geometry = RowSplitGeometry(GROUPED_FORMATS[fmt], *obj.shape)
                grouped = geometry.fmt
                planes = geometry.groups * (grouped.base_bytes_per_group + grouped.high_bytes_per_group + 2)
                widened_bits = 8 if name.endswith("gdn/query_key") else BOUND_BITS[fmt]
                expected += planes + geometry.rows * geometry.cols * (widened_bits - grouped.code_bits) // 8
                assert planes <= obj.bytes < planes + 3 * PLANE_ALIGNMENT
            else:
                expected += obj.bytes * (2 if fmt == "I32" else 1)
    assert _weight_bytes(weights) == expected
    decoded = _weight_bytes(load_artifact_model(path, cache_root=tmp_path, quantized=False).weights)
    assert expected < decoded
