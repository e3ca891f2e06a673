"""The seam of DFlash's block refiners: the DFlash backbone with a pluggable head that refines a drafted block.

A block refiner is a method of its own folder, ``trainer/methods/<refiner>/``, whose parent is DFlash: it imports
this package and subclasses its parts, overriding the hooks below; DFlash itself has no refiner (every hook is
neutral here), and nothing in this package names a refiner.

- config and module (module.py): a :class:`~trainer.methods.dflash.module.DFlashConfig` subclass adds the refiner's
  fields; a :class:`~trainer.methods.dflash.module.DFlashDrafter` subclass builds its heads after the backbone and
  names them in ``refiner_modules`` (their weights keep the refiner's own names beside the backbone's).
- loss terms (objective.py): the :class:`~trainer.methods.dflash.objective.DFlash` subclass names its drafter
  (``drafter_class``, ``drafter_config``) and may give each slot a low-rank logit bias (``slot_bias``, a
  :class:`LogitBias`: the slot loss takes its gradients in forward, slot_loss.py), or read whole blocks for it and
  weigh several slot losses of the step (``slot_terms``, :class:`SlotTerm`), ask for the slots' analytical
  acceptance rates (``wants_acceptance``) and add loss terms and metrics of the trained slots (``refiner_loss``).
  Its drafter record names its own drafter kind (``drafter_record``).
- proposer step (proposer.py): a :class:`~trainer.methods.dflash.proposer.DFlashProposer` subclass gives a slot's
  logits given the token drafted before it (``conditioned``, ``slot_logits``: chains and DDTrees then resolve the
  block left to right) and drafts a chain with its predicted acceptance (``draft_chain``); the DDTree takes the same
  hooks (``DFlashTreeProposer`` after the subclass in the bases).
- export (kind.py, export.py): the refiner's kind registers its format through the speculators writer and reader
  with its model type, architectures and config fields (``save_speculators``, ``load_speculators``), and the
  backbone's proposer factory with its proposer classes (``proposer_factory``). The z-lab and plain speculators
  writers refuse a drafter with a refiner's modules: their readers would not load them.

``model.init_from`` carries a drafter's backbone into a run of another refiner, or of none (:func:`refit`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter

log = logging.getLogger(__name__)


@dataclass
class LogitBias:
    """A low-rank bias of n slots' logits, ``features @ weight.T`` [n, V], differentiable in both (e.g. a first-order
    bias from the token before each slot's: ``features`` an embedding of that token).

    Attributes:
        features: [n, r] each slot's features.
        weight: [V, r] their map onto the vocabulary.
    """

    features: torch.Tensor
    weight: torch.Tensor


@dataclass
class SlotTerm:
    """One slot loss of a step's trained slots against the objective's labels, with its own logit bias; a step's loss
    is the sum of its terms' losses times their scales.

    Attributes:
        bias: the trained slots' logit bias, or None (the lm_head's logits alone).
        scale: the term's factor in the step's loss.
        name: logged as ``loss_<name>``, the term's own (unscaled) loss; empty: not logged.
        uniform: the trained slots weigh the same (the loss is their mean) instead of the objective's position
            weights (a term after the first: the main term keeps the position weights).
    """

    bias: LogitBias | None
    scale: float = 1.0
    name: str = ""
    uniform: bool = False


def backbone_config(config: DFlashConfig) -> DFlashConfig:
    """The DFlash fields of a (refiner's) drafter config, as a plain :class:`DFlashConfig`."""
    return DFlashConfig(**{f.name: getattr(config, f.name) for f in fields(DFlashConfig)})


def refit(drafter: DFlashDrafter, cls: type[DFlashDrafter], config: DFlashConfig, init_from: str) -> DFlashDrafter:
    """The drafter of ``init_from`` as a ``cls`` of ``config`` (a refiner's, or DFlash's): unchanged when it is one
    already, else a new drafter in its dtype with the backbone's weights copied, a refiner weight of the same name and
    shape kept, new or reshaped ones from their initialisation, and those ``cls`` has no place for dropped (warned).

    Args:
        drafter: the drafter read from ``init_from``.
        cls: the run's drafter class.
        config: the run's drafter config (the backbone's fields those of ``drafter``).
        init_from: the checkpoint or export, named in messages.
    """
    if type(drafter) is cls and drafter.config == config:
        return drafter
    rebuilt = cls(config).to(drafter.fc.weight.dtype)
    fresh = rebuilt.state_dict()

    def refiners(name: str) -> bool:
        return type(drafter).is_refiner_weight(name) or cls.is_refiner_weight(name)

    old = drafter.state_dict()
    kept = {k: v for k, v in old.items() if not refiners(k) or (k in fresh and fresh[k].shape == v.shape)}
    missing, _ = rebuilt.load_state_dict(kept, strict=False)
    stray = [k for k in missing if not refiners(k)]
    if stray:  # cannot happen for a drafter of the same backbone: a bug, not a user error
        raise RuntimeError(f"model.init_from {init_from!r}: weights {stray} do not carry over")
    dropped = sorted(k for k in old if k not in kept or k not in fresh)
    if dropped:
        log.warning("model.init_from %s: weights %s not carried over (the run's %s has none of their name and shape)",
                    init_from, dropped, cls.__name__)  # fmt: skip
    log.info("model.init_from %s: a %s of %s (weights %s start untrained)", init_from, cls.__name__, config, missing)
    return rebuilt
