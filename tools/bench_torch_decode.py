"""The torch baseline for bench_decode.py: batch-1 greedy decode of a random-weight Hugging Face
Qwen3ForCausalLM of the same named shape, on the same GPU, timed host to host per token (the next
token read back with .item(), as a server must). Two variants: eager with a DynamicCache, and
torch.compile(mode="reduce-overhead") over a StaticCache (CUDA graphs; the recipe in the transformers
docs). Weights bf16, or the decoder layers' projections weight-only quantized the way torch users run them
(embedding and lm_head stay bf16, as bench_decode.py's --weights int8,int4):
  int4: torch's tinygemm kernel (aten._weight_int4pack_mm, behind gpt-fast's and torchao's int4 weight-only
        decode), symmetric groups of 128 inputs (zero points 0), bf16 scales: `ninfer-rt quantize`'s layout,
        with plain absmax / (2^(bits-1) - 1) scales (its scale search changes values, not bytes or time);
  int8: torch's fused weight-only int8 kernel (aten._weight_int8pack_mm), per-row bf16 scales (torch has no
        group-wise int8 kernel);
  int8-linear: gpt-fast's recipe, F.linear(x, int8 weight cast to bf16) * per-row scale, left to torch.compile.
Each quantized module checks itself once against x @ dequantized(W)^T. Roofline as in bench_decode.py:
weight (+ scale) + KV bytes per step / device copy bandwidth measured here. Appends JSON lines to
bench/results/decode_torch.jsonl. GPU machine only (torch is not a runtime dep).

    python tools/bench_torch_decode.py --shape qwen3-8b --contexts 256 --weights bf16,int8,int4
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM, StaticCache

from bench_decode import append_results, print_table, run_info, shape_config
from step_bytes import kv_bytes
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


QUANT_GROUP = 128
LAYER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def symmetric_codes(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int32 [n, k] in [-2^(bits-1), 2^(bits-1) - 1], f32 scales [n, k / group]): absmax per group."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group, group)
    top = 2 ** (bits - 1) - 1
    scales = (groups.abs().amax(-1) / top).clamp(min=1e-8)
    codes = (groups / scales[..., None]).round().clamp(-top - 1, top).to(torch.int32)
    return codes.view(n, k), scales


class QuantizedLinear(torch.nn.Module):
    """A bias-free projection with weight-only quantized weights; `check` compares it once with x @ dequantized^T."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)

    def check(self, dequantized: torch.Tensor) -> None:
        x = torch.randn(1, dequantized.shape[1], device=dequantized.device, dtype=torch.bfloat16)
        want = x.float() @ dequantized.float().T
        got = self.matmul(x).float()
        error = ((got - want).norm() / want.norm()).item()
        if error > 2e-2:
            raise RuntimeError(f"{type(self).__name__}: relative error {error:.3g} against x @ dequantized(W)^T")

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class Int4TinyGemm(QuantizedLinear):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight.shape[0])
        codes, scales = symmetric_codes(weight, 4, QUANT_GROUP)
        offset = codes + 8  # tinygemm dequantizes (u - 8) * scale + zero
        packed = (offset[:, ::2] << 4 | offset[:, 1::2]).to(torch.uint8)
        self.register_buffer("packed", torch._convert_weight_to_int4pack(packed, 8))
        scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], -1).transpose(0, 1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(torch.bfloat16))
        bf16_scales = scales.to(torch.bfloat16).float()
        self.check((codes.view(*scales.shape, QUANT_GROUP) * bf16_scales[..., None]).view(codes.shape))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm(x, self.packed, QUANT_GROUP, self.scales_and_zeros)


class Int8PerRow(QuantizedLinear):
    """gpt-fast's int8 weight-only linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight.shape[0])
        codes, scales = symmetric_codes(weight, 8, weight.shape[1])
        self.register_buffer("codes", codes.to(torch.int8))
        self.register_buffer("scales", scales[:, 0].to(torch.bfloat16))
        self.check(codes.float() * self.scales.float()[:, None])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.codes.to(x.dtype)) * self.scales


class Int8PackMM(Int8PerRow):
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scales)


QUANTIZED = {"int4": Int4TinyGemm, "int8": Int8PackMM, "int8-linear": Int8PerRow}


def quantize_layers(model: Qwen3ForCausalLM, weights: str) -> None:
    """Replaces every decoder layer's projections by QUANTIZED[weights] (in place; frees the bf16 copies)."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LAYER_PROJECTIONS:
                if hasattr(parent, name):
                    setattr(parent, name, QUANTIZED[weights](getattr(parent, name).weight.detach()))


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
    """Every matrix (codes and scales of a quantized one) once per step plus one embedding row (bench_decode's
    count)."""
    embed = model.model.embed_tokens.weight
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    quantized = sum(m.weight_bytes() for m in model.modules() if isinstance(m, QuantizedLinear))
    return params + quantized - embed.numel() * embed.element_size() + embed.shape[1] * 2


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
    parser.add_argument("--weights", default="bf16", help="comma list of bf16, int4, int8, int8-linear")
    args = parser.parse_args()
    for weights in args.weights.split(","):
        if weights != "bf16" and weights not in QUANTIZED:
            parser.error(f"--weights: {weights!r} is not one of bf16, {', '.join(QUANTIZED)}")

    info = run_info(open_device(0))
    bandwidth = torch_copy_bandwidth()
    timers = {"eager": time_eager, "compile": time_compiled}
    rows = []
    for weights in args.weights.split(","):
        model = build_model(args.shape, args.layers)
        if weights != "bf16":
            quantize_layers(model, weights)
        for context in (int(c) for c in args.contexts.split(",")):
            step_bytes = weight_bytes(model) + kv_bytes(shape_config(args.shape, args.layers), context, "bf16")
            for variant in args.variants.split(","):
                seconds = timers[variant](model, context, args.steps)
                rows.append(info | {
                    "impl": f"torch-{variant}", "torch": torch.__version__, "shape": args.shape, "weights": weights,
                    "context": context, "kv_dtype": "bf16", "tok_s": 1 / seconds, "ms_per_step": seconds * 1e3,
                    "bytes_per_step": step_bytes, "copy_bw_TBs": bandwidth / 1e12,
                    "roofline_fraction": step_bytes / seconds / bandwidth,
                })
        del model
        torch.cuda.empty_cache()
    print_table(rows, ["impl", "weights", "context", "tok_s", "ms_per_step", "copy_bw_TBs", "roofline_fraction"])
    print(f"appended to {append_results('decode_torch', rows)}")


if __name__ == "__main__":
    main()
