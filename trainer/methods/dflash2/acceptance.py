"""Where DFlash2's sampled drafts lose acceptance: each slot's expected acceptance under speculative sampling,
``sum_x min(p(x), q(x))`` (p the target's distribution, q the one the draft is drawn from), of the distribution DFlash2
samples from and of the ones it could sample from, on the same contexts.

``python -m trainer.methods.dflash2.acceptance --target T --drafter D [--baseline B]`` samples a continuation of each
held-out prompt from the target alone (at ``--temperature``, seeded), then drafts a block at every position of it,
teacher-forced (slot k given the sampled token before it, as a chain whose drafts before slot k were accepted), and
averages, per slot, the expected acceptance of:

- ``selector``: what DFlash2 drafts from, the softmax of the slot's top-k candidates rescored given the token before
  (every other token at 0);
- ``backbone``: the softmax of the slot's unary logits over the whole vocabulary (DFlash's own rule, on DFlash2's
  backbone);
- ``backbone top-k``: the same restricted to the top-k candidates, renormalised (the selector's support without its
  bilinear term);
- ``selector + rest``: the softmax over the whole vocabulary of the candidates' rescored logits and every other
  token's unary logit;
- ``selector argmax`` and ``backbone argmax``: a one-hot draft of the argmax, whose expected acceptance is p(argmax);
- ``baseline`` (with ``--baseline``, a DFlash drafter of the same target): its slot softmax, and its argmax;

with ``p on candidates``, the target's mass on the slot's top-k candidates: an upper bound of the selector's
acceptance, whatever its scores; and ``top probability: ...``, the mean largest probability of p and of each q (how
peaked each is). ``chain tau`` is ``1 + sum_k prod_{j <= k} alpha_j`` over the slots, the expected accepted length
of a chain of K drafts if each slot's acceptance were independent of the ones before.

``--engine`` also decodes the prompts as ``draftsmith eval`` does (K = ``--k``, the same seeds) with DFlash2's rule,
with :class:`VocabularySampling` (``selector + rest``) and with the baseline, and gives each one's measured tau.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.decoding import metrics
from trainer.decoding.evaluate import load_prompts, resolve_drafter, run_prompts
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer, ProposalContext
from trainer.losses.distribution import acceptance
from trainer.methods.dflash.proposer import DFlashProposer
from trainer.methods.dflash2.proposer import DFlash2Proposer


class VocabularySampling(DFlash2Proposer):
    """DFlash2's chain with its sampled drafts drawn from the whole vocabulary: the softmax of the slot's top-k
    candidates' rescored logits and every other token's unary logit (``selector + rest``), given the draft before,
    returned as the distribution drawn from (lossless). Greedy drafts are DFlash2's. Not the rule speculators'
    format is served with (vLLM draws among the candidates only): measured here beside it."""

    def draft_chain(
        self, ctx: ProposalContext, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, None]:
        if ctx.temperature <= 0:
            return super().draft_chain(ctx, logits)
        prev = ctx.tokens[-1:]  # [1]
        drafted, dists, rows = [], [], []
        for slot in range(logits.shape[0]):
            row = self.slot_logits(slot, prev, logits)  # [V]: the candidates rescored, the rest -inf
            full = torch.where(torch.isfinite(row), row, logits[slot].to(row.dtype))  # [V]: the rest unary
            dists.append(torch.softmax(full.float() / ctx.temperature, dim=-1))  # [V]
            prev = torch.multinomial(dists[-1], 1, generator=ctx.generator)  # [1]
            drafted.append(prev)
            rows.append(full)
        return torch.cat(drafted), torch.stack(dists), torch.stack(rows), None


def engine_tau(
    target,
    proposer: DFlashProposer,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_token_id: int | list[int] | None = None,
) -> float:
    """tau (tokens committed per target forward) of speculative decoding with ``proposer`` on the prompts, as
    ``draftsmith eval`` decodes them (a generator seeded with ``seed + prompt index``)."""
    results = run_prompts(target, proposer, prompts, k, max_new_tokens, temperature, eos_token_id, seed)
    return metrics.tau([r for result in results for r in result.rounds])


def chain_tau(alpha: list[float]) -> float:
    """``1 + sum_k prod_{j <= k} alpha_j``: the expected tokens per round of a chain with these slot acceptances."""
    tau, survive = 1.0, 1.0
    for a in alpha:
        survive *= a
        tau += survive
    return tau


def block_logits(proposer: DFlashProposer, seq: torch.Tensor, hidden: tuple, anchor: int, k: int) -> torch.Tensor:
    """The proposer's [k, V] unary slot logits of the block rooted at ``seq[anchor - 1]`` (the drafts of positions
    ``anchor .. anchor + k - 1``), its context the target's hidden states ``hidden`` (HF ``hidden_states``) before
    the root."""
    proposer.reset()
    states = {i: hidden[i][0, : anchor - 1] for i in proposer.needs_hidden_states}
    ctx = ProposalContext(tokens=seq[:anchor], k=k, vocab_size=proposer.lm_head.shape[0], hidden_states=states)
    return proposer.block_logits(ctx)[:k]


@torch.no_grad()
def slot_acceptance(
    target,
    proposer: DFlash2Proposer,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    baseline: DFlashProposer | None = None,
) -> dict[str, list[float]]:
    """Per variant (module docstring), the mean expected acceptance of slots 1..k over every anchor of every prompt's
    sampled continuation (slot k counted where the continuation reaches it), and ``anchors``, the count per slot."""
    if any(i < 0 for i in proposer.needs_hidden_states + (baseline.needs_hidden_states if baseline else ())):
        raise ValueError("the measurement reads HF hidden_states indices only (not the final layer before its norm)")
    top_k = proposer.drafter.candidate_selector.top_k
    sums: dict[str, torch.Tensor] = {}
    counts = torch.zeros(k, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)

    def add(name: str, slot: int, value: torch.Tensor) -> None:
        sums.setdefault(name, torch.zeros(k, dtype=torch.float64))[slot] += float(value)

    def add_top(name: str, slot: int, probs: torch.Tensor) -> None:
        add(f"top probability: {name}", slot, probs.max())

    for ids in prompts:
        prompt = torch.tensor(ids)
        out = speculative_generate(target, prompt, NoProposer(), 0, max_new_tokens, temperature, generator=generator)
        seq = torch.cat([prompt, torch.tensor(out.tokens, dtype=torch.long)])  # [L]
        run = target(input_ids=seq[None], output_hidden_states=True)
        p_all = torch.softmax(run.logits[0].double() / temperature, dim=-1)  # [L, V]: p of the token after each
        for anchor in range(len(ids), len(seq)):
            slots = min(k, len(seq) - anchor)  # slot s drafts seq[anchor + s], scored against p_all[anchor + s - 1]
            unary = block_logits(proposer, seq, run.hidden_states, anchor, k).double()  # [k, V]
            base = None if baseline is None else block_logits(baseline, seq, run.hidden_states, anchor, k).double()
            for s in range(slots):
                p = p_all[anchor + s - 1]  # [V]
                prev = seq[anchor + s - 1 : anchor + s]  # [1]: the token before slot s (the root for slot 0)
                row = proposer.slot_logits(s, prev, unary.to(proposer.slot_hidden.dtype)).double()  # [V]
                top = unary[s].topk(top_k).indices  # [top_k]
                truncated = torch.full_like(unary[s], float("-inf")).scatter(-1, top, unary[s][top])
                corrected = unary[s].scatter(-1, top, row[top])  # the candidates rescored, the rest unary
                q_selector, q_backbone = torch.softmax(row / temperature, -1), torch.softmax(unary[s] / temperature, -1)
                add("selector", s, acceptance(q_selector, p))
                add("backbone", s, acceptance(q_backbone, p))
                add("backbone top-k", s, acceptance(torch.softmax(truncated / temperature, -1), p))
                add("selector + rest", s, acceptance(torch.softmax(corrected / temperature, -1), p))
                add("selector argmax", s, p[row.argmax()])
                add("backbone argmax", s, p[unary[s].argmax()])
                add("p on candidates", s, p[top].sum())
                add_top("target", s, p)
                add_top("selector", s, q_selector)
                add_top("backbone", s, q_backbone)
                if base is not None:
                    q_baseline = torch.softmax(base[s] / temperature, -1)
                    add("baseline", s, acceptance(q_baseline, p))
                    add("baseline argmax", s, p[base[s].argmax()])
                    add_top("baseline", s, q_baseline)
                counts[s] += 1
    result = {name: (total / counts.clamp(min=1)).tolist() for name, total in sums.items()}
    result["anchors"] = counts.tolist()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m trainer.methods.dflash2.acceptance", description=__doc__)
    parser.add_argument("--target", required=True, help="the target's folder")
    parser.add_argument("--drafter", required=True, help="a dflash2 export or training checkpoint")
    parser.add_argument("--baseline", default=None, help="a DFlash drafter of the same target, measured beside it")
    parser.add_argument("--prompts", required=True, help="held-out prompts (jsonl, as draftsmith eval reads them)")
    parser.add_argument("--max_prompts", type=int, default=10)
    parser.add_argument("--max_new_tokens", type=int, default=48, help="tokens sampled after each prompt")
    parser.add_argument("--k", type=int, default=15, help="slots measured")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine", action="store_true", help="also decode the prompts (K = --k) with DFlash2's rule, the vocabulary "
        "rule and the baseline, and give each one's measured tau"
    )  # fmt: skip
    parser.add_argument("--output_file", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        parser.error("--temperature must be above 0: at 0 nothing is sampled")
    target = AutoModelForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompts(args.prompts, tokenizer)[: args.max_prompts]
    proposer = resolve_drafter(args.drafter, target, target_tokenizer=tokenizer, target_path=args.target)
    if not isinstance(proposer, DFlash2Proposer):
        parser.error(f"--drafter {args.drafter} is not a DFlash2 drafter")
    baseline = None
    if args.baseline is not None:
        baseline = resolve_drafter(args.baseline, target, target_tokenizer=tokenizer, target_path=args.target)
        if not isinstance(baseline, DFlashProposer) or isinstance(baseline, DFlash2Proposer):
            parser.error(f"--baseline {args.baseline} is not a DFlash drafter")
    torch.manual_seed(args.seed)
    result = slot_acceptance(
        target, proposer, prompts, args.k, args.max_new_tokens, args.temperature, args.seed, baseline
    )
    lines = [f"{'variant':<28} {'chain tau':>9}  slots 1..{min(args.k, 6)} ... mean over 1..{args.k}"]
    for name, alpha in result.items():
        if name == "anchors":
            continue
        tau = "" if name.startswith(("top probability", "p on")) else f"{chain_tau(alpha):.3f}"
        head = ", ".join(f"{a:.3f}" for a in alpha[:6])
        lines.append(f"{name:<28} {tau:>9}  {head} ... {sum(alpha) / len(alpha):.3f}")
    measured: dict[str, float] = {}
    if args.engine:
        eos = target.generation_config.eos_token_id if target.generation_config is not None else None
        eos = tokenizer.eos_token_id if eos is None else eos
        rules = {
            "selector": proposer,
            "selector + rest": VocabularySampling(proposer.drafter, proposer.embedding, proposer.lm_head),
        }
        rules |= {"baseline": baseline} if baseline is not None else {}
        for name, rule in rules.items():
            measured[name] = engine_tau(
                target, rule, prompts, args.k, args.max_new_tokens, args.temperature, args.seed, eos
            )
            lines.append(f"measured tau, {name}: {measured[name]:.3f}")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.output_file:
        Path(args.output_file).parent.mkdir(parents=True, exist_ok=True)
        record = {"args": vars(args), "alpha": result, "measured_tau": measured}
        Path(args.output_file).write_text(json.dumps(record, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
