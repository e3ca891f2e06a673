"""LayerSkip: layer dropout rising with depth and an early-exit loss, so that the model's first E layers draft for it.

Training (Elhoushi et al. 2024; torchtune's names):

- layer dropout: layer ``l`` (0-based, of L) is skipped for a sample with probability ``p_l = p_max * S(l)``, with
  ``S(l) = exp(l ln 2 / (L - 1)) - 1`` (``dropout_scale: exp``) or ``l / (L - 1)`` (``linear``); the last layer is
  never dropped, and nothing is dropped in eval. Drawn per sample from a generator seeded with (seed, step,
  micro-batch, rank), so a resumed run drops the same layers. A skipped layer passes its input through; it runs on
  the samples that keep it, and on one discarded sample when none does, so every rank runs every layer's forward
  and backward (collectives of sharded strategies never wait on a rank that skipped) and a skipped layer's gradient
  is zero, never missing.
- early-exit loss: at the exit layers (``early_exit_layers``, default all), the hidden state after layer ``l`` goes
  through the model's own final norm and lm_head; the losses of the enabled exits and of the last layer are combined
  with scales normalised to sum 1 (``exit_scale``: ``uniform``, ``linear_l`` (l + 1), ``sum_l`` ((l + 1)(l + 2)/2),
  ``sqrt_l``, ``inv_l``). Curricula (deterministic in the step): ``none`` (every exit), ``rotational`` (exit index
  ``i`` is enabled when ``i % period == step % period``) and ``gradual`` (exits enabled from the last layer down,
  all of them after ``curriculum_steps``). Every exit's logits are computed in chunks of positions and freed.
- keeping the model's outputs (``target_kl_weight``, fine-tuning): the loss gains ``target_kl_weight *
  KL(p_original || q_model)``, the forward KL from a frozen copy of the model as it was loaded to the model's own
  next-token distribution (the last layer's, under the step's layer dropout), averaged over the trained positions,
  chunked like the exits' losses and logged as ``target_kl``. The copy is declared with ``track_frozen`` (as
  ``original``: checkpoints keep its fingerprint, never its weights) and kept out of the module tree. Trained on the
  target's own greedy completions without it, the fine-tune drifts towards repeating itself
  (docs/benchmarks/layerskip.md).
- what the exits learn (``labels``): the data's next tokens (cross entropy, the paper's), or the frozen original's
  next-token distribution (``original``: every exit's loss is its ``KL(p_original || q_exit)``, the last layer's
  included), so that the exits draft what the model predicts and the model's output stays the original's; ``loss``
  replaces that KL by another loss toward the same distribution (``tv``, ``nla``, ``lk_hybrid``:
  trainer/losses/distribution.py). Every exit compared with the original (each of them with ``labels: original``, the
  last layer with ``target_kl_weight``) logs its expected acceptance under the original's distribution,
  ``sum_v min(p_v, q_v)``, as ``alpha_exit_{layer}`` beside ``exit_{layer}``, from the loss's chunked pass.

Pre-training a fresh Llama from a tokenizer (``tokenizer`` with ``target_config`` overrides), or fine-tuning any HF
Llama-like model in full (``target``). The model is saved as a plain HF checkpoint (drafter kind ``layerskip``: a
``layerskip.json`` beside it says how it was trained); ``draftsmith eval --drafter DIR --exit_layer E`` drafts with
its first E layers through the target session (proposer.py), and transformers runs it with
``generate(assistant_early_exit=E)``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from trainer.data.vocab import load_tokenizer_if_present
from trainer.decoding.session import slice_refusal
from trainer.export.hf import export_student
from trainer.interface.errors import ModelFolderError, RecipeError
from trainer.losses.distillation import KL, LossParts, chunked_cross_entropy, fused_kd_loss, kd_loss
from trainer.losses.distribution import DEFAULT_ETA, LOSSES, DistributionLoss
from trainer.methods.layerskip import kind as layerskip_kind
from trainer.models.llama import new_llama_config
from trainer.models.logit_scaling import LogitScaling
from trainer.models.target import resolve_dtype
from trainer.training.activation_memory import PlannedStep, causal_lm_layers, chunked, frozen_forward, layer_saved
from trainer.training.objective import DataRequirements, DraftObjective, causal_lm_flops_per_token, derived_seed
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

SCALES = ("uniform", "linear_l", "sum_l", "sqrt_l", "inv_l")


def dropout_rates(num_layers: int, p_max: float, scale: str) -> list[float]:
    """``p_l`` for l = 0..L-1; the last layer's is 0."""
    L = num_layers
    if L < 2:
        return [0.0] * L
    if scale == "exp":
        rates = [p_max * (math.exp(i * math.log(2) / (L - 1)) - 1) for i in range(L)]
    elif scale == "linear":
        rates = [p_max * i / (L - 1) for i in range(L)]
    else:
        raise RecipeError(f"model.dropout_scale must be 'exp' or 'linear', got {scale!r}")
    rates[-1] = 0.0
    return rates


def exit_scales(layers: list[int], scale: str) -> list[float]:
    """The loss scales of the exits at ``layers`` (0-based, the last layer included), normalised to sum 1."""
    raw = {
        "uniform": lambda n: 1.0,
        "linear_l": lambda n: n + 1.0,
        "sum_l": lambda n: (n + 1.0) * (n + 2.0) / 2.0,
        "sqrt_l": lambda n: math.sqrt(n + 1.0),
        "inv_l": lambda n: 1.0 / (n + 1.0),
    }[scale]
    values = [raw(n) for n in layers]
    total = sum(values)
    return [v / total for v in values]


class LayerSkipLM(nn.Module):
    """The model and the forward of a LayerSkip step as one module: the layers with dropout, then every enabled exit's
    loss. Under FSDP2 it is the root unit, so the model's embedding, final norm and lm_head (not in a layer's unit) are
    unsharded for this forward and its backward."""

    def __init__(self, model: PreTrainedModel, chunk_size: int) -> None:
        """
        Args:
            model: the HF causal LM being trained.
            chunk_size: positions per chunk of every exit's logits.
        """
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size

    def run_layers(self, ids: torch.Tensor, keep: torch.Tensor | None, exits: list[int]) -> dict[int, torch.Tensor]:
        """The hidden state after every layer in ``exits`` and after the last one, before the final norm.

        ids: [B, S]; keep: [B, L] bool (None: every layer for every sample)."""
        decoder = self.model.get_decoder()
        h = decoder.embed_tokens(ids)  # [B, S, H]
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, S]
        mask = create_causal_mask(
            config=decoder.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions
        )
        rotary = decoder.rotary_emb(h, position_ids=positions)
        L = len(decoder.layers)
        out: dict[int, torch.Tensor] = {}
        for n, layer in enumerate(decoder.layers):
            kwargs = dict(attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            rows = None if keep is None or bool(keep[:, n].all()) else keep[:, n].nonzero().squeeze(1)  # [b]
            if rows is None:
                h = layer(h, **kwargs)
            elif rows.numel():
                h = h.index_copy(0, rows, layer(h.index_select(0, rows), **kwargs))
            else:  # skipped by every sample: run on one, discarded, so its forward, backward and gradient (0) exist
                h = h + 0.0 * layer(h[:1], **kwargs).sum()
            if n in exits or n == L - 1:
                out[n] = h
        return out

    def forward(
        self,
        ids: torch.Tensor,
        labels: torch.Tensor,
        keep: torch.Tensor | None,
        layers: list[int],
        scales: list[float],
        whole_logits: bool = False,
        original: tuple[torch.Tensor, torch.Tensor, torch.Tensor, LogitScaling] | None = None,
        distill: bool = False,
        loss: DistributionLoss = KL,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None, dict[int, torch.Tensor]]:
        """The scaled sum of the exits' losses, each of them, the last layer's KL from the original, and the
        acceptance (detached) of every exit compared with the original, by layer.

        Every exit's logits are the model's own: through its final norm and lm_head, with the output scaling its
        forward applies after the lm_head (``LogitScaling.from_config(model.config)``).

        ids, labels: [B, S]; keep: [B, L] bool or None; whole_logits: project through the lm_head module at once
        (under ZeRO-3 its weight is a partition outside the module's forward) instead of in chunks of positions;
        original: the frozen original's final normed hidden states [B, S, Ho], its lm_head weight [V, Ho], the
        positions [B, S] bool and its output scaling (``FrozenTarget.logit_scaling``): the third value is then
        ``KL(p_original || q_model)`` of the model's own output (the last layer's) averaged over those positions,
        else None; distill: every exit's loss is its ``KL(p_original || q_exit)`` over those positions instead of
        its cross entropy on ``labels`` (needs ``original``); loss: with ``distill``, the loss toward the original's
        distribution (``kl``: the KL above; the last layer's value is then also the third value)."""
        if distill and original is None:
            raise ValueError("distill needs the original's hidden states")
        if not (distill or loss.is_kl):
            raise ValueError(f"loss={loss.name!r} trains toward the original's distribution: it needs distill")
        states = self.run_layers(ids, keep, layers[:-1])
        norm, head = self.model.get_decoder().norm, self.model.get_output_embeddings()
        scaling = LogitScaling.from_config(self.model.config)
        total, losses, kl, alphas = 0.0, [], None, {}
        for layer, scale in zip(layers, scales):
            normed = norm(states[layer])  # [B, S, H]
            logits = scaling(head(normed).float()) if whole_logits else None  # [B, S, V]
            divergence = None
            if original is not None and (distill or layer == layers[-1]):
                parts = self._kl_to_original(normed, logits, head.weight, scaling, original, loss)
                divergence, alphas[layer] = parts.loss, parts.alpha
            if distill:
                exit_loss = divergence
            elif logits is not None:
                exit_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            else:
                exit_loss = chunked_cross_entropy(normed, head.weight, labels, self.chunk_size, scaling=scaling)
            if layer == layers[-1]:
                kl = divergence
            total = total + scale * exit_loss
            losses.append(exit_loss)
        return total, losses, kl, alphas

    def _kl_to_original(
        self,
        normed: torch.Tensor,
        logits: torch.Tensor | None,
        weight: torch.Tensor,
        scaling: LogitScaling,
        original: tuple[torch.Tensor, torch.Tensor, torch.Tensor, LogitScaling],
        loss: DistributionLoss = KL,
    ) -> LossParts:
        """``KL(p_original || q)`` (or ``loss``) of one exit over the original's positions, with its mean acceptance:
        from its whole ``logits`` [B, S, V] when given (ZeRO-3), else from its normed hidden states [B, S, H] and
        the lm_head ``weight``, chunked."""
        hidden_o, weight_o, mask_o, scaling_o = original
        options = dict(chunk_size=self.chunk_size, loss=loss.name, lk_eta=loss.eta)
        if logits is not None:
            with torch.no_grad():
                reference = scaling_o(hidden_o @ weight_o.t())  # [B, S, V]
            return kd_loss(logits, reference, mask_o, **options)
        return fused_kd_loss(
            normed, weight, hidden_o, weight_o, mask_o, student_scaling=scaling, teacher_scaling=scaling_o, **options
        )


class LayerSkip(DraftObjective):
    """Trains a causal LM with layer dropout and early-exit losses (pre-training or full fine-tuning)."""

    def __init__(
        self,
        target: str | None = None,
        tokenizer: str | None = None,
        target_config: dict[str, int | float | str | bool] | None = None,
        p_max: float = 0.1,
        dropout_scale: Literal["exp", "linear"] = "exp",
        early_exit_layers: list[int] | None = None,
        exit_scale: Literal["uniform", "linear_l", "sum_l", "sqrt_l", "inv_l"] = "sum_l",
        curriculum: Literal["none", "rotational", "gradual"] = "none",
        curriculum_period: int = 2,
        curriculum_steps: int = 0,
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
            target: an HF Llama-like causal LM directory or hub id to fine-tune; None pre-trains a fresh Llama.
            tokenizer: the tokenizer of a fresh model (its length is the vocabulary); ignored with ``target``.
            target_config: a fresh model's Llama config overrides, e.g. {hidden_size: 256, num_hidden_layers: 4}.
            p_max: the largest layer-dropout rate (reached at the last layer but one), in [0, 1).
            dropout_scale: how the rate rises with depth: "exp" or "linear".
            early_exit_layers: layers (0-based) whose output also gets the loss; None: every layer but the last.
            exit_scale: the exits' loss scales before normalisation (uniform, linear_l, sum_l, sqrt_l, inv_l).
            curriculum: which exits are enabled at a step: "none" (all), "rotational", "gradual".
            curriculum_period: rotational: one exit in this many is enabled per step, rotating.
            curriculum_steps: gradual: optimizer steps until every exit is enabled.
            target_kl_weight: fine-tuning: the weight of ``KL(p_original || q_model)``, the forward KL from a frozen
                copy of ``target`` to the model's own next-token distribution (its last layer's), added to the exits'
                loss so that the model keeps its outputs (0: off; >= 0). Needs ``target``; the frozen copy costs one
                more model in memory and its forward in every step.
            labels: what every exit (the last layer's included) learns: "data", the rows' next tokens (cross
                entropy), or "original", the frozen copy of ``target``'s next-token distribution (forward KL, on the
                same positions; needs ``target``, and costs what ``target_kl_weight`` does): the exits learn to draft
                what the model predicts rather than the data, and the model's own output is held to the original's
                (``target_kl_weight`` then weighs its KL once more).
            loss: with labels=original, every exit's loss toward the copy's distribution: kl (the forward KL), tv
                (total variation), nla (negative log-acceptance) or lk_hybrid (trainer/losses/distribution.py; the last
                layer's value is also what target_kl_weight weighs); labels=data takes the cross entropy and needs kl.
            lk_eta: the hybrid's eta (loss=lk_hybrid only), >= 0.
            loss_chunk_size: positions per chunk of every exit's logits.
            target_dtype: the model's weights dtype (float32, bfloat16).
            export_dir: where the model (HF checkpoint, tokenizer, layerskip.json) is saved at the end of fit.
            trust_remote_code: allow custom modelling code in the model directory (off by default).
            seed: seed of a fresh model's initialisation and of the layer dropout.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        # the tokenizer argument only shapes a fresh model: kept out of the hyperparameters, where Lightning refuses
        # a value other than the datamodule's tokenizer of the same name (a fine-tune leaves it None)
        self.save_hyperparameters(ignore=["optim", "tokenizer"])
        if not 0.0 <= p_max < 1.0:
            raise RecipeError(f"model.p_max must be in [0, 1), got {p_max}")
        if curriculum_period < 1 or curriculum_steps < 0:
            raise RecipeError(
                f"model.curriculum_period must be >= 1 and curriculum_steps >= 0, got {curriculum_period}, "
                f"{curriculum_steps}"
            )
        if not target_kl_weight >= 0.0:
            raise RecipeError(f"model.target_kl_weight must be >= 0, got {target_kl_weight}")
        self.loss_spec = DistributionLoss.from_options(loss, lk_eta, LOSSES)
        if not self.loss_spec.is_kl and labels != "original":
            raise RecipeError(
                f"model.loss={loss!r} trains the exits toward the original's distribution: it needs labels: original"
            )
        if labels == "original" and target is None:
            raise RecipeError(
                "model.labels=original trains every exit on the distribution of the model it started from: it needs "
                "model.target (a fresh model has no original); use labels: data"
            )
        if target_kl_weight > 0 and target is None:
            raise RecipeError(
                f"model.target_kl_weight={target_kl_weight} keeps a fine-tuned model close to the model it started "
                "from: it needs model.target (a fresh model has no original); set it to 0"
            )
        torch.manual_seed(seed)
        if target is not None:
            hf = AutoModelForCausalLM.from_pretrained(
                target, dtype=resolve_dtype(target_dtype), trust_remote_code=trust_remote_code
            )
            if target_kl_weight > 0 or labels == "original":  # the frozen original, out of the module tree
                self.load_target(target, "online", target_dtype, trust_remote_code, record_as="original")
            self.tokenizer_path: str | None = target
        elif tokenizer is not None:
            config = new_llama_config(AutoTokenizer.from_pretrained(tokenizer), target_config or {}, "target_config")
            hf = LlamaForCausalLM(config).to(resolve_dtype(target_dtype))
            self.tokenizer_path = tokenizer
        else:
            raise RecipeError("set model.target (a model to fine-tune) or model.tokenizer (a fresh model)")
        self.target_path = target  # trained: not a frozen target
        self.tokenizer = load_tokenizer_if_present(self.tokenizer_path)
        self.net = LayerSkipLM(hf, loss_chunk_size)
        refusal = slice_refusal(self.model)
        if refusal is not None:
            raise ModelFolderError(
                f"LayerSkip runs the model's layers one at a time, which it cannot do here: {refusal}"
            )
        L = self.model.config.num_hidden_layers
        exits = list(range(L - 1)) if early_exit_layers is None else sorted(set(early_exit_layers))
        bad = [n for n in exits if not 0 <= n < L - 1]
        if bad:
            raise RecipeError(
                f"model.early_exit_layers: {bad} not layers of the model before its last (0..{L - 2}; the last layer's "
                "output is always trained)"
            )
        self.exits = exits
        self.rates = dropout_rates(L, p_max, dropout_scale)
        self.exit_scale, self.curriculum = exit_scale, curriculum
        self.curriculum_period, self.curriculum_steps = curriculum_period, curriculum_steps
        self.export_dir, self.seed = export_dir, seed
        self.target_kl_weight, self.labels = target_kl_weight, labels
        self._micro = 0

    @property
    def model(self) -> PreTrainedModel:
        """The HF model being trained."""
        return self.net.model

    def trainable_module(self) -> nn.Module:
        return self.net

    def data_requirements(self) -> DataRequirements:
        """The model's tokenizer."""
        return DataRequirements(self.model.get_output_embeddings().weight.shape[0], name=self.tokenizer_path)

    # ---- the schedule of a step ------------------------------------------------------------------------------------
    def enabled_exits(self, step: int) -> list[int]:
        """The early exits trained at an optimizer step (the last layer is always trained)."""
        if self.curriculum == "rotational":
            period = self.curriculum_period
            return [n for i, n in enumerate(self.exits) if i % period == step % period]
        if self.curriculum == "gradual":
            L = len(self.rates)
            progress = 1.0 if self.curriculum_steps == 0 else min(1.0, step / self.curriculum_steps)
            lowest = L - 1 - math.floor(progress * (L - 1))
            return [n for n in self.exits if n >= lowest]
        return list(self.exits)

    def keep_mask(self, batch_size: int, step: int, micro: int) -> torch.Tensor:
        """``[B, L]`` bool: which layers each sample runs (deterministic in seed, step, micro-batch and rank)."""
        g = torch.Generator().manual_seed(derived_seed(self.seed, "layer-dropout", step, micro, self.global_rank))
        draws = torch.rand(batch_size, len(self.rates), generator=g)  # [B, L]
        return draws >= torch.tensor(self.rates)

    # ---- training ----------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        accumulate = max(1, int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1))
        self._micro = batch_idx % accumulate
        return super().training_step(batch, batch_idx)

    def run_layers(self, ids: torch.Tensor, keep: torch.Tensor | None, exits: list[int]) -> dict[int, torch.Tensor]:
        """See :meth:`LayerSkipLM.run_layers`."""
        return self.net.run_layers(ids, keep, exits)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, labels = batch["input_ids"], batch["labels"]  # [B, S] each
        L = len(self.rates)
        layers = [*self.enabled_exits(self.global_step), L - 1]
        keep = None
        if self.training:
            keep = self.keep_mask(ids.shape[0], self.global_step, self._micro).to(ids.device)  # [B, L]
        whole_logits = self.weights_are_sharded() and self.device_mesh is None  # ZeRO-3: the head through its module
        original = None
        distill = self.labels == "original"
        if self.target_kl_weight > 0 or distill:
            frozen = self.target  # the frozen original, out of the module tree
            mask = batch["loss_mask"].bool()  # [B, S]
            original = (frozen.final_hidden(ids), frozen.lm_head_weight, mask, frozen.logit_scaling)  # [B, S, H]...
        scales = exit_scales(layers, self.exit_scale)
        total, losses, kl, alphas = self.net(
            ids, labels, keep, layers, scales, whole_logits, original, distill, self.loss_spec
        )
        metrics = {f"exit_{layer}": loss.detach() for layer, loss in zip(layers, losses)}
        metrics.update({f"alpha_exit_{layer}": alpha for layer, alpha in alphas.items()})
        if kl is not None:
            total = total + self.target_kl_weight * kl
            metrics["target_kl"] = kl.detach()
        if keep is not None:
            metrics["kept_layers"] = keep.float().sum(1).mean()
        return total, metrics

    def flops_per_token(self) -> float:
        dense = causal_lm_flops_per_token(self.model, self.data_seq_len())
        head = 2.0 * self.model.get_output_embeddings().weight.numel()
        flops = 3.0 * (dense + head * len(self.exits))  # every enabled exit adds a projection to the vocabulary
        if self.labels == "original":  # the original's forward, its projection for every exit's KL (no more of ours)
            flops += dense + head * (len(self.exits) + 1)
        elif self.target_kl_weight > 0:  # the original's forward and projection, the model's output projected again
            flops += dense + head + 3.0 * head
        return flops

    # ---- what the model is ---------------------------------------------------------------------------------------
    def activation_bytes(self, step: PlannedStep) -> int:
        """Every layer's saved tensors, the frozen original's forward (``target_kl_weight``) and the exits' chunked
        loss (six float32 chunks against the original's distribution, else three)."""
        n, a = step.tokens, step.element
        t, layers = causal_lm_layers(self.model)
        kl = frozen_forward(t, n, step.target_element) if self.target_kl_weight else 0
        copies = 6 if kl or not self.loss_spec.is_kl else 3  # an LK loss takes its gradient by autograd on the chunk
        return layers * layer_saved(t, n, a) + kl + chunked(step.chunk, n, t.vocab_size, copies=copies)

    def speculative_eval_target(self) -> PreTrainedModel:
        return self.model  # it drafts for itself

    def drafter_record(self) -> DrafterRecord:
        hp = self.hparams
        return layerskip_kind.make_record(
            self.model, self.tokenizer_path, exits=self.exits, p_max=hp.p_max, dropout_scale=hp.dropout_scale,
            fine_tuned_from=self.target_path, target_kl_weight=self.target_kl_weight, labels=self.labels,
        )  # fmt: skip

    def on_train_end(self) -> None:
        if self.export_dir:
            export_student(self, self.model, self.export_dir, self.tokenizer_path)
            if self.global_rank == 0:
                layerskip_kind.write_marker(self.drafter_record(), self.export_dir)
