"""Distributed strategies that run the same recipe on a CPU laptop and on CUDA nodes.

Recipes pick a strategy with one of the ``recipes/_base/*.yaml`` fragments. What runs on CPU (``accelerator: cpu``,
several processes over gloo; lightning 2.6.6, deepspeed 0.19.8, torch 2.13), each tested in 2 processes with
training, checkpointing and resuming (tests/integration/test_strategies.py):

* ``ddp.yaml``: Lightning's ``ddp``.
* ``fsdp.yaml``: :class:`FSDP2Strategy` (FSDP2 ``fully_shard``), sharded checkpoints (one file per rank).
* ``deepspeed_zero{1,2,3}.yaml``: :class:`CPUDeepSpeedStrategy`; checkpoint folders that
  ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` merges into one fp32 file.
* ``deepspeed_zero{2,3}_offload.yaml``: :class:`CPUDeepSpeedStrategy` with optimizer (and for ZeRO-3 parameter)
  offload, when the objective's optimizer is DeepSpeedCPUAdam.

What does not work on CPU, with the exact errors:

* Lightning's ``strategy: fsdp`` (FSDP1) refuses a CPU accelerator when the Trainer is built::

      ValueError: The strategy `fsdp` requires a GPU accelerator, but received `accelerator='cpu'`. Please set
      `accelerator='cuda'`, `accelerator='gpu'`, or pass a `CUDAAccelerator()` instance to use FSDP.

  and FSDP1 forced onto CPU (an ``FSDPStrategy`` subclass skips that check) fails in torch's FSDP constructor::

      RuntimeError: FSDP needs a non-CPU accelerator device, but no accelerator device is detected.

  FSDP runs on CPU through :class:`FSDP2Strategy` instead (Lightning's ``ModelParallelStrategy``,
  ``fully_shard``); the LightningModule shards its trainable part in ``configure_model`` with
  :func:`shard_for_fsdp2`.
* Lightning's own ``strategy: deepspeed_stage_2`` (and every registered ``deepspeed*`` name) refuses a CPU
  accelerator in ``setup_environment``::

      RuntimeError: The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used.

  :class:`CPUDeepSpeedStrategy` lifts this. It changes nothing on CUDA (every override defers to Lightning when the
  accelerator is a GPU), so GPU recipes use it too, and one ``--config recipes/_base/deepspeed_zero2.yaml`` serves
  both kinds of machine under the Trainer's default ``accelerator: auto``.
* ZeRO offload (``offload_optimizer: true``) with a client ``torch.optim`` optimizer, at ``deepspeed.initialize``::

      deepspeed.runtime.zero.utils.ZeRORuntimeException: You are using ZeRO-Offload with a client provided
      optimizer (<class 'torch.optim.adam.Adam'>) which in most cases will yield poor performance. Please either use
      deepspeed.ops.adam.DeepSpeedCPUAdam or set an optimizer in your ds-config [...]

  Objectives return ``deepspeed.ops.adam.DeepSpeedCPUAdam`` when :func:`deepspeed_offload_enabled` is true.

DeepSpeed on CPU compiles two C++ extensions on first use (its shared-memory collective at the first distributed
init, about a minute; ``cpu_adam`` for offload, about two): point ``TORCH_EXTENSIONS_DIR`` at a persistent folder
(the Makefile does) so that this happens once per machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, Strategy
from torch import nn
from torch.distributed.constants import default_pg_timeout

from trainer.checkpoints.sharded import partial_folder, read_marker, save_folder_atomically

log = logging.getLogger(__name__)

__all__ = [
    "CPUDeepSpeedStrategy",
    "FSDP2Strategy",
    "deepspeed_offload_enabled",
    "full_state_dict",
    "shard_for_fsdp2",
]


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy that also runs on CPU processes (gloo); unchanged on CUDA.

    Takes every argument of :class:`lightning.pytorch.strategies.DeepSpeedStrategy` (``stage``,
    ``offload_optimizer``, ``offload_parameters``, ``config``, ...): this subclass adds none. On a CPU accelerator it
    initialises the process group as DDP does (gloo, no device index checks) and passes the local rank to
    ``deepspeed.initialize``, which otherwise receives ``None`` for a CPU device. Checkpoints exclude frozen
    parameters (``exclude_frozen_parameters``), on CPU and CUDA alike.
    """

    def _on_cuda(self) -> bool:
        return isinstance(self.accelerator, CUDAAccelerator)

    def setup_environment(self) -> None:
        if self._on_cuda():
            super().setup_environment()
            return
        if not isinstance(self.accelerator, CPUAccelerator):
            raise RuntimeError(
                f"CPUDeepSpeedStrategy runs on CUDA or CPU accelerators, got {type(self.accelerator).__name__}; "
                "set trainer.accelerator to cuda or cpu"
            )
        _check_deepspeed_accelerator_is_cpu()
        # DDPStrategy.setup_environment: the accelerator's device setup, then self.setup_distributed().
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if self._on_cuda():
            super().setup_distributed()
            return
        # DeepSpeedStrategy validates CUDA device indices here; CPU devices carry none.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, torch.optim.Optimizer]:
        if self._on_cuda():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _auto_select_batch_size(self) -> int:
        """The micro-batch DeepSpeed's throughput logs count: the datamodule's ``batch_size``. Lightning's own choice
        reads the training loader's batch sampler, which a loader of ready-made batches (ShardDataModule's) does not
        have: it failed every fit from shards under DeepSpeed."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        size = getattr(trainer.datamodule, "batch_size", None) if trainer is not None else None
        return size if isinstance(size, int) and size > 0 else 1

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        """Save without frozen parameters (also on CUDA): frozen targets are rebuilt from their paths on resume and
        checked by fingerprint (trainer/training/objective.py), so a checkpoint holds what training changes. The folder
        is written under a temporary name and published whole once every rank finished
        (:func:`~trainer.checkpoints.sharded.save_folder_atomically`)."""
        self.exclude_frozen_parameters = True
        step = int(checkpoint.get("global_step", 0))

        def write(folder: Path) -> None:
            DeepSpeedStrategy.save_checkpoint(self, checkpoint, folder, storage_options)

        save_folder_atomically(self, filepath, step, write)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load; a folder written by another number of ranks (its marker says how many) is first converted
        to DeepSpeed's universal checkpoint (:func:`universal_checkpoint`, rank 0, once per folder), which the engine
        loads on any number of ranks, ZeRO-1, 2 and 3 alike, with one line saying so."""
        folder = Path(checkpoint_path)
        marker = read_marker(folder) if folder.is_dir() else None
        written_by = int(marker["world_size"]) if marker and "world_size" in marker else None
        if written_by is None or written_by == self.world_size:
            return super().load_checkpoint(checkpoint_path, weights_only)
        rank_zero_info(
            f"resuming {folder}, written by {written_by} ranks, on {self.world_size}: through DeepSpeed's universal "
            "checkpoint, which re-partitions the optimizer states"
        )
        if self.is_global_zero:
            universal_checkpoint(folder)
        self.barrier("draftsmith_universal_checkpoint")
        engine_config = self.deepspeed_engine._config
        engine_config.load_universal_checkpoint = True
        try:
            return super().load_checkpoint(str(folder / UNIVERSAL), weights_only)
        finally:
            engine_config.load_universal_checkpoint = False  # later saves and loads are this run's own


UNIVERSAL = "universal"
"""The subfolder of a DeepSpeed checkpoint folder that holds its universal form, made on the first resume that needs
it."""


def universal_checkpoint(folder: Path) -> Path:
    """Converts the DeepSpeed checkpoint ``folder`` (Lightning's: its tag ``checkpoint`` and a ``latest`` file) to
    DeepSpeed's universal checkpoint in ``folder/universal`` (``deepspeed.checkpoint.ds_to_universal``: every
    parameter's fp32 weights and optimizer states whole, which any world size partitions again), unless done before.
    Written under a temporary name and renamed when complete; the converter's own output goes to the debug log.

    Returns:
        The universal folder, which ``engine.load_checkpoint`` reads with ``load_universal_checkpoint`` set.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = folder / UNIVERSAL
    if (target / "latest_universal").is_file():
        return target
    tag = (folder / "latest").read_text().strip() if (folder / "latest").is_file() else "checkpoint"
    partial = partial_folder(target)
    shutil.rmtree(partial, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(folder / tag),
        output_folder=str(partial / tag),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # Lightning's saves lack the universal-checkpoint info of Megatron's models
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ds_to_universal(args)
    log.debug("ds_to_universal:\n%s", printed.getvalue())
    os.rename(partial, target)
    return target


def _check_deepspeed_accelerator_is_cpu() -> None:
    """DeepSpeed picks its accelerator once per process; a CUDA machine asked for CPU training must say so."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != "cpu":
        raise RuntimeError(
            f"trainer.accelerator is cpu but DeepSpeed selected its {name!r} accelerator; "
            "set the environment variable DS_ACCELERATOR=cpu to train DeepSpeed on CPU on this machine."
        )


def deepspeed_offload_enabled(strategy: Strategy) -> bool:
    """True when ``strategy`` is DeepSpeed with the optimizer offloaded to CPU or NVMe.

    Objectives call this in ``configure_optimizers`` to return ``DeepSpeedCPUAdam`` instead of ``torch.optim.AdamW``
    (DeepSpeed's offload refuses a client torch optimizer).

    Args:
        strategy: the Trainer's strategy (``self.trainer.strategy`` inside a LightningModule).
    """
    if not isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy.config, dict):
        return False
    zero = strategy.config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    return offload.get("device", "none") not in ("none", None)


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2, ``fully_shard``) over all processes; runs on CPU and CUDA.

    Lightning's ``ModelParallelStrategy`` with the data-parallel dimension spanning every process by default (its own
    default puts the devices of a node in a tensor-parallel group). The LightningModule shards itself in
    ``configure_model`` with :func:`shard_for_fsdp2`.
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """Create the strategy.

        Args:
            data_parallel_size: processes in the sharded data-parallel dimension; "auto" is world size divided by
                tensor_parallel_size.
            tensor_parallel_size: processes in the tensor-parallel dimension (1: pure FSDP).
            save_distributed_checkpoint: True saves one shard per rank into a checkpoint folder; False gathers a
                single file on rank 0.
            process_group_backend: torch.distributed backend; None picks nccl on CUDA and gloo on CPU.
            timeout: timeout of collective operations.
        """
        if tensor_parallel_size < 1:
            raise ValueError(f"FSDP2Strategy: tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        """A distributed checkpoint folder is written under a temporary name and published whole once every rank
        finished (:func:`~trainer.checkpoints.sharded.save_folder_atomically`); a single file as Lightning writes
        it, through the CheckpointIO."""
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        step = int(checkpoint.get("global_step", 0))

        def write(folder: Path) -> None:
            ModelParallelStrategy.save_checkpoint(self, checkpoint, folder, storage_options)

        save_folder_atomically(self, filepath, step, write)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            world_size = self.num_nodes * self.num_processes
            tp = int(self._tensor_parallel_size)
            if world_size % tp != 0:
                raise ValueError(
                    f"FSDP2Strategy: world size {world_size} (num_nodes x devices) is not divisible by "
                    f"tensor_parallel_size {tp}"
                )
            self._data_parallel_size = world_size // tp
        super().setup_environment()


def _data_parallel_mesh(device_mesh: Any) -> Any:
    """The data-parallel sub-mesh of Lightning's 2-D ("data_parallel", "tensor_parallel") mesh, else the mesh."""
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    if device_mesh.ndim > 1 and "data_parallel" in names:
        return device_mesh["data_parallel"]
    return device_mesh


def _layer_classes(module: nn.Module) -> tuple[str, ...]:
    """Class names of the repeated blocks: HF's ``_no_split_modules`` of any sub-model, else *DecoderLayer."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    return tuple(sorted(names))


def shard_for_fsdp2(module: nn.Module, device_mesh: Any, reshard_after_forward: bool = True) -> nn.Module:
    """Shard a trainable module with FSDP2: each trainable decoder layer, then the module itself.

    Call it from ``LightningModule.configure_model`` on the trainable part only (the drafter), when
    ``self.device_mesh`` is not None (that is, under :class:`FSDP2Strategy`). Frozen modules (the target/teacher)
    stay whole on every rank. Calling it twice is a no-op.

    Args:
        module: the trainable model (e.g. an HF causal LM or a drafter nn.Module); sharded in place.
        device_mesh: the LightningModule's ``device_mesh``; a 2-D Lightning mesh is reduced to its data-parallel
            dimension.
        reshard_after_forward: free the gathered parameters after each forward (less memory, one more all-gather
            in backward).

    Returns:
        The same module, now an FSDP2 module.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(module, FSDPModule):
        return module
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"shard_for_fsdp2: {type(module).__name__} has no trainable parameter; shard the trainable model only "
            "and keep frozen modules replicated"
        )
    mesh = _data_parallel_mesh(device_mesh)
    layer_names = _layer_classes(module)
    for sub in module.modules():
        if sub is module or isinstance(sub, FSDPModule):
            continue
        cls = type(sub).__name__
        is_layer = cls in layer_names or (not layer_names and cls.endswith("DecoderLayer"))
        if is_layer and any(p.requires_grad for p in sub.parameters()):
            fully_shard(sub, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return module


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict of ``module`` on every rank, as CPU tensors.

    Works for plain/DDP modules, FSDP2 modules (DTensor parameters) and DeepSpeed ZeRO-3 partitioned parameters.
    Collective under FSDP2 and ZeRO-3: every rank must call it.

    Args:
        module: the (possibly sharded) module.
    """
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for k, v in module.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out
