"""Sequential MTP on the tiny target: pre-training with and without modules, refresh, extend, and what MTP costs.

    python -m bench.studies.mtp [--steps 400] [--stage all | prompts,pretrain,heldout,regen,refresh,extend,eval,cost]

Needs the demo's corpus (``make demo`` or ``draftsmith prepare --output_dir artifacts/corpus``). Every stage is
skipped when its output exists under ``--out`` (default artifacts/bench_mtp; delete a folder to redo a stage):

1. ``prompts``: 160-character training prompts (``draftsmith compare``'s cut), ``artifacts/mtp_seq_prompts.jsonl``;
2. ``pretrain``: recipes/quickstart/tiny_target.yaml (D = 0) and recipes/quickstart/mtp_pretrain.yaml (D = 1) for the
   same ``--steps``, side by side, one thread each: same data order, schedule, seed and initial trunk weights;
3. ``heldout``: the held-out next-token loss of both trained models (the corpus' held-out files, 256-token rows);
4. ``regen``: the D = 1 model completes the prompts greedily (``draftsmith generate --prompt_field``);
5. ``refresh``: recipes/quickstart/mtp_refresh.yaml: the module refreshed on the completions, the model frozen;
6. ``extend``: recipes/quickstart/mtp_extend.yaml: module 1 copied into modules 2 and 3, which alone train;
7. ``eval``: ``draftsmith eval`` at K = 1, 2, 3 (``--eval-k``; K = 3 alone reports every depth's acceptance), greedy
   and sampling (T = 1), of the extended three modules, the refreshed one and the pre-trained one, on the demo's 10
   held-out prompts (``--eval-prompts`` for fewer; ``--new-tokens``, 128);
8. ``cost``: training step time and memory of the tiny target's shape with D = 0, 1, 2 (8 x 256 tokens, one thread),
   each variant in its own process, alternated over ``--cost-rounds`` rounds; time as the process' CPU time per step
   (what a shared machine's load does not change) and wall-clock time; peak training memory as the weights, gradients
   and Adam moments of the trained parameters plus the bytes autograd saves for the backward (counted exactly with
   saved-tensor hooks; a CPU process's resident size is no measure of it).

Writes ``OUT/summary.md`` and ``OUT/summary.json`` and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, heldout_data, module_command, run, run_dirs, training_prompts, wait

ARTIFACTS = ROOT / "artifacts"
SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4}  # fmt: skip


def draftsmith(args: list[str], log: Path, threads: int | None = None) -> subprocess.Popen:
    """``draftsmith ARGS`` started from the repository root, its output in ``log``."""
    return run(["draftsmith", *args], log, threads)


def wait_all(*procs: tuple[subprocess.Popen, Path]) -> None:
    """Waits for every (process, log) in turn; exits at the first that failed."""
    for proc, log in procs:
        wait(proc, log)


def stage_pretrain(out: Path, steps: int, d0_model: str | None) -> None:
    runs = []
    d0, d1 = out / "d0", out / "d1"
    if d0_model is None and not (d0 / "model" / "config.json").is_file():
        args = ["fit", "--config", "recipes/quickstart/tiny_target.yaml", "--trainer.max_steps", str(steps),
                "--model.init_args.export_dir", str(d0 / "model"), *run_dirs(d0)]  # fmt: skip
        runs.append((draftsmith(args, d0 / "fit.log", threads=1), d0 / "fit.log"))
    if not (d1 / "model" / "config.json").is_file():
        args = ["fit", "--config", "recipes/quickstart/mtp_pretrain.yaml", "--trainer.max_steps", str(steps),
                "--model.init_args.export_dir", str(d1 / "model"), *run_dirs(d1)]  # fmt: skip
        runs.append((draftsmith(args, d1 / "fit.log", threads=1 if runs else None), d1 / "fit.log"))
    start = time.perf_counter()
    wait_all(*runs)
    if runs:
        (out / "pretrain_seconds.txt").write_text(f"{time.perf_counter() - start:.0f}\n")


def stage_heldout(out: Path, d0_model: str | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.training.heldout import heldout_loss

    data = heldout_data(ARTIFACTS / "corpus")
    losses = {}
    for name in ("d0", "d1"):
        path = d0_model if name == "d0" and d0_model else out / name / "model"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        losses[name] = heldout_loss(model, data.val_dataloader(), max_batches=1000)
    return losses


def stage_finetune(out: Path, name: str, recipe: str, init_from: Path, steps: int) -> Path:
    run = out / name
    ckpt = run / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        args = ["fit", "--config", recipe, "--trainer.max_steps", str(steps),
                "--trainer.val_check_interval", str(steps), "--model.init_args.target", str(out / "d1" / "model"),
                "--model.init_args.init_from", str(init_from),
                "--data.init_args.train_files", json.dumps([str(out / "regen.jsonl")]), *run_dirs(run)]  # fmt: skip
        wait_all((draftsmith(args, run / "fit.log"), run / "fit.log"))
    return ckpt


def stage_eval(out: Path, name: str, drafter: Path, new_tokens: int, ks: str, prompts: int) -> dict:
    report = out / "eval" / name / "report.json"
    if not report.is_file():
        args = ["eval", "--target", str(out / "d1" / "model"), "--drafter", str(drafter),
                "--prompts", str(ARTIFACTS / "heldout_prompts.jsonl"), "--k", ks, "--temperature", "1.0",
                "--max_new_tokens", str(new_tokens), "--max_prompts", str(prompts),
                "--output_dir", str(report.parent)]  # fmt: skip
        log = out / "eval" / f"{name}.log"
        wait_all((draftsmith(args, log), log))
    return json.loads(report.read_text())


# ---------------------------------------------------------------------------------------------------- training cost


def cost_child(depth: int, steps: int) -> None:
    """One variant in this process: ``steps`` timed optimizer steps after a warm-up one; prints a JSON line."""
    import torch

    from trainer.methods.draft_model.pretrain import CausalLMPretraining
    from trainer.methods.mtp.objective import SequentialMTP
    from trainer.training.optimizers import Optim

    torch.set_num_threads(1)
    tokenizer = str(ARTIFACTS / "corpus" / "tokenizer")
    if depth == 0:
        objective = CausalLMPretraining(tokenizer=tokenizer, **SHAPE, optim=Optim(lr=1e-3))
    else:
        objective = SequentialMTP(mode="pretrain", mtp_depth=depth, tokenizer=tokenizer, target_config=SHAPE)
    module = objective.trainable_module()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    vocab = module.get_output_embeddings().weight.shape[0] if depth == 0 else module.trunk.config.vocab_size
    rows = torch.randint(0, vocab, (8, 257), generator=g)
    batch = {"input_ids": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": torch.ones(8, 256, dtype=torch.bool)}

    def step() -> None:
        loss, _ = objective.compute_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: Adam's states exist from here on
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = objective.compute_loss(batch)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    state = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad) * 4  # w, grad, 2 moments
    print(json.dumps({"depth": depth, "times": times, "cpu": cpu, "saved_bytes": saved[0], "params": params,
                      "state_bytes": state}))  # fmt: skip


def trained_params(depth: int) -> int:
    """Trainable parameters of the tiny target's shape with ``depth`` modules (built, not trained)."""
    from trainer.methods.draft_model.pretrain import CausalLMPretraining
    from trainer.methods.mtp.objective import SequentialMTP

    tokenizer = str(ARTIFACTS / "corpus" / "tokenizer")
    if depth == 0:
        module = CausalLMPretraining(tokenizer=tokenizer, **SHAPE).trainable_module()
    else:
        module = SequentialMTP(mode="pretrain", mtp_depth=depth, tokenizer=tokenizer, target_config=SHAPE).drafter
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def stage_cost(rounds: int, steps: int) -> dict:
    results: dict[int, dict] = {d: {"times": [], "cpu": []} for d in (0, 1, 2)}
    for r in range(rounds):
        for depth in (0, 1, 2):
            env = dict(os.environ, OMP_NUM_THREADS="1")
            cmd = module_command("bench.studies.mtp", "--cost-child", str(depth), "--cost-steps", str(steps))
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
            line = json.loads(done.stdout.strip().splitlines()[-1])
            results[depth]["times"].append(statistics.median(line["times"]))
            results[depth]["cpu"].append(statistics.median(line["cpu"]))
            results[depth].update(saved=line["saved_bytes"], state=line["state_bytes"], params=line["params"])
            print(f"cost round {r + 1}/{rounds}: D={depth} {statistics.median(line['times']):.3f} s/step", flush=True)
    return {d: {"step_s": statistics.median(v["times"]), "step_cpu_s": statistics.median(v["cpu"]),
                "params": v["params"], "saved_mb": v["saved"] / 2**20, "state_mb": v["state"] / 2**20,
                "memory_mb": (v["saved"] + v["state"]) / 2**20} for d, v in results.items()}  # fmt: skip


# ------------------------------------------------------------------------------------------------------------- main


def acceptance_rows(report: dict, mode: str) -> list[str]:
    rows = []
    for entry in report[mode]:
        acc = " ".join(f"{a:.2f}" for a in entry["acceptance_per_position"])
        rows.append(f"K={entry['k']}: tau {entry['tau']:.2f}, acceptance per depth {acc}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ARTIFACTS / "bench_mtp"), help="outputs of every stage")
    parser.add_argument("--stage", default="all", help="all, or stages separated by commas: prompts, pretrain, "
                        "heldout, regen, refresh, extend, eval, cost")  # fmt: skip
    parser.add_argument("--steps", type=int, default=400, help="pre-training steps of both models (the demo's)")
    parser.add_argument("--d0-model", default=None, help="use this model, trained by recipes/quickstart/"
                        "tiny_target.yaml for --steps steps (the demo's artifacts/tiny_target), as D = 0")  # fmt: skip
    parser.add_argument("--finetune-steps", type=int, default=300, help="steps of refresh and of extend")
    parser.add_argument("--regen-prompts", type=int, default=1000, help="training prompts the model completes")
    parser.add_argument("--new-tokens", type=int, default=128, help="output tokens per prompt in eval")
    parser.add_argument("--eval-k", default="1,2,3", help="--k of draftsmith eval (3: every depth)")
    parser.add_argument("--eval-prompts", type=int, default=0, help="held-out prompts in eval (0: all 10)")
    parser.add_argument("--cost-rounds", type=int, default=3, help="alternated rounds of the cost measurement")
    parser.add_argument("--cost-steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--cost-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cost_child is not None:
        cost_child(args.cost_child, args.cost_steps)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = {"prompts", "pretrain", "heldout", "regen", "refresh", "extend", "eval", "cost"}
    chosen = stages if args.stage == "all" else set(args.stage.split(","))
    if chosen - stages:
        parser.error(f"--stage: unknown stages {sorted(chosen - stages)}; known: {sorted(stages)}")
    summary_file = out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    prompts = ARTIFACTS / "mtp_seq_prompts.jsonl"
    if "prompts" in chosen and not prompts.is_file():
        training_prompts(ARTIFACTS / "corpus" / "train.jsonl", prompts, per_file=3, seed=0)
    if "pretrain" in chosen:
        stage_pretrain(out, args.steps, args.d0_model)
    if "heldout" in chosen:
        summary["heldout_loss"] = stage_heldout(out, args.d0_model)
    regen, regen_done = out / "regen.jsonl", out / "regen.done"
    if "regen" in chosen and not regen_done.is_file():  # generate resumes an interrupted output itself
        subset = out / "regen_prompts.jsonl"
        subset.write_text("".join(prompts.read_text().splitlines(True)[: args.regen_prompts]))
        log = out / "regen.log"
        wait_all((draftsmith(["generate", "--target", str(out / "d1" / "model"), "--input_file", str(subset),
                          "--output_file", str(regen), "--prompt_field", "prompt", "--max_new_tokens", "192",
                          "--batch_size", "32"],
                         log), log))  # fmt: skip
        regen_done.touch()
    pretrain_ckpt = out / "d1" / "checkpoints" / "last.ckpt"
    refresh_ckpt, extend_ckpt = (
        out / "refresh" / "checkpoints" / "last.ckpt",
        out / "extend" / "checkpoints" / "last.ckpt",
    )
    if "refresh" in chosen:
        stage_finetune(out, "refresh", "recipes/quickstart/mtp_refresh.yaml", pretrain_ckpt, args.finetune_steps)
    if "extend" in chosen:
        stage_finetune(out, "extend", "recipes/quickstart/mtp_extend.yaml", refresh_ckpt, args.finetune_steps)
    if "eval" in chosen:
        summary["eval"] = {
            name: stage_eval(out, name, ckpt, args.new_tokens, args.eval_k, args.eval_prompts)
            for name, ckpt in (("extended", extend_ckpt), ("refreshed", refresh_ckpt), ("pretrained", pretrain_ckpt))
        }
    if "cost" in chosen:
        summary["cost"] = stage_cost(args.cost_rounds, args.cost_steps)
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    lines = []
    if "heldout_loss" in summary:
        h = summary["heldout_loss"]
        lines.append(
            f"held-out next-token loss after {args.steps} steps: D=0 {h['d0']:.3f}, D=1 {h['d1']:.3f} nats/token"
        )
    for name, report in summary.get("eval", {}).items():
        lines.append(f"{name} (loops: {report['loops']['share']:.0%} of the target's greedy output)")
        lines += [f"  greedy   {row}" for row in acceptance_rows(report, "greedy")]
        lines += [f"  sampling {row}" for row in acceptance_rows(report, "sampling")]
    if "cost" in summary:
        c = {int(k): v for k, v in summary["cost"].items()}
        for d, v in c.items():  # a summary written before the memory was counted as below
            if "memory_mb" not in v:
                v["params"] = trained_params(d)
                v["state_mb"] = v["params"] * 4 * 4 / 2**20  # float32 weights, gradients and two Adam moments
                v["memory_mb"] = v["state_mb"] + v["saved_mb"]
        summary["cost"] = {str(d): v for d, v in c.items()}
        summary_file.write_text(json.dumps(summary, indent=2) + "\n")
        for d in (1, 2):
            lines.append(
                f"training cost D={d} / D=0: step CPU time {c[d]['step_cpu_s'] / c[0]['step_cpu_s']:.2f}x (wall "
                f"{c[d]['step_s'] / c[0]['step_s']:.2f}x), activations saved for the backward "
                f"{c[d]['saved_mb'] / c[0]['saved_mb']:.2f}x, peak training memory "
                f"{c[d]['memory_mb'] / c[0]['memory_mb']:.2f}x"
            )
        lines.append(
            "  D = 0 / 1 / 2: CPU s/step "
            + " / ".join(f"{c[d]['step_cpu_s']:.2f}" for d in (0, 1, 2))
            + "; MB saved for backward "
            + " / ".join(f"{c[d]['saved_mb']:.0f}" for d in (0, 1, 2))
            + "; MB of weights, gradients and Adam moments "
            + " / ".join(f"{c[d]['state_mb']:.0f}" for d in (0, 1, 2))
            + "; trained parameters "
            + " / ".join(f"{c[d]['params'] / 1e6:.2f} M" for d in (0, 1, 2))
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
