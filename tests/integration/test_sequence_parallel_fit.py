"""EAGLE-3 with ``model.sequence_parallel: 2`` (DeepSpeed-Ulysses, trainer/distributed/sequence_parallel.py) through the
real ``draftsmith fit`` in 2 gloo processes on CPU: each rank holds half of every row's positions, the target and the
training-time test attend over the whole row, and the run follows the 1-process run on the same rows: the same batches
on both ranks, the same losses, the same final drafter (up to float32 reduction order). The rows are packed with
document masking, so the whole-row attentions honour the documents across the ranks' slices; bad settings are refused
naming the key."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests._multiproc import run_group
from tests.recipe_runs import RECIPES, data_overrides, fit, merge, record_batches, trainer_overrides, write_override
from trainer.checkpoints.reading import load_training_checkpoint
from trainer.interface.errors import RecipeError

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def override(run: Path, corpus, target: Path, documents: Path, **model) -> dict:
    """A 4-step EAGLE-3 run of batch 2 on 64-token rows packed from ``documents`` with documents kept apart, validated
    at its end; the TTT steps recomputed in backward (as the 8B recipes do), so the recomputation's all-to-alls run
    too."""
    out = merge(
        trainer_overrides(run, max_steps=STEPS, every_n=STEPS, log_every_n_steps=1),
        data_overrides(corpus, batch_size=2, document_masking=True),
        {"data": {"init_args": {"train_files": [str(documents)]}}},
        {
            "model": {
                "init_args": {
                    "target": str(target),
                    "draft_vocab_size": 256,
                    "ttt_steps": 3,
                    "target_layers": [0, 1, 2],
                    "recompute": True,
                    **model,
                }
            }
        },
    )
    out["trainer"]["callbacks"].append(record_batches(run))
    out["trainer"]["callbacks"].append(
        {"class_path": "tests.callbacks.RecordGradNorm", "init_args": {"path": str(run / "grad_norms.jsonl")}}
    )
    return out


def scalars(run: Path, tag: str) -> list[float]:
    """The values of a logged scalar at every step it was written (TensorBoard)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (run / "tensorboard").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def grad_norms(run: Path, rank: int = 0) -> list[float]:
    """Rank ``rank``'s gradient norm at every optimizer step (tests.callbacks.RecordGradNorm; DDP and 1 process)."""
    records = [json.loads(line) for line in (run / "grad_norms.jsonl").read_text().splitlines()]
    return [r["norm"] for r in records if r["rank"] == rank]


def batches(run: Path) -> dict[tuple[int, int], list[str]]:
    """(step, rank) -> the hashes of the rows it read (tests.callbacks.RecordBatches)."""
    records = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    return {(r["step"], r["rank"]): r["rows"] for r in records}


def documents_per_row(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    return [n for r in records for n in r["documents"]]


@pytest.fixture(scope="module")
def short_documents(tiny_corpus, tmp_path_factory) -> Path:
    """The corpus' training text as one document per paragraph: most packed 64-token rows hold several."""
    path = tmp_path_factory.mktemp("sp_documents") / "paragraphs.jsonl"
    texts = [json.loads(line)["text"] for line in Path(tiny_corpus.train_file).read_text().splitlines()]
    paragraphs = [p for text in texts for p in text.split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return path


# the other losses, labels, inputs and a window: argmax labels and the target's own probabilities (tv) cross the
# slices' ends too, the drafter's own guesses feed the next TTT step, the window masks across the ranks' slices
OTHER_OPTIONS = {"labels": "argmax", "argmax_weight": 0.0, "loss": "tv", "ttt_inputs": "predicted", "window": 16}


@pytest.fixture(scope="module")
def single_process_runs(tiny_corpus, tiny_target, short_documents, tmp_path_factory):
    """The 1-process run of the given model options (each run once)."""
    runs: dict[str, Path] = {}

    def run_of(options: dict) -> Path:
        key = json.dumps(options, sort_keys=True)
        if key not in runs:
            run = tmp_path_factory.mktemp("sp_single")
            fit("quickstart/eagle3.yaml", override(run, tiny_corpus, tiny_target, short_documents, **options), run)
            runs[key] = run
        return runs[key]

    return run_of


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("deepspeed_zero2.yaml", {}), ("ddp.yaml", {}), ("ddp.yaml", OTHER_OPTIONS)],
    ids=["zero2", "ddp", "ddp-argmax-tv-predicted-window"],
)
@pytest.mark.multiprocess
def test_sequence_parallel_fit_follows_the_single_process(
    strategy, options, single_process_runs, tiny_corpus, tiny_target, short_documents, tmp_path, torch_extensions_dir
):
    single_process_run = single_process_runs(options)
    run = tmp_path / "run"
    run.mkdir()
    config = override(run, tiny_corpus, tiny_target, short_documents, sequence_parallel=2, **options)
    config = write_override(run / "override.yaml", config)
    cmd = [
        str(Path(sys.executable).parent / "draftsmith"), "fit",
        "--config", str(RECIPES / "quickstart/eagle3.yaml"),
        "--config", str(RECIPES / "_base" / strategy),
        "--config", str(config),
        "--trainer.devices", "2", "--trainer.accelerator", "cpu",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = run_group(cmd, timeout=600, log_dir=run / "logs", nprocs=2, env=env, rank_env=True, cwd=str(REPO))
    assert res.ok, f"2-process fit failed (timed out: {res.timed_out}, exit {res.returncodes}):\n{res.output[-5000:]}"
    assert "sequence parallel over 2 ranks per row" in res.output
    single, mine = batches(single_process_run), batches(run)
    assert sorted(single) == [(s, 0) for s in range(STEPS)]
    assert max(documents_per_row(single_process_run)) > 1, "no packed row holds two documents: nothing tested"
    for step in range(STEPS):  # both ranks of the group read the 1-process run's rows
        assert mine[(step, 0)] == mine[(step, 1)] == single[(step, 0)], f"step {step}"
    for tag in ("train/loss", "train/acc_2", "val/loss"):  # validation too: the group reads one validation row
        expected = torch.tensor(scalars(single_process_run, tag))
        torch.testing.assert_close(torch.tensor(scalars(run, tag)), expected, rtol=1e-4, atol=1e-5, msg=tag)
    if strategy == "ddp.yaml":  # the gradient itself (AdamW's update would hide a wrong scale): the 1-process one
        single_norms = torch.tensor(grad_norms(single_process_run))
        for rank in (0, 1):
            torch.testing.assert_close(torch.tensor(grad_norms(run, rank)), single_norms, rtol=1e-4, atol=0)
    a, _ = load_training_checkpoint(str(single_process_run / "checkpoints" / "last.ckpt"))
    b, _ = load_training_checkpoint(str(run / "checkpoints" / "last.ckpt"))
    trained = [key for key in a if key.startswith("drafter.") and torch.is_floating_point(a[key])]
    assert trained and set(trained) <= set(b)
    for key in trained:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=2e-5, msg=f"{key} differs from the 1-process run")


@pytest.mark.parametrize(
    ("model", "data", "error", "match"),
    [
        ({"sequence_parallel": 0}, {}, ValueError, r"model\.sequence_parallel=0: a positive number of ranks"),
        ({"sequence_parallel": 2, "target_signals": "shards"}, {}, ValueError, r"needs target_signals: online"),
        ({"sequence_parallel": 2}, {"seq_len": 65}, RecipeError, r"=2 does not divide data\.seq_len=65"),
        ({"sequence_parallel": 4}, {}, RecipeError, r"=4 does not divide the attention's 2 key/value heads"),
        ({"sequence_parallel": 2}, {"seq_len": 4}, RecipeError, r"leave 2 positions per rank, fewer than ttt_steps=3"),
        ({"sequence_parallel": 2}, {}, RecipeError, r"=2 runs under DDP or DeepSpeed .* not SingleDeviceStrategy"),
    ],
)
def test_sequence_parallel_settings_it_cannot_run_are_refused_by_name(
    model, data, error, match, tiny_corpus, tiny_target, short_documents, tmp_path
):
    """Each refused before a step runs (the recipe's values when it is read, the rows and strategy at setup), the
    message naming the key and value."""
    config = override(tmp_path, tiny_corpus, tiny_target, short_documents, **model)
    config["data"]["init_args"].update(data)
    with pytest.raises(error, match=match):
        fit("quickstart/eagle3.yaml", config, tmp_path)
