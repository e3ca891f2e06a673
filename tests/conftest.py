"""Shared fixtures: a tiny tokenizer, corpus and target that the suite builds once per session."""

from __future__ import annotations

import pytest

# ---------------------------------------------------------------------------------------------------------- corpus


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small standard-library corpus with a 512-token byte-level BPE tokenizer (a few seconds, once per session)."""
    from trainer.data.corpus import prepare_corpus

    out = tmp_path_factory.mktemp("tiny_corpus")
    return prepare_corpus(str(out), vocab_size=512, seed=0, max_files=80)
