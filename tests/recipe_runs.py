"""Runs recipes in-process for tests: the real CLI path, with overrides that point every path into a tmp dir."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainer.training.recipe import DraftsmithCLI

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"

# A model small enough for tests: about 24k tokens/s on 2 cores.
TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
TINY_STUDENT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def save_random_target(folder: Path, tokenizer_dir, seed: int = 0) -> Path:
    """A random 2-layer Llama of :data:`TINY_MODEL` with the tokenizer of ``tokenizer_dir`` saved beside it (no
    training: for tests that need a target of the right shape, not a good one; another ``seed``, another target of
    the same shapes)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=256, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **TINY_MODEL,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def trainer_overrides(run_dir: Path, max_steps: int, every_n: int, **extra) -> dict:
    """A trainer section that writes logs and checkpoints under ``run_dir`` and stays quiet."""
    return {
        "trainer": {
            "max_steps": max_steps,
            "default_root_dir": str(run_dir),
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "val_check_interval": every_n,
            "limit_val_batches": 2,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(run_dir), "name": "tensorboard"},
            },
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "dirpath": str(run_dir / "checkpoints"),
                        "every_n_train_steps": every_n,
                        "save_top_k": -1,
                        "save_last": True,
                    },
                }
            ],
            **extra,
        }
    }


def data_overrides(corpus, seq_len: int = 64, batch_size: int = 4, **extra) -> dict:
    return {
        "data": {
            "init_args": {
                "tokenizer": str(corpus.tokenizer_dir),
                "train_files": [str(corpus.train_file)],
                "val_files": [str(corpus.heldout_file)],
                "seq_len": seq_len,
                "batch_size": batch_size,
                "cache_dir": str(Path(corpus.out_dir) / "tokenized"),
                **extra,
            }
        }
    }


def kd_override(
    run: Path, corpus, target: Path, max_steps: int, every_n: int, batch_size: int = 4, callbacks=(), **model
) -> dict:
    """Overrides of recipes/quickstart/kd.yaml for a tiny run under ``run``: the test target, the tiny student, the
    student exported to ``run/student``, extra trainer ``callbacks`` and ``model`` init_args."""
    override = merge(
        trainer_overrides(run, max_steps=max_steps, every_n=every_n),
        data_overrides(corpus, batch_size=batch_size),
        {
            "model": {
                "init_args": {
                    "target": str(target),
                    "export_dir": str(run / "student"),
                    "drafter_config": TINY_STUDENT,
                    "loss_chunk_size": 64,
                    **model,
                }
            }
        },
    )
    override["trainer"]["callbacks"] += list(callbacks)
    return override


def record_batches(run: Path) -> dict:
    """The RecordBatches test callback writing ``run/batches.jsonl``."""
    return {"class_path": "tests.callbacks.RecordBatches", "init_args": {"path": str(run / "batches.jsonl")}}


def merge(*dicts: dict) -> dict:
    out: dict = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_override(path: Path, override: dict) -> Path:
    path.write_text(yaml.safe_dump(override))
    return path


def fit(recipe: str, override: dict, tmp: Path, extra_args: tuple[str, ...] = ()) -> DraftsmithCLI:
    """``draftsmith fit --config RECIPE --config OVERRIDE [extra_args]`` in this process."""
    tmp.mkdir(parents=True, exist_ok=True)
    override_file = write_override(tmp / "override.yaml", override)
    args = ["fit", "--config", str(RECIPES / recipe), "--config", str(override_file), *extra_args]
    return DraftsmithCLI(args=args)
