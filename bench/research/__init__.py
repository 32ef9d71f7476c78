"""Reproductions of a documented investigation on today's code (not benchmarks: they write no bench/results file)."""
