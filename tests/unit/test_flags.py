"""Flags are spelled one way in every subcommand (underscores, as fit, generate and precompute spell theirs), and a
flag spelled with dashes is refused in one line that names the right one."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from trainer.cli import TOOLS
from trainer.interface.flags import ToolParser, option_strings, respelled

# the argparse tools, each with a build_parser(); generate and precompute are jsonargparse (their parameter names)
ARGPARSE_TOOLS = ("eval", "export", "plan", "slurm", "compare", "prepare", "demo")
JSONARGPARSE_TOOLS = ("generate", "precompute")


def parser_of(tool: str) -> ToolParser:
    module = importlib.import_module(TOOLS[tool][0].split(":")[0])
    return module.build_parser()


def test_every_tool_is_checked() -> None:
    assert set(TOOLS) == set(ARGPARSE_TOOLS) | set(JSONARGPARSE_TOOLS)


@pytest.mark.parametrize("tool", ARGPARSE_TOOLS)
def test_every_flag_of_every_tool_is_spelled_with_underscores(tool: str) -> None:
    parser = parser_of(tool)
    assert isinstance(parser, ToolParser)
    flags = option_strings(parser)
    assert "--help" in flags and len(flags) > 2
    assert [f for f in flags if "-" in f[2:]] == []


def test_precompute_flags_are_its_parameter_names() -> None:
    flags = [f for action in parser_of("precompute")._actions for f in action.option_strings if f.startswith("--")]
    assert flags and [f for f in flags if "-" in f[2:]] == []


@pytest.mark.parametrize(
    "tool, argv, old, new",
    [
        ("eval", ["--max-new-tokens", "8"], "--max-new-tokens", "--max_new_tokens"),
        ("eval", ["--target", "t", "--tree-nodes=16"], "--tree-nodes", "--tree_nodes"),
        ("plan", ["--gpu-memory", "80GB"], "--gpu-memory", "--gpu_memory"),
        ("slurm", ["submit", "--config", "r.yaml", "--dry-run"], "--dry-run", "--dry_run"),
        ("prepare", ["--output_dir", "x", "--vocab-size", "300"], "--vocab-size", "--vocab_size"),
        ("demo", ["--kd-steps", "3"], "--kd-steps", "--kd_steps"),
    ],
)
def test_a_dashed_flag_is_refused_naming_the_new_spelling(tool, argv, old, new, capsys) -> None:
    module = importlib.import_module(TOOLS[tool][0].split(":")[0])
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    prog = "draftsmith slurm submit" if tool == "slurm" else f"draftsmith {tool}"
    assert capsys.readouterr().err == f"{prog}: {old} is spelled {new}\n"


def test_fit_arguments_after_the_separator_are_not_checked(capsys) -> None:
    parser = ToolParser(prog="draftsmith x")
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--dry_run", "--", "--dry-run"])
    assert args.dry_run and args.rest == ["--dry-run"]
    with pytest.raises(SystemExit):  # an unknown dashed flag is argparse's own error
        parser.parse_args(["--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_respelled() -> None:
    assert respelled("--max-new-tokens=8") == "--max_new_tokens"
    assert respelled("--max_new_tokens") is None and respelled("-k") is None and respelled("a-b") is None


def test_the_command_refuses_a_dashed_flag_in_one_line_without_a_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "eval", "--target", "t", "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "draftsmith eval: --max-new-tokens is spelled --max_new_tokens"
    assert "Traceback" not in result.stderr


# ---- one vocabulary ------------------------------------------------------------------------------------------------

VOCABULARY: dict[str, str] = {
    # what every command may share: one name each
    "--help": "show the command's help",
    "--config": "a YAML file of the command's options or recipe",
    "--print_config": "print the parsed configuration",
    "--target": "the target model: a folder or a hub id (plan: also a built-in shape)",
    "--target_dtype": "the target's weights dtype",
    "--output_dir": "the folder a command writes",
    "--output_file": "the file a command writes",
    "--input_file": "the file a command reads its records from",
    "--ckpt_path": "a training checkpoint to read",
    "--drafter": "the drafter measured: a checkpoint, an export or a proposer name",
    "--prompts": "a file of prompts",
    "--max_prompts": "how many prompts are used",
    "--max_new_tokens": "output tokens per prompt",
    "--temperature": "the temperature of the target's distribution",
    "--seed": "the random seed",
    "--device": "the torch device",
    "--batch_size": "sequences per forward",
    "--progress": "show progress",
    "--trust_remote_code": "allow a model folder's own code",
    # eval
    "--accept_threshold": "draft length by predicted acceptance",
    "--allow_other_target": "measure a checkpoint against another target",
    "--context_lengths": "measure by context length",
    "--exit_layer": "the layer a self-speculative drafter exits at",
    "--heldout": "held-out text for the loss of a changed target",
    "--heldout_tokens": "tokens scored per held-out document",
    "--k": "drafts per round",
    "--original_target": "the model a changed target was fine-tuned from",
    "--prompt_tokens": "the cut of every prompt",
    "--rank_temperature": "the temperature ranking a tree's candidates",
    "--repeats": "passes of the speed measurement",
    "--tree": "draft a tree",
    "--tree_choices": "a fixed tree's paths",
    "--tree_nodes": "nodes of a draft tree",
    "--tree_top_k": "candidates per tree node",
    "--write_tree": "write the best tree of parallel heads",
    # export
    "--format": "the export format",
    # prepare
    "--heldout_fraction": "share of the corpus held out",
    "--heldout_prompts": "held-out prompts written",
    "--include_tests": "keep the standard library's tests in the corpus",
    "--max_files": "files of the corpus",
    "--overwrite": "rebuild existing output",
    "--prompt_chars": "characters of a training prompt",
    "--prompts_per_file": "training prompts cut from each file",
    "--vocab_size": "the tokenizer's vocabulary",
    # demo
    "--compare": "run the comparison after the demo",
    "--fresh": "start the demo over",
    "--kd_steps": "steps of the KD student",
    "--readme": "write the demo's block into a README",
    "--target_steps": "steps of the tiny target",
    # compare
    "--only": "the methods to run",
    "--stability": "a second seed's comparison",
    "--threads": "threads of every stage",
    # precompute
    "--data": "the recipe's datamodule",
    "--data.help": "the datamodule's help",
    "--hidden_dtype": "storage dtype of hidden states",
    "--hidden_layers": "hidden-state layers stored",
    "--logprob_dtype": "storage dtype of log-probabilities",
    "--samples_per_shard": "sequences per shard",
    "--splits": "the splits written",
    "--top_logprobs": "log-probabilities kept per position",
    # generate
    "--allow_model_mismatch": "accept a served model of another name",
    "--api_key_env": "the variable holding the server's key",
    "--chunk_size": "records written at a time",
    "--concurrency": "requests in flight",
    "--max_records": "records regenerated",
    "--messages_field": "the key of a record's messages",
    "--prompt_field": "the key of a record's plain prompt",
    "--retries": "tries of a request",
    "--retry_wait": "seconds before a retry",
    "--server": "the serving engine's URL",
    "--served_model_name": "the served model's name",
    "--timeout": "seconds a request may take",
    "--top_k": "sampling among the k most likely tokens",
    "--top_p": "nucleus sampling",
    # plan
    "--cpu": "plan CPU processes",
    "--gpu_memory": "memory of one GPU",
    "--gpus": "GPUs of the data-parallel world",
    "--precision": "the trainer's precision",
    "--reserve": "memory kept free",
    "--seq_len": "tokens per row",
    "--sequence_parallel": "ranks sharing a row",
    # slurm submit
    "--account": "the SLURM account",
    "--cpus_per_task": "CPUs per process",
    "--dry_run": "print the script instead of submitting it",
    "--gpus_per_node": "GPUs per node",
    "--job_name": "the job's name",
    "--max_failed_requeues": "requeues without progress",
    "--nodes": "nodes of the allocation",
    "--partition": "the SLURM partition",
    "--python": "the python of the compute nodes",
    "--sbatch": "an extra sbatch option",
    "--signal_lead": "seconds between USR1 and the time limit",
    "--tasks_per_node": "processes per node",
    "--template": "the sbatch template",
    "--time": "the job's time limit",
    "--workdir": "the folder the job runs in",
}
"""Every flag of every command and what it means: a new flag is declared here, a name already here means the same."""

JSONARGPARSE_FUNCTIONS = {"generate": "regenerate", "precompute": "precompute"}


def command_flags() -> dict[str, dict[str, tuple[str, str]]]:
    """tool -> flag -> (kind: switch or value, value type) read from each command's parser (generate and precompute:
    the signature of the function their parser is built from)."""
    import inspect
    import typing

    from trainer.interface.flags import _Switch

    out: dict[str, dict[str, tuple[str, str]]] = {}
    for tool in ARGPARSE_TOOLS:
        flags = {}
        parsers = [parser_of(tool)]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parsers += list(dict.fromkeys(action.choices.values()))
                for flag in action.option_strings:
                    if flag.startswith("--"):
                        kind = "switch" if isinstance(action, _Switch) else "value"
                        flags[flag] = (kind, getattr(action.type, "__name__", "str") if action.type else "str")
        out[tool] = flags
    for tool, function in JSONARGPARSE_FUNCTIONS.items():
        module = importlib.import_module(TOOLS[tool][0].split(":")[0])
        parser = module.build_parser()
        hints = typing.get_type_hints(getattr(module, function))
        flags = {}
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and not flag.endswith("+"):
                    hint = hints.get(flag[2:])
                    kind = "switch" if hint is bool else "value"
                    flags[flag] = (kind, getattr(hint, "__name__", "str") if hint in (int, float, str) else "str")
        signature = inspect.signature(getattr(module, function))
        assert {f"--{name}" for name in signature.parameters} <= set(flags), tool
        out[tool] = flags
    return out


def test_every_flag_of_every_command_is_in_the_vocabulary_and_nothing_else_is() -> None:
    flags = command_flags()
    used = {flag for tool in flags.values() for flag in tool}
    assert sorted(used - set(VOCABULARY)) == [], "declare what each new flag means in VOCABULARY (or reuse a name)"
    assert sorted(set(VOCABULARY) - used) == [], "VOCABULARY lists flags no command has"


def test_no_meaning_has_two_names() -> None:
    meanings = list(VOCABULARY.values())
    assert sorted(m for m in set(meanings) if meanings.count(m) > 1) == []


def test_a_name_means_one_thing_in_every_command() -> None:
    """A flag shared by several commands is a switch in all or in none, and takes the same type of value."""
    seen: dict[str, dict[tuple[str, str], list[str]]] = {}
    for tool, flags in command_flags().items():
        for flag, kind in flags.items():
            seen.setdefault(flag, {}).setdefault(kind, []).append(tool)
    assert {flag: kinds for flag, kinds in seen.items() if len(kinds) > 1} == {}


def test_a_renamed_flag_is_no_longer_a_flag_of_its_command() -> None:
    from trainer.interface.flags import RENAMED_FLAGS

    flags = command_flags()
    by_prog = {f"draftsmith {tool}": tool for tool in flags} | {"draftsmith slurm submit": "slurm"}
    for prog, renamed in RENAMED_FLAGS.items():
        tool_flags = flags[by_prog[prog]]
        assert [old for old in renamed if old in tool_flags] == [], prog
        assert all(new in tool_flags for new in renamed.values()), prog


RENAMED_CASES = [
    ("prepare", ["--out", "x"], "draftsmith prepare: --out is now --output_dir"),
    ("eval", ["--target", "t", "--dtype", "float32"], "draftsmith eval: --dtype is now --target_dtype"),
    ("eval", ["--out", "x"], "draftsmith eval: --out is now --output_dir"),
    ("compare", ["--config", "c.yaml", "--out", "x"], "draftsmith compare: --out is now --output_dir"),
    ("export", ["--ckpt", "x.ckpt"], "draftsmith export: --ckpt is now --ckpt_path"),
    ("plan", ["--config", "r.yaml", "--target_config", "x"], "draftsmith plan: --target_config is now --target"),
    ("demo", ["--prompts", "3"], "draftsmith demo: --prompts is now --max_prompts"),
    ("slurm", ["submit", "--log_dir", "x"], "draftsmith slurm submit: --log_dir is now --output_dir"),
    ("generate", ["--target", "t", "--input", "i.jsonl"], "draftsmith generate: --input is now --input_file"),
    ("generate", ["--output=o.jsonl"], "draftsmith generate: --output is now --output_file"),
    ("generate", ["--model", "m"], "draftsmith generate: --model is now --served_model_name"),
    ("precompute", ["--out", "x"], "draftsmith precompute: --out is now --output_dir"),
]  # fmt: skip


@pytest.mark.parametrize("tool, argv, message", RENAMED_CASES, ids=[" ".join(c[1][:3]) for c in RENAMED_CASES])
def test_an_old_spelling_is_refused_in_one_line_naming_the_new_one(tool, argv, message, capsys) -> None:
    module = importlib.import_module(TOOLS[tool][0].split(":")[0])
    try:
        status = module.main(argv)
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    assert capsys.readouterr().err == message + "\n"


@pytest.mark.parametrize("tool", ARGPARSE_TOOLS)
def test_every_switch_takes_true_or_false_and_alone_means_true(tool) -> None:
    """Each switch as argparse calls it: alone (its const), with true/false in any case, and off by default; any
    other word is refused naming the flag."""
    from trainer.interface.flags import _Switch

    parser = parser_of(tool)
    parsers = [
        parser,
        *[p for a in parser._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()],
    ]
    switches = [(p, a) for p in parsers for a in p._actions if isinstance(a, _Switch)]
    assert switches or tool in ("export", "compare"), tool
    for owner, action in switches:
        got = []
        for value in (action.const, "true", "false", "False", "YES", "0"):
            namespace = argparse.Namespace()
            action(owner, namespace, value, action.option_strings[0])
            got.append(getattr(namespace, action.dest))
        assert got == [True, True, False, False, True, False] and action.default is False, action.option_strings
        with pytest.raises(SystemExit):
            action(owner, argparse.Namespace(), "maybe", action.option_strings[0])


def test_a_switch_parses_alone_and_with_a_value_on_the_command_line() -> None:
    parser = parser_of("eval")
    required = ["--target", "t", "--drafter", "d", "--prompts", "p", "--output_dir", "o"]
    assert parser.parse_args([*required, "--tree"]).tree is True
    assert parser.parse_args([*required, "--tree", "false", "--k", "2"]).tree is False
    assert parser.parse_args([*required, "--tree", "--k", "2"]).tree is True
    assert parser.parse_args(required).tree is False


@pytest.mark.parametrize("tool", list(JSONARGPARSE_FUNCTIONS))
def test_a_jsonargparse_commands_switch_alone_means_true(tool) -> None:
    from trainer.interface.flags import switches_of, with_bare_switches

    module = importlib.import_module(TOOLS[tool][0].split(":")[0])
    switches = switches_of(getattr(module, JSONARGPARSE_FUNCTIONS[tool]))
    assert {"--trust_remote_code", "--progress"} <= set(switches)
    assert ("--allow_model_mismatch" in switches) == (tool == "generate")
    flags = command_flags()[tool]
    for switch in switches:
        assert flags[switch][0] == "switch"
        assert with_bare_switches([switch, "--seed", "1"], switches) == [switch, "true", "--seed", "1"]
        assert with_bare_switches(["--seed", "1", switch], switches) == ["--seed", "1", switch, "true"]
        assert with_bare_switches([switch, "false"], switches) == [switch, "false"]
    assert sorted(switches) == sorted(f for f, (kind, _) in flags.items() if kind == "switch")


def test_compare_refuses_a_second_config(capsys) -> None:
    from trainer.compare.run import main

    with pytest.raises(SystemExit) as exit_:
        main(["--config", "a.yaml", "--config", "b.yaml"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "draftsmith compare: one --config (a compare recipe), got a.yaml and b.yaml\n"
