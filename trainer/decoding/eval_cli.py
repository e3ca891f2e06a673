"""``draftsmith eval``: real speculative decoding of a drafter against its target, greedy and sampling.

For every K of the sweep, the target alone and the target with the drafter decode the same prompts
(trainer/decoding/evaluate.py). Greedy mode must reproduce the target's output token for token (a difference is an
error, never a statistic); sampling mode runs speculative sampling at ``--temperature``. The report (report.json,
report.md, acceptance.png) gives tau, acceptance per draft position, target forwards, the measured draft cost c,
Leviathan's projected speedup, the measured wall-clock speedup, and the share of the target's greedy output that sits
in loops with tau inside and outside them. The drafting flags (``--tree``, ``--tree_nodes``, ``--exit_layer``...) are
the fields of :class:`~trainer.decoding.options.ProposerOptions`, which the training callback takes too.
``--accept_threshold 0,0.2,0.4`` measures dynamic draft length at each threshold with one proposer, side by side in
one report (a drafter that cannot estimate its acceptance is refused, naming the flag).
``--context_lengths 256,1024,2048`` measures by context length: prompts cut at each length from the ``--prompts``
documents (trainer/decoding/context.py), decoded together, and the report's ``by_context`` and
acceptance_by_context.png give tau, acceptance per draft position and the target's own loss per length.

Refused in one line before anything is decoded: a ``--target`` folder whose safetensors file is empty or truncated
(named), a drafter export given as ``--target`` (named with its kind and the target it names), and a drafter measured
against a target other than the one it was made for (unless ``--allow_other_target``): the fingerprint a training
checkpoint recorded or ``draftsmith export`` wrote beside an export, or the weights of a target the drafter trained
and carries; trainer/decoding/evaluate.py holds these checks (a drafter export that records no target is measured,
with one warning line).
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from trainer.decoding.context import cut_buckets, flatten, target_loss_by_context
from trainer.decoding.drift import heldout_text, target_drift
from trainer.decoding.evaluate import evaluate_drafter, load_prompts, refuse_drafter_as_target, resolve_drafter
from trainer.decoding.identity import SpeculativeMismatchError
from trainer.decoding.options import ProposerOptions, add_option_arguments, options_from_arguments, positive_ints
from trainer.decoding.report import write_report
from trainer.interface.errors import TokenizerError, UsageError, UserError
from trainer.interface.flags import ToolParser
from trainer.interface.output import block, duration
from trainer.models.target import check_safetensors_headers, resolve_model
from trainer.training.registry import is_training_checkpoint


def build_parser() -> ToolParser:
    """The parser of ``draftsmith eval``: the command's own flags, then one per drafting option."""
    parser = ToolParser(prog="draftsmith eval", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--target",
        required=True,
        help="the target: an HF model folder (with its tokenizer) or a hub id (org/name) in the local Hugging Face "
        "cache, HF_HUB_OFFLINE=1 too; a drafter export here is refused, naming its target",
    )
    parser.add_argument(
        "--allow_other_target",
        action="store_true",
        help="measure a training checkpoint against a target other than the one whose fingerprint it recorded "
        "(refused by default)",
    )
    parser.add_argument(
        "--drafter",
        required=True,
        help="a training checkpoint (.ckpt or DeepSpeed folder), an exported drafter folder (any format draftsmith "
        "writes: its kind is read from its files), or a drafter without weights: prompt-lookup, none, early-exit",
    )
    parser.add_argument(
        "--write_tree",
        default=None,
        metavar="FILE",
        help="parallel heads: measure the heads' top-k accuracy on the prompts and write the best tree of "
        "--tree_nodes paths to this JSON file (then use it with --tree --tree_choices FILE)",
    )
    parser.add_argument(
        "--prompts",
        required=True,
        help="jsonl file: one 'prompt' or 'text' string, chat 'messages' or 'input_ids' per line",
    )
    parser.add_argument(
        "--prompt_tokens", type=int, default=0, help="cut every prompt to its first N tokens (0: keep it whole)"
    )
    parser.add_argument(
        "--context_lengths",
        type=positive_ints("--context_lengths"),
        default=None,
        metavar="L[,L...]",
        help="measure by context length: for each L, the first L tokens of every --prompts document at least "
        "L + --max_new_tokens tokens long (--max_prompts: per length); the report adds by_context and "
        "acceptance_by_context.png",
    )
    parser.add_argument(
        "--k", type=positive_ints("--k"), default=[4], help="drafts per round, or a sweep such as 1,2,4,8"
    )
    parser.add_argument("--max_new_tokens", type=int, default=128, help="output budget per prompt")
    parser.add_argument(
        "--output_dir", required=True, help="output directory for report.json, report.md, acceptance.png"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling-mode temperature (0 skips sampling)")
    parser.add_argument(
        "--max_prompts",
        type=int,
        default=0,
        help="use only the first N prompts (0: all; per length with --context_lengths)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling mode")
    parser.add_argument(
        "--repeats",
        type=positive_ints("--repeats"),
        default=[1],
        help="passes over the prompts, the target alone and with the drafter side by side (the measured speedup is "
        "the median of the per-prompt ratios of all passes)",
    )
    parser.add_argument(
        "--original_target",
        default=None,
        metavar="MODEL",
        help="(a folder or a hub id, as --target) for a target a method changed (LayerSkip and parallel-heads "
        "fine-tunes, Medusa-2): the model it was fine-tuned from (their exports record it as fine_tuned_from); the "
        "report gives both models' held-out loss on the --heldout text and loop share of their greedy output side "
        "by side",
    )
    parser.add_argument(
        "--heldout",
        default=None,
        metavar="FILE",
        help="with --original_target: jsonl of held-out text ('text' documents, such as the corpus' held-out file; "
        "each cut to the target's context, or to --heldout_tokens) the two models' held-out loss is measured on "
        "(default: the prompts)",
    )
    parser.add_argument(
        "--heldout_tokens",
        type=int,
        default=0,
        metavar="N",
        help="score each --heldout document's first N tokens (0: up to the target's context); for a target trained on "
        "rows shorter than its config's context, the length it was trained at: past it the original extrapolates, and "
        "a fine-tune on longer rows 'improves' there whatever it did to the positions both were trained at",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    parser.add_argument(
        "--target_dtype",
        default="float32",
        choices=["float32", "float64", "bfloat16", "float16"],
        help="the target's weights dtype (and --original_target's)",
    )
    add_option_arguments(parser)
    return parser


def load_target(
    name: str, dtype: str, device: torch.device, what: str = "--target"
) -> tuple[PreTrainedModel, object, str]:
    """The HF target, its tokenizer and its folder, from a local folder or a hub id (trainer/models/target.py
    ``resolve_model``: the local Hugging Face cache, offline too), with an error that says what the folder lacks."""
    path = str(resolve_model(name, what))
    refuse_drafter_as_target(path)
    check_safetensors_headers(path, f"{what} {name!r}")  # an empty or truncated weights file, named
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, ImportError) as err:
        raise TokenizerError(f"{what} {name!r}: no usable tokenizer in that folder ({err})") from err
    target = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return target, tokenizer, path


def _threshold(entry: dict) -> str:
    """`` threshold X`` for an entry of dynamic draft length, else nothing."""
    return f" threshold {entry['accept_threshold']:g}" if entry["accept_threshold"] > 0 else ""


def _error(message: str, err: BaseException) -> None:
    """``error: <message>`` on standard error, and the hint of a :class:`UserError` on the next line."""
    print(f"error: {message}", file=sys.stderr)
    if isinstance(err, UserError) and err.hint:
        print(f"hint: {err.hint}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftsmith eval``; returns the exit status: 2 for a bad input or a greedy output mismatch (a
    :class:`~trainer.interface.errors.UserError` goes to the command's handler, which prints it and exits 2)."""
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    if args.heldout_tokens < 0 or args.heldout_tokens == 1:
        raise UsageError(f"--heldout_tokens must be 0 (the target's context) or at least 2, got {args.heldout_tokens}")
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    try:
        sweep = options_from_arguments(args)  # several exit layers: one evaluation each, in out/exit_<E>
        target, tokenizer, target_path = load_target(
            args.target, args.target_dtype, device
        )  # a hub id: its cached folder
        context = getattr(target.config, "max_position_embeddings", None)
        max_length = context - args.max_new_tokens if context else None
        buckets, indices = None, None
        if args.context_lengths:
            if args.prompt_tokens:
                raise UsageError(
                    f"--prompt_tokens {args.prompt_tokens} with --context_lengths: the context lengths cut the prompts",
                    hint="drop --prompt_tokens",
                )
            documents = load_prompts(args.prompts, tokenizer, None)
            buckets = cut_buckets(
                documents, args.context_lengths, args.max_new_tokens, max_length, args.max_prompts, args.prompts
            )
            prompts, indices = flatten(buckets)
        else:
            prompts = load_prompts(args.prompts, tokenizer, max_length, cut=args.prompt_tokens or None)
        # the thresholds reach the proposer through the engine: one proposer per set of the other options
        groups: dict[ProposerOptions, list[float]] = {}
        for options in sweep:
            groups.setdefault(replace(options, accept_threshold=0.0), []).append(options.accept_threshold)
        proposers = [
            (options, resolve_drafter(args.drafter, target, options, tokenizer, target_path, args.allow_other_target))
            for options in groups
        ]
        for options, proposer in proposers:
            if any(t > 0 for t in groups[options]) and not getattr(proposer, "estimates_acceptance", False):
                raise UsageError(
                    f"--accept_threshold {','.join(f'{t:g}' for t in groups[options])}: the drafter "
                    f"{args.drafter} ({type(proposer).__name__}) gives no estimate of its acceptance to cut drafts by",
                    hint="drop --accept_threshold (or give 0); eagle3, peagle, dflash, medusa, mtp_heads, mtp and "
                    "draft models estimate it",
                )
    except UserError:
        raise  # the command's handler: `error:` and `hint:` lines, exit status 2
    except (OSError, ValueError) as err:
        _error(str(err), err)
        return 2
    try:
        for _, proposer in proposers:
            for k in args.k:  # every --k before any decoding
                proposer.check_k(k)
    except UserError:
        raise
    except ValueError as err:
        _error(f"{args.drafter}: {err}", err)
        return 2
    if args.max_prompts > 0 and buckets is None:
        prompts = prompts[: args.max_prompts]
    if args.write_tree:
        options, proposer = proposers[0]
        try:
            paths = proposer.write_tree(Path(args.write_tree), target, prompts, args.max_new_tokens, options.tree_nodes)
        except UserError:
            raise
        except ValueError as err:
            _error(f"{args.drafter}: {err}", err)
            return 2
        print(f"wrote a {len(paths)}-node tree from the heads' measured accuracy to {args.write_tree}")
    eos = target.generation_config.eos_token_id if target.generation_config is not None else None
    eos = tokenizer.eos_token_id if eos is None else eos
    original, heldout = None, None
    if args.original_target:
        try:
            original, _, _ = load_target(args.original_target, args.target_dtype, device, what="--original_target")
            cut = min((n for n in (context, args.heldout_tokens) if n), default=None)  # the tighter limit given
            heldout = load_prompts(args.heldout, tokenizer, None, cut=cut) if args.heldout else None
        except UserError:
            raise
        except (OSError, ValueError) as err:
            _error(f"--original_target {args.original_target!r} or --heldout {args.heldout!r}: {err}", err)
            return 2
    losses = None  # the target's loss by context length: the same for every report
    summary: list[tuple[str, str]] = []  # rows of the closing block
    for options, proposer in proposers:
        exit_layer = options.exit_layer
        out = Path(args.output_dir) / f"exit_{exit_layer}" if len(proposers) > 1 else Path(args.output_dir)
        try:
            report = evaluate_drafter(
                target, proposer, prompts, args.k, args.max_new_tokens, args.temperature, eos, args.seed,
                args.repeats[0], groups[options], indices, progress=True,
            )  # fmt: skip
        except SpeculativeMismatchError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        report.update(
            target=args.target, drafter=args.drafter, prompts=len(prompts), max_new_tokens=args.max_new_tokens
        )
        if exit_layer is not None:
            report["exit_layer"] = exit_layer
        if buckets is not None:
            losses = losses or target_loss_by_context(target, buckets)
            for bucket in report["by_context"]:
                bucket.update(losses[bucket["context_length"]])
        if original is not None:
            report["original_target"] = target_drift(
                original, target, prompts, args.max_new_tokens, eos, report["loops"]["share"], args.original_target,
                heldout, heldout_text(args.heldout, args.heldout_tokens),
            )  # fmt: skip
        written = write_report(report, out)
        prefix = "" if exit_layer is None else f"E={exit_layer} "
        for entry in report["greedy"]:
            low, high = entry["measured_speedup_quartiles"]
            dynamic = (
                f" threshold {entry['accept_threshold']:g} ({entry['drafts_per_round']:.2f} drafts per round)"
                if len(groups[options]) > 1 or entry["accept_threshold"] > 0
                else ""
            )
            print(
                f"{prefix}K={entry['k']}{dynamic}: tau {entry['tau']:.3f}, speedup {entry['measured_speedup']:.2f}x "
                "measured "
                f"(quartiles {low:.2f}-{high:.2f}), "
                f"{entry['projected_speedup']:.2f}x projected (c={entry['draft_cost']:.3f})"
            )
        for bucket in report.get("by_context", []):
            taus = ", ".join(f"K={e['k']}{_threshold(e)} tau {e['tau']:.3f}" for e in bucket["greedy"])
            print(
                f"{prefix}context {bucket['context_length']} ({bucket['prompts']} prompts, target loss "
                f"{bucket['target_loss']:.3f}): {taus}"
            )
        best = next((e for e in report["greedy"] if e["k"] == report["best_k"]), None)
        if best is not None:
            summary.append(
                (
                    f"{prefix}best K",
                    f"{best['k']}{_threshold(best)}: tau {best['tau']:.3f}, {best['measured_speedup']:.2f}x measured",
                )
            )
        summary.append((f"{prefix}loops", f"{report['loops']['share']:.1%} of the target's greedy output"))
        if original is not None:
            drift = report["original_target"]
            print(
                f"changed target against its original: held-out loss {drift['target']['heldout_loss']:.3f} "
                f"({drift['original']['heldout_loss']:.3f}), loop share {drift['target']['loop_share']:.1%} "
                f"({drift['original']['loop_share']:.1%})"
            )
        summary.append((f"{prefix}report", ", ".join(str(p) for p in written)))
    rows = [("target", args.target), ("drafter", args.drafter), ("prompts", f"{len(prompts)} from {args.prompts}")]
    commands = []
    if is_training_checkpoint(Path(args.drafter)):
        out = Path(args.drafter).resolve().parent.parent / "export"
        commands.append(
            f"draftsmith export --ckpt_path {shlex.quote(args.drafter)} --output_dir {shlex.quote(str(out))}"
        )
    print(block(f"eval done in {duration(time.monotonic() - started)}", rows + summary, commands), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
