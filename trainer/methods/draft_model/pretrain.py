"""Next-token pretraining of a small causal LM: how the project makes its own tiny targets.

Tests and the demo need a target that nothing has to download. This objective trains a Llama-architecture model from
scratch on the prepared corpus and saves it with ``save_pretrained`` plus the tokenizer, so that every other recipe
can name the directory as its target.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from transformers import AutoTokenizer, LlamaForCausalLM

from trainer.losses.distillation import chunked_cross_entropy
from trainer.methods.draft_model import kind as hf_causal_lm
from trainer.models.llama import new_llama_config
from trainer.models.target import document_kwargs
from trainer.training.activation_memory import PlannedStep, causal_lm_layers, chunked, layer_saved
from trainer.training.objective import DataRequirements, DraftObjective, causal_lm_flops_per_token
from trainer.training.optimizers import Optim
from trainer.training.registry import DrafterRecord

log = logging.getLogger(__name__)


class CausalLMPretraining(DraftObjective):
    """Trains a fresh Llama-architecture model with next-token cross entropy."""

    honours_document_ids = True  # packed rows with document masking: the model attends within each document

    def __init__(
        self,
        tokenizer: str,
        hidden_size: int = 256,
        intermediate_size: int = 688,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 4,
        max_position_embeddings: int = 2048,
        tie_word_embeddings: bool = False,
        loss_chunk_size: int = 256,
        export_dir: str | None = None,
        seed: int = 0,
        optim: Optim = Optim(lr=1e-3, warmup_steps=50),
    ) -> None:
        """
        Args:
            tokenizer: the tokenizer directory; its length is the vocabulary size and it is saved beside the model.
            hidden_size: model width.
            intermediate_size: MLP width.
            num_hidden_layers: decoder layers.
            num_attention_heads: query heads.
            num_key_value_heads: key/value heads (fewer than query heads gives grouped-query attention).
            max_position_embeddings: the longest sequence the model is configured for.
            tie_word_embeddings: share the input embedding and the output layer.
            loss_chunk_size: positions per chunk of the cross entropy.
            export_dir: where the model and tokenizer are saved at the end of fit (the directory recipes name as
                target).
            seed: seed of the initialisation.
            optim: optimizer and learning-rate schedule.
        """
        super().__init__(optim)
        self.save_hyperparameters(ignore=["optim"])
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        config = new_llama_config(
            self.tokenizer,
            {
                "hidden_size": hidden_size,
                "intermediate_size": intermediate_size,
                "num_hidden_layers": num_hidden_layers,
                "num_attention_heads": num_attention_heads,
                "num_key_value_heads": num_key_value_heads,
                "max_position_embeddings": max_position_embeddings,
                "tie_word_embeddings": tie_word_embeddings,
            },
            "model",
        )
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(config)
        self.loss_chunk_size = loss_chunk_size
        self.export_dir = export_dir

    def trainable_module(self) -> nn.Module:
        return self.model

    def data_requirements(self) -> DataRequirements:
        """Data of ``model.tokenizer``."""
        return DataRequirements(self.model.config.vocab_size, name=self.hparams.tokenizer)

    def activation_bytes(self, step: PlannedStep) -> int:
        """Every layer's saved tensors and the chunked cross entropy."""
        t, layers = causal_lm_layers(self.model)
        return layers * layer_saved(t, step.tokens, step.element) + chunked(step.chunk, step.tokens, t.vocab_size)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        documents = document_kwargs(self.model, batch.get("document_ids"))  # mask and positions of packed rows
        if self.weights_are_sharded():  # FSDP2 / ZeRO-3: the output weight is a shard outside the forward
            logits = self.model(input_ids=batch["input_ids"], use_cache=False, **documents).logits  # [B, S, V]
            return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100), {}
        hidden = self.model.get_decoder()(
            input_ids=batch["input_ids"], use_cache=False, **documents
        ).last_hidden_state  # [B, S, H]
        weight = self.model.get_output_embeddings().weight  # [V, H]
        return chunked_cross_entropy(hidden, weight, batch["labels"], self.loss_chunk_size), {}

    def flops_per_token(self) -> float:
        seq_len = self.data_seq_len()
        return 3.0 * causal_lm_flops_per_token(self.model, seq_len)

    def drafter_record(self) -> DrafterRecord:
        """An HF causal LM (kind ``hf_causal_lm``): ``draftsmith export`` writes it as an HF checkpoint."""
        record = hf_causal_lm.make_record(self.model, "model", None, self.model.config)
        record.tokenizer = self.hparams.tokenizer
        return record

    def on_train_end(self) -> None:
        if self.export_dir:
            self.save(self.export_dir)

    @rank_zero_only
    def save(self, out_dir: str) -> None:
        """Writes the model and its tokenizer so that ``AutoModelForCausalLM.from_pretrained`` loads them."""
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        log.info("model saved to %s", path)
