"""Reproducible benchmarks behind `make bench`; each reports a ratio to a floor measured in the same run."""
