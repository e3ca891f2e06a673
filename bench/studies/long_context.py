"""Acceptance by context length for drafters trained on short rows, with and without the long-context options.

    python -m bench.studies.long_context [--methods eagle3.1,dflash] [--variants base,window] [--steps 128]
        [--lengths 256,1024,2048] [--prompts 12] [--out artifacts/studies/long_context]

Needs the demo's corpus and target (``make demo``). Every (method, variant) trains the method's quickstart recipe on
the corpus' training text for ``--steps`` optimizer steps at the recipe's rows (256 tokens), one run at a time on the
machine's threads, and is measured by ``draftsmith eval --context_lengths`` on the held-out documents: greedy, K = 4,
64 new tokens, every output checked against the target's own. Every length reads the same documents: the first
``--prompts`` held-out documents long enough for the longest length (written to OUT/documents.jsonl), so a change of
tau with the length is not a change of documents. A variant adds recipe arguments (:data:`VARIANTS`); ``base`` adds
none. Writes OUT/long_context.md (tau per length and tau at the longest length over tau at the shortest, "kept") and
OUT/long_context.json, keeping the rows of earlier runs into the same OUT; a rerun skips the fits and evaluations
whose outputs exist.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import ROOT, fit_cmd, run, wait

METHODS: dict[str, tuple[str, list[str]]] = {
    "kd": ("recipes/quickstart/kd.yaml", ["--model.init_args.export_dir", "null"]),
    "eagle3.1": (
        "recipes/quickstart/eagle3.yaml",
        ["--model.init_args.fc_norm=true", "--model.init_args.norm_output=true"],
    ),
    "eagle3": ("recipes/quickstart/eagle3.yaml", []),
    "peagle": ("recipes/quickstart/peagle.yaml", []),
    "dflash": ("recipes/quickstart/dflash.yaml", []),
}

VARIANTS: dict[str, list[str]] = {
    "base": [],
    # sliding-window draft attention as long as the training rows: the drafter never attends further than it trained
    "window": ["--model.init_args.window", "256"],
    # packed rows that keep their documents apart
    "documents": ["--data.init_args.document_masking", "true"],
    # half the steps serve rows of 1024 tokens instead of four times as many of 256 (the same tokens), documents apart
    "mixed": [
        "--data.init_args.document_masking",
        "true",
        "--data.init_args.long_seq_len",
        "1024",
        "--data.init_args.long_fraction",
        "0.5",
    ],
    # the same with rows of 2048: batches of 8 x 256 tokens (twice the EAGLE-3, P-EAGLE and DFlash recipes', so run
    # those for half the steps; the KD recipe's own batch)
    "mixed2048": [
        "--data.init_args.document_masking",
        "true",
        "--data.init_args.batch_size",
        "8",
        "--data.init_args.long_seq_len",
        "2048",
        "--data.init_args.long_fraction",
        "0.5",
    ],
    "mixed-window": [
        "--data.init_args.document_masking",
        "true",
        "--data.init_args.long_seq_len",
        "1024",
        "--data.init_args.long_fraction",
        "0.5",
        "--model.init_args.window",
        "256",
    ],
}


def long_documents(source: Path, min_tokens: int, count: int, out: Path) -> Path:
    """Writes the first ``count`` documents of ``source`` with at least ``min_tokens`` tokens (the demo tokenizer's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "artifacts/tiny_target")
    kept = []
    for line in source.read_text().splitlines():
        if line.strip() and len(tokenizer(json.loads(line)["text"])["input_ids"]) >= min_tokens:
            kept.append(line)
        if len(kept) == count:
            break
    if len(kept) < count:
        raise SystemExit(f"{source}: only {len(kept)} documents have {min_tokens} tokens, {count} asked for")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(kept) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="eagle3.1,dflash")
    parser.add_argument("--variants", default="base,window")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the fits' seed; runs of seed S > 0 are named -sS")
    parser.add_argument("--out", default=str(ROOT / "artifacts/studies/long_context"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    corpus = ROOT / "artifacts/corpus"
    lengths = [int(x) for x in args.lengths.split(",")]
    documents = long_documents(corpus / "heldout.jsonl", max(lengths) + 72, args.prompts, out / "documents.jsonl")
    results = {}
    for method in args.methods.split(","):
        recipe, method_args = METHODS[method]
        for variant in args.variants.split(","):
            name = f"{method}-{variant}" + (f"-s{args.seed}" if args.seed else "")
            run_dir = out / name
            ckpt = run_dir / "checkpoints" / "last.ckpt"
            if not ckpt.is_file():
                extra = [*method_args, *VARIANTS[variant]]
                if args.seed:
                    extra += [f"--seed_everything={args.seed}", f"--model.init_args.seed={args.seed}"]
                    extra += [f"--data.init_args.seed={args.seed}"]
                log = run_dir / "fit.log"
                wait(
                    run(fit_cmd(recipe, run_dir, corpus / "train.jsonl", 0, args.steps, extra), log, args.threads), log
                )
            report = run_dir / "eval" / "report.json"
            if not report.is_file():
                log = run_dir / "eval.log"
                cmd = [
                    "draftsmith", "eval", "--target", str(ROOT / "artifacts/tiny_target"), "--drafter", str(ckpt),
                    "--prompts", str(documents), "--context_lengths", args.lengths,
                    "--max_new_tokens", "64", "--max_prompts", str(args.prompts), "--k", "4", "--temperature", "0",
                    "--output_dir", str(run_dir / "eval"),
                ]  # fmt: skip
                wait(run(cmd, log, args.threads), log)
            by_context = json.loads(report.read_text())["by_context"]
            results[name] = {"steps": args.steps} | {
                str(entry["context_length"]): {
                    "tau": entry["greedy"][0]["tau"],
                    "prompts": entry["prompts"],
                    "target_loss": entry["target_loss"],
                    "tau_outside_loops": entry["greedy"][0]["tau_outside_loops"],
                    "loop_share": entry["loops"]["share"],
                    "identical": entry["greedy"][0]["identical"],
                }
                for entry in by_context
            }
    summary = out / "long_context.json"
    results = {**(json.loads(summary.read_text()) if summary.is_file() else {}), **results}  # earlier runs' rows stay
    rows = [
        f"{len(results)} drafters, trained by their quickstart recipes on the corpus' training text for the steps "
        f"given; greedy tau at K = 4 on up to {args.prompts} held-out prompts per context length, 64 new tokens "
        "(in brackets: tau outside the target's loops).",
        "",
        "| drafter | steps | " + " | ".join(f"tau at {n}" for n in lengths) + f" | kept at {lengths[-1]} |",
        "|---|---|" + "---|" * (len(lengths) + 1),
    ]
    for name, by_length in results.items():
        taus = [by_length[str(n)]["tau"] for n in lengths]
        cells = [f"{by_length[str(n)]['tau']:.3f} ({by_length[str(n)]['tau_outside_loops']:.3f})" for n in lengths]
        rows.append(f"| {name} | {by_length['steps']} | " + " | ".join(cells) + f" | {taus[-1] / taus[0]:.2f}x |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_context.md").write_text("\n".join(rows) + "\n")
    summary.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
