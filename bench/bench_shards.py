"""Teacher shards: bytes on disk per token (top-k against full-vocabulary logits), and shard write and read throughput
against what an offline KD step consumes, measured side by side in one run.

    python -m bench.bench_shards [--seq-len 256] [--k 64] [--samples 256]

1. Bytes per token: shards of top-k ids (int32) and log-probabilities (float16) written with the project's writer,
   against shards holding the full-vocabulary float16 logits per position (the alternative to top-k), for the tiny
   target's vocabulary (512) and a Llama-3 size vocabulary (128256; the full-logit side is measured on a few samples).
2. Throughput: writing shards (serialisation only, no teacher), reading them through ShardDataModule (0 and 2 worker
   processes, shuffle buffer on), and the offline KD training step of the quickstart student (kd_offline.yaml:
   2 layers, hidden 128, batch 8 x 256 tokens, sparse KD loss, AdamW) on CPU. The reader must be at least 10 times
   faster than the step consumes tokens.
"""

from __future__ import annotations

import argparse
import io
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.data.shard_datamodule import ShardDataModule, ShardLoader
from trainer.data.shards import ShardMeta, ShardWriter, encode_npy, write_manifest
from trainer.losses.distillation import sparse_kd_loss


def meta_for(vocab: int, k: int, seq_len: int) -> ShardMeta:
    return ShardMeta("bench", "0" * 64, "0" * 64, vocab, k, 1.0, seq_len)


def topk_sample(rng: np.random.Generator, vocab: int, k: int, seq_len: int) -> dict[str, np.ndarray]:
    logits = torch.from_numpy(rng.normal(size=(seq_len, vocab)).astype(np.float32) * 3)
    lp, ids = torch.log_softmax(logits, -1).topk(k, -1)  # [S, k]
    return {
        "tokens": rng.integers(0, vocab, seq_len + 1).astype(np.int32),
        "loss_mask": np.ones(seq_len, bool),
        "topk_ids": ids.to(torch.int32).numpy(),
        "topk_logprobs": lp.numpy().astype(np.float16),
    }


def write_topk(folder: Path, samples: list[dict], meta: ShardMeta, per_shard: int) -> tuple[int, float]:
    """Writes the samples as shards; returns (bytes on disk, seconds)."""
    started, infos = time.perf_counter(), []
    for j in range(0, len(samples), per_shard):
        writer = ShardWriter(folder / f"train-{j // per_shard:06d}.tar", "train", meta)
        for i, s in enumerate(samples[j : j + per_shard]):
            writer.add(f"{j + i:09d}", s)
        infos.append(writer.close())
    write_manifest(folder, meta, infos)
    return sum(i.bytes for i in infos), time.perf_counter() - started


def full_logits_bytes(folder: Path, rng: np.random.Generator, vocab: int, seq_len: int, n: int) -> int:
    """Bytes of a webdataset shard holding tokens and full-vocabulary float16 logits for n sequences."""
    path = folder / "full.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            arrays = {
                "tokens": rng.integers(0, vocab, seq_len + 1).astype(np.int32),
                "loss_mask": np.ones(seq_len, bool),
                "logits": rng.normal(size=(seq_len, vocab)).astype(np.float16),
            }
            for name, a in arrays.items():
                data = encode_npy(a)
                info = tarfile.TarInfo(f"{i:09d}.{name}.npy")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path.stat().st_size


def read_rate(folder: Path, workers: int, batch: int) -> float:
    """Tokens per second through ShardDataModule (one full epoch, batches collated to tensors)."""
    dm = ShardDataModule(str(folder), batch_size=batch, num_workers=workers, shuffle_buffer=64)
    loader = ShardLoader(dm.stream("train", batch, True, 0, 1), lambda: 0, workers)
    started, tokens = time.perf_counter(), 0
    for b in loader:
        tokens += b["input_ids"].numel()
    return tokens / (time.perf_counter() - started)


def kd_step_rate(vocab: int, k: int, seq_len: int, batch: int, steps: int) -> float:
    """Tokens per second of the offline KD step of the quickstart student (forward, sparse KD, backward, AdamW)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    student = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        samples = [topk_sample(rng, vocab, k, seq_len) for _ in range(batch)]
        batches.append(
            {
                "input_ids": torch.from_numpy(np.stack([s["tokens"][:-1] for s in samples]).astype(np.int64)),
                "ids": torch.from_numpy(np.stack([s["topk_ids"] for s in samples])),  # [B, S, k]
                "lp": torch.from_numpy(np.stack([s["topk_logprobs"] for s in samples])),  # [B, S, k]
                "mask": torch.ones(batch, seq_len, dtype=torch.bool),
            }
        )
    started = time.perf_counter()
    for step in range(steps + 1):
        if step == 1:
            started = time.perf_counter()  # the first step warms up allocators
        b = batches[step % 2]
        logits = student(input_ids=b["input_ids"]).logits  # [B, S, V]
        loss = sparse_kd_loss(logits, b["ids"], b["lp"], b["mask"], chunk_size=512).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return steps * batch * seq_len / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    s, k = args.seq_len, args.k
    rng = np.random.default_rng(0)
    print(f"teacher shards: seq_len {s}, k {k}, {args.samples} sequences\n")
    print("1. bytes on disk per token")
    print(f"  {'vocab':>7} {'top-k B/tok':>12} {'full-logits B/tok':>18} {'ratio top-k/full':>17}")
    with tempfile.TemporaryDirectory() as tmp:
        for vocab, n in ((512, 32), (128256, 2)):
            folder = Path(tmp) / f"v{vocab}"
            folder.mkdir()
            samples = [topk_sample(rng, vocab, k, s) for _ in range(n)]
            topk_bytes, _ = write_topk(folder, samples, meta_for(vocab, k, s), per_shard=n)
            full = full_logits_bytes(folder, rng, vocab, s, n)
            per_topk, per_full = topk_bytes / (n * s), full / (n * s)
            print(f"  {vocab:>7} {per_topk:>12.1f} {per_full:>18.1f} {per_topk / per_full:>17.4f}")

        print("\n2. throughput (tokens/s)")
        folder = Path(tmp) / "rw"
        folder.mkdir()
        samples = [topk_sample(rng, 512, k, s) for _ in range(args.samples)]
        total_bytes, seconds = write_topk(folder, samples, meta_for(512, k, s), per_shard=32)
        write = args.samples * s / seconds
        reads = {w: read_rate(folder, w, args.batch) for w in (0, 2)}
        step = kd_step_rate(512, k, s, args.batch, args.steps)
        print(f"  shard write (serialisation only): {write:>12,.0f}   ({total_bytes / seconds / 1e6:.0f} MB/s)")
        for w, rate in reads.items():
            print(f"  shard read, {w} workers:           {rate:>12,.0f}")
        print(f"  offline KD step consumes:         {step:>12,.0f}")
        print(f"\n  read / consume: {min(reads.values()) / step:.1f}x (slowest reader; must be >= 10x)")
        print(f"  write / consume: {write / step:.1f}x")


if __name__ == "__main__":
    main()
