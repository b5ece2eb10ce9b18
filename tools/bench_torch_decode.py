"""The torch baseline for bench_decode.py: batch-1 greedy decode of a random-weight Hugging Face
Qwen3ForCausalLM of the same named shape, bf16, on the same GPU, timed host to host per token (the next
token read back with .item(), as a server must). Two variants: eager with a DynamicCache, and
torch.compile(mode="reduce-overhead") over a StaticCache (CUDA graphs; the recipe in the transformers
docs). Roofline as in bench_decode.py: weight + KV bytes per step / device copy bandwidth measured here.
Appends JSON lines to bench/results/decode_torch.jsonl. GPU machine only (torch is not a runtime dep).

    python tools/bench_torch_decode.py --shape qwen3-8b --contexts 256
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM, StaticCache

from bench_decode import append_results, kv_bytes_read, print_table, run_info, shape_config
from ninfer_rt.cuda.driver import open_device
from ninfer_rt.model.shapes import SHAPES


def torch_copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3)


def build_model(shape: str, layers: int | None) -> Qwen3ForCausalLM:
    raw = shape_config(shape, layers)
    config = Qwen3Config(
        hidden_size=raw.hidden_size, num_hidden_layers=raw.num_hidden_layers, num_attention_heads=raw.num_attention_heads,
        num_key_value_heads=raw.num_key_value_heads, head_dim=raw.head_dim, intermediate_size=raw.intermediate_size,
        vocab_size=raw.vocab_size, max_position_embeddings=131072, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config)
    return model.eval()


def weight_bytes(model: Qwen3ForCausalLM) -> int:
    """Every matrix once per step plus one embedding row (bench_decode's count)."""
    embed = model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size() + embed.shape[1] * 2


@torch.inference_mode()
def time_eager(model: Qwen3ForCausalLM, context: int, steps: int) -> float:
    cache = DynamicCache(config=model.config)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    token = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for i in range(3 + steps):
        if i == 3:
            started = time.perf_counter()
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        token.item()
    return (time.perf_counter() - started) / steps


@torch.inference_mode()
def time_compiled(model: Qwen3ForCausalLM, context: int, steps: int) -> float:
    cache = StaticCache(config=model.config, max_cache_len=context + steps + 16)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    positions = torch.arange(context, device="cuda")
    logits = model(input_ids=prompt, past_key_values=cache, cache_position=positions, use_cache=True).logits
    token = logits[:, -1:].argmax(-1)
    decode = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for i in range(5 + steps):  # the first calls compile and record the CUDA graph
        if i == 5:
            started = time.perf_counter()
        position = torch.tensor([context + i], device="cuda")
        logits = decode(input_ids=token, past_key_values=cache, cache_position=position, position_ids=position[None], use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        token.item()
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--contexts", default="256")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--variants", default="eager,compile")
    args = parser.parse_args()

    info = run_info(open_device(0))
    bandwidth = torch_copy_bandwidth()
    model = build_model(args.shape, args.layers)
    timers = {"eager": time_eager, "compile": time_compiled}
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        step_bytes = weight_bytes(model) + kv_bytes_read(shape_config(args.shape, args.layers), context, "bf16")
        for variant in args.variants.split(","):
            seconds = timers[variant](model, context, args.steps)
            rows.append(info | {
                "impl": f"torch-{variant}", "torch": torch.__version__, "shape": args.shape, "context": context,
                "kv_dtype": "bf16", "tok_s": 1 / seconds, "ms_per_step": seconds * 1e3, "bytes_per_step": step_bytes,
                "copy_bw_TBs": bandwidth / 1e12, "roofline_fraction": step_bytes / seconds / bandwidth,
            })
    print_table(rows, ["impl", "context", "tok_s", "ms_per_step", "copy_bw_TBs", "roofline_fraction"])
    print(f"appended to {append_results('decode_torch', rows)}")


if __name__ == "__main__":
    main()
