"""`python -m infer.bench`: the old name of `python -m bench`, the benchmarks (`bench/` at the
repository's root, not in the wheel). Kept as an alias for commands written before the move."""
