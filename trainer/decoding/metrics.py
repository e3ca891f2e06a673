"""Speculative decoding metrics: tau, acceptance per draft position, loops, and Leviathan's speedup projection.

tau is the mean number of tokens committed per forward of the target, the bonus (or correction) token counted: 1 for
the target alone, at most K + 1. The first forward is also the prefill; it verifies drafts made after the prompt
(except for proposers that need the target's hidden states of the prompt first), so it counts like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.decoding.generate import RoundStats


def tau(rounds: Sequence[RoundStats]) -> float:
    """Mean tokens committed per target forward (``nan`` without rounds)."""
    if not rounds:
        return float("nan")
    return sum(r.committed for r in rounds) / len(rounds)


def acceptance_per_position(rounds: Sequence[RoundStats], k: int) -> list[float]:
    """Acceptance rate of draft position d = 1..k: rounds that accepted >= d drafts among those that drafted >= d.

    ``nan`` where no round drafted that deep. Position 1 is the first draft after the root.
    """
    rates = []
    for d in range(1, k + 1):
        drafted = [r for r in rounds if r.drafted >= d]
        rates.append(sum(r.accepted >= d for r in drafted) / len(drafted) if drafted else float("nan"))
    return rates


def acceptance_rate(rounds: Sequence[RoundStats]) -> float:
    """Accepted drafts over drafted positions (path depth): the alpha of Leviathan's formula (``nan`` if none)."""
    drafted = sum(r.drafted for r in rounds)
    return sum(r.accepted for r in rounds) / drafted if drafted else float("nan")


def loop_mask(tokens: Sequence[int], window: int = 16, max_period: int = 8) -> list[bool]:
    """Mark the tokens that sit in a ``window``-token span repeating with a period of at most ``max_period``.

    A span ``w`` of ``window`` tokens repeats with period p when ``w[i] == w[i + p]`` for every i; every token of
    such a span is marked. A sequence shorter than ``window`` has no loop.
    """
    if window <= max_period or max_period < 1:
        raise ValueError(f"need 1 <= max_period < window, got window={window}, max_period={max_period}")
    n = len(tokens)
    marked = [False] * n
    for s in range(n - window + 1):
        span = tokens[s : s + window]
        if any(all(span[i] == span[i + p] for i in range(window - p)) for p in range(1, max_period + 1)):
            for i in range(s, s + window):
                marked[i] = True
    return marked


def loop_share(tokens: Sequence[int], window: int = 16, max_period: int = 8) -> float:
    """Fraction of the tokens inside a loop (see :func:`loop_mask`); 0 for an empty sequence."""
    mask = loop_mask(tokens, window, max_period)
    return sum(mask) / len(mask) if mask else 0.0


def split_rounds_by_loop(
    rounds: Sequence[RoundStats], mask: Sequence[bool]
) -> tuple[list[RoundStats], list[RoundStats]]:
    """Rounds whose first committed token lies inside a loop of the reference output, and the others."""
    inside = [r for r in rounds if r.start < len(mask) and mask[r.start]]
    outside = [r for r in rounds if not (r.start < len(mask) and mask[r.start])]
    return inside, outside


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per verification with K drafts each accepted independently with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def leviathan_speedup(alpha: float, k: int, cost: float) -> float:
    """Leviathan et al.'s projected speedup (1 - alpha^(K+1)) / ((1 - alpha)(cK + 1)); c is one draft's cost
    relative to a target forward."""
    return expected_tokens(alpha, k) / (cost * k + 1)
