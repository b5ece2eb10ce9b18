"""Quantizing a checkpoint (`ninfer-rt quantize`): the writer, the calibration pass that runs the model on the
numpy executor, the streamed shards, and the footprint of what it leaves. It sits above exec/; the format it
writes (quantize/) sits below the model."""
