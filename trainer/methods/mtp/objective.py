"""Sequential multi-token prediction (DeepSeek-V3 MTP): D modules after a trunk, three modes in one objective.

Module ``k`` (1-based here, as the papers count) reads the hidden state of depth ``k - 1`` (the trunk's for k = 1) and
the embedding of token ``t + k``, runs one decoder layer of the trunk's family and predicts token ``t + k + 1`` through
its own final norm and the trunk's lm_head (module.py). Each depth's cross entropy is computed in chunks of positions
(trainer/losses/distillation.py), one depth after the other, so the float32 logits of several depths never exist at
once. Modes:

- ``pretrain``: a fresh trunk (any HF family: ``model_type`` and ``target_config``, vocabulary from ``tokenizer``)
  trained together with its modules: ``loss = CE_main + lambda / D * sum_k CE_k``, lambda scheduled by the tokens
  seen (``mtp_weights``: DeepSeek-V3 used 0.3 for the first 10T tokens, then 0.1). MTP gradients reach the trunk,
  its embedding and its lm_head, which the modules share.
- ``refresh``: the trunk is a frozen, already post-trained model (``target``); the modules start from its own MTP
  modules when its checkpoint holds them (either layout, or ``init_from``, a draftsmith training checkpoint), or
  fresh, and are trained on regenerated data: ``loss = 1 / D * sum_k CE_k``. This is what a chat fine-tune that
  made the pre-training modules stale calls for.
- ``extend`` (MiMo): module 1 of the model (or of ``init_from``) is copied into modules 2..D, and only those are
  trained, the model and module 1 frozen: ``loss = 1 / (D - 1) * sum_{k >= 2} CE_k``.

The hidden state module 1 reads (``trunk_hidden``: after or before the trunk's final norm) and the engine conventions
(``layout``) default to what the serving engine does for the trunk's architecture: the DeepSeek NextN layout for
DeepSeek-V3 architectures, the Qwen3-Next / Qwen3.5 ``mtp.*`` layout otherwise; both feed the normed output.

In the modes with a frozen model, that model is the target the SpeculativeEvalCallback decodes with; in pre-training
the trained trunk is. Sharded strategies (FSDP2, ZeRO-3) are refused: the loss reads the lm_head and the embedding
outside their modules' forward.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from trainer.data.vocab import load_tokenizer_if_present
from trainer.interface.errors import RecipeError
from trainer.losses.distillation import chunked_cross_entropy
from trainer.methods.mtp import export as exports
from trainer.methods.mtp import kind as mtp_kind
from trainer.methods.mtp.module import MTPConfig, MTPDrafter, text_config
from trainer.models.logit_scaling import LogitScaling
from trainer.models.target import FrozenTarget, resolve_dtype
from trainer.training.activation_memory import (
    PlannedStep,
    Shape,
    causal_lm_layers,
    chunked,
    frozen_forward,
    layer_saved,
)
from trainer.training.objective import DataRequirements, DraftObjective, causal_lm_flops_per_token, count_params
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

log = logging.getLogger(__name__)


def mtp_weight(schedule: list[tuple[int, float]], tokens_seen: int) -> float:
    """lambda after ``tokens_seen`` training tokens: the weight of the last entry whose token count is reached (the
    first entry's before that)."""
    weight = schedule[0][1]
    for tokens, value in schedule:
        if tokens_seen >= tokens:
            weight = value
    return weight


class SequentialMTP(DraftObjective):
    """Trains DeepSeek-V3-style MTP modules: with a fresh trunk, or on a frozen model (refresh, extend)."""

    def __init__(
        self,
        mode: Literal["pretrain", "refresh", "extend"] = "pretrain",
        mtp_depth: int = 1,
        target: str | None = None,
        tokenizer: str | None = None,
        model_type: str = "llama",
        target_config: dict[str, int | float | str | bool] | None = None,
        mtp_weights: list[tuple[int, float]] | None = None,
        trunk_hidden: Literal["auto", "after_norm", "before_norm"] = "auto",
        layout: Literal["auto", "nextn", "qwen3_next"] = "auto",
        init_from: str | None = None,
        load_target_modules: bool = True,
        loss_chunk_size: int = 256,
        target_dtype: str = "float32",
        drafter_dtype: str = "float32",
        export_dir: str | None = None,
        trust_remote_code: bool = False,
        seed: int = 0,
        optim: Optim = Optim(lr=1e-3, warmup_steps=50),
    ) -> None:
        """
        Args:
            mode: "pretrain" (a fresh trunk trained with its modules), "refresh" (modules on a frozen model) or
                "extend" (module 1 copied into modules 2..D, which alone are trained).
            mtp_depth: D, the number of modules.
            target: refresh and extend: the frozen model, an HF causal LM directory or hub id; pretrain: None.
            tokenizer: pretrain: the tokenizer directory (its length is the vocabulary); refresh and extend: the
                target's, by default.
            model_type: pretrain: the trunk's HF model type (llama, deepseek_v3, qwen3, ...).
            target_config: pretrain: the trunk's config keys, e.g. {hidden_size: 256, num_hidden_layers: 4}.
            mtp_weights: pretrain: lambda by training tokens seen, [[tokens, lambda], ...] (default [[0, 0.3]];
                DeepSeek-V3: [[0, 0.3], [10000000000000, 0.1]]).
            trunk_hidden: the trunk hidden state module 1 reads: "after_norm" or "before_norm" of its final norm;
                "auto" is what the layout's engines feed (after_norm for both).
            layout: the engine conventions the modules are trained for, "nextn" (DeepSeek) or "qwen3_next"; "auto"
                is nextn for DeepSeek-V3 architectures and qwen3_next otherwise.
            init_from: refresh and extend: a draftsmith training checkpoint (kind mtp) to take the modules from.
            load_target_modules: refresh and extend: start from the MTP modules the target's checkpoint holds, if any.
            loss_chunk_size: positions per chunk of the cross entropy.
            target_dtype: the trunk's weights dtype (float32, bfloat16, float16).
            drafter_dtype: the modules' weights dtype.
            export_dir: pretrain: where the trained model is saved at the end of fit, without its modules, as a plain
                HF checkpoint with the tokenizer (the target other recipes name); the modules stay in the training
                checkpoint (``draftsmith export`` writes the model with them).
            trust_remote_code: allow custom modelling code in the model directory (off by default).
            seed: seed of the fresh weights' initialisation.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        # the tokenizer is left out: the logger merges hparams with the datamodule's, whose `tokenizer` may differ
        # (None here in refresh mode); the resolved recipe beside every checkpoint keeps it
        self.save_hyperparameters(ignore=["optim", "tokenizer"])
        if mtp_depth < 1:
            raise RecipeError(f"model.mtp_depth must be >= 1, got {mtp_depth}")
        if mode == "extend" and mtp_depth < 2:
            raise RecipeError(
                f"model.mode extend copies module 1 into modules 2..D: mtp_depth must be >= 2, got {mtp_depth}"
            )
        schedule = [(int(t), float(w)) for t, w in (mtp_weights or [(0, 0.3)])]
        counts = [t for t, _ in schedule]
        if not schedule or min(w for _, w in schedule) < 0 or counts != sorted(set(counts)):
            raise RecipeError(
                f"model.mtp_weights={mtp_weights}: needs [[tokens, lambda], ...] with increasing tokens, lambda >= 0"
            )
        self.mode, self.depth, self.schedule, self.loss_chunk_size = mode, mtp_depth, schedule, loss_chunk_size
        self.register_buffer("mtp_tokens_seen", torch.zeros((), dtype=torch.long))
        torch.manual_seed(seed)
        if mode == "pretrain":
            if target is not None or init_from is not None:
                raise RecipeError(
                    "model.mode pretrain builds a fresh trunk: target and init_from are for refresh and extend"
                )
            if tokenizer is None:
                raise RecipeError("model.mode pretrain needs model.tokenizer (its length is the vocabulary)")
            trunk = self._fresh_trunk(tokenizer, model_type, target_config or {}).to(resolve_dtype(target_dtype))
            self.drafter = MTPDrafter(MTPConfig.for_trunk(trunk.config, mtp_depth, layout, trunk_hidden), trunk)
        elif mode in ("refresh", "extend"):
            if target is None:
                raise RecipeError(f"model.mode {mode} needs model.target, the frozen model's directory or hub id")
            if export_dir is not None:
                raise RecipeError(
                    f"model.export_dir is for pretrain: {mode} leaves the model as it is (export the modules)"
                )
            frozen = self.load_target(target, "online", target_dtype, trust_remote_code)
            self.drafter = self._modules_for(frozen, init_from, load_target_modules, layout, trunk_hidden)
        else:
            raise RecipeError(f"model.mode={mode!r} is not pretrain, refresh or extend")
        self.tokenizer_path = tokenizer or target
        if tokenizer is not None:  # the data's token ids must be this tokenizer's
            self.tokenizer = load_tokenizer_if_present(tokenizer)
        self.drafter.mtp.to(resolve_dtype(drafter_dtype))
        self.export_dir = export_dir
        conventions = self.drafter.config
        log.info("MTP %s: %d modules, layout %s, module 1 reads the trunk's hidden state %s", mode, mtp_depth,
                 conventions.layout, conventions.trunk_hidden)  # fmt: skip

    # ---- building ------------------------------------------------------------------------------------------------
    @staticmethod
    def _fresh_trunk(tokenizer: str, model_type: str, overrides: dict) -> PreTrainedModel:
        tok = AutoTokenizer.from_pretrained(tokenizer)
        settings = dict(
            vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, max_position_embeddings=2048, tie_word_embeddings=False,
        )  # fmt: skip
        try:
            defaults = AutoConfig.for_model(model_type)
        except ValueError as err:
            raise RecipeError(f"model.model_type={model_type!r}: {err}") from err
        unknown = sorted(k for k in overrides if not hasattr(defaults, k))
        if unknown:
            raise RecipeError(f"model.target_config: {unknown} are not keys of a {model_type} config")
        settings.update(overrides)
        config = AutoConfig.for_model(model_type, **settings)
        return AutoModelForCausalLM.from_config(config)

    def _modules_for(
        self, frozen: FrozenTarget, init_from: str | None, from_model: bool, layout: str, trunk_hidden: str
    ) -> MTPDrafter:
        """The modules to train on a frozen model: from ``init_from``, from the model's checkpoint, or new ones."""
        model = self.target_path
        source: MTPDrafter | None = None
        where = ""
        if init_from is not None:
            source, where = self.drafter_from_checkpoint(init_from, mtp_kind.KIND), f"model.init_from {init_from!r}"
        elif from_model:
            found = exports.load_model_modules(model)
            if found is not None:
                source, where = found[0], f"the MTP modules of {model!r}"
        if source is None:
            if self.mode == "extend":
                raise RecipeError(
                    f"model.mode extend copies module 1: {model!r} holds no MTP modules and no model.init_from is given"
                )
            log.info("MTP refresh: %s holds no MTP modules: training new ones", model)
            return MTPDrafter(MTPConfig.for_trunk(frozen.config, self.depth, layout, trunk_hidden))
        config = source.config
        asked = {"layout": layout, "trunk_hidden": trunk_hidden}
        for key, value in asked.items():
            if value not in ("auto", getattr(config, key)):
                raise RecipeError(f"{where} were trained with {key}={getattr(config, key)}, model.{key} is {value}")
        log.info("MTP %s: modules from %s", self.mode, where)
        if self.mode == "refresh":
            if config.depth != self.depth:
                raise RecipeError(
                    f"{where} has {config.depth} modules, model.mtp_depth is {self.depth}: refresh keeps them"
                )
            source.trunk = None  # a pre-training checkpoint's trunk: the frozen model replaces it
            return source
        config_d = MTPConfig(**{**config.to_dict(), "depth": self.depth})
        drafter = MTPDrafter(config_d)
        first = source.mtp.layers[0].state_dict()
        for layer in drafter.mtp.layers:
            layer.load_state_dict(first)
        drafter.mtp.layers[0].requires_grad_(False)  # module 1 frozen; modules 2..D start as its copies
        return drafter

    # ---- training ------------------------------------------------------------------------------------------------
    def trunk(self) -> PreTrainedModel:
        """The model the modules follow: the trained trunk (pretrain) or the frozen target (refresh, extend)."""
        return self.drafter.trunk if self.target is None else self.target.model

    def trainable_module(self) -> nn.Module:
        return self.drafter

    def configure_model(self) -> None:
        if self.weights_are_sharded():
            raise RecipeError(
                "SequentialMTP under FSDP2 or ZeRO-3: the loss reads the lm_head and embedding weights outside their "
                "modules' forward, which sharding splits: use DDP or ZeRO-1/2"
            )

    def data_requirements(self) -> DataRequirements:
        """The trunk's tokenizer."""
        width = int(self.trunk().get_output_embeddings().weight.shape[0])
        return DataRequirements(width, name=self.target_path or self.tokenizer_path)

    def setup(self, stage: str) -> None:
        """The data's checks, and the strategy's (:meth:`configure_model`)."""
        super().setup(stage)
        self.configure_model()

    def _trunk_states(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, S, H] the trunk's final normed hidden states, and the pre-norm ones when module 1 reads them."""
        decoder = self.trunk().get_decoder()
        captured: dict[str, torch.Tensor] = {}
        handle = None
        if self.drafter.config.trunk_hidden == "before_norm":
            handle = decoder.norm.register_forward_pre_hook(lambda module, args: captured.setdefault("pre", args[0]))
        try:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.target is None):
                post = decoder(input_ids=ids, use_cache=False).last_hidden_state  # [B, S, H]
        finally:
            if handle is not None:
                handle.remove()
        return post, captured.get("pre")

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids, labels = batch["input_ids"], batch["labels"]  # [B, S] each; labels[i] is token i + 1
        trunk = self.trunk()
        head = trunk.get_output_embeddings().weight  # [V, H]
        post, pre = self._trunk_states(ids)
        h0 = post if self.drafter.config.trunk_hidden == "after_norm" else pre
        metrics: dict[str, torch.Tensor] = {}
        frozen = 1 if self.mode == "extend" else 0
        losses = []
        mtp = self.drafter.mtp
        for k, out in mtp.unroll(h0, ids, trunk.get_input_embeddings(), frozen=frozen):  # out [B, S - k - 1, H]
            depth_labels = labels[:, k + 1 :]  # token i + k + 2 at index i
            if k < frozen or not bool((depth_labels != -100).any()):
                continue
            head_in = mtp.head_input(k, out).to(head.dtype)
            # through the bare head, as the serving engines' MTP modules and the proposer compute their logits
            ce = chunked_cross_entropy(head_in, head, depth_labels, self.loss_chunk_size)
            losses.append(ce)
            metrics[f"mtp_loss_{k + 1}"] = ce.detach()
        mtp_loss = torch.stack(losses).mean() if losses else post.new_zeros((), dtype=torch.float32)
        metrics["mtp_loss"] = mtp_loss.detach()
        if self.mode != "pretrain":
            return mtp_loss, metrics
        weight = mtp_weight(self.schedule, int(self.mtp_tokens_seen))
        if self.training:
            world = self.trainer.world_size if self._trainer is not None else 1
            self.mtp_tokens_seen += ids.numel() * world
        scaling = LogitScaling.from_config(trunk.config)  # the trunk's own logits, as its forward scales them
        main = chunked_cross_entropy(post, head, labels, self.loss_chunk_size, scaling=scaling)
        metrics.update(main_loss=main.detach(), mtp_weight=torch.tensor(weight))
        return main + weight * mtp_loss, metrics

    def flops_per_token(self) -> float:
        seq_len = self.data_seq_len()
        trunk = causal_lm_flops_per_token(self.trunk(), seq_len)
        text = text_config(self.drafter.config.trunk_config())
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
        per_module = 2.0 * count_params(self.drafter.mtp.layers[0]) + 2.0 * text.vocab_size * text.hidden_size
        per_module += 4.0 * heads * head_dim * seq_len
        D = self.depth
        if self.mode == "pretrain":
            return 3.0 * (trunk + D * per_module)
        trained = D - 1 if self.mode == "extend" else D
        return trunk + (D - trained) * per_module + 3.0 * trained * per_module

    def activation_bytes(self, step: PlannedStep) -> int:
        """The modules' saved tensors (fc's 2H input and the two input norms beside a layer's), the trunk's (its
        layers when trained, else the frozen target's forward) and the chunked cross entropy."""
        n, a = step.tokens, step.element
        trunk = self.drafter.trunk  # trained with the modules (pretrain), else the frozen target runs
        t, layers = causal_lm_layers(trunk) if trunk is not None else (Shape.of(self.target_config), 0)
        modules = self.depth * layer_saved(t, n, a, extra_hidden=4)
        trunk_phase = frozen_forward(t, n, step.target_element, hidden_kept=2)
        if trunk is not None and any(p.requires_grad for p in trunk.parameters()):
            trunk_phase = layers * layer_saved(t, n, a)
        return trunk_phase + modules + chunked(step.chunk, n, t.vocab_size)

    def speculative_eval_target(self) -> PreTrainedModel:
        return self.trunk()

    def drafter_record(self) -> DrafterRecord:
        trunk = self.trunk()
        architectures = list(getattr(trunk.config, "architectures", None) or [type(trunk).__name__])
        pretrain = self.mode == "pretrain"
        return mtp_kind.make_record(
            self.drafter.config, None if pretrain else self.target_path, architectures, pretrain, self.tokenizer_path
        )

    def on_train_end(self) -> None:
        if self.export_dir:
            self.save(self.export_dir)

    @rank_zero_only
    def save(self, out_dir: str) -> None:
        """The trained model without its modules (plain HF checkpoint and tokenizer)."""
        path = exports.write_hf(self.drafter, self.drafter_record(), Path(out_dir))
        log.info("model (without its MTP modules) saved to %s", path)
