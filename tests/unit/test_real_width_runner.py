"""The shared runner of the GPU suite and the real-width benchmark (tests/real_width.py) on CPU, on a tiny random
target: it trains an objective through Lightning for warm-up + measured steps, counts exactly the measured steps'
tokens, takes their peak memory, drafts losslessly with the trained drafter, and writes its table and JSON. The GPU
suite (tests/gpu) runs the same code with device="cuda" at real width."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.real_width import (
    OBJECTIVES,
    Result,
    Settings,
    aux_layers,
    context_layers,
    markdown_table,
    run_objective,
    target_info,
    write_json,
    write_text_data,
)

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = Settings(
    device="cpu", precision="32-true", target_dtype="float32", seq_len=32, batch_size=2, steps=2, warmup=1,
    profile="tiny",
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tiny_corpus, tmp_path_factory):
    """(target folder, text data): a random 4-layer Llama whose embedding has 8 rows past its tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("real_width")
    tok = AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok) + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    return out / "target", write_text_data(out / "text.jsonl", chars=30_000)


def test_target_info_and_the_layers_of_a_cut(tiny):
    target, _ = tiny
    layers, rows, unused = target_info(target)
    assert (layers, rows) == (4, unused + 8)  # the first row past the tokenizer
    assert aux_layers(4) == [1, 2, 3] and aux_layers(32) == [1, 16, 31] and aux_layers(2) == [0, 1, 2]
    assert context_layers(4) == [1, 2, 3] and context_layers(2) == [1] and context_layers(32) == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_kd_runs_counts_the_measured_tokens_and_drafts_losslessly(tiny, tmp_path):
    target, data = tiny
    result = run_objective("kd", target, data, SETTINGS, tmp_path, identity_dtype=torch.float64)
    assert result.status == "pass", result.reason
    assert result.greedy_identical is True
    # two measured steps of 2 x 32 tokens: tokens/s x s/step is one step's tokens
    assert result.tokens_per_s * result.step_s == pytest.approx(2 * 32)
    assert result.peak_mib > 0 and result.trainable_m > 0
    assert result.loss_first is not None and result.loss_last is not None


def test_a_run_that_would_not_fit_is_skipped_with_its_figures(tiny, tmp_path, monkeypatch):
    import tests.real_width as runner

    monkeypatch.setattr(runner, "available_gib", lambda: 0.5)
    result = run_objective("kd", tiny[0], tiny[1], SETTINGS, tmp_path, memory_check=True)
    assert result.status == "skip" and "GiB more for gradients and Adam states, 0.5 GiB available" in result.reason
    assert result.tokens_per_s is None


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in OBJECTIVES if n != "kd"])
def test_every_objective_runs_and_drafts_losslessly(name, tiny, tmp_path):
    target, data = tiny
    settings = replace(SETTINGS, steps=1)  # the code path of every objective and drafter kind, at the least cost
    result = run_objective(
        name, target, data, settings, tmp_path, identity_prompts=1, identity_tokens=12, identity_dtype=torch.float64
    )
    assert result.status == "pass", result.reason
    assert result.greedy_identical is True and result.tokens_per_s > 0


def test_table_and_json(tmp_path):
    rows = [
        Result(
            "eagle3",
            "pass",
            tokens_per_s=50.0,
            step_s=2.0,
            peak_mib=1000.0,
            trainable_m=400.0,
            loss_first=10.0,
            loss_last=9.5,
            greedy_identical=True,
        ),  # fmt: skip
        Result("kd", "pass", tokens_per_s=200.0, step_s=0.5, peak_mib=800.0, trainable_m=380.0),
        Result("layerskip", "skip", reason="trains | the whole target"),
        Result("dflash", "fail", reason="RuntimeError: boom"),
    ]
    table = markdown_table(rows).splitlines()
    assert table[0].startswith("| objective | status | tokens/s | vs kd |")
    assert len(table) == 2 + len(rows) and all(line.count("|") == table[0].count("|") for line in table)
    assert "| eagle3 | pass | 50 | 0.25 | 2.000 | 1,000 | 400.0 | 10.000 -> 9.500 | yes |" in table[2]
    assert "| layerskip | skip | - | - |" in table[4] and "trains / the whole target" in table[4]
    path = write_json(tmp_path / "r.json", rows, {"model": "m"}, [{"test": "t", "outcome": "passed"}])
    payload = json.loads(path.read_text())
    assert payload["meta"] == {"model": "m"} and payload["checks"][0]["outcome"] == "passed"
    assert [r["objective"] for r in payload["objectives"]] == ["eagle3", "kd", "layerskip", "dflash"]
    assert payload["objectives"][0]["tokens_per_s"] == 50.0
