"""Shared fixtures: a tiny tokenizer, corpus and target that the suite builds once per session."""

from __future__ import annotations

import os

import pytest

from tests.shared_fixtures import shared_folder, worker_id


def pytest_configure(config) -> None:
    """Under pytest-xdist (``make test`` runs two workers on two cores), each worker and the processes it starts use
    one thread: two workers of two threads each would oversubscribe the cores."""
    if worker_id() is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------------- corpus


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small standard-library corpus with a 512-token byte-level BPE tokenizer (a few seconds, once per session)."""
    from trainer.data.corpus import prepare_corpus

    def build(out):
        prepare_corpus(str(out), vocab_size=512, seed=0, max_files=80)

    out = shared_folder(tmp_path_factory, "tiny_corpus", build)
    return prepare_corpus(str(out), vocab_size=512, seed=0, max_files=80)  # reads the corpus built above


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
