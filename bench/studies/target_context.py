"""The target's own next-token loss by position, on held-out documents: how long a context the target is good for.

    python -m bench.studies.target_context [--model artifacts/tiny_target] [--length 4096] [--bucket 256]

Needs the demo's corpus and target (``make demo``). A drafter's acceptance at a context length is only meaningful
where its target still predicts well, so the demo target's context (``max_position_embeddings``) is chosen by this
measurement: every held-out document of at least ``--length`` tokens is read whole (its first ``--length`` tokens, one
teacher-forced forward, float32), and its per-token cross entropy is averaged per ``--bucket`` positions, pooled over
the documents. The model's ``max_position_embeddings`` is set to ``--length`` in memory for the run: with the default
rotary embedding it bounds the positions used and changes no weight. Writes OUT/target_context.md and .png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bench.common import ROOT


def loss_by_position(model, documents: list[list[int]], length: int) -> torch.Tensor:
    """[length - 1] the mean next-token cross entropy at each position over ``documents`` (their first ``length``)."""
    total = torch.zeros(length - 1, dtype=torch.float64)
    for ids in documents:
        row = torch.tensor(ids[:length]).unsqueeze(0)  # [1, L]
        with torch.no_grad():
            logits = model(input_ids=row).logits[0, :-1].float()  # [L - 1, V]
        total += F.cross_entropy(logits, row[0, 1:], reduction="none").double()  # [L - 1]
    return total / len(documents)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "artifacts/tiny_target"))
    parser.add_argument("--documents", default=str(ROOT / "artifacts/corpus/heldout.jsonl"))
    parser.add_argument("--length", type=int, default=4096, help="tokens read from every document that long")
    parser.add_argument("--bucket", type=int, default=256, help="positions per row of the table")
    parser.add_argument("--out", default=str(ROOT / "artifacts/studies/target_context"))
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = [json.loads(line)["text"] for line in Path(args.documents).read_text().splitlines() if line.strip()]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    documents = [d for d in ids if len(d) >= args.length]
    if not documents:
        raise SystemExit(f"no document of {args.documents} has {args.length} tokens (longest: {max(map(len, ids))})")
    config = AutoConfig.from_pretrained(args.model)
    trained_positions = config.max_position_embeddings
    config.max_position_embeddings = max(trained_positions, args.length)
    model = AutoModelForCausalLM.from_pretrained(args.model, config=config).eval()
    start = time.perf_counter()
    losses = loss_by_position(model, documents, args.length)  # [L - 1]
    seconds = time.perf_counter() - start

    rows = []
    for lo in range(0, args.length - 1, args.bucket):
        hi = min(lo + args.bucket, args.length - 1)
        rows.append((lo, hi, float(losses[lo:hi].mean())))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shown = Path(args.model).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    lines = [
        f"The target's next-token loss by position: {shown}, {len(documents)} held-out documents of at least "
        f"{args.length} tokens, each read whole from its first token (its config's max_position_embeddings "
        f"{trained_positions}, raised to {config.max_position_embeddings} in memory), {seconds:.0f} s.",
        "",
        "| positions | loss (nats/token) |",
        "|---|---|",
        *[f"| {lo}-{hi - 1} | {loss:.3f} |" for lo, hi, loss in rows],
    ]
    (out / "target_context.md").write_text("\n".join(lines) + "\n")
    (out / "target_context.json").write_text(json.dumps({"documents": len(documents), "rows": rows}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([(lo + hi) / 2 for lo, hi, _ in rows], [loss for *_, loss in rows], marker="o")
    ax.set_xlabel("position in the document")
    ax.set_ylabel("target loss (nats/token)")
    ax.set_title(f"target loss by position ({len(documents)} documents)")
    fig.tight_layout()
    fig.savefig(out / "target_context.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
