"""One training-step runner for every objective at real width, shared by the GPU suite (tests/gpu, ``make test-gpu``)
and the CPU table (``python -m tests.real_width_throughput``): the same code measures both tables.

:func:`run_objective` builds an objective on a target folder (a real-shape cut from ``tests/real_shapes.py``, or a
tiny random one in the unit test), trains it through a Lightning ``Trainer`` (its own ``setup``: data checks, EAGLE-3's
draft vocabulary; its optimizer and schedule; the precision plugin) for ``warmup`` + ``steps`` optimizer steps on a
text file, and measures the last ``steps``: training tokens per second (the tokens the objective counts, the batch's
unless it trains on generated ones), seconds per step, and the peak memory of those steps (CUDA: the allocator's peak;
CPU: the process's peak resident set, reset at the first measured step). :func:`greedy_identity` then drafts with the
trained drafter and checks that greedy speculative output equals the target's own.

The objectives and their settings (:func:`objective_kwargs`) follow the real-model recipes
(``recipes/*_llama31_8b.yaml``) under :data:`PROFILES`: ``recipe`` keeps the recipes' drafter sizes (the GPU suite),
``cpu`` shrinks what a shared 24 GiB, 2-core machine cannot hold or run in minutes (DFlash's draft layers and anchors,
the Medusa heads), ``tiny`` fits the unit test's random target.
"""

from __future__ import annotations

import gc
import json
import math
import re
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import lightning as L
import torch
from transformers import AutoConfig, AutoTokenizer

# every objective of the project, in the order of the tables
OBJECTIVES = (
    "kd", "on_policy", "eagle3", "peagle", "dflash", "dspark", "medusa1", "medusa2", "mtp_heads", "layerskip", "mtp",
)  # fmt: skip

# objectives that train the whole target (its every weight, with fp32 Adam states): not on a shared CPU machine
TRAINS_THE_TARGET = ("medusa2", "mtp_heads", "layerskip")


@dataclass(frozen=True)
class Profile:
    """The drafter sizes of a run; ``recipe`` is the real-model recipes' own."""

    name: str
    student: dict  # KD and on-policy: overrides of the target's config for the drafter
    draft_vocab_size: int  # EAGLE-3 and P-EAGLE
    dflash_layers: int
    max_anchors: int
    markov_rank: int  # DSpark
    medusa_heads: int
    mtp_heads: int
    loss_chunk_size: int
    max_new_tokens: int  # on-policy generation per prompt
    prompt_len: int  # on-policy prompts


# a Llama-3.2-1B-like student cut to 2 layers (hidden 2048, 32 heads of 64, 8 key/value heads, tied embeddings)
REAL_STUDENT = {
    "num_hidden_layers": 2, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
}  # fmt: skip
TINY_STUDENT = {
    "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True,
}  # fmt: skip

PROFILES = {
    "recipe": Profile("recipe", REAL_STUDENT, 32000, 5, 512, 256, 4, 4, 1024, 64, 32),
    "cpu": Profile("cpu", REAL_STUDENT, 32000, 1, 32, 256, 1, 2, 1024, 16, 32),
    "tiny": Profile("tiny", TINY_STUDENT, 64, 1, 8, 8, 2, 2, 64, 4, 8),
}


@dataclass(frozen=True)
class Settings:
    """How :func:`run_objective` trains and measures.

    Attributes:
        device: "cuda" or "cpu".
        precision: Lightning's ``trainer.precision`` ("bf16-mixed" as the real recipes, "32-true" on CPU).
        target_dtype: the frozen target's weights ("bfloat16" as the real recipes; "float32" on CPU, where bf16
            matmuls are some 30 times slower).
        seq_len: tokens per row.
        batch_size: rows per step.
        steps: measured optimizer steps.
        warmup: optimizer steps before the measurement (compilation, allocator, first-touch).
        profile: the drafter sizes (:data:`PROFILES`).
    """

    device: str = "cuda"
    precision: str = "bf16-mixed"
    target_dtype: str = "bfloat16"
    seq_len: int = 2048
    batch_size: int = 1
    steps: int = 20
    warmup: int = 2
    profile: str = "recipe"


@dataclass
class Result:
    """One objective's row: what it measured, or why it did not run."""

    objective: str
    status: str  # "pass", "fail" or "skip"
    reason: str = ""
    tokens_per_s: float | None = None
    step_s: float | None = None
    peak_mib: float | None = None
    trainable_m: float | None = None  # trainable parameters, millions
    loss_first: float | None = None
    loss_last: float | None = None
    greedy_identical: bool | None = None
    seconds: float = 0.0  # everything: build, warm-up, steps, drafting
    settings: dict = field(default_factory=dict)


# ---- the target ------------------------------------------------------------------------------------------------------


def target_info(target: Path) -> tuple[int, int, int]:
    """(layers, embedding rows, an id the data never holds) of a target folder (config.json and its tokenizer).

    The id: the first embedding row past the tokenizer (Qwen's padded vocabularies), else the first special token named
    ``reserved`` (Llama-3.1's ``<|reserved_special_token_0|>``, 128002, which the DFlash recipe names).
    """
    config = AutoConfig.from_pretrained(target)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = int(text.vocab_size)
    tok = AutoTokenizer.from_pretrained(target)
    if rows > len(tok):
        return int(text.num_hidden_layers), rows, len(tok)
    reserved = sorted(i for i, t in tok.added_tokens_decoder.items() if "reserved" in str(t.content) and i < rows)
    if not reserved:
        raise ValueError(f"{target}: every embedding row is a token and no reserved special token exists")
    return int(text.num_hidden_layers), rows, reserved[0]


def aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's three target layers on a cut target (HF hidden_states indices): spread over 1..L - 1 when L >= 4
    (the recipes' default 2, L // 2, L - 3 assumes a full model), else 0, 1, L."""
    if num_layers >= 4:
        return [1, num_layers // 2, num_layers - 1]
    return [0, 1, num_layers]


def context_layers(num_layers: int, most: int = 5) -> list[int]:
    """DFlash's context layers on a cut target: hidden_states 1..L - 1 (the outputs every engine reads), at most
    ``most`` of them."""
    return list(range(1, num_layers))[:most]


def objective_kwargs(name: str, target: Path, settings: Settings) -> tuple[type, dict, dict]:
    """(objective class, its init_args, the ProposerOptions kwargs its drafter drafts with) of ``name`` on ``target``.

    The values are the real-model recipes' (recipes/*_llama31_8b.yaml, recipes/quickstart/peagle.yaml and dspark.yaml
    for the methods without one) with the profile's sizes; the target layers follow the cut's layer count.
    """
    from trainer.training.optimizers import Optim

    p = PROFILES[settings.profile]
    layers, rows, unused = target_info(target)
    common = {"target": str(target), "target_dtype": settings.target_dtype, "optim": Optim(lr=1e-4, warmup_steps=2)}
    chunk = {"loss_chunk_size": p.loss_chunk_size}
    if name in ("kd", "on_policy"):
        from trainer.methods.draft_model.kd import KnowledgeDistillation
        from trainer.methods.draft_model.on_policy import OnPolicyDistillation

        if name == "kd":
            return KnowledgeDistillation, {**common, **chunk, "drafter_config": dict(p.student)}, {}
        generation = {"lmbda": 1.0, "max_new_tokens": p.max_new_tokens, "prompt_len": p.prompt_len}
        return OnPolicyDistillation, {**common, **chunk, "drafter_config": dict(p.student), **generation}, {}
    if name == "eagle3":
        from trainer.methods.eagle3.objective import Eagle3

        kwargs = {"draft_vocab_size": min(p.draft_vocab_size, rows), "target_layers": aux_layers(layers)}
        return Eagle3, {**common, **kwargs, "ttt_steps": 7, "step_decay": 0.8, "labels": "soft"}, {}
    if name == "peagle":
        from trainer.methods.peagle.objective import PEagle

        kwargs = {"draft_vocab_size": min(p.draft_vocab_size, rows), "target_layers": aux_layers(layers)}
        cod = {"num_depths": 4, "cod_ratio": 0.7, "cod_min_ratio": 0.2, "mask_token_id": unused}
        return PEagle, {**common, **kwargs, **cod}, {}  # dense, its default: COD changes the shapes every step
    if name in ("dflash", "dspark"):
        from trainer.methods.dflash.objective import DFlash
        from trainer.methods.dspark.objective import DSpark

        kwargs = {
            "num_draft_layers": p.dflash_layers, "target_layers": context_layers(layers), "block_size": 16,
            "mask_token_id": unused, "max_anchors": p.max_anchors, "gamma": 7.0, "labels": "argmax",
            "attention": "auto",
        }  # fmt: skip
        if name == "dspark":
            kwargs.update(markov_rank=p.markov_rank, enable_confidence_head=True, confidence_head_with_markov=True)
        return DSpark if name == "dspark" else DFlash, {**common, **chunk, **kwargs}, {}
    if name in ("medusa1", "medusa2"):
        from trainer.methods.medusa.objective import Medusa

        kwargs = {"num_heads": p.medusa_heads, "num_layers": 1, "stage": 1 if name == "medusa1" else 2}
        return Medusa, {**common, **chunk, **kwargs, "labels": "data", "step_decay": 0.8}, {}
    if name == "mtp_heads":
        from trainer.methods.mtp_heads.objective import ParallelMTPHeads

        return ParallelMTPHeads, {**common, **chunk, "num_heads": p.mtp_heads, "train": "all"}, {}
    if name == "layerskip":
        from trainer.methods.layerskip.objective import LayerSkip

        kwargs = {"p_max": 0.1, "exit_scale": "sum_l", "curriculum": "rotational", "target_kl_weight": 1.0}
        return LayerSkip, {**common, **chunk, **kwargs}, {"exit_layer": 1}
    if name == "mtp":
        from trainer.methods.mtp.objective import SequentialMTP

        return SequentialMTP, {**common, **chunk, "mode": "refresh", "mtp_depth": 1}, {}
    raise ValueError(f"unknown objective {name!r}: one of {', '.join(OBJECTIVES)}")


def write_text_data(out: Path, chars: int) -> Path:
    """A jsonl of ``{"text": ...}`` records, the standard library's Python sources until ``chars`` characters."""
    if out.is_file() and out.stat().st_size >= chars:
        return out
    root = Path(sysconfig.get_paths()["stdlib"])
    total, records = 0, []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) < 2000:
            continue
        records.append(json.dumps({"text": text}))
        total += len(text)
        if total >= chars:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(records) + "\n")
    return out


# ---- measurement -----------------------------------------------------------------------------------------------------


def _rss_peak_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: the peak resident set restarts from now
        return True
    except OSError:
        return False


class StepMeter(L.Callback):
    """Times the optimizer steps after ``warmup`` and takes their peak memory; keeps every step's loss."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.losses: list[torch.Tensor] = []
        self.tokens = 0
        self.started: float | None = None
        self.seconds = 0.0
        self.steps = 0
        self.peak_bytes: int | None = None

    def _sync(self, module) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and self.started is None:
            self._sync(pl_module)
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            elif not _reset_rss_peak():
                self.peak_bytes = -1  # the process's peak so far: not this run's
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().float().reshape(()))
        if self.started is None:
            return
        # the module adds the step's tokens to its count after this hook: what it trained on (generated tokens too)
        counted = getattr(pl_module, "_tokens_in_step", 0)
        self.tokens += int(counted) or int(batch["input_ids"].numel())
        self.steps += 1
        self._sync(pl_module)
        self.seconds = time.perf_counter() - self.started
        if pl_module.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(pl_module.device)
        elif self.peak_bytes != -1:
            self.peak_bytes = _rss_peak_kib() * 1024


def trainable_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters() if p.requires_grad}.values())


def run_objective(
    name: str,
    target: Path,
    data: Path,
    settings: Settings,
    work_dir: Path,
    identity_prompts: int = 2,
    identity_tokens: int = 24,
    keep: Callable[[object], None] | None = None,
    memory_check: bool = False,
    identity_dtype: torch.dtype = torch.float32,
) -> Result:
    """Train ``name`` on ``target`` for ``settings.warmup + settings.steps`` steps and measure the last ``steps``;
    then, with ``identity_prompts`` > 0, check greedy identity with its drafter in ``identity_dtype``
    (:func:`greedy_identity`).

    Exceptions propagate (the caller records a failed row); ``keep(objective)`` sees the trained objective before it
    is freed. With ``memory_check``, a built objective whose gradients, Adam states and AdamW's step temporary (16
    bytes per float32 trainable parameter, as ``draftsmith plan`` counts them) and 2 GiB of activations exceed the
    memory available is not trained: a skipped row names both figures.
    """
    from trainer.data.text import TextDataModule

    started = time.perf_counter()
    result = Result(name, "fail", settings=asdict(settings))
    cls, kwargs, draft_options = objective_kwargs(name, target, settings)
    objective = cls(**kwargs)
    result.trainable_m = trainable_params(objective.trainable_module()) / 1e6
    if memory_check:
        need, available = (result.trainable_m * 1e6 * 16 + 2 * 2**30) / 2**30, available_gib()
        if need > available:
            del objective
            release()
            reason = f"needs {need:.1f} GiB more for gradients and Adam states, {available:.1f} GiB available"
            return replace(result, status="skip", reason=reason, seconds=time.perf_counter() - started)
    datamodule = TextDataModule(
        tokenizer=str(target), train_files=[str(data)], seq_len=settings.seq_len, batch_size=settings.batch_size,
        cache_dir=str(work_dir / "tokenized"), shuffle=False,
    )  # fmt: skip
    meter = StepMeter(settings.warmup)
    trainer = L.Trainer(
        accelerator=settings.device, devices=1, precision=settings.precision,
        max_steps=settings.warmup + settings.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[meter],
        default_root_dir=str(work_dir / name),
    )  # fmt: skip
    trainer.fit(objective, datamodule=datamodule)
    losses = [float(x) for x in torch.stack(meter.losses).cpu()] if meter.losses else []
    if meter.steps:
        result.tokens_per_s = meter.tokens / meter.seconds
        result.step_s = meter.seconds / meter.steps
    if meter.peak_bytes is not None and meter.peak_bytes >= 0:
        result.peak_mib = meter.peak_bytes / 2**20
    if losses:
        result.loss_first, result.loss_last = losses[0], losses[-1]
    if meter.steps != settings.steps or not all(math.isfinite(x) for x in losses):
        result.reason = f"{meter.steps} measured steps of {settings.steps}; losses {losses}"
    elif identity_prompts > 0:
        result.greedy_identical = greedy_identity(
            objective, data, identity_prompts, identity_tokens, draft_options, settings.device, identity_dtype
        )
        result.status = "pass" if result.greedy_identical else "fail"
        if not result.greedy_identical:
            result.reason = "greedy speculative output differs from the target's own"
    else:
        result.status = "pass"
    if keep is not None:
        keep(objective)
    del trainer, objective, datamodule
    release()
    result.seconds = time.perf_counter() - started
    return result


def available_gib() -> float:
    """MemAvailable of /proc/meminfo, in GiB."""
    return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) / 2**20


def release() -> None:
    """Frees what the last run left (its models, the CUDA cache)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- drafting ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_identity(
    objective,
    data: Path,
    prompts: int,
    new_tokens: int,
    options: dict,
    device: str,
    dtype: torch.dtype = torch.float32,
    k: int = 4,
) -> bool:
    """Greedy speculative decoding with the objective's trained drafter gives the target's own greedy output on
    ``prompts`` prompts from ``data`` (the first tokens of its rows), at ``k`` drafts per round (fewer when the drafter
    drafts fewer).

    The drafter is rebuilt from the objective's state dict by its kind, as ``draftsmith eval`` rebuilds it from a
    training checkpoint. Target and drafter run in ``dtype`` on ``device`` (float32; float64 for tiny random models,
    as the engine's CPU tests): in bf16 a batched verification and one-token decoding round differently, and random
    logits have near-ties that the rounding flips.
    """
    from trainer.decoding.generate import speculative_generate
    from trainer.decoding.options import ProposerOptions
    from trainer.decoding.proposers import NoProposer
    from trainer.training.registry import kinds

    record = objective.drafter_record()
    kind = kinds()[record.kind]
    drafter = kind.load(record, objective.state_dict(), f"the trained {type(objective).__name__}")
    objective.to(device)
    model = objective.speculative_eval_target().to(dtype).eval()  # the target, or the model the objective trains
    drafter = drafter.to(device=device, dtype=dtype).eval()
    proposer = kind.proposer(drafter, record, model, ProposerOptions(**options))
    k = min(k, getattr(proposer, "max_drafts", None) or k)
    tok = AutoTokenizer.from_pretrained(getattr(objective, "target_path", None) or objective.tokenizer_path)
    for line in data.read_text().splitlines()[:prompts]:
        prompt = torch.tensor(tok(json.loads(line)["text"][:400])["input_ids"][:48], device=device)  # [S]
        reference = speculative_generate(model, prompt, NoProposer(), k, new_tokens).tokens
        drafted = speculative_generate(model, prompt, proposer, k, new_tokens).tokens
        if drafted != reference:
            return False
    return True


# ---- tables ------------------------------------------------------------------------------------------------------


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _rate(value: float | None) -> str:
    """Tokens/s: whole numbers from 100 up, three significant digits below (a CPU at real width runs ~1 token/s)."""
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown_table(results: list[Result], baseline: str = "kd") -> str:
    """The results as a markdown table, tokens/s also as a ratio to ``baseline``'s (the first measured row when the
    baseline did not run)."""
    measured = [r for r in results if r.tokens_per_s]
    base = next((r for r in measured if r.objective == baseline), measured[0] if measured else None)
    lines = [
        f"| objective | status | tokens/s | vs {base.objective if base else baseline} | s/step | peak MiB | "
        "trainable M | loss first -> last | greedy identical | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r.tokens_per_s / base.tokens_per_s if base and r.tokens_per_s else None
        loss = "-" if r.loss_first is None else f"{r.loss_first:.3f} -> {r.loss_last:.3f}"
        identical = "-" if r.greedy_identical is None else "yes" if r.greedy_identical else "NO"
        lines.append(
            f"| {r.objective} | {r.status} | {_rate(r.tokens_per_s)} | {_num(ratio, '.2f')} | "
            f"{_num(r.step_s, '.3f')} | {_num(r.peak_mib, ',.0f')} | {_num(r.trainable_m, ',.1f')} | {loss} | "
            f"{identical} | {r.reason.replace('|', '/')[:120]} |"
        )
    return "\n".join(lines)


def write_json(path: Path, results: list[Result], meta: dict, checks: list[dict] | None = None) -> Path:
    """``{"meta": ..., "objectives": [...], "checks": [...]}`` at ``path``."""
    payload = {"meta": meta, "objectives": [asdict(r) for r in results], "checks": checks or []}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def skipped(name: str, reason: str, settings: Settings) -> Result:
    return replace(Result(name, "skip", reason=reason), settings=asdict(settings))
