"""Per-slot accuracy of a DFlash or Domino export along the target's own greedy continuations: the backbone's logits
alone, the head's corrected logits teacher-forced on the target's tokens, and the chain the proposer drafts.

    python -m bench.studies.domino_slots DRAFTER [DRAFTER ...] [--target artifacts/tiny_target]
        [--prompts artifacts/heldout_prompts.jsonl] [--max_prompts 10] [--new_tokens 48]

Every position of each prompt's greedy continuation (``--new_tokens`` of them) is a root: the drafter drafts the
block after it from the target's hidden states of the positions before it, and each slot k is compared with the
target's own token k after the root. Printed per slot: ``backbone`` the argmax of the backbone's logits right,
``corrected`` (Domino) the argmax of its logits plus the head's delta from the GRU over the root and the target's
tokens before slot k right (teacher forcing, as training reads them), ``backbone chain`` and ``chain`` slots 1..k all
right, for the backbone's drafts and for the proposer's left-to-right drafts. A chain's slot-k figure is the
probability that a round from that root accepts at least k drafts, so the sum over slots 2..15 is the expected
drafts accepted past slot 1 per round, over every root rather than over the roots a decoding run visits
(``draftsmith eval``'s figure).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.decoding.proposers import ProposalContext
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.dflash.proposer import DFlashProposer
from trainer.methods.domino import kind as domino_kind
from trainer.methods.domino.proposer import DominoProposer


@torch.no_grad()
def slot_rates(folder: Path, target, tokenizer, prompts: list[str], new_tokens: int) -> dict[str, torch.Tensor]:
    """Each measured rate [b - 1] of the export in ``folder`` (see the module docstring)."""
    domino = domino_kind.DOMINO.recognise(folder)
    drafter = (domino_kind.DOMINO if domino else dflash_kind.ZLAB).load(folder)[0].float().eval()
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    proposer = (DominoProposer if domino else DFlashProposer)(drafter, embedding, head)
    K, p = drafter.config.block_size - 1, getattr(drafter.config, "pure_draft_prefix_len", 0)
    hits = {name: torch.zeros(K) for name in ("backbone", "corrected", "backbone chain", "chain")}
    roots = 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        full = target.generate(ids, max_new_tokens=new_tokens + K, do_sample=False)[0]  # [T]
        states = target.model(full[None], output_hidden_states=True).hidden_states
        for a in range(ids.shape[1] - 1, ids.shape[1] - 1 + new_tokens):  # the root's position
            hidden = {i: states[i][0, :a] for i in drafter.config.target_layers}
            proposer.reset()
            ctx = ProposalContext(tokens=full[: a + 1], k=K, vocab_size=head.shape[0], hidden_states=hidden)
            logits = proposer.block_logits(ctx)[:K]  # [K, V]
            truth = full[a + 1 : a + 1 + K]  # [K]
            base = logits.argmax(-1) == truth
            drafts, corrected = logits.argmax(-1), base
            if domino:
                drafts = proposer.draft_chain(ctx, logits)[0]
                gru, _ = drafter.prefix_states(F.embedding(full[a : a + K][None], embedding))  # root, then truth
                delta = drafter.delta(drafter.features(proposer.slot_hidden[:K], gru[0]))  # [K, V]
                delta[:p] = 0
                corrected = (logits + delta).argmax(-1) == truth
            hits["backbone"] += base.float()
            hits["corrected"] += corrected.float()
            hits["backbone chain"] += base.long().cumprod(0).float()
            hits["chain"] += (drafts == truth).long().cumprod(0).float()
            roots += 1
    return {name: total / roots for name, total in hits.items() if domino or name != "corrected"}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("drafters", nargs="+", help="DFlash (z-lab) or Domino export folders")
    parser.add_argument("--target", default="artifacts/tiny_target")
    parser.add_argument("--prompts", default="artifacts/heldout_prompts.jsonl")
    parser.add_argument("--max_prompts", type=int, default=10)
    parser.add_argument("--new_tokens", type=int, default=48)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(args.target).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()[: args.max_prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    for folder in args.drafters:
        rates = slot_rates(Path(folder), target, tokenizer, prompts, args.new_tokens)
        print(folder)
        for name, rate in rates.items():
            print(f"  {name:15s}", " ".join(f"{x:.2f}" for x in rate.tolist()))
        past = {name: float(rates[name][1:].sum()) for name in ("backbone chain", "chain")}
        print(f"  past slot 1: backbone chain {past['backbone chain']:.2f}, chain {past['chain']:.2f}")


if __name__ == "__main__":
    main()
