"""A self-contained `fit` entry point for the strategy tests: a tiny random Llama trained on a learnable token rule.

Run it like the project CLI, with the same ``recipes/_base`` fragments::

    python tests/integration/_toy_fit.py fit --config recipes/_base/ddp.yaml --trainer.devices 2 \
        --trainer.accelerator cpu --trainer.max_steps 4 --trainer.default_root_dir DIR \
        --trainer.callbacks+=tests.integration._probe.StateProbe --trainer.callbacks.out_dir DIR/probe

Lightning launches the second rank itself by re-running this command line.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.distributed.strategies import deepspeed_offload_enabled, shard_for_fsdp2


def build_toy_llama(vocab_size: int, hidden_size: int, num_layers: int, seed: int) -> LlamaForCausalLM:
    """The same random Llama on every call with the same arguments."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


class ToyLM(LightningModule):
    """Trains a tiny LlamaForCausalLM with next-token cross-entropy."""

    def __init__(
        self, vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 2, lr: float = 1e-2, seed: int = 0
    ) -> None:
        """Create the module (the model itself is built in configure_model).

        Args:
            vocab_size: vocabulary of the model and the data.
            hidden_size: model width.
            num_layers: decoder layers.
            lr: Adam learning rate.
            seed: seed of the random initial weights.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        h = self.hparams
        self.model = build_toy_llama(h.vocab_size, h.hidden_size, h.num_layers, h.seed)
        if self.device_mesh is not None:
            shard_for_fsdp2(self.model, self.device_mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # batch: [B, S] token ids
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if deepspeed_offload_enabled(self.trainer.strategy):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, lr=self.hparams.lr)
        return torch.optim.Adam(params, lr=self.hparams.lr)


class _RuleTokens(Dataset):
    """Sequences that follow x[i+1] = (5 x[i] + 3) mod V from a random start: a bigram rule a model learns fast."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab_size, (num_samples,), generator=g)  # [N]
        rows = [starts]
        for _ in range(seq_len - 1):
            rows.append((5 * rows[-1] + 3) % vocab_size)
        self.data = torch.stack(rows, dim=1)  # [N, S]

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class ToyData(LightningDataModule):
    """Random rule-following token batches."""

    def __init__(
        self, num_samples: int = 32, seq_len: int = 16, batch_size: int = 4, vocab_size: int = 128, seed: int = 0
    ) -> None:
        """Create the data module.

        Args:
            num_samples: sequences per epoch, over all ranks.
            seq_len: tokens per sequence.
            batch_size: sequences per rank and step.
            vocab_size: token ids are drawn below this.
            seed: seed of the start tokens.
        """
        super().__init__()
        self.dataset = _RuleTokens(num_samples, seq_len, vocab_size, seed)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, num_workers=0)


def main() -> None:
    LightningCLI(ToyLM, ToyData, seed_everything_default=0, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
