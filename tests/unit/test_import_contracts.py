"""The import contracts of pyproject.toml (``[tool.importlinter]``, run by ``make lint``): the tree keeps them, and
each contract breaks on the import it forbids, written into a copy of the package (a shared module importing a
method, one method importing another, a cycle, a new module placed in no layer)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
LAYERS = "Layers: faces > methods > shared (no shared module imports a method)"
INDEPENDENT = "Methods are independent of each other"
ACYCLIC = "No import cycles in trainer"

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (the dev extra)")


def lint_imports(root: Path) -> tuple[int, dict[str, str], str]:
    """Run lint-imports on the ``trainer`` package under ``root`` with the ``pyproject.toml`` there.

    Returns:
        The exit status, each contract's verdict by name (``KEPT`` or ``BROKEN``) and the whole output.
    """
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "250"}  # one line per contract in the summary
    done = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    verdicts = {
        m["name"]: m["verdict"] for m in re.finditer(r"^(?P<name>\S.*?) (?P<verdict>KEPT|BROKEN)\b", output, re.M)
    }
    return done.returncode, verdicts, output


def test_the_tree_keeps_every_contract():
    status, verdicts, output = lint_imports(ROOT)
    assert status == 0, output
    assert verdicts == {LAYERS: "KEPT", INDEPENDENT: "KEPT", ACYCLIC: "KEPT"}, output


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the package and of pyproject.toml (which holds the contracts) to break."""
    shutil.copytree(ROOT / "trainer", tmp_path / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def prepend(file: Path, line: str) -> None:
    file.write_text(line + "\n" + file.read_text())


@pytest.mark.parametrize(
    ("module", "line", "broken", "named"),
    [
        # the shared layer imports a method (the engine would then depend on one drafter)
        (
            "trainer/decoding/session.py",
            "import trainer.methods.eagle3.module",
            LAYERS,
            "trainer.decoding.session -> trainer.methods.eagle3.module",
        ),
        # one method imports a sibling's module (what they share belongs in trainer/layers.py)
        (
            "trainer/methods/dflash/module.py",
            "import trainer.methods.eagle3.module",
            INDEPENDENT,
            "trainer.methods.dflash.module -> trainer.methods.eagle3.module",
        ),
        # a cycle inside the shared layer, which no layer forbids: generate -> tree -> generate
        (
            "trainer/decoding/tree.py",
            "import trainer.decoding.generate",
            ACYCLIC,
            "No cycles are allowed in trainer.decoding",
        ),
        # the cycle this layout removed: the kind imports the exporters, which read the record back from the kind
        (
            "trainer/methods/mtp/record.py",
            "import trainer.methods.mtp.kind",
            ACYCLIC,
            "No cycles are allowed in trainer.methods.mtp.",
        ),
    ],
    ids=["shared-imports-method", "method-imports-method", "cycle-in-shared-layer", "cycle-in-a-method"],
)
def test_each_contract_breaks_on_the_import_it_forbids(copy: Path, module: str, line: str, broken: str, named: str):
    prepend(copy / module, line)
    status, verdicts, output = lint_imports(copy)
    assert status != 0, output
    assert verdicts[broken] == "BROKEN", output
    assert named in output, output


def test_a_new_module_must_be_placed_in_a_layer(copy: Path):
    (copy / "trainer" / "unplaced.py").write_text('"""A module no layer of the contract names."""\n')
    status, verdicts, output = lint_imports(copy)
    assert status != 0, output
    assert verdicts[LAYERS] == "BROKEN", output
    assert "trainer.unplaced" in output, output
