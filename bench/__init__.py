"""The benchmark suite: scripts that measure the product, each run as a module from the repository root.

    python -m bench.bench_kd_throughput --help

``bench.<name>`` measures what draftsmith costs or delivers against a fixed reference (the naive loss, DDP, the model
alone, speculators' trainer): throughput, memory, decoding, checkpoints. ``bench.studies.<name>`` answers one research
question by training variants (the tiny target's loops, one-off ablations); its answer is recorded once. What the
scripts share is :mod:`bench.common`. docs/benchmarks/index.md lists every script with what it measures. Nothing here
is installed with the package, and nothing in tests/ imports it.
"""
