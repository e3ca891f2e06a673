"""DFlash beside EAGLE-3 on the tiny target: the same completions, the same wall-clock training budget, then lossless
decoding (tau, greedy and sampling, chain and tree, acceptance per position), the drafting cost of one round, and the
cost of a training step.

    python -m bench.bench_dflash [--prepare-only] [--train-seconds 600] [--layers 1,2,5] [--prompts 10]

Needs the demo's artifacts (``make demo``: the corpus and the tiny target). Steps, each skipped when its output
already exists under ``--out`` (default artifacts/dflash; delete a file to redo its step):

1. training prompts cut from the corpus' training files (as ``draftsmith prepare`` and ``draftsmith compare`` cut
   them) and ``draftsmith generate --prompt_field prompt``: the target's own greedy completions, which the method
   expects (``--prepare-only`` stops here; recipes/quickstart/dflash.yaml trains on them, and its header makes them
   with ``draftsmith prepare`` and ``draftsmith generate``);
2. DFlash drafters of each ``--layers`` count (recipes/quickstart/dflash.yaml) and the quickstart EAGLE-3 drafter
   (recipes/quickstart/eagle3.yaml) train on the completions for ``--train-seconds`` each at a constant learning rate
   after warm-up, ``--parallel`` runs at a time with one thread each (so that runs sharing the machine see the same
   load), and are exported (``dflash`` and ``eagle3`` formats);
3. ``evaluate_drafter`` (what ``draftsmith eval`` runs) on the first ``--prompts`` held-out files (160-character
   prompts, ``--max-new-tokens`` each), greedy (every output checked token for token against the target's) and
   sampling at T = 1: DFlash as a chain of the block's ``--dflash-k`` drafts and as a DDTree (``--tree-nodes`` nodes,
   top-``--tree-top-k``), EAGLE-3 as a chain of ``--eagle3-k`` drafts and as its EAGLE-2 tree (same node budget);
4. drafting cost of one round, measured on the same prompts with the drafters taking turns prompt by prompt: one
   DFlash forward for a whole block against EAGLE-3's chain of ``--eagle3-k`` drafts and its tree, as time ratios and
   relative to one forward of the target;
5. one training step of each objective on the same batch (4 x 256 tokens of the completions), one thread: tokens/s
   and peak memory (the profiler's, forward and backward).

Writes ``OUT/dflash.md`` (and prints it).

With ``--labels data,argmax,soft`` it runs instead a side-by-side of the DFlash objective's label options on natural
text (the corpus' training files, whose tokens are often not the target's choice), each run of
recipes/quickstart/dflash.yaml for ``--label-steps`` optimizer steps on the same data with one thread, all at once,
then ``evaluate_drafter`` greedy (K = ``--dflash-k``) on the held-out prompts: tau and acceptance per draft slot, in
``OUT/labels.md``. ``--artifacts`` may name any folder holding ``corpus/`` (``draftsmith prepare``) and
``tiny_target/``:

    python -m bench.bench_dflash --labels data,argmax,soft --artifacts ART --out ART/labels --label-steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import fit_cmd, run, step_memory, training_prompts, wait, write_heldout_prompts
from trainer.decoding.evaluate import evaluate_drafter, load_prompts, resolve_drafter, run_prompts
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer


def prepare(art: Path, out: Path, per_file: int, new_tokens: int) -> Path:
    """Training prompts and the target's completions of them (step 1)."""
    prompts, completions = out / "train_prompts.jsonl", out / "train_completions.jsonl"
    if not prompts.is_file():
        training_prompts(art / "corpus" / "train.jsonl", prompts, per_file, seed=0)
    if not completions.is_file():
        started = time.perf_counter()
        generate = [
            "draftsmith", "generate", "--target", str(art / "tiny_target"), "--input_file", str(prompts),
            "--output_file", str(completions), "--prompt_field", "prompt", "--max_new_tokens", str(new_tokens),
            "--batch_size", "32", "--device", "cpu",
        ]  # fmt: skip
        # one thread: on a shared machine, OpenMP threads of contending processes slow each other down many times
        wait(run(generate, out / "generate.log", threads=1), out / "generate.log")
        print(f"generate: {time.perf_counter() - started:.0f} s", flush=True)
    return completions


def train(out: Path, completions: Path, layers: list[int], seconds: int, parallel: int) -> dict[str, Path]:
    """Every drafter trained for ``seconds`` and exported (step 2); name -> export folder."""
    runs = {
        f"dflash_{n}": ("recipes/quickstart/dflash.yaml", ["--model.init_args.num_draft_layers", str(n)])
        for n in layers
    }
    runs["eagle3"] = ("recipes/quickstart/eagle3.yaml", [])
    exports = {name: out / "export" / name for name in runs}
    todo = [name for name in runs if not (exports[name] / "model.safetensors").is_file()]
    for start in range(0, len(todo), parallel):
        procs = {}
        for name in todo[start : start + parallel]:
            recipe, extra = runs[name]
            cmd = fit_cmd(recipe, out / "runs" / name, completions, seconds, None, extra)
            procs[name] = run(cmd, out / f"fit_{name}.log", threads=1)
        for name, proc in procs.items():
            wait(proc, out / f"fit_{name}.log")
            fmt = "eagle3" if name == "eagle3" else "dflash"
            ckpt = out / "runs" / name / "checkpoints" / "last.ckpt"
            export = ["draftsmith", "export", "--ckpt_path", str(ckpt),
                      "--output_dir", str(exports[name]), "--format", fmt]  # fmt: skip
            wait(run(export, out / f"export_{name}.log"), out / f"export_{name}.log")
    return exports


def steps_done(out: Path, name: str) -> int:
    """Optimizer steps a run reached (from its last checkpoint)."""
    ckpt = out / "runs" / name / "checkpoints" / "last.ckpt"
    return int(torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]) if ckpt.is_file() else 0


def evaluate(target, tokenizer, exports: dict[str, Path], prompts, args, cache: Path) -> dict:
    """Step 3: label -> the report of evaluate_drafter (greedy and sampling, one K)."""
    reports = json.loads(cache.read_text()) if cache.is_file() else {}
    eos = tokenizer.eos_token_id
    for name, folder in exports.items():
        k = args.eagle3_k if name == "eagle3" else args.dflash_k
        for tree in (False, True):
            label = f"{name} {'tree' if tree else 'chain'}"
            if label in reports:
                continue
            options = ProposerOptions(tree=tree, tree_nodes=args.tree_nodes, tree_top_k=args.tree_top_k)
            proposer = resolve_drafter(str(folder), target, options, tokenizer)
            started = time.perf_counter()
            reports[label] = evaluate_drafter(target, proposer, prompts, [k], args.max_new_tokens, 1.0, eos)
            print(f"eval {label}: {time.perf_counter() - started:.0f} s", flush=True)
            cache.write_text(json.dumps(reports))
    return reports


def drafting_cost(target, tokenizer, exports: dict[str, Path], prompts, args) -> dict[str, float]:
    """Step 4: label -> mean seconds of one round's drafting, and "target" -> one decoding forward of the target."""
    proposers = {}
    for name, folder in exports.items():
        for tree in (False, True):
            options = ProposerOptions(tree=tree, tree_nodes=args.tree_nodes, tree_top_k=args.tree_top_k)
            proposers[f"{name} {'tree' if tree else 'chain'}"] = resolve_drafter(
                str(folder), target, options, tokenizer
            )
    seconds = {label: 0.0 for label in proposers} | {"target": 0.0}
    rounds = {label: 0 for label in seconds}
    for prompt in prompts:  # the drafters take turns prompt by prompt
        (alone,) = run_prompts(target, NoProposer(), [prompt], 1, args.max_new_tokens)
        seconds["target"] += alone.target_seconds - alone.prefill_seconds
        rounds["target"] += alone.target_forwards - 1
        for label, proposer in proposers.items():
            k = args.eagle3_k if label.startswith("eagle3") else args.dflash_k
            (result,) = run_prompts(target, proposer, [prompt], k, args.max_new_tokens)
            seconds[label] += result.propose_seconds
            rounds[label] += sum(r.drafted > 0 for r in result.rounds)
    return {label: seconds[label] / max(1, rounds[label]) for label in seconds}


def training_step(art: Path, completions: Path, layers: list[int], repeats: int) -> dict[str, tuple[float, int]]:
    """Step 5: objective -> (tokens/s, peak bytes) of one training step on the same 4 x 256 batch."""
    from trainer.data.text import TextDataModule
    from trainer.methods.dflash.objective import DFlash
    from trainer.methods.eagle3.objective import Eagle3

    data = TextDataModule(
        tokenizer=str(art / "corpus" / "tokenizer"), train_files=[str(completions)], seq_len=256, batch_size=4
    )
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    target = str(art / "tiny_target")
    objectives = {
        f"DFlash, {n} layer{'s' * (n > 1)}, 32 anchors": DFlash(
            target, num_draft_layers=n, mask_token_id=2, max_anchors=32
        )
        for n in layers
    }
    for steps in (3, 7):
        eagle = Eagle3(target, draft_vocab_size=1024, target_layers=[1, 2, 3], ttt_steps=steps)
        eagle.build_vocab_map(data.train_dataset.ids, data.train_dataset.trained)
        objectives[f"EAGLE-3, {steps} TTT steps"] = eagle
    results = {}
    for label, objective in objectives.items():
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            started = time.perf_counter()
            objective.compute_loss(batch)[0].backward()
            times.append(time.perf_counter() - started)
        objective.trainable_module().zero_grad(set_to_none=True)
        _, peak = step_memory(lambda o=objective: o.compute_loss(batch)[0], torch.device("cpu"))
        results[label] = (batch["input_ids"].numel() / statistics.median(times[1:]), peak)
    return results


def table(reports: dict, steps: dict[str, int], args) -> list[str]:
    head = "| drafter | K | trained steps | tau greedy | tau sampling (T = 1) | speedup projected / measured |"
    lines = [head + " acceptance per position (greedy) |", "|---|---|---|---|---|---|---|"]
    for label, report in reports.items():
        greedy, sampling = report["greedy"][0], report["sampling"][0]
        per_position = " ".join("-" if a is None else f"{a:.2f}" for a in greedy["acceptance_per_position"])
        trained = steps.get(label.split()[0], 0)
        lines.append(
            f"| {label} | {greedy['k']} | {trained} | {greedy['tau']:.2f} | {sampling['tau']:.2f} | "
            f"{greedy['projected_speedup']:.2f}x / {greedy['measured_speedup']:.2f}x | {per_position} |"
        )
    return lines


def compare_labels(args, art: Path, out: Path) -> int:
    """``--labels``: the label options side by side on natural text (same steps, same data, one thread each)."""
    labels = args.labels.split(",")
    train_file, tokenizer_dir = art / "corpus" / "train.jsonl", art / "corpus" / "tokenizer"
    exports = {label: out / "export" / label for label in labels}
    procs = {}
    for label in labels:
        if (exports[label] / "model.safetensors").is_file():
            continue
        extra = [
            "--model.init_args.target", str(art / "tiny_target"), "--model.init_args.labels", label,
            "--model.init_args.position_weights", "decay",  # the same fixed slot weights for every label (soft too)
            "--data.init_args.tokenizer", str(tokenizer_dir),
            "--data.init_args.val_files", json.dumps([str(art / "corpus" / "heldout.jsonl")]),
        ]  # fmt: skip
        cmd = fit_cmd("recipes/quickstart/dflash.yaml", out / "runs" / label, train_file, 0, args.label_steps, extra)
        procs[label] = run(cmd, out / f"fit_{label}.log", threads=1)
    for label, proc in procs.items():
        wait(proc, out / f"fit_{label}.log")
        ckpt = out / "runs" / label / "checkpoints" / "last.ckpt"
        export = ["draftsmith", "export", "--ckpt_path", str(ckpt),
                  "--output_dir", str(exports[label]), "--format", "dflash"]  # fmt: skip
        wait(run(export, out / f"export_{label}.log"), out / f"export_{label}.log")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(art / "tiny_target").eval()
    tokenizer = AutoTokenizer.from_pretrained(art / "tiny_target")
    heldout = write_heldout_prompts(art / "corpus", out / "heldout_prompts.jsonl", args.prompts)
    prompts = load_prompts(heldout, tokenizer)
    rows = [
        f"DFlash label options, recipes/quickstart/dflash.yaml for {args.label_steps} steps each on {train_file} "
        f"(natural text), one thread each; greedy on {len(prompts)} held-out prompts, {args.max_new_tokens} new "
        "tokens, "
        f"K = {args.dflash_k}.",
        "",
        "| labels | steps | tau (greedy) | against the first | tau outside loops | acceptance per slot (greedy) |",
        "|---|---|---|---|---|---|",
    ]
    taus = {}
    for label in labels:
        proposer = resolve_drafter(str(exports[label]), target, ProposerOptions(), tokenizer)
        report = evaluate_drafter(target, proposer, prompts, [args.dflash_k], args.max_new_tokens, 0.0)
        greedy = report["greedy"][0]
        taus[label] = greedy["tau"]
        per_slot = " ".join("-" if a is None else f"{a:.2f}" for a in greedy["acceptance_per_position"])
        ratio = f"{greedy['tau'] / taus[labels[0]]:.3f}x" if labels[0] in taus else "-"
        steps = steps_done(out, label)
        outside = greedy["tau_outside_loops"]
        rows.append(f"| {label} | {steps} | {greedy['tau']:.3f} | {ratio} | {outside:.3f} | {per_slot} |")
        print(rows[-1], flush=True)
    rows += ["", f"The target's greedy output sits in loops for {report['loops']['share']:.0%} of its tokens."]
    text = "\n".join(rows) + "\n"
    (out / "labels.md").write_text(text)
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifacts", default="artifacts", help="where `make demo` left the corpus and the target")
    parser.add_argument("--out", default="artifacts/dflash", help="output folder (steps already done are skipped)")
    parser.add_argument("--prepare-only", action="store_true", help="make the training completions and stop")
    parser.add_argument("--prompts-per-file", type=int, default=3, help="training prompts cut from each train file")
    parser.add_argument("--new-tokens", type=int, default=192, help="tokens the target adds to each training prompt")
    parser.add_argument("--layers", default="1,2,5", help="DFlash draft-layer counts to train")
    parser.add_argument("--train-seconds", type=int, default=600, help="wall-clock training time of each drafter")
    parser.add_argument("--parallel", type=int, default=2, help="training runs at a time (one thread each)")
    parser.add_argument("--prompts", type=int, default=10, help="held-out prompts in the evaluation")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="output tokens per evaluation prompt")
    parser.add_argument("--dflash-k", type=int, default=15, help="DFlash drafts per round (block size - 1)")
    parser.add_argument("--eagle3-k", type=int, default=6, help="EAGLE-3 drafts per round")
    parser.add_argument("--tree-nodes", type=int, default=24, help="node budget of both trees")
    parser.add_argument("--tree-top-k", type=int, default=4, help="top-k of both trees")
    parser.add_argument("--step-repeats", type=int, default=3, help="timed training steps per objective (step 5)")
    parser.add_argument("--labels", default=None, help="compare these DFlash label options instead (data,argmax,soft)")
    parser.add_argument("--label-steps", type=int, default=300, help="optimizer steps of each --labels run")
    args = parser.parse_args()
    art, out = Path(args.artifacts), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (art / "tiny_target" / "config.json").is_file():
        sys.exit(f"{art / 'tiny_target'} not found: run `make demo` first")
    if args.labels:
        return compare_labels(args, art, out)
    completions = prepare(art, out, args.prompts_per_file, args.new_tokens)
    if args.prepare_only:
        return 0
    layers = [int(n) for n in args.layers.split(",")]
    exports = train(out, completions, layers, args.train_seconds, args.parallel)
    steps = {name: steps_done(out, name) for name in exports}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(art / "tiny_target").eval()
    tokenizer = AutoTokenizer.from_pretrained(art / "tiny_target")
    heldout = write_heldout_prompts(art / "corpus", out / "heldout_prompts.jsonl", args.prompts)
    prompts = load_prompts(heldout, tokenizer)
    reports = evaluate(target, tokenizer, exports, prompts, args, out / "reports.json")
    costs = drafting_cost(target, tokenizer, exports, prompts, args)
    training = training_step(art, completions, layers, args.step_repeats)

    rows = [
        f"Tiny target, {args.prompts} held-out prompts, {args.max_new_tokens} new tokens each; every drafter trained "
        f"{args.train_seconds} s on the target's completions ({args.parallel} runs at a time, one thread each); "
        f"trees of {args.tree_nodes} nodes, top-{args.tree_top_k}.",
        "",
        *table(reports, steps, args),
        "",
        "Drafting cost of one round (mean over the same prompts, drafters taking turns):",
        "",
        "| drafter | seconds per round | per target forward | against EAGLE-3's chain |",
        "|---|---|---|---|",
    ]
    base = costs["eagle3 chain"]
    for label, seconds in costs.items():
        if label == "target":
            continue
        rows.append(f"| {label} | {seconds * 1e3:.2f} ms | {seconds / costs['target']:.2f} | {seconds / base:.2f} |")
    rows += [f"| one decoding forward of the target | {costs['target'] * 1e3:.2f} ms | 1.00 | - |", ""]
    rows += [
        "One training step, the same 4 x 256 batch, one thread:",
        "",
        "| objective | tokens/s | peak memory |",
        "|---|---|---|",
    ]
    for label, (rate, peak) in training.items():
        rows.append(f"| {label} | {rate:,.0f} | {peak / 2**20:.0f} MiB |")
    text = "\n".join(rows) + "\n"
    (out / "dflash.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
