"""Recipe keys that were renamed so that recipes use one name per concept, and the message that names the new key.

The vocabulary: the model being drafted for (frozen or fine-tuned) is the ``target`` (its ``target_config``,
``target_dtype``, ``target_signals``, ``target_layers``); the trained draft model is the ``drafter``
(``drafter_config``, ``drafter_dtype``); an output folder is ``export_dir``, a head count ``num_heads``, positions per
chunk of a loss ``loss_chunk_size``, and the loss weight of draft step ``k`` is ``step_decay ** k``.

:data:`RENAMED_KEYS` is the one table of the renames, per objective; ``draftsmith fit`` and
:func:`trainer.training.recipe.parse_recipe` refuse an old key with :func:`renamed_key_message` (tests/unit/
test_recipe_vocabulary.py checks that every new name is a parameter of its objective), and ``draftsmith precompute``
with :data:`RENAMED_PRECOMPUTE_KEYS`. A value that was renamed (:data:`RENAMED_VALUES`: one value, one meaning across
objectives) is refused the same way, naming its new spelling: ``labels``, what a loss is trained towards, is ``data``
for the rows' own tokens (DFlash's old ``hard``) and ``argmax`` for the target's most likely token (EAGLE-3's old
``hard``, Medusa's old ``target``) in every objective. An objective that moved (:data:`RENAMED_CLASS_PATHS`: a method
that now lives in its own folder) is refused in a recipe naming its new ``class_path``, and an option that moved with
what it builds to a method of its own (:data:`MOVED_OPTIONS`) naming the class that takes it. A checkpoint that
recorded an old key, value, class path or moved option resumes with its new name, spelling and class
(:func:`checkpoint_names_renamed`); a drafter record of a kind whose drafters moved in part to a kind of their own is
read as that kind (:func:`record_kind_moved`).
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass
from typing import Any

_TARGET = {"teacher": "target", "teacher_dtype": "target_dtype"}
_DRAFTER = {"student": "drafter", "student_config": "drafter_config", "student_dtype": "drafter_dtype"}
_FRESH_TARGET = {"model": "target", "model_config": "target_config"}
_LOSS_CHUNK = {"chunk_size": "loss_chunk_size"}
_EXPORT_DIR = {"save_dir": "export_dir"}
_SIGNALS = {"teacher_signals": "target_signals"}

log = logging.getLogger(__name__)

RENAMED_KEYS: dict[str, dict[str, str]] = {
    "trainer.methods.draft_model.kd.KnowledgeDistillation": {
        **_TARGET,
        **_DRAFTER,
        **_LOSS_CHUNK,
        **_SIGNALS,
        "divergence": "loss",  # the loss toward a distribution is `loss` in every objective
    },
    "trainer.methods.draft_model.on_policy.OnPolicyDistillation": {**_TARGET, **_DRAFTER, **_LOSS_CHUNK},
    "trainer.methods.draft_model.pretrain.CausalLMPretraining": {**_LOSS_CHUNK, **_EXPORT_DIR},
    "trainer.methods.medusa.objective.Medusa": {
        **_SIGNALS,
        **_LOSS_CHUNK,
        "heads_dtype": "drafter_dtype",
        "decay": "step_decay",
    },
    "trainer.methods.mtp_heads.objective.ParallelMTPHeads": {
        **_FRESH_TARGET,
        **_LOSS_CHUNK,
        **_EXPORT_DIR,
        "n_heads": "num_heads",
        "dtype": "target_dtype",
    },
    "trainer.methods.mtp.objective.SequentialMTP": {
        **_FRESH_TARGET,
        **_LOSS_CHUNK,
        **_EXPORT_DIR,
        "load_model_modules": "load_target_modules",
        "model_dtype": "target_dtype",
        "modules_dtype": "drafter_dtype",
    },
    "trainer.methods.eagle3.objective.Eagle3": {**_SIGNALS, "aux_layers": "target_layers"},
    "trainer.methods.dflash.objective.DFlash": {**_SIGNALS},
    "trainer.methods.dspark.objective.DSpark": {**_SIGNALS},
    "trainer.methods.layerskip.objective.LayerSkip": {
        **_FRESH_TARGET,
        **_LOSS_CHUNK,
        **_EXPORT_DIR,
        "model_dtype": "target_dtype",
    },
}
"""Objective class path -> {old ``model.init_args`` key: its new name}."""

RENAMED_VALUES: dict[str, dict[str, dict[str, str]]] = {
    # what a loss is trained towards (``labels``) has one spelling per meaning in every objective: the rows' own
    # tokens are "data", the target's argmax "argmax" (EAGLE-3's "hard" and Medusa's "target" were the argmax,
    # DFlash's "hard" the rows' tokens)
    "trainer.methods.eagle3.objective.Eagle3": {"labels": {"hard": "argmax"}},
    "trainer.methods.dflash.objective.DFlash": {"labels": {"hard": "data"}},
    "trainer.methods.dspark.objective.DSpark": {"labels": {"hard": "data"}},
    "trainer.methods.medusa.objective.Medusa": {"labels": {"target": "argmax"}},
    # the loss toward a distribution (``loss``, KD's old ``divergence``) has one vocabulary: the forward KL is "kl"
    "trainer.methods.draft_model.kd.KnowledgeDistillation": {"loss": {"forward_kl": "kl"}},
}
"""Objective class path -> {``model.init_args`` key: {old value: its new spelling}}."""

RENAMED_CLASS_PATHS: dict[str, str] = {
    "trainer.methods.eagle3.peagle_objective.PEagle": "trainer.methods.peagle.objective.PEagle",
}
"""Old objective class path (``model.class_path``) -> the class path that names it now.

A method that moves (P-EAGLE out of the EAGLE-3 folder into ``trainer/methods/peagle/``) adds its old path here and
nothing else: a recipe naming the old path is refused in one line naming the new one (:func:`renamed_key_message`),
and ``draftsmith fit --ckpt_path`` resumes a checkpoint whose hyper-parameters name the old path as the new class
(:func:`checkpoint_names_renamed`; the tables above are keyed by the new path, and the drafter record's kind, which
export and eval dispatch on, does not change with the folder). A move that depends on the options a recipe sets (a
DFlash recipe that sets DSpark's options now naming ``trainer.methods.dspark``) is a rule of
:func:`moved_class_path`, which sees the recorded ``init_args``; its recipe side is an old key of the class that
stays, refused with a message naming the new class (:data:`RENAMED_KEYS` and :func:`renamed_key_message`).
"""

WHY_MOVED = "each method lives in its own folder, trainer/methods/<method>/"

MOVED_MODULES: dict[str, str] = {
    "trainer.target": "trainer.models.target",
    "trainer.llama": "trainer.models.llama",
    "trainer.layers": "trainer.models.layers",
    "trainer.block_attention": "trainer.models.block_attention",
    "trainer.documents": "trainer.models.documents",
    "trainer.logit_scaling": "trainer.models.logit_scaling",
    "trainer.losses": "trainer.losses.distillation",
    "trainer.distribution_loss": "trainer.losses.distribution",
    "trainer.chunked_loss": "trainer.losses.chunked",
    "trainer.strategies": "trainer.distributed.strategies",
    "trainer.sequence_parallel": "trainer.distributed.sequence_parallel",
    "trainer.preemption": "trainer.distributed.preemption",
    "trainer.run_folder": "trainer.checkpoints.run_folder",
    "trainer.objective": "trainer.training.objective",
    "trainer.muon": "trainer.training.muon",
    "trainer.recipe": "trainer.training.recipe",
    "trainer.registry": "trainer.training.registry",
    "trainer.progress": "trainer.training.progress",
    "trainer.activation_memory": "trainer.training.activation_memory",
    "trainer.throughput": "trainer.training.throughput",
    "trainer.fingerprint": "trainer.training.fingerprint",
    "trainer.heldout": "trainer.training.heldout",
    "trainer.errors": "trainer.interface.errors",
    "trainer.output": "trainer.interface.output",
    "trainer.flags": "trainer.interface.flags",
    "trainer.renamed_keys": "trainer.interface.renamed_keys",
    "trainer.slurm": "trainer.slurm.submit",
    "trainer.requeue": "trainer.slurm.requeue",
}
"""Old module of ``trainer/`` -> the module it is now (0.22.0 grouped the root's modules into packages,
docs/developer/layout.md). A class path under an old module (a recipe's ``trainer.strategy.class_path:
trainer.strategies.CPUDeepSpeedStrategy``, a callback's) is refused in one line naming its new path
(:func:`renamed_key_message`); a checkpoint whose hyper-parameters name one resumes with the new
(:func:`moved_class_path`)."""

WHY_GROUPED = "trainer/'s modules are grouped into packages, docs/developer/layout.md"

_DSPARK_HEADS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


@dataclass(frozen=True)
class MovedOptions:
    """Options of an objective that moved, with the parts they build, to a method of its own.

    Attributes:
        to: the class path that takes them now.
        options: the ``model.init_args`` keys that moved.
        unset: option -> the value at which the old class built none of the parts (the other options then set
            nothing).
    """

    to: str
    options: tuple[str, ...]
    unset: dict[str, Any]


MOVED_OPTIONS: dict[str, MovedOptions] = {
    # DSpark's heads were options of DFlash; DSpark is a method of its own, trainer/methods/dspark/
    "trainer.methods.dflash.objective.DFlash": MovedOptions(
        to="trainer.methods.dspark.objective.DSpark",
        options=(*_DSPARK_HEADS, "confidence_head_alpha"),
        unset={"markov_rank": 0, "enable_confidence_head": False},
    ),
}
"""Objective class path -> the options that left it. A recipe of the class that sets one is refused naming the new
class (:func:`renamed_key_message`); a checkpoint whose hyper-parameters set one away from :attr:`MovedOptions.unset`
resumes as the new class, and one whose options built nothing resumes as the old class without them
(:func:`moved_class_path`, :func:`checkpoint_names_renamed`)."""

MOVED_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    # a DFlash drafter with DSpark's heads (their config fields set) is a DSpark drafter, kind dspark
    "dflash": (
        "dspark",
        {
            "markov_rank": 0,
            "markov_head_type": "vanilla",
            "enable_confidence_head": False,
            "confidence_head_with_markov": False,
        },
    ),
}
"""Drafter kind -> (the kind its drafters with the parts below moved to, {config field of those parts: its value when
the drafter has none}): :func:`record_kind_moved`."""

RENAMED_PRECOMPUTE_KEYS: dict[str, str] = {**dict(_TARGET), "k": "top_logprobs"}
"""Old key of a ``draftsmith precompute`` recipe (trainer/data/precompute.py) -> its new name."""

WHY = "recipes use one name per concept; see docs/methods"

# jsonargparse 4's wording of an unknown init_args key of a subclass (`model.init_args.KEY` in a recipe or on the
# command line): "Problem with given class_path 'CLASS':\n    Option 'KEY' is not accepted"
_UNKNOWN_INIT_ARG = re.compile(r"class_path '(?P<cls>[\w.]+)':\s+Option '(?P<key>\w+)' is not accepted")
# a value outside a Literal: "class_path 'CLASS':\n  Parser key "KEY":\n  Expected a typing.Literal[...]. Got value: V"
_BAD_LITERAL = re.compile(
    r"class_path '(?P<cls>[\w.]+)':\s+Parser key \"(?P<key>\w+)\":\s+Expected a typing\.Literal\[[^\]]*\]\. "
    r"Got value: (?P<value>\S+)"
)
# an unknown top-level key of a plain parser (draftsmith precompute): "Option 'KEY' is not accepted" (in a recipe) or
# "unrecognized arguments: --KEY VALUE --KEY2 ..." (on the command line)
_UNKNOWN_OPTION = re.compile(r"Option '(\w+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments:(.*)", re.I)


def renamed(old_prefix: str, old: str, new: str, values: dict[str, str] | None = None) -> str:
    """The message refusing an old key: ``model.init_args.teacher was renamed to model.init_args.target (...)``, with
    the values respelled under the new name (:data:`RENAMED_VALUES`) where there are some."""
    spelled = "".join(f", {a} to {b}" for a, b in (values or {}).items())
    return f"{old_prefix}{old} was renamed to {old_prefix}{new}{spelled} ({WHY})"


def _builds_any(settings: dict[str, Any], unset: dict[str, Any]) -> bool:
    """Whether ``settings`` (recorded options or config fields) set one of ``unset``'s keys away from the value at
    which it builds nothing."""
    return any(key in settings and settings[key] != value for key, value in unset.items())


def moved_class_path(class_path: str, init_args: dict[str, Any]) -> str:
    """The class path that names ``class_path`` now (:data:`RENAMED_CLASS_PATHS`), given the ``init_args`` a
    checkpoint recorded with it: the class its options moved to when they set one of its parts
    (:data:`MOVED_OPTIONS`); ``class_path`` itself when it did not move."""
    moved = MOVED_OPTIONS.get(class_path)
    if moved is not None and _builds_any(init_args, moved.unset):
        return moved.to
    return RENAMED_CLASS_PATHS.get(class_path) or moved_module_path(class_path) or class_path


def _resolves(path: str) -> bool:
    """Whether a dotted path names a module, or an attribute of one, that imports now."""
    module, _, name = path.rpartition(".")
    for candidate, attribute in ((path, None), (module, name)):
        try:
            imported = importlib.import_module(candidate)
        except ImportError:
            continue
        return attribute is None or hasattr(imported, attribute)
    return False


def moved_module_path(path: str) -> str | None:
    """``path`` (a class path or module) under the module it moved to (:data:`MOVED_MODULES`), or None when it did not
    move (a path that resolves now is where it belongs)."""
    for old, new in MOVED_MODULES.items():
        if (path == old or path.startswith(old + ".")) and not _resolves(path):
            return new + path[len(old) :]
    return None


def record_kind_moved(record: dict[str, Any]) -> dict[str, Any]:
    """A drafter record (its dict, ``checkpoint["drafter"]``) of a kind whose drafters moved in part to a kind of
    their own (:data:`MOVED_KINDS`): of the new kind when its config sets one of their parts, else without those
    parts' fields (at the values that build none); any other record as it is."""
    moved = MOVED_KINDS.get(record.get("kind"))
    config = record.get("config")
    if moved is None or not isinstance(config, dict) or not set(moved[1]) & set(config):
        return record
    kind, unset = moved
    if _builds_any(config, unset):
        log.info("the drafter record of kind %s with %s is read as kind %s", record["kind"], sorted(unset), kind)
        return {**record, "kind": kind}
    return {**record, "config": {key: value for key, value in config.items() if key not in unset}}


def renamed_key_message(parser_error: str) -> str | None:
    """The message for a ``draftsmith fit`` parser error that refuses a moved class path (:data:`RENAMED_CLASS_PATHS`)
    or a renamed ``model.init_args`` key, or None when the error is about something else (the parser's own message
    then stands)."""
    for old, new in RENAMED_CLASS_PATHS.items():
        if re.search(rf"(?<![\w.]){re.escape(old)}(?![\w.])", parser_error):
            return f"model.class_path {old} was renamed to {new} ({WHY_MOVED})"
    for path in re.findall(r"(?<![\w.])trainer\.[\w.]*\w", parser_error):
        new = moved_module_path(path)
        if new is not None:
            return f"class_path {path} was renamed to {new} ({WHY_GROUPED})"
    for found in _UNKNOWN_INIT_ARG.finditer(parser_error):
        moved = MOVED_OPTIONS.get(found["cls"])
        if moved is not None and found["key"] in moved.options:
            return (
                f"model.init_args.{found['key']} is an option of {moved.to} now: set model.class_path to "
                f"{moved.to} ({WHY_MOVED})"
            )
        new = RENAMED_KEYS.get(found["cls"], {}).get(found["key"])
        if new is not None:
            return renamed("model.init_args.", found["key"], new, RENAMED_VALUES.get(found["cls"], {}).get(new))
    for found in _BAD_LITERAL.finditer(parser_error):
        new = RENAMED_VALUES.get(found["cls"], {}).get(found["key"], {}).get(found["value"])
        if new is not None:
            return f"model.init_args.{found['key']}: {found['value']} was renamed to {new} ({WHY})"
    return None


def checkpoint_names_renamed(config: Any) -> Any:
    """A checkpoint's hyper-parameters with a moved class path (:func:`moved_class_path`) under its new path, every
    renamed key (:data:`RENAMED_KEYS`) under its new name and every renamed value (:data:`RENAMED_VALUES`) in its new
    spelling.

    ``draftsmith fit --ckpt_path FILE`` parses the hyper-parameters the checkpoint recorded over the recipe's
    (LightningCLI's ``_parse_ckpt_path``, as ``{subcommand: {"model": {"class_path": C, "dict_kwargs": {...}}}}``):
    a run saved before a rename (KD's ``teacher``, DFlash's ``labels: hard``) resumes with the settings it was trained
    with (``target``, ``labels: data``) instead of failing on a name its recipe cannot change. A key recorded under
    both names keeps the new one's value. Options that moved to another class (:data:`MOVED_OPTIONS`) and built
    nothing are left out, the class staying. Anything else is returned as it is, a recipe's ``init_args`` included (an
    old name there is refused, :func:`renamed_key_message`).
    """
    if not isinstance(config, dict):
        return config
    out = dict(config)
    for subcommand, section in config.items():
        model = section.get("model") if isinstance(section, dict) else None
        if not isinstance(model, dict) or not isinstance(model.get("dict_kwargs"), dict):
            continue
        recorded = str(model.get("class_path"))
        class_path = moved_class_path(recorded, model["dict_kwargs"])
        moved = {}
        if class_path != recorded:
            log.info("the checkpoint's model.class_path %s is read as %s, its new name", recorded, class_path)
            moved = {"class_path": class_path}
        keys, values = RENAMED_KEYS.get(class_path, {}), RENAMED_VALUES.get(class_path, {})
        stayed = MOVED_OPTIONS.get(class_path)
        kwargs: dict[str, Any] = {}
        for key, value in model["dict_kwargs"].items():
            if stayed is not None and key in stayed.options:
                log.info("the checkpoint's model.init_args.%s is left out: it built nothing, and %s has it no more",
                         key, class_path)  # fmt: skip
                continue
            name = keys.get(key, key)
            if name != key:
                log.info("the checkpoint's model.init_args.%s is read as model.init_args.%s, its new name", key, name)
                if name in model["dict_kwargs"]:
                    continue
            new = values.get(name, {}).get(value) if isinstance(value, str) else None
            if new is not None:
                log.info("the checkpoint's model.init_args.%s: %s is read as %s, its new spelling", name, value, new)
                value = new
            kwargs[name] = value
        out[subcommand] = {**section, "model": {**model, **moved, "dict_kwargs": kwargs}}
    return out


def renamed_precompute_key_message(parser_error: str) -> str | None:
    """The same for a ``draftsmith precompute`` parser error (its keys are top-level: ``teacher``, ``--teacher``)."""
    keys = _UNKNOWN_OPTION.findall(parser_error)
    for line in _UNRECOGNIZED.findall(parser_error):
        keys += re.findall(r"--(\w+)", line)
    for key in keys:
        if key in RENAMED_PRECOMPUTE_KEYS:
            return renamed("", key, RENAMED_PRECOMPUTE_KEYS[key])
    return None
