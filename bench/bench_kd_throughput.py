"""KD training throughput (tokens/s) and MFU against a matmul peak measured in the same run.

    python -m bench.bench_kd_throughput [--steps 20] [--batch 8] [--seq 256]

Builds a random teacher of the quickstart target's shape (4 layers, hidden 256, vocab 8192) and the quickstart
student (2 layers, hidden 128), runs the KD objective's own training step (fused chunked loss, AdamW) for a few steps
after a warm-up, and reports tokens/s, the model FLOPs per token, the matmul peak of this device in the same dtype,
and MFU = achieved FLOP/s / peak. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.methods.draft_model.kd import KnowledgeDistillation
from trainer.training.objective import causal_lm_flops_per_token
from trainer.training.throughput import measure_matmul_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(config).save_pretrained(tmp)
        module = KnowledgeDistillation(
            target=tmp,
            drafter_config={"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 344},
            loss_chunk_size=args.chunk_size,
        )
    optimizer = torch.optim.AdamW(module.student.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(args.batch, args.seq, dtype=bool)}

    def step() -> None:
        loss, _ = module.compute_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    peak = measure_matmul_peak(torch.device("cpu"), torch.float32)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    tokens_per_s = args.steps * args.batch * args.seq / seconds
    flops_per_token = 3.0 * causal_lm_flops_per_token(module.student, args.seq) + causal_lm_flops_per_token(
        module.target.model, args.seq
    )
    achieved = tokens_per_s * flops_per_token
    print(f"threads {torch.get_num_threads()}, batch {args.batch} x {args.seq}, {args.steps} steps")
    print("| tokens/s | GFLOP/token | achieved GFLOP/s | matmul peak GFLOP/s | MFU |")
    print("|---|---|---|---|---|")
    print(
        f"| {tokens_per_s:,.0f} | {flops_per_token / 1e9:.3f} | {achieved / 1e9:.1f} | {peak / 1e9:.1f} | "
        f"{achieved / peak:.2f} |"
    )


if __name__ == "__main__":
    main()
