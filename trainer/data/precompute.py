"""``draftsmith precompute --config recipe.yaml --output_dir DIR``: the target's top-k log-probabilities (and optionally
hidden states) for every sequence of a recipe's data, written as webdataset shards (schema: trainer/data/shards.py).

The recipe names ``target``, a ``data`` section (a TextDataModule, exactly as in a fit recipe) and the options below;
see recipes/quickstart/precompute.yaml. Every option is also a command-line flag (``--top_logprobs 512``).

Sharding: the sequences of each split (in data-set order, never shuffled) are cut into shards of
``samples_per_shard``; work item ``g`` (train shards first, then val) is written by rank ``g % world``. Rank and world
come from RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS (srun); the shard set does not depend on them, so a
rerun with another number of processes resumes the same plan.

Resume: a shard is written as ``.partial`` and renamed when complete, then its sidecar ``.tar.json`` is written; a
rerun keeps every shard with a sidecar (and the recorded size) and rewrites the rest. A rerun with different options
is refused. The process that finishes with every shard present writes ``manifest.json``; a rerun over a finished
folder only rewrites the manifest.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser

from trainer.data.shards import (
    HIDDEN_DTYPES,
    META,
    ShardMeta,
    ShardWriter,
    _atomic_write_text,
    finished_shard,
    target_fingerprint,
    write_manifest,
)
from trainer.data.text import TextDataModule
from trainer.data.tokenizer import tokenizer_hash
from trainer.data.vocab import load_tokenizer_if_present, shared_vocab_size
from trainer.interface.errors import UsageError
from trainer.interface.flags import command_line
from trainer.interface.output import CountProgress, block, duration
from trainer.interface.renamed_keys import renamed_precompute_key_message
from trainer.models.target import FrozenTarget

log = logging.getLogger(__name__)


def rank_and_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's or SLURM's environment; (0, 1, 0) when neither is set."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def precompute(
    data: TextDataModule,
    target: str,
    output_dir: str,
    top_logprobs: int = 64,
    temperature: float = 1.0,
    hidden_layers: list[int] | None = None,
    hidden_dtype: Literal["float16", "bfloat16", "float32"] = "bfloat16",
    logprob_dtype: Literal["float16", "float32"] = "float16",
    samples_per_shard: int = 256,
    batch_size: int = 8,
    target_dtype: str = "float32",
    splits: list[Literal["train", "val"]] | None = None,
    device: str = "auto",
    trust_remote_code: bool = False,
    progress: bool = True,
) -> dict[str, int]:
    """Writes this rank's shards (skipping finished ones) and, when all are present, the manifest.

    Args:
        data: the recipe's text datamodule; its train (and val) rows are the sequences, in data-set order.
        target: the target, an HF causal LM directory or hub id (its tokenizer is expected beside it).
        output_dir: the shard folder.
        top_logprobs: target log-probabilities kept per position (the most likely ids); the vocabulary's size keeps
            all.
        temperature: the log-probabilities are log_softmax(logits / temperature); training must use the same.
        hidden_layers: HF hidden_states indices to store (0 embeddings, L the final normed output); None stores none.
        hidden_dtype: storage dtype of hidden states: bfloat16, float16, or float32 (twice the bytes; exact).
        logprob_dtype: storage dtype of the top-k log-probabilities (float16 halves the bytes; float32 is exact).
        samples_per_shard: sequences per shard; use at least nodes x GPUs x workers shards per split for training.
        batch_size: sequences per target forward.
        target_dtype: the target's weights dtype (float32, bfloat16, float16).
        splits: which of the datamodule's splits to write (default: train, and val when the data has one).
        device: "auto" (cuda:LOCAL_RANK when available, else cpu), or a torch device string.
        trust_remote_code: allow custom modelling code in the target directory.
        progress: show the progress on rank 0: a bar on a terminal, else a line (sequences/s, elapsed, ETA) every
            tenth of the sequences and at least every two minutes.
    """
    if top_logprobs < 1 or samples_per_shard < 1 or batch_size < 1 or temperature <= 0:
        raise UsageError(
            f"top_logprobs, samples_per_shard, batch_size and temperature must be positive: {top_logprobs=}, "
            f"{samples_per_shard=}, {batch_size=}, {temperature=}"
        )
    if data.document_masking:
        raise UsageError(
            "data.document_masking=true: precomputed shards store no document boundaries (the target would run across "
            "documents); set data.document_masking=false, or train online"
        )
    if data.long_seq_len is not None:
        raise UsageError(
            f"data.long_seq_len={data.long_seq_len}: precomputed shards hold rows of one length (data.seq_len); "
            "set data.long_seq_len=null"
        )
    rank, world, local_rank = rank_and_world()
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    data.setup("fit")
    rows = {"train": data.train_dataset}
    if data.val_dataset is not None:
        rows["val"] = data.val_dataset
    for split in splits or list(rows):
        if split not in rows:
            raise UsageError(f"splits: the data has no {split!r} split (it has {sorted(rows)})")
    rows = {s: rows[s] for s in (splits or list(rows))}

    frozen = FrozenTarget.from_pretrained(target, target_dtype, trust_remote_code).to(device)
    target_tok = load_tokenizer_if_present(target)
    vocab = shared_vocab_size(
        target,
        target_tok,
        frozen.vocab_size,
        f"the data's tokenizer {data.tokenizer_path}",
        data.tokenizer,
        frozen.vocab_size,
    )
    if top_logprobs > vocab:
        raise UsageError(f"top_logprobs={top_logprobs} exceeds the vocabulary ({vocab} tokens)")
    layers = list(hidden_layers or [])
    for i in layers:
        if not 0 <= i <= frozen.num_layers:
            raise UsageError(f"hidden_layers: {i} is outside the target's hidden_states 0..{frozen.num_layers}")
    meta = ShardMeta(
        teacher=str(target),  # the shard format's field names
        teacher_fingerprint=target_fingerprint(target),
        tokenizer_hash=tokenizer_hash(data.tokenizer),
        vocab_size=vocab,
        k=top_logprobs,
        temperature=float(temperature),
        seq_len=data.seq_len,
        logprob_dtype=logprob_dtype,
        hidden_layers=layers,
        hidden_size=int(frozen.config.hidden_size) if layers else 0,
        hidden_dtype=hidden_dtype,
    )
    _check_or_write_meta(folder, meta)

    plan = [(s, j) for s, ds in rows.items() for j in range(-(-len(ds) // samples_per_shard))]
    mine = [(s, j) for g, (s, j) in enumerate(plan) if g % world == rank]
    todo = [(s, j) for s, j in mine if finished_shard(folder / f"{s}-{j:06d}.tar") is None]
    n_todo = sum(min(samples_per_shard, len(rows[s]) - j * samples_per_shard) for s, j in todo)
    log.info(
        "rank %d/%d: %d of %d shards to write (%d kept), %d sequences",
        rank,
        world,
        len(todo),
        len(mine),
        len(mine) - len(todo),
        n_todo,
    )
    bar = CountProgress("precompute", n_todo, "seq") if progress and rank == 0 else None
    started, written = time.perf_counter(), 0
    for split, j in todo:
        ds = rows[split]
        lo, hi = j * samples_per_shard, min(len(ds), (j + 1) * samples_per_shard)
        writer = ShardWriter(folder / f"{split}-{j:06d}.tar", split, meta)
        try:
            for start in range(lo, hi, batch_size):
                idx = list(range(start, min(hi, start + batch_size)))
                for i, arrays in zip(idx, _target_signals(frozen, ds, idx, meta, device), strict=True):
                    writer.add(f"{i:09d}", arrays)
                if bar is not None:
                    bar.update(len(idx))
                written += len(idx)
        except BaseException:
            writer.abort()
            raise
        writer.close()
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - started
    finished = [finished_shard(folder / f"{s}-{j:06d}.tar") for s, j in plan]
    if all(f is not None for f in finished):
        write_manifest(folder, meta, finished)  # type: ignore[arg-type]
        log.info("manifest written: %d shards", len(finished))
    else:
        log.info("rank %d done; %d shards still missing (other ranks)", rank, sum(f is None for f in finished))
    return {
        "written": written,
        "shards": len(todo),
        "kept": len(mine) - len(todo),
        "seconds": int(elapsed),
        "complete": int(all(f is not None for f in finished)),
    }


def _check_or_write_meta(folder: Path, meta: ShardMeta) -> None:
    path = folder / META
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(key for key, value in meta.to_dict().items() if old.get(key) != value)
        if diff:
            raise UsageError(
                f"{path}: this folder holds shards made with other settings ({', '.join(diff)} differ): "
                f"use a new --output_dir folder or delete it"
            )
        return
    _atomic_write_text(path, json.dumps(meta.to_dict(), indent=1))


@torch.no_grad()
def _target_signals(target: FrozenTarget, ds, idx: list[int], meta: ShardMeta, device: str) -> list[dict]:
    """The sample arrays of the rows ``idx``: one target forward over the batch."""
    tokens = np.stack([np.asarray(ds.ids[i], dtype=np.int32) for i in idx])  # [B, S + 1]
    mask = np.stack([np.asarray(ds.trained[i, 1:], dtype=bool) for i in idx])  # [B, S]
    input_ids = torch.from_numpy(tokens[:, :-1].astype(np.int64)).to(device)  # [B, S]
    out = target(input_ids, hidden_layers=meta.hidden_layers)
    logits = out.logits[..., : meta.vocab_size].float() / meta.temperature  # [B, S, V]
    lp, ids = torch.log_softmax(logits, dim=-1).topk(meta.k, dim=-1)  # [B, S, k] each, descending
    lp = lp.cpu().numpy().astype(np.float16 if meta.logprob_dtype == "float16" else np.float32)
    ids = ids.to(torch.int32).cpu().numpy()
    hidden = []
    for h in out.hidden_states:  # each [B, S, H]
        if meta.hidden_dtype == "bfloat16":
            hidden.append(h.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(HIDDEN_DTYPES["bfloat16"]))
        else:
            hidden.append(h.to(getattr(torch, meta.hidden_dtype)).cpu().numpy())  # float16 or float32
    samples = []
    for b in range(len(idx)):
        arrays = {"tokens": tokens[b], "loss_mask": mask[b], "topk_ids": ids[b], "topk_logprobs": lp[b]}
        for layer, h in zip(meta.hidden_layers, hidden, strict=True):
            arrays[f"hidden_{layer}"] = h[b]
        samples.append(arrays)
    return samples


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="draftsmith precompute", description=__doc__.split("\n\n")[0], default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="the precompute recipe (YAML)")
    parser.add_function_arguments(precompute, fail_untyped=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.exit_on_error = False  # a renamed key (teacher: target) is refused with its new name, exit status 2
    try:
        tokens, refusal = command_line("draftsmith precompute", argv, precompute)
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 2
        cfg = parser.parse_args(tokens)
    except ArgumentError as err:
        parser.exit_on_error = True
        parser.error(renamed_precompute_key_message(str(err)) or str(err), err.__cause__ or err)
    init = parser.instantiate_classes(cfg)
    kwargs = {name: init[name] for name in inspect.signature(precompute).parameters}
    summary = precompute(**kwargs)
    if rank_and_world()[0] != 0:
        return 0
    rows = [
        ("sequences", f"{summary['written']} written in {summary['shards']} shards ({summary['kept']} kept)"),
        ("manifest", "written" if summary["complete"] else "pending (other ranks still running)"),
        ("shards", str(cfg.output_dir)),
    ]
    args = list(sys.argv[1:] if argv is None else argv)
    recipes = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    fit_recipe = _fit_recipe_for(recipes[-1]) if recipes else None
    command = (
        f"draftsmith fit --config {shlex.quote(fit_recipe or 'RECIPE.yaml')} "
        f"--data.init_args.shards {shlex.quote(str(cfg.output_dir))}"
    )
    print(block(f"precompute done in {duration(summary['seconds'])}", rows, [command]), flush=True)
    return 0


def _fit_recipe_for(precompute_recipe: str) -> str | None:
    """The fit recipe beside ``precompute_recipe`` whose opening comment names it (``draftsmith precompute --config
    <it>``: the offline recipes say which shards they read), or None."""
    recipe = Path(precompute_recipe)
    for candidate in sorted(recipe.parent.glob("*.yaml")):
        head = candidate.read_text(errors="replace").split("\n", 12)[:12]
        if (
            head
            and head[0].startswith("# draftsmith fit")
            and any(f"draftsmith precompute --config {precompute_recipe} " in line + " " for line in head)
        ):
            return str(candidate)
    return None
