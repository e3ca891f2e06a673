"""Greedy identity (trainer/decoding/identity.py): any difference is an error, except where the target's own top two
logits tie to its dtype's rounding (a near-tie), which is returned and reported, never hidden."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import tiny_llama
from trainer.decoding.generate import GenerationResult
from trainer.decoding.identity import NEAR_TIE_ULPS, SpeculativeMismatchError, check_identity, near_tie, ulp
from trainer.decoding.report import markdown


def test_a_difference_without_the_target_is_an_error() -> None:
    reference = [GenerationResult(tokens=[1, 2, 3, 4])]
    with pytest.raises(SpeculativeMismatchError, match="K=4, prompt 0.*position 2"):
        check_identity(reference, [GenerationResult(tokens=[1, 2, 9, 4])], k=4)
    with pytest.raises(SpeculativeMismatchError, match="position 3"):  # one output a prefix of the other
        check_identity(reference, [GenerationResult(tokens=[1, 2, 3])], k=4)
    assert check_identity(reference, [GenerationResult(tokens=[1, 2, 3, 4])], k=4) == []


def test_ulp_is_the_dtype_spacing_at_the_magnitude() -> None:
    assert ulp(torch.bfloat16, 5.87) == 2.0**-5  # 8 bits of mantissa: 0.03125 between 4 and 8
    assert ulp(torch.float32, 1.0) == 2.0**-23
    assert ulp(torch.float64, -3.0) == 2.0**-51
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.tensor(5.87, dtype=dtype)
        assert float(torch.nextafter(x, torch.tensor(100.0, dtype=dtype)) - x) == ulp(dtype, 5.87)


def _tied_target(dtype: torch.dtype, prompt: list[int], scale: float):
    """A tiny bf16/float target whose lm_head row of a second token is ``scale`` times the row of its greedy token at
    the end of ``prompt`` (scale 1: an exact tie). Returns (target, greedy token, second token)."""
    target = tiny_llama(0, vocab=64).to(dtype)
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        first, second = logits.topk(2).indices.tolist()
        target.lm_head.weight[second] = target.lm_head.weight[first] * scale
    return target, first, second


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_difference_on_a_near_tie_is_returned_and_reported(dtype) -> None:
    prompt, common = [3, 7, 11], [5, 9]
    target, first, second = _tied_target(dtype, prompt + common, 1.0)
    reference = [GenerationResult(tokens=[5]), GenerationResult(tokens=[*common, first, 1])]
    results = [GenerationResult(tokens=[5]), GenerationResult(tokens=[*common, second, 2])]
    ties = check_identity(reference, results, 3, target, [[1, 2], prompt])
    assert len(ties) == 1
    tie = ties[0]
    assert (tie.prompt, tie.position, tie.target_token, tie.speculative_token) == (1, 2, first, second)
    assert tie.gap == 0.0 and tie.ulps == 0.0
    gap, ulps = near_tie(target, prompt, common, (first, second))
    assert gap == 0.0 and ulps <= NEAR_TIE_ULPS
    report = markdown(_report({"k": 3, "near_ties": [dataclasses.asdict(tie)]}))
    assert f"- K=3, prompt 1, position 2: tokens {first} (target alone) and {second} (speculative), 0 ulps" in report


def test_a_difference_that_is_no_tie_is_an_error() -> None:
    prompt = [3, 7, 11]
    target, first, second = _tied_target(torch.bfloat16, prompt, 0.5)  # the second token's logit halved: no tie
    with torch.no_grad():
        last = target(input_ids=torch.tensor([prompt])).logits[0, -1].float().argsort()[0].item()
    for other in (second, last):
        with pytest.raises(SpeculativeMismatchError, match="prompt 0: greedy speculative output differs.*position 0"):
            check_identity([GenerationResult(tokens=[first])], [GenerationResult(tokens=[other])], 2, target, [prompt])


def _report(entry: dict) -> dict:
    """The least report markdown() writes, with one greedy entry."""
    greedy = {
        "tau": 1.0, "tau_in_loops": None, "tau_outside_loops": None, "acceptance_rate": 0.0, "target_forwards": 1,
        "baseline_target_forwards": 1, "draft_cost": 0.1, "projected_speedup": 1.0, "measured_speedup": 1.0,
        "measured_speedup_quartiles": [1.0, 1.0], "acceptance_per_position": [0.0], "accept_threshold": 0.0, **entry,
    }  # fmt: skip
    return {
        "baseline": {"target_forwards": 1, "tokens": 1, "forward_seconds": 0.01},
        "loops": {"share": 0.0, "window": 16, "max_period": 8, "looped_prompts": 0},
        "best_k": entry["k"], "greedy": [greedy], "sampling": [],
    }  # fmt: skip
