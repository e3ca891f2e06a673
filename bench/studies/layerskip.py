"""LayerSkip on the tiny target: tau of every early exit with and without LayerSkip training, what the training costs
the full model (held-out loss), and our self-speculative decoding against transformers' ``assistant_early_exit``.

    python -m bench.studies.layerskip [--steps 400] [--k 4] [--baseline DIR]

Needs the demo's artifacts (``make demo``: the corpus, the tiny target trained for 400 steps, the held-out prompts).
Trains recipes/quickstart/layerskip_pretrain.yaml for ``--steps`` steps (skipped when its model exists under
``--out``) and compares it with ``--baseline``, the same shape trained without LayerSkip for as many steps (default
the demo's target, 400 steps; for other step counts, ``draftsmith fit --config recipes/quickstart/tiny_target.yaml
--trainer.max_steps N`` with its own ``export_dir``), then:

1. ``draftsmith eval --exit_layer 1,2,3`` of both models (K = ``--k``, greedy and sampling at T = 1; the ordinary
   target through ``--drafter early-exit``);
2. the held-out next-token loss of both full models, and of every exit of both (the model's own norm and head);
3. decoding speed on the held-out prompts, runs alternated prompt by prompt: the model alone, our early-exit drafting
   (the drafts' cache entries of layers [0, E) reused by the verification) and transformers' ``generate(...,
   assistant_early_exit=E)`` with ``K`` assistant tokens (a separate cache, every layer re-run), greedy; every output
   is checked against the model alone; E is the exit with the best measured greedy speedup in step 1.

Writes ``OUT/layerskip.md`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import ROOT, heldout_data, run, run_dirs, wait


def train(out: Path, artifacts: Path, steps: int) -> Path:
    model = out / "model"
    if (model / "layerskip.json").is_file():
        return model
    runs = out / "run"
    cmd = ["draftsmith", "fit", "--config", str(ROOT / "recipes" / "quickstart" / "layerskip_pretrain.yaml"),
           "--trainer.max_steps", str(steps), *run_dirs(runs), "--model.init_args.export_dir", str(model),
           "--model.init_args.tokenizer", str(artifacts / "corpus" / "tokenizer")]  # fmt: skip
    wait(run(cmd, out / "fit.log"), out / "fit.log")
    return model


def sweep(name: str, target: Path, drafter: str, prompts: Path, out: Path, k: int, layers: str) -> dict[int, dict]:
    folder = out / "eval" / name
    if not (folder / f"exit_{layers.split(',')[-1]}" / "report.json").is_file():
        cmd = ["draftsmith", "eval", "--target", str(target), "--drafter", drafter, "--exit_layer", layers,
               "--prompts", str(prompts), "--k", str(k), "--temperature", "1.0",
               "--output_dir", str(folder)]  # fmt: skip
        wait(run(cmd, out / f"eval_{name}.log"), out / f"eval_{name}.log")
    return {int(e): json.loads((folder / f"exit_{e}" / "report.json").read_text()) for e in layers.split(",")}


def exit_losses(model_dir: Path, artifacts: Path) -> list[float]:
    """Held-out loss of every exit (after layer 1..L) through the model's own final norm and head."""
    from transformers import AutoModelForCausalLM

    data = heldout_data(artifacts / "corpus")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    L = model.config.num_hidden_layers
    totals, count = [0.0] * L, 0
    with torch.no_grad():
        for i, batch in enumerate(data.val_dataloader()):
            if i >= 20:
                break
            out = model(batch["input_ids"], output_hidden_states=True)
            labels = batch["labels"].flatten()
            for e in range(1, L + 1):
                hidden = out.hidden_states[e] if e == L else model.model.norm(out.hidden_states[e])
                logits = model.lm_head(hidden).float().flatten(0, 1)
                totals[e - 1] += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            count += int((labels != -100).sum())
    return [t / count for t in totals]


def speed(model_dir: Path, prompts: list[list[int]], exit_layer: int, k: int, new_tokens: int, repeats: int) -> dict:
    """Tokens/s of the model alone, our early-exit drafting and HF's assistant_early_exit (alternated)."""
    from transformers import AutoModelForCausalLM

    from trainer.decoding.generate import speculative_generate
    from trainer.decoding.proposers import NoProposer
    from trainer.methods.layerskip.proposer import EarlyExitProposer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.generation_config.num_assistant_tokens = k
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0  # never stop drafting early
    model.generation_config.eos_token_id = None  # every run generates new_tokens tokens

    def alone(ids):
        return speculative_generate(model, ids, NoProposer(), 1, new_tokens).tokens

    def ours(ids):
        return speculative_generate(model, ids, EarlyExitProposer(exit_layer), k, new_tokens).tokens

    def hf(ids):
        settings = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
        return model.generate(ids[None], assistant_early_exit=exit_layer, **settings)[0, ids.numel() :].tolist()

    runs = {"model alone": alone, "ours (early exit, cache reused)": ours, "transformers assistant_early_exit": hf}
    seconds, tokens = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0)
    ratios = []
    with torch.no_grad():
        for repeat in range(repeats + 1):  # pass 0 warms up
            for i, prompt in enumerate(prompts):
                ids = torch.tensor(prompt)
                order = list(runs) if (repeat + i) % 2 == 0 else list(reversed(runs))
                outputs, elapsed = {}, {}
                for name in order:
                    start = time.perf_counter()
                    outputs[name] = runs[name](ids)
                    elapsed[name] = time.perf_counter() - start
                reference = outputs["model alone"]
                for name, tokens_ in outputs.items():
                    if tokens_[: len(reference)] != reference[: len(tokens_)]:
                        raise SystemExit(f"prompt {i}: {name} decoded other tokens than the model alone")
                if repeat:
                    for name in runs:
                        seconds[name] += elapsed[name]
                        tokens[name] += len(outputs[name])
                    ratios.append(
                        elapsed["transformers assistant_early_exit"] / elapsed["ours (early exit, cache reused)"]
                    )
    return {"rates": {n: tokens[n] / seconds[n] for n in runs}, "ratio_median": statistics.median(ratios)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", default="artifacts", help="where `make demo` left its outputs")
    parser.add_argument("--out", default="artifacts/layerskip", help="output folder (steps already done are skipped)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (the demo's target: 400)")
    parser.add_argument("--k", type=int, default=4, help="drafts per round")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt in the speed runs")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts in the speed runs")
    parser.add_argument(
        "--baseline", default=None, help="the model trained without LayerSkip for --steps steps (default: the demo's)"
    )
    args = parser.parse_args()
    artifacts, out = Path(args.artifacts), Path(args.out)
    plain = Path(args.baseline) if args.baseline else artifacts / "tiny_target"
    prompts = artifacts / "heldout_prompts.jsonl"
    if not (plain / "config.json").is_file() or not prompts.is_file():
        raise SystemExit(f"{plain} or {prompts} not found: run `make demo` first")
    out.mkdir(parents=True, exist_ok=True)
    layerskip = train(out, artifacts, args.steps)
    L = json.loads((plain / "config.json").read_text())["num_hidden_layers"]
    layers = ",".join(str(e) for e in range(1, L))
    reports = {
        "LayerSkip-trained": sweep("layerskip", layerskip, str(layerskip), prompts, out, args.k, layers),
        "ordinary": sweep("ordinary", plain, "early-exit", prompts, out, args.k, layers),
    }
    lines = [f"K = {args.k}, {args.steps} training steps each, the demo's held-out prompts", ""]
    lines += [
        "| model | exit E | tau greedy | tau sampling (T=1) | acceptance per position (greedy) |",
        "|---|---|---|---|---|",
    ]
    for name, by_exit in reports.items():
        for e, report in by_exit.items():
            g, s = report["greedy"][0], report["sampling"][0]
            accept = " ".join(f"{a:.2f}" for a in g["acceptance_per_position"])
            lines.append(f"| {name} | {e} | {g['tau']:.2f} | {s['tau']:.2f} | {accept} |")
    losses = {"LayerSkip-trained": exit_losses(layerskip, artifacts), "ordinary": exit_losses(plain, artifacts)}
    lines += ["", "| model | held-out loss after layer 1..L (nats/token; L is the full model) |", "|---|---|"]
    lines += [f"| {name} | {' / '.join(f'{v:.3f}' for v in values)} |" for name, values in losses.items()]
    best = max(reports["LayerSkip-trained"].items(), key=lambda item: item[1]["greedy"][0]["measured_speedup"])[0]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(layerskip)
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    timing = speed(layerskip, [tokenizer(t).input_ids for t in texts], best, args.k, args.new_tokens, args.repeats)
    lines += ["", f"Decoding speed of the LayerSkip-trained model, E = {best}, K = {args.k}, greedy, "
              f"{len(texts)} prompts x {args.repeats} passes, alternated:", ""]  # fmt: skip
    lines += ["| decoding | tokens/s |", "|---|---|"]
    lines += [f"| {name} | {rate:.1f} |" for name, rate in timing["rates"].items()]
    lines.append(
        f"ours / transformers' assistant_early_exit: median per-prompt speed ratio {timing['ratio_median']:.2f}"
    )
    text = "\n".join(lines)
    (out / "layerskip.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
