"""Shared fixtures: tiny random-weight checkpoints in Hugging Face layout, made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_rt.model.tiny import make_tiny_model
from ninfer_rt.testing.tiny_hybrid import make_tiny_qwen3_5


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", tie=True)


@pytest.fixture(scope="session")
def tiny_qwen3_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_mtp"), arch="qwen3", mtp=True)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3_5ForCausalLM layout (text weights under model.*), with an MTP layer."""
    pytest.importorskip("transformers")
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("tiny_qwen3_5"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3_5ForConditionalGeneration layout, sharded, with the same text and MTP weights as tiny_qwen3_5."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("tiny_qwen3_5_vl")
    return make_tiny_qwen3_5(out, layout="conditional_generation", shards=3)
