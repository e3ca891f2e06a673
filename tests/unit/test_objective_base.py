"""What the base objective does for every objective: a target kept out of the module tree follows the module's moves
(never its casts), and ``setup`` checks the trainer's data against the objective's ``data_requirements()``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.recipe_runs import save_random_target
from trainer.interface.errors import TokenizerError
from trainer.training.objective import DataRequirements, DraftObjective


class Probe(DraftObjective):
    """A head beside a target loaded online, out of the module tree."""

    def __init__(self, target: str) -> None:
        """
        Args:
            target: the target.
        """
        super().__init__()
        self.load_target(target)
        self.head = nn.Linear(4, 4)

    def trainable_module(self) -> nn.Module:
        return self.head

    def data_requirements(self) -> DataRequirements:
        return DataRequirements(self.target.vocab_size, name="the probe's target")


@pytest.fixture
def probe(tiny_corpus, tmp_path) -> Probe:
    return Probe(str(save_random_target(tmp_path / "target", tiny_corpus.tokenizer_dir)))


def test_the_target_follows_the_modules_moves_not_its_casts(probe):
    assert "frozen_target" not in probe._modules  # out of the tree: in no state dict, cast by nothing
    assert not any(name.startswith("_target") for name, _ in probe.named_parameters())
    probe.double()
    assert probe.head.weight.dtype == torch.float64
    assert probe.target.lm_head_weight.dtype == torch.float32 and probe.target.lm_head_weight.device.type == "cpu"
    probe.to("meta")  # a move (to the one other device every machine has): the target goes with the module
    assert probe.head.weight.device.type == "meta" and probe.target.lm_head_weight.device.type == "meta"
    assert probe.target.lm_head_weight.dtype == torch.float32


def test_setup_checks_the_data_against_the_objectives_requirements(probe, tmp_path, monkeypatch):
    other = tmp_path / "other_tokenizer"
    probe.tokenizer.add_tokens(["<one-more>"])  # a tokenizer the data was not made with
    probe.tokenizer.save_pretrained(other)
    probe.tokenizer = type(probe.tokenizer).from_pretrained(probe.target_path)
    data = SimpleNamespace(tokenizer_path=str(other), seq_len=16)
    monkeypatch.setattr(probe, "attached_datamodule", lambda: data)
    with pytest.raises(TokenizerError, match="vocabulary mismatch: the data's tokenizer .*other_tokenizer"):
        probe.setup("fit")
    data.tokenizer_path = probe.target_path  # the target's own tokenizer: accepted
    probe.setup("fit")


def test_an_objective_that_states_no_data_requirements_is_named():
    class Bare(DraftObjective):
        def trainable_module(self) -> nn.Module:
            return nn.Linear(1, 1)

    with pytest.raises(NotImplementedError, match="Bare does not say what its data must match"):
        Bare().setup("fit")


class Clocked(Probe):
    """A probe whose steps take 1 s of a fake clock, or 5 s on the steps whose metrics are written (as a metric that
    costs compute of its own makes them: DraftObjective.metrics_due)."""

    def __init__(self, target: str, clock: list[float]) -> None:
        """
        Args:
            target: the target.
            clock: the fake clock's time, a one-element list the test's perf_counter reads.
        """
        super().__init__(target)
        self.clock, self.due = clock, []

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        due = self.metrics_due()
        self.due.append(due)
        self.clock[0] += 5.0 if due else 1.0
        x = batch["input_ids"].float()[:, :4]  # [B, 4]
        return self.head(x).pow(2).mean(), {}


def test_tokens_per_s_is_the_rate_over_the_steps_since_the_last_written_value(tiny_corpus, tmp_path, monkeypatch):
    """train/tokens_per_s is written every log_every_n_steps as the tokens of the steps since the last written value
    over their step time, not the written step's own rate: metrics_due is True on exactly the written steps, which a
    costly metric makes slower than the others."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    import trainer.training.objective as objective_module

    clock = [100.0]
    monkeypatch.setattr(objective_module.time, "perf_counter", lambda: clock[0])
    probe = Clocked(str(save_random_target(tmp_path / "target", tiny_corpus.tokenizer_dir)), clock)
    monkeypatch.setattr(objective_module, "measure_matmul_peak", lambda *_: None)
    B, S = 2, 8
    rows = [{"input_ids": torch.full((S,), i), "loss_mask": torch.ones(S, dtype=torch.bool)} for i in range(12)]
    loader = torch.utils.data.DataLoader(rows, batch_size=B)
    logger = CSVLogger(str(tmp_path), name="log")
    trainer = pl.Trainer(max_steps=6, log_every_n_steps=3, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(probe, loader)
    assert probe.due == [False, False, True, False, False, True]
    lines = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    written = [dict(zip(header, line.split(","), strict=True)) for line in lines[1:]]
    rates = {int(row["step"]): float(row["train/tokens_per_s"]) for row in written if row.get("train/tokens_per_s")}
    assert rates == {2: pytest.approx(3 * B * S / 7.0), 5: pytest.approx(3 * B * S / 7.0)}
