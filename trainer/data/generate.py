"""``draftsmith generate``: regenerate a data set's responses with the target itself.

A drafter is judged by how often the target accepts its tokens, so it should learn what the target actually says, not
what the data set's original authors wrote.

Chat mode (the default): every conversation keeps its system and user turns; each assistant turn is replaced, in
order, by the target's own reply to the conversation so far (later turns see the regenerated earlier ones). Prompts go
through the target tokenizer's chat template with the generation prompt, in left-padded batches; replies stop at EOS
or after ``max_new_tokens`` (then they are cut there; the chat template closes them with EOS).

Completion mode (``prompt_field`` set, for base models without a chat template): each record holds a plain-text
prompt; the output record adds ``text``, the prompt followed by the target's continuation (tokenized as the
evaluation tokenizes prompts, decoded without special tokens), which ``TextDataModule(format="text")`` trains on.

Output: ``.jsonl`` (one record per line) or ``.parquet``, the input records with their messages replaced (or their
``text`` added), in input order: ``TextDataModule`` reads either.

Resuming. Records are written in chunks of ``chunk_size``. A jsonl output is appended and fsynced chunk by chunk; on a
restart a partial last line (a crash mid-write) is cut off and the records already written are skipped. A parquet
output is written as atomically renamed part files in ``OUTPUT.parts/`` and combined into OUTPUT at the end. A
``OUTPUT.meta.json`` beside the output records the input and the settings; a restart with different ones is refused
(delete the output to start over). Nothing is written before the target has loaded: a ``--target`` that is not a
local model folder or hub id (a misspelled path) is an error that leaves no output and no meta file. Sampling is
seeded per chunk from ``seed`` and the chunk's first record, so a run resumed at a chunk boundary samples as a
straight one would on the same hardware (greedy decoding always matches).

With ``server`` (a running vLLM, SGLang or ``transformers serve``), the replies come from the server's
OpenAI-compatible API instead (:mod:`trainer.data.server_client`): ``concurrency`` records in flight, the server's
chat template, the same output, chunks and resume rule. The model it serves is checked against ``target`` before
anything is written, and the meta file records the server and model.

The in-process replies are target_replies.py's; the record checks, chunks and the durable writer generate_io.py's.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from trainer.data.generate_io import (
    Chunk,
    ChunkWriter,
    OutputLock,
    check_messages,
    check_prompt,
    chunk_ranges,
    write_meta,
)
from trainer.data.server_client import OpenAIClient, RecordReply, ServerRegenerator, ordered_map, served_model
from trainer.data.target_replies import Regenerator, complete_records, load_target, regenerate_records, seed_of
from trainer.interface.errors import DataError, PathError, UsageError
from trainer.interface.flags import command_line
from trainer.interface.output import CountProgress, block, duration, rate

log = logging.getLogger(__name__)

META_VERSION = 1


@dataclass
class GenerateStats:
    """What a run did: records in the output, records written now, replies (assistant turns or completions)
    generated and how many were cut at max_new_tokens, the tokens generated (EOS included) and the records with an
    empty reply (indices into the input)."""

    records: int
    written: int
    turns: int
    truncated: int
    seconds: float
    tokens: int = 0
    empty: list[int] = field(default_factory=list)


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a .jsonl, .json (a list of objects) or .parquet file, with errors naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise PathError(f"input file not found: {path}")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        records = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{n}: not a JSON record ({err})") from err
    elif suffix == ".json":
        records = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(records, list):
            raise DataError(f"{path}: a .json input must hold a list of records")
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(p).to_pylist()
    else:
        raise DataError(f"{path}: unsupported input type {suffix!r} (use .jsonl, .json or .parquet)")
    for n, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {n} is not an object")
    return records


# ---------------------------------------------------------------------------------------------------------------------
# Generation.


def regenerate(
    target: str,
    input_file: str,
    output_file: str,
    messages_field: str = "messages",
    prompt_field: str | None = None,
    batch_size: int = 16,
    chunk_size: int = 64,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    target_dtype: str = "float32",
    device: str = "auto",
    max_records: int | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    server: str | None = None,
    served_model_name: str | None = None,
    concurrency: int = 8,
    api_key_env: str | None = None,
    timeout: float = 600.0,
    retries: int = 6,
    retry_wait: float = 1.0,
    allow_model_mismatch: bool = False,
) -> GenerateStats:
    """Regenerates the assistant turns of a chat data set with ``target``.

    Args:
        target: the target, an HF causal LM directory or hub id with its tokenizer (and chat template) beside it.
            With ``server``: the target the data is for, checked against the model the server serves.
        input_file: the chat data set: .jsonl, .json or .parquet records holding a message list.
        output_file: where the regenerated records go: .jsonl or .parquet (resumed when it exists).
        messages_field: key of the message list ({"role", "content"} dicts) in each record.
        prompt_field: completion mode: the key of a plain-text prompt in each record; the output adds ``text``,
            the prompt and the target's continuation (no chat template; for base models). None: chat mode.
        batch_size: prompts per generate call (in-process only).
        chunk_size: records written (and fsynced) at a time; the unit of resumption.
        max_new_tokens: longest reply, in tokens; longer replies are cut there.
        temperature: sampling temperature; 0 decodes greedily.
        top_p: nucleus sampling threshold (1 keeps every token); used only when sampling.
        top_k: keep only the k most likely tokens (0 keeps every token); used only when sampling (with
            ``server``, sent only when set: vLLM and SGLang take it, ``transformers serve`` refuses it).
        seed: seeds the sampling of each chunk (with ``server``: of each request).
        target_dtype: the target's weights dtype (float32, bfloat16, float16; in-process only).
        device: "auto" (cuda when available), "cpu", "cuda" or "cuda:N" (in-process only).
        max_records: regenerate only the first N records.
        trust_remote_code: allow custom modelling code in the target directory (off by default; in-process only).
        progress: show the progress: a bar on a terminal, else a line (records/s, tokens/s, elapsed, ETA) every
            tenth of the records and at least every two minutes.
        server: the base URL of a running OpenAI-compatible server (vLLM, SGLang, ``transformers serve``), such
            as ``http://localhost:8000``: replies come from its API instead of an in-process target.
        served_model_name: with ``server``, the model name to request; None: the one model the server lists.
        concurrency: with ``server``, requests in flight at once.
        api_key_env: with ``server``, the environment variable holding its API key (None: no key sent).
        timeout: with ``server``, seconds one request may take before it is retried.
        retries: with ``server``, how many times a request is tried again after a connection error, a timeout,
            HTTP 429 or 5xx, before the run ends (finished chunks stay written; a rerun resumes).
        retry_wait: with ``server``, the first pause between tries in seconds; it doubles at each try (up to 30).
        allow_model_mismatch: with ``server``, accept a served model whose name is not the target's.
    """
    started = time.perf_counter()
    settings = {
        "batch_size": batch_size,
        "chunk_size": chunk_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
    }
    for key, value in settings.items():
        if value < 0 or (key in ("batch_size", "chunk_size", "max_new_tokens") and value < 1):
            raise UsageError(f"generate: {key}={value} is out of range")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"generate: top_p={top_p} must lie in (0, 1]")
    _check_server_options(server, served_model_name, concurrency, api_key_env, timeout, retries, retry_wait)
    out_path = Path(output_file)
    writer = ChunkWriter(out_path)
    records = read_records(input_file)
    if max_records is not None:
        records = records[:max_records]
    if not records:
        raise DataError(f"{input_file}: no records to regenerate")
    for n, record in enumerate(records):
        if prompt_field is None:
            check_messages(record, messages_field, f"{input_file} record {n}")
        else:
            check_prompt(record, prompt_field, f"{input_file} record {n}")

    client, model = None, served_model_name
    if server is not None:  # asked before anything is written: a wrong URL, key or model leaves no output
        client = OpenAIClient(server, api_key_env, timeout, retries, retry_wait)
        model = served_model(client, served_model_name, target, allow_model_mismatch)
    stat = Path(input_file).stat()
    meta = {
        "version": META_VERSION,
        "input": str(Path(input_file).resolve()),
        "input_size": stat.st_size,
        "input_mtime_ns": stat.st_mtime_ns,
        "target": target,
        "messages_field": messages_field,
        "prompt_field": prompt_field,
        "seed": seed,
        "records": len(records),
        **{k: v for k, v in settings.items() if k != "batch_size"},
    }
    if client is not None:  # which server answered (its URL may change between resumed runs) and which model
        meta.update(server_model=model, servers=[client.base])
    meta_path = out_path.with_name(out_path.name + ".meta.json")
    # Nothing is written before the target loads: a target that does not load leaves no output and no meta file.
    done = writer.done(repair=False) if meta_path.is_file() else 0
    if meta_path.is_file():
        previous = json.loads(meta_path.read_text())
        meta["servers"] = list(dict.fromkeys([*previous.get("servers", []), *meta.get("servers", [])])) or None
        changed = sorted(k for k in meta.keys() | previous.keys() if k != "servers" and meta.get(k) != previous.get(k))
        if changed:
            raise UsageError(
                f"{output_file} was started with other settings ({', '.join(changed)} differ, see {meta_path}): "
                f"delete the output and {meta_path.name} to start over, or rerun with the same settings"
            )
    elif out_path.exists() or writer.parts.exists():
        raise UsageError(f"{output_file} exists without {meta_path.name}: it was not written by this tool; move it")
    if done > len(records):
        raise DataError(f"{output_file} holds {done} records but {input_file} only {len(records)}")

    if client is None:
        chunks = _in_process_chunks(
            records, done, target, input_file, messages_field, prompt_field, batch_size, chunk_size, max_new_tokens,
            temperature, top_p, top_k, seed, target_dtype, device, trust_remote_code,
        )  # fmt: skip
    else:
        regenerator = ServerRegenerator(client, model, max_new_tokens, temperature, top_p, top_k, seed, input_file)
        chunks = _server_chunks(records, done, regenerator, messages_field, prompt_field, chunk_size, concurrency)
    first = next(chunks, None)  # in-process: the target has loaded
    out_path.parent.mkdir(parents=True, exist_ok=True)
    lock = OutputLock(out_path)
    lock.acquire()
    try:
        if (writer.done(repair=False) if meta_path.is_file() else 0) != done:
            raise UsageError(f"{output_file}: another run wrote records while this one started; rerun to resume")
        if meta_path.is_file():
            done = writer.done()  # now cuts a partial last line (the count is the same)
        write_meta(meta_path, {k: v for k, v in meta.items() if k != "servers" or v})
        return _write_chunks(chunks, first, writer, records, done, output_file, input_file, progress, started)
    finally:
        lock.release()


def _write_chunks(
    chunks: Iterator[tuple[int, Chunk]],
    first: tuple[int, Chunk] | None,
    writer: ChunkWriter,
    records: list[dict[str, Any]],
    done: int,
    output: str,
    input: str,
    progress: bool,
    started: float,
) -> GenerateStats:
    """Writes every chunk (``first``, already generated, then the rest) and returns the run's counts."""
    stats = GenerateStats(len(records), 0, 0, 0, 0.0)
    bar = CountProgress("generate", len(records), "records", done, started=started) if progress else None
    try:
        for start, chunk in chunks if first is None else itertools.chain([first], chunks):
            writer.write(chunk.records, start)
            stats.written += len(chunk.records)
            stats.turns, stats.truncated = stats.turns + chunk.turns, stats.truncated + chunk.truncated
            stats.tokens += chunk.tokens
            stats.empty += chunk.empty
            if bar is not None:
                bar.update(len(chunk.records), f"{rate(stats.tokens / (time.perf_counter() - started))} tokens/s")
    finally:
        if bar is not None:
            bar.close()
    writer.finish()
    if stats.empty:
        shown = ", ".join(str(i) for i in stats.empty[:20]) + (", ..." if len(stats.empty) > 20 else "")
        log.warning("%s: %d records got an empty reply: records %s of %s", output, len(stats.empty), shown, input)
    stats.seconds = time.perf_counter() - started
    return stats


def _check_server_options(
    server: str | None,
    model: str | None,
    concurrency: int,
    api_key_env: str | None,
    timeout: float,
    retries: int,
    retry_wait: float,
) -> None:
    if concurrency < 1:
        raise UsageError(f"generate: --concurrency {concurrency} must be at least 1")
    if not timeout > 0:
        raise UsageError(f"generate: --timeout {timeout} must be a positive number of seconds")
    if retries < 0:
        raise UsageError(f"generate: --retries {retries} must be 0 or more")
    if retry_wait < 0:
        raise UsageError(f"generate: --retry_wait {retry_wait} must be 0 or more seconds")
    if server is None:
        for flag, value in (("--served_model_name", model), ("--api_key_env", api_key_env)):
            if value is not None:
                raise UsageError(f"generate: {flag} {value!r} needs --server (the in-process target has no name)")


def _in_process_chunks(
    records: list[dict[str, Any]],
    done: int,
    target: str,
    input: str,
    messages_field: str,
    prompt_field: str | None,
    batch_size: int,
    chunk_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    dtype: str,
    device: str,
    trust_remote_code: bool,
) -> Iterator[tuple[int, Chunk]]:
    """(first record, chunk) for every chunk still to write, from the target loaded here."""
    tokenizer, model = load_target(target, dtype, trust_remote_code, needs_chat_template=prompt_field is None)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    model.eval()
    sample = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_p=top_p if sample else None,
        top_k=(top_k or None) if sample else None,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=True,
    )
    regenerator = Regenerator(model, tokenizer, config, batch_size)
    for start, end in chunk_ranges(done, len(records), chunk_size):
        chunk = records[start:end]
        torch.manual_seed(seed_of(seed, start))
        if prompt_field is None:
            yield start, regenerate_records(chunk, regenerator, messages_field, input, start)
        else:
            yield start, complete_records(chunk, regenerator, prompt_field, input, start)


def _server_chunks(
    records: list[dict[str, Any]],
    done: int,
    regenerator: ServerRegenerator,
    messages_field: str,
    prompt_field: str | None,
    chunk_size: int,
    concurrency: int,
) -> Iterator[tuple[int, Chunk]]:
    """(first record, chunk) for every chunk still to write, from ``concurrency`` requests in flight (across chunk
    boundaries); a chunk is handed on once all of its records are back."""

    def one(i: int) -> RecordReply:
        if prompt_field is None:
            return regenerator.chat_record(records[i], i, messages_field)
        return regenerator.completion_record(records[i], i, prompt_field)

    results = ordered_map(one, range(done, len(records)), concurrency, window=max(2 * concurrency, chunk_size))
    try:
        for start, end in chunk_ranges(done, len(records), chunk_size):
            parts = [next(results) for _ in range(start, end)]
            yield start, Chunk(
                [p.record for p in parts], sum(p.turns for p in parts), sum(p.truncated for p in parts),
                sum(p.tokens for p in parts), [start + n for n, p in enumerate(parts) if p.empty],
            )  # fmt: skip
    finally:
        results.close()


def build_parser():
    """The parser of ``draftsmith generate`` (jsonargparse: its flags are :func:`regenerate`'s parameters)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="draftsmith generate",
        description="Regenerate a data set's assistant turns (or complete its prompts) with the target, in-process or "
        "through a serving engine's OpenAI-compatible API (--server); resumable.",
        default_env=False,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file with any of the options below")
    parser.add_function_arguments(regenerate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``draftsmith generate --target DIR --input_file IN --output_file OUT [--server URL] [--config F]``."""
    parser = build_parser()
    tokens, refusal = command_line("draftsmith generate", argv, regenerate)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    cfg = parser.parse_args(tokens)
    kwargs = cfg.as_dict()
    kwargs.pop("config", None)
    stats = regenerate(**kwargs)
    seconds = max(stats.seconds, 1e-9)
    rate = f"{stats.written / seconds:.2f} records/s, {stats.tokens / seconds:.1f} tokens/s"
    data_format = "chat" if kwargs.get("prompt_field") is None else "text"
    rows = [
        ("records", f"{stats.written} written ({stats.records} in the output), {rate}"),
        ("replies", f"{stats.turns} generated ({stats.tokens} tokens), {stats.truncated} cut at max_new_tokens"),
        ("empty", f"{len(stats.empty)} records with an empty reply"),
        ("output", str(kwargs["output_file"])),
    ]
    rows.append(
        (
            "train on it",
            f"data.init_args.train_files: [{kwargs['output_file']}] and format: {data_format} in a recipe whose "
            f"target is {kwargs['target']} (docs/guides/your-model.md)",
        )
    )
    print(block(f"generate done in {duration(stats.seconds)}", rows), flush=True)
    return 0
