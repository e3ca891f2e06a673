"""What a drafter is, said once: the drafter-kind registry and the record every checkpoint and export carries.

A drafter kind registers once (:func:`register_kind`) with

- how to rebuild its module from a :class:`DrafterRecord` (weights loaded after);
- its export formats: name -> :class:`ExportFormat` (a writer, the loader the round-trip tests use, and a test that
  recognises a folder of that format from its files);
- its proposer factory: (module, record, target model, ``ProposerOptions``) -> a proposer for the engine
  (the options: trainer/decoding/options.py).

``draftsmith export``, ``draftsmith eval --drafter PATH`` and the training callback dispatch on the record's kind and
nothing else, so a new method is one folder, ``trainer/methods/<method>/`` (its kind, module, objective, proposer
and exporters), and its recipes (docs/developer/add-a-method.md).
Training checkpoints store the record under ``checkpoint["drafter"]``; :func:`load_drafter` reads a checkpoint
(``.ckpt`` file or DeepSpeed folder) or any exported folder and returns the module with its record.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from torch import nn

from trainer.interface.errors import CheckpointError, ModelFolderError, PathError, UsageError
from trainer.interface.renamed_keys import record_kind_moved


@dataclass
class DrafterRecord:
    """The self-description of a trained drafter, stored in checkpoints and rebuilt by every export loader.

    Attributes:
        kind: the registered drafter kind (e.g. ``hf_causal_lm``, ``eagle3``).
        config: the kind's module config (JSON-serialisable).
        components: component name -> the state-dict prefix of its weights in a training checkpoint (e.g.
            ``{"drafter": "drafter."}``).
        target: the target the drafter was trained for (directory or hub id), when known.
        target_architectures: the target config's ``architectures``.
        target_layers: target hidden states the drafter reads (HF ``hidden_states`` indices; empty for none).
        target_vocab_size: the target vocabulary the drafter's token ids live in.
        target_hidden_size: the width of the target hidden states it reads (None when it reads none).
        tokenizer: where the drafter's tokenizer is found (a directory or hub id), when known.
        draft_tokens: drafts per round it was trained for (EAGLE-3: the TTT steps), when it has such a number.
    """

    kind: str
    config: dict
    components: dict[str, str] = field(default_factory=dict)
    target: str | None = None
    target_architectures: list[str] = field(default_factory=list)
    target_layers: list[int] = field(default_factory=list)
    target_vocab_size: int | None = None
    target_hidden_size: int | None = None
    tokenizer: str | None = None
    draft_tokens: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str) -> DrafterRecord:
        """The record of a checkpoint's ``drafter`` entry; ``where`` names the file in errors. A record of a drafter
        whose parts moved to a kind of their own is read as that kind (trainer/interface/renamed_keys.py
        ``MOVED_KINDS``)."""
        if not isinstance(data, dict) or "kind" not in data or "config" not in data:
            raise CheckpointError(f"{where}: holds no drafter record (a checkpoint written by draftsmith fit has one)")
        data = record_kind_moved(dict(data))
        if "prefix" in data:  # the layout before drafter kinds: one component under "prefix"
            data.setdefault("components", {"model": data.pop("prefix")})
            data.setdefault("tokenizer", data.pop("tokenizer_from", None))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CheckpointError(f"{where}: drafter record has unknown keys {unknown}")
        return cls(**data)


@dataclass(frozen=True)
class ExportFormat:
    """One export format of a drafter kind.

    Attributes:
        name: the ``--format`` name.
        description: who loads it.
        write: (module, record, out_dir) -> the written folder.
        load: folder -> (module, record), by the engine's naming rules (every tensor consumed).
        recognise: folder -> True when the folder holds this format.
        generic: the format of any plain checkpoint (an HF model folder): a folder another format also recognises
            (an HF model with a kind's files beside it) is that other format's.
        refuses: record -> why this format cannot hold the record's drafter (an option its loaders have no key for),
            None when it can; None: it holds every drafter of its kind. ``write`` refuses the same drafters.
        serve: (written folder, record) -> the lines that serve it, one per engine (trainer/export/serving.py), which
            ``draftsmith export`` prints; None: a plain model folder, served as any model is.
    """

    name: str
    description: str
    write: Callable[[nn.Module, DrafterRecord, Path], Path]
    load: Callable[[Path], tuple[nn.Module, DrafterRecord]]
    recognise: Callable[[Path], bool]
    generic: bool = False
    refuses: Callable[[DrafterRecord], str | None] | None = None
    serve: Callable[[Path, DrafterRecord], list[str]] | None = None


@dataclass(frozen=True)
class DrafterKind:
    """A registered drafter kind.

    Attributes:
        name: the record's ``kind``.
        build: record -> an initialised module of the record's shape (weights loaded after).
        formats: export formats, the first the default of ``draftsmith export``.
        proposer: (module, record, target model, options) -> a proposer.
        load_weights: (module, record, checkpoint state dict, where) -> None, loading a training checkpoint's
            weights into the rebuilt module; None is :func:`load_components` (strict).
        carried_target: module -> the target model the drafter trained and carries (Medusa-2's target, an MTP
            pre-training's trunk), or None; ``draftsmith eval`` compares its weights with ``--target``'s. None: the
            kind never carries one.
    """

    name: str
    build: Callable[[DrafterRecord], nn.Module]
    formats: tuple[ExportFormat, ...]
    proposer: Callable[..., object]
    load_weights: Callable[[nn.Module, DrafterRecord, dict, str], None] | None = None
    carried_target: Callable[[nn.Module], nn.Module | None] | None = None

    def load(self, record: DrafterRecord, state: dict, where: str) -> nn.Module:
        """The module of ``record`` with a training checkpoint's weights."""
        module = self.build(record)
        (self.load_weights or load_components)(module, record, state, where)
        return module

    def formats_for(self, record: DrafterRecord) -> tuple[ExportFormat, ...]:
        """The formats that can hold ``record``'s drafter, in the kind's order (an EAGLE-3.1 drafter's norm flags, a
        windowed drafter: formats whose loaders have no key for them are left out)."""
        return tuple(f for f in self.formats if f.refuses is None or f.refuses(record) is None)

    def format(self, name: str | None, record: DrafterRecord | None = None) -> ExportFormat:
        """The named format, or the default (None): the first that can hold ``record``'s drafter (the kind's first
        without a record); an error listing what this kind writes for an unknown name."""
        if name is None:
            usable = self.formats_for(record) if record is not None else self.formats
            return (usable or self.formats)[0]
        for fmt in self.formats:
            if fmt.name == name:
                return fmt
        raise UsageError(f"a drafter of kind {self.name!r} cannot be written as {name!r}; it writes: {_list(self)}")


_KINDS: dict[str, DrafterKind] = {}


def _list(kind: DrafterKind) -> str:
    return "; ".join(f"{f.name} ({f.description})" for f in kind.formats)


def register_kind(kind: DrafterKind) -> DrafterKind:
    """Register a drafter kind once; a second kind of the same name is an error."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise ValueError(f"drafter kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


def kinds() -> dict[str, DrafterKind]:
    """Every registered kind: the ``kind`` module of every method package (trainer/methods/<method>/kind.py) is
    imported on first call, each registering one kind (a new method is a new folder there, and nothing else changes).
    The import is by name at run time: the shared layer never imports a method statically (the import contracts)."""
    methods = importlib.import_module("trainer.methods")
    for info in pkgutil.iter_modules(methods.__path__):
        if info.ispkg:
            importlib.import_module(f"{methods.__name__}.{info.name}.kind")
    return dict(_KINDS)


def get_kind(name: str, where: str) -> DrafterKind:
    """The kind of a record, or an error naming ``where`` and the kinds known."""
    known = kinds()
    if name not in known:
        raise CheckpointError(
            f"{where}: drafter kind {name!r} is not one draftsmith knows ({', '.join(sorted(known))})"
        )
    return known[name]


def recognise(folder: Path) -> tuple[DrafterKind, ExportFormat]:
    """The kind and format of an exported folder, from its files; an error listing the formats known."""
    matches = [(k, f) for k in kinds().values() for f in k.formats if f.recognise(folder)]
    matches.sort(key=lambda match: match[1].generic)  # specific formats first
    if not matches:
        listing = "; ".join(f"{k.name}: {', '.join(f.name for f in k.formats)}" for k in kinds().values())
        raise ModelFolderError(
            f"{folder}: no drafter format recognised in this folder (known formats by kind: {listing}; or a "
            "training checkpoint: a .ckpt file, a DeepSpeed or an FSDP2 distributed checkpoint folder)"
        )
    return matches[0]


def is_training_checkpoint(path: Path) -> bool:
    """A Lightning ``.ckpt`` file, a DeepSpeed checkpoint folder or an FSDP2 distributed checkpoint folder."""
    from trainer.checkpoints.reading import checkpoint_layout

    return checkpoint_layout(path) is not None


def load_drafter(path: str) -> tuple[nn.Module, DrafterRecord]:
    """The drafter in a training checkpoint or an exported folder, with its record."""
    from trainer.checkpoints.reading import load_training_checkpoint

    where = Path(path)
    if not where.exists():
        raise PathError(f"drafter {path!r} does not exist")
    if not is_training_checkpoint(where):
        return recognise(where)[1].load(where)
    state, raw = load_training_checkpoint(path)
    record = DrafterRecord.from_dict(raw, path)
    return get_kind(record.kind, path).load(record, state, path), record


def load_components(module: nn.Module, record: DrafterRecord, state: dict, where: str) -> None:
    """Load a checkpoint's weights into a rebuilt drafter, strictly: each component's prefix is replaced by the
    component's attribute path in the module ("" for the module itself)."""
    from trainer.checkpoints.reading import sub_state_dict

    loaded = {}
    for component, prefix in record.components.items():
        target = "" if len(record.components) == 1 else component + "."
        loaded.update({target + k: v for k, v in sub_state_dict(state, prefix).items()})
    missing, unexpected = module.load_state_dict(loaded, strict=False)
    ties = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
    tied = (getattr(module, "_tied_weights_keys", None) or {}) if ties else {}
    missing = [k for k in missing if k not in tied]  # tied output embeddings are stored once
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: weights do not match the drafter record: missing {missing}, extra {unexpected}"
        )
    if tied and hasattr(module, "tie_weights"):
        module.tie_weights()


def check_target(record: DrafterRecord, target_config, where: str) -> None:
    """Refuse a drafter made for another target's vocabulary, hidden size or depth, naming ``where``."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    vocab, hidden, layers = int(text.vocab_size), int(text.hidden_size), int(text.num_hidden_layers)
    problems = []
    if record.target_vocab_size is not None and record.target_vocab_size != vocab:
        problems.append(f"vocabulary of {record.target_vocab_size} tokens, the target has {vocab}")
    if record.target_hidden_size is not None and record.target_hidden_size != hidden:
        problems.append(f"target hidden size {record.target_hidden_size}, the target has {hidden}")
    outside = [i for i in record.target_layers if not -1 <= i <= layers]
    if outside:
        problems.append(f"reads target layers {outside}, the target has hidden states 0..{layers}")
    if problems:
        raise CheckpointError(f"{where}: a drafter for another target: " + "; ".join(problems))
