"""Benchmarks: ``python -m benchmarks [--only prefill|decode] [--no-results]`` on a GPU."""
