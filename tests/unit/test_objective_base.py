"""What the base objective does for every objective: a target kept out of the module tree follows the module's moves
(never its casts), and ``setup`` checks the trainer's data against the objective's ``data_requirements()``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.recipe_runs import save_random_target
from trainer.errors import TokenizerError
from trainer.objective import DataRequirements, DraftObjective


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
