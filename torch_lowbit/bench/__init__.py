"""Benchmarks behind `python -m torch_lowbit bench ...`."""
