"""One package per method: ``trainer/methods/<method>/`` holds a drafter kind's registration (``kind.py``), its module,
its objective(s), its proposer and its exporters, each in its own file.

Methods import the shared layer below them (the objective base, the engine, the registry, the export file helpers,
the losses and layers) and never each other, except a method that extends one parent method (P-EAGLE extends EAGLE-3),
a family declared in the import contracts (pyproject.toml); the shared layer never imports a method (``make lint``
checks both with import-linter). The registry finds the methods at run time by importing
``trainer.methods.<method>.kind``.
"""
