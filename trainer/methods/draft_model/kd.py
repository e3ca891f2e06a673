"""Soft-label knowledge distillation from an online target or from precomputed target shards.

Online (``target_signals: online``): the frozen target runs inside the training step; the drafter (any HF causal
LM, smaller than the target) learns to match the target's temperature-softened distribution at every trained position
(``loss``: the forward KL, the reverse KL, the generalized JSD, or an LK loss: total variation, negative log-acceptance,
the hybrid; trainer/losses/distillation.py), optionally mixed with cross entropy on the hard labels. The expected
acceptance ``alpha = sum_v min(p_v, q_v)`` of the drafter under the target is logged as ``alpha_0``. The loss is
computed in chunks of positions (``trainer.losses.distillation``) so that the float32 full-vocabulary logits of both
models for the whole batch never exist at once.

Offline (``target_signals: shards``): the batches carry the target's top-k ids and log-probabilities written by
``draftsmith precompute`` (trainer/data/shard_datamodule.py); only the target's config and tokenizer are loaded, never
its weights, and the loss is the sparse forward KL (``sparse_kd_loss``) with the tail renormalised or kept as one
bucket, or an LK loss over the stored ids (``alpha_0`` is then the overlap over them, a lower bound). At setup the
shards are checked against this target (fingerprint), the drafter's vocabulary, the tokenizer and the temperature; a
mismatch is refused. With k equal to the vocabulary it is the online loss.
"""

from __future__ import annotations

import copy
import logging
from typing import Literal

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.data.vocab import load_tokenizer_if_present, shared_vocab_size
from trainer.export.hf import export_student
from trainer.interface.errors import RecipeError
from trainer.losses.distillation import KD_LOSSES, SPARSE_LOSSES, fused_kd_loss, kd_loss, sparse_kd_loss
from trainer.losses.distribution import DEFAULT_ETA, DistributionLoss
from trainer.methods.draft_model import kind as hf_causal_lm
from trainer.models.logit_scaling import LogitScaling
from trainer.models.target import document_kwargs, resolve_dtype
from trainer.training.activation_memory import (
    PlannedStep,
    Shape,
    causal_lm_layers,
    chunked,
    frozen_forward,
    layer_saved,
)
from trainer.training.objective import DataRequirements, DraftObjective, TargetSignals, causal_lm_flops_per_token
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

log = logging.getLogger(__name__)


def build_drafter(
    target_config, drafter: str | None, drafter_config: dict[str, int | float | str | bool] | None, dtype: str
) -> PreTrainedModel:
    """Loads a pretrained drafter, or builds a fresh one from the target's config with ``drafter_config`` overrides."""
    if drafter is not None:
        if drafter_config:
            raise RecipeError("set either model.drafter (a pretrained drafter) or model.drafter_config, not both")
        return AutoModelForCausalLM.from_pretrained(drafter, dtype=resolve_dtype(dtype))
    config = copy.deepcopy(target_config)
    for key, value in (drafter_config or {}).items():
        if not hasattr(config, key):
            raise RecipeError(f"model.drafter_config: {key!r} is not a key of the target's {config.model_type} config")
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype))


def drafter_vocab_size(
    objective: DraftObjective, target_width: int, student: PreTrainedModel, drafter: str | None
) -> int:
    """The leading logit columns that mean the same token for the objective's target and its drafter ``student``
    (built by :func:`build_drafter` from ``drafter``, or from the target's config); a ValueError naming both when
    their tokenizers differ."""
    return shared_vocab_size(
        teacher_name=objective.target_path,
        teacher_tokenizer=objective.tokenizer,
        teacher_width=target_width,
        student_name=drafter or "a drafter built from the target's config",
        student_tokenizer=load_tokenizer_if_present(drafter) if drafter else objective.tokenizer,
        student_width=student.get_output_embeddings().weight.shape[0],
    )


def distillation_activation_bytes(objective: DraftObjective, step: PlannedStep) -> int:
    """One step of distilling ``objective.trainable_module()`` (an HF causal LM) from its target: the drafter's saved
    layers and embeddings, the target's forward (none from shards), and a chunked loss against the target's
    distribution (six float32 chunks)."""
    n, a = step.tokens, step.element
    shape, layers = causal_lm_layers(objective.trainable_module())
    t = Shape.of(objective.target_config)
    student = layers * layer_saved(shape, n, a) + 2 * n * shape.hidden_size * a
    teacher = 0 if step.shards else frozen_forward(t, n, step.target_element)
    return student + teacher + chunked(step.chunk, n, t.vocab_size, copies=6)


class KnowledgeDistillation(DraftObjective):
    """Distils a drafter from an online target, or from target shards, on the datamodule's sequences."""

    honours_document_ids = True  # teacher and student both see the batch's document_ids

    def __init__(
        self,
        target: str,
        drafter: str | None = None,
        drafter_config: dict[str, int | float | str | bool] | None = None,
        loss: Literal["kl", "reverse_kl", "jsd", "tv", "nla", "lk_hybrid"] = "kl",
        lk_eta: float = DEFAULT_ETA,
        beta: float = 0.5,
        temperature: float = 1.0,
        alpha: float = 0.0,
        loss_chunk_size: int = 256,
        target_dtype: str = "float32",
        drafter_dtype: str = "float32",
        export_dir: str | None = None,
        trust_remote_code: bool = False,
        seed: int = 0,
        target_signals: TargetSignals = "online",
        tail: Literal["renormalize", "bucket"] = "renormalize",
        optim: Optim = Optim(),
    ) -> None:
        """
        Args:
            target: the target, an HF causal LM directory or hub id (its tokenizer is expected beside it).
            drafter: a pretrained drafter to start from (directory or hub id); None builds one from drafter_config.
            drafter_config: overrides of the target's config for a fresh drafter, e.g. {num_hidden_layers: 2}.
            loss: the loss toward the target's distribution: kl is KL(target || drafter), reverse_kl KL(drafter ||
                target), jsd the generalized Jensen-Shannon divergence with weight beta (TRL's GKD convention: 0 is
                the forward KL, 1 the reverse KL); tv the total variation 1 - alpha, nla the negative log-acceptance
                -log(alpha), lk_hybrid lambda * KL + (1 - lambda) * TV with lambda = exp(-lk_eta * alpha) (the LK
                losses, trainer/losses/distribution.py; alpha = sum_v min(p_v, q_v), the expected acceptance). From
                shards: kl, tv, nla or lk_hybrid.
            lk_eta: the hybrid's eta (loss=lk_hybrid only), >= 0.
            beta: the JSD interpolation weight, used only with loss=jsd.
            temperature: softens both distributions; kl, reverse_kl and jsd are multiplied by temperature squared,
                the LK losses are taken at that temperature as they are.
            alpha: weight of the cross entropy on the hard labels; the distillation loss gets 1 - alpha.
            loss_chunk_size: positions per chunk of the loss; each chunk's float32 logits are freed before the next.
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype (Lightning's precision plugin may still autocast).
            export_dir: where the drafter is saved as an HF checkpoint (safetensors and tokenizer) at the end of fit.
            trust_remote_code: allow custom modelling code in the target or drafter directory (off by default).
            seed: seed for the fresh drafter's initialisation.
            target_signals: "online" runs the target in every step; "shards" reads its top-k from the batches of
                a ShardDataModule (written by ``draftsmith precompute``), loading only the target's config and
                tokenizer.
            tail: with shards, how the mass outside the top-k is treated: "renormalize" (both distributions restricted
                to the k ids) or "bucket" (one extra outcome each); see trainer.losses.distillation.sparse_kd_loss.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        if not 0.0 <= alpha <= 1.0:
            raise RecipeError(f"model.alpha must be in [0, 1], got {alpha}")
        if temperature <= 0:
            raise RecipeError(f"model.temperature must be positive, got {temperature}")
        self.loss_spec = DistributionLoss.from_options(loss, lk_eta, KD_LOSSES)
        if target_signals == "shards" and loss not in SPARSE_LOSSES:
            raise RecipeError(
                f"model.loss={loss!r}: target shards hold the top-k only, use one of {', '.join(SPARSE_LOSSES)}"
            )
        self.beta, self.temperature, self.alpha = beta, temperature, alpha
        self.loss_chunk_size, self.export_dir, self.tail = loss_chunk_size, export_dir, tail
        # in the module tree: ZeRO-3 partitions a large target; from shards only its config (and tokenizer) is read
        frozen = self.load_target(
            target, target_signals, target_dtype, trust_remote_code, shard_tensors=False, in_module_tree=True,
            record_as="teacher",  # the name checkpoints have recorded it under
        )  # fmt: skip
        self.target_width = int(self.target_config.vocab_size) if frozen is None else frozen.vocab_size
        torch.manual_seed(seed)
        # `student`: the drafter's attribute, whose name prefixes its weights in checkpoints
        self.student = build_drafter(self.target_config, drafter, drafter_config, drafter_dtype)
        self.vocab_size = drafter_vocab_size(self, self.target_width, self.student, drafter)

    def trainable_module(self) -> nn.Module:
        return self.student

    def data_requirements(self) -> DataRequirements:
        """The target's tokenizer; shards of its top-k at this temperature."""
        return DataRequirements(self.target_width, self.vocab_size, temperature=self.temperature)

    def activation_bytes(self, step: PlannedStep) -> int:
        return distillation_activation_bytes(self, step)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        input_ids, labels, loss_mask = batch["input_ids"], batch["labels"], batch["loss_mask"]  # [B, S] each
        documents = batch.get("document_ids")  # [B, S] packed rows with document masking, else absent
        student_inputs = document_kwargs(self.student, documents)
        V = self.vocab_size
        options = dict(
            loss=self.loss_spec.name,
            lk_eta=self.loss_spec.eta,
            beta=self.beta,
            temperature=self.temperature,
            alpha=self.alpha,
        )
        hard_labels = labels if self.alpha > 0 else None
        if self.target_signals == "shards":
            student_logits = self.student(input_ids=input_ids, use_cache=False, **student_inputs).logits[..., :V]
            out = sparse_kd_loss(
                student_logits,
                batch["teacher_topk_ids"].long(),  # [B, S, k]
                batch["teacher_topk_logprobs"].float(),  # [B, S, k]
                loss_mask,
                hard_labels,
                tail=self.tail,
                temperature=self.temperature,
                alpha=self.alpha,
                chunk_size=self.loss_chunk_size,
                loss=self.loss_spec.name,
                lk_eta=self.loss_spec.eta,
            )
        elif self.weights_are_sharded():
            # FSDP2 / ZeRO-3: the output weight is only a shard outside the forward, so take the logits from the
            # forward ([B, S, V] in the model's dtype) and upcast them to float32 one chunk of positions at a time.
            student_logits = self.student(input_ids=input_ids, use_cache=False, **student_inputs).logits[..., :V]
            target_logits = self.target(input_ids, document_ids=documents).logits[..., :V]  # [B, S, V]
            out = kd_loss(
                student_logits, target_logits, loss_mask, hard_labels, chunk_size=self.loss_chunk_size, **options
            )
        else:
            # both models' own logits: the output scaling each one's forward applies after its lm_head (a drafter
            # built from a Gemma-2 target's config soft-caps as the target does), as the two branches above see it
            target_hidden = self.target.final_hidden(input_ids, document_ids=documents)  # [B, S, Ht]
            student_hidden = self.student.get_decoder()(
                input_ids=input_ids, use_cache=False, **student_inputs
            ).last_hidden_state  # [B, S, H]
            out = fused_kd_loss(
                student_hidden,  # [B, S, H]
                self.student.get_output_embeddings().weight[:V],  # [V, H]
                target_hidden,
                self.target.lm_head_weight[:V],  # [V, Ht]
                loss_mask,
                hard_labels,
                chunk_size=self.loss_chunk_size,
                student_scaling=LogitScaling.from_config(self.student.config),
                teacher_scaling=self.target.logit_scaling,
                **options,
            )
        metrics = {"kd": out.kd.detach(), "alpha_0": out.alpha}
        if out.ce is not None:
            metrics["ce"] = out.ce.detach()
        return out.loss, metrics

    def flops_per_token(self) -> float:
        seq_len = self.data_seq_len()
        drafter = causal_lm_flops_per_token(self.student, seq_len)
        if self.target is None:
            return 3.0 * drafter  # forward and backward of the drafter; the target ran in precompute
        target = causal_lm_flops_per_token(self.target.model, seq_len)
        return 3.0 * drafter + target  # forward and backward of the drafter, forward of the target

    def drafter_record(self) -> DrafterRecord:
        return hf_causal_lm.make_record(self.student, "student", self.target_path, self.target_config)

    def on_train_end(self) -> None:
        if self.export_dir:
            export_student(self, self.student, self.export_dir, self.target_path)
