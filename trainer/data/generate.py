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
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from trainer.data.server_client import OpenAIClient, RecordReply, ServerRegenerator, ordered_map, served_model
from trainer.data.tokenizer import load_tokenizer
from trainer.errors import DataError, PathError, TokenizerError, UsageError
from trainer.target import resolve_dtype

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


@dataclass
class Chunk:
    """Regenerated records and what making them took (replies, cut ones, tokens, indices with an empty reply)."""

    records: list[dict[str, Any]]
    turns: int
    truncated: int
    tokens: int
    empty: list[int]


# ---------------------------------------------------------------------------------------------------------------------
# Reading and writing records.


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


def _check_messages(record: dict[str, Any], field: str, where: str) -> list[dict[str, str]]:
    messages = record.get(field)
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise DataError(f"{where}: field {field!r} must be a list of {{'role': str, 'content': str}} messages")
    return messages


def _complete_jsonl_lines(path: Path, repair: bool = True) -> int:
    """The number of complete records of ``path``; with ``repair``, a partial last line (a crash mid-write) is cut
    off first, else the file is only read."""
    if not path.is_file():
        return 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # 0 when no line is complete
    if end < len(data) and repair:
        log.warning("%s: cutting a partial last line of %d bytes (an interrupted write)", path, len(data) - end)
        with path.open("r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    count = 0
    for n, line in enumerate(data[:end].splitlines(), start=1):
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{n}: not a JSON record; delete the output to start over ({err})") from err
        count += 1
    return count


class _Writer:
    """Appends chunks of records durably to a .jsonl file, or as part files later combined into one .parquet."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.parquet = output.suffix.lower() == ".parquet"
        if not self.parquet and output.suffix.lower() != ".jsonl":
            raise UsageError(f"{output}: unsupported output type {output.suffix!r} (use .jsonl or .parquet)")
        self.parts = output.with_name(output.name + ".parts")

    def done(self, repair: bool = True) -> int:
        """Records already written; with ``repair``, a partial jsonl line or stale parquet part is removed first
        (without it nothing is written)."""
        if not self.parquet:
            return _complete_jsonl_lines(self.output, repair)
        import pyarrow.parquet as pq

        if self.output.is_file():
            return pq.read_metadata(self.output).num_rows
        for stale in self.parts.glob("*.tmp") if self.parts.is_dir() and repair else []:
            stale.unlink()
        return sum(pq.read_metadata(f).num_rows for f in sorted(self.parts.glob("part-*.parquet")))

    def write(self, records: list[dict[str, Any]], first: int) -> None:
        if not self.parquet:
            blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
            with self.output.open("ab") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.parts.mkdir(parents=True, exist_ok=True)
        final = self.parts / f"part-{first:09d}.parquet"
        tmp = final.with_name(final.name + ".tmp")
        pq.write_table(pa.Table.from_pylist(records), tmp)
        os.replace(tmp, final)

    def finish(self) -> None:
        if not self.parquet or self.output.is_file():
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = sorted(self.parts.glob("part-*.parquet"))
        table = pa.concat_tables([pq.read_table(f) for f in parts], promote_options="default")
        tmp = self.output.with_name(self.output.name + ".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, self.output)
        for f in parts:
            f.unlink()
        self.parts.rmdir()


# ---------------------------------------------------------------------------------------------------------------------
# Generation.


def _seed_of(seed: int, chunk_start: int) -> int:
    digest = hashlib.sha256(f"{seed}:generate:{chunk_start}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids [B, P] and attention mask [B, P], right-aligned (P = the longest prompt)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P]
    attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention[b, width - len(p) :] = 1
    return ids, attention


class Regenerator:
    """Batched replies of a causal LM to chat prompts, rendered with its tokenizer's chat template."""

    def __init__(self, model, tokenizer, config: GenerationConfig, batch_size: int) -> None:
        self.model, self.tokenizer, self.config, self.batch_size = model, tokenizer, config, batch_size
        self.device = next(model.parameters()).device

    def replies(self, conversations: list[list[dict[str, str]]]) -> list[tuple[str, bool, int]]:
        """(reply text, cut at max_new_tokens, tokens generated) for each conversation (each ends before the
        reply)."""
        return self.continue_tokens(
            [
                list(
                    self.tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=True)[
                        "input_ids"
                    ]
                )
                for c in conversations
            ]
        )

    def completions(self, prompts: list[str]) -> list[tuple[str, bool, int]]:
        """(continuation text, cut at max_new_tokens, tokens generated) for each plain-text prompt."""
        return self.continue_tokens([list(self.tokenizer(p)["input_ids"]) for p in prompts])

    def continue_tokens(self, token_lists: list[list[int]]) -> list[tuple[str, bool, int]]:
        """(generated text, cut at max_new_tokens, tokens generated with the EOS) for each prompt given as token
        ids."""
        out: list[tuple[str, bool, int]] = []
        eos = self.config.eos_token_id
        for start in range(0, len(token_lists), self.batch_size):
            prompts = token_lists[start : start + self.batch_size]
            if any(not p for p in prompts):
                raise DataError("generate: a prompt tokenizes to no tokens")
            ids, attention = _left_padded(prompts, self.config.pad_token_id)  # [B, P] each
            with torch.no_grad():
                seqs = self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=attention.to(self.device),
                    generation_config=self.config,
                )  # [B, P + N]
            for row in seqs[:, ids.shape[1] :].tolist():
                cut = row.index(eos) if eos in row else len(row)
                text = self.tokenizer.decode(row[:cut], skip_special_tokens=True)
                out.append((text, cut == len(row), min(cut + 1, len(row))))
        return out


def regenerate_records(
    records: list[dict[str, Any]], regenerator: Regenerator, messages_field: str, source: str, first: int = 0
) -> Chunk:
    """The records (input indices from ``first``) with every assistant turn replaced in order."""
    convs = [list(_check_messages(r, messages_field, f"{source} record")) for r in records]
    turns = truncated = tokens = 0
    empty: set[int] = set()
    depth = 0
    while True:
        # conversations that have an assistant turn after `depth` earlier ones: regenerate that turn in one batch
        todo = []
        for i, messages in enumerate(convs):
            positions = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
            if len(positions) > depth:
                todo.append((i, positions[depth]))
        if not todo:
            break
        replies = regenerator.replies([convs[i][:j] for i, j in todo])
        for (i, j), (text, cut, n) in zip(todo, replies, strict=True):
            convs[i][j] = {**convs[i][j], "content": text}
            truncated, tokens = truncated + int(cut), tokens + n
            if not text.strip():
                empty.add(first + i)
        turns += len(todo)
        depth += 1
    new = [{**r, messages_field: c} for r, c in zip(records, convs, strict=True)]
    return Chunk(new, turns, truncated, tokens, sorted(empty))


def complete_records(
    records: list[dict[str, Any]], regenerator: Regenerator, prompt_field: str, source: str, first: int = 0
) -> Chunk:
    """The records (input indices from ``first``) with ``text`` = prompt + the target's continuation."""
    prompts = [_check_prompt(r, prompt_field, f"{source} record") for r in records]
    done = regenerator.completions(prompts)
    out = [{**r, "text": p + text} for r, p, (text, _, _) in zip(records, prompts, done, strict=True)]
    empty = [first + i for i, (text, _, _) in enumerate(done) if not text.strip()]
    return Chunk(out, len(done), sum(int(cut) for _, cut, _ in done), sum(n for _, _, n in done), empty)


def _check_prompt(record: dict[str, Any], field: str, where: str) -> str:
    prompt = record.get(field)
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: field {field!r} must be a non-empty string prompt")
    return prompt


def regenerate(
    target: str,
    input: str,
    output: str,
    messages_field: str = "messages",
    prompt_field: str | None = None,
    batch_size: int = 16,
    chunk_size: int = 64,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "auto",
    max_records: int | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    server: str | None = None,
    model: str | None = None,
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
        input: the chat data set: .jsonl, .json or .parquet records holding a message list.
        output: where the regenerated records go: .jsonl or .parquet (resumed when it exists).
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
        dtype: the target's weights dtype (float32, bfloat16, float16; in-process only).
        device: "auto" (cuda when available), "cpu", "cuda" or "cuda:N" (in-process only).
        max_records: regenerate only the first N records.
        trust_remote_code: allow custom modelling code in the target directory (off by default; in-process only).
        progress: show a progress bar (records/s and tokens/s).
        server: the base URL of a running OpenAI-compatible server (vLLM, SGLang, ``transformers serve``), such
            as ``http://localhost:8000``: replies come from its API instead of an in-process target.
        model: with ``server``, the model name to request; None: the one model the server lists.
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
    _check_server_options(server, model, concurrency, api_key_env, timeout, retries, retry_wait)
    out_path = Path(output)
    writer = _Writer(out_path)
    records = read_records(input)
    if max_records is not None:
        records = records[:max_records]
    if not records:
        raise DataError(f"{input}: no records to regenerate")
    for n, record in enumerate(records):
        if prompt_field is None:
            _check_messages(record, messages_field, f"{input} record {n}")
        else:
            _check_prompt(record, prompt_field, f"{input} record {n}")

    client = None
    if server is not None:  # asked before anything is written: a wrong URL, key or model leaves no output
        client = OpenAIClient(server, api_key_env, timeout, retries, retry_wait)
        model = served_model(client, model, target, allow_model_mismatch)
    stat = Path(input).stat()
    meta = {
        "version": META_VERSION,
        "input": str(Path(input).resolve()),
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
                f"{output} was started with other settings ({', '.join(changed)} differ, see {meta_path}): "
                f"delete the output and {meta_path.name} to start over, or rerun with the same settings"
            )
    elif out_path.exists() or writer.parts.exists():
        raise UsageError(f"{output} exists without {meta_path.name}: it was not written by this tool; move it")
    if done > len(records):
        raise DataError(f"{output} holds {done} records but {input} only {len(records)}")

    if client is None:
        chunks = _in_process_chunks(
            records, done, target, input, messages_field, prompt_field, batch_size, chunk_size, max_new_tokens,
            temperature, top_p, top_k, seed, dtype, device, trust_remote_code,
        )  # fmt: skip
    else:
        regenerator = ServerRegenerator(client, model, max_new_tokens, temperature, top_p, top_k, seed, input)
        chunks = _server_chunks(records, done, regenerator, messages_field, prompt_field, chunk_size, concurrency)
    first = next(chunks, None)  # in-process: the target has loaded
    if meta_path.is_file():
        done = writer.done()  # now cuts a partial last line (the count is the same)
    else:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    _write_meta(meta_path, {k: v for k, v in meta.items() if k != "servers" or v})

    stats = GenerateStats(len(records), 0, 0, 0, 0.0)
    bar = _progress(len(records), done, progress)
    try:
        for start, chunk in chunks if first is None else itertools.chain([first], chunks):
            writer.write(chunk.records, start)
            stats.written += len(chunk.records)
            stats.turns, stats.truncated = stats.turns + chunk.turns, stats.truncated + chunk.truncated
            stats.tokens += chunk.tokens
            stats.empty += chunk.empty
            if bar is not None:
                bar.update(len(chunk.records))
                bar.set_postfix_str(f"{stats.tokens / max(time.perf_counter() - started, 1e-9):.1f} tokens/s")
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
        for flag, value in (("--model", model), ("--api_key_env", api_key_env)):
            if value is not None:
                raise UsageError(f"generate: {flag} {value!r} needs --server (the in-process target has no name)")


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, path)


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
    for start, end in _chunks(done, len(records), chunk_size):
        chunk = records[start:end]
        torch.manual_seed(_seed_of(seed, start))
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
        for start, end in _chunks(done, len(records), chunk_size):
            parts = [next(results) for _ in range(start, end)]
            yield start, Chunk(
                [p.record for p in parts], sum(p.turns for p in parts), sum(p.truncated for p in parts),
                sum(p.tokens for p in parts), [start + n for n, p in enumerate(parts) if p.empty],
            )  # fmt: skip
    finally:
        results.close()


def load_target(target: str, dtype: str, trust_remote_code: bool, needs_chat_template: bool) -> tuple[Any, Any]:
    """The target's tokenizer and model (on CPU, in eval mode), with errors naming ``target``.

    Args:
        target: a local model folder (config.json, weights and tokenizer) or a hub id.
        dtype: the weights dtype (float32, bfloat16, float16).
        trust_remote_code: allow custom modelling code in the target folder.
        needs_chat_template: refuse a tokenizer without a chat template (chat mode renders prompts with it).

    Raises:
        FileNotFoundError: ``target`` is neither a local model folder nor a hub id that loads (a misspelled path),
            or is a folder without config.json.
        ValueError: its tokenizer has no EOS token, or no chat template when one is needed.
    """
    path = Path(target).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        raise PathError(f"target {target!r}: no config.json in that folder (not a model folder)")
    # "name" or "org/name" may be a hub id; any other path that does not exist is a missing local folder
    looks_local = target.startswith((".", "/", "~")) or target.count("/") > 1
    if looks_local and not path.exists():
        raise PathError(f"target {target!r} is not a local model folder or hub id (no such folder)")
    try:
        tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            str(path) if path.exists() else target, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        if path.exists():
            raise
        raise PathError(
            f"target {target!r} is not a local model folder or hub id (no such folder, and loading it from the hub "
            f"failed: {err}); check the path, or train or download the target first"
        ) from err
    if needs_chat_template and not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(f"the tokenizer of {target} has no chat template: generate needs one to render prompts")
    if tokenizer.eos_token_id is None:
        raise TokenizerError(f"the tokenizer of {target} has no EOS token: replies could not end")
    return tokenizer, model.eval()


def _chunks(done: int, total: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of the chunks still to write; chunk boundaries are the multiples of ``size``."""
    start = done
    while start < total:
        end = min(total, (start // size + 1) * size)
        yield start, end
        start = end


def _progress(total: int, done: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, unit="record", desc="generate", smoothing=0.1)


def main(argv: list[str] | None = None) -> int:
    """``draftsmith generate [--config generate.yaml] --target DIR --input IN --output OUT [--server URL] [...]``."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="draftsmith generate",
        description="Regenerate a data set's assistant turns (or complete its prompts) with the target, in-process or "
        "through a serving engine's OpenAI-compatible API (--server); resumable.",
        default_env=False,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file with any of the options below")
    parser.add_function_arguments(regenerate)
    cfg = parser.parse_args(argv)
    kwargs = cfg.as_dict()
    kwargs.pop("config", None)
    stats = regenerate(**kwargs)
    rate = f"{stats.written / stats.seconds:.2f} records/s, {stats.tokens / stats.seconds:.1f} tokens/s"
    print(
        f"wrote {stats.written} records ({stats.records} in {kwargs['output']}) in {stats.seconds:.1f} s ({rate}): "
        f"{stats.turns} replies generated ({stats.tokens} tokens), {stats.truncated} cut at max_new_tokens, "
        f"{len(stats.empty)} records with an empty reply"
    )
    return 0
