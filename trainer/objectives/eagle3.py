"""EAGLE-3: train a one-layer drafter on fused target features with training-time test (TTT).

Online mode: the frozen target runs inside the training step and gives its logits and the hidden states of the
drafter's aux layers. Element ``t`` of a row pairs the fused features of token ``t`` with the embedding of token
``t + 1``; at unrolled step ``i`` it predicts token ``t + 2 + i``, labelled by the target's prediction at position
``t + 1 + i`` (its distribution over the draft vocabulary, renormalised, or its argmax), under the loss mask of that
token, with weight ``step_decay ** i``. Step ``i > 0`` feeds the drafter's own output features and (by default) its
own argmax tokens of step ``i - 1`` at positions shifted by ``i``; see trainer/drafters/eagle3.py for the attention.

The reduced vocabulary (trainer/drafters/vocab_map.py) is counted once from the datamodule's training rows in
``setup``; it is a buffer of the drafter, so a resumed run gets the checkpoint's map back when Lightning restores the
state dict after ``setup``, and ``init_from`` (fine-tuning from a checkpoint) takes the checkpoint's map and never
counts. The target is kept outside the module tree, so checkpoints hold the drafter only.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from trainer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from trainer.drafters.vocab_map import count_label_tokens, vocab_map_from_rows
from trainer.export.checkpoint import load_training_checkpoint, sub_state_dict
from trainer.objectives.base import DraftObjective, Optim, causal_lm_flops_per_token, count_params
from trainer.target import FrozenTarget, resolve_dtype

log = logging.getLogger(__name__)

DRAFTER_KIND = "eagle3"
PREFIX = "drafter."


def drafter_record(config: Eagle3Config, target: str, target_architectures: list[str] | None) -> dict:
    """What a checkpoint stores so that exporters rebuild the drafter without the target."""
    return {
        "kind": DRAFTER_KIND,
        "prefix": PREFIX,
        "config": config.to_dict(),
        "target": target,
        "target_architectures": list(target_architectures or []),
        "tokenizer_from": target,
    }


def config_from_record(record: dict, where: str) -> Eagle3Config:
    """The drafter config of a checkpoint's drafter record, with an error naming ``where`` when it is not EAGLE-3."""
    if record.get("kind") != DRAFTER_KIND:
        raise ValueError(f"{where}: holds a drafter of kind {record.get('kind')!r}, not {DRAFTER_KIND!r}")
    return Eagle3Config(**record["config"])


class Eagle3(DraftObjective):
    """Trains an EAGLE-3 drafter against an online frozen target."""

    def __init__(
        self,
        target: str,
        draft_vocab_size: int = 32000,
        aux_layers: list[int] | None = None,
        ttt_steps: int = 7,
        step_decay: float = 0.8,
        labels: Literal["soft", "hard"] = "soft",
        ttt_inputs: Literal["predicted", "data"] = "predicted",
        init_from: str | None = None,
        target_dtype: str = "float32",
        drafter_dtype: str = "float32",
        trust_remote_code: bool = False,
        seed: int = 0,
        optim: Optim = Optim(),
    ) -> None:
        """
        Args:
            target: the target, an HF causal LM directory or hub id.
            draft_vocab_size: size of the reduced draft vocabulary (the most frequent trained tokens).
            aux_layers: target layers fused by the drafter, in HF hidden_states indices (input of layer i; 0 is the
                embeddings); None uses 2, L // 2, L - 3.
            ttt_steps: K, the unrolled drafting steps of training-time test.
            step_decay: weight of step i is step_decay ** i.
            labels: "soft" matches the target's distribution over the draft vocabulary (renormalised; cross entropy
                with soft labels, i.e. forward KL up to a constant), "hard" its argmax (positions whose argmax is
                outside the draft vocabulary are skipped).
            ttt_inputs: tokens fed at steps i > 0: "predicted" (the drafter's own argmax of step i - 1, as at
                inference) or "data" (the row's own next tokens, as the reference implementations do).
            init_from: a training checkpoint (.ckpt or DeepSpeed directory) of an EAGLE-3 run to start from: its
                weights, shape and vocabulary map are used, and the map is not recounted on this run's data.
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype.
            trust_remote_code: allow custom modelling code in the target directory (off by default).
            seed: seed for the drafter's initialisation.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        if ttt_steps < 1:
            raise ValueError(f"model.ttt_steps must be >= 1, got {ttt_steps}")
        if not 0.0 < step_decay <= 1.0:
            raise ValueError(f"model.step_decay must be in (0, 1], got {step_decay}")
        self.target_path = target
        self.ttt_steps, self.step_decay, self.labels, self.ttt_inputs = ttt_steps, step_decay, labels, ttt_inputs
        frozen = FrozenTarget.from_pretrained(target, target_dtype, trust_remote_code)
        self._target = [frozen]  # a list: kept out of the module tree, so out of checkpoints and optimizers
        torch.manual_seed(seed)
        self.vocab_fixed = init_from is not None
        if init_from is not None:
            state, record = load_training_checkpoint(init_from)
            config = config_from_record(record, f"model.init_from {init_from!r}")
            if config.vocab_size != frozen.vocab_size:
                raise ValueError(
                    f"model.init_from {init_from!r}: its drafter has vocab_size {config.vocab_size}, the target "
                    f"{target!r} has {frozen.vocab_size}"
                )
            self.drafter = Eagle3Drafter(config)
            self.drafter.load_state_dict(sub_state_dict(state, record["prefix"]), strict=True)
            log.info("EAGLE-3 drafter, its shape and its vocabulary map loaded from %s", init_from)
        else:
            config = Eagle3Config.from_target(frozen.config, draft_vocab_size, aux_layers)
            config.vocab_size = frozen.vocab_size
            L_ = frozen.num_layers
            for i in config.aux_layers:
                if not 0 <= i <= L_:
                    raise ValueError(f"model.aux_layers: {i} is outside the target's hidden_states 0..{L_}")
            self.drafter = Eagle3Drafter(config)
        self.drafter.to(resolve_dtype(drafter_dtype))

    @property
    def target(self) -> FrozenTarget:
        return self._target[0]

    def trainable_module(self) -> nn.Module:
        return self.drafter

    # ---- the reduced vocabulary ----------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.vocab_fixed:
            return
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        dataset = getattr(datamodule, "train_dataset", None)
        if dataset is None or not hasattr(dataset, "ids"):
            raise ValueError(
                "EAGLE-3 needs the training rows to count its draft vocabulary: the datamodule has no train_dataset "
                "with ids and trained arrays (or pass model.init_from)"
            )
        self.build_vocab_map(dataset.ids, dataset.trained)

    def build_vocab_map(self, ids, trained, chunk_rows: int = 4096) -> None:
        """Count the trained labels of [R, S + 1] rows, install the map and copy the target's lm_head rows.

        Every rank computes the same map from the same rows (deterministic; no communication needed).
        """
        cfg = self.drafter.config
        rows = ((ids[i : i + chunk_rows], trained[i : i + chunk_rows]) for i in range(0, len(ids), chunk_rows))
        d2t, t2d = vocab_map_from_rows(rows, cfg.vocab_size, cfg.draft_vocab_size)
        self.drafter.set_vocab_map(d2t.to(self.drafter.d2t.device), t2d.to(self.drafter.t2d.device))
        with torch.no_grad():
            head = self.target.lm_head_weight.detach()  # [V, Ht]
            rows_ = head.index_select(0, self.drafter.draft_ids().to(head.device))  # [Vd, Ht]
            if rows_.shape == self.drafter.lm_head.weight.shape:
                self.drafter.lm_head.weight.copy_(rows_)
        covered = count_label_tokens([(ids[:chunk_rows], trained[:chunk_rows])], cfg.vocab_size)
        share = float(covered[t2d].sum()) / max(1, int(covered.sum()))
        log.info("EAGLE-3 draft vocabulary: %d of %d tokens, %.3f of sampled labels", cfg.draft_vocab_size,
                 cfg.vocab_size, share)  # fmt: skip

    # ---- training ------------------------------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, S] each
        target = self.target
        if target.lm_head_weight.device != ids.device:
            target.to(ids.device)
        drafter = self.drafter
        B, S = ids.shape
        out = target(ids, hidden_layers=drafter.config.aux_layers)  # logits [B, S, V]
        fused = drafter.fuse([h[:, :-1] for h in out.hidden_states])  # [B, S - 1, H]
        draft_ids = drafter.draft_ids()  # [Vd]
        target_argmax = out.logits.argmax(-1)  # [B, S]
        if self.labels == "soft":
            target_probs = torch.softmax(out.logits.index_select(-1, draft_ids).float(), dim=-1)  # [B, S, Vd]
        else:
            t2d_index = torch.cumsum(drafter.t2d.long(), 0) - 1  # [V] draft index of every target id
            hard = torch.where(drafter.t2d[target_argmax], t2d_index[target_argmax], -100)  # [B, S]
        data_tokens = None
        if self.ttt_inputs == "data":
            data_tokens = F.pad(ids, (0, self.ttt_steps), value=0)  # [B, S + K]
        embedding = target.model.get_input_embeddings()
        total = fused.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        steps = drafter.unroll(embedding, fused, ids[:, 1:], self.ttt_steps, data_tokens)
        for i, logits in enumerate(steps):  # logits [B, S - 1, Vd]
            n = S - 1 - i  # elements whose label position t + 1 + i is inside the row
            if n <= 0:
                break
            mask = loss_mask[:, 1 + i :].float()  # [B, n]
            log_q = torch.log_softmax(logits[:, :n].float(), dim=-1)  # [B, n, Vd]
            if self.labels == "soft":
                per_pos = -(target_probs[:, 1 + i :] * log_q).sum(-1)  # [B, n]
            else:
                labels = hard[:, 1 + i :]  # [B, n]
                mask = mask * (labels >= 0)
                per_pos = -log_q.gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # [B, n]
            denom = mask.sum().clamp(min=1.0)
            loss_i = (per_pos * mask).sum() / denom
            total = total + self.step_decay**i * loss_i
            with torch.no_grad():
                guess = drafter.to_target_ids(logits[:, :n].argmax(-1))  # [B, n]
                trained = loss_mask[:, 1 + i :]
                hits = (guess == target_argmax[:, 1 + i :]) & trained
                metrics[f"acc_{i}"] = hits.sum().float() / trained.sum().clamp(min=1).float()
                metrics[f"loss_{i}"] = loss_i.detach()
        return total, metrics

    def flops_per_token(self) -> float:
        drafter = 2.0 * count_params(self.drafter)
        target = causal_lm_flops_per_token(self.target.model, 1024)
        return 3.0 * drafter * self.ttt_steps + target

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        architectures = getattr(self.target.config, "architectures", None)
        checkpoint["drafter"] = drafter_record(self.drafter.config, self.target_path, architectures)
