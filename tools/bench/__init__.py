"""Side-by-side benchmarks; `make bench` runs every `bench_*.py` module's `main()`."""
