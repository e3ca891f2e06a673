"""Fast checks of trainer/distributed/strategies.py and the recipes/_base fragments (the 2-process runs are in
integration/)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from lightning.pytorch.strategies import DDPStrategy, Strategy
from transformers import LlamaConfig, LlamaForCausalLM

from tests._multiproc import free_port
from trainer.distributed.strategies import (
    CPUDeepSpeedStrategy,
    FSDP2Strategy,
    deepspeed_offload_enabled,
    full_state_dict,
    shard_for_fsdp2,
)

BASE = Path(__file__).resolve().parents[2] / "recipes" / "_base"


def _strategy_from_yaml(path: Path) -> Strategy | str:
    spec = yaml.safe_load(path.read_text())["trainer"]["strategy"]
    if isinstance(spec, str):
        return spec
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


@pytest.mark.parametrize("path", sorted(BASE.glob("*.yaml")), ids=lambda p: p.name)
def test_base_fragment_opens_with_its_command_and_builds_its_strategy(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# draftsmith fit --config ") and f"--config recipes/_base/{path.name}" in first
    config = yaml.safe_load(path.read_text())
    assert set(config) == {"trainer"}, f"{path.name}: a _base fragment sets trainer keys only"
    strategy = _strategy_from_yaml(path)
    if "deepspeed" in path.name:
        assert isinstance(strategy, CPUDeepSpeedStrategy)
        stage = int(path.stem.split("zero")[1][0])
        assert strategy.config["zero_optimization"]["stage"] == stage
        assert deepspeed_offload_enabled(strategy) == ("offload" in path.name)
    elif path.name == "fsdp.yaml":
        assert isinstance(strategy, FSDP2Strategy)


def test_offload_detection() -> None:
    assert deepspeed_offload_enabled(CPUDeepSpeedStrategy(stage=3, offload_optimizer=True))
    assert not deepspeed_offload_enabled(CPUDeepSpeedStrategy(stage=3, offload_parameters=True))
    assert not deepspeed_offload_enabled(CPUDeepSpeedStrategy(stage=2))
    assert not deepspeed_offload_enabled(DDPStrategy())


def test_fsdp2_strategy_rejects_bad_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        FSDP2Strategy(tensor_parallel_size=0)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tp"))
    finally:
        dist.destroy_process_group()


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def test_shard_for_fsdp2_shards_decoder_layers_and_root(one_rank_group) -> None:
    from torch.distributed.fsdp import FSDPModule

    model = _tiny_llama()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 64, (2, 8))  # [B, S]
    expected = model(ids).logits  # [B, S, V]

    assert shard_for_fsdp2(model, one_rank_group) is model
    assert isinstance(model, FSDPModule)
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    assert sharded == list(model.model.layers)  # the decoder layers, nothing else
    assert shard_for_fsdp2(model, one_rank_group) is model  # idempotent: configure_model may run twice
    torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)

    full = full_state_dict(model)
    assert full.keys() == reference.keys()
    for k in reference:
        assert torch.equal(full[k], reference[k]), k


def test_shard_for_fsdp2_refuses_a_frozen_module(one_rank_group) -> None:
    model = _tiny_llama().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        shard_for_fsdp2(model, one_rank_group)


def test_shard_for_fsdp2_skips_frozen_layers(one_rank_group) -> None:
    from torch.distributed.fsdp import FSDPModule

    model = _tiny_llama()
    model.model.layers[0].requires_grad_(False)
    shard_for_fsdp2(model, one_rank_group)
    assert not isinstance(model.model.layers[0], FSDPModule)
    assert isinstance(model.model.layers[1], FSDPModule)
