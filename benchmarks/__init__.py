"""Reproducible benchmarks behind `make bench`.

Each result is reported next to a floor measured in the same run.
"""
