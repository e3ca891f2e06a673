"""Our trainers beside speculators' own trainers (speculators 0.9) for EAGLE-3.1, P-EAGLE, DFlash, DSpark, DFlash2 and
XPress: the same target, the same data rows in the same order, the same optimizer steps, run at the same time with one
thread each, then both drafters measured by our engine (``draftsmith eval``) on the same held-out prompts.

    python -m bench.bench_vs_speculators --method eagle3 [--steps 300] [--prompts 15] [--out artifacts/vs_speculators]

``--method`` is ``eagle3`` (EAGLE-3.1: ``fc_norm``, ``norm_output`` and ``norm_before_residual`` on, in both),
``peagle``, ``dflash``, ``dspark``, ``dflash2`` or ``xpress`` (the refiners: speculators' ``--selector-rank`` /
``--xpress-rank`` / ``--markov-rank`` 64 and ``--dflash-decay-gamma`` 7 as our recipes; for DFlash2 and XPress its
``--loss-fn ce`` as our argmax labels unless ``--loss``; DSpark keeps its own default loss, ``kl_div``, and drafts
nothing from the anchor slot, ``--no-sample-from-anchor``, as every DFlash drafter our engine decodes). Needs the demo's
artifacts (the corpus and ``artifacts/tiny_target``) and speculators' virtualenv (``.cache/clients/speculators``, which
``DRAFTSMITH_TEST_CLIENTS=1 pytest tests/clients`` installs).
Steps, each skipped when its output already exists under ``--out`` (delete a file to redo its step):

1. data: ``draftsmith compare``'s training prompts (``trainer.compare.run.training_prompts``: 160 characters of
   every training file) and the target's greedy completions of them (``draftsmith generate --prompt_field prompt``,
   160 new tokens), as ``recipes/compare/tiny.yaml`` regenerates its data;
2. rows: the batches our recipe's data module serves (4 x 257 tokens a step, packed), for ``--steps`` steps, saved
   once, so that speculators trains on exactly the rows ours does, in the same order (4 documents packed into one
   sequence a step, as its collate function packs them); the token counts of those rows, from which speculators'
   own ``parse_vocab_mappings`` builds its d2t/t2d (``token_freq.pt``, as its ``prepare_data`` writes it);
3. training, both at once with ``OMP_NUM_THREADS=1``: ours is ``draftsmith fit`` of the quickstart recipe
   (``recipes/quickstart/{eagle3,peagle,dflash,dspark,dflash2,xpress}.yaml``) with the steps and data overridden;
   speculators' is its ``speculators.train`` code (``TrainConfig`` defaults, ``parse_vocab_mappings``,
   ``build_draft_model``, ``get_trainer_kwargs``, ``Trainer.run_training``) in its own virtualenv, this module run there
   with ``--side speculators``; the only change to its code path is the data loader, which runs the target's decoder on
   the step's rows (online, as ours does; not its lm_head, which speculators' loss applies itself) and hands the hidden
   states to speculators' ``CollateFn`` (with its ``shift_batch`` for EAGLE-3 and P-EAGLE). Its defaults are kept except
   what must match: target, data, steps, tokens per step (``total_seq_len`` 4 x 256), the learning-rate schedule (ours:
   peak lr, warm-up steps, cosine; speculators' cosine decays to 0, ours to 0.1 x lr), draft layers, K / block size, the
   target layers, the draft vocabulary (1,024 tokens for EAGLE-3 and P-EAGLE, the target's for DFlash) and mask token;
   the loss runs speculators' eager implementation (its fused one needs Triton, a GPU) in float32; DFlash's anchors per
   step are set to ours (32 per row, 128 per packed step) so that both train the same blocks; P-EAGLE's layer is ours
   (``--draft-arch llama``, ``norm_before_residual`` off as in our recipe; its defaults are a Qwen3 layer with
   ``norm_before_residual``); ``sdpa`` attention (its default flex attention has no backward on CPU);
4. export ours (``eagle3-speculators``, ``peagle-speculators``, ``dflash``, ``dspark``, ``dflash2``, ``xpress``);
   speculators' folder is its own ``save_pretrained``; ``draftsmith eval`` reads both;
5. ``draftsmith eval`` of both, greedy, on the first ``--prompts`` held-out files (160-character prompts, as
   ``draftsmith compare`` cuts them), ``--max-new-tokens`` each, K = 4 (EAGLE-3, P-EAGLE) or 15 (DFlash and its
   refiners): tau, acceptance per draft position; training tokens/s: ours the median of ``train/tokens_per_s``
   (TensorBoard), speculators' the median time between its optimizer steps (the target forward included, as in ours).

``--speculators-optimizer adamw`` trains speculators' side with AdamW instead of its default Muon (the optimizer of our
recipes; Muon's learning rate is the same peak lr, as speculators sets ``muon_lr`` by default). ``--peak-lr`` trains
both sides at another peak learning rate than the recipe's (the same schedule otherwise). ``--speculators-loss ce``
trains it on the target's argmax over the draft vocabulary (its ``--loss-fn``; default ``kl_div`` for EAGLE-3 and
P-EAGLE), the labels of our ``labels: argmax``; ``--loss L`` trains both sides with one of the LK-paper losses (``kl``,
``tv``, ``nla``, ``lk_hybrid``: our ``model.loss``, its ``--loss-fn``, ``kl`` being its ``kl_div``; our EAGLE-3 and
P-EAGLE recipes' ``argmax_weight`` then 0 but with ``kl``, as the mix is the KL's). ``--seed S`` seeds both sides (the
drafters' initialisation; ours also its anchors), and ``--name`` names the run's folder under ``--out`` (default: the
method; the data is shared by every run under ``--out``).

``--train-text corpus`` skips step 1: both sides train on the corpus' training files themselves
(``artifacts/corpus/train.jsonl``, long documents, as our data module packs them into the 257-token rows) instead of
the target's 160-token completions (``--train-text completions``, the default), e.g. for the long-context study:

    python -m bench.bench_vs_speculators --method eagle3 --steps 500 --train-text corpus \
        --out artifacts/vs_speculators_long --name eagle3_corpus_s0

``--seconds S`` compares at equal wall clock instead of equal steps, as a user pays for hours: both sides first train
``--calibration-steps`` steps together with one thread each (``METHOD/calibration/``), which measures each side's
seconds per optimizer step on this machine; each side then trains the steps that fit in ``S`` seconds at its own
rate, its learning-rate schedule over those steps, both again together with one thread each:

    python -m bench.bench_vs_speculators --method eagle3 --seconds 1800 --seed 0 --name eagle3_1800s_s0

Writes ``OUT/METHOD/vs_speculators.md`` (and prints it), with the ratios ours / speculators', and
``vs_speculators.json`` (the run's settings, steps, seconds per step, tau and tokens/s of each side). ``--table NAME
...`` trains nothing: it puts those runs under ``--out`` in one table, a row each, and says on how many the goals are
met (tau ours / speculators >= 1.2x at equal wall clock, >= 1.0x at equal steps; training tokens/s >= 1.5x where both
sides ran the same optimizer), written to ``OUT/table.md``:

    python -m bench.bench_vs_speculators --table eagle3_300s_s0 eagle3_300s_s1 eagle3_300s_s2
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import PROMPT_CHARS, ROOT, run_dirs, training_prompts, wait, write_heldout_prompts
from bench.common import run as start

SPECULATORS_PYTHON = ROOT / ".cache" / "clients" / "speculators" / "bin" / "python"
ROWS, SEQ = 4, 256  # the quickstart recipes' batch: 4 rows of 256 tokens (257 with the last label)
TARGET_LAYERS = [1, 2, 3]  # HF hidden_states indices, the recipes' layers
MASK_TOKEN = 2  # the recipes' mask / placeholder token (<|system|>, absent from the corpus)
DRAFT_VOCAB = 1024
SPECULATORS_LOSS = {"kl": "kl_div"}  # our model.loss -> speculators' --loss-fn, where the names differ
METHODS = {
    # recipe, our export format, drafts per round at eval, our extra fit arguments
    "eagle3": (
        "recipes/quickstart/eagle3.yaml",
        "eagle3-speculators",
        4,
        ["--model.init_args.fc_norm", "true", "--model.init_args.norm_output", "true"]
        + ["--model.init_args.norm_before_residual", "true"],
    ),
    "peagle": ("recipes/quickstart/peagle.yaml", "peagle-speculators", 4, []),
    "dflash": ("recipes/quickstart/dflash.yaml", "dflash", 15, ["--model.init_args.target_layers", "[1,2,3]"]),
    "dflash2": ("recipes/quickstart/dflash2.yaml", "dflash2", 15, ["--model.init_args.target_layers", "[1,2,3]"]),
    "xpress": ("recipes/quickstart/xpress.yaml", "xpress", 15, ["--model.init_args.target_layers", "[1,2,3]"]),
    "dspark": ("recipes/quickstart/dspark.yaml", "dspark", 15, ["--model.init_args.target_layers", "[1,2,3]"]),
}
# speculators' --loss-fn where neither --loss nor --speculators-loss is given and its own default is not our recipe's
# loss: our DFlash2 and XPress recipes train the cross entropy of the target's argmax (labels argmax, loss kl), which
# is its ce (its defaults: kl_div for dflash2, {"ce": 0.1, "tv": 0.9} for xpress)
SPECULATORS_DEFAULT_LOSS = {"dflash2": "ce", "xpress": "ce"}
# what the refiners' recipes set that speculators' defaults do not: the refiner's (or DSpark's Markov head's) rank and
# the slot weights' gamma (ours 7 at 16 slots, its 4); DSpark's anchor slot drafts nothing, as in every DFlash drafter
# our engine decodes (speculators' dspark default, sample_from_anchor, drafts the first token from the anchor slot)
SPECULATORS_REFINER_ARGS = {
    "dflash2": ["--selector-rank", "64", "--dflash-decay-gamma", "7"],
    "xpress": ["--xpress-rank", "64", "--dflash-decay-gamma", "7"],
    "dspark": ["--markov-rank", "64", "--dflash-decay-gamma", "7", "--no-sample-from-anchor"],
}


# ---- the project's side ---------------------------------------------------------------------------------------------
def run(cmd: list[str], log: Path, python: Path | None = None) -> subprocess.Popen:
    """Starts ``cmd`` (a ``draftsmith`` subcommand, or a module under ``python``) with one thread, output in ``log``."""
    return start(cmd, log, threads=1, python=python)


def completions(art: Path, data: Path) -> Path:
    """The target's greedy completions of compare's training prompts (made once)."""
    done = data / "train_completions.jsonl"
    if done.is_file():
        return done
    prompts, partial = data / "train_prompts.jsonl", data / "train_completions.partial.jsonl"
    data.mkdir(parents=True, exist_ok=True)  # a new --out
    if not prompts.is_file():
        training_prompts(art / "corpus" / "train.jsonl", prompts, 1, 0)
    generate = [
        "draftsmith", "generate", "--target", str(art / "tiny_target"), "--input_file", str(prompts),
        "--output_file", str(partial), "--prompt_field", "prompt", "--max_new_tokens", "160", "--batch_size", "32",
        "--device", "cpu", "--progress", "false",
    ]  # fmt: skip
    wait(run(generate, data / "generate.log"), data / "generate.log")
    partial.rename(done)
    return done


def save_rows(art: Path, train_file: Path, steps: int, out: Path, seed: int = 0) -> None:
    """The rows our data module serves for ``steps`` steps ([steps, 4, 257] token ids, [steps, 4, 257] trained flag
    of each token as a label) and the token counts of the trained tokens (speculators' ``token_freq.pt``)."""
    import torch

    from trainer.data.text import TextDataModule

    data = TextDataModule(
        tokenizer=str(art / "corpus" / "tokenizer"), train_files=[str(train_file)],
        val_files=[str(art / "corpus" / "heldout.jsonl")], seq_len=SEQ, batch_size=ROWS, seed=seed,
    )  # fmt: skip
    data.setup("fit")
    tokens, trained = [], []
    while len(tokens) < steps:  # epochs in order, as the trainer reads them
        for batch in data.train_dataloader():
            labels = batch["labels"]  # [B, S]
            last = labels[:, -1:].clamp(min=0)  # [B, 1]
            tokens.append(torch.cat([batch["input_ids"], last], dim=1))  # [B, S + 1]
            first = torch.zeros(labels.shape[0], 1, dtype=torch.bool)
            trained.append(torch.cat([first, batch["loss_mask"].bool()], dim=1))  # [B, S + 1]: token t is a label
            if len(tokens) == steps:
                break
    ids, mask = torch.stack(tokens), torch.stack(trained)  # [steps, B, S + 1]
    counts = torch.bincount(ids[mask], minlength=data.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": ids, "loss_mask": mask}, out / "rows.pt")
    torch.save({int(i): int(c) for i, c in enumerate(counts.tolist()) if c}, out / "token_freq.pt")


def fit_cmd(method: str, run_dir: Path, train_file: Path, steps: int, target: Path, more: str = "") -> list[str]:
    recipe, _, _, extra = METHODS[method]
    return [
        "draftsmith", "fit", "--config", recipe, "--trainer.max_steps", str(steps), *run_dirs(run_dir),
        "--trainer.limit_val_batches", "0",
        "--trainer.log_every_n_steps", str(max(1, min(10, steps // 3))), "--model.init_args.target", str(target),
        "--data.init_args.train_files", json.dumps([str(train_file)]), *extra, *shlex.split(more),
    ]  # fmt: skip


def speculators_cmd(
    method: str,
    art: Path,
    data: Path,
    out: Path,
    steps: int,
    lr: float,
    warmup: int,
    optimizer: str,
    loss: str,
    layers: int | None,
) -> list[str]:
    return [
        "-m", "bench.bench_vs_speculators", "--side", "speculators", "--method", method, "--target",
        str(art / "tiny_target"), "--rows", str(data), "--out", str(out), "--steps", str(steps), "--lr", str(lr),
        "--warmup", str(warmup), "--speculators-optimizer", optimizer, "--speculators-loss", loss,
        *([] if layers is None else ["--draft-layers", str(layers)]),
    ]  # fmt: skip


def recipe_optim(method: str) -> dict:
    """The ``model.init_args.optim`` of the method's quickstart recipe."""
    import yaml

    return yaml.safe_load((ROOT / METHODS[method][0]).read_text())["model"]["init_args"]["optim"]


def recipe_optimizer(method: str, fit_args: str = "") -> str:
    """Our side's optimizer: the recipe's ``optim.name`` (draftsmith's default ``adamw`` where it names none), or the
    one ``--fit-args`` sets."""
    words = shlex.split(fit_args)
    for flag in ("--model.init_args.optim.name", "--model.optim.name"):
        for i, word in enumerate(words):
            if word == flag and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
    return str(recipe_optim(method).get("name", "adamw"))


def our_tokens_per_s(run_dir: Path) -> float:
    from trainer.compare.fit_logs import read_scalars

    values = read_scalars(run_dir / "tensorboard", ("train/tokens_per_s",)).get("train/tokens_per_s", {})
    if not values:
        sys.exit(f"{run_dir}: no train/tokens_per_s logged")
    return statistics.median(v for s, v in values.items() if s > 0)


def evaluate(target: Path, drafter: Path, prompts: Path, k: int, new_tokens: int, out: Path) -> dict:
    if not (out / "report.json").is_file():
        cmd = [
            "draftsmith", "eval", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
            "--k", str(k), "--max_new_tokens", str(new_tokens), "--temperature", "0", "--output_dir", str(out),
        ]  # fmt: skip
        wait(run(cmd, out.with_suffix(".log")), out.with_suffix(".log"))
    return json.loads((out / "report.json").read_text())["greedy"][0]


def equal_wall_clock_steps(seconds: float, step_seconds: dict[str, float]) -> dict[str, int]:
    """Each side's optimizer steps in ``seconds`` of training at its measured seconds per step (at least 1)."""
    if seconds <= 0 or any(s <= 0 for s in step_seconds.values()):
        raise ValueError(f"a budget of {seconds} s and step times {step_seconds} give no steps")
    return {side: max(1, int(seconds // s)) for side, s in step_seconds.items()}


def budget_line(args: argparse.Namespace, steps: dict[str, int], per_step: dict[str, float]) -> str:
    """The first words of the report: the budget both sides trained under."""
    if args.seconds is None:
        return f"{args.method}: {args.steps} optimizer steps of 4 x 256 tokens each, side by side with one thread each"
    measured = ", ".join(f"{side} {s:.2f} s" for side, s in per_step.items())
    return (
        f"{args.method}: equal wall clock, {args.seconds:.0f} s of training each (seconds per step measured beforehand "
        f"over {args.calibration_steps} steps, both sides together with one thread each: {measured}), so ours "
        f"{steps['ours']} and speculators {steps['speculators']} optimizer steps of 4 x 256 tokens, each side's "
        "schedule over its own steps, side by side with one thread each"
    )


def calibrate(
    args: argparse.Namespace,
    art: Path,
    train_file: Path,
    method_dir: Path,
    target: Path,
    lr: float,
    warmup: int,
    fit_args: str,
) -> dict[str, float]:
    """Each side's seconds per optimizer step on this machine, measured over ``--calibration-steps`` steps with both
    sides running together with one thread each, as they will train (made once: ``calibration/step_seconds.json``)."""
    folder = method_dir / "calibration"
    done = folder / "step_seconds.json"
    if done.is_file():
        return json.loads(done.read_text())
    rows = folder / "rows"
    if not (rows / "rows.pt").is_file():
        save_rows(art, train_file, args.calibration_steps, rows, args.seed)
    both = {"ours": args.calibration_steps, "speculators": args.calibration_steps}
    train_both(args, art, rows, folder, train_file, target, lr, warmup, fit_args, both)
    tokens = ROWS * SEQ
    per_step = {
        "ours": tokens / our_tokens_per_s(folder / "ours"),
        "speculators": statistics.median(
            json.loads((folder / "speculators" / "throughput.json").read_text())["step_seconds"]
        ),
    }
    done.write_text(json.dumps(per_step))
    return per_step


def train_both(
    args: argparse.Namespace,
    art: Path,
    rows: Path,
    method_dir: Path,
    train_file: Path,
    target: Path,
    lr: float,
    warmup: int,
    fit_args: str,
    steps: dict[str, int],
) -> dict[str, int]:
    """Both sides trained together, one thread each, for their ``steps``: ours under ``method_dir/ours``,
    speculators' under ``method_dir/speculators``; returns each side's wall clock in seconds (kept across reruns)."""
    ours_run, theirs_dir = method_dir / "ours", method_dir / "speculators"
    procs, started, seconds_file = {}, time.perf_counter(), method_dir / "fit_seconds.json"
    if not (ours_run / "checkpoints" / "last.ckpt").is_file():
        cmd = fit_cmd(args.method, ours_run, train_file, steps["ours"], target, fit_args)
        procs["ours"] = run(cmd, method_dir / "fit_ours.log")
    if not (theirs_dir / "drafter" / "config.json").is_file():
        optimizer, loss = args.speculators_optimizer, args.speculators_loss
        layers = args.draft_layers
        cmd = speculators_cmd(
            args.method, art, rows, theirs_dir, steps["speculators"], lr, warmup, optimizer, loss, layers
        )
        cmd += ["--seed", str(args.seed)]
        procs["speculators"] = run(cmd, method_dir / "fit_speculators.log", python=SPECULATORS_PYTHON)
    seconds = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
    try:
        for name, proc in procs.items():
            wait(proc, method_dir / f"fit_{name}.log")
            seconds[name] = round(time.perf_counter() - started)  # both started together
    finally:  # one side failed: the other stops too, rather than train on alone, unmeasured
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
    seconds_file.parent.mkdir(parents=True, exist_ok=True)
    seconds_file.write_text(json.dumps(seconds))
    return seconds


def main_project(args: argparse.Namespace) -> int:
    art, out = Path(args.artifacts), Path(args.out)
    target = art / "tiny_target"
    if not (target / "config.json").is_file():
        sys.exit(f"{target} not found: run `make demo` first")
    if not SPECULATORS_PYTHON.is_file():
        sys.exit(f"{SPECULATORS_PYTHON} not found: run `DRAFTSMITH_TEST_CLIENTS=1 pytest tests/clients` once")
    # the training text: the target's completions of short prompts, or the corpus' own (long) documents
    train_file = completions(art, out / "data") if args.train_text == "completions" else art / "corpus" / "train.jsonl"
    method_dir = out / (args.name or args.method)
    ours_run, theirs_dir = method_dir / "ours", method_dir / "speculators"
    optim = recipe_optim(args.method)
    lr, warmup = float(optim["lr"]), int(optim.get("warmup_steps", 0))  # the recipe's peak and warm-up, given to both
    seeds = f"--seed_everything {args.seed} --model.init_args.seed {args.seed} --data.init_args.seed {args.seed}"
    fit_args = f"{args.fit_args} {seeds}".strip()
    if args.loss:
        fit_args = f"{fit_args} --model.init_args.loss {args.loss}"
        if args.loss != "kl" and args.method in ("eagle3", "peagle"):  # the recipes' argmax mix is the KL's alone
            fit_args = f"{fit_args} --model.init_args.argmax_weight 0"
        args.speculators_loss = SPECULATORS_LOSS.get(args.loss, args.loss)
    elif not args.speculators_loss:
        args.speculators_loss = SPECULATORS_DEFAULT_LOSS.get(args.method, "")
    if args.draft_layers is not None:  # both drafters this many decoder layers deep
        fit_args = f"{fit_args} --model.init_args.num_layers {args.draft_layers}".strip()
    if args.peak_lr is not None:  # both sides at another peak learning rate than the recipe's
        lr = args.peak_lr
        fit_args = f"{fit_args} --model.init_args.optim.lr {lr}".strip()
    if args.seconds is not None:  # equal wall-clock: each side the steps its measured step time fits in the budget
        per_step = calibrate(args, art, train_file, method_dir, target, lr, warmup, fit_args)
        steps = equal_wall_clock_steps(args.seconds, per_step)
    else:
        per_step, steps = {}, {"ours": args.steps, "speculators": args.steps}
    rows = method_dir / "rows"
    if not (rows / "rows.pt").is_file():  # in the order our data module seeded so serves
        save_rows(art, train_file, max(steps.values()), rows, args.seed)
    seconds = train_both(args, art, rows, method_dir, train_file, target, lr, warmup, fit_args, steps)

    _, fmt, k, _ = METHODS[args.method]
    fmt = args.export_format or fmt
    export = method_dir / "ours_export"
    if not (export / "config.json").is_file():
        cmd = [
            "draftsmith",
            "export",
            "--ckpt_path",
            str(ours_run / "checkpoints" / "last.ckpt"),
            "--output_dir",
            str(export),
        ]
        wait(run([*cmd, "--format", fmt], method_dir / "export.log"), method_dir / "export.log")
    heldout = write_heldout_prompts(art / "corpus", out / "heldout_prompts.jsonl", args.prompts)
    ours = evaluate(target, export, heldout, k, args.max_new_tokens, method_dir / "eval_ours")
    theirs = evaluate(target, theirs_dir / "drafter", heldout, k, args.max_new_tokens, method_dir / "eval_speculators")
    ours_tps = our_tokens_per_s(ours_run)
    theirs_tps = json.loads((theirs_dir / "throughput.json").read_text())["tokens_per_s"]

    def row(label: str, n_steps: int, greedy: dict, tps: float) -> str:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in greedy["acceptance_per_position"])
        return f"| {label} | {n_steps} | {greedy['tau']:.3f} | {acc} | {tps:.0f} |"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}x"

    acc_ratio = ", ".join(
        ratio(a, b) for a, b in zip(ours["acceptance_per_position"], theirs["acceptance_per_position"], strict=False)
    )
    table = "\n".join(
        [
            budget_line(args, steps, per_step)
            + f" (wall clock: ours {seconds.get('ours', '?')} s, speculators {seconds.get('speculators', '?')} s); "
            f"greedy, K = {k}, {args.prompts} held-out prompts of {PROMPT_CHARS} characters, {args.max_new_tokens} "
            "new tokens each."
            + f" Seed {args.seed}, loss {args.loss or 'each side default'}."
            + (" Trained on the corpus' training documents." if args.train_text == "corpus" else "")
            + (f" Ours with `{args.fit_args}`." if args.fit_args else "")
            + (f" Both at peak learning rate {args.peak_lr}." if args.peak_lr is not None else "")
            + (f" Both drafters {args.draft_layers} layers deep." if args.draft_layers is not None else "")
            + f" speculators with its {args.speculators_optimizer} optimizer"
            + (f" and `--loss-fn {args.speculators_loss}`." if args.speculators_loss else "."),
            "",
            "| trainer | optimizer steps | tau | acceptance per draft position | training tokens/s |",
            "|---|---|---|---|---|",
            row("draftsmith", steps["ours"], ours, ours_tps),
            row("speculators 0.9", steps["speculators"], theirs, theirs_tps),
            f"| ours / speculators | {ratio(steps['ours'], steps['speculators'])} | {ours['tau'] / theirs['tau']:.2f}x "
            f"| {acc_ratio} | {ours_tps / theirs_tps:.2f}x |",
        ]
    )
    (method_dir / "vs_speculators.md").write_text(table + "\n")
    result = {
        "run": {
            "method": args.method,
            "seed": args.seed,
            "seconds": args.seconds,
            "steps": None if args.seconds is not None else args.steps,
            "our_optimizer": recipe_optimizer(args.method, args.fit_args),
            "speculators_optimizer": args.speculators_optimizer,
            "loss": args.loss,
            "speculators_loss": args.speculators_loss,
            "fit_args": args.fit_args,
        },
        "steps": steps,
        "step_seconds": per_step,
        "seconds": seconds,
        "tau": {"ours": ours["tau"], "speculators": theirs["tau"]},
        "tokens_per_s": {"ours": ours_tps, "speculators": theirs_tps},
    }
    (method_dir / "vs_speculators.json").write_text(json.dumps(result, indent=1))
    print(table)
    return 0


GOALS = {"seconds": 1.2, "steps": 1.0}  # issue 55's tau goals: ours / speculators at equal wall clock, at equal steps
TOKENS_GOAL = 1.5  # training tokens/s, ours / speculators, with the same optimizer on both sides


def seeds_table(runs: dict[str, dict]) -> str:
    """One row per run (its folder name: its ``vs_speculators.json``), then how many of them meet the goals: tau
    ours / speculators at least ``GOALS`` at their budget (equal wall clock or equal steps), training tokens/s at
    least ``TOKENS_GOAL`` where both sides ran the same optimizer."""
    rows = [
        "| run | method | seed | budget | optimizers, ours / speculators | optimizer steps, ours / speculators "
        "| fit wall clock, ours / speculators | tau, ours / speculators | tau ratio | training tokens/s, ours / "
        "speculators | tokens/s ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tau_ratios: dict[str, list[float]] = {"seconds": [], "steps": []}
    same_optimizer: list[float] = []
    for name, result in runs.items():
        run, tau, tps, steps = result["run"], result["tau"], result["tokens_per_s"], result["steps"]
        clock = result["seconds"]  # each side's fit, start to end
        budget = "seconds" if run["seconds"] is not None else "steps"
        said = f"{run['seconds']:.0f} s each" if budget == "seconds" else f"{run['steps']} steps"
        tau_ratio, tps_ratio = tau["ours"] / tau["speculators"], tps["ours"] / tps["speculators"]
        tau_ratios[budget].append(tau_ratio)
        if run["our_optimizer"] == run["speculators_optimizer"]:
            same_optimizer.append(tps_ratio)
        rows.append(
            f"| {name} | {run['method']} | {run['seed']} | {said} | {run['our_optimizer']} / "
            f"{run['speculators_optimizer']} | {steps['ours']} / {steps['speculators']} "
            f"| {clock.get('ours', '?')} s / {clock.get('speculators', '?')} s "
            f"| {tau['ours']:.3f} / {tau['speculators']:.3f} | {tau_ratio:.2f}x "
            f"| {tps['ours']:.0f} / {tps['speculators']:.0f} | {tps_ratio:.2f}x |"
        )
    lines = ["\n".join(rows), ""]
    for budget, ratios in tau_ratios.items():
        if ratios:
            met = sum(r >= GOALS[budget] for r in ratios)
            where = "equal wall clock" if budget == "seconds" else "equal steps"
            lines.append(
                f"- tau at {where}: {min(ratios):.2f}x to {max(ratios):.2f}x (mean {statistics.mean(ratios):.2f}x); "
                f"the goal, >= {GOALS[budget]:.1f}x, met on {met} of {len(ratios)} runs."
            )
    if same_optimizer:
        met = sum(r >= TOKENS_GOAL for r in same_optimizer)
        lines.append(
            f"- training tokens/s with the same optimizer on both sides: {min(same_optimizer):.2f}x to "
            f"{max(same_optimizer):.2f}x; the goal, >= {TOKENS_GOAL:.1f}x, met on {met} of {len(same_optimizer)} runs."
        )
    else:
        lines.append("- training tokens/s: no run has the same optimizer on both sides; the goal is not judged here.")
    return "\n".join(lines)


def main_table(args: argparse.Namespace) -> int:
    """``--table NAME...``: the runs' table (:func:`seeds_table`), printed and written to ``OUT/table.md``."""
    runs = {}
    for name in args.table:
        path = Path(args.out) / name / "vs_speculators.json"
        if not path.is_file():
            sys.exit(f"{path} not found: run the bench with --name {name} first")
        result = json.loads(path.read_text())
        if "run" not in result:
            sys.exit(f"{path} was written before the runs' settings were saved: rerun its bench command (every done "
                     "step is skipped) to write it again")  # fmt: skip
        runs[name] = result
    table = seeds_table(runs)
    (Path(args.out) / "table.md").write_text(table + "\n")
    print(table)
    return 0


# ---- speculators' side (runs in its own virtualenv) -----------------------------------------------------------------
def main_speculators(args: argparse.Namespace) -> int:
    """speculators' own training code on our rows: its ``TrainConfig`` defaults with what must match overridden."""
    import speculators.train.distributed as distributed
    import torch
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config import TrainConfig
    from speculators.train.data import CollateFn
    from speculators.train.trainer import Trainer, TrainerConfig
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    distributed._local_rank = "cpu"  # its single-process path moves the model to `local_rank` (a CUDA index)
    torch.accelerator.synchronize = lambda *a, **k: None  # its step timer synchronizes an accelerator; none here
    rows = torch.load(Path(args.rows) / "rows.pt")
    ids, trained = rows["input_ids"][: args.steps], rows["loss_mask"][: args.steps]  # [steps, B, S + 1]
    shift = args.method in ("eagle3", "peagle")
    per_step = ids.shape[1] * (ids.shape[2] - 1 if shift else ids.shape[2])
    argv = [
        "--speculator-type", args.method, "--verifier-name-or-path", args.target, "--data-path", args.rows,
        "--target-layer-ids", *map(str, TARGET_LAYERS),
        "--total-seq-len", str(per_step), "--hidden-states-dtype", "float32", "--loss-implementation", "eager",
        "--lr", str(args.lr), "--muon-lr", str(args.lr), "--scheduler-type", "cosine",
        "--scheduler-warmup-steps", str(args.warmup), "--max-steps", str(args.steps), "--epochs", "1",
        "--save-path", str(Path(args.out) / "checkpoints"), "--num-workers", "0", "--optimizer",
        args.speculators_optimizer,
        "--draft-attn-impl", "sdpa",  # its default, simple_flex_attention, has no backward on CPU
    ]  # fmt: skip
    if args.speculators_loss:
        argv += ["--loss-fn", args.speculators_loss]
    argv += ["--seed", str(args.seed)]
    if shift:  # EAGLE-3 and P-EAGLE draft over ours' reduced vocabulary; DFlash over the target's (both trainers)
        argv += ["--draft-vocab-size", str(DRAFT_VOCAB)]
    if args.draft_layers is not None and shift:
        argv += ["--num-layers", str(args.draft_layers)]
    if args.method == "eagle3":  # EAGLE-3.1 as ours runs it: fc_norm (not norm_before_fc), norm_output
        argv += ["--ttt-steps", "3", "--fc-norm", "--no-norm-before-fc", "--norm-output", "--norm-before-residual"]
    elif args.method == "peagle":
        argv += ["--num-depths", "4", "--mask-token-id", str(MASK_TOKEN), "--draft-arch", "llama"]
        argv += ["--no-norm-before-residual"]
    else:
        argv += ["--num-layers", str(args.draft_layers or 2), "--block-size", "16", "--mask-token-id", str(MASK_TOKEN)]
        argv += ["--max-anchors", str(32 * ids.shape[1])]
        argv += SPECULATORS_REFINER_ARGS.get(args.method, [])
    cfg = TrainConfig.resolve(argv)
    flat = argparse.Namespace(**cfg.flatten())
    set_seed(flat.seed, flat.deterministic_cuda)
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(flat)
    model_class = SpeculatorModel.registry[flat.speculator_type]
    draft = build_draft_model(flat, model_class, t2d, d2t, draft_vocab_size)
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(flat))

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    captured: dict[str, torch.Tensor] = {}
    target.model.norm.register_forward_pre_hook(lambda _m, inp: captured.__setitem__("last", inp[0]))
    hidden = int(target.config.hidden_size)
    collate = CollateFn(
        per_step, hidden, len(TARGET_LAYERS), torch.float32, shift_batch if shift else None
    )  # speculators' own packing

    def step_batch(items: list[int]) -> dict:
        (step,) = items
        with torch.no_grad():
            out = target.model(ids[step], output_hidden_states=True)  # [B, S + 1, ...]: no lm_head (its loss has one)
        aux = torch.cat([out.hidden_states[i] for i in TARGET_LAYERS], dim=-1)  # [B, S + 1, 3 H]
        samples = []
        for b in range(ids.shape[1]):
            n = ids.shape[2]
            samples.append(
                {
                    "hidden_states": aux[b],  # [S + 1, 3 H]
                    "input_ids": ids[step, b],  # [S + 1]
                    "verifier_last_hidden_states": captured["last"][b],  # [S + 1, H]: pre-norm, as vLLM gives it
                    "loss_mask": trained[step, b],  # [S + 1]
                    "lengths": torch.tensor([n]),
                    "position_ids": torch.arange(n),
                }
            )
        return collate(samples)

    loader = torch.utils.data.DataLoader(list(range(ids.shape[0])), batch_size=1, collate_fn=step_batch)
    trainer_config = TrainerConfig(
        num_epochs=flat.epochs, save_path=flat.save_path, lr=flat.lr, resume_from_checkpoint=False,
        train_call_kwargs=train_kwargs, optimizer=flat.optimizer, weight_decay=flat.weight_decay,
        muon_lr=flat.muon_lr, muon_momentum=flat.muon_momentum, muon_weight_decay=flat.muon_weight_decay,
        muon_ns_steps=flat.muon_ns_steps, muon_adjust_lr_fn=flat.muon_adjust_lr_fn,
        scheduler_type=flat.scheduler_type, scheduler_warmup_steps=flat.scheduler_warmup_steps,
        scheduler_warmup_ratio=flat.scheduler_warmup_ratio, scheduler_total_steps=flat.scheduler_total_steps,
        scheduler_num_cosine_cycles=flat.scheduler_num_cosine_cycles, checkpoint_freq=flat.checkpoint_freq,
        save_best=flat.save_best, hidden_states_dtype=torch.float32, log_freq=10, max_steps=flat.max_steps,
    )  # fmt: skip
    trainer = Trainer(draft, trainer_config, loader, None)
    stamps: list[float] = []
    step_schedulers = trainer._schedulers_step

    def timed() -> None:
        step_schedulers()
        stamps.append(time.perf_counter())

    trainer._schedulers_step = timed
    trainer.run_training()
    draft.save_pretrained(str(Path(args.out) / "drafter"))  # float32 (its checkpointer writes bfloat16)
    intervals = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    result = {
        "tokens_per_s": ids.shape[1] * (ids.shape[2] - 1) / statistics.median(intervals),
        "tokens_per_s_mean": ids.shape[1] * (ids.shape[2] - 1) / statistics.mean(intervals),
        "step_seconds": intervals,
        "steps": len(stamps),
        "optimizer": flat.optimizer,
        "train_call_kwargs": {k: str(v) for k, v in train_kwargs.items()},
        "config": {k: v for k, v in vars(flat).items() if isinstance(v, (int, float, str, bool, list, type(None)))},
    }
    (Path(args.out) / "throughput.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "steps", "optimizer")}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=sorted(METHODS), help="the method trained (required but with --table)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of each trainer (equal steps)")
    parser.add_argument(
        "--seconds", type=float,
        help="equal wall clock instead of equal steps: each side trains the steps its measured seconds per step fit "
        "in this many seconds, its schedule over them",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-steps", type=int, default=20,
        help="with --seconds: steps of both sides run together beforehand to measure each side's seconds per step",
    )  # fmt: skip
    parser.add_argument("--artifacts", default="artifacts", help="where `make demo` left the corpus and the target")
    parser.add_argument("--out", default="artifacts/vs_speculators", help="output folder (done steps are skipped)")
    parser.add_argument("--prompts", type=int, default=15, help="held-out prompts in the evaluation")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="output tokens per evaluation prompt")
    parser.add_argument("--fit-args", default="", help="more `draftsmith fit` arguments for our side, one string")
    parser.add_argument(
        "--peak-lr", type=float, help="both sides' peak learning rate (default: the recipe's, given to both)"
    )
    parser.add_argument(
        "--draft-layers", type=int,
        help="both drafters' decoder layers (default: each side's recipe; speculators' is 1 for eagle3 and peagle)",
    )  # fmt: skip
    parser.add_argument("--export-format", help="our export format (default: the method's; dspark for DSpark heads)")
    parser.add_argument(
        "--speculators-optimizer", choices=["muon", "adamw"], default="muon",
        help="speculators' optimizer (muon, its default; adamw, the optimizer of our recipes)",
    )  # fmt: skip
    parser.add_argument(
        "--speculators-loss", default="",
        help="speculators' --loss-fn (its default: kl_div for eagle3 and peagle, ce for dflash); ce takes the target's "
        "argmax over the draft vocabulary, as our `labels: argmax`",
    )  # fmt: skip
    parser.add_argument(
        "--loss", choices=["kl", "tv", "nla", "lk_hybrid"],
        help="both sides' loss (our model.loss, speculators' --loss-fn); default: each side's recipe default",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="both sides' seed")
    parser.add_argument("--name", help="the run's folder under --out (default: the method)")
    parser.add_argument(
        "--train-text", choices=["completions", "corpus"], default="completions",
        help="both sides' training text: the target's completions of short prompts (default) or the corpus' training "
        "documents (artifacts/corpus/train.jsonl, long), packed into the same rows",
    )  # fmt: skip
    parser.add_argument(
        "--table", nargs="+", metavar="NAME",
        help="no training: the table of these runs under --out (their vs_speculators.json), with the goals met, "
        "written to OUT/table.md",
    )  # fmt: skip
    parser.add_argument("--side", choices=["project", "speculators"], default="project", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        return main_table(args)
    if args.method is None:
        parser.error("--method is required")
    return main_speculators(args) if args.side == "speculators" else main_project(args)


if __name__ == "__main__":
    sys.exit(main())
