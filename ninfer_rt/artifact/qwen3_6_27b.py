"""The qwen3_6_27b object inventory of NInfer's `qwen3.6-27b-artifact.md`: names, formats and fused row order.

Only names and formats live here; shapes follow from the model's widths, so the same inventory describes
the 27B artifact and a tiny one. Fused parents are, in physical row order: attention `query_key` [query, key]
and `gate_value` [output gate, value]; GDN `query_key` [query, key] and `value_z` [value, z]; MLP `gate_up`
[gate, up]; the MTP layer's `query_key_gate_value` [query, key, output gate, value]. A GDN convolution is
stored tap-major [taps, channels].
"""

from __future__ import annotations

MODEL_IDS = ("qwen3_6_27b", "qwen3.6-27b")  # the target key NInfer's tools write, and the registered identity
FRONTEND_RESOURCES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)
FRONTEND_PREFIX = "frontend/"
FULL_ATTENTION_INTERVAL = 4  # layers 3, 7, ..., 63 are full attention
ROPE_THETA = 10_000_000.0
PARTIAL_ROTARY_FACTOR = 0.25
MROPE_SECTION = (11, 11, 10)
RMS_NORM_EPS = 1e-6
NATIVE_CONTEXT = 262_144

EMBEDDING = "text/token_embedding"
FINAL_NORM = "text/final_norm"
OUTPUT_HEAD = "text/output_head"
DRAFT_HEAD = "text/draft_head"
DRAFT_HEAD_TOKEN_IDS = "text/draft_head_token_ids"

GLOBAL_FORMATS = {
    EMBEDDING: "Q6G64_F16S",
    FINAL_NORM: "BF16",
    OUTPUT_HEAD: "Q6G64_F16S",
    DRAFT_HEAD: "Q4G64_F16S",
    DRAFT_HEAD_TOKEN_IDS: "I32",
}
FULL_ATTENTION_FORMATS = {
    "input_norm": "BF16",
    "attention/query_key": "Q4G64_F16S",
    "attention/gate_value": "Q5G64_F16S",
    "attention/query_norm": "BF16",
    "attention/key_norm": "BF16",
    "attention/output": "Q5G64_F16S",
    "post_attention_norm": "BF16",
    "mlp/gate_up": "Q4G64_F16S",
    "mlp/down": "Q5G64_F16S",
}
GDN_FORMATS = {
    "input_norm": "BF16",
    "gdn/a_log": "FP32",
    "gdn/dt_bias": "FP32",
    "gdn/convolution": "BF16",
    "gdn/a_projection": "BF16",
    "gdn/b_projection": "BF16",
    "gdn/query_key": "Q4G64_F16S",
    "gdn/value_z": "Q5G64_F16S",
    "gdn/norm": "BF16",
    "gdn/output": "Q5G64_F16S",
    "post_attention_norm": "BF16",
    "mlp/gate_up": "Q4G64_F16S",
    "mlp/down": "Q5G64_F16S",
}
MTP_FORMATS = {
    "mtp/input_projection": "W8G32_F16S",
    "mtp/embedding_norm": "BF16",
    "mtp/hidden_norm": "BF16",
    "mtp/layer/input_norm": "BF16",
    "mtp/layer/attention/query_key_gate_value": "W8G32_F16S",
    "mtp/layer/attention/query_norm": "BF16",
    "mtp/layer/attention/key_norm": "BF16",
    "mtp/layer/attention/output": "W8G32_F16S",
    "mtp/layer/post_attention_norm": "BF16",
    "mtp/layer/mlp/gate_up": "W8G32_F16S",
    "mtp/layer/mlp/down": "W8G32_F16S",
    "mtp/final_norm": "BF16",
}
VISION_STEM_FORMATS = {
    "vision/patch_embedding": "Q6G64_F16S",
    "vision/patch_embedding_bias": "BF16",
    "vision/position_embedding": "BF16",
}
VISION_BLOCK_FORMATS = {
    "attention/qkv": "Q4G64_F16S",
    "attention/qkv_bias": "BF16",
    "attention/output": "Q5G64_F16S",
    "attention/output_bias": "BF16",
    "mlp/fc1": "Q4G64_F16S",
    "mlp/fc1_bias": "BF16",
    "mlp/fc2": "Q5G64_F16S",
    "mlp/fc2_bias": "BF16",
    "norm1/weight": "BF16",
    "norm1/bias": "BF16",
    "norm2/weight": "BF16",
    "norm2/bias": "BF16",
}
VISION_MERGER_FORMATS = {
    "vision/merger/fc1": "W8G32_F16S",
    "vision/merger/fc1_bias": "BF16",
    "vision/merger/fc2": "W8G32_F16S",
    "vision/merger/fc2_bias": "BF16",
    "vision/merger/norm/weight": "BF16",
    "vision/merger/norm/bias": "BF16",
}
VISION_BLOCKS = 27


def is_full_attention(layer: int) -> bool:
    return layer % FULL_ATTENTION_INTERVAL == FULL_ATTENTION_INTERVAL - 1


def layer_prefix(layer: int) -> str:
    return f"text/layers/{layer}/"


def layer_formats(layer: int) -> dict[str, str]:
    """The layer's object names (full, with the prefix) and formats, in writer order."""
    formats = FULL_ATTENTION_FORMATS if is_full_attention(layer) else GDN_FORMATS
    return {layer_prefix(layer) + suffix: fmt for suffix, fmt in formats.items()}


def vision_block_formats(block: int) -> dict[str, str]:
    return {f"vision/layers/{block}/{suffix}": fmt for suffix, fmt in VISION_BLOCK_FORMATS.items()}


def text_layer_count(names: set[str]) -> int:
    """How many Text layers the object names hold: one past the highest `text/layers/{l}/` index."""
    layers = {int(name.split("/")[2]) for name in names if name.startswith("text/layers/")}
    return max(layers) + 1 if layers else 0


def inventory(layers: int, vision_blocks: int = VISION_BLOCKS) -> dict[str, str]:
    """Every tensor object of an artifact with `layers` Text layers, name -> format, in writer order."""
    formats = {EMBEDDING: GLOBAL_FORMATS[EMBEDDING]}
    for layer in range(layers):
        formats.update(layer_formats(layer))
    for name in (FINAL_NORM, OUTPUT_HEAD, DRAFT_HEAD, DRAFT_HEAD_TOKEN_IDS):
        formats[name] = GLOBAL_FORMATS[name]
    formats.update(MTP_FORMATS)
    formats.update(VISION_STEM_FORMATS)
    for block in range(vision_blocks):
        formats.update(vision_block_formats(block))
    formats.update(VISION_MERGER_FORMATS)
    return formats
