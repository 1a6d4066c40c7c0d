"""One module per section of the suite; each wraps a benchmark script's measuring functions.

A section exposes ``run(ctx) -> dict`` and raises :class:`benchmarks.suite.Skip` with the
reason when a prerequisite is missing.
"""
