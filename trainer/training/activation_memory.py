"""What an objective's activation estimate is written with: the sizes of a decoder-only causal LM (:class:`Shape`),
one training step as ``draftsmith plan`` sizes it (:class:`PlannedStep`), and the terms every estimate adds up.

Each objective states the activation bytes of one of its training steps in
:meth:`trainer.training.objective.DraftObjective.activation_bytes`, built from the objective on the meta device (its
shapes, its TTT steps, heads, depth, exits, chunk size, draft vocabulary, target signals); the planner
(:mod:`trainer.planner`) reads it and adds weights, gradients, optimizer states and buffers.

Every estimate is the peak of two phases: the frozen target's forward under ``no_grad`` (its largest transient layer,
the hidden states and logits it returns: :func:`frozen_forward`) and the trained part's forward and backward (the
tensors autograd saves, :func:`layer_saved` per decoder layer; the chunked losses' live float32 chunks,
:func:`chunked`; what the target phase handed over). Per token and trained decoder layer the saved tensors are
``10 H + 4 I + 2 H_kv`` elements (norm inputs and outputs, q/k/v, the attention output, the MLP's gate, up, product
and input; fused attention, no S x S scores). A chunked loss keeps three float32 ``[chunk, V]`` tensors alive
(logits, softmax, gradient), a loss against a second distribution six.

Attention: the drafters' block-sparse attention (trainer/models/block_attention.py) is fused under ``flex`` (on CUDA,
and what ``auto`` picks there) and keeps no scores; its ``dense`` path (what ``auto`` picks on CPU, and the recipes'
default) keeps float32 probabilities and their copy in the activations' dtype for every query and key it scores
(:func:`dense_scores`), quadratic in the sequence length: at 8B width and 8k tokens that alone outgrows a GPU. The
frozen target's attention (:func:`target_scores`): sdpa, flash and flex kernels keep no scores, but transformers builds
a boolean ``[B, 1, S, S]`` mask for a padded or packed row; eager attention materialises its scores and float32 softmax
per head.

Element sizes: the trained part's activations are 2 bytes under ``bf16-mixed``/``16-mixed`` (autocast) and the
``*-true`` half precisions, else the trained weights' own size; the frozen target's are its weights' size (2 under
autocast).

Not counted: the optimizer step's temporaries (one parameter's worth, ``foreach`` off), on-policy generation's KV
cache, tokenizer and data-loader memory, the Python runtime and allocator slack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from trainer.interface.errors import ModelFolderError

F32 = 4
HALF_TRUE = ("bf16-true", "16-true")
MIXED = ("bf16-mixed", "16-mixed", "16", "bf16")


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only (Llama-like) causal LM that memory depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config") -> Shape:
        """From an HF config (a dict, e.g. ``AutoConfig(...).to_dict()``); ``source`` names it in errors."""
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if config.get(k) is None
        ]
        if missing:
            raise ModelFolderError(f"draftsmith plan: {source} has no {', '.join(missing)} (a decoder-only LM config?)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        kv = config.get("num_key_value_heads")
        head_dim = config.get("head_dim")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(kv) if kv is not None else heads,
            head_dim=int(head_dim) if head_dim is not None else hidden // heads,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )

    @classmethod
    def of(cls, config: Any) -> Shape:
        """From an HF config object (its text config, for a multimodal one) or a dict."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls.from_config(text.to_dict() if hasattr(text, "to_dict") else dict(text), "the target config")

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    def layer_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        if self.attention_bias:
            attn += self.q_width + 2 * self.kv_width + h
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attn + mlp + 2 * h  # two RMSNorm weights

    def parameters(self) -> int:
        """Exact parameter count of the HF Llama implementation with this shape."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_hidden_layers * self.layer_parameters() + self.hidden_size + head


def element_bytes(module: nn.Module, precision: str) -> int:
    """Activation bytes per element of a module's forward under ``precision``."""
    if precision in MIXED or precision in HALF_TRUE:
        return 2
    return next(iter(module.parameters())).element_size()


@dataclass(frozen=True)
class PlannedStep:
    """One training step of an objective, as ``draftsmith plan`` sizes it.

    Attributes:
        batch: sequences per step and process.
        seq: tokens per sequence.
        element: activation bytes per element of the trained part (:func:`element_bytes` of its trainable module).
        target_element: activation bytes per element of the frozen target's forward (2 under autocast, else its
            weights' size; the trained part's without a target).
        chunk: positions per chunk of the loss (the recipe's ``loss_chunk_size``, else the objective's, else 256).
        shards: the target's signals come from shards (``target_signals: shards``): its forward never runs.
        device: where the step runs, ``cuda`` (a drafter's ``auto`` attention is flex there) or ``cpu`` (dense).
        target_scores: bytes of the frozen target's attention scores and mask alive in one layer's forward
            (:func:`target_scores` of its attention implementation; 0 without a target forward).
        sequence_parallel: ranks P sharing each row under DeepSpeed-Ulysses (trainer/distributed/sequence_parallel.py):
            each holds ``seq / P`` positions (:attr:`tokens`) and attends over the whole row with ``1 / P`` of the
            heads; the target's ``ulysses_sdpa`` builds the whole row's boolean ``[B, 1, S, S]`` mask for a packed row's
            documents (an upper bound, as for sdpa: a row of one document gets none). 1: none.
    """

    batch: int
    seq: int
    element: int
    target_element: int
    chunk: int
    shards: bool
    device: str = "cuda"
    target_scores: int = 0
    sequence_parallel: int = 1

    def fused(self, impl: str) -> bool:
        """Whether a drafter attention ``impl`` (``auto``, ``flex`` or ``dense``, trainer/models/block_attention.py)
        runs fused on this step's device: flex on CUDA (``flex``, or ``auto`` there); on CPU flex cannot train, every
        implementation is dense."""
        return self.device == "cuda" and impl in ("flex", "auto")

    @property
    def tokens(self) -> int:
        """Tokens per step and process: ``batch * seq``, of which each of the ``sequence_parallel`` ranks of a row
        holds ``1 / sequence_parallel``."""
        return self.batch * (self.seq // self.sequence_parallel)

    @classmethod
    def of(
        cls,
        objective: Any,
        batch: int,
        seq: int,
        precision: str,
        chunk_size: int | None,
        device: str = "cuda",
        sequence_parallel: int = 1,
    ) -> PlannedStep:
        """The step of ``objective`` (a DraftObjective, built on the meta device) on ``batch`` x ``seq`` tokens.

        Args:
            objective: the built objective.
            batch: sequences per step and process.
            seq: tokens per sequence.
            precision: Lightning's trainer.precision.
            chunk_size: the recipe's ``loss_chunk_size`` (None: the objective's own, else 256).
            device: ``cuda`` or ``cpu``, where the step runs (which attention ``auto`` picks).
            sequence_parallel: ranks sharing each row under DeepSpeed-Ulysses (1: none).
        """
        a = element_bytes(objective.trainable_module(), precision)
        target_model = getattr(objective.target, "model", None)
        if precision in MIXED:
            a_t = 2
        else:
            a_t = element_bytes(target_model, precision) if target_model is not None else a
        return cls(
            batch=batch,
            seq=seq,
            element=a,
            target_element=a_t,
            chunk=chunk_size or getattr(objective, "loss_chunk_size", 256),
            shards=objective.target_signals == "shards",
            device=device,
            target_scores=0
            if target_model is None
            else batch * seq * seq  # ulysses_sdpa: the whole row's boolean document mask (a packed row)
            if sequence_parallel > 1
            else target_scores(target_model.config, batch, seq, a_t),
            sequence_parallel=sequence_parallel,
        )


def layer_saved(shape: Shape, tokens: int, a: int, extra_hidden: int = 0) -> int:
    """What autograd saves for one trained decoder layer of ``shape`` over ``tokens`` tokens (``extra_hidden``: more
    H-wide inputs, as EAGLE-3's 2H attention input)."""
    h = shape.hidden_size
    return tokens * ((10 + extra_hidden) * h + 4 * shape.intermediate_size + 2 * shape.kv_width) * a


def frozen_forward(shape: Shape, tokens: int, a: int, hidden_kept: int = 1, vocab_out: int = 0, scores: int = 0) -> int:
    """The frozen target's forward under no_grad: its largest transient layer (``scores``: its attention's scores and
    mask, :attr:`PlannedStep.target_scores`), the hidden states it returns (``hidden_kept`` of them) and ``vocab_out``
    rows of logits per token."""
    h, i = shape.hidden_size, shape.intermediate_size
    return tokens * (3 * h + 3 * i) * a + scores + tokens * (hidden_kept * h + vocab_out) * a


def target_scores(config: Any, batch: int, seq: int, a: int) -> int:
    """The frozen target's attention memory in one layer's forward on ``batch`` x ``seq`` tokens, by its attention
    implementation (``config._attn_implementation``): eager keeps every head's scores and their float32 softmax beside
    its additive ``[B, 1, S, S]`` mask; sdpa, flash and flex keep no scores, only the boolean ``[B, 1, S, S]`` mask
    transformers builds for a padded or packed row (an upper bound: an unpadded row gets none)."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    square = batch * seq * seq  # [B, 1, S, S]
    if implementation == "eager":
        return square * a + square * text.num_attention_heads * (a + F32)
    return square


def dense_scores(batch: int, heads: int, queries: int, keys: int, a: int, live: bool = False) -> int:
    """A dense (unfused) attention layer's scores over ``queries`` x ``keys`` per head: the float32 probabilities and
    their copy in the activations' dtype ``a``, saved for backward; ``live`` adds what its backward holds in flight
    while it runs (the gradients of the copy, of the float32 probabilities and of the scores: ``a + 2 x 4`` bytes a
    score)."""
    per_score = (a + F32) + ((a + 2 * F32) if live else 0)
    return batch * heads * queries * keys * per_score


def chunked(chunk: int, tokens: int, vocab: int, copies: int = 3) -> int:
    """A chunked loss over ``vocab``: ``copies`` float32 [chunk, V] tensors alive."""
    return copies * min(chunk, tokens) * vocab * F32


def causal_lm_layers(model: nn.Module) -> tuple[Shape, int]:
    """The shape and decoder-layer count of an HF causal LM (``model.config``)."""
    return Shape.of(model.config), model.config.num_hidden_layers
