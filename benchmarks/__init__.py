"""The project's benchmarks: one script per question, and the suite that runs them all.

``python -m benchmarks`` runs the suite (:mod:`benchmarks.suite`); each script still runs on
its own (``python benchmarks/bench_fence.py --help``). Not part of the installed package.
"""
