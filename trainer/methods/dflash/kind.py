"""Drafter kind ``dflash``: a block-diffusion drafter over the target's hidden states (module.py).

Exported in the z-lab format (``dflash``: SGLang, vLLM and the z-lab ``dflash`` package, ``DFlashDraftModel``) or the
speculators format (``dflash-speculators``: ``DFlashSpeculator``); drafted one block per round as a chain, or as a
DDTree with ``--tree`` (proposer.py), through the target's own embedding and lm_head. A block refiner's kind
(refiner.py) builds its record with :func:`make_record` and its proposers with :func:`proposer_factory`.

A folder is recognised as the speculators format by its ``speculators_model_type`` first: speculators' own
``save_pretrained`` writes ``architectures: ["DFlashDraftModel"]``, the z-lab format's name, beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedModel

from trainer.decoding.options import ProposerOptions
from trainer.export import serving
from trainer.export.files import folder_config
from trainer.export.speculators import folder_block, read_block
from trainer.methods.dflash import export as formats
from trainer.methods.dflash.module import DFlashConfig, DFlashDrafter
from trainer.methods.dflash.proposer import DFlashProposer, DFlashTreeProposer
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "dflash"


def make_record(
    config: DFlashConfig, target: str | None, target_architectures: list[str], kind: str = KIND
) -> DrafterRecord:
    """The record of a drafter trained against ``target`` (or read back from an export, ``target`` None), of drafter
    kind ``kind`` (a block refiner's, or ``dflash``)."""
    return DrafterRecord(
        kind=kind,
        config=config.to_dict(),
        components={"drafter": "drafter."},
        target=target,
        target_architectures=list(target_architectures or []),
        target_layers=list(config.target_layers),
        target_vocab_size=config.vocab_size,
        target_hidden_size=config.hidden_size,
        tokenizer=target,
        draft_tokens=config.block_size - 1,
    )


def is_speculators(config: dict) -> bool:
    """A speculators DFlash config (``speculators_model_type: "dflash"``), whatever its ``architectures``."""
    return read_block(config).model_type == formats.SPECULATORS_MODEL_TYPE


def is_zlab(config: dict) -> bool:
    """A z-lab config: ``architectures: ["DFlashDraftModel"]`` and no ``speculators_model_type``."""
    return config.get("architectures") == formats.ZLAB_ARCHITECTURES and "speculators_model_type" not in config


def build(record: DrafterRecord) -> DFlashDrafter:
    """An initialised drafter of the record's shape."""
    return DFlashDrafter(DFlashConfig(**record.config))


def load_zlab(folder: Path) -> tuple[DFlashDrafter, DrafterRecord]:
    drafter = formats.load_zlab(str(folder))
    return drafter, make_record(drafter.config, None, [])


def verifier_of(folder: Path) -> str | None:
    """The verifier a speculators export names (``speculators_config.verifier.name_or_path``), or None."""
    return folder_block(folder).verifier


def load_speculators(folder: Path) -> tuple[DFlashDrafter, DrafterRecord]:
    drafter = formats.load_speculators(str(folder))
    return drafter, make_record(drafter.config, verifier_of(folder), [])


def verifier(record: DrafterRecord) -> str:
    """The target a speculators export names as its verifier: the record's."""
    if not record.target:
        raise ValueError("the speculators format names the verifier: the drafter record lacks its target")
    return record.target


def write_speculators(drafter: DFlashDrafter, record: DrafterRecord, out_dir: Path) -> Path:
    return formats.save_speculators(drafter, str(out_dir), verifier(record), record.target_architectures)


def proposer_factory(
    chain: type[DFlashProposer], tree: type[DFlashTreeProposer]
) -> Callable[[DFlashDrafter, DrafterRecord, PreTrainedModel, ProposerOptions], DFlashProposer]:
    """The kind's proposer factory of a chain and a DDTree proposer class (DFlash's, or a block refiner's)."""

    def proposer(drafter: DFlashDrafter, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
        """Chain drafting, or a DDTree with ``options.tree``."""
        embedding = target.get_input_embeddings().weight
        lm_head = target.get_output_embeddings().weight
        if options.tree:
            return tree(
                drafter, embedding, lm_head, top_k=options.tree_top_k, budget=options.tree_nodes,
                rank_temperature=options.rank_temperature,
            )  # fmt: skip
        return chain(drafter, embedding, lm_head)

    return proposer


proposer = proposer_factory(DFlashProposer, DFlashTreeProposer)


ZLAB = ExportFormat(
    name="dflash",
    description="z-lab DFlash (DFlashDraftModel): SGLang, vLLM and the dflash package",
    write=lambda drafter, record, out: formats.save_zlab(drafter, str(out)),
    load=load_zlab,
    recognise=lambda folder: is_zlab(folder_config(folder)),
    refuses=lambda record: formats.zlab_refusal(DFlashConfig(**record.config)),
    serve=lambda folder, record: [
        serving.vllm(record.target, "dflash", folder, record.config["block_size"] - 1),
        serving.sglang(record.target, "DFLASH", folder),
    ],
)
SPECULATORS = ExportFormat(
    name="dflash-speculators",
    description="DFlash in the speculators format (DFlashSpeculator)",
    write=write_speculators,
    load=load_speculators,
    recognise=lambda folder: is_speculators(folder_config(folder)),
    serve=lambda folder, record: [serving.vllm(record.target, "dflash", folder, record.config["block_size"] - 1)],
)

register_kind(DrafterKind(name=KIND, build=build, formats=(ZLAB, SPECULATORS), proposer=proposer))
