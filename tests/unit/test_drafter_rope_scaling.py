"""Drafters use the target's rotary scaling (llama3, yarn): each drafter built from a target as its objective builds it
has the target's own rotary cos/sin at every position of the target's length, and its exports, reloaded by our
loader, keep the same rotary parameters, written as ``rope_parameters`` or, as transformers 4 wrote them, as
``rope_theta`` and ``rope_scaling``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from trainer.methods.dflash import export as dflash_export
from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.eagle3 import export as eagle3_export
from trainer.methods.eagle3.module import Eagle3Config, Eagle3Drafter
from trainer.methods.eagle3.vocab_map import build_vocab_map
from trainer.methods.mtp.module import MTPConfig, MTPModules
from trainer.methods.peagle import export as peagle_export
from trainer.methods.peagle.module import PEagleConfig, PEagleDrafter
from trainer.training.registry import load_drafter

LENGTH = 512  # the target's max_position_embeddings: 8x the 64 positions its rotary scaling was trained at
ROPES = {
    "llama3": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 16.0, "beta_slow": 2.0,
    },
}  # fmt: skip
VOCAB, DRAFT_VOCAB, MASK = 50, 20, 49


def target_config(rope: dict) -> LlamaConfig:
    """A tiny Llama target (head_dim 8) with the rotary parameters ``rope``."""
    return LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=LENGTH, rope_parameters=dict(rope),
    )  # fmt: skip


def cos_sin(rope_of, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, LENGTH, head_dim] of a rotary callable ``(x, positions) -> (cos, sin)`` at positions 0..511."""
    x = torch.zeros(1, 1, head_dim)  # only its dtype and device are read
    return rope_of(x, torch.arange(LENGTH)[None])


def target_cos_sin(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own rotary embedding at positions 0..511."""
    return cos_sin(LlamaRotaryEmbedding(config), config.head_dim)


def eagle3(config: LlamaConfig) -> Eagle3Drafter:
    """EAGLE-3's drafter as its objective builds it (``Eagle3Config.from_target``), with a vocabulary map."""
    drafter = Eagle3Drafter(Eagle3Config.from_target(config, DRAFT_VOCAB))
    drafter.set_vocab_map(*build_vocab_map(torch.arange(VOCAB), DRAFT_VOCAB))
    return drafter


def peagle(config: LlamaConfig) -> PEagleDrafter:
    """P-EAGLE's drafter as its objective builds it (EAGLE-3's config with a placeholder token and two layers)."""
    base = Eagle3Config.from_target(config, DRAFT_VOCAB)
    drafter = PEagleDrafter(PEagleConfig(**base.to_dict(), mask_token_id=MASK, num_layers=2))
    drafter.set_vocab_map(*build_vocab_map(torch.arange(VOCAB), DRAFT_VOCAB))
    return drafter


def dflash(config: LlamaConfig) -> DFlashDrafter:
    """DFlash's drafter as its objective builds it (``DFlashConfig.from_target``)."""
    return DFlashDrafter(DFlashConfig.from_target(config, 1, [1, 3], 4, MASK))


def mtp(config: LlamaConfig) -> MTPModules:
    """The sequential MTP modules of the target as trunk (the trunk family's rotary embedding)."""
    return MTPModules(MTPConfig.for_trunk(config, 2))


BUILDERS = {"eagle3": eagle3, "peagle": peagle, "dflash": dflash, "mtp": mtp}


def drafter_rope(drafter: nn.Module):
    """The drafter's rotary callable ``(x, positions) -> (cos, sin)``."""
    return drafter.rotary if isinstance(drafter, MTPModules) else drafter.rope


@pytest.mark.parametrize("scaling", sorted(ROPES))
def test_the_scaling_changes_positions_past_the_training_length(scaling):
    """The reference is worth comparing against: the scaled rotary embedding differs from the unscaled one."""
    scaled = target_cos_sin(target_config(ROPES[scaling]))[0]
    plain = target_cos_sin(target_config({"rope_type": "default", "rope_theta": 10000.0}))[0]
    assert not torch.allclose(scaled[:, 64:], plain[:, 64:], atol=1e-3)


@pytest.mark.parametrize("method", sorted(BUILDERS))
@pytest.mark.parametrize("scaling", sorted(ROPES))
def test_drafter_has_the_targets_rotary_embedding(scaling, method):
    config = target_config(ROPES[scaling])
    drafter = BUILDERS[method](config)
    head_dim = config.head_dim
    if method != "mtp":  # the MTP blocks are the trunk's own decoder layers, on the trunk's config
        assert drafter.config.head_dim == head_dim
    cos, sin = cos_sin(drafter_rope(drafter), head_dim)
    want_cos, want_sin = target_cos_sin(config)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=0)


def export(fmt: str, drafter: nn.Module, out: Path) -> Path:
    """Write ``drafter`` in format ``fmt``."""
    if fmt == "eagle3-speculators":
        embedding = torch.zeros(VOCAB, drafter.config.hidden_size)
        return eagle3_export.save_speculators(drafter, str(out), "tiny-target", embedding, 3)
    if fmt == "eagle3-native":
        return eagle3_export.save_native(drafter, str(out))
    if fmt == "peagle":
        return peagle_export.save_peagle(drafter, str(out), "tiny-target", 3)
    if fmt == "dflash-speculators":
        return dflash_export.save_speculators(drafter, str(out), "tiny-target")
    return dflash_export.save_zlab(drafter, str(out))


FORMATS = {
    "eagle3-speculators": eagle3,
    "eagle3-native": eagle3,
    "peagle": peagle,
    "dflash-speculators": dflash,
    "dflash-zlab": dflash,
}


def layer_keys(config: dict) -> dict:
    """The part of an export's config.json that holds the draft layers' keys."""
    return config.get("transformer_layer_config", config)


def reload_matches(folder: Path, config: LlamaConfig, rope: dict) -> None:
    """The drafter our loader reads from ``folder`` has rotary parameters ``rope`` and the target's cos/sin."""
    drafter, _ = load_drafter(str(folder))
    assert drafter.config.rope_parameters == rope
    cos, sin = cos_sin(drafter.rope, config.head_dim)
    want_cos, want_sin = target_cos_sin(config)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("scaling", sorted(ROPES))
def test_export_keeps_the_rotary_parameters(tmp_path, scaling, fmt):
    config = target_config(ROPES[scaling])
    drafter = FORMATS[fmt](config)
    folder = export(fmt, drafter, tmp_path / fmt)
    written = layer_keys(json.loads((folder / "config.json").read_text()))
    assert written["rope_parameters"] == written["rope_scaling"] == drafter.config.rope_parameters
    assert written["rope_theta"] == ROPES[scaling]["rope_theta"]
    reload_matches(folder, config, drafter.config.rope_parameters)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("scaling", sorted(ROPES))
def test_transformers_4_rotary_keys_are_read(tmp_path, scaling, fmt):
    """A file without ``rope_parameters`` (transformers 4's ``rope_theta`` and ``rope_scaling``, the scaling type
    under its older key ``type``) reloads with the same rotary parameters."""
    config = target_config(ROPES[scaling])
    drafter = FORMATS[fmt](config)
    folder = export(fmt, drafter, tmp_path / fmt)
    top = json.loads((folder / "config.json").read_text())
    keys = layer_keys(top)
    del keys["rope_parameters"]
    scaling_keys = {k: v for k, v in keys["rope_scaling"].items() if k != "rope_theta"}
    keys["rope_scaling"] = {"type": scaling_keys.pop("rope_type"), **scaling_keys}
    (folder / "config.json").write_text(json.dumps(top))
    reload_matches(folder, config, drafter.config.rope_parameters)
