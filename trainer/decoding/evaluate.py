"""Real speculative decoding of a drafter against its target, greedy and sampling: the measurement ``draftsmith eval``
(trainer/decoding/eval_cli.py), the training callback and ``draftsmith compare`` report.

For every K of the sweep, the target alone and the target with the drafter decode the same prompts. Greedy mode must
reproduce the target's output token for token (a difference is an error, never a statistic, unless the target's own
logits tie there to their dtype's rounding: trainer/decoding/identity.py); sampling mode runs
speculative sampling at a temperature. :func:`evaluate_drafter` returns tau, acceptance per draft position, target
forwards, the measured draft cost c, Leviathan's projected speedup, the measured wall-clock speedup, and the share of
the target's greedy output that sits in loops with tau inside and outside them (trainer/decoding/report.py writes it).
With several ``accept_thresholds`` (dynamic draft length, trainer/decoding/proposers.py) every K is measured at each
threshold, the same proposer drafting, and the entries say how many drafts a round verified on average and what
drafting cost per round, side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from trainer.data.tokenizer import tokenizer_hash
from trainer.data.vocab import load_tokenizer_if_present
from trainer.decoding import metrics
from trainer.decoding.generate import GenerationResult, speculative_generate
from trainer.decoding.identity import check_identity, describe_near_tie
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer, Proposer, build_proposer, registered_proposers
from trainer.export.files import folder_config
from trainer.export.speculators import read_block
from trainer.interface.errors import CheckpointError, ModelFolderError
from trainer.interface.output import CountProgress
from trainer.training.fingerprint import (
    EXPORT_RECORD,
    describe,
    differences,
    export_record,
    fingerprint,
    recorded_fingerprints,
    sample_differences,
)
from trainer.training.registry import (
    DrafterRecord,
    check_target,
    get_kind,
    is_training_checkpoint,
    load_drafter,
    recognise,
)

log = logging.getLogger(__name__)

LOOP_WINDOW = 16
LOOP_MAX_PERIOD = 8


def load_prompts(path: str | Path, tokenizer, max_length: int | None = None, cut: int | None = None) -> list[list[int]]:
    """Token ids of every line of a jsonl file: a ``prompt`` string, chat ``messages`` (through the chat template,
    with the generation prompt; a conversation's closing assistant turns are left out, so a held-out chat file is its
    own prompts), a ``text`` document (such as the corpus' held-out files) or ``input_ids``.

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
                messages = list(record["messages"])
                while messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
                    messages.pop()  # a held-out conversation: its prompt is what comes before its last reply
                if not messages:
                    raise ValueError(f"{path}:{number}: the 'messages' hold no turn before the assistant's")
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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
                    "context leaves beside the output budget (shorten it, cut it with --prompt_tokens, or lower "
                    "--max_new_tokens)"
                )
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def resolve_drafter(
    spec: str,
    target: PreTrainedModel,
    options: ProposerOptions = ProposerOptions(),
    target_tokenizer=None,
    target_path: str | None = None,
    allow_other_target: bool = False,
) -> Proposer:
    """``--drafter``: a registered name needing no weights (``prompt-lookup``, ``none``, ``early-exit``), or the path
    of a training checkpoint or an exported folder, whose drafter kind builds the proposer.

    A drafter made for another target (vocabulary, hidden size, layers, tokenizer) is refused, naming the path;
    so is one whose recorded or carried target is not ``target_path`` (:func:`check_drafters_target`), unless
    ``allow_other_target``.

    Args:
        spec: the ``--drafter`` value.
        target: the loaded target.
        options: the drafting options.
        target_tokenizer: the target's tokenizer (compared with the drafter's), or None.
        target_path: the target's folder, to compare with the fingerprint a training checkpoint recorded (None: no
            comparison, as for a target the caller built itself).
        allow_other_target: measure a training checkpoint against a target other than the one it recorded.
    """
    if spec in registered_proposers():
        return build_proposer(spec, target, options)
    if not os.path.exists(spec):
        raise ValueError(
            f"--drafter {spec!r} is neither an existing checkpoint or export folder nor a registered proposer "
            f"({', '.join(registered_proposers())})"
        )
    module, record = load_drafter(spec)
    if target_path is not None:
        check_drafters_target(spec, module, record, target_path, allow_other_target)
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


def _is_model_class(config: dict) -> bool:
    """Whether a ``config.json`` describes a model transformers builds as a target: an ``architectures`` entry that is
    a transformers class (``LlamaForCausalLM``, ``Qwen3_5ForConditionalGeneration``...) or a ``*ForCausalLM`` of the
    folder's own code (``auto_map``)."""
    names = [str(n) for n in config.get("architectures") or []]
    remote = "AutoModelForCausalLM" in (config.get("auto_map") or {})
    return any(n in _transformers_names() or (remote and n.endswith("ForCausalLM")) for n in names)


@functools.cache
def _transformers_names() -> frozenset[str]:
    """Every name transformers exports (read from its lazy module, importing no model)."""
    return frozenset(dir(transformers))


def named_target(folder: Path, config: dict) -> str | None:
    """The target a drafter export names: speculators' ``speculators_config.verifier.name_or_path``, Medusa / TGI's
    ``base_model_name_or_path``, or the trained target a Medusa-2 export keeps in ``target/``; None when it names
    none."""
    for name in (read_block(config).verifier, config.get("base_model_name_or_path")):
        if name:
            return str(name)
    return str(folder / "target") if (folder / "target" / "config.json").is_file() else None


def drafter_export(path: str | Path) -> tuple[str, str, str | None] | None:
    """(kind, format, the target it names) of a folder that holds a drafter export and no target model, else None.

    The rule: a format of a registered kind recognises the folder (trainer/training/registry.py ``recognise``), that
    format is not the generic one (any HF causal LM folder is kind ``hf_causal_lm``'s, and is a target as well), and the
    folder's ``config.json`` does not name a model class transformers builds (:func:`_is_model_class`). So a LayerSkip
    export, an MTP checkpoint (NextN, Qwen3-Next) and an MTP-heads export, which are target models with a drafter's
    files beside them, are not drafter exports here; Medusa, EAGLE-3, DFlash (z-lab and speculators) exports are.
    """
    folder = Path(path)
    if not folder.is_dir():
        return None
    try:
        kind, fmt = recognise(folder)
        config = folder_config(folder)
    except (OSError, ValueError):  # no format, or a config that is not JSON: the target's own checks say what
        return None
    if fmt.generic or _is_model_class(config):
        return None
    return kind.name, fmt.name, named_target(folder, config)


def refuse_drafter_as_target(path: str) -> None:
    """``--target``: a drafter export (:func:`drafter_export`) is a :class:`ModelFolderError` that says what it is,
    where its target is, and that ``--drafter`` takes it."""
    found = drafter_export(path)
    if found is None:
        return
    kind, fmt, target = found
    where = f"its target is {target}" if target else "its folder does not name its target"
    raise ModelFolderError(
        f"--target {path}: a drafter export (kind {kind}, format {fmt}), not a target model; {where}",
        hint=f"pass it as --drafter {path} and its target model as --target"
        + (f" {target}" if target else " (the model it was trained for)"),
    )


def check_drafters_target(
    spec: str, module: nn.Module, record: DrafterRecord, target_path: str, allow_other_target: bool = False
) -> None:
    """Refuse to measure a drafter against a target other than the one it was made for, by what it holds of it:

    - a drafter that trained its target and carries it (Medusa-2, an MTP pre-training's trunk; the kind's
      ``carried_target``), from a checkpoint or an export: :func:`check_carried_target`;
    - a training checkpoint: the fingerprint it recorded (:func:`check_trained_target`);
    - an exported folder: the fingerprint ``draftsmith export`` wrote beside it (:func:`check_exported_target`).

    Args:
        spec: the ``--drafter`` path.
        module: the drafter loaded from it.
        record: its record.
        target_path: the ``--target`` folder.
        allow_other_target: measure it anyway (no check, no warning).
    """
    carry = get_kind(record.kind, spec).carried_target
    carried = carry(module) if carry is not None else None
    if carried is not None:
        check_carried_target(spec, carried, target_path, allow_other_target)
    elif is_training_checkpoint(Path(spec)):
        check_trained_target(spec, target_path, allow_other_target)
    else:
        check_exported_target(spec, target_path, allow_other_target)


def _same_weights_or_refuse(spec: str, what: str, ours, target_path: str, allow_other_target: bool) -> None:
    """:func:`sample_differences` of ``ours`` and ``target_path``: a :class:`CheckpointError` when no weight is in
    common or any differs (``what``: the weights ``ours`` are, in the message)."""
    if allow_other_target:
        return
    compared, differ = sample_differences(ours, target_path)
    if compared and not differ:
        return
    found = (
        "no weight of the same name and shape in common"
        if not compared
        else f"{len(differ)} of the {compared} weights both hold differ ({differ[0]} first)"
    )
    raise CheckpointError(
        f"--drafter {spec}: {what}, and --target {target_path} is not that model: {found}",
        hint="give that model as --target; to measure the drafter against this one anyway, pass --allow_other_target",
    )


def check_carried_target(spec: str, carried: nn.Module, target_path: str, allow_other_target: bool = False) -> None:
    """Refuse a drafter that carries the target it trained (Medusa-2, an MTP trunk trained with its modules) measured
    against another model: its weights and ``target_path``'s are compared by sampled values, tensor by tensor
    (:func:`~trainer.training.fingerprint.sample_differences`; a float32 copy and a bfloat16 save agree).

    Raises:
        CheckpointError: no weight in common, or one differing, unless ``allow_other_target``.
    """
    what = "it trained its target and carries it (the model to measure it with)"
    _same_weights_or_refuse(spec, what, carried.state_dict(), target_path, allow_other_target)


def check_exported_target(spec: str, target_path: str, allow_other_target: bool = False) -> None:
    """Refuse an exported drafter measured against a target other than the one it was made for, as far as its folder
    says which: the fingerprint ``draftsmith export`` wrote beside it
    (:data:`~trainer.training.fingerprint.EXPORT_RECORD`), compared as a training checkpoint's is; for a target model
    with a drafter's files beside it (an MTP, MTP-heads or LayerSkip export), that model's own weights, compared with
    ``target_path``'s. A drafter export without a record (a folder another tool wrote, or an export older than the
    record) is one warning line saying that nothing ties it to ``target_path``; a draft model folder (kind
    ``hf_causal_lm``) without one is left to the tokenizer check.

    Raises:
        CheckpointError: a recorded fingerprint that differs, or a model folder whose weights differ, unless
            ``allow_other_target``.
    """
    folder = Path(spec)
    recorded = export_record(folder)
    if recorded is not None:
        if allow_other_target:
            return
        current = fingerprint(target_path, AutoConfig.from_pretrained(target_path))
        differ = differences(recorded, current)
        if differ:
            raise CheckpointError(
                f"--drafter {spec}: exported for another target: its {EXPORT_RECORD} records ({describe(recorded)}), "
                f"--target {target_path} is ({describe(current)}); they differ in {', '.join(differ)}",
                hint="give the target it was trained with as --target; to measure it against this one anyway, pass "
                "--allow_other_target (a config hash alone can change with the transformers version)",
            )
        return
    found = drafter_export(folder)
    if found is not None:
        if not allow_other_target:
            named = f"; it names {found[2]}, which is not compared" if found[2] else ""
            log.warning(
                f"--drafter {spec}: records no target fingerprint (not exported by draftsmith export, or before it "
                f"wrote {EXPORT_RECORD}){named}: nothing but the vocabulary and shapes ties it to --target "
                f"{target_path}"
            )
        return
    try:
        kind, fmt = recognise(folder)
    except ModelFolderError:
        return
    if fmt.generic or folder.resolve() == Path(target_path).resolve():
        return
    what = f"a target model with a {kind.name} drafter's files beside it (format {fmt.name})"
    _same_weights_or_refuse(spec, what, str(folder), target_path, allow_other_target)


def check_trained_target(checkpoint: str, target_path: str, allow_other_target: bool = False) -> None:
    """Refuse to measure a training checkpoint against a target other than the one it recorded.

    Training checkpoints keep the fingerprint of their frozen target (``checkpoint["frozen_models"]["target"]``;
    ``"teacher"`` in KD checkpoints): its config hash, the hash of its weights' names, shapes and dtypes, and a hash of
    a sample of their values (trainer/training/fingerprint.py; reading it costs the safetensors headers and one small
    slice per tensor). They are compared with ``target_path``'s; the path itself is not compared (the same model copied
    elsewhere is the same target). A checkpoint without a recorded target, or an export (no fingerprint), is not checked
    here.

    Raises:
        CheckpointError: naming both fingerprints and what differs, unless ``allow_other_target``.
    """
    recorded = recorded_fingerprints(checkpoint)
    trained = recorded.get("target") or recorded.get("teacher")
    if not isinstance(trained, dict) or allow_other_target:
        return
    current = fingerprint(target_path, AutoConfig.from_pretrained(target_path))
    differ = differences(trained, current)
    if differ:
        raise CheckpointError(
            f"--drafter {checkpoint}: trained for another target: the checkpoint recorded ({describe(trained)}), "
            f"--target {target_path} is ({describe(current)}); they differ in {', '.join(differ)}",
            hint="give the target it was trained with as --target; to measure it against this one anyway, pass "
            "--allow_other_target (a config hash alone can change with the transformers version)",
        )


def run_prompts(
    target: PreTrainedModel,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | list[int] | None = None,
    seed: int = 0,
    accept_threshold: float = 0.0,
) -> list[GenerationResult]:
    """Decode every prompt (one at a time); sampling uses a generator seeded with ``seed + prompt index``;
    ``accept_threshold`` is the engine's (dynamic draft length, 0: off)."""
    results = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator(device=target.device).manual_seed(seed + i) if temperature > 0 else None
        ids = torch.tensor(list(prompt), dtype=torch.long, device=target.device)  # [S]
        results.append(
            speculative_generate(
                target,
                ids,
                proposer,
                k,
                max_new_tokens,
                temperature,
                eos_token_id,
                generator,
                accept_threshold,
            )  # fmt: skip
        )
    return results


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
    accept_threshold: float = 0.0,
    progress: CountProgress | None = None,
) -> tuple[list[GenerationResult], list[GenerationResult], list[float]]:
    """Every prompt decoded by the target alone and with the drafter one right after the other, which of the two goes
    first alternating from prompt to prompt and from pass to pass, over ``repeats`` passes: a load change on a shared
    machine then hits both sides of a ratio alike. Returns the first pass's results of the target alone and with the
    drafter, and the wall-clock ratio (alone / with the drafter) of every prompt in every pass; the drafter decodes
    with ``accept_threshold``; ``progress`` counts each prompt of each pass once both sides decoded it."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    alone, drafted, ratios = [], [], []
    for repeat in range(repeats):
        for i, prompt in enumerate(prompts):
            pair = {}
            for who in ("alone", "drafter") if (i + repeat) % 2 == 0 else ("drafter", "alone"):
                alone_ = who == "alone"
                pair[who] = run_prompts(
                    target, NoProposer() if alone_ else proposer, [prompt], 1 if alone_ else k,
                    max_new_tokens, temperature, eos_token_id, seed + i, 0.0 if alone_ else accept_threshold,
                )[0]  # fmt: skip
            ratios.append(pair["alone"].total_seconds / pair["drafter"].total_seconds)
            if progress is not None:
                progress.update(1)
            if repeat == 0:
                alone.append(pair["alone"])
                drafted.append(pair["drafter"])
    return alone, drafted, ratios


def summarize(
    results: Sequence[GenerationResult],
    baseline: Sequence[GenerationResult],
    k: int,
    ratios: Sequence[float],
    accept_threshold: float = 0.0,
) -> dict:
    """The statistics of one mode, one K and one threshold, pooled over prompts; the measured speedup is the median
    of the side-by-side ratios (:func:`run_side_by_side`), with their quartiles as its spread. ``drafts_per_round``
    is the mean number of draft tokens a target forward verified (tree nodes for a tree)."""
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
        "accept_threshold": accept_threshold,
        "tau": metrics.tau(rounds),
        "drafts_per_round": sum(r.nodes for r in rounds) / len(rounds) if rounds else 0.0,
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
    accept_thresholds: Sequence[float] = (0.0,),
    buckets: Mapping[int, Sequence[int]] | None = None,
    progress: bool = False,
) -> dict:
    """Greedy and sampling evaluation for every K and every threshold of dynamic draft length (``accept_thresholds``,
    0: off), each run side by side with the target alone
    (:func:`run_side_by_side`, ``repeats`` passes); the entries of ``greedy`` and ``sampling`` go by threshold, then
    K. Raises :class:`SpeculativeMismatchError` on a greedy mismatch that is not a near-tie of the target's logits
    (trainer/decoding/identity.py); near-ties are logged and listed in each greedy entry's ``near_ties``.

    ``buckets`` (context length -> the indices of its prompts, trainer/decoding/context.py) adds ``by_context``: per
    bucket, in the order given, its ``context_length``, ``prompts``, ``loops`` and ``greedy`` and ``sampling`` entries
    made as the pooled ones are, from the same decodes (the measured speedup from that bucket's ratios; ``identical``
    and ``near_ties`` from that bucket's prompts, whose indices stay those of ``prompts``).

    ``progress``: show the progress over every prompt of every pass (each threshold and K, greedy then sampling, each
    repeat), trainer/interface/output.py's CountProgress: a bar on a terminal, else a line every tenth of them and at
    least every two minutes."""
    if not accept_thresholds:
        raise ValueError("accept_thresholds: give at least one threshold (0: off)")
    passes = len(accept_thresholds) * len(ks) * (2 if temperature > 0 else 1) * repeats
    shown = CountProgress("eval", passes * len(prompts), "prompts") if progress else None
    run_prompts(target, NoProposer(), prompts[:1], 1, min(8, max_new_tokens), 0.0, eos_token_id)  # warm-up
    report: dict = {"greedy": [], "sampling": [], "temperature": temperature, "repeats": repeats}
    report["accept_thresholds"] = list(accept_thresholds)
    greedy_base, masks = None, None
    by_context = [
        {"context_length": length, "prompts": len(indices), "greedy": [], "sampling": []}
        for length, indices in (buckets or {}).items()
    ]
    for threshold, k in ((t, k) for t in accept_thresholds for k in ks):
        base, results, ratios = run_side_by_side(
            target,
            proposer,
            prompts,
            k,
            max_new_tokens,
            0.0,
            eos_token_id,
            repeats=repeats,
            accept_threshold=threshold,
            progress=shown,
        )
        if greedy_base is None:
            greedy_base = base
            report["loops"], masks = loop_statistics(greedy_base)
            for bucket, indices in zip(by_context, (buckets or {}).values()):
                bucket["loops"] = loop_statistics([greedy_base[i] for i in indices])[0]
        ties = check_identity(greedy_base, results, k, target, prompts)
        for tie in ties:
            log.warning(describe_near_tie(tie, k, next(target.parameters()).dtype))
        entry = _greedy_entry(results, base, masks, ratios, k, threshold, ties)
        report["greedy"].append(entry)
        log.info(
            "greedy K=%d threshold=%g tau=%.3f speedup=%.2f", k, threshold, entry["tau"], entry["measured_speedup"]
        )
        for bucket, indices in zip(by_context, (buckets or {}).values()):
            sub = _subset(indices, len(prompts), results, base, masks, ratios)
            chosen = set(indices)
            bucket["greedy"].append(_greedy_entry(*sub, k, threshold, [t for t in ties if t.prompt in chosen]))
    if temperature > 0:
        for threshold, k in ((t, k) for t in accept_thresholds for k in ks):
            base, results, ratios = run_side_by_side(
                target, proposer, prompts, k, max_new_tokens, temperature, eos_token_id, seed, repeats, threshold,
                shown,
            )  # fmt: skip
            report["sampling"].append(summarize(results, base, k, ratios, threshold))
            for bucket, indices in zip(by_context, (buckets or {}).values()):
                sub_results, sub_base, _, sub_ratios = _subset(indices, len(prompts), results, base, masks, ratios)
                bucket["sampling"].append(summarize(sub_results, sub_base, k, sub_ratios, threshold))
    if shown is not None:
        shown.close()
    best = max(report["greedy"], key=lambda e: e["measured_speedup"])
    report["best_k"] = best["k"]
    report["best_accept_threshold"] = best["accept_threshold"]
    report["baseline"] = {
        "target_forwards": sum(r.target_forwards for r in greedy_base),
        "tokens": sum(len(r.tokens) for r in greedy_base),
        "seconds": sum(r.total_seconds for r in greedy_base),
        "forward_seconds": _forward_seconds(greedy_base),
    }
    if buckets is not None:
        report["by_context"] = by_context
    return report


def _greedy_entry(
    results: Sequence[GenerationResult],
    base: Sequence[GenerationResult],
    masks: Sequence[Sequence[bool]],
    ratios: Sequence[float],
    k: int,
    threshold: float,
    ties: Sequence,
) -> dict:
    """One greedy entry: :func:`summarize`, whether the outputs were identical (and the near-ties), and tau inside and
    outside the loops of the target's own output (``masks``, one per prompt)."""
    entry = summarize(results, base, k, ratios, threshold)
    inside, outside = [], []
    for res, mask in zip(results, masks):
        a, b = metrics.split_rounds_by_loop(res.rounds, mask)
        inside += a
        outside += b
    entry.update(
        identical=not ties,
        near_ties=[dataclasses.asdict(t) for t in ties],
        tau_in_loops=metrics.tau(inside),
        tau_outside_loops=metrics.tau(outside),
        rounds_in_loops=len(inside),
        rounds_outside_loops=len(outside),
    )
    return entry


def _subset(
    indices: Sequence[int],
    count: int,
    results: Sequence[GenerationResult],
    base: Sequence[GenerationResult],
    masks: Sequence[Sequence[bool]],
    ratios: Sequence[float],
) -> tuple[list, list, list, list[float]]:
    """The results, baseline results, loop masks and side-by-side ratios of the prompts ``indices`` (of ``count``
    prompts; :func:`run_side_by_side` gives ``count`` ratios per pass)."""
    passes = len(ratios) // count
    return (
        [results[i] for i in indices],
        [base[i] for i in indices],
        [masks[i] for i in indices],
        [ratios[p * count + i] for p in range(passes) for i in indices],
    )
