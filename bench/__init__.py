"""Benchmarks: `python -m bench <name> ...` (micro, ttft, io)."""
