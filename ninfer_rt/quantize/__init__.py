"""Groupwise integer weights: the format and its layouts, the schemes checkpoints declare, the quantizer, and
GPTQ/AWQ/fp8 import. Below the model, which loads them; writing a quantized checkpoint is quantize_checkpoint/."""
