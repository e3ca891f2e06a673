"""Text and chat data for causal-LM objectives: read, tokenize (cached), pack, and serve resumable batches.

Every example is a row of `seq_len + 1` token ids and a per-token "trained" flag. A batch is a dict::

    input_ids  [B, S] long   row[:-1]
    labels     [B, S] long   row[1:] (the next token), -100 where it is not trained
    loss_mask  [B, S] bool   True where labels is trained (aligned with labels)

Text (`format="text"`): each document is tokenized without special tokens and followed by EOS. With `pack=True` the
token stream of all documents is cut into rows of `seq_len + 1` tokens with a stride of `seq_len` (consecutive rows
share one token, so every token but the first is a label exactly once); attention DOES cross document boundaries
inside a row, the EOS token separates documents; the ragged tail is dropped. With `pack=False` every document is
one row, truncated to `seq_len + 1` tokens or right-padded with the pad token (padding is never trained).

Document masking (`document_masking=True`, packed rows only): every batch also carries

    document_ids [B, S] long  the document of each input position within its row (trainer/models/documents.py), from the
                              packer's own boundaries (not guessed from EOS: a chat document may hold EOS tokens)

and a document's first token is no label (the previous document's last token would predict it across the boundary),
so a packed row trains exactly what its documents alone would; the objectives pass `document_ids` to every attention.

Mixed lengths (`long_seq_len`, `long_fraction`, packed rows only): the training stream is packed into rows of
`long_seq_len + 1` tokens, a multiple `k` of `seq_len`. A `long_fraction` share of each epoch's steps serves
`batch_size / k` such rows whole; the other steps split each of them into the `k` rows of `seq_len + 1` tokens that
packing at `seq_len` would cut, `batch_size` rows in all: every step holds `batch_size * seq_len` tokens, and each
token is a label exactly once whichever way its row is served. Which steps are long is drawn from the seed and the
epoch (trainer/data/sampler.py `MixedLengthSampler`), so a resumed run serves the batches of an uninterrupted one.
Validation rows stay at `seq_len`.

Chat (`format="chat"`): each conversation (a list of {"role", "content"} messages) goes through the tokenizer's chat
template as its model publishes it; only assistant tokens are trained: each assistant turn's content and the
end-of-turn token the template closes it with, found by rendering the conversation before and through each turn
(trainer/data/chat.py; a template with `{% generation %}` blocks keeps transformers' mask). A template that renders
earlier turns differently once a later one follows (Qwen3) gives one row per assistant turn, said once per file. An
EOS is appended (not trained) when the rendered conversation does not end with one; rows are then packed or padded as
for text.
A conversation without an assistant turn is left out with a warning naming the file, the count and the first
records; a file where no conversation has one is an error.

Rows with nothing to train (no trained label: a packed row inside a long prompt, a padded row whose prompt fills
`seq_len`) are dropped from the training and validation rows and counted in a log line per file, so that every batch
has a trained label. Data where nothing is trained is refused, and so is data whose trained share of label tokens
is below `min_trained_fraction`: per file for local files (the error names each file and its share), over the whole
source for a hub split or a validation carve-out.

Local files: `train_files` / `val_files` entries are files, folders (every supported file inside, recursively,
sorted; hidden entries skipped) or glob patterns (`data/*.jsonl`, `data/**/*.txt`). .jsonl files (and .json files in
JSON-lines form) are read line by line (trainer/data/sources.py): a broken line is an error `FILE:LINE: not valid
JSON (...)`.

Tokenized rows are cached as .npy files under `cache_dir`, keyed by the expanded file list (path, size, modification
time of each file), the tokenizer hash and every argument that changes the rows, so a rerun skips reading and
tokenizing.

The train loader uses `ResumableSampler`: see trainer/data/sampler.py for how the data position is saved in
checkpoints and restored exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
from torch.utils.data import DataLoader, DistributedSampler

from trainer.data.chat import assistant_rows, has_generation_blocks
from trainer.data.packing import (
    MixedRows,
    TokenRows,
    collate_rows,
    document_starts,
    label_sources,
    pack_rows,
    pad_rows,
)
from trainer.data.sampler import MixedLengthSampler, ResumableSampler, resume_point
from trainer.data.sources import DocumentReader, Documents, check_data_paths
from trainer.data.tokenizer import check_before_reading, load_tokenizer, tokenizer_hash
from trainer.distributed.preemption import stop_signal_worker_init
from trainer.distributed.sequence_parallel import data_parallel_rank_world
from trainer.interface.errors import CheckpointError, DataError, PathError, RecipeError, TokenizerError

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: rows with nothing to train are dropped
_SHOW_RECORDS = 5  # records named in a warning about several


def check_long_rows(seq_len: int, batch_size: int, pack: bool, long_seq_len: int | None, long_fraction: float) -> None:
    """Refuses mixed-length settings that cannot keep every step's tokens equal, naming the keys and values."""
    if not 0.0 <= long_fraction <= 1.0:
        raise RecipeError(f"data.long_fraction={long_fraction}: a share of the training steps, in [0, 1]")
    if long_seq_len is None:
        if long_fraction > 0:
            raise RecipeError(f"data.long_fraction={long_fraction} needs data.long_seq_len (the long rows' length)")
        return
    if not pack:
        raise RecipeError("data.long_seq_len needs data.pack=true: long rows are cut from the packed stream")
    if long_seq_len <= seq_len or long_seq_len % seq_len:
        raise RecipeError(f"data.long_seq_len={long_seq_len} must be a multiple (2x or more) of data.seq_len={seq_len}")
    if batch_size % (long_seq_len // seq_len):
        raise RecipeError(
            f"data.batch_size={batch_size} must be divisible by data.long_seq_len / data.seq_len = "
            f"{long_seq_len // seq_len}: a long step serves batch_size / {long_seq_len // seq_len} rows"
        )


class ResumableLoader(DataLoader):
    """A DataLoader that tells Lightning it resumes mid-epoch (Lightning warns about loaders that do not).

    The position itself is saved by `TextDataModule.state_dict` and applied through the `ResumableSampler` built by
    `train_dataloader()`; this loader's own state is empty.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class TextDataModule(L.LightningDataModule):
    """Plain-text or chat documents from local files or a hub data set, packed into fixed-length causal-LM rows."""

    def __init__(
        self,
        tokenizer: str | None = None,
        train_files: list[str] | None = None,
        val_files: list[str] | None = None,
        dataset_name: str | None = None,
        dataset_config: str | None = None,
        train_split: str = "train",
        val_split: str | None = None,
        format: Literal["text", "chat"] = "text",
        text_field: str = "text",
        messages_field: str = "messages",
        seq_len: int = 256,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        val_fraction: float = 0.0,
        pack: bool = True,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
        max_documents: int | None = None,
        cache_dir: str | None = None,
        trust_remote_code: bool = False,
        min_trained_fraction: float = 0.01,
        document_masking: bool = False,
        long_seq_len: int | None = None,
        long_fraction: float = 0.0,
    ) -> None:
        """Configure the data; nothing is read until `prepare_data` / `setup`.

        Args:
            tokenizer: tokenizer folder or hub id (AutoTokenizer); required.
            train_files: local training data: files (.txt: one document per file; .jsonl / .json; .parquet), folders
                (every such file inside, recursively, sorted; .txt only for format="text") or glob patterns
                (`data/*.jsonl`, `data/**/*.parquet`); an entry matching no data file is an error.
            val_files: local validation data, same forms; when None see `val_split` and `val_fraction`.
            dataset_name: a `datasets` hub name or loading script, used when `train_files` is None (needs network).
            dataset_config: the hub data set's configuration name.
            train_split: split of `dataset_name` used for training.
            val_split: split of `dataset_name` used for validation (None: see `val_fraction`).
            format: "text" (documents in `text_field`) or "chat" (message lists in `messages_field`).
            text_field: key of the document text in .jsonl / .json / .parquet records.
            messages_field: key of the message list ({"role", "content"} dicts) in chat records.
            seq_len: tokens per training row (the model sees seq_len inputs and seq_len labels).
            batch_size: rows per batch on one device.
            val_batch_size: rows per validation batch (default: batch_size).
            val_fraction: share of training documents held out for validation when no validation source is given.
            pack: pack documents into full rows (True) or pad/truncate one document per row (False).
            shuffle: shuffle the training rows every epoch (deterministic in seed and epoch).
            num_workers: DataLoader worker processes.
            seed: seeds the validation carve-out and the per-epoch order.
            max_documents: use only the first N training documents (after reading all sources in order).
            cache_dir: folder for tokenized rows (and `datasets`' own cache, under hf/); None uses $DRAFTSMITH_CACHE
                or ~/.cache/draftsmith/tokenized.
            trust_remote_code: let the tokenizer run code from the hub (off unless a recipe asks).
            min_trained_fraction: refuse data whose trained share of label tokens (assistant tokens for chat) is below
                this, per local file (over the whole source for a hub split or a carve-out), naming the file and its
                share; 0 disables this check. Data with no trained token at all is always refused.
            document_masking: packed rows carry `document_ids` [B, S] (the packer's document boundaries) so that no
                token attends across documents and positions restart at each document; a document's first token is
                then no label. Needs pack=True.
            long_seq_len: tokens per long training row: a multiple k >= 2 of seq_len, with k dividing batch_size, and
                no longer than the target's context; a long step serves batch_size / k such rows (as many tokens as a
                step of batch_size rows of seq_len). None: every row has seq_len tokens. Needs pack=True.
            long_fraction: share of each epoch's training steps served as long rows, in [0, 1] (needs long_seq_len).
        """
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise RecipeError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise RecipeError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if format not in ("text", "chat"):
            raise RecipeError(f"format must be 'text' or 'chat', got {format!r}")
        if not 0.0 <= min_trained_fraction < 1.0:
            raise RecipeError(f"min_trained_fraction must be in [0, 1), got {min_trained_fraction}")
        if document_masking and not pack:
            raise RecipeError("data.document_masking=true needs data.pack=true: unpacked rows hold one document each")
        check_long_rows(seq_len, batch_size, pack, long_seq_len, long_fraction)
        # kept in checkpoints, not logged: the objective's hyperparameters are, and Lightning refuses to merge a key
        # both hold with two values (model.seed and data.seed); the run folder's config.yaml holds every value
        self.save_hyperparameters(logger=False)
        self.tokenizer_path = tokenizer
        self.train_files = list(train_files) if train_files else None
        self.val_files = list(val_files) if val_files else None
        self.dataset_name = dataset_name
        self.dataset_config = dataset_config
        self.train_split = train_split
        self.val_split = val_split
        self.format = format
        self.text_field = text_field
        self.messages_field = messages_field
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.val_fraction = val_fraction
        self.pack = pack
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.seed = seed
        self.max_documents = max_documents
        self.cache_dir = cache_dir or os.environ.get(
            "DRAFTSMITH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "draftsmith", "tokenized")
        )
        self.trust_remote_code = trust_remote_code
        self.min_trained_fraction = min_trained_fraction
        self.document_masking = document_masking
        self.long_seq_len = long_seq_len
        self.long_fraction = long_fraction
        self.split = 1 if long_seq_len is None else long_seq_len // seq_len  # short rows per training row
        # every local path is checked at construction, before anything is read or tokenized
        check_data_paths(
            {
                "train_files": self.train_files,
                "val_files": self.val_files,
                "format": format,
                "cache_dir": self.cache_dir,
            }
        )
        self.reader = DocumentReader(format, text_field, messages_field, self.cache_dir, dataset_name, dataset_config)
        self._tokenizer: Any = None
        self.train_dataset: TokenRows | None = None
        self.val_dataset: TokenRows | None = None
        self._train_sampler: ResumableSampler | None = None
        self._resume_position: dict[str, Any] | None = None

    # ------------------------------------------------------------------ tokenizer

    @property
    def tokenizer(self) -> Any:
        """The loaded tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            if not self.tokenizer_path:
                raise RecipeError("TextDataModule needs `tokenizer` (a tokenizer folder or hub id)")
            self._tokenizer = load_tokenizer(self.tokenizer_path, trust_remote_code=self.trust_remote_code)
            if self._tokenizer.eos_token_id is None:
                raise TokenizerError(
                    f"tokenizer {self.tokenizer_path} has no EOS token: documents could not be separated"
                )
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return len(self.tokenizer)

    # ------------------------------------------------------------------ reading

    def _sources(self, role: str) -> tuple[list[str], str | None]:
        """(local files, folders and patterns expanded; hub split) for 'train' or 'val'."""
        if role == "train":
            if self.train_files:
                return self.reader.expand(self.train_files), None
            if self.dataset_name:
                return [], self.train_split
            raise RecipeError("TextDataModule needs `train_files` or `dataset_name`")
        if self.val_files:
            return self.reader.expand(self.val_files), None
        if self.dataset_name and self.val_split:
            return [], self.val_split
        return [], None

    # ------------------------------------------------------------------ tokenizing

    def _tokenize_text(self, docs: Documents) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """(ids, trained) of every document (all trained) and the source of each."""
        eos = self.tokenizer.eos_token_id
        streams = []
        for start in range(0, len(docs), 512):
            chunk = docs.items[start : start + 512]
            for i, d in enumerate(chunk):
                if not isinstance(d, str):
                    raise DataError(f"{docs.where(start + i)}: field {self.text_field!r} is not a string")
            enc = self.tokenizer(chunk, add_special_tokens=False)["input_ids"]
            for ids in enc:
                arr = np.asarray([*ids, eos], np.int32)
                streams.append((arr, np.ones_like(arr, dtype=bool)))
        return streams, docs.source

    def _tokenize_chat(
        self, docs: Documents
    ) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, dict[int, tuple[int, list[str]]]]:
        """(ids, assistant mask) of every conversation with an assistant turn, the source of each, and per source the
        number of conversations without an assistant turn (left out, with a warning) and the roles they hold."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise TokenizerError(f"tokenizer {self.tokenizer_path} has no chat template: format='chat' needs one")
        eos = tok.eos_token_id
        streams = []
        tags: list[int] = []
        missing: dict[int, list[int]] = {}  # source -> documents without an assistant turn
        roles: dict[int, set[str]] = {}
        per_turn: dict[int, int] = {}  # source -> conversations split into one row per assistant turn
        for i, messages in enumerate(docs.items):
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise DataError(f"{docs.where(i)}: field {self.messages_field!r} is not a list of messages")
            if not any(m.get("role") == "assistant" for m in messages):
                s = int(docs.source[i])
                missing.setdefault(s, []).append(i)
                seen = roles.setdefault(s, set())
                for m in messages:
                    seen.add(repr(m["role"]) if "role" in m else f"no 'role' key (keys: {', '.join(map(str, m))})")
                continue
            for ids, mask in self._chat_rows(messages, docs.where(i), per_turn, int(docs.source[i])):
                if not ids or ids[-1] != eos:
                    ids.append(eos)
                    mask.append(False)
                streams.append((np.asarray(ids, np.int32), np.asarray(mask, bool)))
                tags.append(int(docs.source[i]))
        for s, count in sorted(per_turn.items()):
            log.info(
                "%s: the chat template of %s renders earlier assistant turns differently once a later turn follows: "
                "%d conversations give one row per assistant turn (the conversation through that turn, that turn "
                "trained)",
                docs.names[s],
                self.tokenizer_path,
                count,
            )
        counts = np.bincount(docs.source, minlength=len(docs.names))
        for s, idx in missing.items():
            shown = ", ".join(docs.where(i) for i in idx[:_SHOW_RECORDS]) + (
                ", ..." if len(idx) > _SHOW_RECORDS else ""
            )
            log.warning(
                "%s: %d of %d conversations have no assistant turn and are left out (nothing in them is trained;"
                " roles seen: %s): %s",
                docs.names[s],
                len(idx),
                counts[s],
                ", ".join(sorted(roles[s])) or "none",
                shown,
            )
        info = {s: (len(idx), sorted(roles[s])) for s, idx in missing.items()}
        return streams, np.asarray(tags, np.int64), info

    def _chat_rows(
        self, messages: list[dict], where: str, per_turn: dict[int, int], source: int
    ) -> list[tuple[list[int], list[bool]]]:
        """(ids, assistant mask) of the rows of one conversation: transformers' mask for a template with
        ``{% generation %}`` blocks, else trainer/data/chat.py's (counting in ``per_turn`` a conversation it splits)."""
        tok = self.tokenizer
        if has_generation_blocks(tok.chat_template):
            try:
                out = tok.apply_chat_template(
                    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )
            except Exception as err:  # jinja raises its own types (unknown roles, missing keys)
                raise DataError(f"{where}: the chat template failed on this conversation: {err}") from err
            rows = [(list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]])]
        else:
            chat_rows = assistant_rows(tok, messages, where)
            if chat_rows and chat_rows[0].per_turn:
                per_turn[source] = per_turn.get(source, 0) + 1
            rows = [(row.ids, row.trained) for row in chat_rows]
        if not any(any(mask) for _, mask in rows):
            raise DataError(
                f"{where}: the chat template of {self.tokenizer_path} marks no assistant tokens in this conversation "
                "(its assistant turns are empty, or its {% generation %} blocks hold nothing)"
            )
        return rows

    def _rows(self, docs: Documents, role: str, source: str, per_file: bool, seq_len: int) -> tuple[np.ndarray, ...]:
        """The rows of `docs` without those that have nothing to train, after the trained-share checks: ids and
        trained [R, S + 1], and with document masking the document starts [R, S + 1] (`document_starts`).

        Args:
            docs: the documents or conversations.
            role: "training" or "validation" (for messages).
            source: what the messages call the whole data.
            per_file: check the trained share of every source (else of the whole data).
            seq_len: the rows' length (seq_len; long_seq_len for the training rows of mixed lengths).
        """
        missing: dict[int, tuple[int, list[str]]] = {}
        if self.format == "chat":
            streams, tags, missing = self._tokenize_chat(docs)
        else:
            streams, tags = self._tokenize_text(docs)
        if self.document_masking:
            for _, trained_flags in streams:
                trained_flags[:1] = False  # a document's first token is predicted by nothing of its own
        if self.pack:
            ids, trained = pack_rows(streams, seq_len)  # [R, S + 1] each
        else:
            pad = self.tokenizer.pad_token_id
            ids, trained = pad_rows(streams, self.seq_len, self.tokenizer.eos_token_id if pad is None else pad)
        if ids.shape[0] == 0 and streams:
            return ids, trained  # too small: the caller says so (no rows because nothing is left: checked below)
        lengths = np.fromiter((s[0].shape[0] for s in streams), np.int64, len(streams))  # [D]
        del streams
        starts = document_starts(lengths, seq_len) if self.document_masking else None  # [R, S + 1]
        label_src, real = label_sources(lengths, tags.astype(np.int32), seq_len, self.pack)  # [R, S] each
        n = len(docs.names)
        labels = trained[:, 1:]  # [R, S] the trained labels
        keep = labels.any(axis=1)  # [R] rows with something to train
        stats = {  # per source (all zero when every conversation was left out)
            "rows": np.bincount(label_src[:, 0], minlength=n),  # a row counts for the source of its first label
            "dropped": np.bincount(label_src[~keep, 0], minlength=n),
            "real": np.bincount(label_src.reshape(-1) if self.pack else label_src[real], minlength=n),
            "trained": np.bincount(label_src[labels], minlength=n),
            "docs": np.bincount(docs.source, minlength=n),
        }
        self._check_trained(docs, stats, missing, role, source, per_file)
        if not keep.all():
            ids, trained = ids[keep], trained[keep]
            starts = None if starts is None else starts[keep]
        return (ids, trained) if starts is None else (ids, trained, starts)

    def _check_trained(
        self,
        docs: Documents,
        stats: dict[str, np.ndarray],
        missing: dict[int, tuple[int, list[str]]],
        role: str,
        source: str,
        per_file: bool,
    ) -> None:
        """Logs the rows dropped per source; refuses data with nothing trained or a trained share below the minimum."""
        for s in np.nonzero(stats["dropped"])[0].tolist():
            log.warning(
                "%s: %d of %d %s rows have no trained label (only prompt or padding tokens) and are dropped",
                docs.names[s],
                stats["dropped"][s],
                stats["rows"][s],
                role,
            )
        floor = self.min_trained_fraction

        def low(trained: int, real: int) -> bool:
            return real > 0 and (trained == 0 or trained / real < floor)

        def share(trained: int, real: int) -> str:
            return f"{100 * trained / real:.3g}% of {real:,} label tokens trained"

        problems = []
        if per_file:
            for s, name in enumerate(docs.names):
                lacking, roles = missing.get(s, (0, []))
                if lacking and lacking == stats["docs"][s]:
                    problems.append(
                        f"{name}: none of its {lacking} conversations has an assistant turn (roles: {', '.join(roles)})"
                    )
                elif low(int(stats["trained"][s]), int(stats["real"][s])):
                    problems.append(f"{name}: {share(int(stats['trained'][s]), int(stats['real'][s]))}")
        elif low(int(stats["trained"].sum()), int(stats["real"].sum())):
            problems.append(f"{source}: {share(int(stats['trained'].sum()), int(stats['real'].sum()))}")
        nothing = int(stats["trained"].sum()) == 0
        if nothing and not problems:
            problems.append(f"{source}: no label token is trained")
        if not problems:
            log.info(
                "%s rows: %d (%s), %s",
                role,
                int(stats["rows"].sum() - stats["dropped"].sum()),
                source,
                share(int(stats["trained"].sum()), int(stats["real"].sum())),
            )
            return
        head = f"nothing to train in the {role} data" if nothing else f"too little is trained in the {role} data"
        hints = []
        if self.format == "chat":
            hints.append("format='chat' trains only assistant tokens (messages with role 'assistant')")
            if not self.pack:
                hints.append(
                    f"with pack=False a conversation is cut to seq_len + 1 = {self.seq_len + 1} tokens, so a longer"
                    " prompt leaves nothing to train: raise seq_len or set pack=True"
                )
        if floor > 0 and not nothing:
            hints.append(f"min_trained_fraction={floor}; 0 accepts any share above zero")
        raise DataError(f"{head}: {'; '.join(problems)}" + (f" ({'; '.join(hints)})" if hints else ""))

    # ------------------------------------------------------------------ caching

    def _cache_key(self) -> str:
        def stamp(path: str) -> list[Any]:
            p = Path(path)
            if not p.is_file():
                raise PathError(f"data file not found: {path}")
            st = p.stat()
            return [str(p.resolve()), st.st_size, st.st_mtime_ns]

        train_files, _ = self._sources("train")
        val_files, _ = self._sources("val")
        record = {
            "version": CACHE_VERSION,
            "train": [stamp(f) for f in train_files],  # the expanded list: a file added to a folder is a new key
            "val": [stamp(f) for f in val_files],
            "hub": [self.dataset_name, self.dataset_config, self.train_split, self.val_split],
            "tokenizer": tokenizer_hash(self.tokenizer),
            "chat_template": getattr(self.tokenizer, "chat_template", None) if self.format == "chat" else None,
            "args": [self.format, self.text_field, self.messages_field, self.seq_len, self.pack],
            "split": [self.val_fraction, self.seed, self.max_documents],
            "checks": [self.min_trained_fraction],  # cached rows passed the checks of this value
        }
        if self.document_masking:  # other rows (no first-token labels) and their starts; absent: the keys of before
            record["documents"] = True
        if self.long_seq_len is not None:  # training rows of long_seq_len
            record["long_seq_len"] = self.long_seq_len
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]

    def _build(self) -> dict[str, tuple[np.ndarray, ...]]:
        files, split = self._sources("train")
        docs = self.reader.documents(files, split)
        train_source = docs.label()
        if self.max_documents is not None:
            docs = docs.take(np.arange(min(self.max_documents, len(docs))))
        if not len(docs):
            raise DataError(f"no documents in the training data: {train_source}")
        val_files, val_split = self._sources("val")
        val_docs: Documents | None = None
        val_per_file = True
        if val_files or val_split:
            val_docs = self.reader.documents(val_files, val_split)
            val_source = val_docs.label()
            if not len(val_docs):
                raise DataError(f"no documents in the validation data: {val_source}")
        elif self.val_fraction > 0:
            if len(docs) < 2:
                raise DataError(f"val_fraction={self.val_fraction} needs at least 2 documents in {train_source}")
            order = np.random.default_rng(self.seed).permutation(len(docs))
            n_val = min(max(1, round(len(docs) * self.val_fraction)), len(docs) - 1)
            is_val = np.zeros(len(docs), bool)
            is_val[order[:n_val]] = True
            val_docs, docs = docs.take(np.nonzero(is_val)[0]), docs.take(np.nonzero(~is_val)[0])
            val_source = f"{len(val_docs)} documents carved from {train_source}"
            val_per_file = False  # a few carved documents say little about a file's share
        row = self.seq_len * self.split
        out = {"train": self._rows(docs, "training", train_source, per_file=True, seq_len=row)}
        if len(out["train"][0]) == 0:
            key = "seq_len" if self.long_seq_len is None else "long_seq_len"
            raise DataError(
                f"the training data is too small: {len(docs)} documents give fewer tokens than one sequence of"
                f" {key} + 1 = {row + 1} tokens: {train_source}"
            )
        if val_docs is not None:
            out["val"] = self._rows(val_docs, "validation", val_source, per_file=val_per_file, seq_len=self.seq_len)
            if len(out["val"][0]) == 0:
                raise DataError(
                    f"the validation data is too small for one sequence of {self.seq_len + 1} tokens: {val_source}"
                )
        return out

    def _load_or_build(self, write: bool) -> dict[str, tuple[np.ndarray, ...]]:
        folder = Path(self.cache_dir) / self._cache_key()
        if (folder / "done").is_file():
            out = {}
            for role in ("train", "val"):
                if (folder / f"{role}_ids.npy").is_file():
                    # memory-mapped: worker processes and ranks on one node share the pages
                    names = ("ids", "trained", "starts") if self.document_masking else ("ids", "trained")
                    out[role] = tuple(np.load(folder / f"{role}_{name}.npy", mmap_mode="r") for name in names)
            log.info("loaded tokenized rows from %s", folder)
            return out
        out = self._build()
        if write:
            tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            for role, arrays in out.items():
                for name, array in zip(("ids", "trained", "starts"), arrays, strict=False):
                    np.save(tmp / f"{role}_{name}.npy", array)
            (tmp / "done").write_text("ok\n")
            try:
                tmp.rename(folder)
            except OSError:  # another process finished first: keep its copy
                log.info("tokenized rows already cached in %s", folder)
        return out

    # ------------------------------------------------------------------ Lightning hooks

    def prepare_data(self) -> None:
        """Tokenize and cache the rows once (Lightning calls this on one process per node), after the model's check
        of the tokenizer (``check_before_reading``)."""
        check_before_reading(self)
        if not (Path(self.cache_dir) / self._cache_key() / "done").is_file():  # setup loads (and says so) a cached one
            self._load_or_build(write=True)

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenized rows (from the cache when present)."""
        if self.train_dataset is not None:
            return
        check_before_reading(self)
        rows = self._load_or_build(write=True)
        if self.long_seq_len is None:
            self.train_dataset = TokenRows(*rows["train"])
        else:
            ids, trained, *starts = rows["train"]
            self.train_dataset = MixedRows(ids, trained, starts[0] if starts else None, self.split)
        self.val_dataset = TokenRows(*rows["val"]) if "val" in rows else None

    def _rank_world(self) -> tuple[int, int]:
        """(rank, world size) among the data-parallel replicas: the ranks sharing rows under sequence parallelism
        read the same rows."""
        return data_parallel_rank_world(self.trainer)

    def train_dataloader(self) -> DataLoader:
        """The training loader: resumable, rank-aware order over `train_dataset` (drops a ragged last batch)."""
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        rank, world = self._rank_world()
        rows_per_batch = self.batch_size // self.split  # training rows (long rows with mixed lengths) per batch
        epoch, start = 0, 0
        # Lightning restores the data module's state for validate/test too: only a fit from a checkpoint resumes.
        resuming = self.trainer is None or getattr(self.trainer, "ckpt_path", None) is not None
        if self._resume_position and resuming:
            saved = self._resume_position.get("long_fraction", 0.0)  # absent: a checkpoint without mixed lengths
            if saved != self.long_fraction:
                raise CheckpointError(
                    f"cannot resume the data position: the checkpoint has long_fraction={saved!r}, this run has "
                    f"data.long_fraction={self.long_fraction!r} (the schedule of long steps changed)"
                )
            epoch, start = resume_point(
                self._resume_position, len(self.train_dataset), rows_per_batch, world, self.seed, self.shuffle
            )
        self._resume_position = None
        if self.long_seq_len is None:
            self._train_sampler = ResumableSampler(
                len(self.train_dataset), self.batch_size, rank, world, self.seed, self.shuffle, epoch, start
            )
        else:
            self._train_sampler = MixedLengthSampler(
                len(self.train_dataset), rows_per_batch, rank, world, self.seed, self.shuffle, epoch, start,
                self.long_fraction,
            )  # fmt: skip
        return ResumableLoader(
            self.train_dataset,
            batch_size=rows_per_batch,
            sampler=self._train_sampler,
            collate_fn=None if self.long_seq_len is None else collate_rows,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            worker_init_fn=stop_signal_worker_init(),  # Ctrl-C, SIGTERM: the main process saves
        )

    def val_dataloader(self) -> DataLoader | list:
        """The validation loader in data set order (an empty list when there is no validation data)."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        rank, replicas = self._rank_world()
        sampler = None  # Lightning's own distributed sampler over every rank
        if self.trainer is not None and replicas < self.trainer.world_size:  # sequence parallel: a group reads a row
            sampler = DistributedSampler(self.val_dataset, num_replicas=replicas, rank=rank, shuffle=False)
        return DataLoader(
            self.val_dataset, batch_size=self.val_batch_size, shuffle=False, sampler=sampler,
            num_workers=self.num_workers, worker_init_fn=stop_signal_worker_init(),
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The training data position (saved in checkpoints): see trainer/data/sampler.py."""
        trainer = self.trainer
        if self._train_sampler is None or trainer is None or trainer.state.fn != "fit":
            return {"position": self._resume_position} if self._resume_position else {}
        # Batches whose training_step finished in this epoch: batches prefetched by the loop or by workers are not
        # counted. An epoch cut short by limit_train_batches ends at num_training_batches.
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if done >= trainer.num_training_batches:
            done = self._train_sampler.batches_per_epoch
        return {"position": self._train_sampler.position(done)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the data position; the next `train_dataloader()` starts there."""
        self._resume_position = state_dict.get("position")
