"""Medusa heads: Medusa-1 (heads on a frozen target, online or from hidden-state shards) and Medusa-2 (heads and target
trained together).

Head k (0-based) reads the target's final normed hidden state at position t and predicts token t + 2 + k (the
target's own head predicts t + 1): its labels are the data's tokens (``labels: data``) or the target's own greedy
tokens, its argmax (``labels: argmax``; with regenerated data this is how Medusa is trained in practice), shifted by
1 + k, under the loss mask of that token; or (``labels: original``) the target's whole next-token distribution at
t + 1 + k, the frozen target's at stage 1 and the frozen original's with Medusa-2's self-distillation: head k's loss
is then its forward KL from that distribution over the same positions (the paper's self-distillation of the heads),
or another loss toward it (``loss``: ``tv``, ``nla``, ``lk_hybrid``, trainer/losses/distribution.py); head k's expected
acceptance under that distribution, ``sum_v min(p_v, q_v)``, is logged as ``alpha_{k}`` beside ``loss_{k}``.

- Medusa-1 (``stage: 1``): loss ``sum_k step_decay^k CE_k``; the target is frozen (a FrozenTarget: never in a
  checkpoint), or never built when its final hidden states come from shards (``target_signals: shards``, data
  ``hidden_layers`` ``[L]`` of ``draftsmith precompute``; only its config, embedding and lm_head are read, the lm_head
  for the heads' initialisation).
- Medusa-2 (``stage: 2``): loss ``L_lm + sum_k coef * step_decay^k * warmup(step) * CE_k`` (coef 0.2, step_decay
  0.8), where ``L_lm`` is the target's next-token loss, or with ``self_distillation`` the KL from a frozen copy of the
  original target to the trained one (its outputs do not drift from what it was); the heads learn
  ``heads_lr_multiplier`` (4) times faster than the target, which trains in full or its last ``trained_target_layers``
  layers and final norm; the warm-up of the heads' weight is constant, linear or sine over ``heads_warmup_steps``.

Every head's logits are computed in chunks of positions (trainer/losses/distillation.py), one head after the other, so
that the float32 logits of all heads never exist at once. The drafter (module.py) holds the heads and, for Medusa-2, the
trained target; drafter kind ``medusa`` (kind.py) exports it for vLLM or TGI.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.data.vocab import load_tokenizer_if_present
from trainer.interface.errors import RecipeError
from trainer.losses.distillation import SoftTargets, chunked_cross_entropy, fused_kd_loss
from trainer.losses.distribution import DEFAULT_ETA, LOSSES, DistributionLoss
from trainer.methods.medusa import kind as medusa_kind
from trainer.methods.medusa.module import MedusaConfig, MedusaDrafter
from trainer.models.logit_scaling import LogitScaling
from trainer.models.target import FrozenTarget, resolve_dtype
from trainer.training.activation_memory import PlannedStep, Shape, chunked, frozen_forward, layer_saved
from trainer.training.objective import (
    DataRequirements,
    DraftObjective,
    TargetSignals,
    causal_lm_flops_per_token,
    count_params,
)
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

IGNORE_INDEX = -100
log = logging.getLogger(__name__)


@torch.no_grad()
def chunked_argmax(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``argmax(hidden @ weight.T)`` over the vocabulary, ``chunk_size`` positions at a time: [B, S, H] -> [B, S].

    Also a model's own greedy token when its forward scales its logits (Cohere, Granite, Gemma-2's soft-cap,
    trainer/models/logit_scaling.py): a positive factor and the soft-cap are increasing, so they keep the argmax."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*S, H]
    out = torch.cat([(flat[i : i + chunk_size] @ weight.T).argmax(-1) for i in range(0, flat.shape[0], chunk_size)])
    return out.reshape(hidden.shape[:-1])


def shifted(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Head k's labels at position t: the label of position t + 1 + k ([B, S] -> [B, S], -100 past the row)."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, : labels.shape[1] - 1 - k] = labels[:, 1 + k :]
    return out


def warmup_factor(step: int, warmup_steps: int, shape: str) -> float:
    """The heads' loss weight multiplier at an optimizer step: constant 1, or rising linearly / as a sine to 1."""
    if shape == "constant" or warmup_steps <= 0:
        return 1.0
    progress = min(1.0, step / warmup_steps)
    return progress if shape == "linear" else math.sin(0.5 * math.pi * progress)


class Medusa(DraftObjective):
    """Trains Medusa heads on a frozen target (stage 1) or together with it (stage 2)."""

    def __init__(
        self,
        target: str,
        num_heads: int = 4,
        num_layers: int = 1,
        head_bias: bool = True,
        stage: Literal[1, 2] = 1,
        step_decay: float = 0.8,
        labels: Literal["data", "argmax", "original"] = "data",
        loss: Literal["kl", "tv", "nla", "lk_hybrid"] = "kl",
        lk_eta: float = DEFAULT_ETA,
        heads_coefficient: float = 0.2,
        heads_warmup: Literal["constant", "linear", "sine"] = "linear",
        heads_warmup_steps: int = 0,
        heads_lr_multiplier: float = 4.0,
        self_distillation: bool = False,
        trained_target_layers: int | None = None,
        target_signals: TargetSignals = "online",
        loss_chunk_size: int = 256,
        target_dtype: str = "float32",
        drafter_dtype: str = "float32",
        trust_remote_code: bool = False,
        seed: int = 0,
        optim: Optim = Optim(),
    ) -> None:
        """
        Args:
            target: the target, an HF causal LM directory or hub id (its tokenizer beside it).
            num_heads: K, the heads (drafts per round).
            num_layers: residual blocks per head.
            head_bias: the blocks' linear layers have a bias (vLLM's medusa_fc_bias).
            stage: 1 trains the heads on the frozen target (Medusa-1); 2 trains heads and target together.
            step_decay: head k's loss weight is step_decay ** k.
            labels: "data" (the rows' tokens), "argmax" (the target's own greedy tokens, its argmax) or "original"
                (the frozen target's distribution, the forward KL from it; at stage 2 the frozen original's, which
                needs self_distillation; online target signals only).
            loss: with labels=original, each head's loss toward that distribution: kl (the forward KL), tv (total
                variation), nla (negative log-acceptance) or lk_hybrid (trainer/losses/distribution.py); other labels
                take the cross entropy and need kl.
            lk_eta: the hybrid's eta (loss=lk_hybrid only), >= 0.
            heads_coefficient: stage 2: the heads' loss weight beside the target's loss.
            heads_warmup: stage 2: how the heads' weight rises over heads_warmup_steps (constant, linear, sine).
            heads_warmup_steps: stage 2: optimizer steps of that warm-up (0: none).
            heads_lr_multiplier: stage 2: the heads' learning rate as a multiple of the target's.
            self_distillation: stage 2: the target's loss is the KL from a frozen copy of the original target instead
                of the next-token loss on the data.
            trained_target_layers: stage 2: train the last this many decoder layers and the final norm (None: the
                whole target).
            target_signals: stage 1: "online" runs the target in every step; "shards" reads its final normed
                hidden states (data hidden_layers [L]) and top-k from a ShardDataModule and never builds it.
            loss_chunk_size: positions per chunk of every head's logits.
            target_dtype: the target's weights dtype (float32, bfloat16, float16; stage 2 trains it: not float16).
            drafter_dtype: the heads' weights dtype.
            trust_remote_code: allow custom modelling code in the target directory (off by default).
            seed: seed of the heads' initialisation.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        checks = {
            "num_heads": num_heads >= 1,
            "num_layers": num_layers >= 0,
            "step_decay": 0.0 < step_decay <= 1.0,
            "heads_coefficient": heads_coefficient > 0,
            "heads_lr_multiplier": heads_lr_multiplier > 0,
            "heads_warmup_steps": heads_warmup_steps >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise RecipeError(f"model.{name} is out of range: {locals()[name]!r}")
        if stage == 2 and target_signals == "shards":
            raise RecipeError("model.stage=2 trains the target, which shards cannot: use target_signals: online")
        if stage == 2 and target_dtype == "float16":
            raise RecipeError(
                "model.stage=2 trains the target's weights, which float16 cannot hold stably (no master copy): use "
                "target_dtype float32 or bfloat16, and trainer.precision bf16-mixed for half-precision compute"
            )
        if stage == 1 and (self_distillation or trained_target_layers is not None):
            raise RecipeError("model.self_distillation and model.trained_target_layers apply to stage 2 only")
        if labels == "original" and (target_signals == "shards" or (stage == 2 and not self_distillation)):
            raise RecipeError(
                "model.labels=original trains the heads on the frozen target's distribution: it needs "
                "target_signals: online and, at stage 2, self_distillation: true (the frozen original)",
                hint="use labels: argmax, or set what the message names",
            )
        self.loss_spec = DistributionLoss.from_options(loss, lk_eta, LOSSES)
        if not self.loss_spec.is_kl and labels != "original":
            raise RecipeError(
                f"model.loss={loss!r} trains the heads toward the target's distribution: it needs labels: original "
                f"(labels={labels!r} trains them on tokens, with the cross entropy)"
            )
        self.stage, self.step_decay, self.labels, self.loss_chunk_size = stage, step_decay, labels, loss_chunk_size
        self.heads_coefficient, self.heads_warmup, self.heads_warmup_steps = (
            heads_coefficient,
            heads_warmup,
            heads_warmup_steps,
        )
        self.heads_lr_multiplier, self.self_distillation = heads_lr_multiplier, self_distillation
        self.original: FrozenTarget | None = None
        model = None
        if stage == 1:  # frozen: in the module tree, as Lightning moves it and ZeRO-3 partitions it (never saved)
            frozen = self.load_target(target, target_signals, target_dtype, trust_remote_code, in_module_tree=True)
            config, lm_head = frozen.config, frozen.lm_head_weight
        else:  # trained with the heads: part of the drafter
            model = self._trained_target(target, target_dtype, trust_remote_code, trained_target_layers)
            config, lm_head = model.config, model.get_output_embeddings().weight
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_target_layers = int(text.num_hidden_layers)
        heads = MedusaConfig(
            hidden_size=int(text.hidden_size), vocab_size=int(lm_head.shape[0]), num_heads=num_heads,
            num_layers=num_layers, bias=head_bias, with_target=model is not None,
        )  # fmt: skip
        torch.manual_seed(seed)
        self.drafter = MedusaDrafter(heads, model)
        self.drafter.heads.init_from(lm_head)  # a target that ties its embedding: copies of the embedding
        if getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
            log.info(
                "%s ties its input embedding and lm_head: every head's output layer starts as a copy of that shared "
                "matrix and trains as a weight of its own, apart from the embedding",
                target,
            )
        self.drafter.heads.to(resolve_dtype(drafter_dtype))

    def _trained_target(
        self, target: str, dtype: str, trust_remote_code: bool, trained_layers: int | None
    ) -> PreTrainedModel:
        """Stage 2: the target, trained in full or its last ``trained_layers`` layers; its fingerprint (and with
        self-distillation a frozen copy of it, ``original``) kept as the run's frozen target."""
        model = AutoModelForCausalLM.from_pretrained(
            target, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
        )
        self._freeze_all_but_last(model, trained_layers)
        if self.self_distillation:
            self.original = FrozenTarget.from_pretrained(target, dtype, trust_remote_code)
            self.track_frozen("original", target, model.config)
        # under DeepSpeed the frozen layers are not saved: resume and export take them from the target's path
        self.strict_loading = trained_layers is None
        self.target_path, self.target_config = target, model.config
        self.tokenizer = load_tokenizer_if_present(target)
        self.track_frozen("target", target, model.config)
        return model

    @staticmethod
    def _freeze_all_but_last(model: PreTrainedModel, layers: int | None) -> None:
        """Stage 2 with a subset: only the last ``layers`` decoder layers and the final norm train."""
        if layers is None:
            return
        decoder = model.get_decoder()
        total = len(decoder.layers)
        if not 1 <= layers <= total:
            raise RecipeError(f"model.trained_target_layers={layers} must be in 1..{total} (the target's layers)")
        model.requires_grad_(False)
        for layer in decoder.layers[total - layers :]:
            layer.requires_grad_(True)
        decoder.norm.requires_grad_(True)

    def trainable_module(self) -> nn.Module:
        return self.drafter

    def lr_groups(self) -> list[tuple[nn.Module, float]]:
        if self.stage == 1:
            return [(self.drafter.heads, 1.0)]
        return [(self.drafter.model, 1.0), (self.drafter.heads, self.heads_lr_multiplier)]

    def data_requirements(self) -> DataRequirements:
        """The target's tokenizer; shards of the target's top-k."""
        return DataRequirements(self.drafter.config.vocab_size)

    def setup(self, stage: str) -> None:
        """The data's checks, and shards holding the target's final normed hidden state alone."""
        super().setup(stage)
        data = self.attached_datamodule()
        if self.target_signals == "shards" and list(data.hidden_layers) != [self.num_target_layers]:
            raise RecipeError(
                f"data.hidden_layers={list(data.hidden_layers)}: Medusa heads read the target's final normed hidden "
                f"state, hidden_states[{self.num_target_layers}]: write shards with hidden_layers "
                f"[{self.num_target_layers}]"
            )

    # ---- training ------------------------------------------------------------------------------------------------
    def _signals(self, batch: dict[str, torch.Tensor]):
        """(final normed hidden [B, S, H], the target's loss or None, the target's argmax [B, S] or None, the frozen
        target's distribution with ``labels: original``, else None)."""
        ids = batch["input_ids"]  # [B, S]
        need_argmax = self.labels == "argmax"
        if self.target_signals == "shards":
            hidden = batch["teacher_hidden"][:, 0].to(self.drafter.heads.lm_heads[0].weight.dtype)  # [B, S, H]
            return hidden, None, batch["teacher_topk_ids"][..., 0].long() if need_argmax else None, None
        if self.stage == 1:
            hidden = self.target.final_hidden(ids)  # [B, S, H], no gradient
            # the bare head's argmax is the target's greedy token: its output scaling, if any, keeps the argmax
            argmax = chunked_argmax(hidden, self.target.lm_head_weight, self.loss_chunk_size) if need_argmax else None
            if self.labels != "original":
                return hidden, None, argmax, None
            return hidden, None, argmax, SoftTargets(hidden, self.target.lm_head_weight, self.target.logit_scaling)
        model = self.drafter.model
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state  # [B, S, H], trained
        weight = model.get_output_embeddings().weight  # [V, H]
        scaling = LogitScaling.from_config(model.config)  # the trained target's own logits, as its export's forward
        if self.self_distillation:
            teacher = self.original.final_hidden(ids)  # [B, S, H]
            lm = fused_kd_loss(
                hidden, weight, teacher, self.original.lm_head_weight, batch["loss_mask"],
                chunk_size=self.loss_chunk_size, student_scaling=scaling, teacher_scaling=self.original.logit_scaling,
            ).loss  # fmt: skip
        else:
            lm = chunked_cross_entropy(hidden, weight, batch["labels"], self.loss_chunk_size, scaling=scaling)
        # the bare head's argmax is the model's greedy token: its output scaling, if any, keeps the argmax
        source = teacher if self.self_distillation else hidden.detach()
        source_weight = self.original.lm_head_weight if self.self_distillation else weight.detach()
        argmax = chunked_argmax(source, source_weight, self.loss_chunk_size) if need_argmax else None
        frozen = None
        if self.labels == "original":  # self-distillation (checked at construction): the frozen original's
            frozen = SoftTargets(teacher, self.original.lm_head_weight, self.original.logit_scaling)
        return hidden, lm, argmax, frozen

    def head_weights(self) -> list[float]:
        """The loss weight of every head at this step."""
        weights = [self.step_decay**k for k in range(self.drafter.config.num_heads)]
        if self.stage == 1:
            return weights
        ramp = warmup_factor(self.global_step, self.heads_warmup_steps, self.heads_warmup)
        return [self.heads_coefficient * ramp * w for w in weights]

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hidden, lm, argmax, frozen = self._signals(batch)
        labels = batch["labels"]  # [B, S], -100 where not trained
        if argmax is not None:
            labels = torch.where(batch["loss_mask"].bool(), argmax, IGNORE_INDEX)
        heads = self.drafter.heads
        total = hidden.new_zeros((), dtype=torch.float32) if lm is None else lm
        metrics: dict[str, torch.Tensor] = {} if lm is None else {"lm": lm.detach()}
        for k, weight in enumerate(self.head_weights()):
            target_k = shifted(labels, k)  # [B, S]: token t + 2 + k
            trained = target_k != IGNORE_INDEX
            if not bool(trained.any()):
                continue  # rows too short for this head
            features = heads.head_hidden(hidden, k)  # [B, S, H]
            # the heads' own output layers: not the target's output scaling (the export declares none, and the
            # heads are served without one)
            if frozen is None:
                loss_k = chunked_cross_entropy(features, heads.lm_heads[k].weight, target_k, self.loss_chunk_size)
            else:  # the frozen target's distribution at t + 1 + k, its prediction of token t + 2 + k
                later = frozen.later(1 + k)  # hidden [B, S, H]: position t holds the target's t + 1 + k
                out = fused_kd_loss(
                    features, heads.lm_heads[k].weight, later.hidden, later.lm_head_weight, trained,
                    chunk_size=self.loss_chunk_size, teacher_scaling=later.scaling, loss=self.loss_spec.name,
                    lk_eta=self.loss_spec.eta,
                )  # fmt: skip
                loss_k = out.loss
                metrics[f"alpha_{k}"] = out.alpha  # the head's acceptance under the frozen target, in the same pass
            total = total + weight * loss_k
            metrics[f"loss_{k}"] = loss_k.detach()
            if self._log_accuracy():  # one more projection per head: only at the steps that are logged
                weight_k = heads.lm_heads[k].weight.detach()
                guess = chunked_argmax(features.detach(), weight_k, self.loss_chunk_size)  # [B, S]
                metrics[f"acc_{k}"] = ((guess == target_k) & trained).sum().float() / trained.sum().float()
        return total, metrics

    def _log_accuracy(self) -> bool:
        """Validation, and the training steps the logger writes (and outside a trainer: always)."""
        if self._trainer is None or not self.training:
            return True
        return self.global_step % max(1, self.trainer.log_every_n_steps) == 0

    def flops_per_token(self) -> float:
        heads = 2.0 * count_params(self.drafter.heads)
        if self.target_signals == "shards":
            return 3.0 * heads
        model = self.drafter.model if self.stage == 2 else self.target.model
        target = causal_lm_flops_per_token(model, self.data_seq_len())
        return 3.0 * heads + (3.0 if self.stage == 2 else 1.0) * target

    # ---- what the drafter is -------------------------------------------------------------------------------------
    def activation_bytes(self, step: PlannedStep) -> int:
        """The heads' layers and outputs, the target's layers saved for backward and its forward, and a chunked loss
        of six float32 chunks: both stages are counted as Medusa-2's step, which bounds Medusa-1's (target frozen)."""
        n, a = step.tokens, step.element
        t = Shape.of(self.target_config)
        config = self.drafter.heads.config
        heads = config.num_heads * (config.num_layers * 3 + 1) * n * t.hidden_size * a  # each layer's, each output
        backbone = t.num_hidden_layers * layer_saved(t, n, a) + frozen_forward(t, n, step.target_element)
        return backbone + heads + chunked(step.chunk, n, t.vocab_size, copies=6)

    def speculative_eval_target(self) -> PreTrainedModel:
        if self.stage == 2:
            return self.drafter.model  # Medusa-2 drafts for the target trained with it
        return super().speculative_eval_target()

    def drafter_record(self) -> DrafterRecord:
        return medusa_kind.make_record(self.drafter.config, self.target_path, self.target_config)
