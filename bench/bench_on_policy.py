"""Where an on-policy distillation step spends its time: the student's generation against the training pass.

Builds teachers at the tiny target's sizes (random weights, saved to a temporary folder; the timing does not depend on
the weights as long as generation runs to max_new_tokens, which it does here: no EOS is ever sampled, it is suppressed)
and the quickstart recipe's student, then times, side by side in one process and median over repetitions:

- generate: ``OnPolicyDistillation.generate`` (student in eval mode, KV cache, sampling), prompts of ``prompt_len``;
- train:    ``distill`` forward + backward + AdamW step on the generated [prompt + generated] sequences;
- data:     the same training pass on a data set batch of seq_len tokens (the step taken when the coin says no).

It prints the generation / training ratio of an on-policy step and the on-policy step / data step ratio, so that the
cost of lmbda can be read off: an epoch at lmbda costs about (1 - lmbda) + lmbda * (on-policy / data) data steps.

    python -m bench.bench_on_policy                     # tiny target 4x256 and 2x128 student, B=8, 32 + 64 tokens
    python -m bench.bench_on_policy --max-new-tokens 128 --batch-size 4
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.methods.draft_model.on_policy import OnPolicyDistillation

TARGETS = {  # name: (layers, hidden, intermediate, heads)
    "test": (2, 64, 128, 4),
    "quickstart": (4, 256, 688, 4),
}
STUDENT = {  # recipes/quickstart/on_policy.yaml
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def bench(name: str, args: argparse.Namespace, folder: str) -> dict[str, float]:
    layers, hidden, inter, heads = TARGETS[name]
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        eos_token_id=None,  # generation always runs to max_new_tokens: the worst case, and a stable timing
        pad_token_id=0,
    )
    torch.manual_seed(0)
    path = f"{folder}/{name}"
    LlamaForCausalLM(config).save_pretrained(path)
    model = OnPolicyDistillation(
        target=path,
        drafter_config=STUDENT,
        lmbda=1.0,
        max_new_tokens=args.max_new_tokens,
        prompt_len=args.prompt_len,
        loss_chunk_size=512,
    ).train()
    optimizer = torch.optim.AdamW(model.student.parameters(), lr=1e-4)
    B, S = args.batch_size, args.seq_len
    ids = torch.randint(1, args.vocab, (B, S))
    batch = {"input_ids": ids, "labels": ids, "loss_mask": torch.ones(B, S, dtype=torch.bool)}

    def train(input_ids, loss_mask):
        def step():
            loss = model.distill(input_ids, loss_mask).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return step

    gen_s, gen = timed(lambda: model.generate(model.student, batch, sample_seed=0), args.repeats)
    train_s, _ = timed(train(gen.input_ids, gen.loss_mask), args.repeats)
    data_s, _ = timed(train(batch["input_ids"], batch["loss_mask"]), args.repeats)
    return {
        "generate_s": gen_s,
        "train_s": train_s,
        "data_s": data_s,
        "generated": float(gen.generated_lengths.float().mean()),
        "seq": gen.input_ids.shape[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens of a data set row")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    args = parser.parse_args()
    print(
        f"B={args.batch_size}, prompt {args.prompt_len} + {args.max_new_tokens} generated tokens, data rows of "
        f"{args.seq_len}, vocab {args.vocab}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    header = f"{'target':<11} {'generate s':>10} {'train s':>8} {'gen/train':>9} {'on-policy s':>11} {'data s':>7}"
    print(header + f" {'on-policy/data':>14}")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.targets:
            r = bench(name, args, folder)
            step = r["generate_s"] + r["train_s"]
            print(
                f"{name:<11} {r['generate_s']:>10.3f} {r['train_s']:>8.3f} {r['generate_s'] / r['train_s']:>9.2f} "
                f"{step:>11.3f} {r['data_s']:>7.3f} {step / r['data_s']:>14.2f}"
            )


if __name__ == "__main__":
    main()
