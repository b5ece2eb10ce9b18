"""OpenAI-compatible HTTP server: `python -m ninfer_rt.serve` or `ninfer-rt serve`."""
