"""Vocabulary compatibility between a teacher, a student and the data.

Two models may be distilled into one another only if token id i means the same string in both. The check compares
tokenizer hashes (vocabulary, merges and special tokens); the widths of the output layers may still differ by padding
(e.g. 152064 vs 151936 rows for the same tokenizer), in which case the shared ids are the tokenizer's length and the
extra rows, which no text ever produces, are left out of the loss.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer.data.tokenizer import tokenizer_hash

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer_if_present(name_or_path: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved beside a model, or None when a local directory holds none."""
    path = Path(name_or_path)
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(name_or_path)


def shared_vocab_size(
    teacher_name: str,
    teacher_tokenizer: PreTrainedTokenizerBase | None,
    teacher_width: int,
    student_name: str,
    student_tokenizer: PreTrainedTokenizerBase | None,
    student_width: int,
) -> int:
    """The number of leading logit columns that mean the same token for both, or a ValueError naming both sides."""
    if teacher_tokenizer is not None and student_tokenizer is not None:
        t_hash, s_hash = tokenizer_hash(teacher_tokenizer), tokenizer_hash(student_tokenizer)
        if t_hash != s_hash:
            raise ValueError(
                f"vocabulary mismatch: the teacher {teacher_name!r} (tokenizer hash {t_hash[:16]}, "
                f"{len(teacher_tokenizer)} tokens) and {student_name} (tokenizer hash {s_hash[:16]}, "
                f"{len(student_tokenizer)} tokens) do not share a tokenizer: distil between models that share one"
            )
        n = len(teacher_tokenizer)
    else:
        n = min(teacher_width, student_width)
        if teacher_width != student_width:
            raise ValueError(
                f"vocabulary mismatch: the teacher {teacher_name!r} has {teacher_width} output rows and {student_name} "
                f"{student_width}, and no tokenizer is saved beside them to tell which ids they share"
            )
    if n > teacher_width or n > student_width:
        raise ValueError(
            f"vocabulary mismatch: the tokenizer has {n} tokens but the teacher {teacher_name!r} has {teacher_width} "
            f"output rows and {student_name} {student_width}: a token id would fall outside a model's vocabulary"
        )
    return n


def check_data_tokenizer(
    datamodule, teacher_name: str, teacher_tokenizer: PreTrainedTokenizerBase | None, teacher_width: int, width: int
) -> None:
    """Refuses a datamodule whose tokenizer is not the teacher's (a no-op for data without a tokenizer path)."""
    data_tokenizer = getattr(datamodule, "tokenizer_path", None)
    if data_tokenizer is not None:
        shared_vocab_size(
            teacher_name=teacher_name,
            teacher_tokenizer=teacher_tokenizer,
            teacher_width=teacher_width,
            student_name=f"the data's tokenizer {data_tokenizer}",
            student_tokenizer=load_tokenizer_if_present(data_tokenizer),
            student_width=width,
        )
