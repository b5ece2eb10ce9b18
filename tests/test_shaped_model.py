"""Random-weight checkpoints of a named shape (tools/make_shaped_model.py, ninfer_rt.testing.shaped), here of a
small custom shape with the real Qwen3 vocabulary size: the config is the shape's with a 128k context, the
project's loader and tokenizer load it, the tokenizer covers the whole vocabulary, and what the model
generates comes back in the next turn's prompt as the same ids, so an agent replay's replies hit the
prefix cache as a real model's would."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ninfer_rt.cli import main
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.model.weights import SHARD_INDEX, load_checkpoint, load_model_weights
from ninfer_rt.replay.profiles import make_profile
from ninfer_rt.replay.trace import synth_words, write_trace
from ninfer_rt.serve.chat import ChatTemplate
from ninfer_rt.testing.shaped import BPE_VOCAB, SHAPED_MAX_POSITIONS, make_shaped_model, write_random_weights
from tests.replay_helpers import verified_server

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             intermediate_size=128, vocab_size=151936)


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shaped_model(tmp_path_factory.mktemp("shaped"), SMALL, seed=3)


def test_the_config_is_the_shape_with_a_long_context(shaped: Path) -> None:
    cfg = ModelConfig.from_dir(shaped)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == tuple(SMALL.values())
    assert cfg.architecture == "Qwen3ForCausalLM" and not cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == SHAPED_MAX_POSITIONS >= 131072
    assert json.loads((shaped / "tokenizer_config.json").read_text())["model_max_length"] == SHAPED_MAX_POSITIONS


def test_the_loader_maps_every_tensor_from_the_sharded_files(shaped: Path) -> None:
    weights = load_model_weights(shaped)
    assert (shaped / SHARD_INDEX).exists()
    assert weights.lm_head.shape == (SMALL["vocab_size"], SMALL["hidden_size"])
    assert len(weights.layers) == SMALL["num_hidden_layers"]


def test_matrices_are_small_random_values_with_distinct_rows_and_norm_gains_are_one(shaped: Path) -> None:
    weights = load_model_weights(shaped)
    embed = np.asarray(weights.embed, np.float32)
    assert abs(embed.std() - 0.02) < 0.001 and abs(embed.mean()) < 0.001
    assert len(np.unique(embed, axis=0)) == len(embed)
    layer = weights.layers[0]
    assert not np.array_equal(np.asarray(layer.q_proj), np.asarray(weights.layers[1].q_proj))
    for gain in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, weights.norm):
        assert np.all(np.asarray(gain, np.float32) == 1.0)


def test_the_bpe_part_of_lm_head_is_zero_so_the_model_never_emits_it(shaped: Path) -> None:
    lm_head = np.asarray(load_model_weights(shaped).lm_head, np.float32)
    assert not lm_head[:BPE_VOCAB].any()
    assert np.all(np.abs(lm_head[BPE_VOCAB:]).max(axis=1) > 0)


def test_sharding_does_not_change_the_weights(shaped: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(shaped)
    write_random_weights(tmp_path, cfg, seed=3, zero_logit_rows=BPE_VOCAB, shard_bytes=4 << 20)
    files = set(json.loads((tmp_path / SHARD_INDEX).read_text())["weight_map"].values())
    assert files == {path.name for path in tmp_path.glob("model-*.safetensors")} and len(files) > 2
    one, many = load_checkpoint(shaped), load_checkpoint(tmp_path, cfg)
    assert set(one) == set(many)
    assert all(np.array_equal(np.asarray(one[name]), np.asarray(many[name])) for name in one)


def test_the_tokenizer_covers_the_vocabulary_and_keeps_the_chat_template(shaped: Path) -> None:
    tokenizer = Tokenizer(shaped)
    assert tokenizer.vocab_size == SMALL["vocab_size"]
    assert all(tokenizer.id_to_token(i) is not None for i in range(SMALL["vocab_size"]))
    assert tokenizer.chat_template is not None and tokenizer.eos_token_ids


def test_generated_ids_come_back_from_their_text_inside_a_prompt(shaped: Path) -> None:
    # The replay's contract: turn N+1's prompt is the text of turn N's prompt + the reply + new content;
    # it must encode to turn N's ids + the reply's ids + the rest for the prefix cache to hit.
    tokenizer = Tokenizer(shaped)
    template = ChatTemplate(tokenizer.chat_template or "")
    rng = random.Random(0)
    for seed in range(20):
        reply_ids = [rng.randrange(BPE_VOCAB, SMALL["vocab_size"]) for _ in range(rng.randrange(1, 300))]
        reply = tokenizer.decode(reply_ids)
        prompt = template.render([{"role": "user", "content": synth_words(50, seed)}]).text
        after = "<|im_end|>\n<|im_start|>user\n" + synth_words(20, seed + 100)
        assert tokenizer.encode(reply) == reply_ids
        assert tokenizer.encode(prompt + reply + after) == (
            tokenizer.encode(prompt) + reply_ids + tokenizer.encode(after))


def test_with_its_own_sampling_the_model_emits_only_round_tripping_tokens(shaped: Path) -> None:
    # the checkpoint's generation_config (temperature 0.6, top-k 20, top-p 0.95) and greedy
    engine = Engine.load(shaped, EngineConfig(device="cpu", kv_capacity="64", max_context=4096))
    prompts = [synth_words(40, seed) for seed in range(4)]
    for params in (SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=1, max_tokens=48, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)):
        ids = [t for output in engine.generate(prompts, params) for t in output.token_ids]
        assert len(ids) == 4 * 48 and min(ids) >= BPE_VOCAB


def test_an_agent_replay_gets_every_reply_back_from_the_prefix_cache(shaped: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    trace, records = tmp_path / "agent.jsonl", tmp_path / "records.jsonl"
    write_trace(make_profile("agent", 0.02), trace)
    with verified_server(shaped, kv_pages=128, checkpoint_sampling=True) as server:
        result = CliRunner().invoke(main, ["replay", str(trace), "--url", server.url, "--no-progress",
                                           "--out", str(records)])
    assert result.exit_code == 0, result.output
    agent = [r for r in map(json.loads, records.read_text().splitlines()) if r["lane"] == "agent"]
    assert len(agent) >= 10
    for previous, turn in zip(agent, agent[1:]):
        # everything the last turn held, its prompt and its reply, except the reply's last token, whose KV
        # was never computed (it was sampled, not fed back); with the tiny model's BPE no turn gets this far
        assert turn["cached_tokens"] == previous["prompt_tokens"] + previous["completion_tokens"] - 1
