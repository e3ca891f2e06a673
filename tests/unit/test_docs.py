"""The README and docs/ are checked against the code: their links resolve, their ``draftsmith`` command lines parse,
and the README stays short.

Links: every relative link or image of README.md and docs/**/*.md (outside code) must name a file of the repository,
and a ``#anchor`` a heading of the file it points to (GitHub's rule: lowercase, punctuation other than ``-`` and ``_``
dropped, spaces turned into ``-``, ``-1``, ``-2``... for a repeated heading). Links with a scheme (``https:``) are
not followed.

Command lines, and the rule for placeholders:

- what counts: a line of a fenced code block that starts with ``draftsmith`` (a trailing ``\\`` joins the next
  line; a shell comment, ``# ...``, is cut), and an inline code span that starts with ``draftsmith `` and holds a
  flag. A span without a flag (``draftsmith eval``, ``draftsmith slurm submit``) only names a subcommand: it must
  exist; ``draftsmith --help`` is the command's own usage, ``draftsmith --version`` its release.
- placeholders: a word in capitals (``DIR``, ``FILE``, ``CKPT``, ``N``, ``RECIPE``...), a ``<...>``, ``$VAR`` or
  ``${VAR}`` is replaced by the dummy value ``1`` (a valid integer, path or name for every flag), and ``...`` is
  dropped. A ``draftsmith fit`` or ``validate`` line whose ``--config`` is a placeholder has no recipe to read and is
  not parsed.
- ``draftsmith fit`` and ``validate``: :func:`trainer.training.recipe.parse_recipe` (the configs in order, then the
  other arguments as overrides), which builds and reads nothing but the recipes.
- every other subcommand: the tool's own ``main(argv)`` from ``trainer.cli.TOOLS`` runs with argparse's and
  jsonargparse's ``parse_args`` intercepted: the first parse returns its namespace by raising, so nothing after the
  parsing runs, whatever the tool. ``plan`` and ``slurm submit`` also parse their recipes and fit arguments with
  ``parse_recipe``, as they do; ``compare`` reads its recipe with ``read_config``.

Nothing touches the network: the recipes name local folders that parsing never opens.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import jsonargparse
import pytest

from trainer.cli import TOOLS

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted([README, *(REPO / "docs").rglob("*.md")])
README_MAX_LINES = 260
DUMMY = "1"
TRAINING = ("fit", "validate")

# ---- reading markdown --------------------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def split_code(text: str) -> tuple[list[tuple[int, str]], str]:
    """The lines of fenced code blocks (with their line numbers) and the text outside them (fenced lines blanked,
    so that line numbers stay)."""
    code, prose, inside = [], [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            prose.append("")
            continue
        if inside:
            code.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    return code, "\n".join(prose)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file."""
    _, prose = split_code(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for line in prose.splitlines():
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image outside code."""
    _, prose = split_code(path.read_text(encoding="utf-8"))
    out = []
    for number, line in enumerate(prose.splitlines(), 1):
        line = INLINE_CODE.sub("", line)
        out += [(number, m.group(1)) for m in LINK.finditer(line)]
    return out


@dataclass(frozen=True)
class Command:
    file: str
    line: int
    text: str  # as written, one line

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def commands(path: Path) -> list[Command]:
    """The ``draftsmith`` command lines of a markdown file: code-block lines and inline spans."""
    text = path.read_text(encoding="utf-8")
    name = str(path.relative_to(REPO))
    code, prose = split_code(text)
    found = []
    pending: tuple[int, str] | None = None
    for number, line in code:
        stripped = line.strip()
        if pending is not None:
            start, joined = pending
            joined += " " + stripped
        elif re.match(r"(\$\s+)?draftsmith(\s|$)", stripped):
            start, joined = number, re.sub(r"^\$\s+", "", stripped)
        else:
            continue
        if joined.endswith("\\"):
            pending = (start, joined[:-1].rstrip())
            continue
        pending = None
        found.append(Command(name, start, joined))
    for match in INLINE_CODE.finditer(prose):
        span = " ".join(match.group(1).split())
        if span.startswith("draftsmith "):
            number = prose.count("\n", 0, match.start()) + 1
            found.append(Command(name, number, span))
    return found


# ---- placeholders and parsing ------------------------------------------------------------------------------------

CAPITALS = re.compile(r"^[A-Z][A-Z0-9_]*$")
ANGLE = re.compile(r"<[^<>]*>")
SHELL_VAR = re.compile(r"\$\{?\w+\}?")


def is_placeholder(token: str) -> bool:
    return bool(CAPITALS.match(token) or ANGLE.fullmatch(token) or SHELL_VAR.fullmatch(token))


def fill(token: str) -> str:
    """The token with every placeholder replaced by the dummy value."""
    if CAPITALS.match(token):
        return DUMMY
    return SHELL_VAR.sub(DUMMY, ANGLE.sub(DUMMY, token))


def argv_of(command: Command) -> list[str]:
    """The arguments after ``draftsmith``, shell-split, comments cut, ``...`` dropped (placeholders kept)."""
    tokens = shlex.split(command.text, comments=True)
    assert tokens and tokens[0] == "draftsmith", command
    return [t for t in tokens[1:] if t != "..."]


class _Parsed(Exception):
    def __init__(self, namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


@contextlib.contextmanager
def stop_after_parsing():
    """argparse's and jsonargparse's ``parse_args`` and ``parse_known_args``: the outermost call raises
    :class:`_Parsed` with its result, so a tool's ``main`` never gets past parsing its command line."""
    depth = [0]
    patched = []

    def wrap(original):
        def parse(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(result[0] if isinstance(result, tuple) else result)
            return result

        return parse

    for cls in dict.fromkeys([argparse.ArgumentParser, jsonargparse.ArgumentParser]):
        for name in ("parse_args", "parse_known_args"):
            if name in vars(cls):
                patched.append((cls, name, vars(cls)[name]))
                setattr(cls, name, wrap(vars(cls)[name]))
    try:
        yield
    finally:
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)


def parse_tool(sub: str, argv: list[str]):
    """The namespace ``draftsmith <sub> <argv>`` parses to, by the tool's own parser; AssertionError with the tool's
    message when it refuses the arguments."""
    module_name, function_name = TOOLS[sub][0].split(":")
    main = getattr(importlib.import_module(module_name), function_name)
    stderr, stdout = io.StringIO(), io.StringIO()
    try:
        with stop_after_parsing(), contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            main(argv)
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as err:
        raise AssertionError(
            f"draftsmith {sub} refuses {argv} (exit {err.code}): {(stderr.getvalue() + stdout.getvalue()).strip()}"
        ) from None
    raise AssertionError(f"draftsmith {sub}: main returned without parsing its arguments (the test cannot check it)")


_RECIPES: dict[tuple[tuple[str, ...], tuple[str, ...]], str | None] = {}


def recipe_error(configs: list[str], overrides: list[str]) -> str | None:
    """parse_recipe's refusal of a recipe and fit arguments (None: it parses); each pair parsed once."""
    from trainer.training.recipe import RecipeError, parse_recipe

    key = (tuple(configs), tuple(overrides))
    if key not in _RECIPES:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            try:
                parse_recipe(configs, overrides)
                _RECIPES[key] = None
            except RecipeError as err:
                _RECIPES[key] = str(err)
    return _RECIPES[key]


def parse_training(sub: str, argv: list[str]) -> str | None:
    """``draftsmith fit|validate`` by parse_recipe; returns why it was skipped, or None."""
    configs, overrides, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--config" and i + 1 < len(argv):
            configs.append(argv[i + 1])
            i += 2
            continue
        if token.startswith("--config="):
            configs.append(token.split("=", 1)[1])
        else:
            overrides.append(token)
        i += 1
    assert configs, f"draftsmith {sub} without --config"
    if any(is_placeholder(c) or ANGLE.search(c) for c in configs):
        return f"the recipe is a placeholder ({configs})"
    error = recipe_error(configs, [fill(o) for o in overrides])
    assert error is None, f"draftsmith {sub} {' '.join(argv)}: {error}"
    return None


def check_recipes(sub: str, namespace) -> None:
    """What the tool does with its recipe right after parsing, without running anything else."""
    if sub in ("plan", "slurm"):
        configs = list(namespace.config)
        if not any(is_placeholder(c) for c in configs):
            error = recipe_error(configs, list(namespace.fit_args))
            assert error is None, f"draftsmith {sub}: its recipe {configs}: {error}"
    elif sub == "compare" and not is_placeholder(namespace.config):
        from trainer.compare.config import CompareConfigError, read_config

        try:
            read_config(namespace.config)
        except CompareConfigError as err:
            raise AssertionError(f"draftsmith compare: {err}") from None


_CHECKED: dict[tuple[str, ...], str | None] = {}


def check_command(command: Command) -> str | None:
    """Parse one command line; returns why it was skipped (or None), raises AssertionError when it does not parse."""
    argv = argv_of(command)
    key = tuple(argv)
    if key in _CHECKED:
        return _CHECKED[key]
    assert argv, f"{command.id}: `draftsmith` alone"
    if argv in (["--help"], ["-h"], ["--version"], ["-V"]):  # the command's own usage and version (trainer/cli.py)
        return None
    sub, rest = argv[0], argv[1:]
    known = (*TRAINING, *TOOLS)
    assert sub in known, f"{command.id}: draftsmith has no subcommand {sub!r} (it has {', '.join(known)})"
    if sub in TRAINING:
        skipped = parse_training(sub, rest)
    else:
        namespace = parse_tool(sub, [fill(t) for t in rest])
        check_recipes(sub, namespace)
        skipped = None
    _CHECKED[key] = skipped
    return skipped


def names_only(command: Command) -> bool:
    """An inline mention of a subcommand (``draftsmith eval``, ``draftsmith slurm submit``): no flag, no value."""
    return not any(t.startswith("-") for t in argv_of(command)) and len(argv_of(command)) <= 2


ALL_COMMANDS = [c for path in DOCS for c in commands(path)]


# ---- the tests ---------------------------------------------------------------------------------------------------


def test_the_docs_are_found() -> None:
    assert README in DOCS and len(DOCS) > 10, DOCS
    assert ALL_COMMANDS, "no draftsmith command line found in the docs"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:...
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
            continue
        if REPO not in destination.parents and destination != REPO:
            problems.append(f"{where}: outside the repository")
            continue
        if anchor:
            if destination.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(destination):
                problems.append(f"{where}: no heading #{anchor} in {destination.relative_to(REPO)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=lambda c: c.id)
def test_every_draftsmith_command_line_parses(command: Command, monkeypatch) -> None:
    monkeypatch.chdir(REPO)  # the commands name paths relative to the repository
    if names_only(command):
        argv = argv_of(command)
        assert argv[0] in (*TRAINING, *TOOLS), f"{command.id}: draftsmith has no subcommand {argv[0]!r}"
        return
    skipped = check_command(command)
    if skipped:
        pytest.skip(f"{command.id}: {skipped}")


def test_the_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; the rest belongs in docs/ (at most {README_MAX_LINES})"
    )


# ---- the checker's own rules -------------------------------------------------------------------------------------


def test_slugs_follow_githubs_rule() -> None:
    assert slug("What `--drafter` takes") == "what---drafter-takes"
    assert slug("Recipe keys (`model.init_args`)") == "recipe-keys-modelinit_args"
    assert slug("EAGLE-3 training-time test") == "eagle-3-training-time-test"


def test_placeholders_are_filled_and_a_placeholder_recipe_is_skipped() -> None:
    assert [fill(t) for t in ["--output_dir", "DIR", "<dir>", "$OUT/x", "${RUN}", "80GB", "recipes/x.yaml"]] == [
        "--output_dir", "1", "1", "1/x", "1", "80GB", "recipes/x.yaml",
    ]  # fmt: skip
    assert parse_training("fit", ["--config", "RECIPE", "--trainer.max_steps", "N"]) is not None


def test_a_bad_command_line_is_caught() -> None:
    with pytest.raises(AssertionError, match="refuses"):
        parse_tool("export", ["--ckpt_path", "x.ckpt"])  # --output_dir is required
    with pytest.raises(AssertionError, match="no subcommand"):
        check_command(Command("x.md", 1, "draftsmith frobnicate --x 1"))


def test_tools_stop_after_parsing() -> None:
    """The interception works for argparse and jsonargparse tools alike: nothing runs after the parse."""
    assert parse_tool("demo", ["--compare"]).compare is True  # the demo would train for minutes
    assert (
        parse_tool("generate", ["--target", "t", "--input_file", "i.jsonl", "--output_file", "o.jsonl"]).target == "t"
    )
    assert parse_tool("slurm", ["submit", "--config", "r.yaml", "--dry_run", "--", "--x", "1"]).fit_args == ["--x", "1"]


def test_the_export_table_and_the_objectives_table_list_every_method():
    """docs/guides/checkpoints-and-resume.md's table lists every registered kind with its formats in order, and
    docs/guides/recipes.md's objectives table every objective class a method folder defines (both missed the
    DFlash refiners and P-EAGLE once)."""
    import importlib
    import inspect
    import pkgutil

    import lightning.pytorch as pl

    import trainer.methods
    from trainer.training.registry import kinds

    root = Path(__file__).resolve().parents[2]
    table = (root / "docs/guides/checkpoints-and-resume.md").read_text()
    listed = {
        m[1]: re.findall(r"`([\w-]+)`", m[2])
        for m in re.finditer(r"^\| `(\w+)`[^|]*\| ([^|]+) \|", table, flags=re.MULTILINE)
    }
    assert listed == {k.name: [f.name for f in k.formats] for k in kinds().values()}
    recipes = (root / "docs/guides/recipes.md").read_text()
    documented = set(re.findall(r"^\|[^|]+\| `(trainer\.methods\.[\w.]+)` \|", recipes, flags=re.MULTILINE))
    defined = set()
    for info in pkgutil.iter_modules(trainer.methods.__path__):
        for name in ("objective", "kd", "on_policy", "pretrain"):  # the modules that hold a method's objectives
            try:
                module = importlib.import_module(f"trainer.methods.{info.name}.{name}")
            except ModuleNotFoundError:
                continue
            for cls_name, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, pl.LightningModule) and cls.__module__ == module.__name__:
                    defined.add(f"{cls.__module__}.{cls_name}")
    assert defined <= documented, sorted(defined - documented)
