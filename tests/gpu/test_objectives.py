"""Every objective for DRAFTSMITH_GPU_STEPS (20) bf16 steps on the real-shape cut target, through the runner the CPU
benchmark uses (tests/real_width.py): tokens/s and peak memory per objective for the summary table and
gpu_results.json, finite losses, and greedy speculative decoding with the trained drafter identical to the target's
own output on CUDA."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import record_objective, settings
from tests.real_width import OBJECTIVES, Result, run_objective

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", OBJECTIVES)
def test_objective_trains_in_bf16_and_drafts_losslessly(name, cut_target, text_data, tmp_path):
    try:
        result = run_objective(name, cut_target, text_data, settings(), tmp_path)
    except Exception as err:
        record_objective(Result(name, "fail", reason=f"{type(err).__name__}: {err}"))
        raise
    record_objective(result)
    assert result.status == "pass", result.reason
    assert result.tokens_per_s and result.peak_mib
