"""draftsmith: train drafters that let a large language model emit several tokens per forward pass."""

__version__ = "0.1.0"
