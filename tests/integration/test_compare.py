"""``draftsmith compare`` end to end on the test target: shared regenerated data, a trained method, a drafter without
weights and a broken method; then a rerun that skips what is done.

Each stage (generate, fit, export, eval) runs in a fresh process as ``draftsmith compare`` runs it, forked from a
process that has imported torch, Lightning and transformers once (tests/cli_server.py) rather than started anew: the
seven stages would otherwise spend about a minute importing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.cli_server import CliServer
from tests.recipe_runs import RECIPES, TINY_STUDENT
from trainer.compare.run import Comparison
from trainer.compare.run import main as compare_main

pytestmark = pytest.mark.slow


@pytest.fixture
def forked_stages(monkeypatch):
    """Comparison's stages run as ``draftsmith ARGS`` in children of one :class:`CliServer`: the same command line,
    environment and working folder as ``Comparison._run_command``'s own process, the output in the stage's log."""
    with CliServer() as server:

        def run_command(self: Comparison, args: list[str], output) -> int:
            part = Path(output.name + ".part")
            result = server.run(args, part, cwd=Path.cwd(), env=self.env, timeout=900)
            output.write(part.read_text(errors="replace"))
            part.unlink()
            return result.status

        monkeypatch.setattr(Comparison, "_run_command", run_command)
        yield


def test_compare_trains_measures_reports_and_resumes(tiny_corpus, tiny_target, tmp_path, capsys, forked_stages):
    prompts = tmp_path / "prompts.jsonl"
    texts = [json.loads(line)["text"] for line in Path(tiny_corpus.heldout_file).read_text().splitlines()[:2]]
    prompts.write_text("".join(json.dumps({"prompt": t[:120]}) + "\n" for t in texts))
    documents = tmp_path / "documents.jsonl"  # 48 of the corpus' training documents: enough rows for two steps
    documents.write_text("".join(Path(tiny_corpus.train_file).read_text().splitlines(keepends=True)[:48]))
    small = [
        "--model.init_args.target={target}", "--model.init_args.export_dir={run}/student",
        f"--model.init_args.drafter_config={json.dumps(TINY_STUDENT)}", "--model.init_args.loss_chunk_size=64",
        f"--data.init_args.tokenizer={tiny_corpus.tokenizer_dir}",
        f"--data.init_args.val_files=[{tiny_corpus.heldout_file}]", "--data.init_args.seq_len=64",
        "--data.init_args.batch_size=4", "--trainer.limit_val_batches=1",
    ]  # fmt: skip
    recipe = {
        "target": str(tiny_target),
        "output_dir": str(tmp_path / "out"),
        "budget": {"tokens": 2 * 4 * 64},  # two steps of 4 x 64 tokens
        "data": {"regenerate": {"documents": str(documents), "max_new_tokens": 8, "prompt_chars": 60,
                                "prompts_per_document": 1}},
        "evaluation": {"prompts": str(prompts), "max_prompts": 2, "k": [2], "max_new_tokens": 8,
                       "training_evals": 1, "callback_prompts": 1},
        "methods": [
            {"name": "lookup", "drafter": "prompt-lookup"},
            {"name": "kd", "recipe": str(RECIPES / "quickstart" / "kd.yaml"), "fit_args": small},
            {"name": "broken", "recipe": str(RECIPES / "quickstart" / "kd.yaml"),
             "fit_args": [*small, "--model.init_args.target={run}/no_such_model"]},
        ],
    }  # fmt: skip
    path = tmp_path / "compare.yaml"
    # a misspelled fit key stops the comparison before anything runs, naming the method and the key
    typo = {
        **recipe,
        "methods": [
            *recipe["methods"][:2],
            {**recipe["methods"][1], "name": "typo", "fit_args": [*small, "--model.init_args.not_a_key=1"]},
        ],
    }
    path.write_text(yaml.safe_dump(typo))
    assert compare_main(["--config", str(path)]) == 2  # a user error
    assert "methods[2] ('typo')" in capsys.readouterr().err and not (tmp_path / "out" / "methods").exists()
    path.write_text(yaml.safe_dump(recipe))

    assert compare_main(["--config", str(path)]) == 1  # one method failed, the others went on
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    rows = {row["method"]: row for row in report["rows"]}
    assert [r["status"] for r in report["rows"]] == ["done", "done", "failed"]
    kd = rows["kd"]
    assert kd["training"]["steps"] == 2 and kd["training"]["tokens"] == 2 * 4 * 64
    assert kd["training"]["tau"] and kd["training"]["tau"][-1][0] == 2 * 4 * 64  # tau at the last step's tokens
    assert kd["kind"] == "hf_causal_lm" and kd["extra_parameters"] == kd["parameters"] > 0
    assert kd["loss"] == "kl" and rows["lookup"].get("loss") is None  # the loss column: what the recipe trains with
    assert kd["per_k"][0]["k"] == 2 and kd["per_k"][0]["tau_greedy"] >= 1 and kd["per_k"][0]["tau_sampling"] >= 1
    assert rows["lookup"]["extra_mib"] == 0 and rows["lookup"]["budget"] == "no training"
    assert rows["broken"]["failure"]["stage"] == "fit" and "no_such_model" in rows["broken"]["failure"]["tail"]
    regenerated = out / "data" / "train_completions.jsonl"
    assert len(regenerated.read_text().splitlines()) == 48
    markdown = (out / "report.md").read_text()
    assert "| kd | 2 |" in markdown and "| broken | failed at fit" in markdown
    assert all((out / f"{name}.png").is_file() for name in ("tau_vs_cost", "acceptance", "tau_vs_tokens", "speedup"))

    # a rerun skips what is done: the data, the trained method's fit and evaluation; the broken one is retried
    done = [regenerated, out / "methods" / "kd" / "fit.json", out / "methods" / "kd" / "eval" / "report.json"]
    stamps = [p.stat().st_mtime_ns for p in done]
    capsys.readouterr()
    assert compare_main(["--config", str(path)]) == 1
    said = capsys.readouterr().out
    assert "kd: fit" not in said and "broken: fit" in said and "data:" not in said
    assert [p.stat().st_mtime_ns for p in done] == stamps
    assert len(json.loads((out / "compare_seconds.json").read_text())) == 2
    assert compare_main(["--config", str(path), "--only", "nope"]) == 2
