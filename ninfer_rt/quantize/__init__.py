"""Groupwise integer weights: the format and its layouts, the quantizer, GPTQ/AWQ import, and checkpoint writing."""
