"""Write a DFlash drafter with speculators' own trainer code, and run speculators' own forward on it.

Runs inside the client virtualenv (speculators pins its own transformers, which the project's venv cannot share):

    python speculators_dflash_forward.py make VERIFIER OUT [--layers N] [--block-size B] [--aux 1,3] [--mask ID]
        [--sliding-window W] [--full-attention-indices 0,2] [--non-causal] [--dspark RANK] [--xpress RANK]
    python speculators_dflash_forward.py forward EXPORT FEATURES OUT [--attn eager|sdpa]

``make`` builds the drafter the way ``speculators train`` does by default (speculators/train/cli.py:
``create_transformer_layer_config(verifier, N, "qwen3", None, W, full_attention_indices)``, every layer
``sliding_attention`` unless listed, then ``DFlashDraftModel.from_training_args``, which reads the verifier's config
and weights), draws non-trivial weights (norms included) with a fixed seed, and writes it with ``save_pretrained``;
``--dspark RANK`` builds ``DSparkDraftModel`` instead (a vanilla Markov head of rank RANK, the confidence head reading
it, ``sample_from_anchor`` false), its heads' weights drawn too; ``--xpress RANK`` builds ``XPressDraftModel`` (a
causal refiner of rank RANK, its weights drawn too, ``mix_l`` included).

``forward`` loads EXPORT with ``SpeculatorModel.from_pretrained`` (the embedding and lm_head from the verifier it
names), checks that every tensor the forward uses came from the file or the verifier (none NaN), and runs
``DFlashDraftModel._backbone_forward`` (speculators/models/dflash/core.py, the training forward: every anchored block
under ``create_anchor_block_mask_mod``) with the anchors of FEATURES instead of random ones.

A DSpark export (``speculators_model_type: "dspark"``) runs ``DSparkDraftModel.forward`` itself, with speculators'
``compute_metrics`` replaced by a capture of what it is given: the Markov-biased logits and the confidence logits
(``confidence`` [1, N * b] in OUT). An XPress export (``"xpress"``) runs ``XPressDraftModel.forward`` the same way:
OUT holds the teacher-forced refined logits (``logits``), the free-running rounds' (``rounds`` [passes, N * b, V], at
its default 3 rounds) and the backbone's own (``base``); the refiner's ``causal_tril``, which speculators' loader
leaves uninitialised (it is not saved), is rebuilt first (``causal_tril_as_loaded`` in the report).

``make --dflash2 RANK`` builds ``DFlash2DraftModel`` (speculators' default convolutions, a selector of rank RANK,
``sliding_window_non_causal`` its default, true), its convolutions and selector drawn too; ``forward`` of a DFlash2
export (``"dflash2"``) runs ``DFlash2DraftModel.forward`` with its ``compute_metrics`` captured: the unary logits
(``logits``), the selector's candidates (``candidates`` [1, N * b, K] int64: the unary top-k, the target's token
injected last where missing; the targets are the zero hidden state's) and their rescored logits
(``candidate_logits``).

FEATURES (safetensors): ``hidden_states`` [1, T, m * H] the aux layers' hidden states concatenated in
``aux_hidden_state_layer_ids`` order, ``input_ids`` [1, T], ``anchors`` [N] int64. OUT: ``logits`` [1, N * b, V] and
``hidden`` [1, N * b, H] (the normed block outputs, slot 0 of each block included). The report (stdout's last line)
names the attention implementation, the layer types, window and causality as speculators read them, and versions.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def make(args: argparse.Namespace) -> int:
    if args.dflash2:
        return make_dflash2(args)
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel
    from speculators.models.xpress import XPressDraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        args.verifier, args.layers, "qwen3", None, args.sliding_window, args.full_attention_indices
    )
    heads = {}
    if args.dspark:
        heads = dict(
            markov_rank=args.dspark, markov_head_type="vanilla", enable_confidence_head=True,
            confidence_head_with_markov=True, sample_from_anchor=False,
        )  # fmt: skip
    if args.xpress:
        heads = dict(xpress_rank=args.xpress)
    cls = DSparkDraftModel if args.dspark else XPressDraftModel if args.xpress else DFlashDraftModel
    model = cls.from_training_args(
        verifier_config=layer_config,
        draft_vocab_size=layer_config.vocab_size,
        block_size=args.block_size,
        verifier_name_or_path=args.verifier,
        target_layer_ids=args.aux,
        mask_token_id=args.mask,
        sliding_window_non_causal=args.non_causal,
        **heads,
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(
                ("layers.", "fc.", "hidden_norm.", "norm.", "markov_head.", "confidence_head.", "refiner_head.")
            ):
                mean = 1.0 if p.ndim == 1 else 0.0
                p.copy_(mean + 0.1 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(args.out)
    print(json.dumps({"written": args.out, "versions": {p: version(p) for p in ("speculators", "transformers")}}))
    return 0


def make_dflash2(args: argparse.Namespace) -> int:
    """``make`` of a ``DFlash2DraftModel`` (its convolutions and selector drawn too)."""
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        args.verifier, args.layers, "qwen3", None, args.sliding_window, args.full_attention_indices
    )
    model = DFlash2DraftModel.from_training_args(
        verifier_config=layer_config,
        draft_vocab_size=layer_config.vocab_size,
        block_size=args.block_size,
        verifier_name_or_path=args.verifier,
        target_layer_ids=args.aux,
        mask_token_id=args.mask,
        selector_rank=args.dflash2,
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("layers.", "fc.", "hidden_norm.", "norm.", "candidate_selector.")):
                p.copy_((1.0 if p.ndim == 1 else 0.0) + 0.1 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(args.out)
    print(json.dumps({"written": args.out, "versions": {p: version(p) for p in ("speculators", "transformers")}}))
    return 0


def forward(args: argparse.Namespace) -> int:
    import speculators.models.dflash.core as core
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(args.export)
    config.transformer_layer_config._attn_implementation = args.attn
    model = SpeculatorModel.from_pretrained(args.export, config=config).eval()
    with safe_open(f"{args.export}/model.safetensors", framework="pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys()}
    state = model.state_dict()
    used = [k for k in state if not k.startswith(("verifier_", "t2d", "d2t"))]  # verifier_*: the loss's only
    report = {
        "unused": sorted(k for k in file if k not in state),
        "differ_from_file": sorted(
            k for k in file if k in state and not torch.equal(state[k].to(file[k].dtype), file[k])
        ),
        "nan": sorted(k for k in used if state[k].is_floating_point() and state[k].isnan().any()),
        "attn_implementation": model._attn_impl,
        "sliding_window": model.sliding_window,
        "sliding_window_indices": model.sliding_window_indices,
        "sliding_window_non_causal": model.sliding_window_non_causal,
        "versions": {p: version(p) for p in ("speculators", "transformers", "torch")},
    }
    if report["unused"] or report["differ_from_file"] or report["nan"]:
        print(json.dumps(report))
        return 2
    with safe_open(args.features, framework="pt") as f:
        hidden, ids, anchors = (f.get_tensor(n) for n in ("hidden_states", "input_ids", "anchors"))
    T, N = ids.shape[1], anchors.numel()
    core.select_anchors = lambda loss_mask, n, b: (anchors.clone(), torch.ones(n, dtype=torch.bool))
    if config.speculators_model_type == "dflash2":
        return dflash2_forward(model, hidden, ids, N, args.out, report)
    if config.speculators_model_type == "dspark":
        return dspark_forward(model, hidden, ids, N, args.out, report)
    if config.speculators_model_type == "xpress":
        return xpress_forward(model, hidden, ids, N, args.out, report)
    with torch.no_grad():
        out, logits, *_ = model._backbone_forward(
            hidden.to(model.fc.weight.dtype),
            ids,
            torch.ones(1, T, dtype=torch.long),
            torch.zeros(1, T, model.hidden_size, dtype=model.fc.weight.dtype),  # the loss's targets only
            torch.zeros(1, T, dtype=torch.long),  # one document
            max_anchors=N,
        )
    save_file({"logits": logits.float().contiguous(), "hidden": out.float().contiguous()}, args.out)
    print(json.dumps(report))
    return 0


class Captured(Exception):
    """Raised by the capture that replaces DSpark's compute_metrics: the forward's outputs are taken, the loss (whose
    fused kernels need triton) is not computed."""


def dspark_forward(model, hidden: torch.Tensor, ids: torch.Tensor, N: int, out: str, report: dict) -> int:
    """``DSparkDraftModel.forward`` on the fixed anchors; its Markov-biased logits and confidence logits to OUT."""
    import speculators.models.dspark.core as dspark_core

    seen: dict[str, torch.Tensor] = {}

    def capture(logits, targets, confidence_logits, *rest, **kwargs):
        seen["logits"] = logits
        if confidence_logits is not None:
            seen["confidence"] = confidence_logits
        raise Captured

    dspark_core.compute_metrics = capture
    T = ids.shape[1]
    report["markov"] = None if model.markov_head is None else model.markov_head.head_type
    report["confidence_head"] = model.confidence_head is not None
    report["sample_from_anchor"] = model.config.sample_from_anchor
    with torch.no_grad():
        try:
            model.forward(
                hidden.to(model.fc.weight.dtype),
                ids,
                torch.ones(1, T, dtype=torch.long),
                torch.zeros(1, T, model.hidden_size, dtype=model.fc.weight.dtype),  # the loss's targets only
                torch.zeros(1, T, dtype=torch.long),  # one document
                max_anchors=N,
            )
        except Captured:
            pass
    save_file({k: v.float().contiguous() for k, v in seen.items()}, out)
    print(json.dumps(report))
    return 0


def xpress_forward(model, hidden: torch.Tensor, ids: torch.Tensor, N: int, out: str, report: dict) -> int:
    """``XPressDraftModel.forward`` on the fixed anchors; its teacher-forced, free-running and base logits to OUT."""
    import speculators.models.xpress.core as xpress_core

    seen: dict[str, torch.Tensor] = {}

    def capture(logits_tf, round_logits, base_logits, *rest, **kwargs):
        seen.update(logits=logits_tf, rounds=torch.cat(round_logits), base=base_logits)
        raise Captured

    xpress_core.compute_metrics = capture
    T = ids.shape[1]
    report["xpress_rank"] = model.refiner_head.rank
    # speculators 0.9's from_pretrained leaves the head's causal_tril (a buffer not saved) uninitialised memory, which
    # its forward multiplies into the mixer: reported, then built as its __init__ builds it
    tril = torch.tril(torch.ones_like(model.refiner_head.causal_tril))
    report["causal_tril_as_loaded"] = bool(torch.equal(model.refiner_head.causal_tril, tril))
    model.refiner_head.causal_tril.copy_(tril)
    report["sample_from_anchor"] = model.config.sample_from_anchor
    with torch.no_grad():
        try:
            model.forward(
                hidden.to(model.fc.weight.dtype),
                ids,
                torch.ones(1, T, dtype=torch.long),
                torch.zeros(1, T, model.hidden_size, dtype=model.fc.weight.dtype),  # the loss's targets only
                torch.zeros(1, T, dtype=torch.long),  # one document
                max_anchors=N,
            )
        except Captured:
            pass
    save_file({k: v.float().contiguous() for k, v in seen.items()}, out)
    print(json.dumps(report))
    return 0


def dflash2_forward(model, hidden: torch.Tensor, ids: torch.Tensor, N: int, out: str, report: dict) -> int:
    """``DFlash2DraftModel.forward`` on the fixed anchors; its unary logits, candidates and their rescored logits to
    OUT."""
    import speculators.models.dflash2.core as dflash2_core

    seen: dict[str, torch.Tensor] = {}

    def capture(*, unary_logits, training_candidate_ids, candidate_logits, **kwargs):
        seen.update(logits=unary_logits, candidates=training_candidate_ids, candidate_logits=candidate_logits)
        raise Captured

    dflash2_core.compute_metrics = capture
    T = ids.shape[1]
    c = model.config
    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "sliding_window_non_causal")
    report["dflash2"] = {k: getattr(c, k) for k in keys}
    report["sample_from_anchor"] = c.sample_from_anchor
    with torch.no_grad():
        try:
            model.forward(
                hidden.to(model.fc.weight.dtype),
                ids,
                torch.ones(1, T, dtype=torch.long),
                torch.zeros(1, T, model.hidden_size, dtype=model.fc.weight.dtype),  # the loss's targets only
                torch.zeros(1, T, dtype=torch.long),  # one document
                max_anchors=N,
            )
        except Captured:
            pass
    save_file({k: (v if k == "candidates" else v.float()).contiguous() for k, v in seen.items()}, out)
    print(json.dumps(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("verifier")
    m.add_argument("out")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--block-size", type=int, default=8)
    m.add_argument("--aux", type=ints, default=[1, 3])
    m.add_argument("--mask", type=int, required=True)
    m.add_argument("--sliding-window", type=int, default=2048)  # speculators train's default
    m.add_argument("--full-attention-indices", type=ints, default=[])
    m.add_argument("--non-causal", action="store_true")
    m.add_argument("--dspark", type=int, default=0)  # a DSparkDraftModel with a Markov head of this rank
    m.add_argument("--dflash2", type=int, default=0)  # a DFlash2DraftModel with a selector of this rank
    m.add_argument("--xpress", type=int, default=0)  # an XPressDraftModel with a refiner of this rank
    f = sub.add_parser("forward")
    f.add_argument("export")
    f.add_argument("features")
    f.add_argument("out")
    f.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    args = parser.parse_args(argv)
    return make(args) if args.command == "make" else forward(args)


if __name__ == "__main__":
    sys.exit(main())
