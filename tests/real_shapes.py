"""Targets of the real models' shapes with random weights: the published ``config.json`` of each real model the
real-model recipes name (``tests/fixtures/real_configs/<name>/``, configs only, no weights) with the layer count cut,
and a tokenizer built here with the real vocabulary size and the real special tokens at their real ids.

``build_cut_target(name, out, num_layers)`` writes an HF model folder that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load: ``config.json`` (the published one, ``num_hidden_layers`` cut to ``num_layers`` and nothing
else changed but what the fixture's README lists), ``model.safetensors`` (random weights at the config's
``initializer_range``, the model's own initialisation), the tokenizer files and ``generation_config.json``. A folder
that holds a complete build of the same arguments is reused.

The tokenizer: a byte-level BPE trained in seconds on the Python standard library's source, its vocabulary padded with
unreachable placeholder tokens to the real tokenizer's size, every special token of ``tokenizer_spec.json`` at its real
id, and the model's published chat template (``tests/fixtures/chat_templates/``, verbatim; DeepSeek-V3 has none there:
no verbatim copy of its template was found, so its tokenizer has no chat template).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real_configs"
REAL_MODELS: dict[str, Path] = {
    name: FIXTURES / name for name in ("llama31_8b", "qwen3_8b", "qwen3_5_9b", "deepseek_v3")
}
"""Name -> the fixture folder holding its published ``config.json`` and ``tokenizer_spec.json``."""

CHAT_TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
PUBLISHED_CHAT_TEMPLATE: dict[str, Path | None] = {
    "llama31_8b": CHAT_TEMPLATES / "llama31_8b_instruct.jinja",
    "qwen3_8b": CHAT_TEMPLATES / "qwen3_8b.jinja",
    "qwen3_5_9b": CHAT_TEMPLATES / "qwen3_5_9b.jinja",
    "deepseek_v3": None,
}
"""Name -> the model's published chat template, verbatim (tests/fixtures/chat_templates/README.md names the sources)."""

BPE_MERGED_TOKENS = 4096
"""Learned BPE tokens of the built tokenizer (the 256 bytes included); the rest of the vocabulary is placeholders."""
BPE_TRAIN_BYTES = 2_000_000
"""Standard-library source the BPE is trained on."""
DEEPSEEK_ROUTED_EXPERTS = 16
"""DeepSeek-V3's 256 routed experts of width 2048 do not fit a CPU rehearsal: the cut keeps 16 (2 per group of 8)."""
_COMPLETE = "real_shapes.json"

_bpe_cache: dict[str, tuple[list[str], list[tuple[str, str]]]] = {}


def published_config(name: str) -> dict:
    """The fixture's ``config.json`` as published."""
    return json.loads((REAL_MODELS[name] / "config.json").read_text())


def tokenizer_spec(name: str) -> dict:
    """The fixture's ``tokenizer_spec.json``: tokenizer size, special tokens with their ids, bos/eos/pad, generation
    config."""
    return json.loads((REAL_MODELS[name] / "tokenizer_spec.json").read_text())


def cut_config(name: str, num_layers: int) -> dict:
    """The published config with ``num_layers`` decoder layers (``layer_types`` cut with it), and the changes a CPU
    build needs: DeepSeek-V3 without its fp8 ``quantization_config`` (the weights are bf16) and custom-code
    ``auto_map`` (transformers has the architecture), with :data:`DEEPSEEK_ROUTED_EXPERTS` routed experts."""
    config = published_config(name)
    text = config.get("text_config", config)
    if num_layers < 1 or num_layers > text["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{text['num_hidden_layers']} for {name}, got {num_layers}")
    text["num_hidden_layers"] = num_layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:num_layers]
    if "max_window_layers" in text:
        text["max_window_layers"] = num_layers
    if config["model_type"] == "deepseek_v3":
        config.pop("quantization_config")
        config.pop("auto_map")
        config["n_routed_experts"] = DEEPSEEK_ROUTED_EXPERTS
    return config


# ------------------------------------------------------------------------------------------------------- tokenizer


def _stdlib_text(max_bytes: int) -> list[str]:
    from trainer.data.corpus import stdlib_python_files

    texts, total = [], 0
    for path in stdlib_python_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def _trained_bpe() -> tuple[list[str], list[tuple[str, str]]]:
    """The learned tokens (in id order) and merges of a byte-level BPE of :data:`BPE_MERGED_TOKENS` tokens."""
    if "bpe" not in _bpe_cache:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = trainers.BpeTrainer(
            vocab_size=BPE_MERGED_TOKENS,
            min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_stdlib_text(BPE_TRAIN_BYTES), trainer=trainer)
        model = json.loads(tok.to_str())["model"]
        tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        _bpe_cache["bpe"] = (tokens, merges)
    return _bpe_cache["bpe"]


def build_tokenizer(name: str, out: Path):
    """Writes the tokenizer of ``name`` to ``out`` and returns it: ``len(tokenizer)`` is the real tokenizer's size and
    every special token sits at its real id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = tokenizer_spec(name)
    size, specials = spec["tokenizer_size"], spec["special_tokens"]
    by_id = {int(i): t for t, i in specials.items()}
    learned, merges = _trained_bpe()
    vocab: dict[str, int] = {}
    free = (i for i in range(size) if i not in by_id)
    for token in learned:
        vocab[token] = next(free)
    for i in free:  # unreachable: no merge produces them
        vocab[f"<|placeholder_{i}|>"] = i
    vocab.update({t: i for i, t in by_id.items()})
    if sorted(vocab.values()) != list(range(size)):
        raise AssertionError(f"{name}: the built vocabulary does not cover ids 0..{size - 1} once each")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(by_id[i], special=True, normalized=False) for i in sorted(by_id)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec["bos_token"],
        eos_token=spec["eos_token"],
        pad_token=spec["pad_token"],
        unk_token=None,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    template = PUBLISHED_CHAT_TEMPLATE[name]
    if template is not None:
        tok.chat_template = template.read_text()
    wrong = {t: tok.convert_tokens_to_ids(t) for t, i in specials.items() if tok.convert_tokens_to_ids(t) != i}
    if wrong or len(tok) != size:
        raise AssertionError(f"{name}: special ids {wrong}, size {len(tok)} (want {size})")
    tok.save_pretrained(out)
    return tok


# ------------------------------------------------------------------------------------------------------- weights


def _random_state(config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The random weights of the cut model in the published checkpoint's naming."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    del model
    if config["model_type"] == "qwen3_5":
        # the published Qwen3.5 checkpoints hold the language model under model.language_model.* and one MTP layer
        state = {
            ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in state.items()
        }
        state.update(_qwen3_5_mtp_state(config, dtype))
    return state


def _qwen3_5_mtp_state(config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``mtp.*`` of a Qwen3.5 checkpoint (``mtp_num_hidden_layers`` full-attention layers, one fc and three norms),
    random, in the published naming."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    text = dict(config["text_config"])
    n = int(text.get("mtp_num_hidden_layers", 0))
    hidden, std = int(text["hidden_size"]), float(text.get("initializer_range", 0.02))
    text.update(num_hidden_layers=1, layer_types=["full_attention"])
    layer_config = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    state: dict[str, torch.Tensor] = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden) * std,
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),  # Qwen3.5 norms scale by (1 + weight)
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden),
        "mtp.norm.weight": torch.zeros(hidden),
    }
    for i in range(n):
        layer = Qwen3_5DecoderLayer(layer_config, 0)
        for key, value in layer.state_dict().items():
            if value.ndim >= 2:
                value = torch.randn(value.shape) * std
            state[f"mtp.layers.{i}.{key}"] = value.detach().clone()
    return {k: v.to(dtype).contiguous() for k, v in state.items()}


def build_cut_target(name: str, out: Path, num_layers: int, dtype: torch.dtype = torch.bfloat16) -> Path:
    """An HF model folder of the real model ``name`` (a key of :data:`REAL_MODELS`) cut to ``num_layers`` decoder
    layers, random weights in ``dtype``; reuses ``out`` when it holds a complete build of the same arguments.

    Args:
        name: the real model, a key of :data:`REAL_MODELS`.
        out: the folder to write.
        num_layers: decoder layers kept (``num_hidden_layers``).
        dtype: the weights' dtype in ``model.safetensors``.
    """
    from safetensors.torch import save_file

    if name not in REAL_MODELS:
        raise KeyError(f"unknown real model {name!r}; known: {sorted(REAL_MODELS)}")
    out = Path(out)
    stamp = {"name": name, "num_layers": num_layers, "dtype": str(dtype), "version": 1}
    marker = out / _COMPLETE
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = cut_config(name, num_layers)
    spec = tokenizer_spec(name)
    build_tokenizer(name, out)
    state = _random_state(config, dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    generation = {**spec["generation_config"], "transformers_version": config.get("transformers_version", "")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    marker.write_text(json.dumps(stamp))
    return out
