"""Load a speculators-format EAGLE-3 export with the speculators library itself and write its draft logits.

Runs inside the client virtualenv (speculators pins its own transformers, which the project's venv cannot share):

    python speculators_forward.py EXPORT FEATURES OUT [--steps K] [--attn IMPL] [--verifier PATH] [--allow-missing]

The export is loaded the way speculators loads any checkpoint, ``SpeculatorModel.from_pretrained(EXPORT)``
(speculators/model.py), which resolves ``Eagle3DraftModel`` (speculators/models/eagle3/core.py) from
``speculators_model_type``, reads model.safetensors through transformers, then reads the verifier named in
``speculators_config.verifier.name_or_path``: its config (layer ids checked by ``resolve_target_layer_ids``, hidden
size compared with the drafter's) and its weights (``load_verifier_weights``: embedding and lm_head only where the
drafter's are still NaN, lm_head rows ``t2d`` and final norm for the loss-only ``verifier_lm_head``/``verifier_norm``).
speculators 0.9 cannot load an EAGLE-3 drafter without that verifier (a null name fails in ``AutoConfig``);
``--verifier`` points it at a local copy when the export names a hub id.

Before running, every tensor the forward pass uses is checked to come from the file: speculators 0.9 lists
``embed_tokens.weight``, ``d2t`` and ``t2d`` in ``_keys_to_ignore_on_load_missing``, and transformers materialises a
missing parameter with ``torch.empty`` (uninitialised memory: often zeros, sometimes leftovers) after building the
model on the meta device, where the NaN that ``load_verifier_weights`` looks for is lost. An export without the
embedding thus loads without a warning and drafts from a meaningless embedding, whatever the verifier. The script
fails (exit 2) when such a tensor is missing, differs from the file or is NaN, unless ``--allow-missing``.

FEATURES (safetensors) holds, for B sequences of S elements, in speculators' training convention (after
``speculators.models.eagle3.data.shift_batch``: element t pairs the target features of token t with token t + 1):
    hidden_states    [B, S, n * Ht] the aux layers' hidden states concatenated in
                     ``eagle_aux_hidden_state_layer_ids`` order (or ``hidden_states.0`` .. ``hidden_states.{n-1}``,
                     one [B, S, Ht] per layer)
    input_ids        [B, S] int64, token t + 1 of element t (the tokens embedded at TTT step 0)
    position_ids     [B, S] int64, optional: rotary positions of step 0 (speculators' default: 1 + arange(S))

OUT (safetensors) receives ``logits.{i}`` [B, S, Vd] float32 for TTT steps i = 0 .. K-1 (captured from ``lm_head``,
over the draft vocabulary, before any ``d2t`` mapping) and ``draft_tokens.{i}`` [B, S]; its metadata and stdout carry
a JSON report (missing / unused tensors, attention implementation, versions).

``Eagle3DraftModel.forward(hidden_states, input_ids, document_ids, position_ids=..., ttt_steps=K)`` runs the whole
training-time-test unroll on one packed sequence ([1, T]): step i > 0 feeds the data tokens shifted by i (zero past
the end of the sequence), attends causally to step 0's keys and to its own position's key of every later step, and
advances the rotary positions by one per step. It returns only the argmax tokens; the logits are read off a forward
hook on ``lm_head``. Each of the B rows runs as its own sequence (packing rows would let the shifted tokens of step
i > 0 cross into the next row). The default attention, ``simple_flex_attention``, grows its block mask by whole
128-element blocks per step, so rows are padded to a multiple of 128 with ``document_ids`` -1 (masked out).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from speculators import SpeculatorModel, SpeculatorModelConfig

FLEX_BLOCK = 128  # torch's flex-attention block size, which speculators' mask extension assumes
# read only for speculators' training loss (verifier targets), never for drafting
LOSS_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="speculators-format export folder (config.json, model.safetensors)")
    parser.add_argument("features", help="safetensors file with hidden_states, input_ids[, position_ids]")
    parser.add_argument("out", help="safetensors file to write logits.{i} and draft_tokens.{i} to")
    parser.add_argument("--steps", type=int, default=None, help="TTT steps (default: the config's speculative_tokens)")
    parser.add_argument(
        "--attn",
        default=None,
        choices=["simple_flex_attention", "eager", "sdpa"],
        help="attention implementation (default: speculators' own choice, simple_flex_attention)",
    )
    parser.add_argument("--verifier", default=None, help="verifier folder to use instead of the one the export names")
    parser.add_argument("--allow-missing", action="store_true", help="run even when a used tensor is not in the file")
    return parser.parse_args(argv)


def load(args: argparse.Namespace) -> SpeculatorModel:
    """The drafter as speculators loads it (config first, to apply the overrides)."""
    config = SpeculatorModelConfig.from_pretrained(args.export)
    if args.attn is not None:
        config.transformer_layer_config._attn_implementation = args.attn
    if args.verifier is not None:
        config.speculators_config.verifier.name_or_path = args.verifier
    return SpeculatorModel.from_pretrained(args.export, config=config).eval()


def audit(model: SpeculatorModel, export: str) -> dict:
    """Which tensors of the model did not come from the file, and which file tensors the model did not take."""
    with safe_open(f"{export}/model.safetensors", framework="pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys()}
    state = model.state_dict()  # persistent tensors only: the rotary inv_freq buffers are computed, not loaded
    missing = sorted(k for k in state if k not in file and k not in LOSS_ONLY)
    unused = sorted(k for k in file if k not in state)
    differ = sorted(
        k
        for k in file
        if k in state and (state[k].shape != file[k].shape or not torch.equal(state[k].to(file[k].dtype), file[k]))
    )
    nan = sorted(k for k, v in state.items() if k not in LOSS_ONLY and v.is_floating_point() and v.isnan().any())
    return {"missing": missing, "unused": unused, "differ_from_file": differ, "nan": nan}


def read_features(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    with safe_open(path, framework="pt") as f:
        names = list(f.keys())
        if "hidden_states" in names:
            hidden = f.get_tensor("hidden_states")  # [B, S, n * Ht]
        else:
            layers = sorted((n for n in names if n.startswith("hidden_states.")), key=lambda n: int(n.split(".")[1]))
            if not layers:
                raise ValueError(f"{path}: neither hidden_states nor hidden_states.0 .. is present")
            hidden = torch.cat([f.get_tensor(n) for n in layers], dim=-1)  # [B, S, n * Ht]
        ids = f.get_tensor("input_ids")  # [B, S]
        positions = f.get_tensor("position_ids") if "position_ids" in names else None  # [B, S]
    if hidden.shape[:2] != ids.shape or (positions is not None and positions.shape != ids.shape):
        raise ValueError(f"{path}: hidden_states {tuple(hidden.shape)} and input_ids {tuple(ids.shape)} disagree")
    return hidden, ids, positions


@torch.no_grad()
def run(model: SpeculatorModel, hidden, ids, positions, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row: speculators' forward over one sequence -> logits [B, S, Vd] and draft tokens [B, S] per step."""
    B, S = ids.shape
    T = -(-S // FLEX_BLOCK) * FLEX_BLOCK if model._attn_impl == "simple_flex_attention" else S
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _module, _inputs, out: captured.append(out.detach()))
    logits: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    tokens: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    try:
        for b in range(B):
            h = torch.zeros(1, T, hidden.shape[-1], dtype=model.fc.weight.dtype)
            h[0, :S] = hidden[b].to(h.dtype)
            x = torch.zeros(1, T, dtype=torch.long)
            x[0, :S] = ids[b]
            docs = torch.full((1, T), -1, dtype=torch.long)
            docs[0, :S] = 0
            pos = None
            if positions is not None:  # padding continues the positions (it is masked out anyway)
                pos = (positions[b, 0] + torch.arange(T)).unsqueeze(0)  # [1, T]
                pos[0, :S] = positions[b]
            captured.clear()
            drafted = model(hidden_states=h, input_ids=x, document_ids=docs, position_ids=pos, ttt_steps=steps)
            if len(captured) != steps:
                raise RuntimeError(f"lm_head ran {len(captured)} times for {steps} TTT steps")
            for i in range(steps):
                logits[i].append(captured[i][0, :S].float())  # [S, Vd]
                tokens[i].append(drafted[i][0, :S])  # [S]
    finally:
        hook.remove()
    return [torch.stack(x) for x in logits], [torch.stack(x) for x in tokens]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = load(args)
    report = audit(model, args.export)
    report["attn_implementation"] = model._attn_impl
    report["dtype"] = str(model.fc.weight.dtype)
    report["versions"] = {p: version(p) for p in ("speculators", "transformers", "torch")}
    proposals = model.config.speculators_config.proposal_methods
    steps = args.steps or proposals[0].speculative_tokens
    report["steps"] = steps
    flags = (
        "norm_before_residual",
        "norm_before_fc",
        "fc_norm",
        "norm_output",
    )  # EAGLE-3.1's, as speculators read them
    report["config_flags"] = {flag: getattr(model.config, flag, None) for flag in flags}
    bad = report["missing"] or report["differ_from_file"] or report["nan"]
    if bad and not args.allow_missing:
        print(json.dumps(report))
        print(f"{args.export}: tensors not loaded from the file (see the report above)", file=sys.stderr)
        return 2
    hidden, ids, positions = read_features(args.features)
    logits, tokens = run(model, hidden, ids, positions, steps)
    out = {f"logits.{i}": x.contiguous() for i, x in enumerate(logits)}
    out.update({f"draft_tokens.{i}": x.contiguous() for i, x in enumerate(tokens)})
    save_file(out, args.out, metadata={"report": json.dumps(report)})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
