"""What serving a drafter adds to its target: parameters, and the bytes of those the target does not already hold."""

from __future__ import annotations

from collections import defaultdict

import torch

from trainer.compare.config import TRAINING_FREE


def footprint(drafter: str, target: str) -> dict:
    """The drafter at ``drafter`` (a checkpoint or export, as ``draftsmith eval --drafter`` takes it) against the
    target at ``target``: its parameter count, and the count and bytes of its tensors that equal none of the
    target's. A tensor equal to one of the target's (shape, dtype and values: the shared embedding and head of MTP
    modules, the whole model of a self-speculative drafter) is the target's at serving time. Drafters without
    weights (prompt lookup, early exit) add nothing. The KV cache a drafter fills is not counted."""
    if drafter in TRAINING_FREE:
        return {"parameters": 0, "extra_parameters": 0, "extra_bytes": 0, "kind": drafter, "formats": []}
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from trainer.training.registry import get_kind, load_drafter

    hf_logging.disable_progress_bar()  # the comparison prints one line per stage

    module, record = load_drafter(drafter)
    reference = AutoModelForCausalLM.from_pretrained(target)
    by_shape: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for tensor in reference.state_dict().values():
        by_shape[(tuple(tensor.shape), tensor.dtype)].append(tensor)
    seen: set[int] = set()
    parameters = extra = extra_bytes = 0
    for tensor in module.parameters():
        if tensor.data_ptr() in seen:  # tied weights are stored once
            continue
        seen.add(tensor.data_ptr())
        parameters += tensor.numel()
        data = tensor.detach()
        if not any(torch.equal(data, other) for other in by_shape.get((tuple(data.shape), data.dtype), [])):
            extra += tensor.numel()
            extra_bytes += tensor.numel() * tensor.element_size()
    kind = get_kind(record.kind, drafter)
    return {
        "parameters": parameters,
        "extra_parameters": extra,
        "extra_bytes": extra_bytes,
        "kind": record.kind,
        "formats": [f.name for f in kind.formats],
    }
