"""Research studies: each trains variants on the demo's tiny target to answer one question (why the target loops,
what a method's pre-training or self-distillation buys, how one drafter compares with another), run as
``python -m bench.studies.<name>`` from the repository root. The benchmarks that measure the product are in
:mod:`bench`; docs/benchmarks/index.md says which script is which.
"""
