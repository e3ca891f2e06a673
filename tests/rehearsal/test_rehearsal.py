"""The real-shape rehearsal of every real-model recipe (tests/rehearsal/cases.py): fit a few steps on one CPU process
on the real model's cut shapes, export every format, read each back, draft with ``draftsmith eval`` (greedy output
identical to the target's), and ask ``draftsmith plan`` for the same run.

``make rehearse`` runs them all (marker ``rehearsal``, one real-width process at a time: 10 to 21 GiB and several
CPU minutes each) and writes docs/benchmarks/rehearsal.md. ``make test`` runs :data:`CI_CASE` unmarked: DFlash on
Llama-3.1-8B cut to 2 layers with one draft layer and no ZeRO-2, the cheapest case that still has the real
vocabulary (128,256, in the chunked loss over the shared head), the 4,096-wide layers and fusion, the
real rope scaling and chat template, and every export DFlash writes (see docs/benchmarks/rehearsal.md for its memory
and time); tests/conftest.py starts it first on its worker. Where less memory is available than it needs it is
skipped, saying so (the planner's answer is still written).
"""

from __future__ import annotations

import pytest

from tests.rehearsal.cases import CASES, available_gib, plan_only, rehearse, short_of_memory

CI_CASE: str | None = "dflash_llama31_8b_ci"
"""The case ``make test`` runs unmarked (None: every case is marked ``rehearsal``)."""


def _param(case):
    marks = [pytest.mark.slow] + ([] if case.name == CI_CASE else [pytest.mark.rehearsal])
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_rehearse(case):
    if short_of_memory(case) and not case.low_memory_precision:
        why = f"needs about {case.needs_gib:.0f} GiB, {available_gib():.1f} GiB available"
        plan_only(case, f"not run: {why}")  # the table still shows the planner's answer
        pytest.skip(f"{case.name} {why}")
    result = rehearse(case)
    assert result["ok"]
    measured = result["fit"]["peak_rss_gib"]
    assert measured > result["target_params_b"] * 2 * 0.5  # the target was resident (bf16 or float32)
    planned = result["plan"]["estimate_gib"]
    assert planned is not None and 0.8 <= planned / measured <= 1.2, f"planned {planned} GiB, measured {measured} GiB"
