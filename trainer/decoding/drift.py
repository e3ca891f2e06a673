"""How far a changed target moved from the model it was fine-tuned from (``draftsmith eval --original_target``).

Methods that train their target (LayerSkip and parallel-heads fine-tunes, Medusa-2) are measured against the model
they produced, so their tau says nothing about what the training did to that model's own outputs. Two figures, for the
changed target and the original side by side:

- held-out loss: the mean next-token cross entropy (nats per token) of each model on held-out text (``--heldout``, each
  document cut to the target's context), teacher forced (every token after a document's first); without it, on the
  prompts' tokens, which a fine-tune on prompts cut the same way (``draftsmith compare``'s regenerated data) can fit
  better than the text that follows them;
- loop share: the share of each model's greedy output (``max_new_tokens`` per prompt) that sits in a loop
  (:func:`trainer.decoding.metrics.loop_mask`, the window and period of the eval report's own loop statistics).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from trainer.decoding.evaluate import loop_statistics, run_prompts
from trainer.decoding.proposers import NoProposer


def heldout_text(heldout: str | None, tokens: int = 0) -> str:
    """What a held-out loss is measured on, as eval's and compare's reports name it: ``heldout`` (a jsonl of held-out
    text; None: the prompts) and ``tokens`` (each document's first this many; 0: up to the target's context)."""
    if not heldout:
        return "the prompts"
    return f"the first {tokens} tokens of each document of {heldout}" if tokens else heldout


@torch.no_grad()
def prompt_loss(model: PreTrainedModel, prompts: Sequence[Sequence[int]]) -> tuple[float, int]:
    """Mean next-token cross entropy of ``model`` over every prompt's tokens, and how many tokens were scored."""
    total, count = 0.0, 0
    for prompt in prompts:
        if len(prompt) < 2:
            continue
        ids = torch.tensor(list(prompt), dtype=torch.long, device=model.device)[None]  # [1, S]
        logits = model(input_ids=ids).logits[0, :-1]  # [S - 1, V]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return (total / count if count else float("nan")), count


def target_drift(
    original: PreTrainedModel,
    changed: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    changed_loop_share: float | None = None,
    original_path: str | None = None,
    heldout: Sequence[Sequence[int]] | None = None,
    heldout_source: str = "the prompts",
) -> dict:
    """Held-out loss and greedy loop share of the changed target and of its original, for the eval report.

    Args:
        original: the model the changed target was fine-tuned from.
        changed: the changed target (the one the drafter was measured against).
        prompts: the evaluation's prompts (token ids): their greedy outputs give the loop share.
        max_new_tokens: greedy tokens per prompt for the loop share.
        eos_token_id: stops a greedy output early.
        changed_loop_share: the changed target's loop share when already measured (the eval report's ``loops``).
        original_path: the original's folder, recorded in the result.
        heldout: held-out token sequences for the loss (None: the prompts).
        heldout_source: what ``heldout`` is, recorded in the result.

    Returns:
        ``{"original_path", "heldout", "tokens", "original": {"heldout_loss", "loop_share"}, "target": {...}}``.
    """
    out: dict = {"original_path": original_path, "heldout": heldout_source if heldout is not None else "the prompts"}
    for name, model, share in (("original", original, None), ("target", changed, changed_loop_share)):
        loss, tokens = prompt_loss(model, prompts if heldout is None else heldout)
        if share is None:
            results = run_prompts(model, NoProposer(), prompts, 1, max_new_tokens, 0.0, eos_token_id)
            share = loop_statistics(results)[0]["share"]
        out[name] = {"heldout_loss": loss, "loop_share": share}
        out["tokens"] = tokens
    return out
