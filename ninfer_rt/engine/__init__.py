"""Engine: requests, sampling, scheduling, the model runner and the engine loop (DESIGN.md, engine/)."""
