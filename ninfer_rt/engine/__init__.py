"""Engine: requests, sampling, scheduling, the model runner and the engine loop (docs/ARCHITECTURE.md,
"The package")."""
