"""Drafters side by side on the tiny target: prompt lookup, a KD student and EAGLE-3 (chain and tree), K = 6 greedy.

    python -m bench.studies.compare_drafters [--train-seconds 300 | --steps 500,770] [--prompts 10]

Needs the demo's artifacts (``make demo``: the corpus and the tiny target). Steps, each skipped when its output
already exists under ``--out`` (delete the folder to start over):

1. training prompts: the first 160 characters of every training file and of random line starts inside them;
2. ``draftsmith generate --prompt_field prompt``: the target completes every prompt greedily, so the drafters learn
   what the target says (the tiny target loops; a drafter trained on the corpus alone never sees that);
3. the KD student (recipes/quickstart/kd.yaml) and the EAGLE-3 drafter (recipes/quickstart/eagle3.yaml) train on the
   completions *at the same time*, one thread each (so both see the same machine load): either for the same
   wall-clock time ``--train-seconds``, at a constant learning rate after warm-up (a run bounded by time has no step
   count to decay over, so the final weights are wherever the last steps left them), or for ``--steps KD,EAGLE3``
   optimizer steps with the recipes' cosine decay (deterministic: seeded data order and initialisation; pick counts
   that took the same time in a time-bounded run, the wall-clock time of each is written beside the table);
4. ``draftsmith eval`` of every drafter on the first ``--prompts`` held-out files (160-character prompts, as the demo
   uses), K = 6, greedy: every drafter's output is checked token for token against the target's.

5. teacher-forced chains, a low-noise companion of step 4: the target continues ``--chain-prompts`` held-out prompts
   greedily (``--chain-new-tokens`` tokens each), and every position of every continuation is taken as a round start:
   a draft counts while it and all drafts before it equal the target's greedy tokens, which is what greedy
   verification accepts. The KD student is scored from one forward pass over the continuation, the EAGLE-3 drafter
   from one training-time-test unroll over it with the continuation's tokens as inputs (inside an accepted chain the
   drafts are those tokens); tests/unit/test_eagle3_drafter.py checks that the unroll equals cached chain drafting.

Writes ``OUT/compare.md`` (and prints it): tau overall, inside and outside the target's loops, and acceptance per draft
position, for both evaluations.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from bench.common import fit_cmd, run, training_prompts, wait, write_heldout_prompts
from trainer.decoding.evaluate import load_prompts
from trainer.decoding.metrics import loop_mask
from trainer.training.registry import load_drafter


def greedy_continuations(
    target, tokenizer, prompts: Path, new_tokens: int, cache: Path
) -> list[tuple[torch.Tensor, int]]:
    """(prompt + greedy continuation [N], prompt length) of every prompt, cached in ``cache``."""
    if cache.is_file():
        return torch.load(cache)
    out = []
    for ids in load_prompts(prompts, tokenizer):
        with torch.no_grad():
            full = target.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)  # [1, N]
        out.append((full[0], len(ids)))
    torch.save(out, cache)
    return out


def accepted_lengths(target, spec: str, sequences, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain acceptance of the drafter at ``spec`` (a KD student or EAGLE-3 export folder) from every round
    start of every continuation: (accepted drafts [R] in 0..k, inside-a-loop flag [R] of the round's first drafted
    token)."""
    drafter, record = load_drafter(spec)
    eagle = record.kind == "eagle3"
    drafter.eval()
    lengths, loops = [], []
    for ids, prompt_len in sequences:
        N = ids.numel()
        with torch.no_grad():
            if eagle:
                out = target(ids[None], output_hidden_states=True)
                fused = drafter.fuse([out.hidden_states[i][:, :-1] for i in drafter.config.aux_layers])  # [1, N-1, H]
                stream = torch.nn.functional.pad(ids[None], (0, k))  # [1, N + k]
                steps = drafter.unroll(target.get_input_embeddings(), fused, ids[None, 1:], k, stream)
                # element t, step i drafts token t + 2 + i
                hits = [
                    drafter.to_target_ids(lg[0].argmax(-1))[: N - 2 - i] == ids[2 + i :] for i, lg in enumerate(steps)
                ]
            else:
                right = drafter(ids[None]).logits[0].argmax(-1)[:-1] == ids[1:]  # [N - 1]: position s predicts s + 1
                hits = [right[1 + i :] for i in range(k)]  # draft i of element t is the prediction at t + 1 + i
        hits = torch.stack([h[: N - 1 - k] for h in hits], dim=1)  # [N - 1 - k, k], round starts whose chain fits
        accepted = hits.long().cumprod(dim=1).sum(dim=1)  # [N - 1 - k]
        first = prompt_len - 1  # element t's bonus token t + 1 is the first generated one
        in_loop = torch.tensor(loop_mask(ids[prompt_len:].tolist()))  # [N - prompt_len]
        lengths.append(accepted[first:])
        loops.append(in_loop[: N - 1 - k - first])
    return torch.cat(lengths), torch.cat(loops)


def chain_row(label: str, accepted: torch.Tensor, in_loop: torch.Tensor, k: int) -> str:
    """A table row: tau, tau inside / outside loops, acceptance of draft positions 1..k (as `draftsmith eval`)."""
    tau = 1 + accepted.float()  # [R]
    per_position = ", ".join(f"{(accepted >= d).float().mean():.2f}" for d in range(1, k + 1))
    return f"| {label} | {tau.mean():.2f} | {tau[in_loop].mean():.2f} | {tau[~in_loop].mean():.2f} | {per_position} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifacts", default="artifacts", help="where `make demo` left the corpus and the target")
    parser.add_argument("--out", default="artifacts/compare", help="output folder (steps already done are skipped)")
    parser.add_argument("--train-seconds", type=int, default=300, help="wall-clock training time of each drafter")
    parser.add_argument("--steps", help="KD,EAGLE3: optimizer steps of each run (cosine decay) instead of a time")
    parser.add_argument("--prompts-per-file", type=int, default=3, help="training prompts cut from each train file")
    parser.add_argument("--new-tokens", type=int, default=192, help="tokens the target adds to each training prompt")
    parser.add_argument("--prompts", type=int, default=10, help="held-out prompts in the evaluation")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="output tokens per evaluation prompt")
    parser.add_argument("--k", type=int, default=6, help="drafts per round")
    parser.add_argument("--chain-prompts-per-file", type=int, default=3, help="held-out prompts per file for step 5")
    parser.add_argument("--chain-new-tokens", type=int, default=96, help="greedy tokens per step-5 continuation")
    parser.add_argument("--completions", help="reuse the target completions of an earlier run (skips steps 1 and 2)")
    parser.add_argument("--kd-args", default="", help="extra `draftsmith fit` arguments of the KD run")
    parser.add_argument(
        "--eagle3-args",
        default="",
        help='extra `draftsmith fit` arguments of the EAGLE-3 run, e.g. "--model.init_args.ttt_steps 5"',
    )
    args = parser.parse_args()
    art, out = Path(args.artifacts), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, corpus = art / "tiny_target", art / "corpus"
    if not (target / "config.json").is_file():
        sys.exit(f"{target} not found: run `make demo` first")

    prompts, regen = out / "train_prompts.jsonl", out / "train_completions.jsonl"
    if args.completions:
        regen = Path(args.completions)
    else:
        if not prompts.is_file():
            training_prompts(corpus / "train.jsonl", prompts, args.prompts_per_file, seed=0)
        started = time.perf_counter()
        generate = [
            "draftsmith", "generate", "--target", str(target), "--input_file", str(prompts),
            "--output_file", str(regen),
            "--prompt_field", "prompt", "--max_new_tokens", str(args.new_tokens), "--batch_size", "32",
            "--device", "cpu",
        ]  # fmt: skip
        # one thread: two contending multi-threaded processes slow down several times on 2 cores
        wait(run(generate, out / "generate.log", threads=1), out / "generate.log")
        print(f"generate: {time.perf_counter() - started:.0f} s", flush=True)

    kd_dir, eagle_dir = out / "kd_student", out / "eagle3"
    fits = {
        "kd": (
            "recipes/quickstart/kd.yaml", kd_dir / "model.safetensors",
            ["--model.init_args.export_dir", str(kd_dir), *shlex.split(args.kd_args)],
        ),
        "eagle3": ("recipes/quickstart/eagle3.yaml", eagle_dir / "model.safetensors", shlex.split(args.eagle3_args)),
    }  # fmt: skip
    steps = dict(zip(fits, map(int, args.steps.split(",")))) if args.steps else dict.fromkeys(fits)
    procs, started, seconds_file = {}, time.perf_counter(), out / "fit_seconds.json"
    for name, (recipe, done, extra) in fits.items():
        if not done.is_file():
            cmd = fit_cmd(recipe, out / "runs" / name, regen, args.train_seconds, steps[name], extra)
            procs[name] = run(cmd, out / f"fit_{name}.log", threads=1)
    seconds = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
    for name, proc in procs.items():
        wait(proc, out / f"fit_{name}.log")
        seconds[name] = round(time.perf_counter() - started)  # both started together
    seconds_file.write_text(json.dumps(seconds))
    if not (eagle_dir / "model.safetensors").is_file():
        ckpt = out / "runs" / "eagle3" / "checkpoints" / "last.ckpt"
        export = ["draftsmith", "export", "--ckpt_path", str(ckpt),
                  "--output_dir", str(eagle_dir), "--format", "eagle3"]  # fmt: skip
        wait(run(export, out / "export_eagle3.log"), out / "export_eagle3.log")

    heldout = write_heldout_prompts(corpus, out / "heldout_prompts.jsonl", args.prompts)
    drafters = {
        "prompt lookup": "prompt-lookup",
        "KD student": str(kd_dir),
        "EAGLE-3 chain": str(eagle_dir),
        "EAGLE-3 tree": f"{eagle_dir} --tree",
    }
    rows = []
    for label, spec in drafters.items():
        report_dir = out / "eval" / label.lower().replace(" ", "_").replace("-", "")
        if not (report_dir / "report.json").is_file():
            cmd = ["draftsmith", "eval", "--target", str(target), "--drafter", *spec.split(), "--prompts", str(heldout),
                   "--k", str(args.k), "--max_new_tokens", str(args.max_new_tokens), "--temperature", "0",
                   "--output_dir", str(report_dir)]  # fmt: skip
            wait(run(cmd, report_dir.with_suffix(".log")), report_dir.with_suffix(".log"))
        report = json.loads((report_dir / "report.json").read_text())
        greedy = report["greedy"][0]
        rows.append(
            f"| {label} | {greedy['tau']:.2f} | {greedy['tau_in_loops']:.2f} | {greedy['tau_outside_loops']:.2f} | "
            + ", ".join("-" if a is None else f"{a:.2f}" for a in greedy["acceptance_per_position"])
            + " |"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    chain_prompts = out / "chain_prompts.jsonl"
    training_prompts(corpus / "heldout.jsonl", chain_prompts, args.chain_prompts_per_file, seed=1)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    sequences = greedy_continuations(
        model, AutoTokenizer.from_pretrained(target), chain_prompts, args.chain_new_tokens, out / "chain_greedy.pt"
    )
    chain_rows = []
    for label, spec in {"KD student": str(kd_dir), "EAGLE-3 chain": str(eagle_dir)}.items():
        accepted, in_loop = accepted_lengths(model, spec, sequences, args.k)
        chain_rows.append(chain_row(label, accepted, in_loop, args.k))
    if args.steps:
        trained = " and ".join(f"{name} {steps[name]} steps in {seconds.get(name, '?')} s" for name in fits)
    else:
        trained = f"for {args.train_seconds} s each"
    header = ["| drafter | tau | tau in loops | tau off loops | acceptance per position |", "|---|---|---|---|---|"]
    table = "\n".join(
        [
            f"K = {args.k}, greedy, {args.prompts} held-out prompts, {args.max_new_tokens} new tokens each; KD student "
            f"and EAGLE-3 trained side by side on the target's completions, {trained}.",
            "",
            *header,
            *rows,
            "",
            f"Teacher-forced chains: every position of the target's greedy continuations ({args.chain_new_tokens} "
            f"tokens) of {len(sequences)} held-out prompts as a round start, {int(accepted.numel())} rounds.",
            "",
            *header,
            *chain_rows,
        ]
    )
    (out / "compare.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
