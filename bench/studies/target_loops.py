"""How much of the tiny target's greedy output sits in loops, for variants of its training at the demo's budget.

    python -m bench.studies.target_loops [--steps 400] [--variants 8x256,16x128,lr4e-3,tied] [--parallel 2]
    python -m bench.studies.target_loops --noise 0.001,0.003,0.01 [--model artifacts/tiny_target] [--seeds 3]
    python -m bench.studies.target_loops --finetune 0.0002,0.0001 [--model artifacts/tiny_target] [--seeds 3]

Needs the demo's corpus (``make demo`` or ``draftsmith prepare``). Every variant trains
recipes/quickstart/tiny_target.yaml for ``--steps`` optimizer steps (the demo's 400) with its own changes,
``--parallel`` at a time on one thread each (so all see the same machine load), then the script measures on the
demo's held-out prompts (the first 160 characters of the first 10 held-out files): the held-out loss (the demo's
8 x 256-token batches), and the share of greedy output positions inside loops (trainer/decoding/metrics.loop_mask,
window 16, period <= 8, as ``draftsmith eval`` counts them) at 48 and 128 new tokens. Writes OUT/loops.md and prints
it.

``--noise``: no training; the null experiment for a changed target's loop share. Every weight of ``--model`` gets
Gaussian noise of ``sigma`` times that tensor's standard deviation (``--seeds`` draws per sigma), and the same
measures are taken, with how many of the 10 greedy outputs (48 tokens) stay identical to the model's own: how much
the loop share moves when the model changes at random rather than by training. Writes OUT/noise.md.

``--finetune``: the null experiment by training: ``--model`` goes on with its own pre-training, nothing else (its
next-token loss on the corpus' training text, AdamW at each given peak learning rate, 20 warm-up steps, cosine to a
tenth), for a fine-tune's budget (``--finetune-steps`` of 8 x 256 tokens: the 64 steps ``draftsmith compare`` gives a
target-changing method), ``--seeds`` batch orders per rate; the same measures as ``--noise``: how far the loop share
moves when the model trains on nothing but what it was made from. Writes OUT/finetune.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import ROOT, heldout_data, heldout_texts
from trainer.decoding.metrics import loop_mask
from trainer.training.heldout import heldout_loss
from trainer.training.optimizers import Optim, lr_factor

BEFORE = ["--data.init_args.seq_len", "256", "--data.init_args.batch_size", "8"]  # the demo's target until 2026-12
VARIANTS = {
    "8x256": BEFORE,
    "16x128": [],  # recipes/quickstart/tiny_target.yaml as it is: the same tokens per step in shorter rows
    "lr4e-3": [*BEFORE, "--model.init_args.optim.lr", "0.004"],
    "tied": [*BEFORE, "--model.init_args.tie_word_embeddings", "true", "--model.init_args.optim.lr", "0.004"],
    "lr1e-3": [*BEFORE, "--model.init_args.optim.lr", "0.001"],
    "wd0.1": [*BEFORE, "--model.init_args.optim.weight_decay", "0.1"],
}


def train(name: str, extra: list[str], out: Path, steps: int) -> subprocess.Popen:
    run = out / name
    args = [
        sys.executable, "-m", "trainer.cli", "fit", "--config", str(ROOT / "recipes/quickstart/tiny_target.yaml"),
        "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(run), "--trainer.logger", "false",
        "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false", "--model.init_args.export_dir", str(run / "model"), *extra,
    ]  # fmt: skip
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=(run / "fit.log").open("w"), stderr=subprocess.STDOUT)


def greedy_outputs(model, tokenizer, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """Each prompt's ``new_tokens`` greedy output tokens."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def share_in_loops(outputs: list[list[int]]) -> float:
    """The share of the outputs' positions inside loops (window 16, period <= 8, as ``draftsmith eval``)."""
    return sum(sum(loop_mask(o, 16, 8)) for o in outputs) / sum(len(o) for o in outputs)


def loop_share(model, tokenizer, prompts: list[str], new_tokens: int) -> float:
    return share_in_loops(greedy_outputs(model, tokenizer, prompts, new_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifacts", default="artifacts", help="where the demo's corpus is")
    parser.add_argument("--out", default="artifacts/target_loops", help="output folder")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of every variant (the demo's 400)")
    parser.add_argument("--variants", default="8x256,16x128,lr4e-3,tied", help=f"among {', '.join(VARIANTS)}")
    parser.add_argument("--parallel", type=int, default=2, help="variants trained at once, one thread each")
    parser.add_argument("--noise", help="comma-separated relative noise levels: measure --model perturbed instead")
    parser.add_argument("--model", default="artifacts/tiny_target", help="the model --noise perturbs")
    parser.add_argument("--seeds", type=int, default=3, help="noise draws per level, batch orders per learning rate")
    parser.add_argument("--finetune", help="comma-separated peak learning rates: continue --model's pre-training")
    parser.add_argument("--finetune-steps", type=int, default=64, help="optimizer steps of 8 x 256 tokens")
    args = parser.parse_args()
    if args.noise or args.finetune:
        return perturbed(args)
    out, corpus = Path(args.out), Path(args.artifacts) / "corpus"
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    seconds = {}
    todo = [n for n in names if not (out / n / "model" / "config.json").is_file()]
    while todo:
        batch, todo = todo[: args.parallel], todo[args.parallel :]
        started = time.perf_counter()
        procs = {n: train(n, VARIANTS[n], out, args.steps) for n in batch}
        for name, proc in procs.items():
            if proc.wait() != 0:
                sys.exit(f"{name} failed, see {out / name / 'fit.log'}")
            seconds[name] = time.perf_counter() - started
        (out / "seconds.json").write_text(json.dumps({**_read(out / "seconds.json"), **seconds}))
    seconds = _read(out / "seconds.json")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    data = heldout_data(corpus)
    prompts = heldout_texts(corpus, 10)
    rows = [
        f"{args.steps} optimizer steps each (the demo's budget), trained {args.parallel} at a time on one thread each; "
        "loop share of the greedy output of the demo's 10 held-out prompts.",
        "",
        "| variant | changes | held-out loss | loop share, 48 tokens | loop share, 128 tokens | training time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        folder = out / name / "model"
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        loss = heldout_loss(model, data.val_dataloader())
        short, long = loop_share(model, tokenizer, prompts, 48), loop_share(model, tokenizer, prompts, 128)
        changes = " ".join(VARIANTS[name]).replace("--model.init_args.", "").replace("--data.init_args.", "") or "-"
        rows.append(
            f"| {name} | {changes} | {loss:.3f} | {short:.0%} | {long:.0%} | {seconds.get(name, float('nan')):.0f} |"
        )
    (out / "loops.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


def perturbed(args: argparse.Namespace) -> int:
    """The null experiments: the original against itself perturbed by noise (--noise) or by its own pre-training
    (--finetune), on the held-out loss, the loop share and the greedy outputs that stay the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    out, corpus = Path(args.out), Path(args.artifacts) / "corpus"
    data = heldout_data(corpus)
    prompts = heldout_texts(corpus, 10)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    original = AutoModelForCausalLM.from_pretrained(args.model).eval()

    def measure(model) -> tuple[float, float, list[list[int]]]:
        outputs = greedy_outputs(model, tokenizer, prompts, 48)
        return heldout_loss(model, data.val_dataloader()), share_in_loops(outputs), outputs

    loss0, share0, outputs0 = measure(original)
    if args.noise:
        name, what, levels, change = "noise", "sigma", args.noise, add_noise
        head = f"`{args.model}` with every weight tensor plus Gaussian noise of sigma times its standard deviation"
    else:
        name, what, levels, change = "finetune", "peak learning rate", args.finetune, continue_pretraining
        head = (
            f"`{args.model}` after {args.finetune_steps} more steps of its own pre-training (8 x 256 tokens of the "
            "corpus' training text, AdamW, 20 warm-up steps, cosine to a tenth of the peak; the seed orders the "
            "batches)"
        )
    rows = [
        f"{head}; loop share of the greedy output (48 tokens) of the demo's 10 held-out prompts.",
        "",
        f"| {what} | seed | held-out loss | loop share | outputs identical to the model's |",
        "|---|---|---|---|---|",
        f"| 0 | | {loss0:.3f} | {share0:.0%} | 10 / 10 |",
    ]
    for level in (float(x) for x in levels.split(",")):
        for seed in range(args.seeds):
            model = AutoModelForCausalLM.from_pretrained(args.model)
            change(model, level, seed, corpus, args.finetune_steps)
            loss, share, outputs = measure(model.eval())
            same = sum(a == b for a, b in zip(outputs, outputs0, strict=True))
            rows.append(f"| {level:g} | {seed} | {loss:.3f} | {share:.0%} | {same} / {len(prompts)} |")
            print(rows[-1], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


def add_noise(model, sigma: float, seed: int, corpus: Path, steps: int) -> None:
    """Every weight tensor plus Gaussian noise of ``sigma`` times its standard deviation."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * sigma * weight.float().std())


def continue_pretraining(model, lr: float, seed: int, corpus: Path, steps: int) -> None:
    """``steps`` AdamW steps of the model's next-token loss on the corpus' training text (8 x 256-token batches in
    the order ``seed`` draws), ``lr`` at the peak after 20 warm-up steps, cosine to a tenth."""
    from trainer.data.text import TextDataModule

    data = TextDataModule(
        tokenizer=str(corpus / "tokenizer"), train_files=[str(corpus / "train.jsonl")], seq_len=256, batch_size=8,
        seed=seed,
    )  # fmt: skip
    data.setup("fit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    shape = Optim(lr=lr, warmup_steps=20, min_lr_ratio=0.1)  # the schedule every recipe's optim gets
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, shape, steps))
    model.train()
    batches = iter(data.train_dataloader())
    for _ in range(steps):
        batch = next(batches)
        logits = model(input_ids=batch["input_ids"]).logits  # [B, S, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


if __name__ == "__main__":
    sys.exit(main())
