"""What ``draftsmith eval`` accepts is what training scores: the engine's accepted drafts per round equal the training
forward's teacher-forced leading run of right slots at the round's root, walked as the engine anchors its rounds (the
next root after the accepted drafts and the bonus token), for plain DFlash and with DSpark's Markov head
(trainer/methods/dspark/: teacher forcing its previous token changes nothing while the drafts before are right).
Per-position acceptance over rounds is therefore lower than the training log's per-anchor ``prefix_k`` only because
rounds skip over what they accept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import tiny_llama
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer
from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.dflash.proposer import DFlashProposer
from trainer.methods.dspark.module import DSparkConfig, DSparkDrafter
from trainer.methods.dspark.proposer import DSparkProposer

VOCAB, K = 4, 4  # a small vocabulary: random drafts are often right, so rounds accept runs of several lengths


def teacher_forced_walk(target, drafter: DFlashDrafter, sequence: torch.Tensor, prompt_length: int) -> list[int]:
    """The accepted drafts of every round after the prefill, from the training forward on the final sequence."""
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.no_grad():
        hidden = target(sequence[None], output_hidden_states=True).hidden_states
        context = drafter.context([hidden[i] for i in drafter.config.target_layers])  # [1, T, H]
    T, b, accepted = sequence.numel(), drafter.config.block_size, []
    root = prompt_length  # the prefill commits one token: the first round's root
    while root < T - 1:
        with torch.no_grad():
            block = drafter.block_ids(sequence[root : root + 1])[None]  # [1, b]
            out = drafter.train_blocks(context, embedding[block], torch.tensor([[root]]), "dense")[0, 1:]  # [b-1, H]
            truth = sequence[root + 1 : root + b]  # [<= b - 1]
            prev = torch.cat([sequence[root : root + 1], truth[:-1]])  # the token before each slot's, teacher-forced
            n = truth.numel()
            logits = out[:n] @ head.t()  # [n, V]
            if isinstance(drafter, DSparkDrafter):
                logits, _ = drafter.apply_heads(out[:n], logits, prev)
        k = min(K, T - 2 - root)  # the engine drafts no more than the tokens left to generate, less the bonus
        lead = int((logits.argmax(-1)[:k] == truth[:k]).long().cumprod(0).sum())
        accepted.append(lead)
        root += lead + 1
    return accepted


@pytest.mark.parametrize("markov", [False, True])
def test_the_engines_rounds_accept_the_teacher_forced_leading_runs(markov, one_thread):
    # plain: a random drafter on a target whose output ends in a run of one token; Markov: a target that loops
    # 3, 0, 2, 3, 0, 2, ... and a bigram head that knows 3 -> 0 and 0 -> 2 but says 2 -> 1 (wrong), so a round from
    # root 3 accepts 2 drafts (a head that read the root instead of the previous draft would accept 1)
    target = tiny_llama(2 if markov else 3, vocab=VOCAB, layers=4)  # float64, eval
    config = DFlashConfig.from_target(target.config, 2, (1, 3), block_size=6, mask_token_id=VOCAB - 1)
    if markov:
        heads = dict(markov_rank=VOCAB, enable_confidence_head=False, confidence_head_with_markov=False)
        config = DSparkConfig(**config.to_dict(), **heads)
    torch.manual_seed(1)
    drafter = DSparkDrafter(config) if markov else DFlashDrafter(config)
    for p in drafter.parameters():
        nn.init.normal_(p, std=0.3)
    if markov:
        with torch.no_grad():
            drafter.markov_head.markov_w1.weight.copy_(10.0 * torch.eye(VOCAB))  # prev -> one-hot of rank VOCAB
            successor = torch.tensor([2, 0, 1, 0])  # of 0, 1, 2, 3
            drafter.markov_head.markov_w2.weight.copy_(F.one_hot(successor, VOCAB).t().double())  # [V, r]
    drafter = drafter.to(torch.float64).eval()
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = torch.randint(0, VOCAB - 1, (7,), generator=torch.Generator().manual_seed(0))
    proposer = (DSparkProposer if markov else DFlashProposer)(drafter, embedding, head)
    result = speculative_generate(target, prompt, proposer, k=K, max_new_tokens=40)
    assert result.tokens == speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=40).tokens
    engine = [r.accepted for r in result.rounds[1:]]  # the first forward is the prefill: nothing drafted
    walked = teacher_forced_walk(target, drafter, torch.cat([prompt, torch.tensor(result.tokens)]), prompt.numel())
    assert engine == walked
    assert max(engine) >= 2  # rounds that accept runs: the comparison is not all zeros
