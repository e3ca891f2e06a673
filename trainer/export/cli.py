"""``draftsmith export --ckpt_path CKPT --output_dir DIR [--format FORMAT]``: a trained drafter in a serving
engine's format.

The checkpoint's drafter record says what the drafter is; its kind says which formats it can be written in
(trainer/training/registry.py). Without ``--format`` the kind's first format that can hold the drafter is written (an
EAGLE-3.1 drafter's norm flags: ``eagle3-speculators``, not ``eagle3``). Beside it goes the fingerprint of the frozen
target the checkpoint recorded (``target_fingerprint.json``, trainer/training/fingerprint.py), which ``draftsmith eval``
compares with its ``--target``; a drafter that carries the target it trained (Medusa-2, an MTP pre-training) is compared
by that target's own weights instead, and gets none.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trainer.interface.errors import CheckpointError, PathError, UserError, debugging, error_report
from trainer.interface.flags import ToolParser
from trainer.interface.output import NO_PROMPTS, block, duration, eval_command, recorded_eval_prompts
from trainer.training.fingerprint import recorded_fingerprints, write_export_record
from trainer.training.registry import DrafterRecord, ExportFormat, get_kind, is_training_checkpoint, kinds


def _formats_help() -> str:
    return "; ".join(f"{k.name}: {', '.join(f.name for f in k.formats)}" for k in kinds().values())


def export(ckpt: str, out: str, fmt: str | None = None) -> tuple[Path, str]:
    """Write the drafter of training checkpoint ``ckpt`` to ``out``; returns the folder and the format's name.

    Nothing is written when the checkpoint holds no drafter record, a kind draftsmith does not know, or a kind that
    cannot be written as ``fmt``.
    """
    folder, writer, _ = _export(ckpt, out, fmt)
    return folder, writer.name


def _export(ckpt: str, out: str, fmt: str | None) -> tuple[Path, ExportFormat, DrafterRecord]:
    """:func:`export`, returning the format written and the checkpoint's drafter record."""
    from trainer.checkpoints.reading import load_training_checkpoint

    path = Path(ckpt)
    if not path.exists():
        raise PathError(f"checkpoint {ckpt!r} does not exist")
    if not is_training_checkpoint(path):
        raise CheckpointError(
            f"{ckpt!r} is neither a .ckpt file nor a DeepSpeed or FSDP2 distributed checkpoint folder (no checkpoint/ "
            "or .metadata inside)"
        )
    state, raw = load_training_checkpoint(ckpt)
    record = DrafterRecord.from_dict(raw, ckpt)
    kind = get_kind(record.kind, ckpt)
    writer = kind.format(fmt, record)
    module = kind.load(record, state, ckpt)
    folder = writer.write(module, record, Path(out))
    recorded = recorded_fingerprints(ckpt)
    target = recorded.get("target") or recorded.get("teacher")  # KD checkpoints record their target as the teacher
    if isinstance(target, dict) and (kind.carried_target is None or kind.carried_target(module) is None):
        write_export_record(folder, target)
    return folder, writer, record


def build_parser() -> ToolParser:
    """The parser of ``draftsmith export``."""
    parser = ToolParser(prog="draftsmith export", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--ckpt_path", required=True, help="a Lightning .ckpt file or a DeepSpeed checkpoint directory (as fit's)"
    )
    parser.add_argument("--output_dir", required=True, help="output directory")
    parser.add_argument(
        "--format",
        default=None,
        help=f"target format (default: the kind's first that can hold the drafter). {_formats_help()}",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftsmith export``; returns the exit status (2 when nothing could be written)."""
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        path, written, record = _export(args.ckpt_path, args.output_dir, args.format)
    except UserError as err:
        if debugging():
            raise
        print(error_report(err), file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as err:  # a format's writer refusing this drafter
        print(f"error: {err}", file=sys.stderr)
        return 2
    others = [f.name for f in get_kind(record.kind, args.ckpt_path).formats if f.name != written.name]
    rows = [
        ("checkpoint", str(args.ckpt_path)),
        (
            "drafter",
            f"{record.kind}, written as {written.name}" + (f" (other formats: {', '.join(others)})" if others else ""),
        ),
        ("folder", str(path)),
        ("serve", "\n".join(written.serve(path, record)) if written.serve is not None else ""),
    ]
    commands = []
    if record.target:
        recorded = recorded_eval_prompts(args.ckpt_path)
        if recorded is None:
            rows.append(("measure", NO_PROMPTS))
        else:
            out = path.parent / (path.name + "_eval")
            commands.append(eval_command(record.target, path, recorded[0], recorded[1], out))
    print(block(f"export done in {duration(time.monotonic() - started)}", rows, commands), flush=True)
    return 0
