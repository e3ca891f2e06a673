"""Training-time test cost against the drafted tokens K: step time and memory of an EAGLE-3 training step, with and
without recomputing the earlier TTT steps in backward (``model.recompute``), beside P-EAGLE drafting the same K in one
parallel pass (``num_depths`` K, COD sampling at the recipe's 0.7 / 0.2 and with every element kept, ``cod_ratio`` 1).

    python -m bench.bench_eagle3_ttt [--hidden 256] [--layers 4] [--vocab 8192] [--seq-len 256] [--batch 2]

A random Llama target of the given shape is saved to a temporary directory; for K = 1, 3, 7, each configuration's
forward and backward is timed (median of a few, the configurations taking turns so that load changes hit all alike)
and its memory measured once under the profiler: ``held``, the bytes allocated during the forward pass and still alive
when backward starts (what the step keeps for backward: saved activations, and with recomputation each step's inputs
and outputs), and ``peak``, the highest allocation above the start during forward and backward (on CUDA, the
allocator's own peak). Printed as ratios to EAGLE-3 at K = 1 without recomputation (K = 1 recomputes nothing either
way: its only step is the last one). COD sampling draws its elements anew each step: P-EAGLE's times are a median over
draws, its memory one draw.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.common import step_memory
from trainer.methods.eagle3.objective import Eagle3
from trainer.methods.peagle.objective import PEagle

COD = {"cod 0.7/0.2": (0.7, 0.2), "cod 1": (1.0, 1.0)}  # P-EAGLE's configurations: (cod_ratio, cod_min_ratio)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
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
        objectives: dict[tuple[str, int, str], Eagle3 | PEagle] = {}
        for recompute in (False, True):
            for k in (1, 3, 7):
                objective = Eagle3(target_dir, draft_vocab_size=args.draft_vocab, ttt_steps=k, recompute=recompute)
                objective.build_vocab_map(rows, np.ones_like(rows, dtype=bool))
                objectives[("eagle3", k, "recompute" if recompute else "no recompute")] = objective.to(device)
        for name, (ratio, floor) in COD.items():
            for k in (1, 3, 7):
                objective = PEagle(
                    target_dir, num_depths=k, cod_ratio=ratio, cod_min_ratio=floor, mask_token_id=args.vocab - 1,
                    draft_vocab_size=args.draft_vocab,
                )  # fmt: skip
                objective.install_vocab_map([(rows, np.ones_like(rows, dtype=bool))])
                objectives[("peagle", k, name)] = objective.to(device)

        def step(objective: Eagle3 | PEagle) -> None:
            loss, _ = objective.compute_loss(batch)
            loss.backward()

        times: dict[tuple[str, int, str], list[float]] = {key: [] for key in objectives}
        for objective in objectives.values():
            step(objective)  # warm-up
        for _ in range(args.repeats):  # round-robin, so that load changes hit every configuration alike
            for key, objective in objectives.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(objective)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[key].append(time.perf_counter() - t0)
        results = {}
        for key, objective in objectives.items():
            objective.drafter.zero_grad(set_to_none=True)  # gradients of earlier steps would count as held
            held, peak = step_memory(lambda o=objective: o.compute_loss(batch)[0], device)
            results[key] = (statistics.median(times[key]), held, peak)
    t1, h1, p1 = results[("eagle3", 1, "no recompute")]
    print(
        f"EAGLE-3 TTT and P-EAGLE steps on {device}: target {args.layers}x{args.hidden}, vocab {args.vocab}, draft "
        f"vocab {args.draft_vocab}, batch {args.batch} x {args.seq_len}; ratios to EAGLE-3 at K = 1"
    )
    header = f"{'method':>7} {'K':>3} {'setting':>13} {'step s':>8} {'time/K=1':>9} {'held MiB':>9} {'held/K=1':>9}"
    print(header + f" {'peak MiB':>9} {'peak/K=1':>9}")
    for (method, k, setting), (t, h, p) in results.items():
        print(
            f"{method:>7} {k:>3} {setting:>13} {t:8.3f} {t / t1:9.2f} {h / 2**20:9.1f} {h / h1:9.2f} "
            f"{p / 2**20:9.1f} {p / p1:9.2f}"
        )


if __name__ == "__main__":
    main()
