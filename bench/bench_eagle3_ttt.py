"""Training-time test cost against the unrolled steps K: step time and memory of an EAGLE-3 training step.

    .venv/bin/python bench/bench_eagle3_ttt.py [--hidden 256] [--layers 4] [--vocab 8192] [--seq-len 256] [--batch 4]

A random Llama target of the given shape is saved to a temporary directory; for K = 1, 3, 7 one forward and backward
of the EAGLE-3 objective is timed (median of a few) and its memory measured: on CUDA the peak allocated memory, and
everywhere the bytes autograd saves for the backward pass (the part that grows with K). Printed as ratios to K = 1,
measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.objectives.eagle3 import Eagle3


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves while running ``fn`` (each storage counted once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64), max_position_embeddings=4096,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as target_dir:
        LlamaForCausalLM(config).save_pretrained(target_dir)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
        rows = np.random.default_rng(0).integers(0, args.vocab, (64, args.seq_len + 1))
        objectives = {}
        for k in (1, 3, 7):
            objectives[k] = Eagle3(target_dir, draft_vocab_size=args.draft_vocab, ttt_steps=k).to(device)
            objectives[k].build_vocab_map(rows, np.ones_like(rows, dtype=bool))

        def step(objective: Eagle3) -> None:
            loss, _ = objective.compute_loss(batch)
            loss.backward()

        times: dict[int, list[float]] = {k: [] for k in objectives}
        peaks: dict[int, int | None] = {}
        for objective in objectives.values():
            step(objective)  # warm-up
        for _ in range(args.repeats):  # round-robin over K, so that load changes hit every K alike
            for k, objective in objectives.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                step(objective)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[k].append(time.perf_counter() - t0)
                peaks[k] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        results = {
            k: (statistics.median(times[k]), saved_bytes(lambda o=o: step(o)), peaks[k]) for k, o in objectives.items()
        }
    t1, s1, p1 = results[1]
    print(f"EAGLE-3 TTT step on {device}: target {args.layers}x{args.hidden}, vocab {args.vocab}, "
          f"draft vocab {args.draft_vocab}, batch {args.batch} x {args.seq_len}")  # fmt: skip
    print(f"{'K':>3} {'step s':>8} {'time/K=1':>9} {'saved MiB':>10} {'saved/K=1':>10} {'peak/K=1':>9}")
    for k, (t, s, p) in results.items():
        peak = f"{p / p1:9.2f}" if p is not None and p1 else f"{'n/a':>9}"
        print(f"{k:>3} {t:8.3f} {t / t1:9.2f} {s / 2**20:10.1f} {s / s1:10.2f} {peak}")


if __name__ == "__main__":
    main()
