"""``draftsmith eval``: real speculative decoding of a drafter against its target, greedy and sampling.

For every K of the sweep, the target alone and the target with the drafter decode the same prompts. Greedy mode must
reproduce the target's output token for token (a difference is an error, never a statistic); sampling mode runs
speculative sampling at ``--temperature``. The report (report.json, report.md, acceptance.png) gives tau, acceptance
per draft position, target forwards, the measured draft cost c, Leviathan's projected speedup, the measured
wall-clock speedup, and the share of the target's greedy output that sits in loops with tau inside and outside them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from trainer.data.tokenizer import tokenizer_hash
from trainer.decoding import metrics
from trainer.decoding.generate import GenerationResult, speculative_generate
from trainer.decoding.head_tree import tree_for_budget
from trainer.decoding.heads_proposer import ParallelHeadsProposer, measure_head_accuracy
from trainer.decoding.proposers import NoProposer, Proposer, build_proposer, registered_proposers
from trainer.decoding.report import write_report
from trainer.registry import ProposerOptions, check_target, get_kind, load_drafter
from trainer.vocab import load_tokenizer_if_present

log = logging.getLogger(__name__)

LOOP_WINDOW = 16
LOOP_MAX_PERIOD = 8


class SpeculativeMismatchError(RuntimeError):
    """Greedy speculative output differs from the target's own greedy output."""


def load_prompts(path: str | Path, tokenizer, max_length: int | None = None, cut: int | None = None) -> list[list[int]]:
    """Token ids of every line of a jsonl file: a ``prompt`` string, chat ``messages`` (through the chat template),
    a ``text`` document (such as the corpus' held-out files) or ``input_ids``.

    Args:
        path: the jsonl file.
        tokenizer: the target's tokenizer (chat lines need its chat template).
        max_length: the most tokens a prompt may have (the target's context less the output budget), or None.
        cut: keep only the first this many tokens of every prompt (None: whole prompts).
    """
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{number}: expected an object with 'prompt', 'messages', 'text' or 'input_ids'"
                )
            if isinstance(record.get("prompt"), str) or isinstance(record.get("text"), str):
                ids = tokenizer(record.get("prompt", record.get("text"))).input_ids
            elif isinstance(record.get("messages"), list):
                if not getattr(tokenizer, "chat_template", None):
                    raise ValueError(f"{path}:{number}: chat 'messages' given but the tokenizer has no chat template")
                text = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, add_special_tokens=False).input_ids
            elif isinstance(record.get("input_ids"), list) and all(isinstance(t, int) for t in record["input_ids"]):
                ids = record["input_ids"]
            else:
                raise ValueError(
                    f"{path}:{number}: needs a string 'prompt' or 'text', a list 'messages' or token 'input_ids', got "
                    f"keys {list(record)}"
                )
            ids = list(ids)[:cut]
            if not ids:
                raise ValueError(f"{path}:{number}: the prompt tokenizes to nothing")
            if max_length is not None and len(ids) > max_length:
                raise ValueError(
                    f"{path}:{number}: the prompt has {len(ids)} tokens, more than the {max_length} the target's "
                    "context leaves beside the output budget (shorten it, cut it with --prompt-tokens, or lower "
                    "--max-new-tokens)"
                )
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def resolve_drafter(
    spec: str, target: PreTrainedModel, options: ProposerOptions = ProposerOptions(), target_tokenizer=None
) -> Proposer:
    """``--drafter``: a registered name needing no weights (``prompt-lookup``, ``none``, ``early-exit``), or the path
    of a training checkpoint or an exported folder, whose drafter kind builds the proposer.

    A drafter made for another target (vocabulary, hidden size, layers, tokenizer) is refused, naming the path.
    """
    if spec in registered_proposers():
        return build_proposer(spec, target, options)
    if not os.path.exists(spec):
        raise ValueError(
            f"--drafter {spec!r} is neither an existing checkpoint or export folder nor a registered proposer "
            f"({', '.join(registered_proposers())})"
        )
    module, record = load_drafter(spec)
    check_target(record, target.config, spec)
    drafter_tokenizer = load_tokenizer_if_present(record.tokenizer) if record.tokenizer else None
    if drafter_tokenizer is not None and target_tokenizer is not None:
        if tokenizer_hash(drafter_tokenizer) != tokenizer_hash(target_tokenizer):
            raise ValueError(
                f"{spec}: the drafter's tokenizer ({record.tokenizer}) is not the target's: token ids would mean "
                "different strings"
            )
    elif record.target_vocab_size is None and hasattr(module, "get_output_embeddings"):
        width = module.get_output_embeddings().weight.shape[0]  # a draft model without a tokenizer beside it
        if width != target.config.vocab_size:
            raise ValueError(f"{spec}: a drafter of {width} output tokens for a target of {target.config.vocab_size}")
    module = module.to(device=target.device, dtype=target.dtype).eval()
    return get_kind(record.kind, spec).proposer(module, record, target, options)


def run_prompts(
    target: PreTrainedModel,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | list[int] | None = None,
    seed: int = 0,
) -> list[GenerationResult]:
    """Decode every prompt (one at a time); sampling uses a generator seeded with ``seed + prompt index``."""
    results = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator(device=target.device).manual_seed(seed + i) if temperature > 0 else None
        ids = torch.tensor(list(prompt), dtype=torch.long, device=target.device)  # [S]
        results.append(
            speculative_generate(target, ids, proposer, k, max_new_tokens, temperature, eos_token_id, generator)
        )
    return results


def check_identity(reference: Sequence[GenerationResult], results: Sequence[GenerationResult], k: int) -> None:
    """Raise :class:`SpeculativeMismatchError` naming the prompt and position where greedy outputs first differ."""
    for i, (ref, res) in enumerate(zip(reference, results)):
        if ref.tokens != res.tokens:
            pos = next((j for j, (a, b) in enumerate(zip(ref.tokens, res.tokens)) if a != b), None)
            pos = min(len(ref.tokens), len(res.tokens)) if pos is None else pos
            raise SpeculativeMismatchError(
                f"K={k}, prompt {i}: greedy speculative output differs from the target's at output position {pos} "
                f"(target {ref.tokens[pos : pos + 5]}, speculative {res.tokens[pos : pos + 5]})"
            )


def _forward_seconds(baseline: Sequence[GenerationResult]) -> float:
    """Mean wall-clock time of one decoding forward of the target alone (prefill excluded)."""
    seconds = sum(r.target_seconds - r.prefill_seconds for r in baseline)
    forwards = sum(r.target_forwards - 1 for r in baseline)
    return seconds / forwards if forwards else float("nan")


def run_side_by_side(
    target: PreTrainedModel,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | list[int] | None = None,
    seed: int = 0,
    repeats: int = 1,
) -> tuple[list[GenerationResult], list[GenerationResult], list[float]]:
    """Every prompt decoded by the target alone and with the drafter one right after the other, which of the two goes
    first alternating from prompt to prompt and from pass to pass, over ``repeats`` passes: a load change on a shared
    machine then hits both sides of a ratio alike. Returns the first pass's results of the target alone and with the
    drafter, and the wall-clock ratio (alone / with the drafter) of every prompt in every pass."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    alone, drafted, ratios = [], [], []
    for repeat in range(repeats):
        for i, prompt in enumerate(prompts):
            pair = {}
            for who in ("alone", "drafter") if (i + repeat) % 2 == 0 else ("drafter", "alone"):
                pair[who] = run_prompts(
                    target, NoProposer() if who == "alone" else proposer, [prompt], 1 if who == "alone" else k,
                    max_new_tokens, temperature, eos_token_id, seed + i,
                )[0]  # fmt: skip
            ratios.append(pair["alone"].total_seconds / pair["drafter"].total_seconds)
            if repeat == 0:
                alone.append(pair["alone"])
                drafted.append(pair["drafter"])
    return alone, drafted, ratios


def summarize(
    results: Sequence[GenerationResult], baseline: Sequence[GenerationResult], k: int, ratios: Sequence[float]
) -> dict:
    """The statistics of one mode and one K, pooled over prompts; the measured speedup is the median of the
    side-by-side ratios (:func:`run_side_by_side`), with their quartiles as its spread."""
    rounds = [r for res in results for r in res.rounds]
    alpha = metrics.acceptance_rate(rounds)
    drafted = sum(r.drafted for r in rounds)
    propose = sum(res.propose_seconds for res in results)
    forward = _forward_seconds(baseline)
    cost = propose / drafted / forward if drafted else 0.0  # Leviathan's c: per drafted token
    per_round = propose / len(rounds) / forward if rounds else 0.0  # a round's drafting, chain or tree
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0], ratios[0], ratios[0]]
    return {
        "k": k,
        "tau": metrics.tau(rounds),
        "acceptance_per_position": metrics.acceptance_per_position(rounds, k),
        "acceptance_rate": alpha,
        "target_forwards": sum(res.target_forwards for res in results),
        "baseline_target_forwards": sum(res.target_forwards for res in baseline),
        "tokens": sum(len(res.tokens) for res in results),
        "draft_cost": cost,
        "draft_cost_per_round": per_round,
        "projected_speedup": metrics.leviathan_speedup(alpha, k, cost) if not math.isnan(alpha) else 1.0,
        "measured_speedup": statistics.median(ratios),
        "measured_speedup_quartiles": [quartiles[0], quartiles[2]],
        "measured_pairs": len(ratios),
    }


def loop_statistics(baseline: Sequence[GenerationResult]) -> tuple[dict, list[list[bool]]]:
    """Loop share of the target's own greedy output, and the per-prompt loop masks."""
    masks = [metrics.loop_mask(r.tokens, LOOP_WINDOW, LOOP_MAX_PERIOD) for r in baseline]
    total = sum(len(m) for m in masks)
    return {
        "share": sum(sum(m) for m in masks) / total if total else 0.0,
        "looped_prompts": sum(any(m) for m in masks),
        "window": LOOP_WINDOW,
        "max_period": LOOP_MAX_PERIOD,
    }, masks


def evaluate_drafter(
    target: PreTrainedModel,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    ks: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    seed: int = 0,
    repeats: int = 1,
) -> dict:
    """Greedy and sampling evaluation for every K, each run side by side with the target alone
    (:func:`run_side_by_side`, ``repeats`` passes); raises :class:`SpeculativeMismatchError` on a greedy mismatch."""
    run_prompts(target, NoProposer(), prompts[:1], 1, min(8, max_new_tokens), 0.0, eos_token_id)  # warm-up
    report: dict = {"greedy": [], "sampling": [], "temperature": temperature, "repeats": repeats}
    greedy_base, masks = None, None
    for k in ks:
        base, results, ratios = run_side_by_side(
            target, proposer, prompts, k, max_new_tokens, 0.0, eos_token_id, repeats=repeats
        )
        if greedy_base is None:
            greedy_base = base
            report["loops"], masks = loop_statistics(greedy_base)
        check_identity(greedy_base, results, k)
        entry = summarize(results, base, k, ratios)
        inside, outside = [], []
        for res, mask in zip(results, masks):
            a, b = metrics.split_rounds_by_loop(res.rounds, mask)
            inside += a
            outside += b
        entry.update(
            identical=True,
            tau_in_loops=metrics.tau(inside),
            tau_outside_loops=metrics.tau(outside),
            rounds_in_loops=len(inside),
            rounds_outside_loops=len(outside),
        )
        report["greedy"].append(entry)
        log.info("greedy K=%d tau=%.3f speedup=%.2f", k, entry["tau"], entry["measured_speedup"])
    if temperature > 0:
        for k in ks:
            base, results, ratios = run_side_by_side(
                target, proposer, prompts, k, max_new_tokens, temperature, eos_token_id, seed, repeats
            )
            report["sampling"].append(summarize(results, base, k, ratios))
    best = max(report["greedy"], key=lambda e: e["measured_speedup"])
    report["best_k"] = best["k"]
    report["baseline"] = {
        "target_forwards": sum(r.target_forwards for r in greedy_base),
        "tokens": sum(len(r.tokens) for r in greedy_base),
        "seconds": sum(r.total_seconds for r in greedy_base),
        "forward_seconds": _forward_seconds(greedy_base),
    }
    return report


def _positive_ints(flag: str):
    """An argparse type: integers >= 1 separated by commas, errors naming ``flag``."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{flag} must be integers separated by commas, got {text!r}") from err
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} needs values >= 1, got {text!r}")
        return values

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HF target model directory (with its tokenizer)")
    parser.add_argument(
        "--drafter",
        required=True,
        help="a training checkpoint (.ckpt or DeepSpeed folder), an exported drafter folder (any format draftsmith "
        "writes: its kind is read from its files), or a drafter without weights: prompt-lookup, none, early-exit",
    )
    parser.add_argument("--tree", action="store_true", help="draft a tree (eagle3, dflash, medusa, mtp_heads, mtp)")
    parser.add_argument("--tree-nodes", type=int, default=24, help="node budget of a tree (default 24)")
    parser.add_argument("--tree-top-k", type=int, default=4, help="children per expanded tree node (default 4)")
    parser.add_argument("--rank-temperature", type=float, default=0.1, help="temperature that ranks tree nodes")
    parser.add_argument(
        "--exit-layer",
        type=_positive_ints("--exit-layer"),
        default=None,
        help="the layer self-speculative drafters (early-exit, LayerSkip) exit at, or a sweep such as 1,2,3 (one "
        "report each, in OUT/exit_<E>)",
    )
    parser.add_argument(
        "--tree-choices", default=None, help="parallel heads: a JSON file of tree paths (per-head top-k ranks)"
    )
    parser.add_argument(
        "--write-tree",
        default=None,
        help="parallel heads: measure the heads' top-k accuracy on the prompts and write the best tree of "
        "--tree-nodes paths to this JSON file (then use it with --tree --tree-choices FILE)",
    )
    parser.add_argument(
        "--prompts",
        required=True,
        help="jsonl file: one 'prompt' or 'text' string, chat 'messages' or 'input_ids' per line",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="cut every prompt to its first N tokens (0: keep it whole)"
    )
    parser.add_argument(
        "--k", type=_positive_ints("--k"), default=[4], help="drafts per round, or a sweep such as 1,2,4,8"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="output budget per prompt")
    parser.add_argument("--out", required=True, help="output directory for report.json, report.md, acceptance.png")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling-mode temperature (0 skips sampling)")
    parser.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling mode")
    parser.add_argument(
        "--repeats",
        type=_positive_ints("--repeats"),
        default=[1],
        help="passes over the prompts, the target alone and with the drafter side by side (the measured speedup is "
        "the median of the per-prompt ratios of all passes)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    return parser


def read_tree(path: str) -> tuple[tuple[int, ...], ...]:
    """Tree paths from a JSON file: a list of paths, or the ``paths`` of a file ``--write-tree`` wrote."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--tree-choices {path}: not a readable JSON file ({err})") from err
    paths = data.get("paths") if isinstance(data, dict) else data
    if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
        raise ValueError(f"--tree-choices {path}: expected a list of paths (lists of top-k ranks)")
    return tuple(tuple(int(r) for r in p) for p in paths)


def load_target(path: str, dtype: str, device: torch.device) -> tuple[PreTrainedModel, object]:
    """The HF target and its tokenizer from a local folder, with an error that says what the folder lacks."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--target {path!r} is not a local model folder (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(f"--target {path!r}: no usable tokenizer in that folder ({err})") from err
    target = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return target, tokenizer


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``draftsmith eval``; returns the exit status (2 for a greedy output mismatch)."""
    args = _parser().parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    sweep = args.exit_layer or [None]  # several exit layers: one evaluation each, in out/exit_<E>
    try:
        options = ProposerOptions(
            tree=args.tree,
            tree_nodes=args.tree_nodes,
            tree_top_k=args.tree_top_k,
            rank_temperature=args.rank_temperature,
            tree_choices=read_tree(args.tree_choices) if args.tree_choices else None,
        )
        target, tokenizer = load_target(args.target, args.dtype, device)
        context = getattr(target.config, "max_position_embeddings", None)
        max_length = context - args.max_new_tokens if context else None
        prompts = load_prompts(args.prompts, tokenizer, max_length, cut=args.prompt_tokens or None)
        proposers = {e: resolve_drafter(args.drafter, target, replace(options, exit_layer=e), tokenizer) for e in sweep}
        limit = getattr(proposers[sweep[0]], "max_drafts", None)  # drafters with a fixed number of heads or modules
        if limit is not None and max(args.k) > limit:
            raise ValueError(f"--k {max(args.k)}: {args.drafter} drafts at most {limit} tokens per round")
        check_k = getattr(proposers[sweep[0]], "check_k", None)  # drafters that refuse some K (MTP modules)
        for k in args.k if check_k is not None else ():
            check_k(k)  # every --k before any decoding
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.max_prompts > 0:
        prompts = prompts[: args.max_prompts]
    if args.write_tree:
        proposer = proposers[sweep[0]]
        if not isinstance(proposer, ParallelHeadsProposer):
            print(f"error: --write-tree: {args.drafter} does not draft with parallel heads", file=sys.stderr)
            return 1
        accuracy = measure_head_accuracy(target, proposer, prompts, args.max_new_tokens, top_k=10)
        paths = tree_for_budget(accuracy, args.tree_nodes)
        record = {"paths": [list(p) for p in paths], "accuracy": accuracy.tolist(), "nodes": len(paths)}
        Path(args.write_tree).write_text(json.dumps(record) + "\n")
        print(f"wrote a {len(paths)}-node tree from the heads' measured top-10 accuracy to {args.write_tree}")
    eos = target.generation_config.eos_token_id if target.generation_config is not None else None
    eos = tokenizer.eos_token_id if eos is None else eos
    for exit_layer, proposer in proposers.items():
        out = Path(args.out) / f"exit_{exit_layer}" if len(sweep) > 1 else Path(args.out)
        try:
            report = evaluate_drafter(
                target,
                proposer,
                prompts,
                args.k,
                args.max_new_tokens,
                args.temperature,
                eos,
                args.seed,
                args.repeats[0],
            )
        except SpeculativeMismatchError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        report.update(
            target=args.target, drafter=args.drafter, prompts=len(prompts), max_new_tokens=args.max_new_tokens
        )
        if exit_layer is not None:
            report["exit_layer"] = exit_layer
        paths = write_report(report, out)
        for entry in report["greedy"]:
            prefix = "" if exit_layer is None else f"E={exit_layer} "
            low, high = entry["measured_speedup_quartiles"]
            print(
                f"{prefix}K={entry['k']}: tau {entry['tau']:.3f}, speedup {entry['measured_speedup']:.2f}x measured "
                f"(quartiles {low:.2f}-{high:.2f}), "
                f"{entry['projected_speedup']:.2f}x projected (c={entry['draft_cost']:.3f})"
            )
        print(f"loop share of the target's output: {report['loops']['share']:.1%}; best K: {report['best_k']}")
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
