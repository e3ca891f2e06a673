"""Greedy identity: speculative greedy output checked token for token against the target's own greedy output, with
rounding told apart from a bug.

The engine's rules are exact, its arithmetic is the target's (trainer/decoding/generate.py): a forward over K + 1
tokens and K + 1 one-token forwards round differently, so where the target's top two logits are closer than that
rounding the two decodes may pick different tokens, and from there they go on differently. In float64 (the tests)
this does not happen; in bfloat16, the dtype real targets are served in, it does (a real-width Llama-3.1 cut to 4
layers diverged at its third output token, its top two bf16 logits 0.0625 apart, 2 units in the last place).

:func:`check_identity` therefore looks at the first difference of each prompt: given the target and the prompts, it
runs the target once over the prompt and the common output and accepts the difference as a *near-tie* when the two
tokens are that forward's top two and their logits are at most :data:`NEAR_TIE_ULPS` units in the last place of the
target's dtype apart; it returns the near-ties (reported, never hidden) and raises
:class:`SpeculativeMismatchError` on any other difference. Without the target any difference raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEAR_TIE_ULPS = 16.0
"""The widest logit gap, in units in the last place of the target's dtype at the logits' magnitude, taken as rounding:
16 ulps is 0.5 at a bfloat16 logit of 4 to 8 and 8e-6 at a float32 one, far below the gaps a wrong verification
leaves (whole logits) and above what one forward's other summation order moves (a few ulps)."""


class SpeculativeMismatchError(RuntimeError):
    """Greedy speculative output differs from the target's own greedy output (not on a near-tie)."""


@dataclass(frozen=True)
class NearTie:
    """A first difference between the two greedy outputs of one prompt, on a near-tie of the target's logits.

    Attributes:
        prompt: the prompt's index.
        position: the output position of the first difference.
        target_token: the token of the target's own greedy output there.
        speculative_token: the token of the speculative output there.
        gap: |logit(target_token) - logit(speculative_token)| in one forward over the prompt and the common output.
        ulps: ``gap`` in units in the last place of the target's dtype at the larger logit's magnitude.
    """

    prompt: int
    position: int
    target_token: int
    speculative_token: int
    gap: float
    ulps: float


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype``'s numbers at ``magnitude``: eps x 2 ** floor(log2(magnitude))."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(magnitude), info.tiny)))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one is a prefix), or None."""
    if list(a) == list(b):
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def near_tie(target, prompt: Sequence[int], common: Sequence[int], tokens: tuple[int, int]) -> tuple[float, float]:
    """(gap, ulps) of ``tokens`` under one forward of ``target`` over ``prompt + common``, or (inf, inf) when they are
    not that forward's top two."""
    weight = next(target.parameters())
    ids = torch.tensor([list(prompt) + list(common)], dtype=torch.long, device=weight.device)  # [1, S]
    logits = target(input_ids=ids).logits[0, -1].float()  # [V]
    if set(logits.topk(2).indices.tolist()) != set(tokens):
        return math.inf, math.inf
    first, second = (float(logits[t]) for t in tokens)
    gap = abs(first - second)
    return gap, gap / ulp(weight.dtype, max(abs(first), abs(second)))


def check_identity(
    reference: Sequence,
    results: Sequence,
    k: int,
    target=None,
    prompts: Sequence[Sequence[int]] | None = None,
) -> list[NearTie]:
    """Compares each prompt's speculative greedy output (``results``, GenerationResults) with the target's
    (``reference``). Returns the near-ties (see the module docstring; only with ``target`` and ``prompts``); raises
    :class:`SpeculativeMismatchError` naming K, the prompt and the position of any other difference."""
    ties = []
    for i, (ref, res) in enumerate(zip(reference, results)):
        pos = first_difference(ref.tokens, res.tokens)
        if pos is None:
            continue
        tie = None
        if target is not None and prompts is not None and pos < min(len(ref.tokens), len(res.tokens)):
            pair = (ref.tokens[pos], res.tokens[pos])
            gap, ulps = near_tie(target, prompts[i], ref.tokens[:pos], pair)
            if ulps <= NEAR_TIE_ULPS:
                tie = NearTie(i, pos, pair[0], pair[1], round(gap, 9), round(ulps, 2))
        if tie is None:
            raise SpeculativeMismatchError(
                f"K={k}, prompt {i}: greedy speculative output differs from the target's at output position {pos} "
                f"(target {ref.tokens[pos : pos + 5]}, speculative {res.tokens[pos : pos + 5]})"
            )
        ties.append(tie)
    return ties


def describe_near_tie(tie: NearTie, k: int, dtype: torch.dtype) -> str:
    """One line saying what a near-tie is, for logs and reports."""
    name = str(dtype).removeprefix("torch.")
    return (
        f"K={k}, prompt {tie.prompt}: the outputs part at position {tie.position} on a near-tie of the target's logits "
        f"(tokens {tie.target_token} and {tie.speculative_token}, {tie.gap:.3g} apart, {tie.ulps:g} {name} ulps): "
        "rounding, not a draft; each output is the engine's own greedy output from there"
    )
