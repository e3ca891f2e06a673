"""The benchmark suite's layout, read as source (nothing here imports bench/): bench/ and tests/ import nothing from
each other, no script edits sys.path, docs/benchmarks/index.md names every benchmark and study once, and every
``python -m bench...`` command in the docs and recipes names a module that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "docs" / "benchmarks" / "index.md"


def imported_roots(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (absolute imports, at any depth of the file)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def scripts() -> list[str]:
    """Every runnable module of bench/ as ``bench.<name>`` or ``bench.studies.<name>``."""
    found = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        if path.name in ("__init__.py", "common.py"):
            continue
        found.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def test_bench_and_tests_import_nothing_from_each_other():
    bench = {p: imported_roots(p) for p in (REPO / "bench").rglob("*.py")}
    tests = {p: imported_roots(p) for p in (REPO / "tests").rglob("*.py")}
    assert [str(p) for p, roots in bench.items() if "tests" in roots] == []
    assert [str(p) for p, roots in tests.items() if "bench" in roots] == []
    assert len(bench) > 10 and len(tests) > 10  # the walk found the files


def test_no_bench_script_edits_the_import_path():
    edits = [
        str(p)
        for p in (REPO / "bench").rglob("*.py")
        if any(
            isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys"
            for node in ast.walk(ast.parse(p.read_text()))
        )
    ]
    assert edits == []


def test_the_index_says_which_script_is_a_benchmark_and_which_a_study():
    text = INDEX.read_text()
    section = text.split("## Benchmarks and studies", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- `(bench\.[a-z0-9_.]+)`(?:, `(bench\.[a-z0-9_.]+)`)?:", section, flags=re.M)
    names = [name for pair in listed for name in pair if name]
    assert sorted(names) == sorted(scripts())
    benchmarks, studies = section.split("A **study**", 1)
    assert all(".studies." not in name for name in re.findall(r"`(bench\.[a-z0-9_.]+)`", benchmarks))
    assert all(".studies." in name for name in re.findall(r"^- `(bench\.[a-z0-9_.]+)`", studies, flags=re.M))


def test_every_documented_bench_command_names_a_module_that_exists():
    known = set(scripts())
    pages = [*(REPO / "docs").rglob("*.md"), REPO / "README.md", *(REPO / "recipes").rglob("*.yaml")]
    commands = {
        (str(page.relative_to(REPO)), module)
        for page in pages
        for module in re.findall(r"python -m (bench\.[a-z0-9_.]+)", page.read_text())
    }
    assert commands, "no command found: the pattern no longer matches the docs"
    assert sorted(c for c in commands if c[1] not in known) == []
    stale = [str(p.relative_to(REPO)) for p in pages if re.search(r"python bench/", p.read_text())]
    assert stale == []  # scripts run as modules from the repository root
