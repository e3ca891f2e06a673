"""The training callback by context length (``SpeculativeEvalCallback(context_lengths=...)``): each length's logged
tau, acceptance, loop share and target loss equal an evaluation of that length's prompts alone; refusals name the
key."""

from __future__ import annotations

import random

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger

from tests.helpers import SpeculativeEvalModule
from trainer.decoding.callback import SpeculativeEvalCallback
from trainer.decoding.evaluate import evaluate_drafter
from trainer.interface.errors import DataError, UsageError
from trainer.training.registry import get_kind

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
LENGTHS = [16, 48]
NEW = 8
K = 3
DOCUMENT_TOKENS = (10, 30, 60, 90, 140)  # shorter than every bucket to longer than all


def documents() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in DOCUMENT_TOKENS]


class DraftModule(SpeculativeEvalModule):
    """A float64 target and student implementing the callback's protocol."""

    def __init__(self) -> None:
        super().__init__(VOCAB)


class Collect(Logger):
    """Every ``log_metrics`` call, kept."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "collect"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append((step, dict(metrics)))


def naive_buckets(max_prompts: int) -> dict[int, list[list[int]]]:
    """Each length's prompts by a loop: the first L tokens of every document holding L + NEW tokens."""
    out = {}
    for length in LENGTHS:
        kept = [doc[:length] for doc in documents() if len(doc) >= length + NEW]
        out[length] = kept[:max_prompts]
    return out


def naive_loss(target, prompts: list[list[int]]) -> float:
    """Mean next-token cross entropy over every prompt's tokens after its first, one token at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt in prompts:
            logits = target(input_ids=torch.tensor([prompt])).logits[0]  # [S, V]
            for t in range(len(prompt) - 1):
                total -= float(logits[t, prompt[t + 1]] - torch.logsumexp(logits[t], dim=0))
                count += 1
    return total / count


def test_each_lengths_values_equal_an_evaluation_of_its_prompts_alone() -> None:
    module = DraftModule()
    callback = SpeculativeEvalCallback(
        prompts=[[1, 2, 3], [4, 5, 6, 7]], k=K, max_new_tokens=NEW, max_prompts=2, temperature=1.0, seed=3,
        context_lengths=[48, 16, 48], documents=documents(),
    )  # fmt: skip
    values = callback.evaluate(module)
    expected = naive_buckets(2)
    assert callback.buckets == expected and len(expected[48]) < len(documents())  # short documents skipped
    target = module.target_model
    record = module.drafter_record()
    for length, prompts in expected.items():
        proposer = get_kind(record.kind, "test").proposer(module.student, record, target, callback.options)
        alone = evaluate_drafter(target, proposer, prompts, [K], NEW, 1.0, None, 3)
        greedy, sampled = alone["greedy"][0], alone["sampling"][0]
        assert greedy["identical"] and values[f"spec_eval/tau_ctx{length}"] == greedy["tau"]
        assert values[f"spec_eval/acceptance_rate_ctx{length}"] == greedy["acceptance_rate"]
        for d, rate in enumerate(greedy["acceptance_per_position"], 1):
            assert values[f"spec_eval/acceptance_ctx{length}_{d}"] == rate
        assert values[f"spec_eval/tau_sampling_ctx{length}"] == sampled["tau"]  # seeds by index within the length
        assert values[f"spec_eval/loop_share_ctx{length}"] == alone["loops"]["share"]
        assert values[f"spec_eval/near_ties_ctx{length}"] == 0.0
        assert values[f"spec_eval/target_loss_ctx{length}"] == pytest.approx(naive_loss(target, prompts), rel=1e-9)
    # the plain values on ``prompts`` stay as they were without context lengths
    plain = SpeculativeEvalCallback(prompts=[[1, 2, 3], [4, 5, 6, 7]], k=K, max_new_tokens=NEW, temperature=1.0, seed=3)
    without = plain.evaluate(module)
    assert {name: values[name] for name in without} == without
    assert not any("_ctx" in name for name in without)


def test_a_fit_logs_every_length_at_each_evaluation(tmp_path) -> None:
    """In a real fit the per-length values reach the trainer's loggers at the evaluated steps; ``documents`` None
    cuts the lengths from ``prompts``, read whole."""
    logger = Collect()
    callback = SpeculativeEvalCallback(
        prompts=documents(), prompt_tokens=6, k=2, max_new_tokens=NEW, every_n_steps=2, max_prompts=1,
        context_lengths=LENGTHS,
    )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=2, callbacks=[callback], logger=logger, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (4, 12)))
    trainer.fit(DraftModule(), torch.utils.data.DataLoader(data, batch_size=2))
    assert callback.buckets == naive_buckets(1) and callback.prompts == [doc[:6] for doc in documents()[:1]]
    (logged,) = [values for step, values in logger.logged if step == 2 and "spec_eval/tau" in values]
    for length in LENGTHS:
        assert logged[f"spec_eval/tau_ctx{length}"] == callback.last[f"spec_eval/tau_ctx{length}"]
        assert 1.0 <= logged[f"spec_eval/tau_ctx{length}"] <= 3.0


def test_refusals_name_the_key_and_value() -> None:
    module = DraftModule()  # 256 positions
    with pytest.raises(UsageError, match=r"context_lengths \[16, 0\]: give a non-empty list of lengths >= 1"):
        SpeculativeEvalCallback(prompts=[[1, 2]], context_lengths=[16, 0])
    with pytest.raises(UsageError, match=r"context_lengths \[\]"):
        SpeculativeEvalCallback(prompts=[[1, 2]], context_lengths=[])
    callback = SpeculativeEvalCallback(
        prompts=[[1, 2]], max_new_tokens=NEW, context_lengths=[16, 250], documents=documents()
    )
    with pytest.raises(UsageError) as err:
        callback.on_fit_start(None, module)
    assert str(err.value) == (
        "SpeculativeEvalCallback: context_lengths 250: longer than the 248 tokens the target's context "
        "(max_position_embeddings 256) leaves beside max_new_tokens 8"
    )
    longest = max(DOCUMENT_TOKENS)
    callback = SpeculativeEvalCallback(
        prompts=[[1, 2]], max_new_tokens=NEW, context_lengths=[longest - NEW + 1], documents=documents()
    )
    with pytest.raises(DataError, match=rf"context_lengths {longest - NEW + 1}: no document of the documents given"):
        callback.on_fit_start(None, module)
