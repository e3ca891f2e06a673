"""The frozen target (teacher) model: any HF ``AutoModelForCausalLM``, in eval mode, without gradients; and
``TargetEmbeddings``, only its input embedding and lm_head read from its safetensors, for objectives whose other
target signals come from precomputed shards.

Layer indices follow one convention across the project: ``hidden_states[i]`` as HF returns them, the input of decoder
layer ``i`` (index 0 is the embeddings; index ``L``, the last, is the final normed output, as HF returns it). Exporters
translate to each serving engine's own counting.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from trainer.interface.errors import ModelFolderError, PathError, RecipeError, UserError
from trainer.models.documents import allowed_keys, document_positions
from trainer.models.logit_scaling import LogitScaling

log = logging.getLogger(__name__)

try:  # what huggingface_hub's strict dataclasses raise for a config that fails Hugging Face's own validation
    from huggingface_hub.errors import StrictDataclassError

    CONFIG_VALIDATION_ERRORS: tuple[type[Exception], ...] = (StrictDataclassError,)
except ImportError:  # older huggingface_hub: the configs raise ValueError
    CONFIG_VALIDATION_ERRORS = ()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_path(name_or_path: str, what: str = "target") -> Path:
    """The local path of a target (``model.target``), refused when it is a folder without config.json, or a path that
    looks local (starting with ``/``, ``.`` or ``~``, or of more than two parts) and does not exist: a PathError
    naming it (and ``what`` named it), before Hugging Face would try it as a hub id.

    Returns:
        The expanded path (which need not exist: a hub id such as ``org/name``).
    """
    path = Path(name_or_path).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        raise PathError(f"{what} {name_or_path!r} is not a local model folder (no config.json in that directory)")
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not path.exists():
        raise PathError(
            f"{what} {name_or_path!r}: no such folder", "check the path, or train or download the target first"
        )
    return path


# What a model's folder needs to be loaded (weights, configs, tokenizer, chat template); not the other copies of the
# weights some repositories also hold (Llama's original/consolidated.pth, pytorch_model.bin beside safetensors)
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py")


def resolve_model(name_or_path: str, what: str) -> Path:
    """The local folder of a model named as every command names one: a folder, or a hub id (``org/name``) read from
    the local Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``), fetched into it first unless ``HF_HUB_OFFLINE=1``.

    Args:
        name_or_path: the folder or hub id.
        what: the option or key that named it, for errors (``--target``).

    Raises:
        PathError: a folder without config.json, a path that looks local and does not exist (:func:`check_model_path`),
            or a hub id neither cached nor downloadable.
        ModelFolderError: a hub repository without config.json.
    """
    path = check_model_path(name_or_path, what)
    if path.exists():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_OFFLINE

    try:
        folder = Path(snapshot_download(name_or_path, allow_patterns=list(HUB_FILES)))
    except Exception as err:  # not cached while offline, an unknown repository, no access, no network
        why = "" if HF_HUB_OFFLINE else f": {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if HF_HUB_OFFLINE else "on the hub"
        raise PathError(
            f"{what} {name_or_path!r} is not a local folder, and the hub id was not found {where}{why}",
            f"download it first (`hf download {name_or_path}`) where the hub can be reached, or give its folder",
        ) from err
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"{what} {name_or_path!r}: the hub repository has no config.json ({folder})")
    return folder


# Keys a target's config.json must state: Hugging Face fills a missing one with its class default (a Llama config
# without hidden_size loads as a 4096-wide model, one without rope_theta with theta 10000), which builds another model
# than the published one, or a drafter of the wrong shape, without any error.
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
ROPE_KEYS = ("rope_theta", "rope_parameters")


def check_config_keys(name_or_path: str, config) -> None:
    """Refuses a local target whose config.json omits a key its model (and the drafters built from it) depend on.

    Checked, on the text part of the config (``text_config`` of a multimodal one): the shape keys (vocabulary, width,
    layers, heads; a model type's own spelling, e.g. GPT-2's ``n_embd``, counts); for a model with rotary positions,
    ``rope_theta`` or ``rope_parameters``. (A width the heads do not divide without ``head_dim`` is refused by Hugging
    Face's own validation, turned into a ModelFolderError by :meth:`FrozenTarget.from_pretrained`.) A hub id is not
    checked (its file is not read here).

    Args:
        name_or_path: the target (``model.target``).
        config: its loaded HF config.

    Raises:
        ModelFolderError: naming the file and the missing key.
    """
    file = Path(name_or_path).expanduser() / "config.json"
    if not file.is_file():
        return
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return  # Hugging Face's own error names the file
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    stated = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    where = f"target {name_or_path!r}: {file}"
    aliases = getattr(text, "attribute_map", {}) or {}
    for key in SHAPE_KEYS:
        if key not in stated and aliases.get(key) not in stated and key not in raw:
            raise ModelFolderError(
                f"{where} has no {key}: Hugging Face would build the model with its default "
                f"({getattr(text, key, None)}), not the published one",
                hint=f"copy {key} from the model's published config.json",
            )
    uses_rope = any(getattr(text, k, None) is not None for k in ROPE_KEYS)
    if uses_rope and not any(k in stated or k in raw for k in ROPE_KEYS):
        raise ModelFolderError(
            f"{where} has no rope_theta (nor rope_parameters): Hugging Face would use its default rotary base, and "
            "the target and every drafter built from its config (EAGLE-3, DFlash, MTP) would use other positions "
            "than the published model",
            hint="copy rope_theta and rope_scaling (or rope_parameters) from the model's published config.json",
        )


def check_context(config, seq_len: int | None, target: str | None, key: str = "data.seq_len") -> None:
    """Refuses rows longer than the target's context (``max_position_embeddings`` of its config): positions beyond it
    have no trained rotary or position embedding, and a model with learned positions fails with an index error.

    Args:
        config: the target's HF config (None: nothing to check, as for a model trained from scratch).
        seq_len: the data's tokens per row (``data.seq_len``; None or 0: unknown).
        target: the target's path, for the message.
        key: the recipe key of ``seq_len`` (``data.long_seq_len`` for the long rows of mixed lengths).

    Raises:
        RecipeError: naming the key, its value, and the target's limit.
    """
    if config is None or not seq_len:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise RecipeError(
            f"{key}={seq_len} is beyond the context of the target {target!r}: max_position_embeddings={limit} "
            "in its config.json",
            hint=f"set {key} to at most {limit}",
        )


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); elsewhere PyTorch emulates it."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def emulated_bf16_message(precision: str | None, dtypes: dict[str, str], native: bool | None = None) -> str | None:
    """The warning for bf16 asked of a CPU without native bf16 (None when there is nothing to say).

    PyTorch runs bf16 on any CPU: the results are bf16's, but its matrix products there are slower than float32's,
    4 to 6x in a forward and up to about 90x in some backward layouts (a linear layer's input gradient; measured on
    an AVX2 CPU, docs/benchmarks/rehearsal.md).
    The run keeps the recipe's precision (its memory is what ``draftsmith plan`` estimates for it); the message names
    the keys that ask for bf16 and what to set for speed.

    Args:
        precision: ``trainer.precision``.
        dtypes: recipe key -> dtype name (``model.target_dtype``...).
        native: whether the CPU has native bf16 (default: this one's, :func:`cpu_has_native_bf16`).
    """
    asked = [f"trainer.precision={precision}"] if str(precision).startswith("bf16") else []
    asked += [f"{key}={value}" for key, value in dtypes.items() if value == "bfloat16"]
    if not asked or (cpu_has_native_bf16() if native is None else native):
        return None
    return (
        f"{', '.join(asked)} on a CPU without native bf16 ({torch.backends.cpu.get_cpu_capability()}): PyTorch "
        "emulates bf16 (same results; matrix products 4 to 6x slower than float32's, some backward ones about "
        "90x); set trainer.precision: 32-true and float32 dtypes for speed"
    )


def model_load_error(name_or_path: str, err: OSError) -> UserError:
    """The error of a target that Hugging Face could not load: a ModelFolderError naming the folder (its config.json
    is not JSON, a file is missing...), or for a hub id a PathError."""
    if Path(name_or_path).expanduser().exists():
        return ModelFolderError(f"target {name_or_path!r}: cannot be loaded: {err}")
    return PathError(
        f"target {name_or_path!r} is not a local directory, and loading it as a hub id failed ({err})",
        "check the path, or train or download the target first",
    )


def resolve_dtype(name: str) -> torch.dtype:
    """Maps a recipe's dtype name to a torch dtype, with an error naming the value on a typo."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def document_attention(
    model: PreTrainedModel,
    document_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The ``attention_mask`` and ``position_ids`` that make an HF causal LM (transformers 5.24) run a packed row as
    its documents alone: no token attends across documents, positions restart at each document's first token.

    For the ``eager`` and ``sdpa`` attentions of a model without sliding-window layers, an explicit 4D mask
    [B, 1, S, S] (boolean for sdpa, additive 0 / dtype-min for eager, the forms transformers' own masks take; a 4D
    mask is used as given by ``masking_utils``). Otherwise (flash attention, flex, sliding-window layers) no mask:
    transformers finds the documents from ``position_ids`` restarting at 0 (``find_packed_sequence_indices``, applied
    when no 2D mask and no cache are given), which also keeps every layer's own window.

    Args:
        model: the HF causal LM (or its decoder) the inputs are for.
        document_ids: [B, S] int64, non-decreasing along each row (trainer/models/documents.py).
        attention_mask: [B, S] padding mask (1 = a real token), or None; combined with the documents in the 4D mask.
        position_ids: must be None: the positions are the documents' own.

    Returns:
        (attention_mask, position_ids): a [B, 1, S, S] mask or None, and [B, S] positions.
    """
    if position_ids is not None:
        raise ValueError("document_ids and position_ids are exclusive: the positions are counted within each document")
    if document_ids.ndim != 2:
        raise ValueError(f"document_ids must be [B, S], got shape {tuple(document_ids.shape)}")
    positions = document_positions(document_ids)  # [B, S]
    config = model.config
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    sliding = getattr(config, "sliding_window", None) is not None and any(
        kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ["sliding_attention"])
    )
    if implementation not in ("eager", "sdpa") or sliding:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                f"document_ids with a padding attention_mask needs the eager or sdpa attention without sliding "
                f"windows (this model: {implementation}{', sliding window' if sliding else ''})"
            )
        return None, positions
    index = torch.arange(document_ids.shape[1], device=document_ids.device)  # [S]
    allowed = allowed_keys(index, index, document_ids, document_ids)  # [B, S, S]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]  # [B, S, S]
        allowed = allowed | torch.eye(allowed.shape[-1], dtype=torch.bool, device=allowed.device)  # a padded query
        # keeps itself: a row without any key would give NaN in sdpa (its output is never read)
    allowed = allowed[:, None]  # [B, 1, S, S]
    if implementation == "sdpa":
        return allowed, positions
    dtype = model.get_input_embeddings().weight.dtype
    additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)  # [B, 1, S, S]
    return additive.masked_fill(~allowed, torch.finfo(dtype).min), positions


def document_kwargs(model: PreTrainedModel, document_ids: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The ``attention_mask`` and ``position_ids`` keyword arguments of an HF forward of ``model`` over packed rows
    (:func:`document_attention`), or no arguments when ``document_ids`` is None (one document per row).

    Args:
        model: the HF causal LM (or its decoder), e.g. a KD student.
        document_ids: [B, S] the batch's ``document_ids``, or None.
    """
    if document_ids is None:
        return {}
    attention_mask, position_ids = document_attention(model, document_ids)
    return {"attention_mask": attention_mask, "position_ids": position_ids}


@dataclass
class TargetOutput:
    """What a target forward returns.

    logits: [B, S, V] in the target's dtype, or None when the forward was asked for hidden states only.
    hidden_states: the requested layers' hidden states, each [B, S, H], in the order requested.
    cache: the updated KV cache when ``use_cache`` was set, else None.
    """

    logits: torch.Tensor | None
    hidden_states: list[torch.Tensor]
    cache: object | None


class FrozenTarget(nn.Module):
    """Wraps an HF causal LM so that it can never be trained by accident, nor saved into a training checkpoint.

    The wrapped model's parameters have ``requires_grad=False``, the model stays in eval mode whatever ``train()`` is
    called on a parent module, and every forward runs under ``torch.no_grad()``. Its weights never appear in a parent
    module's ``state_dict`` (so a checkpoint of a distillation run holds the student only), and loading a state dict
    leaves them as they are: on resume the frozen model is rebuilt from its path, and the objective checks its
    fingerprint (trainer/training/fingerprint.py) against the one the checkpoint recorded.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.model.eval()
        self._register_state_dict_hook(_drop_own_entries)
        self.register_load_state_dict_pre_hook(_keep_own_weights)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False
    ) -> FrozenTarget:
        """Loads a local directory or hub id. A local path that does not exist is an error naming the path, and so is
        a folder Hugging Face cannot load (a config.json that is not JSON...)."""
        path = check_model_path(name_or_path)
        check_safetensors_headers(path, f"target {name_or_path!r}")
        try:
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except (ValueError, *CONFIG_VALIDATION_ERRORS) as err:  # refused by its validation (heads that do not divide
            # the width...)
            raise ModelFolderError(
                f"target {name_or_path!r}: its config.json is refused by Hugging Face: {err}"
            ) from err
        except OSError as err:
            raise model_load_error(name_or_path, err) from err
        check_config_keys(name_or_path, config)  # before any weight is read
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
            )
        except OSError as err:
            raise model_load_error(name_or_path, err) from err
        return cls(model)

    def train(self, mode: bool = True) -> FrozenTarget:
        """Keeps the target in eval mode (no dropout) even when the parent module trains."""
        super().train(False)
        return self

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection, [V, H]."""
        return self.model.get_output_embeddings().weight

    @property
    def logit_scaling(self) -> LogitScaling:
        """The output scaling the target's forward applies after its lm_head (identity for most architectures): what
        a loss projecting :meth:`final_hidden` with :attr:`lm_head_weight` applies to get the target's logits."""
        return LogitScaling.from_config(self.model.config)

    def project(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits of its final normed hidden states ``hidden`` [..., H]: [..., V], or [..., len(rows)]
        over the vocabulary rows ``rows`` only, with the output scaling its config declares, as its own forward
        applies it (:attr:`logit_scaling`: Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma-2's
        ``final_logit_softcapping``)."""
        head = self.model.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if rows is not None:
            weight = weight.index_select(0, rows)  # [R, H]
            bias = None if bias is None else bias.index_select(0, rows)
        logits = nn.functional.linear(hidden, weight, bias)  # [..., R]
        return self.logit_scaling(logits)  # [..., R]

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The normalised last hidden state, [B, S, H]: ``logit_scaling(lm_head(final_hidden))`` gives the logits.

        Used by chunked losses, which project to the vocabulary one chunk of positions at a time (and apply
        :attr:`logit_scaling` to each chunk, ``teacher_scaling`` of :func:`trainer.losses.distillation.fused_kd_loss`).

        Args:
            input_ids: [B, S] token ids.
            attention_mask: [B, S] padding mask, or None.
            document_ids: [B, S] the document of every position of a packed row (trainer/models/documents.py), or None:
                each document is then run as if alone (:func:`document_attention`).
        """
        with torch.no_grad():
            backbone = self.model.get_decoder()
            position_ids = None
            if document_ids is not None:
                attention_mask, position_ids = document_attention(backbone, document_ids, attention_mask)
            return backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        cache: object | None = None,
        use_cache: bool = False,
        position_ids: torch.Tensor | None = None,
        logits: bool = True,
        document_ids: torch.Tensor | None = None,
    ) -> TargetOutput:
        """One forward of the target.

        Args:
            input_ids: [B, S] token ids.
            attention_mask: [B, S] padding mask, or None.
            hidden_layers: indices into HF ``hidden_states`` (0 embeddings, L final normed output).
            cache: a KV cache to extend, or None.
            use_cache: return the updated cache.
            position_ids: [B, S] positions, or None (HF counts from the cache's length).
            logits: False skips the output projection (no [B, S, V] tensor: ask for layer L and project what is
                needed, as EAGLE-3's soft labels project onto the draft vocabulary only).
            document_ids: [B, S] int64 the document of every position of a packed row (trainer/models/documents.py), or
                None (one document per row): no position attends across documents and positions restart at each
                document's first token, so every document's hidden states and logits are those of it alone
                (:func:`document_attention`). Exclusive with ``position_ids`` and with a cache.
        """
        L = self.num_layers
        for i in hidden_layers:
            if not 0 <= i <= L:
                raise ValueError(f"hidden layer index {i} out of range: the target has hidden_states 0..{L}")
        model = self.model if logits else self.model.get_decoder()
        if document_ids is not None:
            if cache is not None or use_cache:
                raise ValueError("document_ids is for training forwards over packed rows: not with a KV cache")
            attention_mask, position_ids = document_attention(model, document_ids, attention_mask, position_ids)
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            output_hidden_states=bool(hidden_layers),
        )
        hidden = [out.hidden_states[i] for i in hidden_layers]  # each [B, S, H]
        return TargetOutput(out.logits if logits else None, hidden, out.cache if use_cache else None)


def _drop_own_entries(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict hook of FrozenTarget: remove its weights from the parent's state dict."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]


def _keep_own_weights(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load pre-hook of FrozenTarget: whatever the incoming state dict holds under its prefix (nothing, in a
    checkpoint written by this project), load the weights it already has."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]
    for name, sub in module.named_modules(remove_duplicate=False):
        entries = list(sub._parameters.items()) + [
            (n, b) for n, b in sub._buffers.items() if n not in sub._non_persistent_buffers_set
        ]
        for local, tensor in entries:
            if tensor is not None:
                state_dict[f"{prefix}{name}.{local}" if name else prefix + local] = tensor


# ---------------------------------------------------------------------------------------------------------- tensors

EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "transformer.wte.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
SAFETENSORS_INDEX = "model.safetensors.index.json"


@contextmanager
def open_safetensors(path: str | Path, what: str) -> Iterator[Any]:
    """``safe_open(path)`` (PyTorch tensors) whose header errors name the file: an empty or truncated file, or one
    that is not safetensors, is a :class:`ModelFolderError` naming ``what`` and the file.

    Args:
        path: the safetensors file.
        what: what holds it, for the message (e.g. ``target '/models/llama'``, ``drafter export /out``).
    """
    from safetensors import SafetensorError, safe_open

    file = Path(path)
    try:
        handle = safe_open(str(file), framework="pt")
    except SafetensorError as err:
        raise safetensors_error(file, what, err) from err
    with handle as f:
        yield f


def safetensors_error(file: Path, what: str, err: Exception) -> ModelFolderError:
    """The error for a safetensors ``file`` of ``what`` that could not be read (``err``: safetensors' own)."""
    size = file.stat().st_size if file.is_file() else 0
    if size == 0:
        state = "empty (0 bytes)"
    else:
        detail = str(err).removeprefix("Error while deserializing header: ")
        state = f"truncated or not a safetensors file ({size:,} bytes; {detail})"
    return ModelFolderError(
        f"{what}: {file} is {state}",
        hint="copy or save the model folder again (a download or save that did not finish leaves such files)",
    )


def check_safetensors_headers(folder: str | Path, what: str) -> None:
    """Opens the header of every ``*.safetensors`` file in a local ``folder`` (cheap: no tensor is read), so that an
    empty or truncated one is a :class:`ModelFolderError` naming it before a loader fails without the file's name."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return
    for file in sorted(path.glob("*.safetensors")):
        with open_safetensors(file, what):
            pass


def target_file(name_or_path: str, filename: str) -> Path | None:
    """``filename`` of a local target directory (None when absent), or of a hub id (downloaded; None when absent)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path / filename if (path / filename).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(name_or_path, filename))
    except EntryNotFoundError:
        return None
    except Exception as err:  # offline, unknown repository, no access
        raise PathError(
            f"target {name_or_path!r} is not a local directory, and reading {filename} from the hub failed ({err})"
        ) from err


def weight_map(name_or_path: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, of a target directory (or hub id) with ``model.safetensors``
    or a sharded checkpoint with ``model.safetensors.index.json``; an error naming the target when it has neither."""
    index = target_file(name_or_path, SAFETENSORS_INDEX)
    if index is not None:
        try:
            names: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise ModelFolderError(
                f"target {name_or_path!r}: {index} is not a safetensors index (no weight_map: {err})"
            ) from err
        files = {}
        for file_name in sorted(set(names.values())):
            file = target_file(name_or_path, file_name)
            if file is None:
                raise PathError(f"target {name_or_path!r}: {file_name} (named by its index) is missing")
            files[file_name] = file
        return {name: files[file_name] for name, file_name in names.items()}
    single = target_file(name_or_path, "model.safetensors")
    if single is None:
        raise PathError(
            f"target {name_or_path!r}: no model.safetensors or {SAFETENSORS_INDEX}: the embedding and lm_head are "
            "read from safetensors weights",
            hint="resave the target with save_pretrained (safetensors is its default)",
        )
    with open_safetensors(single, f"target {name_or_path!r}") as f:
        return dict.fromkeys(f.keys(), single)


def load_target_tensors(name_or_path: str, names: dict[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    """Reads single tensors of a target's safetensors weights without building the model.

    Args:
        name_or_path: the target directory (or hub id) holding ``model.safetensors`` or a sharded checkpoint with
            ``model.safetensors.index.json``.
        names: role -> accepted tensor names, the first one present is read (e.g. {"embedding": EMBEDDING_NAMES}).

    Returns:
        role -> the tensor, as stored. A role none of whose names is in the checkpoint is a ModelFolderError naming
        the directory and the names; an empty or truncated safetensors file is one naming the file.
    """
    files = weight_map(name_or_path)
    out: dict[str, torch.Tensor] = {}
    for role, candidates in names.items():
        name = next((n for n in candidates if n in files), None)
        if name is None:
            raise ModelFolderError(
                f"target {name_or_path!r}: its safetensors weights hold no tensor named "
                f"{' or '.join(repr(n) for n in candidates)} (the {role})"
            )
        with open_safetensors(files[name], f"target {name_or_path!r}") as f:
            out[role] = f.get_tensor(name)
    return out


class TargetEmbeddings:
    """What an EAGLE-3 drafter needs of its target when the hidden states come from shards: the config, the input
    embedding [V, H] and the lm_head [V, H] (the embedding itself when the target ties them), frozen.

    Plain tensors, not a module: kept outside the drafter's module tree, they are in no checkpoint and no optimizer.
    The target model is never built.
    """

    def __init__(self, config, embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
        """
        Args:
            config: the target's HF config.
            embedding: the input embedding, [V, H].
            lm_head: the output projection, [V, H].
        """
        self.config = config
        self.embedding = embedding.detach()
        self.lm_head_weight = self.embedding if lm_head is embedding else lm_head.detach()  # one tensor when tied

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False
    ) -> TargetEmbeddings:
        """The target's config (AutoConfig) and its two tensors read from its safetensors, cast to ``dtype``."""
        check_model_path(name_or_path)
        try:
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except OSError as err:
            raise model_load_error(name_or_path, err) from err
        check_config_keys(name_or_path, config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
        names = {"embedding": EMBEDDING_NAMES} if tied else {"embedding": EMBEDDING_NAMES, "lm_head": LM_HEAD_NAMES}
        tensors = load_target_tensors(name_or_path, names)
        torch_dtype = resolve_dtype(dtype)
        embedding = tensors["embedding"].to(torch_dtype)
        lm_head = embedding if tied else tensors["lm_head"].to(torch_dtype)
        if embedding.ndim != 2 or lm_head.ndim != 2 or embedding.shape[1] != lm_head.shape[1]:
            raise ModelFolderError(
                f"target {name_or_path!r}: embedding {tuple(embedding.shape)} and lm_head {tuple(lm_head.shape)} are "
                "not two [V, H] matrices of one width"
            )
        log.info("target %s: embedding and lm_head read from its safetensors (the model is not built)", name_or_path)
        return cls(config, embedding, lm_head)

    def to(self, device: torch.device | str) -> TargetEmbeddings:
        tied = self.lm_head_weight is self.embedding
        self.embedding = self.embedding.to(device)
        self.lm_head_weight = self.embedding if tied else self.lm_head_weight.to(device)
        return self

    @property
    def num_layers(self) -> int:
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return int(text.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def logit_scaling(self) -> LogitScaling:
        """The output scaling the target's forward applies after its lm_head, from its config (as
        :attr:`FrozenTarget.logit_scaling`)."""
        return LogitScaling.from_config(self.config)

    def tensors(self) -> list[torch.Tensor]:
        """The distinct tensors held (one when the embedding is tied)."""
        return [self.embedding] if self.lm_head_weight is self.embedding else [self.embedding, self.lm_head_weight]
