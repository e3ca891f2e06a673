"""Decoding speed of the target session's own layer loop against the model's own forward (the engine before the
session), side by side, prompt lookup at K = 4 on the tiny target.

    python -m bench.bench_session [--target artifacts/tiny_target] [--prompts 10] [--repeats 3]

Both paths run the same engine (trainer/decoding/generate.py); ``TargetSession(sliced=False)`` runs every forward
through the HF model's ``forward`` (what the engine did before the session), ``sliced=True`` through the session's
own loop over the decoder layers (which makes slices and verification from layer E possible). Runs alternate prompt
by prompt (A B, then B A), so load changes on a shared machine hit both; the table gives tokens/s of each and the
median and spread of the per-prompt ratio. Outputs must be identical (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import PromptLookupProposer
from trainer.decoding.session import TargetSession


def load(target: str, prompts: int, chars: int):
    """The tiny target and its held-out prompts (``make demo`` writes both), or a random model of its shape."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(target)
    heldout = path.parent / "corpus" / "heldout.jsonl"
    if (path / "config.json").is_file() and heldout.is_file():
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        lines = heldout.read_text().splitlines()[:prompts]
        ids = [tokenizer(json.loads(line)["text"][:chars]).input_ids for line in lines]
        return model, [torch.tensor(i) for i in ids], f"the tiny target ({path})"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    return model, [torch.randint(0, 8192, (48,)) for _ in range(prompts)], "a random model of the tiny target's shape"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="artifacts/tiny_target", help="HF target folder (make demo writes it)")
    parser.add_argument("--prompts", type=int, default=10, help="held-out prompts")
    parser.add_argument("--chars", type=int, default=160, help="characters of each held-out file used as its prompt")
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens generated per prompt")
    parser.add_argument("--k", type=int, default=4, help="drafts per round")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompts")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, prompts, what = load(args.target, args.prompts, args.chars)
    sessions = {"model forward": TargetSession(model, sliced=False), "session loop": TargetSession(model, sliced=True)}
    tokens = dict.fromkeys(sessions, 0)
    seconds = dict.fromkeys(sessions, 0.0)
    ratios = []
    for repeat in range(args.repeats + 1):  # pass 0 warms up
        for i, prompt in enumerate(prompts):
            order = list(sessions) if (repeat + i) % 2 == 0 else list(reversed(sessions))
            outputs, elapsed = {}, {}
            for name in order:
                start = time.perf_counter()
                result = speculative_generate(sessions[name], prompt, PromptLookupProposer(), args.k, args.new_tokens)
                elapsed[name] = time.perf_counter() - start
                outputs[name] = result.tokens
            if outputs["model forward"] != outputs["session loop"]:
                raise SystemExit(f"prompt {i}: the two paths decoded different tokens")
            if repeat == 0:
                continue
            for name in sessions:
                tokens[name] += len(outputs[name])
                seconds[name] += elapsed[name]
            ratios.append(elapsed["model forward"] / elapsed["session loop"])
    rates = {name: tokens[name] / seconds[name] for name in sessions}
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"{what}, prompt lookup K={args.k}, {len(prompts)} prompts x {args.repeats} passes, {args.threads} thread(s)")
    print("| path | tokens/s |")
    print("|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} |")
    print(
        f"session loop / model forward speed: {rates['session loop'] / rates['model forward']:.3f} overall, "
        f"per-prompt median {statistics.median(ratios):.3f} (quartiles {quartiles[0]:.3f} to {quartiles[2]:.3f}); "
        "outputs identical"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
