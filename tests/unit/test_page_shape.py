"""The method pages and the recipe headers keep a shape a person reads.

A page in ``docs/methods/`` says what the method does, when to use it, how to run it, what it trains, its recipes and
its exports; what was measured lives in ``docs/benchmarks/`` and what is tested in ``docs/developer/tests.md``, both
linked. So a method page has at most :data:`PAGE_MAX_LINES` lines, no prose line over :data:`LINE_MAX_CHARS`
characters (fenced code blocks and table rows excepted: a command is one line), no table cell over
:data:`CELL_MAX_CHARS` characters (a longer description goes in prose below the table), and no commit hash or date
(``2026-12-03``): a figure measured at a commit on a day belongs to the benchmark pages.

A recipe's header (its comment lines before the first key) opens with the recipe's command and says what it trains,
when to use it and the commands around it: at most :data:`HEADER_MAX_LINES` lines, no commit hash and no date.

A commit hash is a word of 7 to 40 hex digits holding both a letter and a digit (``f68a0b1``), or a run of 7 to 40
decimal digits after the word "commit" (``commit 2684678``): plain numbers (``10000000000000``, ``151669``) and words
(``defaced``) are not hashes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
METHOD_PAGES = sorted((REPO / "docs" / "methods").glob("*.md"))
RECIPES = sorted([*(REPO / "recipes").glob("*.yaml"), *(REPO / "recipes" / "quickstart").glob("*.yaml")])

PAGE_MAX_LINES = 160
LINE_MAX_CHARS = 120
CELL_MAX_CHARS = 200
HEADER_MAX_LINES = 25

FENCE = re.compile(r"^\s*(```|~~~)")
HEX_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
DECIMAL_HASH = re.compile(r"\bcommits?\s+(\d{7,40})\b", flags=re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def commit_hashes(line: str) -> list[str]:
    """The commit hashes a line holds (the rule above)."""
    return [m.group(0) for m in HEX_HASH.finditer(line)] + [m.group(1) for m in DECIMAL_HASH.finditer(line)]


def dated(line: str) -> list[str]:
    """The ISO dates a line holds."""
    return DATE.findall(line)


def table_cells(line: str) -> list[str]:
    """The cells of a markdown table row (``\\|`` inside a cell is not a separator)."""
    row = line.strip().removeprefix("|").removesuffix("|")
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row)]


def page_problems(text: str) -> list[str]:
    """What breaks the method pages' shape, one message per problem."""
    lines = text.splitlines()
    problems = []
    if len(lines) > PAGE_MAX_LINES:
        problems.append(
            f"{len(lines)} lines (at most {PAGE_MAX_LINES}): figures to docs/benchmarks/, tests to tests.md"
        )
    inside = False
    for number, line in enumerate(lines, 1):
        problems += [f"line {number}: commit hash {h}" for h in commit_hashes(line)]
        problems += [f"line {number}: date {d} (a dated figure goes to docs/benchmarks/)" for d in dated(line)]
        if FENCE.match(line):
            inside = not inside
            continue
        if inside:
            continue
        if line.lstrip().startswith("|"):
            for cell in table_cells(line):
                if len(cell) > CELL_MAX_CHARS:
                    problems.append(f"line {number}: a table cell of {len(cell)} characters (at most {CELL_MAX_CHARS})")
        elif len(line) > LINE_MAX_CHARS:
            problems.append(f"line {number}: {len(line)} characters (at most {LINE_MAX_CHARS})")
    return problems


def recipe_header(text: str) -> list[str]:
    """A recipe's comment lines before its first key."""
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    return header


def test_the_pages_and_recipes_are_found() -> None:
    assert len(METHOD_PAGES) >= 10 and (REPO / "docs" / "methods" / "eagle3.md") in METHOD_PAGES
    assert len(RECIPES) >= 20 and all(recipe_header(p.read_text(encoding="utf-8")) for p in RECIPES)


@pytest.mark.parametrize("page", METHOD_PAGES, ids=lambda p: p.name)
def test_a_method_page_has_a_readable_shape(page: Path) -> None:
    problems = page_problems(page.read_text(encoding="utf-8"))
    assert not problems, f"docs/methods/{page.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_a_recipe_header_is_short_and_undated(recipe: Path) -> None:
    header = recipe_header(recipe.read_text(encoding="utf-8"))
    assert header[0].startswith("# draftsmith "), f"{recipe.name} must open with its command"
    assert len(header) <= HEADER_MAX_LINES, (
        f"{recipe.name}: a header of {len(header)} lines (at most {HEADER_MAX_LINES})"
    )
    hashes = [h for line in header for h in commit_hashes(line)]
    assert not hashes, f"{recipe.name}: commit hashes in the header: {hashes}"
    dates = [d for line in header for d in dated(line)]
    assert not dates, f"{recipe.name}: dates in the header (a dated figure goes to docs/benchmarks/): {dates}"


def test_the_rules_catch_what_they_name() -> None:
    assert commit_hashes("measured at f68a0b1 and at commit 2684678") == ["f68a0b1", "2684678"]
    assert commit_hashes("`[[0, 0.3], [10000000000000, 0.1]]`, id 151669, arXiv 2602.23881, defaced, bf16") == []
    assert dated("at 131,072 tokens (2026-12-03)") == ["2026-12-03"] and dated("December 2026, PR #571") == []
    long_cell = "| `x` | " + "y" * (CELL_MAX_CHARS + 1) + " |"
    too_wide = f"line 3: a table cell of {CELL_MAX_CHARS + 1} characters (at most {CELL_MAX_CHARS})"
    assert page_problems(f"# A\n\n{long_cell}\n") == [too_wide]
    assert page_problems("```\n" + "z" * 300 + "\n```\n") == []  # a command in a code block is one line
    assert page_problems("p" * (LINE_MAX_CHARS + 1)) == [f"line 1: {LINE_MAX_CHARS + 1} characters (at most 120)"]
    assert len(page_problems("\n" * PAGE_MAX_LINES + "x")) == 1
