"""`draftsmith plan` against a measured step at real width: a recipe's objective built on CPU from a cut of a real
target config (its published shape, fewer layers, random weights), one training step (forward, backward, AdamW) on a
random batch of the recipe's shape, and the process's peak resident memory against the planner's one-process estimate
(``draftsmith plan --cpu``) for the same recipe, cut and precision.

    python -m bench.bench_planner --config recipes/eagle3_llama31_8b.yaml \\
        --target_config tests/fixtures/real_configs/llama31_8b/config.json --layers 4 --seq_len 512

Run one at a time (a 4-layer cut of an 8B model holds about 4 GB of bf16 weights). Prints one markdown row.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch


def rss_now() -> int:
    """Resident bytes of this process now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def materialize(objective: torch.nn.Module) -> None:
    """Allocates the meta-built objective's tensors on CPU, filled with a constant (every page written, so resident;
    random values are not needed to measure memory and would take minutes at real width)."""
    modules = [objective] + [m for m in getattr(objective, "_target", []) if isinstance(m, torch.nn.Module)]
    for module in modules:
        module.to_empty(device="cpu")
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                tensor.fill_(0.02 if tensor.is_floating_point() else 0)
    for held in getattr(objective, "_target", []):
        if hasattr(held, "tensors") and not isinstance(held, torch.nn.Module):
            held.to("cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--config", required=True, help="the recipe")
    p.add_argument("--target_config", required=True, help="the target's config.json (published shape)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the cut")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--precision", default=None, help="override trainer.precision")
    p.add_argument("fit_args", nargs="*", help="after --: more fit arguments")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from trainer.planner import CPU_RUNTIME_BYTES, plan_from_recipe
    from trainer.planner.build import build_objective
    from trainer.training.recipe import parse_recipe

    config = json.loads(Path(args.target_config).read_text())
    text = config.get("text_config", config)
    text["num_hidden_layers"] = args.layers
    for key in ("layer_types", "mtp_num_hidden_layers"):
        if isinstance(text.get(key), list):
            text[key] = text[key][: args.layers]
    with tempfile.TemporaryDirectory() as folder:
        cut = Path(folder) / "config.json"
        cut.write_text(json.dumps(config))
        plan = plan_from_recipe([args.config], target_config=str(cut), batch=args.batch_size, seq=args.seq_len,
                                precision=args.precision, overrides=args.fit_args)  # fmt: skip
        recipe = parse_recipe([args.config], args.fit_args)
        runtime = rss_now()
        objective = build_objective(recipe.model.class_path, recipe.model.init_args, config)
    materialize(objective)
    B, S = args.batch_size, args.seq_len
    vocab = int(text["vocab_size"])
    ids = torch.randint(0, vocab, (B, S))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "loss_mask": torch.ones(B, S, dtype=torch.long),
             "attention_mask": torch.ones(B, S, dtype=torch.long)}  # fmt: skip
    if hasattr(objective, "build_vocab_map") and not getattr(objective, "vocab_fixed", True):
        objective.build_vocab_map(torch.cat([ids, ids[:, :1]], 1).numpy(), torch.ones(B, S + 1, dtype=bool).numpy())
    precision = plan.precision
    if precision == "bf16-true":
        objective.to(torch.bfloat16)
    optimizer = torch.optim.AdamW([q for q in objective.trainable_module().parameters() if q.requires_grad], lr=1e-4)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss, _ = objective.compute_loss(batch)
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    planned = plan.estimates(1)[0].total + CPU_RUNTIME_BYTES
    gib = 1024**3
    print(
        f"| {Path(args.config).name} | {args.layers} | {B} x {S} | {precision} | {peak / gib:.2f} | "
        f"{planned / gib:.2f} | {planned / peak:.2f} | {runtime / gib:.2f} | {seconds:.0f} s |"
    )


if __name__ == "__main__":
    main()
