"""Drafter kind ``eagle3``: one decoder layer over fused target hidden states (module.py).

Exported natively (``eagle3``: SGLang and vLLM ``LlamaForCausalLMEagle3``) or in the speculators format
(``eagle3-speculators``: vLLM ``Eagle3Speculator``); drafted as a chain, or as an EAGLE-2 dynamic tree with
``--tree``, by proposer.py on the target's input embedding.

P-EAGLE, the same drafter drafting K tokens in one forward, extends this method as the kind ``peagle``
(trainer/methods/peagle/).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from trainer.decoding.options import ProposerOptions
from trainer.export import serving, speculators
from trainer.export.files import folder_config
from trainer.methods.eagle3 import export as formats
from trainer.methods.eagle3 import records
from trainer.methods.eagle3.module import Eagle3Config, Eagle3Drafter
from trainer.methods.eagle3.proposer import Eagle3Proposer, Eagle3TreeProposer
from trainer.models.target import EMBEDDING_NAMES, load_target_tensors
from trainer.training.registry import DrafterKind, DrafterRecord, ExportFormat, register_kind

KIND = "eagle3"
DEFAULT_DRAFTS = 3  # drafts per round to serve with when the record has no TTT steps (an export read back)


def make_record(config: Eagle3Config, target: str, target_architectures: list[str], ttt_steps: int) -> DrafterRecord:
    """The record of a drafter trained against ``target`` with ``ttt_steps`` unrolled steps."""
    return records.training_record(KIND, config, target, target_architectures, ttt_steps)


def build(record: DrafterRecord) -> Eagle3Drafter:
    """An initialised drafter of the record's shape."""
    return Eagle3Drafter(Eagle3Config(**record.config))


def load_native(folder: Path) -> tuple[Eagle3Drafter, DrafterRecord]:
    drafter = formats.load_native(str(folder))
    return drafter, records.export_record(KIND, drafter.config)


def load_speculators(folder: Path) -> tuple[Eagle3Drafter, DrafterRecord]:
    drafter = formats.load_speculators(str(folder))
    return drafter, records.export_record(KIND, drafter.config, *records.speculators_verifier(folder))


def write_speculators(drafter: Eagle3Drafter, record: DrafterRecord, out_dir: Path) -> Path:
    """The speculators format, with the target's embedding read from its safetensors (the record's target)."""
    if not record.target or record.draft_tokens is None:
        raise ValueError(
            "the speculators format names the verifier and the drafts per round: the drafter record lacks "
            f"{'its target' if not record.target else 'its TTT steps (draft_tokens)'}"
        )
    embedding = load_target_tensors(record.target, {"embedding": EMBEDDING_NAMES})["embedding"]
    return formats.save_speculators(
        drafter,
        str(out_dir),
        verifier=record.target,
        embedding=embedding,
        speculative_tokens=record.draft_tokens,
        verifier_architectures=record.target_architectures,
    )


def proposer(drafter: Eagle3Drafter, record: DrafterRecord, target: PreTrainedModel, options: ProposerOptions):
    """Chain drafting, or the EAGLE-2 dynamic tree with ``options.tree``."""
    embedding = target.get_input_embeddings()
    if options.tree:
        return Eagle3TreeProposer(
            drafter, embedding, top_k=options.tree_top_k, budget=options.tree_nodes,
            rank_temperature=options.rank_temperature,
        )  # fmt: skip
    return Eagle3Proposer(drafter, embedding)


NATIVE = ExportFormat(
    name="eagle3",
    description="native EAGLE-3 (LlamaForCausalLMEagle3): SGLang and vLLM",
    write=lambda drafter, record, out: formats.save_native(drafter, str(out)),
    load=load_native,
    recognise=lambda folder: folder_config(folder).get("architectures") == ["LlamaForCausalLMEagle3"],
    refuses=lambda record: formats.native_refusal(Eagle3Config(**record.config)),
    serve=lambda folder, record: [
        serving.vllm(record.target, "eagle3", folder, record.draft_tokens or DEFAULT_DRAFTS),
        serving.sglang(record.target, "EAGLE3", folder),
    ],
)
SPECULATORS = ExportFormat(
    name="eagle3-speculators",
    description="EAGLE-3 in the speculators format (Eagle3Speculator): vLLM and the speculators library",
    write=write_speculators,
    load=load_speculators,
    recognise=lambda folder: speculators.is_model_type(folder, formats.MODEL_TYPE),
    serve=lambda folder, record: [serving.vllm(record.target, "eagle3", folder, record.draft_tokens or DEFAULT_DRAFTS)],
)

register_kind(
    DrafterKind(
        name=KIND, build=build, formats=(NATIVE, SPECULATORS), proposer=proposer, load_weights=records.load_weights
    )
)
