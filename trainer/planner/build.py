"""Builds a recipe's objective on the meta device, through the method's own ``__init__``, to count what it trains and
what it holds frozen exactly: the count can never drift from the model.

The recipe's ``model.init_args`` are passed to the objective's class as ``draftsmith fit`` would pass them, with
``target`` pointing to a folder that holds only the target's ``config.json``. Nothing is read but configs (and the
tokenizers the recipe names, when they exist): under :func:`meta_loading`, ``AutoModelForCausalLM.from_pretrained``
builds the model from its config on the meta device (no weights, no memory), the embedding and lm_head a
``target_signals: shards`` objective reads are meta tensors of the config's shape, and frozen models are not
fingerprinted. A recipe whose ``model.init_from`` or ``model.drafter`` names a checkpoint or folder that does not exist
cannot be built: the planner says so (pass it, or drop init_from: the shape comes from the target's config).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from trainer.interface.errors import RecipeError, UserError
from trainer.planner.shapes import Counts


@contextlib.contextmanager
def meta_loading(device: str = "meta") -> Iterator[None]:
    """Model loading without weights: ``from_pretrained`` builds from the config on the meta device (or, for a
    measurement, with random weights on ``device``), the target's embedding and lm_head are empty tensors of their
    shape, frozen models get an empty fingerprint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import trainer.models.target as target_module
    import trainer.training.objective as objective_module

    def from_pretrained(path, *args, dtype=None, torch_dtype=None, trust_remote_code=False, **kwargs):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(
                config, dtype=dtype or torch_dtype, trust_remote_code=trust_remote_code
            )

    def target_tensors(path, names):
        config = AutoConfig.from_pretrained(path)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return {role: torch.empty(text.vocab_size, text.hidden_size, device=device) for role in names}

    with (
        mock.patch.object(AutoModelForCausalLM, "from_pretrained", from_pretrained),
        mock.patch.object(target_module, "load_target_tensors", target_tensors),
        mock.patch.object(objective_module, "fingerprint", lambda *args, **kwargs: {}),
        torch.device(device),
    ):
        yield


def objective_class(class_path: str) -> type:
    """The class a recipe's ``model.class_path`` names."""
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise RecipeError(f"draftsmith plan: model.class_path {class_path!r} cannot be imported ({err})") from err


def init_arguments(init_args: Any) -> dict[str, Any]:
    """``model.init_args`` as keyword arguments (nested dataclass arguments, ``optim``, built as fit builds them)."""
    from trainer.training.optimizers import Optim

    args = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args)
    if isinstance(args.get("optim"), dict):
        args["optim"] = Optim(**args["optim"])
    return args


def build_objective(
    class_path: str, init_args: Any, target_config: dict[str, Any] | None, device: str = "meta"
) -> nn.Module:
    """The recipe's objective built on the meta device (``device``: random weights there, for a measurement).

    Args:
        class_path: ``model.class_path``.
        init_args: ``model.init_args`` as parsed.
        target_config: the target's HF config as a dict, written beside no weights; None keeps the recipe's target
            (an objective without one, such as a fresh pretraining).

    Raises:
        UserError: the objective refuses the recipe (its own message), or a file it names is missing.
    """
    cls = objective_class(class_path)
    args = init_arguments(init_args)
    accepted = inspect.signature(cls.__init__).parameters
    with tempfile.TemporaryDirectory(prefix="draftsmith-plan-") as folder:
        if target_config is not None and "target" in accepted:
            (Path(folder) / "config.json").write_text(json.dumps(target_config))
            args["target"] = folder
            if "mask_token_id" in accepted and args.get("mask_token_id") is None:
                args["mask_token_id"] = 0  # chosen from the target's tokenizer in a run; any id sizes the same model
        with meta_loading(device):
            try:
                return cls(**args)
            except UserError as err:
                raise type(err)(f"draftsmith plan: {class_path.rsplit('.', 1)[-1]}: {err.message}", err.hint) from err


def _tensors(module: Any) -> Iterator[torch.Tensor]:
    if isinstance(module, nn.Module):
        yield from module.parameters()
        yield from module.buffers()
    elif hasattr(module, "tensors"):  # TargetEmbeddings
        yield from module.tensors()


def count(objective: nn.Module) -> Counts:
    """Trainable and frozen elements and bytes of a built objective (every tensor once, tied weights once)."""
    trainable = {id(p): p for p in objective.trainable_module().parameters() if p.requires_grad}
    in_tree: dict[int, torch.Tensor] = {}
    for tensor in _tensors(objective):
        if id(tensor) not in trainable:
            in_tree[id(tensor)] = tensor
    outside: dict[int, torch.Tensor] = {}
    held = list(getattr(objective, "_target", [])) + [v for v in vars(objective).values() if hasattr(v, "tensors")]
    for frozen in held:
        for tensor in _tensors(frozen):
            if id(tensor) not in trainable and id(tensor) not in in_tree:
                outside[id(tensor)] = tensor
    frozen = {**in_tree, **outside}
    layers = [m for m in objective.modules() if type(m).__name__.endswith("DecoderLayer")]
    for frozen_model in held:
        if isinstance(frozen_model, nn.Module):
            layers += [m for m in frozen_model.modules() if type(m).__name__.endswith("DecoderLayer")]

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    largest = max((nbytes(p for p in m.parameters() if id(p) not in trainable) for m in layers), default=0)
    return Counts(
        method=type(objective).__name__,
        trainable=sum(p.numel() for p in trainable.values()),
        trainable_bytes=nbytes(trainable.values()),
        frozen=sum(t.numel() for t in frozen.values()),
        frozen_bytes=nbytes(frozen.values()),
        frozen_in_tree=sum(t.numel() for t in in_tree.values()),
        frozen_in_tree_bytes=nbytes(in_tree.values()),
        largest_layer_bytes=largest,
    )
