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


@pytest.fixture(scope="session")
def tok(tiny_corpus):
    """The tiny corpus' tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and far faster on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
