"""Packing with document masking (trainer/documents.py's convention): the target runs a packed row as its documents
alone; the data module serves the packer's exact boundaries; the KD loss sums each document's own loss."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_llama, tiny_model
from trainer.target import FrozenTarget

# --------------------------------------------------------------------------------------------------- the target


def packed_row(lengths: list[list[int]], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [B, S] and document_ids [B, S] for rows made of documents of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (sum(row),), generator=generator) for row in lengths]
    documents = [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths]
    return torch.stack(ids), torch.stack(documents)


def each_alone(document_ids: torch.Tensor, b: int) -> list[slice]:
    """The span of every document of row b."""
    row = document_ids[b].tolist()
    starts = [t for t in range(len(row)) if t == 0 or row[t] != row[t - 1]] + [len(row)]
    return [slice(starts[i], starts[i + 1]) for i in range(len(starts) - 1)]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_packed_row_gives_each_documents_own_hidden_states_and_logits(implementation):
    model = tiny_llama(0, layers=2, attn_implementation=implementation)
    target = FrozenTarget(model)
    ids, documents = packed_row([[5, 1, 9, 3], [11, 7]], vocab=128)  # [2, 18]
    out = target(ids, hidden_layers=(1, 2), document_ids=documents)
    final = target.final_hidden(ids, document_ids=documents)  # [B, S, H]
    for b in range(ids.shape[0]):
        for span in each_alone(documents, b):
            alone = target(ids[b : b + 1, span], hidden_layers=(1, 2))
            torch.testing.assert_close(out.logits[b, span], alone.logits[0], atol=1e-5, rtol=0)
            for got, want in zip(out.hidden_states, alone.hidden_states, strict=True):
                torch.testing.assert_close(got[b, span], want[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(final[b, span], alone.hidden_states[1][0], atol=1e-5, rtol=0)
    plain = target(ids).logits  # without document_ids the second document sees the first
    assert not torch.allclose(plain[0, 5:6], out.logits[0, 5:6], atol=1e-5)


def test_a_sliding_window_model_keeps_its_window_within_documents():
    """Mistral with a 3-token window: the position_ids path (no explicit mask) runs each document alone, window kept."""
    target = FrozenTarget(tiny_model("mistral", 1, sliding_window=3))
    ids, documents = packed_row([[6, 2, 8]], vocab=96, seed=1)
    out = target(ids, document_ids=documents)
    for span in each_alone(documents, 0):
        torch.testing.assert_close(out.logits[0, span], target(ids[:, span]).logits[0], atol=1e-5, rtol=0)


def test_document_ids_refuse_a_cache_and_explicit_positions():
    target = FrozenTarget(tiny_llama(0))
    ids, documents = packed_row([[3, 4]], vocab=128)
    with pytest.raises(ValueError, match="KV cache"):
        target(ids, document_ids=documents, use_cache=True)
    with pytest.raises(ValueError, match="exclusive"):
        target(ids, document_ids=documents, position_ids=torch.arange(7)[None])
