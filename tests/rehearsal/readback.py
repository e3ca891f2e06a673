"""``python -m tests.rehearsal.readback CKPT EXPORT...``: reads each exported folder back with its format's loader (the
one ``draftsmith eval`` and the round-trip tests use: every tensor consumed, none missing, shapes checked) and
compares every weight it shares with the training checkpoint's drafter, in the export's dtype. Prints one JSON line
per export; exits 1 on a weight that differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    from trainer.training.registry import load_drafter, recognise

    torch.set_num_threads(1)
    ckpt, folders = argv[0], argv[1:]
    trained, record = load_drafter(ckpt)
    reference = {k: v.detach() for k, v in trained.state_dict().items()}
    failed = False
    for folder in folders:
        if Path(folder).name == "hf" and record.kind == "mtp":  # the target without its modules: a plain HF model
            print(json.dumps(plain_model(Path(folder))), flush=True)
            continue
        kind, fmt = recognise(Path(folder))
        module, loaded_record = fmt.load(Path(folder))
        state = module.state_dict()
        common = sorted(set(state) & set(reference))
        differ = [k for k in common if not torch.equal(state[k].detach(), reference[k].to(state[k].dtype))]
        failed |= bool(differ) or loaded_record.kind != record.kind
        report = {
            "folder": folder, "kind": kind.name, "format": fmt.name, "tensors": len(state), "compared": len(common),
            "differ": differ[:5], "record_kind": loaded_record.kind,
        }  # fmt: skip
        print(json.dumps(report), flush=True)
        del module, state
    return 1 if failed else 0


def plain_model(folder: Path) -> dict:
    """The MTP kind's ``hf`` export, the trunk without its modules, read as transformers reads a target: it loads
    and holds no ``mtp`` tensor."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    mtp = [k for k in state if ".mtp." in f".{k}" or k.startswith("mtp")]
    assert not mtp, f"{folder}: the plain model holds MTP tensors {mtp[:3]}"
    return {"folder": str(folder), "kind": "plain HF model (transformers)", "format": "hf", "tensors": len(state)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
