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

Chat (`format="chat"`): each conversation (a list of {"role", "content"} messages) goes through the tokenizer's chat
template with `return_assistant_tokens_mask=True`; only assistant tokens are trained. An EOS is appended (not
trained) when the rendered conversation does not end with one; rows are then packed or padded as for text.

Tokenized rows are cached as .npy files under `cache_dir`, keyed by the files (path, size, modification time), the
tokenizer hash and every argument that changes the rows, so a rerun skips reading and tokenizing.

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
from torch.utils.data import DataLoader

from trainer.data.packing import TokenRows, pack_rows, pad_rows
from trainer.data.sampler import ResumableSampler, resume_point
from trainer.data.tokenizer import load_tokenizer, tokenizer_hash

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_TEXT_SUFFIXES = (".txt",)
_JSON_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)


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
    ) -> None:
        """Configure the data; nothing is read until `prepare_data` / `setup`.

        Args:
            tokenizer: tokenizer folder or hub id (AutoTokenizer); required.
            train_files: local training files: .txt (one document per file), .jsonl / .json, .parquet.
            val_files: local validation files, same formats; when None see `val_split` and `val_fraction`.
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
        """
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if format not in ("text", "chat"):
            raise ValueError(f"format must be 'text' or 'chat', got {format!r}")
        self.save_hyperparameters()
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
                raise ValueError("TextDataModule needs `tokenizer` (a tokenizer folder or hub id)")
            self._tokenizer = load_tokenizer(self.tokenizer_path, trust_remote_code=self.trust_remote_code)
            if self._tokenizer.eos_token_id is None:
                raise ValueError(f"tokenizer {self.tokenizer_path} has no EOS token: documents could not be separated")
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return len(self.tokenizer)

    # ------------------------------------------------------------------ reading

    def _read_file(self, path: str) -> list[Any]:
        """The documents (str) or conversations (list of messages) in one local file."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        suffix = p.suffix.lower()
        if suffix in _TEXT_SUFFIXES:
            if self.format == "chat":
                raise ValueError(f"{path}: a .txt file holds plain text; chat data needs .jsonl, .json or .parquet")
            return [p.read_text(encoding="utf-8", errors="replace")]
        if suffix in _JSON_SUFFIXES or suffix in _PARQUET_SUFFIXES:
            import datasets

            builder = "parquet" if suffix in _PARQUET_SUFFIXES else "json"
            if builder == "json" and p.stat().st_size < (1 << 16) and not p.read_bytes().strip():
                return []  # an empty file: reported with the other sources when nothing is left
            try:
                ds = datasets.load_dataset(
                    builder, data_files=[str(p)], split="train", cache_dir=os.path.join(self.cache_dir, "hf")
                )
            except Exception as err:  # datasets wraps parser errors in several types
                raise ValueError(f"could not read {path}: {err}") from err
            return self._column(ds, path)
        raise ValueError(f"{path}: unsupported data file type {suffix!r} (use .txt, .jsonl, .json or .parquet)")

    def _column(self, ds: Any, source: str) -> list[Any]:
        key = self.messages_field if self.format == "chat" else self.text_field
        if len(ds) == 0:
            return []
        if key not in ds.column_names:
            raise KeyError(f"{source}: records have no key {key!r} (keys: {', '.join(ds.column_names)})")
        return list(ds[key])

    def _read_hub(self, split: str) -> list[Any]:
        import datasets

        try:
            ds = datasets.load_dataset(
                self.dataset_name, self.dataset_config, split=split, cache_dir=os.path.join(self.cache_dir, "hf")
            )
        except FileNotFoundError as err:
            raise FileNotFoundError(f"data set {self.dataset_name!r} (split {split!r}) not found: {err}") from err
        return self._column(ds, f"{self.dataset_name}[{split}]")

    def _sources(self, role: str) -> tuple[list[str], str | None]:
        """(local files, hub split) for 'train' or 'val'."""
        if role == "train":
            if self.train_files:
                return self.train_files, None
            if self.dataset_name:
                return [], self.train_split
            raise ValueError("TextDataModule needs `train_files` or `dataset_name`")
        if self.val_files:
            return self.val_files, None
        if self.dataset_name and self.val_split:
            return [], self.val_split
        return [], None

    def _documents(self, files: list[str], split: str | None) -> list[Any]:
        docs: list[Any] = []
        for f in files:
            docs.extend(self._read_file(f))
        if split is not None:
            docs.extend(self._read_hub(split))
        return docs

    # ------------------------------------------------------------------ tokenizing

    def _tokenize_text(self, docs: list[str], source: str) -> list[tuple[np.ndarray, np.ndarray]]:
        eos = self.tokenizer.eos_token_id
        streams = []
        for start in range(0, len(docs), 512):
            chunk = docs[start : start + 512]
            for i, d in enumerate(chunk):
                if not isinstance(d, str):
                    raise TypeError(f"{source}: document {start + i} field {self.text_field!r} is not a string")
            enc = self.tokenizer(chunk, add_special_tokens=False)["input_ids"]
            for ids in enc:
                arr = np.asarray([*ids, eos], np.int32)
                streams.append((arr, np.ones_like(arr, dtype=bool)))
        return streams

    def _tokenize_chat(self, convs: list[Any], source: str) -> list[tuple[np.ndarray, np.ndarray]]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"tokenizer {self.tokenizer_path} has no chat template: format='chat' needs one")
        eos = tok.eos_token_id
        streams = []
        for i, messages in enumerate(convs):
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise TypeError(f"{source}: conversation {i} field {self.messages_field!r} is not a list of messages")
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids = list(out["input_ids"])
            mask = list(out["assistant_masks"])
            if not any(mask) and any(m.get("role") == "assistant" for m in messages):
                raise ValueError(
                    f"{source}: the chat template of {self.tokenizer_path} marks no assistant tokens in conversation"
                    f" {i}; it needs {{% generation %}} blocks around assistant turns"
                )
            if not ids or ids[-1] != eos:
                ids.append(eos)
                mask.append(0)
            streams.append((np.asarray(ids, np.int32), np.asarray(mask, bool)))
        return streams

    def _rows(self, docs: list[Any], source: str) -> tuple[np.ndarray, np.ndarray]:
        if self.format == "chat":
            streams = self._tokenize_chat(docs, source)
        else:
            streams = self._tokenize_text(docs, source)
        if self.pack:
            return pack_rows(streams, self.seq_len)
        pad = self.tokenizer.pad_token_id
        return pad_rows(streams, self.seq_len, self.tokenizer.eos_token_id if pad is None else pad)

    # ------------------------------------------------------------------ caching

    def _cache_key(self) -> str:
        def stamp(path: str) -> list[Any]:
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(f"data file not found: {path}")
            st = p.stat()
            return [str(p.resolve()), st.st_size, st.st_mtime_ns]

        record = {
            "version": CACHE_VERSION,
            "train": [stamp(f) for f in self.train_files or []],
            "val": [stamp(f) for f in self.val_files or []],
            "hub": [self.dataset_name, self.dataset_config, self.train_split, self.val_split],
            "tokenizer": tokenizer_hash(self.tokenizer),
            "chat_template": getattr(self.tokenizer, "chat_template", None) if self.format == "chat" else None,
            "args": [self.format, self.text_field, self.messages_field, self.seq_len, self.pack],
            "split": [self.val_fraction, self.seed, self.max_documents],
        }
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]

    def _build(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        files, split = self._sources("train")
        train_source = ", ".join(files) if files else f"{self.dataset_name}[{split}]"
        docs = self._documents(files, split)
        if self.max_documents is not None:
            docs = docs[: self.max_documents]
        if not docs:
            raise ValueError(f"no documents in the training data: {train_source}")
        val_files, val_split = self._sources("val")
        val_source = ", ".join(val_files) if val_files else f"{self.dataset_name}[{val_split}]"
        if val_files or val_split:
            val_docs = self._documents(val_files, val_split)
            if not val_docs:
                raise ValueError(f"no documents in the validation data: {val_source}")
        elif self.val_fraction > 0:
            if len(docs) < 2:
                raise ValueError(f"val_fraction={self.val_fraction} needs at least 2 documents in {train_source}")
            order = np.random.default_rng(self.seed).permutation(len(docs))
            n_val = min(max(1, round(len(docs) * self.val_fraction)), len(docs) - 1)
            val_set = set(order[:n_val].tolist())
            val_docs = [d for i, d in enumerate(docs) if i in val_set]
            docs = [d for i, d in enumerate(docs) if i not in val_set]
            val_source = f"{len(val_docs)} documents carved from {train_source}"
        else:
            val_docs = []
        out = {"train": self._rows(docs, train_source)}
        if len(out["train"][0]) == 0:
            raise ValueError(
                f"the training data is too small: {len(docs)} documents give fewer tokens than one sequence of"
                f" seq_len + 1 = {self.seq_len + 1} tokens: {train_source}"
            )
        if val_docs:
            out["val"] = self._rows(val_docs, val_source)
            if len(out["val"][0]) == 0:
                raise ValueError(
                    f"the validation data is too small for one sequence of {self.seq_len + 1} tokens: {val_source}"
                )
        return out

    def _load_or_build(self, write: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        folder = Path(self.cache_dir) / self._cache_key()
        if (folder / "done").is_file():
            out = {}
            for role in ("train", "val"):
                if (folder / f"{role}_ids.npy").is_file():
                    # memory-mapped: worker processes and ranks on one node share the pages
                    ids = np.load(folder / f"{role}_ids.npy", mmap_mode="r")
                    out[role] = (ids, np.load(folder / f"{role}_trained.npy", mmap_mode="r"))
            log.info("loaded tokenized rows from %s", folder)
            return out
        out = self._build()
        if write:
            tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            for role, (ids, trained) in out.items():
                np.save(tmp / f"{role}_ids.npy", ids)
                np.save(tmp / f"{role}_trained.npy", trained)
            (tmp / "done").write_text("ok\n")
            try:
                tmp.rename(folder)
            except OSError:  # another process finished first: keep its copy
                log.info("tokenized rows already cached in %s", folder)
        return out

    # ------------------------------------------------------------------ Lightning hooks

    def prepare_data(self) -> None:
        """Tokenize and cache the rows once (Lightning calls this on one process per node)."""
        self._load_or_build(write=True)

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenized rows (from the cache when present)."""
        if self.train_dataset is not None:
            return
        rows = self._load_or_build(write=True)
        self.train_dataset = TokenRows(*rows["train"])
        self.val_dataset = TokenRows(*rows["val"]) if "val" in rows else None

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def train_dataloader(self) -> DataLoader:
        """The training loader: resumable, rank-aware order over `train_dataset` (drops a ragged last batch)."""
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        rank, world = self._rank_world()
        epoch, start = 0, 0
        # Lightning restores the data module's state for validate/test too: only a fit from a checkpoint resumes.
        resuming = self.trainer is None or getattr(self.trainer, "ckpt_path", None) is not None
        if self._resume_position and resuming:
            epoch, start = resume_point(
                self._resume_position, len(self.train_dataset), self.batch_size, world, self.seed, self.shuffle
            )
        self._resume_position = None
        self._train_sampler = ResumableSampler(
            len(self.train_dataset), self.batch_size, rank, world, self.seed, self.shuffle, epoch, start
        )
        return ResumableLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=self._train_sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader | list:
        """The validation loader in data set order (an empty list when there is no validation data)."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        return DataLoader(self.val_dataset, batch_size=self.val_batch_size, shuffle=False, num_workers=self.num_workers)

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
