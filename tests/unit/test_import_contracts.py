"""The import contracts of pyproject.toml (``[tool.importlinter]``, run by ``make lint``): the tree keeps them, and
each contract breaks on the import it forbids, written into a copy of the package (a shared module importing a
method, one method importing another, a cycle, a new module placed in no layer). A method may extend one parent
method, a family declared in the independence contract (P-EAGLE extends EAGLE-3): the child's imports of its parent
are allowed by the declaration alone, and an undeclared sibling import or the parent importing its child is refused."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

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


ENTRY_MODULES = {"cli", "demo"}  # the draftsmith command and its demo; everything else lives in a package


def test_the_root_holds_packages_and_the_entry_modules_and_the_layers_name_them():
    root = ROOT / "trainer"
    assert {p.stem for p in root.glob("*.py")} - {"__init__"} == ENTRY_MODULES
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    contract = next(
        c
        for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
        if c["name"] == LAYERS
    )
    named = {name.strip() for layer in contract["layers"] for name in re.split(r"[:|]", layer)}
    assert named == packages | ENTRY_MODULES
    for package in packages:  # each says what it holds
        assert ast.get_docstring(ast.parse((root / package / "__init__.py").read_text())), package


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
        # one method imports a sibling's module (what they share belongs in trainer/models/layers.py)
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
        # a child imports a method other than its declared parent
        (
            "trainer/methods/peagle/module.py",
            "import trainer.methods.dflash.module",
            INDEPENDENT,
            "trainer.methods.peagle.module -> trainer.methods.dflash.module",
        ),
        # a parent imports its child (a family goes one way)
        (
            "trainer/methods/eagle3/labels.py",
            "import trainer.methods.peagle.module",
            INDEPENDENT,
            "trainer.methods.eagle3.labels -> trainer.methods.peagle.module",
        ),
        # ... which is also a cycle between the two methods (the child imports its parent)
        (
            "trainer/methods/eagle3/labels.py",
            "import trainer.methods.peagle.module",
            ACYCLIC,
            "No cycles are allowed in trainer.methods.",
        ),
    ],
    ids=[
        "shared-imports-method",
        "method-imports-method",
        "cycle-in-shared-layer",
        "cycle-in-a-method",
        "child-imports-an-undeclared-method",
        "parent-imports-its-child",
        "parent-and-child-in-a-cycle",
    ],
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


FAMILY = re.compile(r'^\s*"trainer\.methods\.peagle\.\*\* -> trainer\.methods\.eagle3\.\*\*",.*\n', re.M)


def test_a_declared_family_allows_the_child_to_import_its_parent(copy: Path):
    # the tree keeps the contract with P-EAGLE importing EAGLE-3's modules (test_the_tree_keeps_every_contract), one
    # more import of the parent included; without the declaration the same imports break it
    prepend(copy / "trainer/methods/peagle/proposer.py", "import trainer.methods.eagle3.export")
    status, verdicts, output = lint_imports(copy)
    assert status == 0 and verdicts[INDEPENDENT] == "KEPT", output

    pyproject = copy / "pyproject.toml"
    declared = pyproject.read_text()
    assert len(FAMILY.findall(declared)) == 1, "the P-EAGLE family is declared once in pyproject.toml"
    pyproject.write_text(FAMILY.sub("", declared))
    status, verdicts, output = lint_imports(copy)
    assert status != 0, output
    assert verdicts[INDEPENDENT] == "BROKEN", output
    assert "trainer.methods.peagle.objective -> trainer.methods.eagle3.objective" in output, output
    assert "trainer.methods.peagle.proposer -> trainer.methods.eagle3.export" in output, output


def test_a_declared_family_whose_child_imports_nothing_of_its_parent_is_an_error(copy: Path):
    pyproject = copy / "pyproject.toml"
    stale = '    "trainer.methods.medusa.** -> trainer.methods.mtp.**",\n'
    pyproject.write_text(FAMILY.sub(lambda m: m.group(0) + stale, pyproject.read_text()))
    status, _, output = lint_imports(copy)
    assert status != 0, output
    assert "trainer.methods.medusa.** -> " in output, output
