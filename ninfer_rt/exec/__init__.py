"""Executors: numpy reference and CUDA."""
