"""``draftsmith demo``: the whole loop on one CPU in minutes, with nothing downloaded.

1. prepares the bundled corpus (the standard library's source) and trains its byte-level BPE tokenizer;
2. pretrains the tiny target (recipes/quickstart/tiny_target.yaml);
3. distils a smaller student from it (recipes/quickstart/kd.yaml);
4. evaluates both on held-out text (loss against a unigram baseline) and measures the student as a drafter with
   lossless speculative decoding (``draftsmith eval``), beside prompt lookup.

Every stage reuses its output when it exists, so a rerun only repeats what is missing (``--fresh`` starts over).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trainer.data.corpus import HELDOUT_PROMPTS, PROMPT_CHARS, prepare_corpus, write_heldout_prompts
from trainer.data.text import TextDataModule
from trainer.distributed.preemption import exit_status_after_fit
from trainer.interface.flags import ToolParser
from trainer.interface.output import block, duration
from trainer.training.heldout import heldout_loss, unigram_baseline, unigram_counts
from trainer.training.recipe import DraftsmithCLI

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"
ARTIFACTS = Path("artifacts")
SUMMARY_FILE = ARTIFACTS / "demo_summary.json"
README_START = "<!-- demo summary: written by `python -m trainer.demo --readme README.md` from the demo's summary -->"
README_END = "<!-- end of demo summary -->"
README_SUMMARY = "docs/demo_summary.json"
COMPARE_RECIPE = "recipes/compare/tiny.yaml"
STAGES = 4


def _say(stage: int, text: str) -> None:
    """One line of the demo's story, ``demo [i/4] text``, flushed at once: with the output redirected to a file it
    lands between the fit's log lines (standard error) in the order it happened."""
    print(f"demo [{stage}/{STAGES}] {text}", flush=True)


def render_summary(summary: dict) -> str:
    """The demo's figures as it prints them (and as the README shows them, generated from the same summary)."""
    kd, lookup, pad, s = summary["kd_student"], summary["prompt_lookup"], " " * 29, summary
    return "\n".join(
        [
            f"held-out loss (nats/token)   unigram baseline {summary['unigram_loss']:.3f}",
            f"{pad}tiny target      {s['target_loss']:.3f}  ({s['target_params'] / 1e6:.1f} M parameters)",
            f"{pad}KD student       {s['student_loss']:.3f}  ({s['student_params'] / 1e6:.1f} M parameters)",
            f"training throughput          target {summary['target_tokens_per_s']:,.0f} tokens/s, KD "
            f"{summary['kd_tokens_per_s']:,.0f} tokens/s (whole fit, start-up included)",
            f"speculative decoding, K=4    KD student    tau {kd['tau_greedy']:.2f} greedy, "
            f"{kd['tau_sampling']:.2f} sampling (T=1)",
            f"{pad}prompt lookup tau {lookup['tau_greedy']:.2f} greedy",
            f"{pad}loops: {100 * summary['loop_share']:.0f}% of the target's greedy output positions, in "
            f"{summary['looped_prompts']} of {summary['prompts']} prompts",
        ]
    )


def write_readme_block(readme: Path, summary_file: Path) -> None:
    """Replace the README's demo block (between its two markers) with :func:`render_summary` of ``summary_file``, and
    keep that summary beside the README (``docs/demo_summary.json``), which the tests render and compare."""
    if not summary_file.is_file():
        raise SystemExit(f"{summary_file} not found: run `draftsmith demo` first")
    text = readme.read_text()
    pattern = re.compile(re.escape(README_START) + r"\n```\n.*?\n```\n" + re.escape(README_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme}: no demo block between {README_START!r} and {README_END!r}")
    summary = json.loads(summary_file.read_text())
    block = f"{README_START}\n```\n{render_summary(summary)}\n```\n{README_END}"
    readme.write_text(pattern.sub(lambda _: block, text, count=1))
    kept = readme.parent / README_SUMMARY
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(summary, indent=2) + "\n")


def _fit(recipe: str, max_steps: int, summary_file: Path, checkpoints: Path) -> dict:
    """Runs ``draftsmith fit --config RECIPE`` in this process and keeps the final metrics beside its outputs; a stage
    interrupted earlier resumes from its ``last.ckpt`` (a fresh run into a folder of checkpoints is refused)."""
    start = time.perf_counter()
    args = ["fit", "--config", str(RECIPES / recipe), "--trainer.max_steps", str(max_steps)]
    if (checkpoints / "last.ckpt").exists():
        args += ["--ckpt_path", "last"]
    with warnings.catch_warnings():  # the demo hands fit its arguments in-process, on purpose
        warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
        cli = DraftsmithCLI(args=args)
    status = exit_status_after_fit(cli.trainer)
    if status:  # stopped by a signal before its last step: last.ckpt is saved, and no later stage may use it
        print(
            f"draftsmith demo: the {recipe} stage stopped on signal {status - 128} at step {cli.trainer.global_step} "
            f"and saved {checkpoints / 'last.ckpt'}; rerun `draftsmith demo` to go on from there",
            file=sys.stderr,
        )
        raise SystemExit(status)
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


def build_parser() -> ToolParser:
    """The parser of ``draftsmith demo``."""
    parser = ToolParser(prog="draftsmith demo", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--target_steps", type=int, default=400, help="optimizer steps of the tiny target")
    parser.add_argument("--kd_steps", type=int, default=150, help="optimizer steps of the KD student")
    parser.add_argument(
        "--max_prompts", type=int, default=HELDOUT_PROMPTS, help="held-out prompts for the speculative evaluation"
    )
    parser.add_argument("--max_new_tokens", type=int, default=48, help="output tokens per prompt in the evaluation")
    parser.add_argument("--fresh", action="store_true", help="delete the demo's outputs and start over")
    parser.add_argument(
        "--compare",
        action="store_true",
        help=f"then compare every method on the tiny target ({COMPARE_RECIPE}, draftsmith compare; see the README "
        "for its time)",
    )
    parser.add_argument(
        "--readme",
        default=None,
        help=f"only rewrite this README's demo block from {SUMMARY_FILE} (what the last demo run measured)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftsmith demo``."""
    args = build_parser().parse_args(argv)
    if args.readme:
        write_readme_block(Path(args.readme), SUMMARY_FILE)
        return 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.fresh:
        for name in ("tiny_target", "kd_student", "runs", "eval"):
            shutil.rmtree(ARTIFACTS / name, ignore_errors=True)
    ARTIFACTS.mkdir(exist_ok=True)
    timings: dict[str, float] = {}

    start = time.perf_counter()
    _say(1, "corpus: the standard library's source, split by file, and a byte-level BPE tokenizer of 8192 tokens")
    corpus = prepare_corpus(str(ARTIFACTS / "corpus"), vocab_size=8192, seed=0)
    timings["prepare"] = time.perf_counter() - start
    _say(1, f"corpus ready in {duration(timings['prepare'])}: {corpus.out_dir}")

    target_dir, student_dir = ARTIFACTS / "tiny_target", ARTIFACTS / "kd_student"
    target_summary_file, kd_summary_file = ARTIFACTS / "tiny_target.summary.json", ARTIFACTS / "kd_student.summary.json"
    if not (target_dir / "config.json").is_file():
        _say(2, f"tiny target: pretraining for {args.target_steps} steps (recipes/quickstart/tiny_target.yaml)")
        _fit(
            "tiny_target.yaml",
            args.target_steps,
            target_summary_file,
            ARTIFACTS / "runs" / "tiny_target" / "checkpoints",
        )
        target_summary = json.loads(target_summary_file.read_text())
        _say(2, f"tiny target trained in {duration(target_summary['seconds'])}: {target_dir}")
    else:
        target_summary = json.loads(target_summary_file.read_text())
        trained = duration(target_summary["seconds"])
        _say(2, f"tiny target reused: {target_dir} (trained in {trained}; --fresh redoes it)")
    if not (student_dir / "config.json").is_file():
        _say(3, f"KD student: distilling for {args.kd_steps} steps (recipes/quickstart/kd.yaml)")
        _fit("kd.yaml", args.kd_steps, kd_summary_file, ARTIFACTS / "runs" / "kd" / "checkpoints")
        kd_summary = json.loads(kd_summary_file.read_text())
        _say(3, f"KD student trained in {duration(kd_summary['seconds'])}: {student_dir}")
    else:
        kd_summary = json.loads(kd_summary_file.read_text())
        _say(3, f"KD student reused: {student_dir} (trained in {duration(kd_summary['seconds'])}; --fresh redoes it)")
    timings["target"], timings["kd"] = target_summary["seconds"], kd_summary["seconds"]

    start = time.perf_counter()
    _say(4, f"evaluation: held-out loss, then speculative decoding of {args.max_prompts} prompts (draftsmith eval)")
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
    _say(4, f"held-out loss {target_loss:.3f} target, {student_loss:.3f} student, {baseline:.3f} unigram baseline")

    from trainer.decoding.eval_cli import main as eval_main

    prompts = write_heldout_prompts(
        corpus.heldout_file, ARTIFACTS / "heldout_prompts.jsonl", args.max_prompts, PROMPT_CHARS
    )
    reports = {}
    for name, drafter in (("kd_student", str(student_dir)), ("prompt_lookup", "prompt-lookup")):
        out = ARTIFACTS / "eval" / name
        common = ["--target", str(target_dir), "--prompts", str(prompts), "--max_new_tokens", str(args.max_new_tokens)]
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "eval.log", "w") as said, contextlib.redirect_stdout(said):  # its lines: in its report
            status = eval_main(
                [*common, "--drafter", drafter, "--k", "4", "--temperature", "1.0", "--output_dir", str(out)]
            )
        if status != 0:
            raise SystemExit(f"draftsmith eval failed for {name} (exit {status}); see {out / 'eval.log'}")
        reports[name] = json.loads((out / "report.json").read_text())
        greedy = reports[name]["greedy"][0]
        _say(4, f"{name}: tau {greedy['tau']:.2f} greedy at K=4 ({out / 'report.md'})")
    timings["evaluate"] = time.perf_counter() - start
    _say(4, f"evaluated in {duration(timings['evaluate'])}")

    kd, lookup = reports["kd_student"], reports["prompt_lookup"]
    summary = {
        "unigram_loss": baseline,
        "target_loss": target_loss,
        "student_loss": student_loss,
        "target_params": target.num_parameters(),
        "student_params": student.num_parameters(),
        "target_tokens_per_s": target_summary["tokens_per_s"],
        "kd_tokens_per_s": kd_summary["tokens_per_s"],
        "kd_student": {"tau_greedy": kd["greedy"][0]["tau"], "tau_sampling": kd["sampling"][0]["tau"]},
        "prompt_lookup": {"tau_greedy": lookup["greedy"][0]["tau"]},
        "loop_share": kd["loops"]["share"],
        "looped_prompts": kd["loops"]["looped_prompts"],
        "prompts": args.max_prompts,
        "target_steps": target_summary["steps"],
        "kd_steps": kd_summary["steps"],
        "seconds": timings,
    }
    SUMMARY_FILE.write_text(json.dumps(summary, indent=2) + "\n")
    stage_times = ", ".join(
        f"{name} {duration(timings[key])}"
        for name, key in (("prepare", "prepare"), ("target", "target"), ("KD", "kd"), ("evaluation", "evaluate"))
    )
    outputs = [
        f"corpus and tokenizer  {corpus.out_dir}",
        f"tiny target (HF)      {target_dir}",
        f"KD student (HF)       {student_dir}",
        f"checkpoints           {ARTIFACTS / 'runs' / '*' / 'checkpoints'}",
        f"TensorBoard logs      tensorboard --logdir {ARTIFACTS / 'runs'}",
        f"evaluation reports    {ARTIFACTS / 'eval' / '*' / 'report.md'}",
        f"summary               {SUMMARY_FILE} (python -m trainer.demo --readme README.md copies it into the README)",
    ]
    commands = [
        f"draftsmith eval --target {target_dir} --drafter {student_dir} --prompts {prompts} --k 1,2,4,8 "
        f"--output_dir {ARTIFACTS / 'eval' / 'sweep'}",
        "draftsmith fit --config recipes/quickstart/kd.yaml --config recipes/_base/ddp.yaml --trainer.devices 2",
        f"draftsmith export --ckpt_path {ARTIFACTS / 'runs' / 'kd' / 'checkpoints' / 'last.ckpt'} "
        f"--output_dir {ARTIFACTS / 'hf'}",
        f"draftsmith compare --config {COMPARE_RECIPE}   (every method side by side; or draftsmith demo --compare)",
    ]
    rows = [
        ("time", f"{stage_times} (a reused stage counts its first run)"),
        ("results", render_summary(summary)),
        ("outputs", "\n".join(outputs)),
    ]
    print(block(f"demo done in {duration(sum(timings.values()))}", rows, commands), flush=True)
    if args.compare:
        from trainer.compare.run import main as compare_main

        return compare_main(["--config", str(Path(__file__).resolve().parents[1] / COMPARE_RECIPE)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
