"""``draftsmith demo``: the whole loop on one CPU in minutes, with nothing downloaded.

1. prepares the bundled corpus (the standard library's source) and trains its byte-level BPE tokenizer;
2. pretrains the tiny target (recipes/quickstart/tiny_target.yaml);
3. distils a smaller student from it (recipes/quickstart/kd.yaml);
4. evaluates both on held-out text (loss against a unigram baseline) and measures the student as a drafter with
   lossless speculative decoding (``draftsmith eval``), beside prompt lookup.

Every stage reuses its output when it exists, so a rerun only repeats what is missing (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trainer.cli import DraftsmithCLI
from trainer.data.corpus import prepare_corpus
from trainer.data.text import TextDataModule
from trainer.heldout import heldout_loss, unigram_baseline, unigram_counts

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"
ARTIFACTS = Path("artifacts")


def _fit(recipe: str, max_steps: int, summary_file: Path, checkpoints: Path) -> dict:
    """Runs ``draftsmith fit --config RECIPE`` in this process and keeps the final metrics beside its outputs; a stage
    interrupted earlier resumes from its ``last.ckpt`` (a fresh run into a folder of checkpoints is refused)."""
    start = time.perf_counter()
    args = ["fit", "--config", str(RECIPES / recipe), "--trainer.max_steps", str(max_steps)]
    if (checkpoints / "last.ckpt").exists():
        args += ["--ckpt_path", "last"]
    cli = DraftsmithCLI(args=args)
    seconds = time.perf_counter() - start
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    tokens = cli.trainer.global_step * cli.datamodule.batch_size * cli.datamodule.seq_len
    summary = {
        "seconds": seconds,
        "steps": cli.trainer.global_step,
        "tokens_per_s": tokens / seconds,
        "metrics": metrics,
    }
    summary_file.write_text(json.dumps(summary, indent=2))
    return summary


def _heldout_prompts(heldout_file: str, out: Path, n: int, chars: int) -> Path:
    """The first characters of held-out files, one prompt per line, for ``draftsmith eval``."""
    lines = Path(heldout_file).read_text().splitlines()
    prompts = [json.loads(line)["text"][:chars] for line in lines[:n]]
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftsmith demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-steps", type=int, default=400, help="optimizer steps of the tiny target")
    parser.add_argument("--kd-steps", type=int, default=150, help="optimizer steps of the KD student")
    parser.add_argument("--prompts", type=int, default=10, help="held-out prompts for the speculative evaluation")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="output tokens per prompt in the evaluation")
    parser.add_argument("--fresh", action="store_true", help="delete the demo's outputs and start over")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.fresh:
        for name in ("tiny_target", "kd_student", "runs", "eval"):
            shutil.rmtree(ARTIFACTS / name, ignore_errors=True)
    ARTIFACTS.mkdir(exist_ok=True)
    timings: dict[str, float] = {}

    start = time.perf_counter()
    corpus = prepare_corpus(str(ARTIFACTS / "corpus"), vocab_size=8192, seed=0)
    timings["prepare"] = time.perf_counter() - start

    target_dir, student_dir = ARTIFACTS / "tiny_target", ARTIFACTS / "kd_student"
    target_summary_file, kd_summary_file = ARTIFACTS / "tiny_target.summary.json", ARTIFACTS / "kd_student.summary.json"
    if not (target_dir / "config.json").is_file():
        _fit(
            "tiny_target.yaml",
            args.target_steps,
            target_summary_file,
            ARTIFACTS / "runs" / "tiny_target" / "checkpoints",
        )
    if not (student_dir / "config.json").is_file():
        _fit("kd.yaml", args.kd_steps, kd_summary_file, ARTIFACTS / "runs" / "kd" / "checkpoints")
    target_summary = json.loads(target_summary_file.read_text())
    kd_summary = json.loads(kd_summary_file.read_text())
    timings["target"], timings["kd"] = target_summary["seconds"], kd_summary["seconds"]

    start = time.perf_counter()
    data = TextDataModule(
        tokenizer=corpus.tokenizer_dir,
        train_files=[corpus.train_file],
        val_files=[corpus.heldout_file],
        seq_len=256,
        batch_size=8,
    )
    data.setup("fit")
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    baseline = unigram_baseline(
        unigram_counts(data.train_dataloader(), target.config.vocab_size), data.val_dataloader()
    )
    target_loss = heldout_loss(target, data.val_dataloader())
    student_loss = heldout_loss(student, data.val_dataloader())

    from trainer.decoding.evaluate import main as eval_main

    prompts = _heldout_prompts(corpus.heldout_file, ARTIFACTS / "heldout_prompts.jsonl", args.prompts, 160)
    reports = {}
    for name, drafter in (("kd_student", str(student_dir)), ("prompt_lookup", "prompt-lookup")):
        out = ARTIFACTS / "eval" / name
        common = ["--target", str(target_dir), "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens)]
        status = eval_main([*common, "--drafter", drafter, "--k", "4", "--temperature", "1.0", "--out", str(out)])
        if status != 0:
            raise SystemExit(f"draftsmith eval failed for {name} (exit {status})")
        reports[name] = json.loads((out / "report.json").read_text())
    timings["evaluate"] = time.perf_counter() - start

    kd, lookup = reports["kd_student"], reports["prompt_lookup"]
    print(
        f"""
draftsmith demo: done in {sum(timings.values()):.0f} s of work (prepare {timings["prepare"]:.0f} s, target \
{timings["target"]:.0f} s, KD {timings["kd"]:.0f} s, evaluation {timings["evaluate"]:.0f} s; reused stages count \
their first run)

held-out loss (nats/token)   unigram baseline {baseline:.3f}
                             tiny target      {target_loss:.3f}  ({target.num_parameters() / 1e6:.1f} M parameters)
                             KD student       {student_loss:.3f}  ({student.num_parameters() / 1e6:.1f} M parameters)
training throughput          target {target_summary["tokens_per_s"]:,.0f} tokens/s, KD \
{kd_summary["tokens_per_s"]:,.0f} tokens/s (trained tokens over the whole fit, start-up included)
speculative decoding, K=4    KD student    tau {kd["greedy"][0]["tau"]:.2f} greedy, \
{kd["sampling"][0]["tau"]:.2f} sampling (T=1)
                             prompt lookup tau {lookup["greedy"][0]["tau"]:.2f} greedy
                             loops: {100 * kd["loops"]["share"]:.0f}% of the target's greedy output positions, \
in {kd["loops"]["looped_prompts"]} of {args.prompts} prompts

outputs     corpus and tokenizer  {corpus.out_dir}
            tiny target (HF)      {target_dir}
            KD student (HF)       {student_dir}
            checkpoints           {ARTIFACTS / "runs" / "*" / "checkpoints"}
            TensorBoard logs      tensorboard --logdir {ARTIFACTS / "runs"}
            evaluation reports    {ARTIFACTS / "eval" / "*" / "report.md"}

next        draftsmith eval --target {target_dir} --drafter {student_dir} --prompts {prompts} --k 1,2,4,8 \
--out {ARTIFACTS / "eval" / "sweep"}
            draftsmith fit --config recipes/quickstart/kd.yaml --config recipes/_base/ddp.yaml --trainer.devices 2
            draftsmith export --ckpt {ARTIFACTS / "runs" / "kd" / "checkpoints" / "last.ckpt"} --out {ARTIFACTS / "hf"}
"""
    )
    return 0
