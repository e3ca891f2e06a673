"""``draftsmith compare``: the recipe schema's errors, budgets, training prompts, footprints and the report."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from tests.helpers import tiny_llama
from trainer.compare.config import Budget, CompareConfigError, read_config
from trainer.compare.fit_logs import steps_for_budget, tokens_at
from trainer.compare.footprint import footprint
from trainer.compare.report import METRICS, metric, ordering_flips, write_report
from trainer.compare.run import Comparison, training_prompts
from trainer.decoding.eval_cli import build_parser as eval_parser
from trainer.decoding.options import ProposerOptions, options_from_arguments
from trainer.training.recipe import parse_recipe

ROOT = Path(__file__).resolve().parents[2]
KD = str(ROOT / "recipes" / "quickstart" / "kd.yaml")


def write_recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "compare.yaml"
    path.write_text(text)
    return str(path)


BASE = f"""
target: t
evaluation: {{prompts: p.jsonl}}
budget: {{steps: 100}}
methods:
  - name: lookup
    drafter: prompt-lookup
  - name: kd
    recipe: {KD}
    fit_args: ["--model.init_args.export_dir={{run}}/student"]
"""


@pytest.mark.parametrize("name, methods", [("tiny", 16), ("llama31_8b", 8)])
def test_the_compare_recipes_read_with_every_fit_argument_known(name, methods):
    path = str(ROOT / "recipes" / "compare" / f"{name}.yaml")
    config = read_config(path)
    assert len(config.methods) == methods and config.methods[0].drafter == "prompt-lookup"
    Comparison(config, path).check_methods()  # fit's own parser: every key of every method exists
    overridden = read_config(path, {"output_dir": "elsewhere", "seed": 3, "threads": 1})  # the flags
    assert (overridden.output_dir, overridden.seed, overridden.threads) == ("elsewhere", 3, 1)
    # the seed reaches every fit: Lightning's, the objective's initialisation and the data order
    fit = parse_recipe([overridden.methods[1].recipe], Comparison(overridden, path).fit_args(overridden.methods[1]))
    assert fit.seed_everything == fit.model.init_args.seed == fit.data.init_args.seed == 3


def test_a_misspelled_fit_argument_names_the_method(tmp_path):
    config = read_config(write_recipe(tmp_path, BASE.replace("export_dir=", "exportdir=")))
    with pytest.raises(CompareConfigError, match=r"(?s)methods\[1\] \('kd'\).*exportdir"):
        Comparison(config, "compare.yaml").check_methods()


@pytest.mark.parametrize(
    "change, message",
    [
        (("recipe:", "recpe:"), "recpe"),  # a misspelled key is named
        (("name: kd", "name: lookup"), "a second method of this name"),
        (("name: kd", "name: k/d"), "name must be letters"),
        (("{run}/student", "{runs}/student"), "['runs']"),
        (("drafter: prompt-lookup", "drafter: some/folder"), "must name a drafter without weights"),
        (("kd.yaml", "kd_missing.yaml"), "not found"),
        (("drafter: prompt-lookup", 'drafter: prompt-lookup\n    eval_args: ["--tree"]'), "eval_args"),  # options now
        (("drafter: prompt-lookup", "drafter: prompt-lookup\n    options: {tree_node: 8}"), "tree_node"),
        (("drafter: prompt-lookup", "drafter: prompt-lookup\n    options: {tree_nodes: 0}"), "tree_nodes >= 1"),
        (("{prompts: p.jsonl}", "{prompts: p.jsonl, context_lengths: [16]}"), "needs long documents"),
        (("{prompts: p.jsonl}", "{prompts: p.jsonl, heldout: h.jsonl, context_lengths: [16, 0]}"), "integers >= 1"),
        (
            ("{prompts: p.jsonl}", "{prompts: p.jsonl, heldout: h.jsonl, context_lengths: [16], context_prompts: 0}"),
            "context_prompts must be >= 1",
        ),  # fmt: skip
    ],
)
def test_a_bad_recipe_is_refused_naming_the_key(tmp_path, change, message):
    with pytest.raises(CompareConfigError, match=None) as err:
        read_config(write_recipe(tmp_path, BASE.replace(*change)))
    assert message in str(err.value) and "compare.yaml" in str(err.value)


@pytest.mark.parametrize(
    "budget, message",
    [
        ("{steps: 3, tokens: 9}", "give exactly one of steps, tokens or seconds, got {'steps': 3, 'tokens': 9}"),
        ("{}", "give exactly one of steps, tokens or seconds, got none"),
        ("{seconds: 0}", "seconds must be >= 1"),
    ],
)
def test_a_budget_is_exactly_one_positive_length(tmp_path, budget, message):
    with pytest.raises(CompareConfigError) as err:
        read_config(write_recipe(tmp_path, BASE.replace("budget: {steps: 100}", f"budget: {budget}")))
    assert f"compare.yaml: budget: {message}" in str(err.value)
    with pytest.raises(CompareConfigError) as err:
        read_config(write_recipe(tmp_path, BASE + f"    budget: {budget}\n"))
    assert f"compare.yaml: methods[1] ('kd'): budget: {message}" in str(err.value)


def test_a_token_budget_becomes_steps_of_the_recipes_batch():
    # kd.yaml: batch 8 x 256 tokens; accumulation and devices multiply the tokens of a step
    assert steps_for_budget(Budget(tokens=8 * 256 * 10), KD, []) == 10
    assert steps_for_budget(Budget(tokens=8 * 256 * 10 + 1), KD, []) == 11
    assert steps_for_budget(Budget(tokens=8 * 256 * 10), KD, ["--trainer.accumulate_grad_batches", "2"]) == 5
    assert steps_for_budget(Budget(steps=7), KD, []) == 7
    assert steps_for_budget(Budget(seconds=60), KD, []) is None


def test_tokens_between_logged_steps_are_interpolated():
    tokens = {10: 1000.0, 20: 2000.0}
    assert tokens_at(tokens, 15) == 1500.0 and tokens_at(tokens, 20) == 2000.0
    assert tokens_at(tokens, 5) == 500.0 and tokens_at(tokens, 30) == 3000.0 and tokens_at({}, 3) is None


def test_training_prompts_are_cut_from_every_document(tmp_path):
    docs = tmp_path / "docs.jsonl"
    texts = ["a" * 50 + "\n" + "b" * 300, "short doc", "   "]
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "prompts.jsonl"
    assert training_prompts(docs, out, chars=40, per_document=2, seed=0) == 3
    prompts = sorted(json.loads(line)["prompt"] for line in out.read_text().splitlines())
    assert prompts == sorted(["a" * 40, "b" * 40, "short doc"])
    docs.write_text('{"txt": "x"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl:1: expected a JSON object with a 'text'"):
        training_prompts(docs, out, chars=40, per_document=2, seed=0)


def test_footprint_counts_what_the_target_does_not_hold(tmp_path):
    import torch

    target, other = tmp_path / "target", tmp_path / "other"
    reference = tiny_llama(0, dtype=torch.float32)
    reference.save_pretrained(target)
    student = tiny_llama(1, layers=1, dtype=torch.float32)
    with torch.no_grad():
        for tensor in student.parameters():  # nothing left equal to the target's (norms start at ones in both)
            tensor.add_(torch.rand_like(tensor))
    student.save_pretrained(other)
    itself = footprint(str(target), str(target))  # a self-speculative drafter adds nothing
    assert itself["parameters"] == reference.num_parameters()
    assert itself["extra_parameters"] == 0 and itself["extra_bytes"] == 0
    separate = footprint(str(other), str(target))
    assert separate["extra_parameters"] == separate["parameters"] == student.num_parameters()
    assert separate["extra_bytes"] == 4 * student.num_parameters() and "hf" in separate["formats"]
    with torch.no_grad():  # a drafter sharing the target's embedding: the engine serves it once
        student.model.embed_tokens.weight.copy_(reference.model.embed_tokens.weight)
    student.save_pretrained(other)
    shared = footprint(str(other), str(target))
    assert shared["extra_parameters"] == student.num_parameters() - student.model.embed_tokens.weight.numel()
    assert footprint("prompt-lookup", str(target))["extra_bytes"] == 0


def _eval_report(taus: dict[int, float], speedups: dict[int, float]) -> dict:
    entry = {
        "tau_in_loops": 2.0, "tau_outside_loops": 1.0, "draft_cost": 0.1, "draft_cost_per_round": 0.4,
        "projected_speedup": 1.5,
        "measured_speedup_quartiles": [0.9, 1.1],
    }  # fmt: skip
    greedy = [
        {**entry, "k": k, "tau": tau, "measured_speedup": speedups[k], "acceptance_per_position": [0.5] * k}
        for k, tau in taus.items()
    ]
    sampling = [{"k": k, "tau": tau / 2, "acceptance_per_position": [0.2] * k} for k, tau in taus.items()]
    return {"greedy": greedy, "sampling": sampling, "loops": {"share": 0.5}}


def test_report_rows_tables_plots_and_failures(tmp_path):
    config = read_config(write_recipe(tmp_path, BASE + f"output_dir: {tmp_path / 'out'}\n"))
    out = tmp_path / "out"
    lookup, kd = out / "methods" / "lookup", out / "methods" / "kd"
    (lookup / "eval").mkdir(parents=True)
    (lookup / "eval" / "report.json").write_text(json.dumps(_eval_report({2: 1.5, 4: 1.8}, {2: 1.05, 4: 1.0})))
    (lookup / "footprint.json").write_text(json.dumps(footprint("prompt-lookup", "unused")))
    kd.mkdir(parents=True)
    (kd / "failed.json").write_text(json.dumps({"stage": "fit", "error": "exited with status 1", "tail": "boom"}))
    paths = write_report(config, out)
    assert {p.name for p in paths} == {"report.json", "report.md", "tau_vs_cost.png", "acceptance.png",
                                       "tau_vs_tokens.png", "speedup.png"}  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    row, failed = report["rows"]
    assert row["status"] == "done" and row["largest_k"]["k"] == 4 and row["best_k"]["k"] == 2
    assert row["stage_seconds"] == {} and "training" not in row
    assert row["per_k"][1]["tau_sampling"] == 0.9 and row["extra_mib"] == 0
    assert failed["status"] == "failed" and failed["failure"]["stage"] == "fit"
    markdown = (out / "report.md").read_text()
    assert (
        "| lookup | 4 | 1.80 | 0.90 |" in markdown
        and "| 0.100 / 0.40 |" in markdown
        and "| kd | failed at fit: exited with status 1 |" in markdown
    )
    assert report["machine"]["summary"] in markdown and "100 optimizer steps" in markdown
    assert "By context length" not in markdown and not (out / "tau_by_context.png").exists()  # not asked for
    # against another run (here: itself) the report counts flipped orderings; a folder without a report is an error
    write_report(config, out, stability=out)
    stability = json.loads((out / "report.json").read_text())["stability"]
    assert stability["flips"]["tau_greedy"] == {"pairs": 0, "flips": 0, "flipped": []}
    assert "pairwise orderings flip" in (out / "report.md").read_text()
    with pytest.raises(FileNotFoundError, match="no report.json"):
        write_report(config, out, stability=tmp_path / "elsewhere")


def test_ordering_flips_match_a_pairwise_count():
    def rows(values):
        return [
            {"method": name, "status": "done", "largest_k": {"tau_greedy": v, "tau_sampling": v},
             "best_k": {"measured_speedup": v}}
            for name, v in values.items()
        ]  # fmt: skip

    a = {"x": 1.0, "y": 2.0, "z": 3.0, "w": 2.5}
    b = {"x": 2.1, "y": 2.0, "z": 3.0, "w": 1.0}
    flips = ordering_flips(rows(a), rows(b))
    expected = [
        sorted(p) for p in itertools.combinations(a, 2) if (a[p[0]] - a[p[1]]) * (b[p[0]] - b[p[1]]) < 0
    ]  # fmt: skip
    for name in METRICS:
        assert flips[name]["pairs"] == 6
        assert sorted(sorted(p) for p in flips[name]["flipped"]) == sorted(expected)
        assert flips[name]["flips"] == len(expected) == 3  # x-y, x-w, y-w
    # a method measured in one run only, or failed, is in no pair
    failed = rows(b)[:3] + [{"method": "w", "status": "failed"}]
    assert ordering_flips(rows(a), failed)["tau_greedy"]["pairs"] == 3
    assert metric({"status": "failed"}, "tau_greedy") is None and not math.isnan(metric(rows(a)[0], "tau_greedy"))


def test_placeholders_fill_named_braces_only():
    from trainer.compare.config import fill_placeholders

    values = {"run": "out/methods/kd/run", "target": "t"}
    text = '--model.init_args.drafter_config={"hidden_size": 32} --x={run}/student --y={target}'
    assert fill_placeholders(text, values) == (
        '--model.init_args.drafter_config={"hidden_size": 32} --x=out/methods/kd/run/student --y=t'
    )


def test_a_methods_drafting_options_reach_eval_and_the_training_callback_as_data(tmp_path, monkeypatch):
    """``options`` of a method: eval's flags (read back by eval's own parser) and the callback's ``options`` argument
    (read by fit's own parser) give the same ProposerOptions; a tree file is written for ``tree_choices``."""
    text = BASE + "    options: {tree: true, tree_nodes: 16, tree_choices: [[0], [0, 0], [1]]}\n"
    config = read_config(write_recipe(tmp_path, text))
    method = config.methods[1]
    expected = ProposerOptions(tree=True, tree_nodes=16, tree_choices=((0,), (0, 0), (1,)))
    assert method.options == expected and config.methods[0].options == ProposerOptions()
    comparison = Comparison(config, "compare.yaml")
    comparison.out = tmp_path / "out"
    stages: dict[str, list[str]] = {}

    class Stop(Exception):
        pass

    def run_stage(stage: str, args: list[str], log: Path) -> None:
        stages[stage] = args
        if stage == "fit":
            raise Stop  # before the fit's logs are read

    monkeypatch.setattr(comparison, "_run_stage", run_stage)
    comparison.evaluate(method, comparison.folder(method))
    assert stages["eval"][0] == "eval"
    assert options_from_arguments(eval_parser().parse_args(stages["eval"][1:])) == [expected]
    assert (comparison.folder(method).root / "tree_choices.json").is_file()
    with pytest.raises(Stop):
        comparison.fit(method, comparison.folder(method))
    args = stages["fit"]
    callbacks = json.loads(args[args.index("--trainer.callbacks") + 1])
    fit = parse_recipe([method.recipe], ["--trainer.callbacks", json.dumps(callbacks)])
    (spec,) = [c for c in fit.trainer.callbacks if c.class_path.endswith("SpeculativeEvalCallback")]
    assert ProposerOptions(**vars(spec.init_args.options)) == expected


def test_a_changed_target_is_evaluated_and_reported_beside_the_recipes_target(tmp_path, monkeypatch):
    """A method whose eval target is not the recipe's: eval gets ``--original_target`` the recipe's target (read back
    by eval's own parser), and the row gives the loop share and held-out loss as ``original -> changed``."""
    text = BASE.replace("target: t", f"target: t\noutput_dir: {tmp_path / 'out'}") + '    eval_target: "{export}"\n'
    text = text.replace(
        "evaluation: {prompts: p.jsonl}", "evaluation: {prompts: p.jsonl, heldout: h.jsonl, heldout_tokens: 128}"
    )
    config = read_config(write_recipe(tmp_path, text))
    comparison = Comparison(config, "compare.yaml")
    stages: dict[str, list[str]] = {}
    monkeypatch.setattr(comparison, "_run_stage", lambda stage, args, log: stages.setdefault(stage, args))
    for method in config.methods:
        stages.clear()
        comparison.evaluate(method, comparison.folder(method))
        parsed = eval_parser().parse_args(stages["eval"][1:])
        changed = method.name == "kd"
        assert (parsed.original_target, parsed.heldout) == (("t", "h.jsonl") if changed else (None, None))
        assert parsed.heldout_tokens == (128 if changed else 0)
    kd = tmp_path / "out" / "methods" / "kd"
    (kd / "eval").mkdir(parents=True)
    report = _eval_report({2: 1.5}, {2: 1.1})
    report["original_target"] = {
        "original_path": "t", "tokens": 40, "original": {"heldout_loss": 3.5, "loop_share": 0.3},
        "target": {"heldout_loss": 3.75, "loop_share": 0.5},
    }  # fmt: skip
    (kd / "eval" / "report.json").write_text(json.dumps(report))
    write_report(config, tmp_path / "out")
    rows = {row["method"]: row for row in json.loads((tmp_path / "out" / "report.json").read_text())["rows"]}
    assert rows["kd"]["target_changed"] and rows["kd"]["original_loop_share"] == 0.3
    assert rows["kd"]["heldout_loss"] == 3.75 and rows["kd"]["original_heldout_loss"] == 3.5
    assert "original_loop_share" not in rows["lookup"]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| 30% -> 50% | yes | 3.500 -> 3.750 |" in markdown
    assert "on the first 128 tokens of each document of h.jsonl" in markdown


def test_every_method_of_a_thirteen_method_comparison_gets_its_own_color():
    from trainer.compare.plots import method_colors

    names = [f"method-{i}" for i in range(13)]  # tab10 alone gave the 11th method the first one's color
    assert len(set(method_colors(names).values())) == 13
    assert len(set(method_colors(names[:4]).values())) == 4


CONTEXT_WORDS = "the cat sat on the mat and the dog sat on the log a b c d e f g h i j k l m n o p def f(x): return x"


@pytest.fixture(scope="module")
def context_models(tmp_path_factory):
    """A float32 target (256 positions), a draft model, the target with 40 positions, a BPE tokenizer beside each,
    short prompts and a file of documents from shorter than every context length to longer than all."""
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("compare_context")
    words = CONTEXT_WORDS.split()
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator([CONTEXT_WORDS] * 4, trainers.BpeTrainer(vocab_size=110, special_tokens=["<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    for name, seed, positions in (("target", 0, 256), ("draft", 1, 256), ("short", 0, 40)):
        model = tiny_llama(seed, len(tokenizer), dtype=torch.float32, eos_token_id=None)
        model.config.max_position_embeddings = positions
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rng = random.Random(0)
    documents = [" ".join(rng.choice(words) for _ in range(n)) for n in (10, 30, 60, 90, 140, 200)]
    (root / "documents.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": d[:40]}) + "\n" for d in documents))
    return root


def _in_process(self: Comparison, args: list[str], output) -> int:
    """A stage as ``draftsmith ARGS`` in this process, its output in the stage's log."""
    import contextlib

    from trainer.cli import main as draftsmith

    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        return draftsmith(args)


def test_compare_by_context_length_reports_each_methods_eval_by_context(context_models, tmp_path, monkeypatch):
    """``evaluation.context_lengths``: every method gets a second eval with ``--context_lengths`` on the documents,
    the report's table and plot hold exactly its by_context figures at the largest K (kept: longest over shortest),
    the target's loss once, and a method whose evaluation by length is refused (its changed target has 40 positions)
    shows "-" with eval's reason while its other figures stand."""
    import shutil

    from trainer.compare.run import main as compare_main

    monkeypatch.setattr(Comparison, "_run_command", _in_process)
    root, out = context_models, tmp_path / "out"
    evaluation = {
        "prompts": str(root / "prompts.jsonl"), "max_prompts": 2, "k": [1, 3], "max_new_tokens": 8,
        "temperature": 1.0, "training_evals": 0, "device": "cpu", "context_lengths": [48, 16],
        "context_documents": str(root / "documents.jsonl"), "context_prompts": 2,
    }  # fmt: skip
    trained = {"recipe": KD, "fit_args": ["--model.init_args.export_dir={run}/student"]}
    recipe = {
        "target": str(root / "target"), "output_dir": str(out), "budget": {"steps": 1}, "evaluation": evaluation,
        "methods": [
            {"name": "lookup", "drafter": "prompt-lookup"},
            {"name": "draft", **trained},
            {"name": "short", **trained, "drafter": "prompt-lookup", "eval_target": "{export}"},
        ],
    }  # fmt: skip
    path = tmp_path / "compare.yaml"
    path.write_text(json.dumps(recipe))
    for name, export in (("draft", "draft"), ("short", "short")):  # trained already: fit and export are skipped
        folder = out / "methods" / name
        folder.mkdir(parents=True)
        fit = {"budget": "1 optimizer steps", "loss": "kl", "steps": 1, "tokens": 64, "scalars": {}}
        (folder / "fit.json").write_text(json.dumps(fit))
        (folder / "export.json").write_text(json.dumps({"format": None}))
        shutil.copytree(root / export, folder / "export")
    path.write_text(json.dumps({**recipe, "evaluation": {**evaluation, "context_lengths": None}}))
    assert compare_main(["--config", str(path)]) == 0  # without the key: no evaluation by length, no section
    assert "By context length" not in (out / "report.md").read_text()
    assert not (out / "methods" / "lookup" / "eval_context").exists()
    first = {name: (out / "methods" / name / "eval" / "report.json").stat().st_mtime_ns for name in ("lookup", "draft")}
    path.write_text(json.dumps(recipe))
    assert compare_main(["--config", str(path)]) == 1  # the refused evaluation by length is a failure
    for name, mtime in first.items():  # the key added later: only the new stage runs
        assert (out / "methods" / name / "eval" / "report.json").stat().st_mtime_ns == mtime
    report = json.loads((out / "report.json").read_text())
    assert report["setup"]["context_lengths"] == [48, 16]
    rows = {row["method"]: row for row in report["rows"]}
    markdown = (out / "report.md").read_text()
    assert "## By context length" in markdown and "| method | K | 16 | 48 | kept |" in markdown
    for name in ("lookup", "draft"):
        row = rows[name]
        evaluated = json.loads((out / "methods" / name / "eval_context" / "report.json").read_text())
        assert evaluated["prompts"] == 4  # two per length, from the documents
        buckets = {b["context_length"]: b for b in evaluated["by_context"]}
        assert [b["context_length"] for b in row["by_context"]] == [16, 48]
        for mine in row["by_context"]:
            bucket = buckets[mine["context_length"]]
            (greedy,) = [e for e in bucket["greedy"] if e["k"] == 3]
            (sampling,) = [e for e in bucket["sampling"] if e["k"] == 3]
            assert mine["k"] == 3 and mine["tau_greedy"] == greedy["tau"] and mine["tau_sampling"] == sampling["tau"]
            assert mine["acceptance_per_position"] == greedy["acceptance_per_position"]
            assert mine["target_loss"] == bucket["target_loss"] and mine["prompts"] == bucket["prompts"] == 2
        kept = buckets[48]["greedy"][-1]["tau"] / buckets[16]["greedy"][-1]["tau"]
        assert row["context_kept"] == kept
        taus = " | ".join(f"{buckets[n]['greedy'][-1]['tau']:.2f}" for n in (16, 48))
        assert f"| {name} | 3 | {taus} | {kept:.2f} |" in markdown
    losses = " | ".join(f"{b['target_loss']:.3f}" for b in rows["lookup"]["by_context"])
    assert markdown.count("| target loss |") == 1 and f"| target loss | | {losses} | |" in markdown
    short = rows["short"]
    assert short["status"] == "done" and short["per_k"] and "by_context" not in short
    assert short["context_missing"] == (
        "failed at eval_context: --context_lengths 48: longer than the 32 tokens the target's context "
        "(max_position_embeddings 40) leaves beside --max_new_tokens 8"
    )
    assert f"| short | - | - | - | - ({short['context_missing']}) |" in markdown
    assert (out / "tau_by_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "tau_by_context.png" in markdown


def test_context_lengths_are_checked_against_the_target_and_documents_before_anything_runs(
    context_models, tmp_path, capsys, monkeypatch
):
    from trainer.compare.run import main as compare_main

    def no_stage(self, args, output):
        raise AssertionError(f"a stage ran: {args}")

    monkeypatch.setattr(Comparison, "_run_command", no_stage)
    root = context_models
    text = BASE.replace("target: t", f"target: {root / 'target'}\noutput_dir: {tmp_path / 'out'}").replace(
        "evaluation: {prompts: p.jsonl}",
        f"evaluation: {{prompts: {root / 'prompts.jsonl'}, heldout: {root / 'documents.jsonl'}, "
        "max_new_tokens: 8, context_lengths: [16, 250]}",
    )
    path = write_recipe(tmp_path, text)
    assert compare_main(["--config", path]) == 2
    err = capsys.readouterr().err
    assert (
        f"error: {path}: evaluation.context_lengths 250: longer than the 248 tokens the target's context "
        "(max_position_embeddings 256) leaves beside evaluation.max_new_tokens 8"
    ) in err
    assert "Traceback" not in err and not (tmp_path / "out" / "methods").exists()
    assert compare_main(["--config", write_recipe(tmp_path, text.replace("250", "400"))]) == 2
    assert "evaluation.context_lengths 400: longer than" in capsys.readouterr().err
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "the cat sat"}) + "\n")
    text = text.replace(", 250", "").replace("heldout: ", f"context_documents: {short}, heldout: ")
    assert compare_main(["--config", write_recipe(tmp_path, text)]) == 2  # context_documents over heldout
    err = capsys.readouterr().err
    assert f"evaluation.context_lengths 16: no document of {short} has the 24 tokens" in err


@pytest.mark.parametrize(
    "text, message",
    [
        (BASE + "out: somewhere\n", "out is now output_dir"),
        (
            BASE.replace("{prompts: p.jsonl}", "{prompts: p.jsonl, dtype: bfloat16}"),
            "evaluation.dtype is now evaluation.target_dtype",
        ),
    ],
)  # fmt: skip
def test_a_renamed_compare_key_is_refused_naming_the_new_one(tmp_path, text, message):
    path = write_recipe(tmp_path, text)
    with pytest.raises(CompareConfigError) as refused:
        read_config(path)
    assert str(refused.value) == f"{path}: {message}"
