"""The real-shape rehearsal of every real-model recipe (tests/rehearsal/cases.py): fit a few steps on one CPU process
on the real model's cut shapes, export every format, read each back, draft with ``draftsmith eval`` (greedy output
identical to the target's), and ask ``draftsmith plan`` for the same run.

``make rehearse`` runs them all (marker ``rehearsal``, one real-width process at a time: several GB and many CPU
minutes each) and writes docs/benchmarks/rehearsal.md. ``make test`` runs :data:`CI_CASE` unmarked when one is named;
none is today: the cheapest case, the MTP refresh on Qwen3.5-9B cut to 4 layers, took more than 11 CPU minutes and
6 GiB in its fit alone on the 2-core machine, past the whole suite's budget. What CI runs of the rehearsal is
test_compare_recipe.py (the cut Llama-3.1-8B config and tokenizer, every compare method's fit parsed against it).
"""

from __future__ import annotations

import pytest

from tests.rehearsal.cases import CASES, available_gib, rehearse

CI_CASE: str | None = None
"""A case cheap enough for ``make test`` to run unmarked (None: every case is marked ``rehearsal``)."""


def _param(case):
    marks = [pytest.mark.slow] + ([] if case.name == CI_CASE else [pytest.mark.rehearsal])
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_rehearse(case):
    if case.needs_gib > available_gib():
        pytest.skip(f"{case.name} needs about {case.needs_gib:.0f} GiB, {available_gib():.1f} GiB available")
    result = rehearse(case)
    assert result["ok"]
    assert result["fit"]["peak_rss_gib"] > result["target_params_b"] * 2 * 0.5  # the bf16 target was resident
