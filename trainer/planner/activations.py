"""Activation bytes of one training step of each objective, read from the objective the planner built on the meta
device (its shapes, its TTT steps, heads, depth, exits, chunk size, draft vocabulary, target signals).

Every estimate is the peak of two phases: the frozen target's forward under ``no_grad`` (its largest transient layer,
the hidden states and logits it returns) and the trained part's forward and backward (the tensors autograd saves, the
chunked losses' live float32 chunks, what the target phase handed over). Per token and trained decoder layer the saved
tensors are ``10 H + 4 I + 2 H_kv`` elements (norm inputs and outputs, q/k/v, the attention output, the MLP's gate, up,
product and input; fused attention, no S x S scores). A chunked loss keeps three float32 ``[chunk, V]`` tensors alive
(logits, softmax, gradient), a loss against a second distribution six.

Element sizes: the trained part's activations are 2 bytes under ``bf16-mixed``/``16-mixed`` (autocast) and the
``*-true`` half precisions, else the trained weights' own size; the frozen target's are its weights' size (2 under
autocast).

Not counted: the optimizer step's temporaries (one parameter's worth, ``foreach`` off), on-policy generation's KV
cache, tokenizer and data-loader memory, the Python runtime (``--cpu`` adds a measured allowance) and allocator slack.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainer.planner.shapes import HALF_TRUE, MIXED, Shape

F32 = 4


def _shape(config: Any) -> Shape:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return Shape.from_config(text.to_dict() if hasattr(text, "to_dict") else dict(text), "the target config")


def _element(module: nn.Module, precision: str) -> int:
    """Activation bytes of a module's forward under ``precision``."""
    if precision in MIXED or precision in HALF_TRUE:
        return 2
    return next(iter(module.parameters())).element_size()


def layer_saved(shape: Shape, tokens: int, a: int, extra_hidden: int = 0) -> int:
    """What autograd saves for one trained decoder layer of ``shape`` over ``tokens`` tokens (``extra_hidden``: more
    H-wide inputs, as EAGLE-3's 2H attention input)."""
    h = shape.hidden_size
    return tokens * ((10 + extra_hidden) * h + 4 * shape.intermediate_size + 2 * shape.kv_width) * a


def frozen_forward(shape: Shape, tokens: int, a: int, hidden_kept: int = 1, vocab_out: int = 0) -> int:
    """The frozen target's forward under no_grad: its largest transient layer, the hidden states it returns
    (``hidden_kept`` of them) and ``vocab_out`` rows of logits per token."""
    h, i = shape.hidden_size, shape.intermediate_size
    return tokens * (3 * h + 3 * i) * a + tokens * (hidden_kept * h + vocab_out) * a


def chunked(chunk: int, tokens: int, vocab: int, copies: int = 3) -> int:
    """A chunked loss over ``vocab``: ``copies`` float32 [chunk, V] tensors alive."""
    return copies * min(chunk, tokens) * vocab * F32


def _trained_hf(module: nn.Module) -> tuple[Shape, int]:
    return _shape(module.config), module.config.num_hidden_layers


def activation_bytes(objective: nn.Module, batch: int, seq: int, precision: str, chunk_size: int | None) -> int:
    """Activation bytes of one step of ``objective`` (built by :func:`trainer.planner.build.build_objective`).

    Args:
        objective: the built objective.
        batch: sequences per step and process.
        seq: tokens per sequence.
        precision: Lightning's trainer.precision.
        chunk_size: the recipe's ``loss_chunk_size`` (None: the objective has none).
    """
    name = type(objective).__name__
    n = batch * seq
    trained = objective.trainable_module()
    a = _element(trained, precision)
    target = getattr(objective, "target", None)
    target_model = getattr(target, "model", None)
    a_t = 2 if precision in MIXED else (_element(target_model, precision) if target_model is not None else a)
    chunk = chunk_size or getattr(objective, "loss_chunk_size", 256)
    shards = getattr(objective, "target_signals", "online") == "shards"
    if name in ("KnowledgeDistillation", "OnPolicyDistillation"):
        shape, layers = _trained_hf(trained)
        t = _shape(objective.target_config)
        student = layers * layer_saved(shape, n, a) + 2 * n * shape.hidden_size * a
        teacher = 0 if shards else frozen_forward(t, n, a_t)
        return student + teacher + chunked(chunk, n, t.vocab_size, copies=6)
    if name in ("Eagle3", "PEagle"):
        return _eagle(objective, name, batch, seq, a, a_t, shards)
    if name == "DFlash":
        return _dflash(objective, batch, seq, a, a_t, chunk, shards)
    if name == "Medusa":
        t = _shape(objective.target_config)
        config = objective.drafter.heads.config
        heads = (
            config.num_heads * config.num_layers * 3 * n * t.hidden_size * a + config.num_heads * n * t.hidden_size * a
        )
        if objective.stage == "heads":
            target_phase = 0 if shards else frozen_forward(t, n, a_t)
            return max(target_phase, n * t.hidden_size * a_t + heads + chunked(chunk, n, t.vocab_size))
        backbone = t.num_hidden_layers * layer_saved(t, n, a) + frozen_forward(t, n, a_t)
        return backbone + heads + chunked(chunk, n, t.vocab_size, copies=6)
    if name == "LayerSkip":
        t, layers = _trained_hf(objective.model)
        kl = frozen_forward(t, n, a_t) if getattr(objective, "target_kl_weight", 0) else 0
        return layers * layer_saved(t, n, a) + kl + chunked(chunk, n, t.vocab_size, copies=6 if kl else 3)
    if name == "SequentialMTP":
        trunk = objective.drafter.trunk  # trained with the modules (pretrain), else the frozen target runs
        t, layers = _trained_hf(trunk) if trunk is not None else (_shape(objective.target_config), 0)
        depth = objective.depth
        modules = depth * (layer_saved(t, n, a, extra_hidden=4))  # fc's 2H input, the two input norms
        trunk_phase = frozen_forward(t, n, a_t, hidden_kept=2)
        if trunk is not None and any(p.requires_grad for p in trunk.parameters()):
            trunk_phase = layers * layer_saved(t, n, a)
        return trunk_phase + modules + chunked(chunk, n, t.vocab_size)
    if name == "ParallelMTPHeads":
        model = objective.mtp.model
        t, layers = _trained_hf(model)
        heads = objective.mtp.num_heads if hasattr(objective.mtp, "num_heads") else 1
        trunk = layers * layer_saved(t, n, a) if objective.train_mode == "all" else frozen_forward(t, n, a_t)
        kl = frozen_forward(t, n, a_t) if getattr(objective, "target_kl_weight", 0) else 0
        return trunk + layer_saved(t, n, a) + heads * n * t.hidden_size * a + kl + chunked(chunk, n, t.vocab_size)
    if name == "CausalLMPretraining":
        t, layers = _trained_hf(trained)
        return layers * layer_saved(t, n, a) + chunked(chunk, n, t.vocab_size)
    raise NotImplementedError(f"draftsmith plan: no activation estimate for {name}")


def _eagle(objective: nn.Module, name: str, batch: int, seq: int, a: int, a_t: int, shards: bool) -> int:
    """EAGLE-3 (training-time test over ``ttt_steps``, the first K - 1 steps recomputed in backward by default) and
    P-EAGLE (all depths in one parallel forward over the COD-sampled elements)."""
    drafter = objective.drafter
    config = drafter.config
    t = _shape(objective.target_config)
    n = batch * seq
    vd = config.draft_vocab_size
    d = Shape(vd, config.hidden_size, config.intermediate_size, 1, config.num_attention_heads,
              config.num_key_value_heads, config.head_dim)  # fmt: skip
    layers_kept = len(config.aux_layers)
    soft = getattr(objective, "labels", "soft") == "soft"
    if shards:
        target_phase = layers_kept * n * t.hidden_size * 2  # the batch's teacher hidden states (bf16 shards)
    else:
        # every hidden state HF returns with output_hidden_states; soft labels project onto the draft vocabulary's
        # lm_head rows only ([B, S, Vd] logits and their float32 softmax), argmax labels onto every token ([B, S, V])
        vocab_out = 0 if soft else t.vocab_size
        target_phase = frozen_forward(t, n, a_t, hidden_kept=t.num_hidden_layers + 1, vocab_out=vocab_out)
        if soft:
            target_phase += n * vd * (a_t + F32) + vd * t.hidden_size * a_t  # + the draft rows of lm_head
    labels = n * vd * F32 if soft else 0
    handed = n * config.hidden_size * a + labels  # the fused features, the soft labels
    # one step: the layer (2H attention input), its [B, S, Vd] logits, their float32 log-softmax and the product
    step = layer_saved(d, n, a, extra_hidden=2) + n * vd * (a + 2 * F32)
    if name == "PEagle":
        elements = batch * objective.elements_per_row(seq)  # the COD-sampled elements of every depth
        deeper = (drafter.num_decoder_layers - 1) * layer_saved(d, int(elements), a)  # plain layers after the first
        step = layer_saved(d, int(elements), a, extra_hidden=2) + deeper + int(elements) * vd * (a + 3 * F32)
        return max(target_phase, handed + n * layers_kept * t.hidden_size * a_t + step)
    steps = min(objective.ttt_steps, seq - 1)
    if objective.recompute:
        kept = (steps - 1) * n * (config.hidden_size + 2 * d.kv_width) * a  # each recomputed step's outputs
        drafter_phase = handed + kept + step + step  # the last step, and one step recomputed in backward
    else:
        drafter_phase = handed + steps * step
    return max(target_phase, drafter_phase)


def _dflash(objective: nn.Module, batch: int, seq: int, a: int, a_t: int, chunk: int, shards: bool) -> int:
    """DFlash: draft layers over the sampled blocks' slots, attending to the target's fused context; the slots'
    logits through the target's lm_head in chunks whose gradients are taken in forward (a float32 [slots, H]
    gradient kept for backward)."""
    config = objective.drafter.config
    t = _shape(objective.target_config)
    n = batch * seq
    m = len(config.target_layers)
    slots = batch * min(objective.max_anchors, seq) * config.block_size
    d = Shape(t.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
              config.num_attention_heads, config.num_key_value_heads, config.head_dim)  # fmt: skip
    if shards:
        target_phase = m * n * t.hidden_size * 2
    else:
        target_phase = frozen_forward(t, n, a_t, hidden_kept=t.num_hidden_layers + 1)
    context = n * (m * t.hidden_size + t.hidden_size) * a_t + n * (m + 1) * t.hidden_size * a  # kept, fused
    layers = config.num_hidden_layers * (layer_saved(d, slots, a) + n * 2 * d.kv_width * a)
    grad = slots * d.hidden_size * F32  # slot_loss.py's gradient of the slots' outputs
    return max(target_phase, context + layers + grad + chunked(chunk, slots, t.vocab_size))
