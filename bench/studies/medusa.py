"""Medusa-1 and Medusa-2 on the tiny target: tau of the heads (chain and the paper's tree, greedy and sampling) and how
far Medusa-2 moves the target (held-out loss), with and without self-distillation.

    python -m bench.studies.medusa [--medusa1-steps 400] [--medusa2-steps 200] [--new-tokens 48]

Needs the demo's artifacts (``make demo``). Trains, each skipped when its export already exists under ``--out``:
Medusa-1 (recipes/quickstart/medusa1.yaml), Medusa-2 with self-distillation (recipes/quickstart/medusa2.yaml) and
Medusa-2 with the plain next-token loss (``self_distillation: false``), all with K = 4 heads. Then ``draftsmith eval``
on the demo's held-out prompts at K = 4, chain and ``--tree`` (63 nodes), greedy and sampling at T = 1 (Medusa-2 heads
against their own trained target), prompt lookup and the demo's KD student beside them (same prompts and K), and the
held-out next-token loss of each Medusa-2 target against the original.
Writes ``OUT/medusa.md`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import ROOT, heldout_data, run, run_dirs, wait


def fit(name: str, recipe: str, steps: int, out: Path, extra: list[str]) -> float:
    """Train ``recipe`` for ``steps`` steps into ``out/runs/name``, export it to ``out/name``; the seconds it took."""
    export = out / name
    if (export / "config.json").is_file():
        return float("nan")
    runs = out / "runs" / name
    cmd = ["draftsmith", "fit", "--config", str(ROOT / "recipes" / "quickstart" / recipe),
           "--trainer.max_steps", str(steps), *run_dirs(runs), *extra]  # fmt: skip
    start = time.perf_counter()
    wait(run(cmd, out / f"fit_{name}.log"), out / f"fit_{name}.log")
    seconds = time.perf_counter() - start
    export_cmd = [
        "draftsmith",
        "export",
        "--ckpt_path",
        str(runs / "checkpoints" / "last.ckpt"),
        "--output_dir",
        str(export),
    ]
    wait(run(export_cmd, out / f"export_{name}.log"), out / f"export_{name}.log")
    return seconds


def evaluate(
    name: str, target: Path, drafter: Path | str, prompts: Path, out: Path, tree: bool, new_tokens: int
) -> dict:
    report_dir = out / "eval" / (name + ("_tree" if tree else ""))
    if not (report_dir / "report.json").is_file():
        cmd = ["draftsmith", "eval", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
               "--k", "4", "--max_new_tokens", str(new_tokens), "--temperature", "1.0", "--output_dir", str(report_dir),
               *(["--tree"] if tree else [])]  # fmt: skip
        wait(run(cmd, report_dir.with_suffix(".log")), report_dir.with_suffix(".log"))
    return json.loads((report_dir / "report.json").read_text())


def heldout_losses(artifacts: Path, models: dict[str, Path]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from trainer.training.heldout import heldout_loss

    data = heldout_data(artifacts / "corpus")
    return {
        n: heldout_loss(AutoModelForCausalLM.from_pretrained(p).eval(), data.val_dataloader())
        for n, p in models.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", default="artifacts", help="where `make demo` left the corpus and the target")
    parser.add_argument("--out", default="artifacts/medusa", help="output folder (steps already done are skipped)")
    parser.add_argument("--medusa1-steps", type=int, default=400, help="optimizer steps of Medusa-1")
    parser.add_argument("--medusa2-steps", type=int, default=200, help="optimizer steps of each Medusa-2 run")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per held-out prompt")
    args = parser.parse_args()
    artifacts, out = Path(args.artifacts), Path(args.out)
    target, prompts = artifacts / "tiny_target", artifacts / "heldout_prompts.jsonl"
    if not (target / "config.json").is_file() or not prompts.is_file():
        raise SystemExit(f"{target} or {prompts} not found: run `make demo` first")
    out.mkdir(parents=True, exist_ok=True)
    seconds = {
        "medusa1": fit("medusa1", "medusa1.yaml", args.medusa1_steps, out, []),
        "medusa2_sd": fit("medusa2_sd", "medusa2.yaml", args.medusa2_steps, out, []),
        "medusa2_lm": fit(
            "medusa2_lm", "medusa2.yaml", args.medusa2_steps, out, ["--model.init_args.self_distillation", "false"]
        ),
    }
    rows = []
    for name, label in (("medusa1", "Medusa-1"), ("medusa2_sd", "Medusa-2, self-distillation"),
                        ("medusa2_lm", "Medusa-2, next-token loss")):  # fmt: skip
        eval_target = target if name == "medusa1" else out / name / "target"
        for tree in (False, True):
            report = evaluate(name, eval_target, out / name, prompts, out, tree, args.new_tokens)
            g, s = report["greedy"][0], report["sampling"][0]
            shape = "tree (63 nodes)" if tree else "chain"
            accept = " ".join(f"{a:.2f}" for a in g["acceptance_per_position"])
            rows.append(
                f"| {label}, {shape} | {g['tau']:.2f} | {s['tau']:.2f} | {accept} | {g['measured_speedup']:.2f}x |"
            )
    for name, drafter, label in (("prompt_lookup", "prompt-lookup", "prompt lookup"),
                                 ("kd_student", artifacts / "kd_student", "the demo's KD student")):  # fmt: skip
        report = evaluate(name, target, drafter, prompts, out, False, args.new_tokens)
        g, s = report["greedy"][0], report["sampling"][0]
        accept = " ".join(f"{a:.2f}" for a in g["acceptance_per_position"])
        rows.append(f"| {label}, chain | {g['tau']:.2f} | {s['tau']:.2f} | {accept} | {g['measured_speedup']:.2f}x |")
    losses = heldout_losses(
        artifacts, {"original target": target, **{n: out / n / "target" for n in ("medusa2_sd", "medusa2_lm")}}
    )
    prompt_count = json.loads((out / "eval" / "medusa1" / "report.json").read_text())["prompts"]
    lines = [
        f"K = 4 heads, {prompt_count} held-out prompts, "
        f"{args.new_tokens} new tokens; Medusa-1 {args.medusa1_steps} steps, Medusa-2 {args.medusa2_steps} steps "
        f"(training seconds: {', '.join(f'{k} {v:.0f}' for k, v in seconds.items())})",
        "",
        "| heads | tau greedy | tau sampling (T=1) | acceptance per position (greedy) | measured speedup (greedy) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "| model | held-out loss (nats/token) |",
        "|---|---|",
        *(f"| {name} | {loss:.4f} |" for name, loss in losses.items()),
    ]
    text = "\n".join(lines)
    (out / "medusa.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
