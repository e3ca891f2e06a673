"""Muon for the hidden weight matrices and AdamW for everything else, as one torch optimizer.

Muon (Keller Jordan, 2024; ``torch.optim.Muon``) orthogonalises each matrix's momentum update with a few Newton-Schulz
iterations. It applies to 2-D hidden matrices only: vectors (norms, biases), vocabulary matrices (embeddings, output
heads) and degenerate ``[1, N]`` matrices stay with AdamW, the split speculators 0.9 (whose trainer defaults to Muon)
and Muon's authors use. Lightning's automatic optimisation steps one optimizer, so :class:`MuonWithAdamW` holds both
and shares one ``param_groups`` list (a learning-rate scheduler scales every group) and one ``state`` (one
``state_dict`` for checkpoints and resume).

DeepSpeed flattens the parameters into 1-D partitions, which Muon cannot orthogonalise: ``optim.name: muon`` is
refused there (:func:`trainer.training.optimizers.muon_optimizer`).
"""

from __future__ import annotations

import torch
from torch import nn

ADAMW_NAME_HINTS = ("embed", "lm_head", "head.weight", "codebook", "mask_hidden")
"""Parameter names (substrings) kept with AdamW although 2-D: vocabulary matrices and learned placeholders."""


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates ``param``: a 2-D matrix with both sides above 1 that is not a vocabulary matrix."""
    return param.ndim == 2 and min(param.shape) > 1 and not any(hint in name for hint in ADAMW_NAME_HINTS)


def split_for_muon(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """The trained parameters of ``module`` as (Muon matrices, AdamW matrices, AdamW vectors)."""
    muon, matrices, vectors = [], [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if is_muon_matrix(name, param):
            muon.append(param)
        elif param.ndim >= 2:
            matrices.append(param)
        else:
            vectors.append(param)
    return muon, matrices, vectors


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the groups marked ``muon`` and ``torch.optim.AdamW`` over the others, stepped together.

    Every group dict lives in this optimizer's ``param_groups`` and in its inner optimizer's (the same objects), and
    both inner optimizers read and write this optimizer's ``state``, so schedulers, ``state_dict`` and
    ``load_state_dict`` see one optimizer.
    """

    def __init__(
        self,
        muon_groups: list[dict],
        adamw_groups: list[dict],
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        ns_steps: int = 5,
    ) -> None:
        """
        Args:
            muon_groups: parameter groups (``params``, ``lr``, ``weight_decay``) of 2-D hidden matrices.
            adamw_groups: parameter groups of every other trained parameter.
            betas: AdamW's (beta1, beta2).
            eps: AdamW's epsilon.
            momentum: Muon's (Nesterov) momentum.
            ns_steps: Muon's Newton-Schulz iterations.
        """
        if not muon_groups or not adamw_groups:
            raise ValueError("MuonWithAdamW needs Muon groups and AdamW groups; use torch.optim.AdamW alone otherwise")
        # Muon's update scaled to AdamW's RMS, so that one learning rate serves both groups
        self._muon = torch.optim.Muon(muon_groups, momentum=momentum, ns_steps=ns_steps, adjust_lr_fn="match_rms_adamw")
        self._adamw = torch.optim.AdamW(adamw_groups, betas=betas, eps=eps)
        for group in self._muon.param_groups:
            group["muon"] = True
        for group in self._adamw.param_groups:
            group["muon"] = False
        super().__init__(self._muon.param_groups + self._adamw.param_groups, defaults={})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after ``load_state_dict``)."""
        self._muon.param_groups = [g for g in self.param_groups if g["muon"]]
        self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self._muon.state = self.state
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        self._adamw.step()
        return loss
