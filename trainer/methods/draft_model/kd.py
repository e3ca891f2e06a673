"""Soft-label knowledge distillation from an online teacher or from precomputed teacher shards.

Online (``teacher_signals: online``): the frozen target runs inside the training step; the student (any HF causal
LM, smaller than the target) learns to match the target's temperature-softened distribution at every trained position
(forward KL, reverse KL or generalized JSD), optionally mixed with cross entropy on the hard labels. The loss is
computed in chunks of positions (``trainer.losses``) so that the float32 full-vocabulary logits of both models for the
whole batch never exist at once.

Offline (``teacher_signals: shards``): the batches carry the teacher's top-k ids and log-probabilities written by
``draftsmith precompute`` (trainer/data/shard_datamodule.py); only the teacher's config and tokenizer are loaded, never
its weights, and the loss is the sparse forward KL (``sparse_kd_loss``) with the tail renormalised or kept as one
bucket. At setup the shards are checked against this teacher (fingerprint), the student's vocabulary, the tokenizer
and the temperature; a mismatch is refused. With k equal to the vocabulary it is the online loss.
"""

from __future__ import annotations

import copy
import logging
from typing import Literal

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from trainer.data.shard_datamodule import checked_shard_data
from trainer.export.hf import export_student
from trainer.losses import fused_kd_loss, kd_loss, sparse_kd_loss
from trainer.methods.draft_model import kind as hf_causal_lm
from trainer.objective import DraftObjective, Optim, causal_lm_flops_per_token
from trainer.registry import DrafterRecord
from trainer.target import FrozenTarget, resolve_dtype
from trainer.vocab import check_data_tokenizer, load_tokenizer_if_present, shared_vocab_size

log = logging.getLogger(__name__)


def build_student(
    teacher_config, student: str | None, student_config: dict[str, int | float | str | bool] | None, dtype: str
) -> PreTrainedModel:
    """Loads a pretrained student, or builds a fresh one from the teacher's config with ``student_config`` overrides."""
    if student is not None:
        if student_config:
            raise ValueError("set either model.student (a pretrained student) or model.student_config, not both")
        return AutoModelForCausalLM.from_pretrained(student, dtype=resolve_dtype(dtype))
    config = copy.deepcopy(teacher_config)
    for key, value in (student_config or {}).items():
        if not hasattr(config, key):
            raise ValueError(f"model.student_config: {key!r} is not a key of the teacher's {config.model_type} config")
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(dtype))


class KnowledgeDistillation(DraftObjective):
    """Distils a student from an online teacher, or from teacher shards, on the datamodule's sequences."""

    def __init__(
        self,
        teacher: str,
        student: str | None = None,
        student_config: dict[str, int | float | str | bool] | None = None,
        divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl",
        beta: float = 0.5,
        temperature: float = 1.0,
        alpha: float = 0.0,
        chunk_size: int = 256,
        teacher_dtype: str = "float32",
        student_dtype: str = "float32",
        export_dir: str | None = None,
        trust_remote_code: bool = False,
        seed: int = 0,
        teacher_signals: Literal["online", "shards"] = "online",
        tail: Literal["renormalize", "bucket"] = "renormalize",
        optim: Optim = Optim(),
    ) -> None:
        """
        Args:
            teacher: the target, an HF causal LM directory or hub id (its tokenizer is expected beside it).
            student: a pretrained student to start from (directory or hub id); None builds one from student_config.
            student_config: overrides of the teacher's config for a fresh student, e.g. {num_hidden_layers: 2}.
            divergence: forward_kl is KL(teacher || student), reverse_kl KL(student || teacher), jsd the generalized
                Jensen-Shannon divergence with weight beta (TRL's GKD convention: 0 is forward KL, 1 reverse KL).
            beta: the JSD interpolation weight, used only with divergence=jsd.
            temperature: softens both distributions; the divergence is multiplied by temperature squared.
            alpha: weight of the cross entropy on the hard labels; the divergence gets 1 - alpha.
            chunk_size: positions per chunk of the loss; each chunk's float32 logits are freed before the next.
            teacher_dtype: the teacher's weights dtype (float32, bfloat16, float16).
            student_dtype: the student's weights dtype (Lightning's precision plugin may still autocast).
            export_dir: where the student is saved as an HF checkpoint (safetensors and tokenizer) at the end of fit.
            trust_remote_code: allow custom modelling code in the teacher or student directory (off by default).
            seed: seed for the fresh student's initialisation.
            teacher_signals: "online" runs the teacher in every step; "shards" reads its top-k from the batches of
                a ShardDataModule (written by ``draftsmith precompute``), loading only the teacher's config and
                tokenizer.
            tail: with shards, how the mass outside the top-k is treated: "renormalize" (both distributions
                restricted to the k ids) or "bucket" (one extra outcome each); see trainer.losses.sparse_kd_loss.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"model.alpha must be in [0, 1], got {alpha}")
        if temperature <= 0:
            raise ValueError(f"model.temperature must be positive, got {temperature}")
        self.teacher_path = teacher
        self.divergence, self.beta, self.temperature, self.alpha = divergence, beta, temperature, alpha
        self.chunk_size = chunk_size
        self.export_dir = export_dir
        self.teacher_signals, self.tail = teacher_signals, tail
        if teacher_signals == "shards":
            if divergence != "forward_kl":
                raise ValueError(f"model.divergence={divergence!r}: teacher shards hold top-k only, use forward_kl")
            self.teacher: FrozenTarget | None = None
            teacher_config = AutoConfig.from_pretrained(teacher, trust_remote_code=trust_remote_code)
            teacher_width = int(teacher_config.vocab_size)
        elif teacher_signals == "online":
            self.teacher = FrozenTarget.from_pretrained(teacher, teacher_dtype, trust_remote_code)
            teacher_config, teacher_width = self.teacher.config, self.teacher.vocab_size
        else:
            raise ValueError(f"model.teacher_signals={teacher_signals!r} is not 'online' or 'shards'")
        self.teacher_config = teacher_config
        self.track_frozen("teacher", teacher, teacher_config)
        torch.manual_seed(seed)
        self.student = build_student(teacher_config, student, student_config, student_dtype)
        self.tokenizer = load_tokenizer_if_present(teacher)
        self.vocab_size = shared_vocab_size(
            teacher_name=teacher,
            teacher_tokenizer=self.tokenizer,
            teacher_width=teacher_width,
            student_name=student or "a student built from the teacher's config",
            student_tokenizer=load_tokenizer_if_present(student) if student else self.tokenizer,
            student_width=self.student.get_output_embeddings().weight.shape[0],
        )

    def trainable_module(self) -> nn.Module:
        return self.student

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if self.teacher_signals == "shards":
            checked_shard_data(
                datamodule,
                vocab_size=self.vocab_size,
                tokenizer=self.tokenizer,
                teacher=self.teacher_path,
                temperature=self.temperature,
            )
            return
        check_data_tokenizer(datamodule, self.teacher_path, self.tokenizer, self.teacher.vocab_size, self.vocab_size)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        input_ids, labels, loss_mask = batch["input_ids"], batch["labels"], batch["loss_mask"]  # [B, S] each
        V = self.vocab_size
        options = dict(divergence=self.divergence, beta=self.beta, temperature=self.temperature, alpha=self.alpha)
        hard_labels = labels if self.alpha > 0 else None
        if self.teacher_signals == "shards":
            student_logits = self.student(input_ids=input_ids, use_cache=False).logits[..., :V]  # [B, S, V]
            out = sparse_kd_loss(
                student_logits,
                batch["teacher_topk_ids"].long(),  # [B, S, k]
                batch["teacher_topk_logprobs"].float(),  # [B, S, k]
                loss_mask,
                hard_labels,
                tail=self.tail,
                temperature=self.temperature,
                alpha=self.alpha,
                chunk_size=self.chunk_size,
            )
        elif self.weights_are_sharded():
            # FSDP2 / ZeRO-3: the output weight is only a shard outside the forward, so take the logits from the
            # forward ([B, S, V] in the model's dtype) and upcast them to float32 one chunk of positions at a time.
            student_logits = self.student(input_ids=input_ids, use_cache=False).logits[..., :V]  # [B, S, V]
            teacher_logits = self.teacher(input_ids).logits[..., :V]  # [B, S, V]
            out = kd_loss(student_logits, teacher_logits, loss_mask, hard_labels, chunk_size=self.chunk_size, **options)
        else:
            teacher_hidden = self.teacher.final_hidden(input_ids)  # [B, S, Ht]
            student_hidden = self.student.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
            out = fused_kd_loss(
                student_hidden,  # [B, S, H]
                self.student.get_output_embeddings().weight[:V],  # [V, H]
                teacher_hidden,
                self.teacher.lm_head_weight[:V],  # [V, Ht]
                loss_mask,
                hard_labels,
                chunk_size=self.chunk_size,
                **options,
            )
        metrics = {"kd": out.kd.detach()}
        if out.ce is not None:
            metrics["ce"] = out.ce.detach()
        return out.loss, metrics

    def flops_per_token(self) -> float:
        seq_len = self.data_seq_len()
        student = causal_lm_flops_per_token(self.student, seq_len)
        if self.teacher is None:
            return 3.0 * student  # forward and backward of the student; the teacher ran in precompute
        teacher = causal_lm_flops_per_token(self.teacher.model, seq_len)
        return 3.0 * student + teacher  # forward and backward of the student, forward of the teacher

    def speculative_eval_target(self) -> PreTrainedModel:
        if self.teacher is None:
            raise ValueError(
                "teacher_signals: shards never builds the target, so SpeculativeEvalCallback cannot decode with it: "
                "measure the exported drafter with draftsmith eval, or train online"
            )
        return self.teacher.model

    def drafter_record(self) -> DrafterRecord:
        return hf_causal_lm.make_record(self.student, "student", self.teacher_path, self.teacher_config)

    def on_train_end(self) -> None:
        if self.export_dir:
            export_student(self, self.student, self.export_dir, self.teacher_path)
