"""Benchmarks and helper scripts (not part of the installed package)."""
