"""Size of a quickstart KD checkpoint without the frozen teacher (now) against the same checkpoint with it (before).

    python -m bench.bench_checkpoint_size [--artifacts artifacts]

Runs recipes/quickstart/kd.yaml for 2 steps on the tiny target ``make demo`` trained, into a temporary folder, and
measures its ``last.ckpt``. The earlier layout is rebuilt from it: the same checkpoint plus the teacher's weights
under ``teacher.model.`` (what the state dict held when the teacher was part of it), saved the same way.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from bench.common import ROOT
from trainer.training.recipe import DraftsmithCLI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", default="artifacts", help="where `make demo` left the corpus and the target")
    args = parser.parse_args()
    artifacts = Path(args.artifacts)
    if not (artifacts / "tiny_target" / "config.json").is_file():
        raise SystemExit(f"{artifacts}/tiny_target not found: run `make demo` first")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        override = {
            "trainer": {
                "max_steps": 2, "default_root_dir": str(run), "logger": False, "enable_progress_bar": False,
                "callbacks": [{
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(run / "checkpoints"), "save_last": True},
                }],
            },
            "model": {"init_args": {"target": str(artifacts / "tiny_target"), "export_dir": str(run / "student")}},
            "data": {"init_args": {
                "tokenizer": str(artifacts / "corpus" / "tokenizer"),
                "train_files": [str(artifacts / "corpus" / "train.jsonl")],
                "val_files": [str(artifacts / "corpus" / "heldout.jsonl")],
            }},
        }  # fmt: skip
        (run / "override.yaml").write_text(yaml.safe_dump(override))
        recipe = ROOT / "recipes" / "quickstart" / "kd.yaml"
        cli = DraftsmithCLI(args=["fit", "--config", str(recipe), "--config", str(run / "override.yaml")])
        ckpt = run / "checkpoints" / "last.ckpt"
        now = ckpt.stat().st_size
        data = torch.load(ckpt, map_location="cpu", weights_only=True)
        teacher = cli.model.target.model
        teacher_state = {f"teacher.model.{k}": v for k, v in torch.nn.Module.state_dict(teacher).items()}
        data["state_dict"] = {**data["state_dict"], **teacher_state}
        torch.save(data, run / "with_teacher.ckpt")
        before = (run / "with_teacher.ckpt").stat().st_size
        student = sum(p.numel() for p in cli.model.student.parameters())
        frozen = sum(p.numel() for p in teacher.parameters())
    print("| checkpoint of recipes/quickstart/kd.yaml | bytes | parameters held |")
    print("|---|---|---|")
    print(f"| with the frozen teacher (before) | {before / 1e6:.1f} MB | {student / 1e6:.2f} M student + "
          f"{frozen / 1e6:.2f} M teacher |")  # fmt: skip
    print(f"| trainable state only (now) | {now / 1e6:.1f} MB | {student / 1e6:.2f} M student |")
    print(f"ratio now / before: {now / before:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
