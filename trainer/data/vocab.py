"""Vocabulary compatibility between a teacher, a student and the data.

Two models may be distilled into one another only if token id i means the same string in both. The check compares
tokenizer hashes (vocabulary, merges and special tokens); the widths of the output layers may still differ by padding
(e.g. 152064 vs 151936 rows for the same tokenizer), in which case the shared ids are the tokenizer's length and the
extra rows, which no text ever produces, are left out of the loss.

The data's tokenizer is compared with the model's from the tokenizer files alone (:func:`check_data_tokenizer`):
nothing of the corpus is read or tokenized, so data of another tokenizer is refused in seconds, and a model folder
without a tokenizer is refused by name (its widths cannot tell two tokenizers of one size apart).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer.data.tokenizer import tokenizer_hash
from trainer.interface.errors import TokenizerError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer_if_present(name_or_path: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved beside a model, or None when a local directory holds none."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name_or_path)


def shared_vocab_size(
    teacher_name: str,
    teacher_tokenizer: PreTrainedTokenizerBase | None,
    teacher_width: int,
    student_name: str,
    student_tokenizer: PreTrainedTokenizerBase | None,
    student_width: int,
) -> int:
    """The number of leading logit columns that mean the same token for both, or a TokenizerError naming both."""
    if teacher_tokenizer is not None and student_tokenizer is not None:
        t_hash, s_hash = tokenizer_hash(teacher_tokenizer), tokenizer_hash(student_tokenizer)
        if t_hash != s_hash:
            raise TokenizerError(
                f"vocabulary mismatch: the teacher {teacher_name!r} (tokenizer hash {t_hash[:16]}, "
                f"{len(teacher_tokenizer)} tokens) and {student_name} (tokenizer hash {s_hash[:16]}, "
                f"{len(student_tokenizer)} tokens) do not share a tokenizer: distil between models that share one"
            )
        n = len(teacher_tokenizer)
    else:
        n = min(teacher_width, student_width)
        if teacher_width != student_width:
            raise TokenizerError(
                f"vocabulary mismatch: the teacher {teacher_name!r} has {teacher_width} output rows and {student_name} "
                f"{student_width}, and no tokenizer is saved beside them to tell which ids they share"
            )
    if n > teacher_width or n > student_width:
        raise TokenizerError(
            f"vocabulary mismatch: the tokenizer has {n} tokens but the teacher {teacher_name!r} has {teacher_width} "
            f"output rows and {student_name} {student_width}: a token id would fall outside a model's vocabulary"
        )
    return n


def check_tokenizer_files(
    data_tokenizer: str, model_name: str, model_tokenizer: PreTrainedTokenizerBase | None, width: int
) -> None:
    """Refuses data tokenized by ``data_tokenizer`` for a model whose tokenizer is ``model_tokenizer``, from the
    tokenizer files alone (their hashes: vocabulary, merges, special tokens), before any text is tokenized.

    Args:
        data_tokenizer: the data's tokenizer (folder or hub id), as the recipe names it (``data.tokenizer``).
        model_name: the model's folder or hub id (the target, or the model being trained), for the message.
        model_tokenizer: the tokenizer saved beside the model, None when its folder holds none.
        width: the model's output rows: every id the data's tokenizer produces must be below it.

    Raises:
        TokenizerError: the model folder holds no tokenizer, the data's tokenizer folder holds none, the two differ
            (even with the same number of tokens), or the data's tokenizer has more tokens than the model has rows.
    """
    if model_tokenizer is None:
        raise TokenizerError(
            f"{model_name}: holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): cannot tell whether the data's "
            f"tokenizer {data_tokenizer} gives the token ids it was trained on",
            hint=f"save the model's own tokenizer into {model_name} (tokenizer.save_pretrained(folder))",
        )
    try:
        data = load_tokenizer_if_present(data_tokenizer)
    except (OSError, ValueError) as err:
        raise TokenizerError(f"data.tokenizer {data_tokenizer}: cannot be loaded ({err})") from err
    if data is None:
        raise TokenizerError(
            f"data.tokenizer {data_tokenizer}: holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
            hint=f"set data.tokenizer to the tokenizer of {model_name}",
        )
    model_hash, data_hash = tokenizer_hash(model_tokenizer), tokenizer_hash(data)
    if model_hash != data_hash:
        raise TokenizerError(
            f"vocabulary mismatch: the data's tokenizer {data_tokenizer} (tokenizer hash {data_hash[:16]}, "
            f"{len(data)} tokens) is not the tokenizer of {model_name} (tokenizer hash {model_hash[:16]}, "
            f"{len(model_tokenizer)} tokens): its token ids mean other strings",
            hint=f"set data.tokenizer to {model_name} (or to a copy of its tokenizer)",
        )
    if len(data) > width:
        raise TokenizerError(
            f"vocabulary mismatch: the data's tokenizer {data_tokenizer} has {len(data)} tokens but {model_name} has "
            f"{width} output rows: a token id would fall outside the model's vocabulary"
        )


def check_data_tokenizer(
    datamodule: Any,
    teacher_name: str,
    teacher_tokenizer: PreTrainedTokenizerBase | None,
    teacher_width: int,
    width: int,
) -> None:
    """Refuses a datamodule whose tokenizer is not the model's (a no-op for data without a tokenizer path), from the
    tokenizer files alone (see :func:`check_tokenizer_files`): call it before the datamodule reads its data.

    Args:
        datamodule: the run's datamodule; its ``tokenizer_path`` (None: nothing to check) is compared.
        teacher_name: the model the data is for (the target's folder or hub id, or the model being trained).
        teacher_tokenizer: the tokenizer saved beside that model (None when its folder holds none: refused).
        teacher_width: that model's output rows.
        width: the output rows the data's ids index (the drafter's); ids must be below both widths.
    """
    data_tokenizer = getattr(datamodule, "tokenizer_path", None)
    if data_tokenizer is None:
        return
    check_tokenizer_files(str(data_tokenizer), str(teacher_name), teacher_tokenizer, min(teacher_width, width))
