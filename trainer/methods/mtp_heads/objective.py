"""Parallel multi-token prediction (Gloeckle et al., 2024): a causal LM trained with n heads, head i predicting the
token i positions after the next one, for pre-training from scratch or fine-tuning an existing HF model.

The model and its heads are module.py: the trunk is the model's layers ``0 .. L - 2``, head 0 its
last layer (so trunk + head 0 is the ordinary model), heads ``1 .. n - 1`` extra decoder layers of the same class
on the trunk output, all sharing the final norm and lm_head. The loss is ``sum_i w_i CE_i`` (``head_weights``, default
all 1); logged per head as ``loss_head{i}``.

The memory-saving backward (``head_backward``): ``sequential`` runs the heads' forward and backward one after the
other inside one autograd Function, each head's logits a chunk of ``loss_chunk_size`` positions at a time, accumulating
the gradient of the trunk output, then the trunk runs one backward; Lightning's automatic optimization, DDP and
DeepSpeed ZeRO-1/2 see a single backward in which every parameter's gradient arrives once (the shared lm_head's
summed over the heads), micro-batch after micro-batch under gradient accumulation. Under ZeRO-3 and FSDP2 a parameter
is only a shard outside its module's forward, so ``auto`` switches to ``checkpoint``: every head's loss under
activation checkpointing, one head's logits alive at a time in forward and in backward. ``naive`` keeps all heads'
logits (the reference). All three give the same gradients (tested in float64, in one process and in two under DDP and
ZeRO-2, with and without gradient accumulation).

Pre-training (``tokenizer`` and ``target_config``): a fresh Llama of ``len(tokenizer)`` tokens, the tiny target's shape
by default (CausalLMPretraining's), overridden key by key (recipes/quickstart/mtp_heads_pretrain.yaml). Fine-tuning
(``target``): an existing HF model whose extra heads start as copies of its last layer (``head_init``); ``train:
heads`` freezes the model and trains the extra heads only (the model's outputs then never change).

Keeping the model's outputs (``target_kl_weight``, fine-tuning with ``train: all``): the loss gains
``target_kl_weight * KL(p_original || q_model)``, the forward KL from a frozen copy of the model as it was loaded
(``target``) to the model's own next-token distribution (trunk + head 0), averaged over the trained positions and
logged as ``target_kl``. The copy is declared with ``track_frozen`` (as ``original``: checkpoints keep its fingerprint,
never its weights) and kept out of the module tree. Trained on the target's own greedy completions without it, the
fine-tune drifts towards repeating itself (docs/benchmarks/mtp-heads.md).

What the heads learn (``labels``): the data's tokens (cross entropy, the paper's), or the frozen original's
distribution (``original``: head i's loss at position t is its forward KL from the original's next-token distribution
at t + i, head 0's included, which then also carries ``target_kl_weight``), so that no head pulls the shared trunk
towards the data where the original predicts otherwise. With ``labels: original``, ``loss`` is the loss toward that
distribution (``kl``, the forward KL; ``tv``, ``nla``, ``lk_hybrid``: trainer/losses/distribution.py), and every
head's expected acceptance under it, ``sum_v min(p_v, q_v)``, is logged as ``alpha_head{i}`` beside
``loss_head{i}`` (computed in the same chunked pass as the loss).

Validation also measures every head's accuracy (``val/acc_head{i}``) and how often extra head i's top-k tokens hold
head 0's argmax i positions later (``val/agree_head{i}``, top 1): the last measurement is kept in the module and
exported, and the drafting tree for a node budget is built from it. At the end of fit the model is written to
``export_dir`` as an HF checkpoint with the heads beside it (export.py); ``draftsmith eval --target
DIR --drafter DIR`` measures self-speculative decoding with the heads (K = n - 1 drafts).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedModel

from trainer.data.vocab import load_tokenizer_if_present
from trainer.interface.errors import RecipeError
from trainer.losses.distribution import DEFAULT_ETA, LOSSES, DistributionLoss
from trainer.methods.mtp_heads import export as mtp_export
from trainer.methods.mtp_heads import kind as mtp_kind
from trainer.methods.mtp_heads.module import MTPHeads, Original
from trainer.models.llama import new_llama_config
from trainer.models.target import resolve_dtype
from trainer.training.activation_memory import PlannedStep, causal_lm_layers, chunked, frozen_forward, layer_saved
from trainer.training.objective import DataRequirements, DraftObjective, causal_lm_flops_per_token, count_params
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

log = logging.getLogger(__name__)

FRESH_MODEL: dict[str, int | float | str | bool] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
"""The fresh model's shape before ``target_config`` overrides: the tiny target's (methods/draft_model/pretrain.py)."""


def fresh_llama(tokenizer, overrides: dict[str, int | float | str | bool] | None, seed: int) -> LlamaForCausalLM:
    """A fresh Llama of ``len(tokenizer)`` tokens, :data:`FRESH_MODEL` with ``overrides``, initialised from ``seed``
    exactly as CausalLMPretraining initialises the same shape."""
    if "vocab_size" in (overrides or {}):
        raise RecipeError("model.target_config: vocab_size is the tokenizer's length, do not set it")
    config = new_llama_config(tokenizer, {**FRESH_MODEL, **(overrides or {})}, "model.target_config")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def mtp_flops_per_token(heads: MTPHeads, seq_len: int) -> float:
    """Forward FLOPs per token of the trunk and all heads (2 per weight, attention scores and values; every head's
    unembedding counted, the shared weight being applied n times)."""
    cfg = heads.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 2 * 2 * cfg.num_attention_heads * head_dim * seq_len
    unembedding = heads.model.lm_head.weight.numel()
    extra = sum(2.0 * count_params(h) + attention + 2.0 * unembedding for h in heads.heads)
    return causal_lm_flops_per_token(heads.model, seq_len) + extra


class ParallelMTPHeads(DraftObjective):
    """Trains a causal LM with parallel multi-token-prediction heads."""

    def __init__(
        self,
        target: str | None = None,
        tokenizer: str | None = None,
        target_config: dict[str, int | float | str | bool] | None = None,
        num_heads: int = 4,
        head_weights: list[float] | None = None,
        head_init: Literal["copy", "random"] = "copy",
        train: Literal["all", "heads"] = "all",
        head_backward: Literal["auto", "sequential", "checkpoint", "naive"] = "auto",
        heads_lr_multiplier: float = 1.0,
        target_kl_weight: float = 0.0,
        labels: Literal["data", "original"] = "data",
        loss: Literal["kl", "tv", "nla", "lk_hybrid"] = "kl",
        lk_eta: float = DEFAULT_ETA,
        loss_chunk_size: int = 256,
        target_dtype: str = "float32",
        export_dir: str | None = None,
        trust_remote_code: bool = False,
        seed: int = 0,
        optim: Optim = Optim(),
    ) -> None:
        """
        Args:
            target: an existing HF causal LM to fine-tune with new heads (directory or hub id; its tokenizer is
                expected beside it); None pre-trains a fresh Llama from ``tokenizer`` and ``target_config``.
            tokenizer: the tokenizer directory of a fresh model (its length is the vocabulary; saved beside the
                model); with ``target``, a tokenizer to use instead of the one beside it.
            target_config: overrides of the fresh model's config (the tiny target's shape), e.g.
                {num_hidden_layers: 8}; only without ``target``.
            num_heads: n, the heads including head 0 (the model's own last layer): n - 1 drafts per round.
            head_weights: the loss weight of every head (n values; default all 1).
            head_init: the extra heads start as copies of the last layer ("copy") or freshly initialised ("random").
            train: "all" trains the model and the heads; "heads" freezes the model and trains the extra heads only.
            head_backward: "sequential" (heads one after the other inside one backward, logits chunked), "checkpoint"
                (per-head activation checkpointing, for ZeRO-3 and FSDP2), "naive" (every head's logits alive),
                or "auto": checkpoint when the weights are sharded, else sequential.
            heads_lr_multiplier: the extra heads' learning rate as a multiple of ``optim.lr``.
            target_kl_weight: fine-tuning with ``train: all``: the weight of ``KL(p_original || q_model)``, the
                forward KL from a frozen copy of ``target`` to the model's next-token distribution, added to the
                heads' loss so that the model keeps its outputs (0: off; >= 0). Needs ``target``; the frozen copy
                costs one more model in memory and its forward in every step.
            labels: what every head (head 0 included) learns: "data", the rows' next tokens (cross entropy), or
                "original", the frozen copy of ``target``'s next-token distribution (head i at t: the forward KL from
                the copy's distribution at t + i, over the positions with a label), so that the heads draft what the
                model predicts rather than the data, and the model's own output is held to the original's. Needs
                ``target``; the frozen copy costs what ``target_kl_weight`` costs.
            loss: with labels=original, every head's loss toward the copy's distribution: kl (the forward KL), tv
                (total variation), nla (negative log-acceptance) or lk_hybrid (trainer/losses/distribution.py);
                labels=data takes the cross entropy and needs kl. target_kl_weight then adds to head 0's weight on
                this loss.
            lk_eta: the hybrid's eta (loss=lk_hybrid only), >= 0.
            loss_chunk_size: positions per chunk of a head's logits.
            target_dtype: the weights' dtype (float32, bfloat16, float16, float64).
            export_dir: where the model (HF checkpoint and tokenizer) and its heads are written at the end of fit.
            trust_remote_code: allow custom modelling code in the model's directory (off by default).
            seed: seed of the fresh model's and the heads' initialisation.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        # not the tokenizer: Lightning refuses a module hparam of the datamodule's name with another value (None here
        # when fine-tuning, the data's tokenizer there)
        self.save_hyperparameters(ignore=["optim", "tokenizer"])
        if num_heads < 1:
            raise RecipeError(f"model.num_heads must be >= 1 (head 0 is the model's last layer), got {num_heads}")
        if head_weights is not None and (len(head_weights) != num_heads or min(head_weights) < 0):
            raise RecipeError(f"model.head_weights needs {num_heads} values >= 0 (one per head), got {head_weights}")
        if loss_chunk_size < 1:
            raise RecipeError(f"model.loss_chunk_size must be >= 1, got {loss_chunk_size}")
        if train not in ("all", "heads") or head_backward not in ("auto", "sequential", "checkpoint", "naive"):
            raise RecipeError(f"model.train={train!r} or model.head_backward={head_backward!r} is not a known value")
        if not target_kl_weight >= 0.0:
            raise RecipeError(f"model.target_kl_weight must be >= 0, got {target_kl_weight}")
        if target_kl_weight > 0 and (target is None or train != "all"):
            raise RecipeError(
                f"model.target_kl_weight={target_kl_weight} keeps a fine-tuned model close to the model it started "
                "from: it needs model.target and train: all (a fresh model has no original, and train: heads never "
                "changes the model); set it to 0"
            )
        if labels not in ("data", "original"):
            raise RecipeError(f"model.labels={labels!r} is not 'data' or 'original'")
        self.loss_spec = DistributionLoss.from_options(loss, lk_eta, LOSSES)
        if not self.loss_spec.is_kl and labels != "original":
            raise RecipeError(
                f"model.loss={loss!r} trains the heads toward the original's distribution: it needs labels: original"
            )
        if labels == "original" and target is None:
            raise RecipeError(
                "model.labels=original trains every head on the distribution of the model it started from: it needs "
                "model.target (a fresh model has no original); use labels: data"
            )
        torch_dtype = resolve_dtype(target_dtype) if target_dtype != "float64" else torch.float64
        if target is not None:
            if target_config:
                raise RecipeError(
                    "set either model.target (fine-tune an existing model) or model.target_config, not both"
                )
            hf_model = AutoModelForCausalLM.from_pretrained(
                target, dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
            if target_kl_weight > 0 or labels == "original":  # the frozen original, out of the module tree
                read_as = "float32" if torch_dtype == torch.float64 else target_dtype
                self.load_target(target, "online", read_as, trust_remote_code, record_as="original")
                self.target.to(torch_dtype)
            self.tokenizer_path = tokenizer or target
            self.tokenizer = load_tokenizer_if_present(self.tokenizer_path)
        else:
            if tokenizer is None:
                raise RecipeError("pre-training a fresh model needs model.tokenizer (or fine-tune model.target)")
            self.tokenizer_path = tokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            hf_model = fresh_llama(self.tokenizer, target_config, seed).to(torch_dtype)
        torch.manual_seed(seed)
        self.mtp = MTPHeads(hf_model, num_heads, head_init=head_init)
        if train == "heads":
            if num_heads < 2:
                raise RecipeError("model.train: heads trains the extra heads, and num_heads=1 has none")
            self.mtp.model.requires_grad_(False)
        self.target_path = target  # trained with its heads: not a frozen target
        self.head_weights = head_weights
        self.train_mode, self.head_backward, self.heads_lr_multiplier = train, head_backward, heads_lr_multiplier
        self.loss_chunk_size, self.export_dir = loss_chunk_size, export_dir
        self.target_kl_weight, self.labels = target_kl_weight, labels
        self._agreement: list[torch.Tensor] = []

    def trainable_module(self) -> nn.Module:
        return self.mtp

    def lr_groups(self) -> list[tuple[nn.Module, float]]:
        """The model at ``optim.lr``, the extra heads at ``heads_lr_multiplier`` times it."""
        return [(self.mtp.model, 1.0), (self.mtp.heads, self.heads_lr_multiplier)]

    def data_requirements(self) -> DataRequirements:
        """The model's tokenizer."""
        width = int(self.mtp.model.get_output_embeddings().weight.shape[0])
        return DataRequirements(width, name=self.target_path or f"the fresh model of {self.tokenizer_path}")

    def backward_mode(self) -> str:
        """The head backward this run uses: ``head_backward``, with ``auto`` resolved for the strategy."""
        sharded = self.weights_are_sharded()
        if self.head_backward == "auto":
            return "checkpoint" if sharded else "sequential"
        if self.head_backward == "sequential" and sharded:
            raise RecipeError(
                "model.head_backward=sequential reads whole parameters, but this strategy shards them (ZeRO-3, "
                "FSDP2): use auto or checkpoint"
            )
        return self.head_backward

    # ---- training ----------------------------------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        measure = not torch.is_grad_enabled()  # validation: accuracies and agreement too
        distill = self.labels == "original"
        weights = self.head_weights or [1.0] * self.mtp.num_heads
        if distill:  # head 0's loss is the KL to the original: target_kl_weight adds to its weight
            weights = [weights[0] + self.target_kl_weight, *weights[1:]]
        out = self.mtp(
            batch["input_ids"],
            batch["labels"],
            backward=self.backward_mode(),
            chunk_size=self.loss_chunk_size,
            weights=weights,
            measure=measure,
            original=self.original(batch),
            distill=distill,
            loss=self.loss_spec,
        )
        metrics = {f"loss_head{i}": out.head_losses[i].float() for i in range(self.mtp.num_heads)}
        loss = out.loss.float()
        if out.head_alpha is not None:  # the heads' acceptance under the original, from the loss's chunked pass
            metrics.update({f"alpha_head{i}": out.head_alpha[i].float() for i in range(self.mtp.num_heads)})
        if distill and self.target_kl_weight > 0:
            metrics["target_kl"] = out.head_losses[0].float()
        if out.target_kl is not None:
            loss = loss + self.target_kl_weight * out.target_kl
            metrics["target_kl"] = out.target_kl.detach()
        if out.head_accuracy is not None:
            metrics.update({f"acc_head{i}": out.head_accuracy[i] for i in range(self.mtp.num_heads)})
        if out.agreement is not None and out.agreement.numel():
            self._agreement.append(torch.cat([out.agreement, out.agreement_count[:, None]], dim=1).cpu())
            rates = out.agreement[:, 0] / out.agreement_count.clamp(min=1)
            metrics.update({f"agree_head{i + 1}": rates[i].float() for i in range(rates.numel())})
        return loss, metrics

    def original(self, batch: dict[str, torch.Tensor]) -> Original | None:
        """The frozen original's final normed hidden states on the batch (``target_kl_weight > 0`` or ``labels:
        original``), else None."""
        if self.target_kl_weight <= 0 and self.labels != "original":
            return None
        frozen = self.target  # the frozen original, out of the module tree
        ids = batch["input_ids"]  # [B, S]
        return Original(
            frozen.final_hidden(ids), frozen.lm_head_weight, batch["loss_mask"].bool(), frozen.logit_scaling
        )

    def on_validation_epoch_start(self) -> None:
        self._agreement = []

    def on_validation_epoch_end(self) -> None:
        """Keep this validation's agreement of the extra heads with head 0 (trees are built from it)."""
        if self._agreement:
            total = torch.stack(self._agreement).sum(0)  # [n - 1, R + 1]
            self.mtp.record_agreement(total[:, :-1], total[:, -1])
        self._agreement = []

    def flops_per_token(self) -> float:
        flops = 3.0 * mtp_flops_per_token(self.mtp, self.data_seq_len())
        if self.labels == "original":  # the original's forward, its projection for every head's KL (no more of ours)
            flops += causal_lm_flops_per_token(self.mtp.model, self.data_seq_len())
            flops += self.mtp.num_heads * 2.0 * self.mtp.model.lm_head.weight.numel()
        elif self.target_kl_weight > 0:  # the original's forward, head 0 and both projections once more
            model = self.mtp.model
            unembedding = 2.0 * model.lm_head.weight.numel()
            flops += causal_lm_flops_per_token(model, self.data_seq_len()) + unembedding
            flops += 3.0 * (2.0 * count_params(self.mtp.head(0)) + unembedding)
        return flops

    def activation_bytes(self, step: PlannedStep) -> int:
        """The trunk's saved tensors (``train: all``; else its forward), the heads' (one layer and each head's
        output), the frozen original's forward (``target_kl_weight``) and a chunked loss."""
        n, a, a_t = step.tokens, step.element, step.target_element
        t, layers = causal_lm_layers(self.mtp.model)
        trunk = layers * layer_saved(t, n, a) if self.train_mode == "all" else frozen_forward(t, n, a_t)
        kl = frozen_forward(t, n, a_t) if self.target_kl_weight else 0
        heads = self.mtp.num_heads * n * t.hidden_size * a
        copies = 3 if self.loss_spec.is_kl else 6  # an LK loss takes its gradient by autograd on the chunk
        return trunk + layer_saved(t, n, a) + heads + kl + chunked(step.chunk, n, t.vocab_size, copies=copies)

    # ---- what was trained --------------------------------------------------------------------------------------------
    def drafter_record(self) -> DrafterRecord:
        """Kind ``mtp_heads``: the model with its heads, its own target (at ``export_dir`` once written)."""
        return mtp_kind.make_record(
            self.mtp, "mtp", self.export_dir, self.tokenizer_path, self.target_path, self.target_kl_weight, self.labels
        )

    def speculative_eval_target(self) -> PreTrainedModel:
        """The model being trained: with parallel heads the model drafts for itself.

        When the model trains (``train: all``) its own greedy output changes from one evaluation to the next, but
        SpeculativeEvalCallback keeps the target-alone output of its first evaluation (made for frozen targets): it is
        cleared here, so that every evaluation checks against the model as it is now.
        """
        if self.weights_are_sharded():
            raise RecipeError(
                "under ZeRO-3 and FSDP2 the model's weights are shards, which SpeculativeEvalCallback cannot decode "
                "with: measure the export with draftsmith eval --target DIR --drafter DIR"
            )
        if self._trainer is not None and any(p.requires_grad for p in self.mtp.model.parameters()):
            from trainer.decoding.callback import SpeculativeEvalCallback

            for callback in self.trainer.callbacks:
                if isinstance(callback, SpeculativeEvalCallback):
                    callback._reference = None  # the callback's cache of the target alone: stale after a step
        return self.mtp.model

    def on_train_end(self) -> None:
        if self.export_dir:
            from trainer.distributed.strategies import full_state_dict

            state = full_state_dict(self.mtp) if self.weights_are_sharded() else None
            self._save(state)

    @rank_zero_only
    def _save(self, state: dict[str, torch.Tensor] | None) -> None:
        path = mtp_export.save(
            self.mtp, self.export_dir, self.tokenizer_path, state, self.target_path, self.target_kl_weight, self.labels
        )
        log.info("model and %d heads saved to %s", self.mtp.num_heads, path)
