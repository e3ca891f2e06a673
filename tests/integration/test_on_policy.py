"""On-policy distillation through the real CLI with recipes/quickstart/on_policy.yaml: steps, export, exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.recipe_runs import TINY_STUDENT, data_overrides, fit, merge, trainer_overrides

pytestmark = pytest.mark.slow

RECIPE = "quickstart/on_policy.yaml"


class RecordSteps(L.Callback):
    """Appends one line per training step to ``path``: the step, its loss and whether it was on-policy."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        metrics = trainer.callback_metrics
        record = {
            "step": trainer.global_step - 1,
            "loss": float(outputs["loss"]),
            "on_policy": float(metrics["train/on_policy"]),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def override(run: Path, corpus, target: Path, max_steps: int, every_n: int, callbacks=(), **model) -> dict:
    out = merge(
        trainer_overrides(run, max_steps=max_steps, every_n=every_n),
        data_overrides(corpus, seq_len=48, batch_size=4),
        {
            "model": {
                "init_args": {
                    "target": str(target),
                    "export_dir": str(run / "student"),
                    "drafter_config": TINY_STUDENT,
                    "loss_chunk_size": 64,
                    "max_new_tokens": 12,
                    "prompt_len": 12,
                    **model,
                }
            }
        },
    )
    record = {"class_path": "tests.integration.test_on_policy.RecordSteps", "init_args": {"path": str(run / "steps")}}
    out["trainer"]["callbacks"] += [record, *callbacks]
    return out


def steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "steps").read_text().splitlines()]


def test_fit_mixes_on_policy_and_data_steps_and_exports_an_hf_student(tiny_corpus, tiny_target, tmp_path):
    cli = fit(RECIPE, override(tmp_path, tiny_corpus, tiny_target, 8, 8, lmbda=0.5), tmp_path)
    records = steps(tmp_path)
    assert [r["step"] for r in records] == list(range(8))
    assert all(math.isfinite(r["loss"]) and r["loss"] >= 0 for r in records)
    # the coin of every step is the objective's deterministic coin, and both kinds of step occur
    expected = [float(cli.model.coin(s)) for s in range(8)]
    assert [r["on_policy"] for r in records] == expected
    assert 0 < sum(expected) < 8
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "student").eval()
    ids = torch.randint(0, student.config.vocab_size, (2, 10))
    torch.testing.assert_close(student(ids).logits, cli.model.student.eval()(ids).logits, rtol=0, atol=0)
    assert (tmp_path / "student" / "tokenizer.json").is_file()


def test_resume_repeats_the_same_steps_and_weights(tiny_corpus, tiny_target, tmp_path):
    straight = tmp_path / "straight"
    fit(RECIPE, override(straight, tiny_corpus, tiny_target, 6, 3, lmbda=0.5), straight)

    split = tmp_path / "split"
    stop = {"class_path": "tests.callbacks.StopAtStep", "init_args": {"step": 3}}
    fit(RECIPE, override(split, tiny_corpus, tiny_target, 6, 3, [stop], lmbda=0.5), split)
    fit(RECIPE, override(split, tiny_corpus, tiny_target, 6, 3, lmbda=0.5), split, ("--ckpt_path", "last"))

    a, b = steps(straight), steps(split)
    assert [r["step"] for r in b] == list(range(6))
    assert [r["on_policy"] for r in a] == [r["on_policy"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-4, abs_tol=1e-6)
    wa, wb = load_file(straight / "student" / "model.safetensors"), load_file(split / "student" / "model.safetensors")
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-6)
