"""Checkpoint writers for tests and tools: tiny models (dense and hybrid, the hybrid written by transformers itself) and random-weight models of a named shape."""
