"""The base of every objective: token counting, throughput and MFU, training checks, and what a checkpoint holds; its
optimizer and schedule are ``model.init_args.optim``'s (trainer/training/optimizers.py).

Subclasses implement ``trainable_module()`` (what the optimizer trains), ``compute_loss(batch)`` (returns the loss
and a dict of extra metrics), ``flops_per_token()``, ``drafter_record()`` (what the trained drafter is, for
``draftsmith export`` and ``eval``), ``data_requirements()`` (what the training data must match, checked in
``setup``) and ``activation_bytes(step)`` (the activations of one training step, for ``draftsmith plan``). Frozen
models are declared with :meth:`track_frozen`: checkpoints hold their fingerprints, not their weights (a FrozenTarget
never enters a state dict), and a resumed run with a different frozen model is refused with both fingerprints in the
message.

The setup every objective with a target shares is written here once: :meth:`load_target` (the target run online, or
only what its shards do not hold, by ``target_signals``; tracked as a frozen model, and kept on the module's device
wherever it lives), :meth:`setup` running :meth:`check_data` on the objective's :meth:`data_requirements` (the data's
tokenizer, or the shards' target, tokenizer, vocabulary, temperature and hidden layers), :meth:`drafter_from_checkpoint`
(``init_from``) and :meth:`speculative_eval_target`.

Throughput: ``train/tokens_per_s`` is the training tokens of every rank over the time of the optimizer steps since the
last written value, each step from the start of its first micro-batch to the end of its optimizer step (validation,
speculative evaluation, checkpoint saves and data loading between steps are not counted); ``train/mfu`` divides it by
the measured matmul peak (trainer/training/throughput.py). :meth:`training_throughput` is the same count over the whole
run (the fit's closing block, trainer/training/progress.py).

Training checks: a non-finite loss stops the run (naming the step); so do a gradient norm of exactly zero for
:data:`DEAD_GRADIENT_STEPS` optimizer steps in a row and trainable weights whose root mean square exceeds
:data:`MAX_WEIGHT_RMS` (a learning rate far too high leaves a dead model, which must not be exported). The last saved
checkpoint stays intact.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from trainer.data.shard_datamodule import ShardDataModule, checked_shard_data
from trainer.data.shards import load_manifest
from trainer.data.vocab import check_data_tokenizer, load_tokenizer_if_present
from trainer.distributed.preemption import PreemptionCheckpoint
from trainer.distributed.strategies import shard_for_fsdp2
from trainer.interface.errors import CheckpointError, DataError, RecipeError, TrainingError
from trainer.models.target import FrozenTarget, TargetEmbeddings, check_context, check_model_path, model_load_error
from trainer.training.fingerprint import describe, fingerprint
from trainer.training.optimizers import Optim, build_optimizer, build_schedule
from trainer.training.registry import DrafterRecord, check_target, load_drafter
from trainer.training.throughput import measure_matmul_peak

if TYPE_CHECKING:
    from trainer.training.activation_memory import PlannedStep

DEAD_GRADIENT_STEPS = 3
MAX_WEIGHT_RMS = 1e3

TargetSignals = Literal["online", "shards"]


@dataclass(frozen=True)
class DataRequirements:
    """What an objective's training data must match (:meth:`DraftObjective.data_requirements`), checked in ``setup``
    by :meth:`DraftObjective.check_data`.

    Args:
        width: the output rows of the model whose token ids the data must match.
        vocab_size: the ids shared with the data; default the tokenizer's length (online: ``width``).
        temperature: shards: the temperature their top-k was taken at (None: any).
        target_layers: shards: the HF hidden_states indices they must hold, in order (None: not checked).
        hidden_size: shards: the width of those hidden states (None: not checked).
        name: the model named in a tokenizer mismatch (None: :attr:`DraftObjective.target_path`).
    """

    width: int
    vocab_size: int | None = None
    temperature: float | None = 1.0
    target_layers: Sequence[int] | None = None
    hidden_size: int | None = None
    name: str | None = None


def derived_seed(*parts: object) -> int:
    """A 63-bit seed that depends on every part (stable across processes and Python versions)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def longest_rows(datamodule) -> tuple[int | None, str]:
    """The tokens of the datamodule's longest training rows and their recipe key: ``data.long_seq_len`` with mixed
    lengths, else ``data.seq_len`` (None for a datamodule without one)."""
    long = getattr(datamodule, "long_seq_len", None)
    if long:
        return int(long), "data.long_seq_len"
    return getattr(datamodule, "seq_len", None), "data.seq_len"


class DraftObjective(L.LightningModule):
    """Shared training logic. Every objective subclasses this, or the objective of the one method it extends (a method
    family: P-EAGLE's extends EAGLE-3's, DSpark's DFlash's)."""

    # Whether every forward of this objective over the batch (target and drafter) passes the batch's document_ids
    # (trainer/models/documents.py) to its attention; otherwise data.document_masking is refused
    # (check_document_masking).
    honours_document_ids: ClassVar[bool] = False
    # Ranks sharing each row under sequence parallelism (trainer/distributed/sequence_parallel.py): the samplers give
    # them the same rows. 1 (none) unless an objective that trains so takes it as an argument (EAGLE-3's
    # model.sequence_parallel).
    sequence_parallel: int = 1

    def __init__(self, optim: Optim = Optim()) -> None:
        """
        Args:
            optim: optimizer and learning-rate schedule.
        """
        super().__init__()
        self.optim = optim
        self._peak_flops: float | None = None
        self._step_started: float | None = None
        self._step_ended: float | None = None
        self._tokens_in_step = 0
        self._run_tokens, self._run_step_seconds = 0, 0.0  # this process's run alone (training_throughput)
        self._rate_window = [0, 0.0]  # tokens and step seconds since train/tokens_per_s was last written
        self._tokens_seen = 0  # over every rank and step of the run, resumes included (kept in checkpoints)
        self._tokens_in_batch: int | None = None
        self._zero_grad_steps = 0
        self._frozen: dict[str, dict[str, str]] = {}
        # the target, set by load_target: a list keeps it out of the module tree (so out of checkpoints, optimizers
        # and Lightning's moves); `in_module_tree` also registers it as the submodule `frozen_target`
        self._target: list[FrozenTarget | TargetEmbeddings] = []
        self.target_path: str | None = None
        self.target_signals: TargetSignals = "online"
        self.target_config = None  # the target's HF config
        self.tokenizer = None  # the tokenizer the data's token ids must match (the target's), None when none is saved

    # ---- to implement --------------------------------------------------------------------------------------------
    def trainable_module(self) -> nn.Module:
        """The module whose parameters are trained."""
        raise NotImplementedError

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns the scalar loss and extra metrics to log."""
        raise NotImplementedError

    def flops_per_token(self) -> float:
        """Training FLOPs per trained token (forward and backward of trainable parts, forward of frozen ones)."""
        raise NotImplementedError

    def drafter_record(self) -> DrafterRecord:
        """What the trained module is (trainer/training/registry.py), stored in every checkpoint."""
        raise NotImplementedError

    def data_requirements(self) -> DataRequirements:
        """What the training data must match (its tokenizer; from shards their target, vocabulary, temperature and
        hidden layers): :meth:`setup` checks the trainer's datamodule against it with :meth:`check_data`."""
        raise NotImplementedError(f"{type(self).__name__} does not say what its data must match (data_requirements)")

    def activation_bytes(self, step: PlannedStep) -> int:
        """The activation bytes of one training step on ``step``'s batch, read by ``draftsmith plan``: the objective
        is built on the meta device, so this reads its shapes and settings, never its weights; the terms are in
        :mod:`trainer.training.activation_memory`.

        Raises:
            RecipeError: the objective has no estimate (an objective that does not implement this method): the
                planner refuses its recipe naming the class.
        """
        raise RecipeError(
            f"draftsmith plan: {type(self).__name__} has no activation estimate: it does not implement "
            "DraftObjective.activation_bytes (docs/developer/add-a-method.md)"
        )

    def speculative_eval_target(self) -> PreTrainedModel:
        """The HF target the drafter is measured against by SpeculativeEvalCallback (trainer/decoding/callback.py), on
        the module's device: the target :meth:`load_target` loaded online. Objectives whose model drafts for itself
        return that model."""
        if self.target_signals == "shards":
            raise RecipeError(
                "target_signals: shards never builds the target, so SpeculativeEvalCallback cannot decode with it: "
                "measure the exported drafter with draftsmith eval, or train online"
            )
        if not isinstance(self.target, FrozenTarget):
            raise RecipeError(f"{type(self).__name__} trains no drafter against a target for SpeculativeEvalCallback")
        return self.target.model

    # ---- the target, its data and init_from ----------------------------------------------------------------------
    def load_target(
        self,
        path: str,
        signals: TargetSignals = "online",
        dtype: str = "float32",
        trust_remote_code: bool = False,
        shard_tensors: bool = True,
        in_module_tree: bool = False,
        record_as: str = "target",
    ) -> FrozenTarget | TargetEmbeddings | None:
        """Loads the target as ``target_signals`` asks and declares it frozen (checkpoints keep its fingerprint).

        Online it is a FrozenTarget; from shards (``draftsmith precompute``) the model is never built: a
        TargetEmbeddings (its config, input embedding and lm_head read from its safetensors), or with
        ``shard_tensors=False`` only its config. It is then :attr:`target`, with :attr:`target_path`,
        :attr:`target_signals`, :attr:`target_config` and the tokenizer saved beside it, :attr:`tokenizer`.

        Args:
            path: the target, an HF causal LM directory or hub id (``model.target``).
            signals: ``model.target_signals``: "online" (the target runs in every step) or "shards".
            dtype: the target's weights dtype (float32, bfloat16, float16).
            trust_remote_code: allow custom modelling code in the target directory.
            shard_tensors: with shards, read the embedding and lm_head (False: the config only; :attr:`target` is
                None).
            in_module_tree: register the online target as the submodule ``frozen_target``, so that Lightning moves and
                casts it with the objective and ZeRO-3 partitions it (a large distillation target); it is still in no
                checkpoint. Otherwise it stays out of the module tree, never cast, and moved with the module
                (:meth:`_apply`) and to the strategy's device when a fit starts.
            record_as: the name of its fingerprint in checkpoints (``frozen_models``).

        Returns:
            :attr:`target`.
        """
        frozen: FrozenTarget | TargetEmbeddings | None
        if signals == "online":
            frozen = FrozenTarget.from_pretrained(path, dtype, trust_remote_code)
            config = frozen.config
        elif signals == "shards" and shard_tensors:
            frozen = TargetEmbeddings.from_pretrained(path, dtype, trust_remote_code)
            config = frozen.config
        elif signals == "shards":
            check_model_path(path)
            try:
                frozen, config = None, AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            except OSError as err:
                raise model_load_error(path, err) from err
        else:
            raise RecipeError(f"model.target_signals={signals!r} is not 'online' or 'shards'")
        self._target = [] if frozen is None else [frozen]
        if in_module_tree and isinstance(frozen, FrozenTarget):
            self.frozen_target = frozen
        self.target_path, self.target_signals, self.target_config = path, signals, config
        self.track_frozen(record_as, path, config)
        self.tokenizer = load_tokenizer_if_present(path)
        return frozen

    @property
    def target(self) -> FrozenTarget | TargetEmbeddings | None:
        """The target :meth:`load_target` loaded: a FrozenTarget (online), TargetEmbeddings (shards), or None."""
        return self._target[0] if self._target else None

    def _move_target(self, device: torch.device) -> None:
        """Moves :attr:`target`, when it is kept out of the module tree, to ``device`` (a no-op where it is, and for
        a target on the meta device, which the planner builds)."""
        held = self.__dict__.get("_target")
        if not held or "frozen_target" in self._modules:
            return
        where = held[0].lm_head_weight.device
        if where != device and where.type != "meta":
            held[0].to(device)

    def _apply(self, fn, recurse: bool = True):
        """Every move of the module (``.to(device)``, ``.cuda()``, a strategy's or an engine's own move) takes the
        target kept out of the module tree with it; a cast (``.half()``, ``.to(dtype)``) leaves it as loaded
        (``target_dtype``)."""
        module = super()._apply(fn, recurse)
        held = self.__dict__.get("_target")
        if held:
            self._move_target(fn(torch.empty(0, device=held[0].lm_head_weight.device)).device)  # where fn moves to
        return module

    def attached_datamodule(self):
        """The trainer's datamodule, or None outside a trainer."""
        return getattr(self._trainer, "datamodule", None) if self._trainer is not None else None

    def check_document_masking(self, datamodule) -> None:
        """Refuses packed rows with document masking (``data.document_masking``) for an objective whose forwards
        would ignore their ``document_ids`` (:attr:`honours_document_ids` False) and train across documents."""
        if getattr(datamodule, "document_masking", False) and not self.honours_document_ids:
            raise RecipeError(
                f"data.document_masking=true: {type(self).__name__} does not pass document_ids to its attention "
                "(it would attend across documents); set data.document_masking=false"
            )

    def setup(self, stage: str) -> None:
        """Refuses data the objective cannot train on: :meth:`check_data` of the trainer's datamodule against
        :meth:`data_requirements`. An objective that checks more overrides this and calls it first."""
        self.check_data(self.attached_datamodule(), self.data_requirements())

    def check_data(self, datamodule, requirements: DataRequirements) -> ShardDataModule | None:
        """Refuses data the objective cannot train on (:meth:`setup` calls it).

        Online (or without a target): the data's tokenizer must be :attr:`tokenizer` (check_data_tokenizer; a no-op
        for data without one). From shards: a ShardDataModule whose shards were made by this target (fingerprint),
        tokenizer, vocabulary and temperature, holding the required target layers in that order, of the required
        hidden size.

        Args:
            datamodule: the trainer's datamodule (:meth:`attached_datamodule`).
            requirements: what the data must match (:meth:`data_requirements`).

        Returns:
            The set-up ShardDataModule (shards), else None.
        """
        self.check_document_masking(datamodule)
        width, vocab_size, name = requirements.width, requirements.vocab_size, requirements.name
        target_layers, hidden_size = requirements.target_layers, requirements.hidden_size
        rows, key = longest_rows(datamodule)
        check_context(self.target_config, rows, self.target_path, key)
        if self.target_signals != "shards":
            check_data_tokenizer(datamodule, name or self.target_path, self.tokenizer, width, vocab_size or width)
            return None
        if not isinstance(datamodule, ShardDataModule):
            raise RecipeError(
                "model.target_signals=shards needs data: trainer.data.shard_datamodule.ShardDataModule, got "
                f"{type(datamodule).__name__}"
            )
        layers = None if target_layers is None else list(target_layers)
        if layers and not load_manifest(datamodule.shards_dir)[0].hidden_layers:
            raise DataError(
                f"{datamodule.shards_dir}: the shards hold no hidden states; {type(self).__name__} reads target layers "
                f"{layers}: rerun draftsmith precompute with --hidden_layers '{layers}'"
            )
        if vocab_size is None:
            vocab_size = len(self.tokenizer) if self.tokenizer is not None else width
        data = checked_shard_data(
            datamodule, vocab_size=vocab_size, tokenizer=self.tokenizer, teacher=self.target_path,
            temperature=requirements.temperature,
        )  # fmt: skip
        if layers is not None and list(data.hidden_layers) != layers:
            raise RecipeError(
                f"data.hidden_layers={list(data.hidden_layers)} must equal the drafter's target_layers {layers} (the "
                f"shards hold {data.meta.hidden_layers}), in that order: teacher_hidden[:, j] is target layer j"
            )
        if hidden_size is not None and data.meta.hidden_size != hidden_size:
            raise DataError(
                f"{data.shards_dir}: hidden states of width {data.meta.hidden_size}, the target {self.target_path!r} "
                f"has {hidden_size}"
            )
        return data

    def check_data_tokenizer(self, datamodule) -> None:
        """Refuses data of another tokenizer than the model's before the datamodule reads or tokenizes anything.

        TextDataModule's ``prepare_data`` and ``setup`` call it (trainer/data/tokenizer.py ``check_before_reading``),
        which Lightning runs before the objective's ``setup``: data of another tokenizer, or a model folder that holds
        no tokenizer, is refused in seconds instead of after tokenizing a corpus. It is the tokenizer part of
        :meth:`check_data` (the tokenizer files compared), with the model's output rows as the width; ``setup`` runs
        :meth:`check_data` again with the drafter's widths. From shards a no-op (:meth:`check_data` checks the
        shards' tokenizer), and for data without a tokenizer.

        Args:
            datamodule: the datamodule about to read its data.

        Raises:
            TokenizerError: the model holds no tokenizer, or the data's differs (named by both folders).
        """
        self.check_document_masking(datamodule)
        rows, key = longest_rows(datamodule)
        check_context(self.target_config, rows, self.target_path, key)
        if self.target_signals == "shards":
            return
        name = self.target_path or getattr(self, "tokenizer_path", None) or self.hparams.get("tokenizer")
        config = self.target_config
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        rows = getattr(text, "vocab_size", None)
        if rows is None:
            rows = len(self.tokenizer) if self.tokenizer is not None else 1 << 62
        check_data_tokenizer(datamodule, str(name), self.tokenizer, int(rows), int(rows))

    def drafter_from_checkpoint(self, init_from: str, kind: str) -> nn.Module:
        """The drafter of ``model.init_from`` (a training checkpoint or an export), refused when it is not of ``kind``
        or was made for another target than :attr:`target_config`."""
        drafter, record = load_drafter(init_from)
        where = f"model.init_from {init_from!r}"
        if record.kind != kind:
            raise CheckpointError(f"{where}: holds a drafter of kind {record.kind!r}, not {kind!r}")
        check_target(record, self.target_config, where)
        return drafter

    # ---- frozen models and checkpoints ---------------------------------------------------------------------------
    def track_frozen(self, name: str, name_or_path: str, config) -> None:
        """Declare a frozen model (rebuilt from ``name_or_path`` on resume): checkpoints keep its fingerprint."""
        self._frozen[name] = fingerprint(name_or_path, config)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["drafter"] = self.drafter_record().to_dict()
        checkpoint["frozen_models"] = dict(self._frozen)
        # a checkpoint written in a callback's on_train_batch_end (before this module's, where the step's tokens are
        # added) holds the step's tokens too: it resumes after that step
        world = self.trainer.world_size if self._trainer is not None else 1
        checkpoint["tokens_seen"] = self._tokens_seen + self._tokens_in_step * world

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._tokens_seen = int(checkpoint.get("tokens_seen", 0))
        saved = checkpoint.get("frozen_models") or {}
        for name, current in self._frozen.items():
            old = saved.get(name)
            if old is not None and old != current:
                raise CheckpointError(
                    f"the checkpoint was trained with another {name}: it recorded ({describe(old)}), this run loads "
                    f"({describe(current)}); resume with the model it was trained with, or start a new run"
                )

    def count_tokens(self, n: int) -> None:
        """Called from ``compute_loss`` when a training step ran on other tokens than the batch's (e.g. sequences
        generated in the step): the throughput counts ``n`` for this batch."""
        self._tokens_in_batch = n

    # ---- shared --------------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under FSDP2 (recipes/_base/fsdp.yaml), shards the trainable module's layers; frozen parts stay whole."""
        if self.device_mesh is not None:
            shard_for_fsdp2(self.trainable_module(), self.device_mesh)

    def data_seq_len(self, default: int = 1024) -> int:
        """The datamodule's sequence length (for FLOP counts), or ``default`` before a trainer is attached."""
        return int(getattr(self.attached_datamodule(), "seq_len", default))

    def metrics_due(self) -> bool:
        """Whether this step's metrics reach the loggers (Lightning writes a training step's every
        ``log_every_n_steps``; evaluation and a module without a trainer: always). A metric that costs compute of its
        own (EAGLE-3's expected acceptance, which needs the target's log-partition over the whole vocabulary) is
        computed only then."""
        if self._trainer is None or not self.training:
            return True
        connector = getattr(self.trainer, "_logger_connector", None)
        return bool(getattr(connector, "should_update_logs", True))

    def weights_are_sharded(self) -> bool:
        """True under FSDP2 or ZeRO-3, where a parameter read outside its module's forward is only a shard.

        Objectives then compute logits through the module's own forward instead of reading its output weight.
        """
        if self._trainer is None:
            return False
        strategy = self.trainer.strategy
        return self.device_mesh is not None or (isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        loss, metrics = self.compute_loss(batch)
        if not torch.isfinite(loss):
            raise TrainingError(
                f"non-finite {stage} loss ({loss.item()}) at global step {self.global_step}, batch of "
                f"{tuple(batch['input_ids'].shape)}: lower the learning rate (model.init_args.optim.lr="
                f"{self.optim.lr}) or check the data; the last saved checkpoint is intact"
            )
        batch_size = batch["input_ids"].shape[0]
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=batch_size, sync_dist=stage != "train")
        for name, value in metrics.items():
            self.log(f"{stage}/{name}", value, batch_size=batch_size, sync_dist=stage != "train")
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._tokens_in_batch = None
        loss = self._step(batch, "train")
        counted = self._tokens_in_batch
        self._tokens_in_step += int(batch["input_ids"].numel()) if counted is None else counted
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val")

    def lr_groups(self) -> list[tuple[nn.Module, float]]:
        """The trained modules and the multiplier of the learning rate of each (default: the trainable module at 1;
        Medusa-2 trains its heads 4 times faster than the target)."""
        return [(self.trainable_module(), 1.0)]

    def configure_optimizers(self):
        strategy = self.trainer.strategy if self._trainer is not None else None
        precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
        optimizer = build_optimizer(self.optim, self.lr_groups(), strategy, precision)
        schedule = build_schedule(
            optimizer, self.optim, self.trainer.max_steps, lambda: self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_fit_start(self) -> None:
        self._move_target(self.trainer.strategy.root_device)  # where the batches go, whatever moved the module
        dtype = next(self.trainable_module().parameters()).dtype
        self._peak_flops = measure_matmul_peak(self.device, dtype)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self._step_started is None:
            self._step_started = time.perf_counter()

    def on_before_optimizer_step(self, optimizer) -> None:
        total = self._grad_norm()
        if total is not None:  # None under ZeRO, where gradients are partitioned inside DeepSpeed
            self.log("train/grad_norm", total)
            self._zero_grad_steps = self._zero_grad_steps + 1 if total == 0.0 else 0
            if self._zero_grad_steps >= DEAD_GRADIENT_STEPS:
                raise TrainingError(
                    f"the gradient norm has been exactly 0 for {self._zero_grad_steps} optimizer steps (global step "
                    f"{self.global_step}): the model no longer learns (a learning rate far too high, "
                    f"model.init_args.optim.lr={self.optim.lr}, kills it); the last saved checkpoint is intact"
                )
        self.log("train/lr", optimizer.param_groups[0]["lr"])
        self._check_weights()

    def _grad_norm(self) -> float | None:
        """The 2-norm of the trainable gradients (under FSDP2 the local shards' squares summed over ranks), or None
        when the parameters hold no gradient (ZeRO keeps them in its own partitioned buffers)."""
        grads = [p.grad for p in self.trainable_module().parameters() if p.grad is not None]
        if not grads:
            return None
        if self.device_mesh is not None:
            from torch.distributed.tensor import DTensor

            local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            squares = torch.stack([g.float().pow(2).sum() for g in local]).sum()
            torch.distributed.all_reduce(squares)
        else:
            squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        return math.sqrt(float(squares))

    def _check_weights(self) -> None:
        """Every ``log_every_n_steps``: the trainable weights' root mean square, logged and bounded."""
        if self.global_step % max(1, self.trainer.log_every_n_steps) or self.weights_are_sharded():
            return
        params = [p.detach() for p in self.trainable_module().parameters() if p.requires_grad and p.numel()]
        if not params:
            return
        squares = sum(float(p.float().pow(2).sum()) for p in params)
        rms = math.sqrt(squares / sum(p.numel() for p in params))
        self.log("train/weight_rms", rms)
        if not math.isfinite(rms) or rms > MAX_WEIGHT_RMS:
            raise TrainingError(
                f"the trainable weights' root mean square is {rms:.3g} at global step {self.global_step} (more than "
                f"{MAX_WEIGHT_RMS:g}): training diverged (model.init_args.optim.lr={self.optim.lr}); the last saved "
                "checkpoint is intact"
            )

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """Lightning's optimizer step, then notes the time: the end of the step's time that ``train/tokens_per_s``
        counts (the callbacks' ``on_train_batch_end`` that run next, a speculative evaluation or a checkpoint save,
        are not training).

        Args:
            epoch: the current epoch.
            batch_idx: the batch's index in the epoch.
            optimizer: the optimizer (Lightning's wrapper of it).
            optimizer_closure: the closure that runs the forward and backward passes.
        """
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self._step_ended = time.perf_counter()

    def training_throughput(self) -> tuple[int, float]:
        """(tokens, seconds) of this run's optimizer steps (a resumed run counts from where it resumed): the training
        tokens over every rank, and this rank's seconds in the steps, each from the start of its first micro-batch to
        the end of its optimizer step (validation, speculative evaluation, checkpoint saves and data loading between
        steps excluded): what ``train/tokens_per_s`` measures, over the whole run."""
        return self._run_tokens, self._run_step_seconds

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if not self.trainer.fit_loop._should_accumulate():
            tokens = self._tokens_in_step * self.trainer.world_size
            self._tokens_seen += tokens
            self.log("train/tokens", float(self._tokens_seen))
            self._log_final_tokens()
            now = time.perf_counter()
            elapsed = (self._step_ended or now) - (self._step_started or now)
            self._run_tokens += tokens
            self._run_step_seconds += elapsed
            window = self._rate_window
            window[0] += tokens
            window[1] += elapsed
            if window[1] > 0:
                # over the steps since the last written value, not this step alone: a step whose metrics are written
                # may compute more than the others (DraftObjective.metrics_due)
                tokens_per_s = window[0] / window[1]
                self.log("train/tokens_per_s", tokens_per_s, prog_bar=True)
                if self._peak_flops:
                    mfu = tokens_per_s * self.flops_per_token() / (self._peak_flops * self.trainer.world_size)
                    self.log("train/mfu", mfu)
            if self.metrics_due():
                self._rate_window = [0, 0.0]
            self._step_started, self._step_ended, self._tokens_in_step = None, None, 0
            self._save_last_if_final()

    def _is_final_step(self) -> bool:
        """True at the run's last optimizer step: max_steps reached, or a callback (max_time, a stop) asked to stop."""
        trainer = self.trainer
        return trainer.should_stop or (trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps)

    def _log_final_tokens(self) -> None:
        """At the run's final step, write the tokens seen to the loggers whatever ``log_every_n_steps`` (what a run
        cost in tokens, read back by ``draftsmith compare``)."""
        trainer = self.trainer
        if self._is_final_step() and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"train/tokens": float(self._tokens_seen)}, step=trainer.global_step)

    def _save_last_if_final(self) -> None:
        """At the run's final optimizer step, write ``last.ckpt`` where Lightning would not.

        Lightning's ModelCheckpoint writes ``last`` at the end of training only when it never wrote one before, so a
        run stopped by ``trainer.max_time`` (or by a ``max_steps`` off the checkpoint interval) would keep the
        ``last.ckpt`` of its last interval, and an export of it would silently miss the final steps. Written here, at
        the end of the final batch (callbacks such as the max_time timer have already asked to stop), the checkpoint
        resumes mid-epoch at the next batch; written in ``on_train_end`` it would resume at the next epoch. Every
        rank runs this (saving is collective under DeepSpeed and FSDP).
        """
        trainer = self.trainer
        step = trainer.global_step
        if not self._is_final_step() or step == 0:
            return
        if any(isinstance(cb, PreemptionCheckpoint) and cb.saved_path for cb in trainer.callbacks):
            return  # the preemption handler has just written last.ckpt at this step
        for callback in trainer.checkpoint_callbacks:
            # _last_global_step_saved / _save_last_checkpoint: Lightning's own record and writer of `last` (private
            # in the pinned 2.6 release; the writer also keeps save_last="link" and the last-name template right)
            saved_here = getattr(callback, "_last_global_step_saved", -1) == step
            if isinstance(callback, ModelCheckpoint) and callback.save_last and not saved_here:
                callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def count_params(module: nn.Module) -> int:
    """Parameters of a module, counted once even when shared (tied embeddings)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def causal_lm_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward FLOPs per token of an HF causal LM: 2 per weight plus attention scores and values (PaLM's estimate)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq_len
    embeddings = model.get_input_embeddings().weight.numel()
    return 2.0 * (count_params(model) - embeddings) + attention
