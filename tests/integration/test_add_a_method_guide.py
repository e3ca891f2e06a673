"""docs/developer/add-a-method.md is a method that works: its five files (module, objective, proposer, export, kind)
and its recipe, taken from the page's code blocks into a ``one_head`` package on ``trainer.methods``' search path,
train two steps through ``draftsmith fit``, export through ``draftsmith export`` (the kind found by the registry like
any other), draft losslessly through ``draftsmith eval`` (which checks every output token against the target's), plan
through ``draftsmith plan`` (the objective's own activation estimate) and pass the recipe-vocabulary checks
(tests/unit/test_recipe_vocabulary.py) beside every shipped objective, its recipe counted with the quickstart ones."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipe_runs import ROOT, data_overrides, merge, trainer_overrides, write_override

pytestmark = pytest.mark.slow
GUIDE = ROOT / "docs" / "developer" / "add-a-method.md"
FILES = ("module.py", "objective.py", "proposer.py", "export.py", "kind.py")

RUN = """
import sys
from pathlib import Path

import trainer.methods
trainer.methods.__path__.append(sys.argv[1])  # the guide's package, found as trainer.methods.one_head
from trainer.cli import main
for command in sys.argv[3:]:
    status = main(command.split("\\x1f"))
    if status:
        sys.exit(status)
from tests.unit import test_recipe_vocabulary as vocabulary  # its objectives found with the guide's on the path

vocabulary.check_objectives_found(vocabulary.objectives(), [*vocabulary.FIT_RECIPES, Path(sys.argv[2])])
print("vocabulary checked:", sorted(vocabulary.objectives()))
"""


def guide_blocks() -> tuple[dict[str, str], str]:
    """The page's Python block under each ``## <file>.py`` heading, and its YAML recipe."""
    text = GUIDE.read_text()
    files = {}
    for name in FILES:
        match = re.search(rf"^## {re.escape(name)}\n.*?^```python\n(.*?)^```", text, flags=re.M | re.S)
        assert match, f"{GUIDE.name}: no python block under '## {name}'"
        files[name] = match.group(1)
    recipe = re.search(
        r"^```yaml\n(# draftsmith fit --config recipes/quickstart/one_head\.yaml.*?)^```", text, re.M | re.S
    )
    assert recipe, f"{GUIDE.name}: no one_head recipe block"
    return files, recipe.group(1)


def test_the_guides_method_trains_exports_and_drafts_losslessly(tiny_corpus, random_target, tmp_path):
    files, recipe = guide_blocks()
    package = tmp_path / "methods" / "one_head"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, code in files.items():
        (package / name).write_text(code)
    (tmp_path / "one_head.yaml").write_text(recipe)
    run = tmp_path / "run"
    override = merge(
        trainer_overrides(run, 2, 2, logger=False),
        {"model": {"init_args": {"target": str(random_target)}}},
        data_overrides(tiny_corpus, seq_len=32, batch_size=2),
    )
    write_override(tmp_path / "override.yaml", override)
    prompts = tmp_path / "prompts.jsonl"
    lines = Path(tiny_corpus.heldout_file).read_text().splitlines()[:2]
    prompts.write_text("".join(json.dumps({"prompt": json.loads(x)["text"][:80]}) + "\n" for x in lines))
    commands = [
        ["fit", "--config", str(tmp_path / "one_head.yaml"), "--config", str(tmp_path / "override.yaml")],
        ["export", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--output_dir", str(tmp_path / "exported")],
        ["eval", "--target", str(random_target), "--drafter", str(tmp_path / "exported"), "--prompts", str(prompts),
         "--k", "1", "--max_new_tokens", "12", "--output_dir", str(tmp_path / "eval")],
        ["plan", "--config", str(tmp_path / "one_head.yaml"), "--config", str(tmp_path / "override.yaml"),
         "--gpus", "1"],
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / "methods"), str(tmp_path / "one_head.yaml"),
         *("\x1f".join(c) for c in commands)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["architectures"] == ["DraftsmithOneHead"]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())  # written only when every output matched
    assert [entry["k"] for entry in report["greedy"]] == [1] and report["greedy"][0]["tau"] >= 1.0
    planned = re.search(r"^OneHeadObjective: trained \S+M parameters", done.stdout, flags=re.M)
    assert planned and "| ddp |" in done.stdout, done.stdout[-3000:]  # the objective's own activation estimate
    assert "trainer.methods.one_head.objective.OneHeadObjective" in done.stdout.splitlines()[-1]
