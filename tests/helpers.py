"""Builders the tests share: tiny HF causal LMs of several families, made locally with fixed seeds."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    DeepseekV3Config,
    Gemma2Config,
    GemmaConfig,
    GraniteConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)


def tiny_llama(
    seed: int,
    vocab: int = 128,
    hidden: int = 32,
    layers: int = 2,
    dtype: torch.dtype = torch.float64,
    **config,
) -> LlamaForCausalLM:
    """A random Llama of ``layers`` layers and width ``hidden`` in eval mode (float64: no near-ties in argmax)."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    settings.update(config)
    return LlamaForCausalLM(LlamaConfig(**settings)).to(dtype).eval()


def tiny_model(model_type: str, seed: int, vocab: int = 96, layers: int = 3, **config) -> PreTrainedModel:
    """A random float64 causal LM of another family: qwen2, qwen3, mistral, gemma or deepseek_v3 (dense layers)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    if model_type == "deepseek_v3":
        extra = dict(
            first_k_dense_replace=layers, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, head_dim=8, n_group=1, topk_group=1, num_nextn_predict_layers=0,
        )  # fmt: skip
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: one latent, expanded to every head
        cfg = DeepseekV3Config(**common, **extra, **config)
    else:
        classes = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig, "gemma": GemmaConfig}
        extra = {"head_dim": 8} if model_type in ("qwen3", "gemma") else {}
        if model_type == "mistral":
            extra["sliding_window"] = None
        cfg = classes[model_type](**common, **{**extra, **config})
    return AutoModelForCausalLM.from_config(cfg).to(torch.float64).eval()


SCALED_FAMILIES = ("llama", "gemma2", "granite", "cohere")
"""Families of :func:`tiny_scaled_model`: Llama (no output scaling) and three whose forward scales the logits."""


def tiny_scaled_model(name: str, seed: int = 0, vocab: int = 64, **config) -> PreTrainedModel:
    """A random float64 causal LM of a family whose forward scales its logits after the lm_head, each scaling set
    large enough to matter: Gemma-2 (``final_logit_softcapping`` 0.5), Granite (``logits_scaling`` 4: divided),
    Cohere (``logit_scale`` 0.25: multiplied); ``llama`` (none) for comparison. ``config``: overrides of the config
    (another soft-cap or scale...)."""
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)  # fmt: skip
    scalings = {
        "gemma2": (Gemma2Config, {"final_logit_softcapping": 0.5}),
        "granite": (GraniteConfig, {"logits_scaling": 4.0}),
        "cohere": (CohereConfig, {"logit_scale": 0.25, "eos_token_id": 0}),
        "llama": (LlamaConfig, {}),
    }
    config_class, scaling = scalings[name]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config_class(**{**shape, **scaling, **config})).double().eval()


def chat_stream(tok, convs: list[list[dict]]) -> tuple[list[int], list[int]]:
    """The token stream and assistant mask TextDataModule packs from chat conversations, built here from the chat
    template (an EOS appended, untrained, when a conversation does not end with one)."""
    ids, mask = [], []
    for c in convs:
        out = tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids += out["input_ids"]
        mask += out["assistant_masks"]
        if ids[-1] != tok.eos_token_id:
            ids.append(tok.eos_token_id)
            mask.append(0)
    return ids, mask


def write_jsonl(path, records: list) -> str:
    """``records`` as a jsonl file at ``path``; returns the path as a string."""
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def text_datamodule(corpus, tmp_path, **kw):
    """A TextDataModule with the test corpus' tokenizer and a cache under ``tmp_path``."""
    from trainer.data.text import TextDataModule

    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return TextDataModule(tokenizer=corpus.tokenizer_dir, **kw)


class SpeculativeEvalModule(pl.LightningModule):
    """A minimal module implementing SpeculativeEvalCallback's protocol (the objectives do it through their base
    class): a frozen random target and a random student of the same vocabulary, trained by plain next-token loss."""

    def __init__(self, vocab: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.target_model = tiny_llama(0, vocab, dtype=dtype, eos_token_id=None).requires_grad_(False)
        self.student = tiny_llama(1, vocab, dtype=dtype, eos_token_id=None)

    def speculative_eval_target(self):
        return self.target_model

    def trainable_module(self):
        return self.student

    def drafter_record(self):
        from trainer.methods.draft_model import kind as hf_causal_lm

        return hf_causal_lm.make_record(self.student, "student", "unused", self.target_model.config)

    def training_step(self, batch, batch_idx):
        return self.student(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=1e-3)


def cache_as_hub_repository(folder: Path, cache: Path, repo_id: str, commit: str = "0" * 40) -> Path:
    """Lays ``folder``'s files out as the Hugging Face cache holds a downloaded repository ``repo_id`` (``cache`` as
    ``HF_HUB_CACHE``: ``models--org--name/refs/main`` naming the commit, ``snapshots/<commit>/`` holding the files);
    returns the snapshot folder. Commands then find the model by its hub id with ``HF_HUB_OFFLINE=1``."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    return snapshot
