"""Parallel multi-token-prediction heads: training memory and time of the heads' backwards, tau of self-speculative
decoding with the heads, and the held-out next-token loss of a model pre-trained with heads.

    python -m bench.bench_mtp_heads memory     # one training step, 4 heads, V = 32768: naive vs sequential
    python -m bench.bench_mtp_heads tau --model artifacts/mtp_finetuned [--model artifacts/mtp_target]
    python -m bench.bench_mtp_heads heldout --with-heads artifacts/mtp_target --without-heads artifacts/tiny_target
    python -m bench.bench_mtp_heads labels --target artifacts/tiny_target   # a fine-tune step: data vs original

``memory``: each variant (``naive``: every head's full logits alive until backward; ``sequential``: the heads one
after the other inside one backward, logits chunked; ``checkpoint``: per-head activation checkpointing, the ZeRO-3 /
FSDP2 path) runs forward + backward of a whole model with its heads (Llama, hidden 512, 4 layers, 4 heads, B = 4,
S = 512, V = 32768, chunks of 256 positions by default) in a fresh child process, alternated over ``--rounds``; a
child reports the rise of its peak resident set size over the peak it had with the model and the batch allocated,
the gradients set to None before the step as Lightning's ``zero_grad`` does (so the rise is the step's activations,
logits and gradients; the optimizer states, the same in every variant, are left out), and the median time of
``--reps`` further steps. Ratios are against ``naive``.

``tau``: ``draftsmith eval``'s measurement (trainer.decoding.evaluate.evaluate_drafter: greedy output checked token
for token against the model alone, then speculative sampling at T = 1) of the heads of an exported model (the model
drafts for itself), K = n - 1, as a chain and as the tree built for ``--tree-nodes`` from the heads' measured
agreement, on the held-out prompts ``make demo`` wrote.

``heldout``: trainer.training.heldout.heldout_loss of two HF models on the corpus' held-out split (the demo's 256-token
    rows):
a model pre-trained with heads (recipes/quickstart/mtp_heads_pretrain.yaml, trunk + head 0) against the same shape
trained without heads for the same steps (recipes/quickstart/tiny_target.yaml: same data, schedule, seed and initial
weights).

``labels``: one training step (``compute_loss`` and backward, the sequential head backward) of the fine-tune recipe's
objective (4 heads, ``head_weights [0, 1, 1, 1]``, ``target_kl_weight 4``, chunks of 512 positions) on a random
batch of 8 x 256 tokens, with ``labels: data`` (head 0's KL to the frozen original apart) and ``labels: original``
(every head's KL to it), alternated over ``--rounds`` after one warm-up step each; the median step time of each and
their ratio, one thread.
"""

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import ROOT, heldout_data, module_command, peak_rss_mib

VARIANTS = ("naive", "sequential", "checkpoint")


def child(args: argparse.Namespace) -> None:
    """One variant's step in this process; prints a JSON line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.methods.mtp_heads.module import MTPHeads

    def build(vocab: int, hidden: int, layers: int) -> MTPHeads:
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden), num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
        )  # fmt: skip
        return MTPHeads(LlamaForCausalLM(config), args.heads, head_init="random")

    def step(heads: MTPHeads, ids: torch.Tensor, labels: torch.Tensor) -> float:
        heads.zero_grad(set_to_none=True)  # as Lightning does: the step allocates the gradients
        out = heads(ids, labels, backward=args.variant, chunk_size=args.chunk_size)
        out.loss.backward()
        return float(out.loss)

    torch.manual_seed(0)
    small = build(64, 64, 2)  # load kernels and thread pools before the baseline, on a model of no size
    step(small, torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16)))
    heads = build(args.vocab, args.hidden, args.layers)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))  # [B, S]
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))  # [B, S]
    base = peak_rss_mib()
    loss = step(heads, ids, labels)
    peak = peak_rss_mib() - base
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        step(heads, ids, labels)
        times.append(time.perf_counter() - start)
    print(json.dumps({"variant": args.variant, "peak_mib": peak, "seconds": statistics.median(times), "loss": loss,
                      "base_mib": base}))  # fmt: skip


def memory(args: argparse.Namespace) -> None:
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    common = ["--batch", str(args.batch), "--seq", str(args.seq), "--hidden", str(args.hidden), "--layers",
              str(args.layers), "--vocab", str(args.vocab), "--heads", str(args.heads), "--chunk-size",
              str(args.chunk_size), "--reps", str(args.reps)]  # fmt: skip
    for _ in range(args.rounds):
        for variant in VARIANTS:
            cmd = module_command("bench.bench_mtp_heads", "child", "--variant", variant, *common)
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    naive_peak = statistics.median(r["peak_mib"] for r in results["naive"])
    naive_time = statistics.median(r["seconds"] for r in results["naive"])
    print(f"one training step (forward + backward), {args.heads} heads, B={args.batch}, S={args.seq}, "
          f"H={args.hidden}, {args.layers} layers, V={args.vocab}, chunk {args.chunk_size}; median of {args.rounds} "
          f"rounds; memory: peak RSS rise over the weights and the batch (the step allocates the gradients)"
          )  # fmt: skip
    print(f"{'variant':<12}{'step peak MiB':>15}{'ratio':>8}{'step s':>9}{'ratio':>8}{'process MiB':>13}")
    for variant in VARIANTS:
        peak = statistics.median(r["peak_mib"] for r in results[variant])
        seconds = statistics.median(r["seconds"] for r in results[variant])
        total = statistics.median(r["peak_mib"] + r["base_mib"] for r in results[variant])
        print(f"{variant:<12}{peak:>15.0f}{peak / naive_peak:>8.2f}{seconds:>9.2f}{seconds / naive_time:>8.2f}"
              f"{total:>13.0f}")  # fmt: skip
    losses = {v: results[v][0]["loss"] for v in VARIANTS}
    print(f"losses (must agree): {losses}")


def tau(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from trainer.decoding.evaluate import evaluate_drafter, load_prompts
    from trainer.decoding.options import ProposerOptions
    from trainer.methods.mtp_heads import kind as kind
    from trainer.methods.mtp_heads.export import load

    torch.set_num_threads(args.threads)
    for model_dir in args.model:
        heads = load(model_dir).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = load_prompts(args.prompts, tokenizer)[: args.max_prompts or None]
        record = kind.make_record(heads, "mtp", model_dir, model_dir)
        k = heads.num_heads - 1
        eos = tokenizer.eos_token_id
        measured = heads.measured_agreement()
        print(f"{model_dir}: {heads.num_heads} heads, K = {k}; agreement with head 0 (top-1 per extra head): "
              f"{'not measured' if measured is None else [round(float(x), 3) for x in measured[:, 0]]}")  # fmt: skip
        for name, options in (("chain", ProposerOptions()),
                              ("tree", ProposerOptions(tree=True, tree_nodes=args.tree_nodes,
                                                       tree_top_k=args.tree_top_k))):  # fmt: skip
            proposer = kind.proposer(heads, record, heads.model, options)
            report = evaluate_drafter(heads.model, proposer, prompts, [k], args.max_new_tokens, 1.0, eos, 0)
            greedy, sampled = report["greedy"][0], report["sampling"][0]
            nodes = len(proposer.choices) if proposer.choices else k
            per_position = " ".join(f"{a:.2f}" for a in greedy["acceptance_per_position"])
            print(f"  {name:<6} {nodes:>3} nodes: tau {greedy['tau']:.2f} greedy (in / out of loops "
                  f"{greedy['tau_in_loops']:.2f} / {greedy['tau_outside_loops']:.2f}), {sampled['tau']:.2f} sampling "
                  f"(T=1); acceptance per position {per_position}; measured speedup {greedy['measured_speedup']:.2f}x; "
                  f"loop share {report['loops']['share']:.0%}")  # fmt: skip


def heldout(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.training.heldout import heldout_loss

    torch.set_num_threads(args.threads)
    data = heldout_data(Path(args.corpus))
    for label, path in (("with heads", args.with_heads), ("without heads", args.without_heads)):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        print(f"{label:<14} {path}: held-out next-token loss {heldout_loss(model, data.val_dataloader()):.4f} nats")


def labels(args: argparse.Namespace) -> None:
    import torch

    from trainer.methods.mtp_heads.objective import ParallelMTPHeads

    torch.set_num_threads(args.threads)
    objectives = {}
    for value in ("data", "original"):
        objectives[value] = ParallelMTPHeads(
            target=args.target, num_heads=4, head_weights=[0.0, 1.0, 1.0, 1.0], target_kl_weight=4.0, labels=value,
            head_backward="sequential", loss_chunk_size=512,
        )  # fmt: skip
    vocab = objectives["data"].mtp.model.config.vocab_size
    ids = torch.randint(0, vocab, (8, 257), generator=torch.Generator().manual_seed(0))  # [B, S + 1]
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(8, 256, dtype=torch.bool)}

    def step(objective: ParallelMTPHeads) -> float:
        objective.zero_grad(set_to_none=True)
        start = time.perf_counter()
        objective.compute_loss(batch)[0].backward()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {value: [] for value in objectives}
    for objective in objectives.values():
        step(objective)  # warm-up
    for _ in range(args.rounds):
        for value, objective in objectives.items():
            times[value].append(step(objective))
    data, original = statistics.median(times["data"]), statistics.median(times["original"])
    print(
        f"one fine-tune step of 8 x 256 tokens, 4 heads, {args.threads} thread(s), median of {args.rounds}: "
        f"labels: data {data:.2f} s, labels: original {original:.2f} s, ratio {original / data:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("memory", "child"):
        p = sub.add_parser(name)
        p.add_argument("--batch", type=int, default=4)
        p.add_argument("--seq", type=int, default=512)
        p.add_argument("--hidden", type=int, default=512)
        p.add_argument("--layers", type=int, default=4)
        p.add_argument("--vocab", type=int, default=32768)
        p.add_argument("--heads", type=int, default=4)
        p.add_argument("--chunk-size", type=int, default=256)
        p.add_argument("--reps", type=int, default=2)
        if name == "memory":
            p.add_argument("--rounds", type=int, default=2, help="alternations of the variants")
        else:
            p.add_argument("--variant", choices=VARIANTS, required=True)
    p = sub.add_parser("tau")
    p.add_argument("--model", action="append", required=True, help="an exported model with heads (repeatable)")
    p.add_argument("--prompts", default=str(ROOT / "artifacts" / "heldout_prompts.jsonl"))
    p.add_argument("--max-prompts", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree-nodes", type=int, default=16)
    p.add_argument("--tree-top-k", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("heldout")
    p.add_argument("--with-heads", required=True)
    p.add_argument("--without-heads", required=True)
    p.add_argument("--corpus", default=str(ROOT / "artifacts" / "corpus"))
    p.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("labels")
    p.add_argument("--target", default=str(ROOT / "artifacts" / "tiny_target"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    {"memory": memory, "child": child, "tau": tau, "heldout": heldout, "labels": labels}[args.command](args)


if __name__ == "__main__":
    main()
