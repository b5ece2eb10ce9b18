"""Paged KV cache: page pool, storage, prefix cache."""
