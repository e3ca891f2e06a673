"""``draftsmith export --ckpt CKPT --out DIR [--format FORMAT]``: a trained drafter in a serving engine's format."""

from __future__ import annotations

import argparse

from trainer.export.checkpoint import load_training_checkpoint, sub_state_dict
from trainer.export.hf import build_hf_causal_lm, save_hf

FORMATS = {
    "hf": "a plain HF checkpoint (distilled draft models): transformers, vLLM and SGLang load it",
    "eagle3": "native EAGLE-3 (LlamaForCausalLMEagle3): SGLang and vLLM",
    "eagle3-speculators": "EAGLE-3 in the speculators format (Eagle3Speculator): vLLM",
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith export", description=__doc__)
    parser.add_argument("--ckpt", required=True, help="a Lightning .ckpt file or a DeepSpeed checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--format", default="hf", choices=sorted(FORMATS), help="target format")
    args = parser.parse_args(argv)

    state, record = load_training_checkpoint(args.ckpt)
    if record.get("kind") == "eagle3" and args.format.startswith("eagle3"):
        from trainer.export.eagle3 import export_checkpoint

        path = export_checkpoint(state, record, args.out, args.format)
        print(f"exported {args.ckpt} as {args.format} to {path}")
        return 0
    if record.get("kind") != "hf_causal_lm" or args.format != "hf":
        raise SystemExit(
            f"draftsmith export: {args.ckpt!r} holds a drafter of kind {record.get('kind')!r}, which format "
            f"{args.format!r} cannot write"
        )
    model = build_hf_causal_lm(record, sub_state_dict(state, record["prefix"]))
    path = save_hf(model, args.out, record.get("tokenizer_from"))
    print(f"exported {args.ckpt} as {args.format} to {path}")
    return 0
