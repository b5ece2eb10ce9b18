"""Checkpoint writers for tests and tools: tiny trained-shape models and random-weight models of a named shape."""
