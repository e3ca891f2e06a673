"""Load a z-lab DFlash export with the DFlash authors' ``dflash`` package itself and write its draft logits.

Runs inside the client virtualenv (dflash 0.1.0 pins transformers 5.15, which the project's venv cannot share):

    python dflash_forward.py EXPORT FEATURES OUT [--generate TARGET --max-new-tokens N]

The export is loaded the way the package loads any drafter, ``DFlashDraftModel.from_pretrained(EXPORT)``
(dflash/model.py: a Qwen3 config, ``target_layer_ids``, ``block_size`` and ``mask_token_id`` read from
``dflash_config`` first). Before running, every tensor the forward uses is checked to come from the file:
transformers initialises a parameter missing from the file and only warns, so an export that lacks one would draft
from random weights. The script fails (exit 2) when such a tensor is missing, differs from the file or is NaN.

FEATURES (safetensors):
    hidden_states.{i}  [B, S, H] for i = 0..L: HF's hidden_states of the target over the context, all of them (the
                       package picks its layers itself, ``extract_context_feature``: ``hidden_states[id + 1]``)
    block_ids          [B, b] int64: the block, the anchor then mask ids (at positions S .. S + b - 1)
    embedding          [V, H] the target's input embedding; lm_head [V, H] its output layer
    prompt             [T] int64 (with --generate): the prompt to decode

OUT (safetensors): ``logits`` [B, b - 1, V] float32, the package's draft logits of slots 1..b-1 (its forward without
a cache: the context's keys and values computed with the block's); with ``--generate``, ``output`` [T + N] (the
package's ``dflash_generate`` greedy output with the HF target at TARGET) and ``round.{r}`` [b - 1, V], the draft
logits of round r (captured from ``compute_logits``). The report (stdout's last line and OUT's metadata) names
missing / unused / differing tensors, the layer ids, block size and mask token as read, and the versions.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel, dflash_generate, extract_context_feature
from safetensors import safe_open
from safetensors.torch import save_file


def audit(model: DFlashDraftModel, export: str) -> dict:
    """Which tensors of the model did not come from the file, and which file tensors the model did not take."""
    with safe_open(f"{export}/model.safetensors", framework="pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys()}
    state = model.state_dict()  # persistent tensors only: the rotary inv_freq buffer is computed, not loaded
    missing = sorted(k for k in state if k not in file)
    unused = sorted(k for k in file if k not in state)
    differ = sorted(
        k
        for k in file
        if k in state and (state[k].shape != file[k].shape or not torch.equal(state[k].to(file[k].dtype), file[k]))
    )
    nan = sorted(k for k, v in state.items() if v.is_floating_point() and v.isnan().any())
    return {"missing": missing, "unused": unused, "differ_from_file": differ, "nan": nan}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="z-lab export folder (config.json, model.safetensors)")
    parser.add_argument("features", help="safetensors file with hidden_states.{i}, block_ids, embedding, lm_head")
    parser.add_argument("out", help="safetensors file to write the logits to")
    parser.add_argument("--generate", default=None, help="an HF target folder: also decode FEATURES' prompt")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    model = DFlashDraftModel.from_pretrained(args.export).eval()
    report = audit(model, args.export)
    report.update(
        target_layer_ids=list(model.target_layer_ids),
        block_size=model.block_size,
        mask_token_id=model.mask_token_id,
        versions={p: version(p) for p in ("dflash", "transformers", "torch")},
    )
    if report["missing"] or report["differ_from_file"] or report["nan"]:
        print(json.dumps(report))
        print(f"{args.export}: tensors not loaded from the file (see the report above)", file=sys.stderr)
        return 2
    with safe_open(args.features, framework="pt") as f:
        names = set(f.keys())
        hidden = [f.get_tensor(f"hidden_states.{i}") for i in range(sum(n.startswith("hidden_states.") for n in names))]
        block_ids, embedding, lm_head = (f.get_tensor(n) for n in ("block_ids", "embedding", "lm_head"))
        prompt = f.get_tensor("prompt") if "prompt" in names else None
    head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
    head.weight.data.copy_(lm_head)
    S, b = hidden[0].shape[1], block_ids.shape[1]
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        context = extract_context_feature(hidden, model.target_layer_ids)  # [B, S, m * H]
        noise = F.embedding(block_ids, embedding)  # [B, b, H], as dflash_generate embeds the block
        positions = torch.arange(S + b).expand(block_ids.shape[0], S + b)  # context, then the block
        drafted = model(position_ids=positions, noise_embedding=noise, target_hidden=context)  # [B, b, H]
        out["logits"] = model.compute_logits(drafted[:, 1:], head).float().contiguous()  # [B, b - 1, V]
    if args.generate:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.generate, dtype=torch.float32).eval()
        rounds: list[torch.Tensor] = []
        compute_logits = model.compute_logits

        def capture(hidden_states, output_head):
            logits = compute_logits(hidden_states, output_head)
            rounds.append(logits[0].detach().float().clone())
            return logits

        model.compute_logits = capture
        output = dflash_generate(model, target, prompt[None], args.max_new_tokens, None, temperature=0.0)
        out["output"] = output[0].contiguous()
        out.update({f"round.{r}": logits.contiguous() for r, logits in enumerate(rounds)})
        report["rounds"] = len(rounds)
    save_file(out, args.out, metadata={"report": json.dumps(report)})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
