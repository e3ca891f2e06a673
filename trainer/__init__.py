"""draftsmith: train drafters that let a large language model emit several tokens per forward pass."""

# The one source of the version: pyproject.toml reads it (setuptools' dynamic ``attr``), ``draftsmith --version``
# prints it, exports record it, and CHANGELOG.md's top entry names it (docs/developer/releasing.md).
__version__ = "0.24.0"
