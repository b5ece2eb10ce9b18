"""Checkpoint writers for tests and tools: tiny random models in the layouts real checkpoints use."""
