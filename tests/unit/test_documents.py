"""trainer/models/documents.py: positions within documents and the allowed-keys mask, against per-element loops."""

import pytest
import torch

from trainer.interface.errors import RecipeError
from trainer.models.documents import allowed_keys, check_window, document_positions


def _random_documents(B: int, S: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, S, generator=g) < 0.2  # [B, S]
    starts[:, 0] = False
    return torch.cumsum(starts.long(), 1)  # [B, S] non-decreasing from 0


def test_document_positions_count_from_each_documents_first_token():
    docs = _random_documents(3, 40, 0)
    got = document_positions(docs)
    for b in range(3):
        for t in range(40):
            first = min(s for s in range(40) if docs[b, s] == docs[b, t])
            assert got[b, t] == t - first


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("with_documents", [False, True])
def test_allowed_keys_against_a_loop(window, with_documents):
    docs = _random_documents(2, 24, 1)
    pos = torch.arange(24).expand(2, 24)
    mask = allowed_keys(pos, pos, docs if with_documents else None, docs if with_documents else None, window)
    assert mask.shape == (2, 24, 24)
    for b in range(2):
        for t in range(24):
            for s in range(24):
                want = s <= t and (window is None or t - s < window)
                if with_documents:
                    want = want and bool(docs[b, s] == docs[b, t])
                assert bool(mask[b, t, s]) == want
    assert mask.diagonal(dim1=1, dim2=2).all()  # every query sees itself


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_check_window_refuses_names_the_key(bad):
    with pytest.raises(RecipeError, match="model.init_args.window"):
        check_window(bad, "model.init_args.window")
    check_window(None, "x")
    check_window(7, "x")
