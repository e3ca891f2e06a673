"""Load a speculators ``peagle`` export with the speculators library itself and write its logits for given elements.

Runs inside the client virtualenv (tests/clients/venvs.py):

    python speculators_peagle_forward.py EXPORT FEATURES OUT [--attn IMPL]

The export is loaded by ``SpeculatorModel.from_pretrained(EXPORT)``, which resolves ``PEagleDraftModel``
(speculators/models/peagle/core.py) from ``speculators_model_type``; every tensor the forward uses is checked to come
from the file (speculators_forward.audit: ``embed_tokens.weight`` and ``mask_hidden`` are among the keys speculators
may miss and then keeps uninitialised memory). ``PEagleDraftModel.forward`` draws its (anchor, depth) elements with
``generate_cod_sample_indices``, at random; the elements of FEATURES are put in its place so that both sides run the
same elements.

FEATURES (safetensors), one sequence of S elements in speculators' convention (element t pairs the target features
of token t with token t + 1): ``hidden_states`` [1, S, n * Ht], ``input_ids`` [1, S], ``anchor`` and ``depth``
[N] int64 (the elements, depth 0 first). OUT receives ``logits`` [1, N, Vd] float32 (captured from ``lm_head``) and a
JSON report on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.losses import resolve_loss_config
from speculators.models.peagle import core as peagle_core
from speculators_forward import audit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("features")
    parser.add_argument("out")
    parser.add_argument("--attn", default=None, choices=["simple_flex_attention", "eager", "sdpa"])
    args = parser.parse_args(argv)
    config = SpeculatorModelConfig.from_pretrained(args.export)
    if args.attn is not None:
        config.transformer_layer_config._attn_implementation = args.attn
    model = SpeculatorModel.from_pretrained(args.export, config=config).eval()
    report = audit(model, args.export)
    report["model_class"] = type(model).__name__
    report["mask_token_id"] = model.mask_token_id
    report["steps"] = model.config.speculators_config.proposal_methods[0].speculative_tokens
    report["layers"] = len(model.layers)
    flags = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    report["config_flags"] = {flag: getattr(model.config, flag, None) for flag in flags}
    if report["missing"] or report["differ_from_file"] or report["nan"]:
        print(json.dumps(report))
        return 2
    with safe_open(args.features, framework="pt") as f:
        hidden, ids = f.get_tensor("hidden_states"), f.get_tensor("input_ids")
        anchor, depth = f.get_tensor("anchor"), f.get_tensor("depth")
    peagle_core.generate_cod_sample_indices = lambda **_: (anchor, depth)  # our elements instead of a random draw
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    S = ids.shape[1]
    with torch.no_grad():
        model(
            hidden_states=hidden.to(model.fc.weight.dtype),
            input_ids=ids,
            document_ids=torch.zeros(1, S, dtype=torch.long),
            loss_mask=torch.ones(1, S),
            verifier_last_hidden_states=torch.zeros(1, S, model.hidden_size, dtype=model.fc.weight.dtype),
            num_depths=int(depth.max()) + 1,
            loss_config=resolve_loss_config("kl_div", "eager"),  # the loss only (zero targets); no Triton on CPU
        )
    hook.remove()
    save_file({"logits": captured[0].float().contiguous()}, args.out)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
