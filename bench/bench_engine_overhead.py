"""Engine overhead: with an oracle proposer that is always right, every round commits K + 1 tokens, so the ideal
speedup over the target alone is K + 1 if a forward over K + 1 tokens cost the same as a forward over one. This prints
tokens per target forward (must be K + 1) and the measured wall-clock speedup against that ideal, side by side.

    python -m bench.bench_engine_overhead [--hidden 512 --layers 8 --vocab 4096 --new-tokens 96 --device cpu]

The ratio measured/ideal mixes the engine's bookkeeping (drafting, verification, cache cropping) with the extra
cost of verifying K + 1 tokens at once, which grows with K on a compute-bound CPU and stays small on a GPU.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.decoding.generate import speculative_generate
from trainer.decoding.metrics import tau
from trainer.decoding.proposers import NoProposer, OracleProposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="target hidden size")
    parser.add_argument("--layers", type=int, default=8, help="target layers")
    parser.add_argument("--vocab", type=int, default=4096, help="target vocabulary")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=96, help="generated tokens per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (the fastest is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
    )  # fmt: skip
    target = LlamaForCausalLM(config).to(args.device).eval()
    prompt = torch.randint(0, args.vocab, (args.prompt_len,), device=args.device)

    def best_time(proposer, k: int):
        runs = [speculative_generate(target, prompt, proposer, k, args.new_tokens) for _ in range(args.repeats)]
        fastest = min(runs, key=lambda r: r.total_seconds)
        return fastest.total_seconds, fastest

    best_time(NoProposer(), 1)  # warm-up
    base_seconds, base = best_time(NoProposer(), 1)
    reference = torch.cat([prompt, torch.tensor(base.tokens, device=args.device)])
    print(
        f"target: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.device}, {args.threads} "
        f"thread(s); {args.new_tokens} new tokens; target alone {base_seconds * 1e3:.1f} ms"
    )
    print("tokens/fwd: per full round (must be K + 1) and overall (the last round is cut by the budget)")
    print(
        "verify cost: mean round (forward over K + 1 tokens, acceptance, cache crop) / mean round of the target alone"
    )
    print("outside verify: share of the wall-clock time outside verification rounds (drafting, engine bookkeeping)")
    print(
        f"{'K':>3} {'tokens/fwd':>10} {'overall':>8} {'ideal':>6} {'measured':>9} {'measured/ideal':>15} "
        f"{'verify cost':>11} {'outside verify':>14}"
    )
    base_fwd = (base.target_seconds - base.prefill_seconds) / (base.target_forwards - 1)
    for k in (1, 2, 4, 8):
        seconds, result = best_time(OracleProposer(reference, args.prompt_len), k)
        if result.tokens != base.tokens:
            raise SystemExit(f"K={k}: output differs from the target alone")
        full = [r.committed for r in result.rounds if r.drafted == k]
        assert all(c == k + 1 for c in full), "an always-right proposer must commit K + 1 tokens per forward"
        speedup = base_seconds / seconds
        per_full, ratio = sum(full) / len(full), speedup / (k + 1)
        fwd = (result.target_seconds - result.prefill_seconds) / (result.target_forwards - 1) / base_fwd
        outside = 1 - result.target_seconds / result.total_seconds
        print(
            f"{k:>3} {per_full:>10.2f} {tau(result.rounds):>8.2f} {k + 1:>6} {speedup:>8.2f}x {ratio:>15.2f} "
            f"{fwd:>11.2f} {outside:>14.1%}"
        )


if __name__ == "__main__":
    main()
