"""The project's own corpus: the Python standard library's source, and a byte-level BPE tokenizer trained on it.

`prepare_corpus` (CLI: `draftsmith prepare`) collects the `.py` files of the running interpreter's standard library
(sorted, so the list is deterministic for one Python install), splits them by file into train and held-out sets with a
seeded shuffle, trains the tokenizer on the train split only, and writes::

    out_dir/tokenizer/       PreTrainedTokenizerFast.save_pretrained (AutoTokenizer loads it), with a chat template
    out_dir/train.jsonl      one {"text": file contents, "source": path relative to the stdlib} per file
    out_dir/heldout.jsonl    the same for the held-out files
    out_dir/corpus.json      the arguments, counts and the tokenizer hash

A second call with the same arguments finds corpus.json and reuses the output unless `overwrite=True`.

`write_prompt_files` (which `draftsmith prepare` runs after it) cuts the prompts the recipes and `draftsmith eval` read
from the two splits, each a jsonl of ``{"prompt": ...}`` records::

    out_dir/train_prompts.jsonl    prompts cut from the training files (`training_prompts`, as `draftsmith compare` and
                                   the benchmarks cut them): the input of `draftsmith generate`
    out_dir/heldout_prompts.jsonl  the start of the first held-out files (`write_heldout_prompts`, as `draftsmith demo`
                                   writes artifacts/heldout_prompts.jsonl)
    out_dir/prompts.json           the arguments they were cut with; a rerun with the same ones keeps them
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.data.tokenizer import tokenizer_hash, train_byte_level_bpe, wrap_fast_tokenizer
from trainer.interface.errors import DataError, PathError, UsageError
from trainer.interface.flags import ToolParser

log = logging.getLogger(__name__)

CORPUS_VERSION = 1
PROMPT_CHARS = 160
"""Characters of a prompt cut from a corpus file (the training prompts and the held-out prompts alike)."""
PROMPTS_PER_FILE = 3
"""Training prompts cut from each training file: its start and random line starts."""
HELDOUT_PROMPTS = 10
"""Held-out prompts: the start of this many held-out files (``draftsmith demo``'s evaluation prompts)."""
# Folders left out when include_tests is False: the test suites are large, repetitive and full of odd literals.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True)
class PreparedCorpus:
    """Where a prepared corpus lives and what it holds."""

    out_dir: str
    tokenizer_dir: str
    train_file: str
    heldout_file: str
    meta_file: str
    vocab_size: int
    seed: int
    num_train_files: int
    num_heldout_files: int
    train_bytes: int
    heldout_bytes: int
    train_tokens: int
    heldout_tokens: int
    tokenizer_hash: str
    reused: bool = False


@dataclass(frozen=True)
class PromptFiles:
    """The prompt files cut from a prepared corpus and how many prompts each holds."""

    train_prompts_file: str
    heldout_prompts_file: str
    num_train_prompts: int
    num_heldout_prompts: int
    reused: bool = False


def stdlib_python_files(
    stdlib_dir: str | None = None, include_tests: bool = False, min_file_bytes: int = 256
) -> list[Path]:
    """The standard library's `.py` files, sorted by relative path, without site-packages.

    Args:
        stdlib_dir: the folder to scan; the running interpreter's `sysconfig.get_paths()["stdlib"]` when None.
        include_tests: keep files under `test`, `tests` and `idle_test` folders.
        min_file_bytes: skip files smaller than this (mostly empty `__init__.py`).
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise PathError(f"standard library folder not found: {root}")
    skip = {"site-packages", "dist-packages", "__pycache__"} | (set() if include_tests else set(_TEST_DIRS))
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath, name)
            try:
                if path.is_file() and path.stat().st_size >= min_file_bytes:
                    files.append(path)
            except OSError:
                continue
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(path)


def _count_tokens(tok, texts: list[str]) -> int:  # tok: tokenizers.Tokenizer
    total = 0
    for start in range(0, len(texts), 256):
        total += sum(len(e.ids) for e in tok.encode_batch(texts[start : start + 256], add_special_tokens=False))
    return total


def prepare_corpus(
    out_dir: str,
    vocab_size: int = 8192,
    seed: int = 0,
    heldout_fraction: float = 0.05,
    max_files: int | None = None,
    min_file_bytes: int = 256,
    include_tests: bool = False,
    stdlib_dir: str | None = None,
    overwrite: bool = False,
) -> PreparedCorpus:
    """Build (or reuse) the standard-library corpus and its tokenizer under `out_dir`.

    Args:
        out_dir: output folder; created if missing.
        vocab_size: the tokenizer's vocabulary size, special tokens included.
        seed: seeds the train / held-out split (and which files are kept when `max_files` is set).
        heldout_fraction: share of files held out (at least one file is held out and one kept for training).
        max_files: keep only this many files (a seeded sample of the sorted list); None keeps all.
        min_file_bytes: skip source files smaller than this.
        include_tests: keep the standard library's own test suites.
        stdlib_dir: the folder to scan; the running interpreter's standard library when None.
        overwrite: rebuild even when `out_dir` already holds a corpus made with the same arguments.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise UsageError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if max_files is not None and max_files < 2:
        raise UsageError(f"max_files must be at least 2 (one train and one held-out file), got {max_files}")
    out = Path(out_dir)
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    args = {
        "version": CORPUS_VERSION,
        "vocab_size": vocab_size,
        "seed": seed,
        "heldout_fraction": heldout_fraction,
        "max_files": max_files,
        "min_file_bytes": min_file_bytes,
        "include_tests": include_tests,
        "stdlib": str(root),
    }
    meta_path = out / "corpus.json"
    if meta_path.is_file() and not overwrite:
        meta = json.loads(meta_path.read_text())
        if meta.get("args") == args and (out / "tokenizer" / "tokenizer.json").is_file():
            log.info("reusing the corpus in %s", out)
            return dataclasses.replace(_from_meta(out, meta), reused=True)
        log.info("the corpus in %s was made with other arguments: rebuilding it", out)

    files = stdlib_python_files(str(root), include_tests=include_tests, min_file_bytes=min_file_bytes)
    if len(files) < 2:
        raise DataError(f"found {len(files)} usable .py files under {root}: need at least 2")
    rng = random.Random(seed)
    order = list(range(len(files)))
    rng.shuffle(order)
    if max_files is not None:
        order = order[:max_files]
    n_heldout = min(max(1, round(len(order) * heldout_fraction)), len(order) - 1)
    heldout_idx = sorted(order[:n_heldout])
    train_idx = sorted(order[n_heldout:])

    def records(indices: list[int]) -> list[dict[str, str]]:
        recs = []
        for i in indices:
            text = files[i].read_text(encoding="utf-8", errors="ignore")
            recs.append({"text": text, "source": files[i].relative_to(root).as_posix()})
        return recs

    train, heldout = records(train_idx), records(heldout_idx)
    train_texts = [r["text"] for r in train]
    heldout_texts = [r["text"] for r in heldout]
    tok = train_byte_level_bpe(train_texts, vocab_size=vocab_size, length=len(train_texts))
    fast = wrap_fast_tokenizer(tok)

    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    fast.save_pretrained(str(tok_dir))
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "heldout.jsonl", heldout)
    meta = {
        "args": args,
        "vocab_size": len(fast),
        "num_train_files": len(train),
        "num_heldout_files": len(heldout),
        "train_bytes": sum(len(t.encode("utf-8")) for t in train_texts),
        "heldout_bytes": sum(len(t.encode("utf-8")) for t in heldout_texts),
        "train_tokens": _count_tokens(tok, train_texts),
        "heldout_tokens": _count_tokens(tok, heldout_texts),
        "tokenizer_hash": tokenizer_hash(fast),
    }
    tmp = meta_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(meta_path)
    return _from_meta(out, meta)


def _from_meta(out: Path, meta: dict) -> PreparedCorpus:
    return PreparedCorpus(
        out_dir=str(out),
        tokenizer_dir=str(out / "tokenizer"),
        train_file=str(out / "train.jsonl"),
        heldout_file=str(out / "heldout.jsonl"),
        meta_file=str(out / "corpus.json"),
        vocab_size=int(meta["vocab_size"]),
        seed=int(meta["args"]["seed"]),
        num_train_files=int(meta["num_train_files"]),
        num_heldout_files=int(meta["num_heldout_files"]),
        train_bytes=int(meta["train_bytes"]),
        heldout_bytes=int(meta["heldout_bytes"]),
        train_tokens=int(meta["train_tokens"]),
        heldout_tokens=int(meta["heldout_tokens"]),
        tokenizer_hash=str(meta["tokenizer_hash"]),
    )


def _write_prompts(path: Path, prompts: list[str]) -> None:
    """``prompts`` as one ``{"prompt": ...}`` record a line at ``path``, written to a temporary file first."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    tmp.replace(path)


def training_prompts(documents: Path, out: Path, chars: int, per_document: int, seed: int) -> int:
    """Prompts of ``chars`` characters cut from every ``text`` document of a jsonl file: its start and
    ``per_document - 1`` random line starts, shuffled; writes them to ``out`` (one ``prompt`` per line), returns how
    many. The one cut of `draftsmith prepare`, `draftsmith compare` and the benchmarks.

    Args:
        documents: jsonl file of ``{"text": ...}`` records (such as a corpus' train.jsonl).
        out: the jsonl file to write.
        chars: characters per prompt.
        per_document: prompts cut from each document (fewer where it has fewer line starts).
        seed: seeds the choice of line starts and the shuffle.
    """
    rng = random.Random(seed)
    prompts = []
    for number, line in enumerate(documents.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{documents}:{number}: expected a JSON object with a 'text' string ({err})") from err
        starts = [i + 1 for i, c in enumerate(text[:-chars]) if c == "\n"]
        for start in [0] + rng.sample(starts, min(per_document - 1, len(starts))):
            prompt = text[start : start + chars]
            if prompt.strip():
                prompts.append(prompt)
    if not prompts:
        raise DataError(f"{documents}: no document to cut a prompt from")
    rng.shuffle(prompts)
    _write_prompts(out, prompts)
    return len(prompts)


def heldout_prompts(heldout_file: str | Path, count: int = HELDOUT_PROMPTS, chars: int = PROMPT_CHARS) -> list[str]:
    """The first ``chars`` characters of the first ``count`` documents of a held-out jsonl file.

    Args:
        heldout_file: jsonl file of ``{"text": ...}`` records (such as a corpus' heldout.jsonl).
        count: how many documents to take (all of them when the file has fewer).
        chars: characters per prompt.
    """
    prompts = []
    for number, line in enumerate(Path(heldout_file).read_text(encoding="utf-8").splitlines()[:count], 1):
        try:
            prompts.append(json.loads(line)["text"][:chars])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{heldout_file}:{number}: expected a JSON object with a 'text' string ({err})") from err
    return prompts


def write_heldout_prompts(
    heldout_file: str | Path, out: str | Path, count: int = HELDOUT_PROMPTS, chars: int = PROMPT_CHARS
) -> Path:
    """:func:`heldout_prompts` as a ``{"prompt": ...}`` jsonl at ``out`` (what ``draftsmith eval --prompts`` reads);
    returns ``out``.

    Args:
        heldout_file: jsonl file of ``{"text": ...}`` records (such as a corpus' heldout.jsonl).
        out: the jsonl file to write.
        count: how many documents to take a prompt from.
        chars: characters per prompt.
    """
    out = Path(out)
    _write_prompts(out, heldout_prompts(heldout_file, count, chars))
    return out


def _check_prompt_counts(prompt_chars: int, prompts_per_file: int, num_heldout_prompts: int) -> None:
    """UsageError naming the option when a count of :func:`write_prompt_files` is below 1.

    Args:
        prompt_chars: characters per prompt.
        prompts_per_file: training prompts cut from each training file.
        num_heldout_prompts: held-out prompts.
    """
    for name, value in (
        ("prompt_chars", prompt_chars),
        ("prompts_per_file", prompts_per_file),
        ("heldout_prompts", num_heldout_prompts),
    ):
        if value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")


def write_prompt_files(
    corpus: PreparedCorpus,
    prompt_chars: int = PROMPT_CHARS,
    prompts_per_file: int = PROMPTS_PER_FILE,
    num_heldout_prompts: int = HELDOUT_PROMPTS,
    overwrite: bool = False,
) -> PromptFiles:
    """Cut (or keep) ``train_prompts.jsonl`` and ``heldout_prompts.jsonl`` in the corpus' folder.

    The training prompts are seeded with the corpus' seed. Files cut from the same corpus with the same arguments
    (``prompts.json`` says which) are kept unless ``overwrite``.

    Args:
        corpus: the prepared corpus (:func:`prepare_corpus`) whose train and held-out files are cut.
        prompt_chars: characters per prompt, training and held-out alike.
        prompts_per_file: training prompts cut from each training file.
        num_heldout_prompts: held-out prompts, one from the start of each of the first held-out files.
        overwrite: cut them again even when the folder holds prompts cut with the same arguments.
    """
    _check_prompt_counts(prompt_chars, prompts_per_file, num_heldout_prompts)
    out = Path(corpus.out_dir)
    train_out, heldout_out, meta_path = out / "train_prompts.jsonl", out / "heldout_prompts.jsonl", out / "prompts.json"
    args = {
        "corpus": json.loads(Path(corpus.meta_file).read_text())["args"],
        "prompt_chars": prompt_chars,
        "prompts_per_file": prompts_per_file,
        "heldout_prompts": num_heldout_prompts,
        "seed": corpus.seed,
    }
    if meta_path.is_file() and train_out.is_file() and heldout_out.is_file() and not overwrite:
        meta = json.loads(meta_path.read_text())
        if meta.get("args") == args:
            log.info("reusing the prompts in %s", out)
            return PromptFiles(
                str(train_out), str(heldout_out), int(meta["num_train_prompts"]), int(meta["num_heldout_prompts"]), True
            )
    meta_path.unlink(missing_ok=True)  # gone while the files change: an interrupted run cuts them again
    num_train = training_prompts(Path(corpus.train_file), train_out, prompt_chars, prompts_per_file, corpus.seed)
    held = heldout_prompts(corpus.heldout_file, num_heldout_prompts, prompt_chars)
    _write_prompts(heldout_out, held)
    meta = {"args": args, "num_train_prompts": num_train, "num_heldout_prompts": len(held)}
    tmp = meta_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(meta_path)
    return PromptFiles(str(train_out), str(heldout_out), num_train, len(held))


def build_parser() -> ToolParser:
    """The parser of ``draftsmith prepare``."""
    parser = ToolParser(
        prog="draftsmith prepare",
        description="Build the standard-library corpus and its byte-level BPE tokenizer, then cut its training and "
        "held-out prompts (train_prompts.jsonl, heldout_prompts.jsonl).",
    )
    parser.add_argument("--output_dir", required=True, help="output folder")
    parser.add_argument("--vocab_size", type=int, default=8192, help="tokenizer vocabulary size (default 8192)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the train / held-out split and of the training prompts (default 0)"
    )
    parser.add_argument("--heldout_fraction", type=float, default=0.05, help="share of files held out (0.05)")
    parser.add_argument("--max_files", type=int, default=None, help="keep only this many files (default: all)")
    parser.add_argument("--include_tests", action="store_true", help="keep the standard library's test suites")
    parser.add_argument(
        "--prompt_chars", type=int, default=PROMPT_CHARS, help=f"characters per prompt (default {PROMPT_CHARS})"
    )
    parser.add_argument(
        "--prompts_per_file",
        type=int,
        default=PROMPTS_PER_FILE,
        help=f"training prompts cut from each training file into train_prompts.jsonl (default {PROMPTS_PER_FILE})",
    )
    parser.add_argument(
        "--heldout_prompts",
        type=int,
        default=HELDOUT_PROMPTS,
        help=f"prompts in heldout_prompts.jsonl, from the first held-out files (default {HELDOUT_PROMPTS})",
    )
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if the output exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`draftsmith prepare`: build the standard-library corpus and tokenizer, then print a summary."""
    ns = build_parser().parse_args(argv)
    _check_prompt_counts(ns.prompt_chars, ns.prompts_per_file, ns.heldout_prompts)  # before the corpus is built
    start = time.perf_counter()
    corpus = prepare_corpus(
        ns.output_dir,
        vocab_size=ns.vocab_size,
        seed=ns.seed,
        heldout_fraction=ns.heldout_fraction,
        max_files=ns.max_files,
        include_tests=ns.include_tests,
        overwrite=ns.overwrite,
    )
    prompts = write_prompt_files(
        corpus,
        prompt_chars=ns.prompt_chars,
        prompts_per_file=ns.prompts_per_file,
        num_heldout_prompts=ns.heldout_prompts,
        overwrite=ns.overwrite,
    )
    elapsed = time.perf_counter() - start
    print(
        f"{'reused' if corpus.reused else 'prepared'} corpus in {corpus.out_dir} ({elapsed:.1f} s)\n"
        f"  files:  {corpus.num_train_files} train, {corpus.num_heldout_files} held out\n"
        f"  bytes:  {corpus.train_bytes:,} train, {corpus.heldout_bytes:,} held out\n"
        f"  tokens: {corpus.train_tokens:,} train, {corpus.heldout_tokens:,} held out (vocab {corpus.vocab_size})\n"
        f"  tokenizer: {corpus.tokenizer_dir} (hash {corpus.tokenizer_hash[:16]})\n"
        f"  prompts: {prompts.num_train_prompts:,} in {prompts.train_prompts_file}, "
        f"{prompts.num_heldout_prompts} in {prompts.heldout_prompts_file}{' (reused)' if prompts.reused else ''}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
