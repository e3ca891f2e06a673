"""On-policy distillation (GKD, Agarwal et al. 2024): the drafter learns on sequences it generated itself.

At every training step a coin with probability ``lmbda`` decides where the step's sequences come from:

- heads: the drafter samples continuations of the batch's prompts (eval mode, no gradient, KV cache) and the loss is
  taken on ``[prompt + generated]`` with the mask covering exactly the generated tokens, up to and including the first
  EOS (the step trains on what the drafter actually says, which removes the train/generation mismatch);
- tails: the data set's own sequences and loss mask (the KD objective's step), or, with ``seq_kd``, continuations the
  target sampled from the same prompts (sequence-level KD).

The loss (``loss``, the vocabulary of every objective) is by default GKD's generalized JSD with weight ``beta`` between
the target's and the drafter's temperature-softened next-token distributions at every trained position (``beta = 0`` is
the forward KL, ``beta = 1`` the reverse KL, TRL's GKD convention, see trainer/losses/distillation.py), or the forward
KL, the reverse KL, or an LK loss (``tv``, ``nla``, ``lk_hybrid``: taken at ``temperature`` without its square),
computed in chunks by ``fused_kd_loss``. The expected acceptance ``sum_v min(p_v, q_v)`` of the drafter under the target
is logged as ``alpha_0``.

Prompts. ``prompt="prefix"``: the first ``prompt_len`` tokens of every row (text data). ``prompt="chat"``: the tokens
before the first assistant token of the row (the untrained region that ends where the loss mask first turns on after
an untrained token); a row with no such region falls back to its first ``prompt_len`` tokens. Prompts of different
lengths are left-padded for batched generation; the training sequences are then laid out right-padded, so that every
real token keeps its position and causal attention never sees a pad before a real token.

Determinism. The coin and the sampling seed are functions of (seed, global step, micro-batch index): a resumed run
makes the same choices and, on the same hardware, samples the same tokens. Validation always uses the data set.

Limits: generation calls HF ``generate`` on the drafter as it is held by the strategy; under DeepSpeed ZeRO-3 or FSDP
(sharded parameters) it is not supported yet. Throughput logging counts the tokens each step trained on (prompts and
generated tokens on generated steps, the data batch otherwise); the generation itself is not counted.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from trainer.export.hf import export_student
from trainer.interface.errors import RecipeError
from trainer.losses.distillation import KD_LOSSES, LossParts, fused_kd_loss
from trainer.losses.distribution import DEFAULT_ETA, DistributionLoss
from trainer.methods.draft_model import kind as hf_causal_lm
from trainer.methods.draft_model.kd import build_drafter, distillation_activation_bytes, drafter_vocab_size
from trainer.models.logit_scaling import LogitScaling
from trainer.models.target import document_kwargs
from trainer.training.activation_memory import PlannedStep
from trainer.training.objective import DataRequirements, DraftObjective, causal_lm_flops_per_token, derived_seed
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclass
class GeneratedBatch:
    """Sequences built from prompts and a model's continuations, right-padded.

    input_ids: [B, T] long, ``[prompt + generated]`` without its last token, then pads.
    labels: [B, T] long, the next token where loss_mask is True, -100 elsewhere.
    loss_mask: [B, T] bool, True exactly where labels is a generated token (up to and including the first EOS).
    prompt_lengths: [B] long, tokens of each row's prompt.
    generated_lengths: [B] long, generated tokens kept per row.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    generated_lengths: torch.Tensor


def prompt_lengths(loss_mask: torch.Tensor, prompt: str, prompt_len: int) -> torch.Tensor:
    """Tokens of each row's prompt. loss_mask: [B, S] bool (aligned with labels: True at i trains token i + 1).

    ``prefix``: ``min(prompt_len, S)`` for every row. ``chat``: ``j + 1`` for the first ``j >= 1`` where the mask turns
    on after an untrained position (token ``j + 1`` is the first assistant token), else ``min(prompt_len, S)``.
    """
    B, S = loss_mask.shape
    fallback = torch.full((B,), min(prompt_len, S), dtype=torch.long, device=loss_mask.device)  # [B]
    if prompt == "prefix":
        return fallback
    if prompt != "chat":
        raise RecipeError(f"model.prompt must be 'prefix' or 'chat', got {prompt!r}")
    mask = loss_mask.bool()
    rising = torch.zeros_like(mask)  # [B, S]
    rising[:, 1:] = mask[:, 1:] & ~mask[:, :-1]
    has = rising.any(dim=1)  # [B]
    first = rising.float().argmax(dim=1)  # [B] first True (0 when none)
    return torch.where(has, first + 1, fallback)


def left_pad(input_ids: torch.Tensor, lengths: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``lengths[b]`` tokens of each row, right-aligned: ids [B, P] and attention mask [B, P] (P = max)."""
    B = input_ids.shape[0]
    P = int(lengths.max())
    ids = input_ids.new_full((B, P), pad_id)  # [B, P]
    attention = torch.zeros((B, P), dtype=torch.long, device=input_ids.device)  # [B, P]
    for b in range(B):
        n = int(lengths[b])
        ids[b, P - n :] = input_ids[b, :n]
        attention[b, P - n :] = 1
    return ids, attention


def assemble(
    prompts: torch.Tensor, lengths: torch.Tensor, generated: torch.Tensor, eos_id: int | None, pad_id: int
) -> GeneratedBatch:
    """Right-padded training sequences from left-padded prompts and their continuations.

    prompts: [B, P] left-padded; lengths: [B]; generated: [B, N] (what follows the prompts in ``generate``'s output,
    pads after a row's EOS). A row keeps its generated tokens up to and including the first EOS (all N without one).
    """
    B, P = prompts.shape
    N = generated.shape[1]
    if eos_id is not None and N > 0:
        is_eos = generated == eos_id  # [B, N]
        first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(lengths, N))  # [B]
        gen_len = torch.clamp(first_eos + 1, max=N)  # [B]
    else:
        gen_len = torch.full_like(lengths, N)  # [B]
    total = lengths + gen_len  # [B]
    T = max(int(total.max()) - 1, 1)
    seq = prompts.new_full((B, T + 1), pad_id)  # [B, T + 1]
    for b in range(B):
        p, g = int(lengths[b]), int(gen_len[b])
        seq[b, :p] = prompts[b, P - p :]
        seq[b, p : p + g] = generated[b, :g]
    pos = torch.arange(T, device=prompts.device)[None, :]  # [1, T]; position i predicts token i + 1
    loss_mask = (pos >= (lengths - 1)[:, None]) & (pos < (total - 1)[:, None])  # [B, T]
    labels = torch.where(loss_mask, seq[:, 1:], torch.full_like(seq[:, 1:], IGNORE_INDEX))  # [B, T]
    return GeneratedBatch(seq[:, :-1], labels, loss_mask, lengths, gen_len)


class OnPolicyDistillation(DraftObjective):
    """Generalized-JSD distillation on a mix of drafter-generated, target-generated and data set sequences."""

    honours_document_ids = True  # data rows: teacher and student see document_ids; prompts stay in one document

    def __init__(
        self,
        target: str,
        drafter: str | None = None,
        drafter_config: dict[str, int | float | str | bool] | None = None,
        lmbda: float = 0.5,
        loss: Literal["jsd", "kl", "reverse_kl", "tv", "nla", "lk_hybrid"] = "jsd",
        lk_eta: float = DEFAULT_ETA,
        beta: float = 0.5,
        seq_kd: bool = False,
        temperature: float = 1.0,
        generation_temperature: float = 1.0,
        do_sample: bool = True,
        max_new_tokens: int = 64,
        prompt: Literal["prefix", "chat"] = "prefix",
        prompt_len: int = 32,
        loss_chunk_size: int = 256,
        target_dtype: str = "float32",
        drafter_dtype: str = "float32",
        export_dir: str | None = None,
        trust_remote_code: bool = False,
        seed: int = 0,
        optim: Optim = Optim(),
    ) -> None:
        """
        Args:
            target: the target, an HF causal LM directory or hub id (its tokenizer is expected beside it).
            drafter: a pretrained drafter to start from (directory or hub id); None builds one from drafter_config.
            drafter_config: overrides of the target's config for a fresh drafter, e.g. {num_hidden_layers: 2}.
            lmbda: probability that a training step trains on the drafter's own continuations (GKD's lambda).
            loss: the loss toward the target's distribution: jsd (GKD's generalized JSD with weight beta), kl
                (KL(target || drafter)), reverse_kl, or an LK loss: tv (total variation), nla (negative
                log-acceptance), lk_hybrid (trainer/losses/distribution.py).
            lk_eta: the hybrid's eta (loss=lk_hybrid only), >= 0.
            beta: generalized JSD weight (TRL's GKD convention): 0 is the forward KL, 1 the reverse KL (loss=jsd).
            seq_kd: on steps that are not on-policy, train on the target's continuations instead of the data set.
            temperature: softens both distributions in the loss; jsd, kl and reverse_kl are multiplied by temperature
                squared, the LK losses are taken at that temperature as they are.
            generation_temperature: sampling temperature of the drafter's (and, with seq_kd, the target's) generation.
            do_sample: sample the continuations (True) or decode them greedily (False).
            max_new_tokens: tokens generated per prompt at most (generation stops earlier at EOS).
            prompt: where prompts come from: "prefix" (the first prompt_len tokens of each row, text data) or "chat"
                (the untrained tokens before the first assistant token of each row).
            prompt_len: prompt length with prompt="prefix", and the fallback for chat rows without an assistant turn.
            loss_chunk_size: positions per chunk of the loss; each chunk's float32 logits are freed before the next.
            target_dtype: the target's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the drafter's weights dtype (Lightning's precision plugin may still autocast).
            export_dir: where the drafter is saved as an HF checkpoint (safetensors and tokenizer) at the end of fit.
            trust_remote_code: allow custom modelling code in the target or drafter directory (off by default).
            seed: seeds the fresh drafter's initialisation, the per-step coin and the sampling.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        checks = {
            "lmbda": 0.0 <= lmbda <= 1.0,
            "beta": 0.0 <= beta <= 1.0,
            "temperature": temperature > 0,
            "generation_temperature": generation_temperature > 0,
            "max_new_tokens": max_new_tokens >= 1,
            "prompt_len": prompt_len >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise RecipeError(f"model.{name} is out of range: {locals()[name]!r}")
        if prompt not in ("prefix", "chat"):
            raise RecipeError(f"model.prompt must be 'prefix' or 'chat', got {prompt!r}")
        self.loss_spec = DistributionLoss.from_options(loss, lk_eta, KD_LOSSES)
        self.lmbda, self.beta, self.seq_kd = lmbda, beta, seq_kd
        self.temperature, self.generation_temperature, self.do_sample = temperature, generation_temperature, do_sample
        self.max_new_tokens, self.prompt, self.prompt_len = max_new_tokens, prompt, prompt_len
        self.loss_chunk_size, self.export_dir, self.seed = loss_chunk_size, export_dir, seed
        # in the module tree, as in KD; recorded in checkpoints under the name they have used
        frozen = self.load_target(
            target, "online", target_dtype, trust_remote_code, in_module_tree=True, record_as="teacher"
        )
        torch.manual_seed(seed)
        # `student`: the drafter's attribute, whose name prefixes its weights in checkpoints
        self.student = build_drafter(frozen.config, drafter, drafter_config, drafter_dtype)
        self.vocab_size = drafter_vocab_size(self, frozen.vocab_size, self.student, drafter)
        self.eos_id, self.pad_id = self._special_ids()
        self._micro = 0

    def _special_ids(self) -> tuple[int | None, int]:
        """(EOS id or None, pad id) from the tokenizer, else the target's config; pad falls back to EOS, then 0."""
        tok, cfg = self.tokenizer, self.target_config
        eos = tok.eos_token_id if tok is not None else getattr(cfg, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        pad = tok.pad_token_id if tok is not None else getattr(cfg, "pad_token_id", None)
        return eos, pad if pad is not None else (eos if eos is not None else 0)

    def trainable_module(self) -> nn.Module:
        return self.student

    def data_requirements(self) -> DataRequirements:
        """The target's tokenizer."""
        return DataRequirements(self.target.vocab_size, self.vocab_size)

    def activation_bytes(self, step: PlannedStep) -> int:
        """A step on the data set's sequences (KD's); generation's KV cache is not counted."""
        return distillation_activation_bytes(self, step)

    # ---- the pieces of a step (public for tests and the benchmark) -----------------------------------------------
    def coin(self, step: int, micro: int = 0) -> bool:
        """True when the step trains on the student's own continuations; a function of (seed, step, micro) only."""
        return random.Random(derived_seed(self.seed, "coin", step, micro)).random() < self.lmbda

    @torch.no_grad()
    def generate(self, model: PreTrainedModel, batch: dict[str, torch.Tensor], sample_seed: int) -> GeneratedBatch:
        """Continuations of the batch's prompts by ``model`` (put in eval mode for the call), as training sequences."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, S] each
        lengths = prompt_lengths(loss_mask, self.prompt, self.prompt_len)  # [B]
        if "document_ids" in batch:  # a packed row's prompt stays within its first document
            lengths = torch.minimum(lengths, (batch["document_ids"] == 0).sum(dim=1))  # [B]
        prompts, attention = left_pad(input_ids, lengths, self.pad_id)  # [B, P] each
        width = model.get_output_embeddings().weight.shape[0]
        config = GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=self.do_sample,
            temperature=self.generation_temperature if self.do_sample else None,
            top_k=None,
            top_p=None,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            suppress_tokens=list(range(self.vocab_size, width)) or None,  # ids no tokenizer produces
            use_cache=True,
        )
        was_training = model.training
        model.eval()
        devices = [input_ids.device] if input_ids.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(sample_seed)
                out = model.generate(input_ids=prompts, attention_mask=attention, generation_config=config)  # [B, P+N]
        finally:
            model.train(was_training)
        return assemble(prompts, lengths, out[:, prompts.shape[1] :], self.eos_id, self.pad_id)

    def distill(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> LossParts:
        """The loss (``loss``; T^2 * generalized JSD(beta) by default) between target and drafter at the positions of
        loss_mask ([B, S] each), with the acceptance; ``document_ids`` [B, S] (packed rows with document masking, or
        None) keeps both models' attention within each document."""
        V = self.vocab_size
        target_hidden = self.target.final_hidden(input_ids, document_ids=document_ids)  # [B, S, Ht]
        student_hidden = self.student.get_decoder()(
            input_ids=input_ids, use_cache=False, **document_kwargs(self.student, document_ids)
        ).last_hidden_state  # [B, S, H]
        return fused_kd_loss(
            student_hidden,
            self.student.get_output_embeddings().weight[:V],  # [V, H]
            target_hidden,
            self.target.lm_head_weight[:V],  # [V, Ht]
            loss_mask,
            loss=self.loss_spec.name,
            lk_eta=self.loss_spec.eta,
            beta=self.beta,
            temperature=self.temperature,
            chunk_size=self.loss_chunk_size,
            # each model's own distribution (what generate samples from): its forward's output scaling
            student_scaling=LogitScaling.from_config(self.student.config),
            teacher_scaling=self.target.logit_scaling,
        )

    # ---- Lightning -----------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        accumulate = max(1, int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1))
        self._micro = batch_idx % accumulate
        return super().training_step(batch, batch_idx)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        device = batch["input_ids"].device
        source = "data"
        if self.training:
            step, micro = self.global_step, self._micro
            sample_seed = derived_seed(self.seed, "sample", step, micro, self.global_rank)
            if self.coin(step, micro):
                source = "student"
            elif self.seq_kd:
                source = "target"
        metrics: dict[str, torch.Tensor] = {}
        documents = None  # generated rows hold one document: their prompt is cut within the row's first
        if source == "data":
            input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, S] each
            documents = batch.get("document_ids")  # [B, S], or absent without document masking
        else:
            model = self.student if source == "student" else self.target.model
            gen = self.generate(model, batch, sample_seed)
            input_ids, loss_mask = gen.input_ids, gen.loss_mask  # [B, T] each
            metrics["generated_tokens"] = gen.generated_lengths.float().mean()
            self.count_tokens(int((gen.prompt_lengths + gen.generated_lengths).sum()))  # what the step ran on
        out = self.distill(input_ids, loss_mask, documents)
        metrics["on_policy"] = torch.tensor(float(source == "student"), device=device)
        metrics["kd"] = out.kd.detach()
        metrics["alpha_0"] = out.alpha
        return out.loss, metrics

    def flops_per_token(self) -> float:
        """Training FLOPs per token (drafter forward and backward, target forward); generation is not counted."""
        seq_len = self.data_seq_len()
        return 3.0 * causal_lm_flops_per_token(self.student, seq_len) + causal_lm_flops_per_token(
            self.target.model, seq_len
        )

    def drafter_record(self) -> DrafterRecord:
        return hf_causal_lm.make_record(self.student, "student", self.target_path, self.target_config)

    def on_train_end(self) -> None:
        if self.export_dir:
            export_student(self, self.student, self.export_dir, self.target_path)
