"""``optim.name: muon`` (trainer/training/muon.py): the parameter split, one optimizer that steps exactly as torch's
Muon and AdamW side by side, a scheduler that reaches both, and a state_dict that resumes to the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainer.training.muon import MuonWithAdamW, split_for_muon


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 8)
        self.fc = nn.Linear(16, 8, bias=True)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        self.gate = nn.Linear(8, 1, bias=False)  # a degenerate [1, 8] matrix

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)  # [B, S, H]
        h = self.norm(self.fc(torch.cat([x, x], dim=-1)))  # [B, S, H]
        return self.lm_head(h) + self.gate(h)  # [B, S, V]


def loss_of(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (2, 5), generator=g)
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), torch.randint(0, 32, (10,), generator=g))


def composite(model: nn.Module) -> MuonWithAdamW:
    muon, matrices, vectors = split_for_muon(model)
    return MuonWithAdamW(
        [{"params": muon, "lr": 0.02, "weight_decay": 0.1}],
        [{"params": matrices, "lr": 0.02, "weight_decay": 0.1}, {"params": vectors, "lr": 0.02, "weight_decay": 0.0}],
    )


def test_hidden_matrices_go_to_muon_and_the_rest_to_adamw():
    model = Tiny()
    muon, matrices, vectors = split_for_muon(model)
    assert [p is model.fc.weight for p in muon] == [True]
    assert {id(p) for p in matrices} == {id(model.embed_tokens.weight), id(model.lm_head.weight), id(model.gate.weight)}
    assert {id(p) for p in vectors} == {id(model.fc.bias), id(model.norm.weight), id(model.norm.bias)}


def test_one_step_is_torchs_muon_and_adamw_side_by_side():
    torch.manual_seed(0)
    ours, reference = Tiny(), Tiny()
    reference.load_state_dict(ours.state_dict())
    optimizer = composite(ours)
    muon, matrices, vectors = split_for_muon(reference)
    muon_ref = torch.optim.Muon(
        [{"params": muon, "lr": 0.02, "weight_decay": 0.1}], momentum=0.95, adjust_lr_fn="match_rms_adamw"
    )
    adamw_ref = torch.optim.AdamW(
        [{"params": matrices, "lr": 0.02, "weight_decay": 0.1}, {"params": vectors, "lr": 0.02, "weight_decay": 0.0}],
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for seed in range(3):
        for model, steps in ((ours, [optimizer]), (reference, [muon_ref, adamw_ref])):
            loss_of(model, seed).backward()
            for opt in steps:
                opt.step()
                opt.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert all(not torch.equal(a, b) for a, b in zip(ours.parameters(), Tiny().parameters(), strict=True))


def test_a_scheduler_scales_both_optimizers():
    model = Tiny()
    optimizer = composite(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert scheduler.get_last_lr() == [0.01, 0.01, 0.01]
    assert optimizer._muon.param_groups[0]["lr"] == optimizer._adamw.param_groups[1]["lr"] == 0.01


def test_state_dict_resumes_to_the_same_weights():
    torch.manual_seed(1)
    model = Tiny()
    optimizer = composite(model)
    for seed in range(2):
        loss_of(model, seed).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert len(saved_optimizer["state"]) == sum(1 for _ in model.parameters())  # Muon's momentum and AdamW's moments

    resumed = Tiny()
    resumed.load_state_dict(saved_model)
    resumed_optimizer = composite(resumed)
    resumed_optimizer.load_state_dict(saved_optimizer)
    for m, opt in ((model, optimizer), (resumed, resumed_optimizer)):
        loss_of(m, 7).backward()
        opt.step()
    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_groups_of_one_kind_only_are_refused():
    with pytest.raises(ValueError, match="AdamW alone"):
        MuonWithAdamW([], [{"params": [nn.Parameter(torch.zeros(2))], "lr": 0.1}])


def test_an_objective_builds_it_and_deepspeed_refuses_it():
    from types import SimpleNamespace

    from trainer.distributed.strategies import CPUDeepSpeedStrategy
    from trainer.interface.errors import RecipeError
    from trainer.training.objective import DraftObjective
    from trainer.training.optimizers import Optim

    class Objective(DraftObjective):
        def __init__(self) -> None:
            super().__init__(Optim(name="muon", lr=0.01))
            self.model = Tiny()

        def trainable_module(self) -> nn.Module:
            return self.model

    def trainer(strategy: object) -> SimpleNamespace:
        return SimpleNamespace(strategy=strategy, precision="32-true", max_steps=10)

    objective = Objective()
    objective._trainer = trainer(object())
    optimizer = objective.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, MuonWithAdamW) and [g["lr"] for g in optimizer.param_groups] == [0.01] * 3
    objective._trainer = trainer(object.__new__(CPUDeepSpeedStrategy))  # a DeepSpeedStrategy
    with pytest.raises(RecipeError, match="optim.name: muon cannot run under DeepSpeed"):
        objective.configure_optimizers()
