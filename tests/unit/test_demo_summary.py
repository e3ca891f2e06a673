"""The README's demo block is generated from the demo's summary (docs/demo_summary.json), not written by hand; the
demo's in-process fits and plain runs outside SLURM print none of Lightning's warnings that do not apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.demo import README_END, README_START, README_SUMMARY, render_summary, write_readme_block

REPO = Path(__file__).resolve().parents[2]


def test_the_readmes_demo_block_is_the_rendered_summary() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split(README_START + "\n```\n", 1)[1].split("\n```\n" + README_END, 1)[0]
    summary = json.loads((REPO / README_SUMMARY).read_text())
    assert block == render_summary(summary)


def test_writing_the_block_replaces_it_and_keeps_the_summary(tmp_path) -> None:
    summary = json.loads((REPO / README_SUMMARY).read_text())
    summary["kd_student"]["tau_greedy"] = 9.87
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n\n{README_START}\n```\nstale\n```\n{README_END}\n\nafter\n")
    write_readme_block(readme, tmp_path / "summary.json")
    text = readme.read_text()
    assert "tau 9.87 greedy" in text and "stale" not in text
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert json.loads((tmp_path / README_SUMMARY).read_text()) == summary
    (tmp_path / "plain.md").write_text("# no block\n")
    with pytest.raises(SystemExit, match="no demo block"):
        write_readme_block(tmp_path / "plain.md", tmp_path / "summary.json")


@pytest.mark.parametrize("in_slurm_job", [False, True])
def test_lightnings_srun_hint_is_shown_only_inside_a_slurm_job(in_slurm_job) -> None:
    import warnings

    from lightning.fabric.utilities.warnings import PossibleUserWarning

    from trainer.training.recipe import hide_srun_hint

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        hide_srun_hint({"SLURM_JOB_ID": "7"} if in_slurm_job else {})
        hint = "The `srun` command is available on your system but is not used. HINT: x"
        warnings.warn(hint, PossibleUserWarning, stacklevel=1)
    assert any("srun" in str(w.message) for w in shown) == in_slurm_job


def test_a_stage_stopped_by_a_signal_ends_the_demo_with_its_status(tmp_path, monkeypatch, capsys) -> None:
    """A SIGTERM during the target's fit saves last.ckpt and stops the demo there (status 143), instead of training
    the student on a half-trained target and writing a summary as if the stage had finished."""
    from types import SimpleNamespace

    import trainer.demo as demo
    from trainer.distributed.preemption import PreemptionCheckpoint

    stopped = PreemptionCheckpoint()
    stopped.stopped_by = 15
    trainer = SimpleNamespace(callbacks=[stopped], global_step=3, callback_metrics={})
    monkeypatch.setattr(demo, "DraftsmithCLI", lambda args: SimpleNamespace(trainer=trainer))
    summary = tmp_path / "summary.json"
    with pytest.raises(SystemExit) as stop:
        demo._fit("tiny_target.yaml", 10, summary, tmp_path / "checkpoints")
    assert stop.value.code == 143 and not summary.exists()
    said = capsys.readouterr().err
    assert "tiny_target.yaml stage stopped on signal 15 at step 3" in said and "rerun `draftsmith demo`" in said
