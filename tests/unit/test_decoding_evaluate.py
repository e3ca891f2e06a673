"""`draftsmith eval` end to end on a saved tiny target, its error handling, and the Lightning callback."""

from __future__ import annotations

import dataclasses
import json

import lightning.pytorch as pl
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.helpers import SpeculativeEvalModule, tiny_llama
from trainer.cli import main as draftsmith
from trainer.decoding.callback import SpeculativeEvalCallback
from trainer.decoding.eval_cli import build_parser, main
from trainer.decoding.generate import GenerationResult
from trainer.decoding.options import ProposerOptions, field_help, options_from_arguments
from trainer.decoding.proposers import BaseProposer, PromptLookupProposer
from trainer.interface.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ["the cat sat on the mat and the dog sat on the log", "a b c d e f g h i j k l m n o p", "def f(x): return x"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(TEXT * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    vocab = len(tokenizer)
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_llama(seed, vocab, dtype=torch.float32, eos_token_id=None).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXT))
    return root


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft"])
def test_eval_writes_report(saved, drafter: str, capsys) -> None:
    out = saved / f"out-{drafter}"
    spec = str(saved / "draft") if drafter == "draft" else drafter
    argv = ["--target", str(saved / "target"), "--drafter", spec, "--prompts", str(saved / "prompts.jsonl")]
    argv += [
        "--k",
        "1,3",
        "--max_new_tokens",
        "12",
        "--output_dir",
        str(out),
        "--target_dtype",
        "float64",
        "--temperature",
        "0.8",
    ]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert [e["k"] for e in report["greedy"]] == [1, 3] and [e["k"] for e in report["sampling"]] == [1, 3]
    for entry in report["greedy"] + report["sampling"]:
        assert 1.0 <= entry["tau"] <= entry["k"] + 1
        assert len(entry["acceptance_per_position"]) == entry["k"]
        assert entry["target_forwards"] <= entry["baseline_target_forwards"] == 3 * 12
    for entry in report["greedy"][1:] if drafter == "draft" else []:  # K = 3 drafts (nearly) every round
        assert entry["draft_cost_per_round"] >= entry["draft_cost"] > 0
    assert all(e["identical"] for e in report["greedy"])
    assert 0.0 <= report["loops"]["share"] <= 1.0
    assert report["best_k"] in (1, 3)
    assert "tau" in (out / "report.md").read_text()
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best K" in capsys.readouterr().out


def test_eval_sweeps_thresholds_side_by_side_and_refuses_them_without_estimate(saved, tmp_path, capsys) -> None:
    """``--accept_threshold 0,0.3``: one report, each K at each threshold with its drafts per round (the greedy
    output checked identical at each); a drafter without an acceptance estimate is refused, naming the flag."""
    out = tmp_path / "thresholds"
    argv = ["--target", str(saved / "target"), "--prompts", str(saved / "prompts.jsonl"), "--target_dtype", "float64"]
    argv += ["--k", "2,4", "--max_new_tokens", "10", "--temperature", "0"]
    assert (
        main([*argv, "--drafter", str(saved / "draft"), "--accept_threshold", "0,0.3", "--output_dir", str(out)]) == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["accept_thresholds"] == [0.0, 0.3]
    assert [(e["accept_threshold"], e["k"]) for e in report["greedy"]] == [(0.0, 2), (0.0, 4), (0.3, 2), (0.3, 4)]
    for e in report["greedy"]:
        assert e["identical"] and 0 <= e["drafts_per_round"] <= e["k"]
    fixed, cut = report["greedy"][1], report["greedy"][3]
    assert cut["drafts_per_round"] < fixed["drafts_per_round"]  # a random draft model is rarely confident
    markdown = (out / "report.md").read_text()
    assert "## Draft length by predicted acceptance" in markdown and "| 4 | 0.3 |" in markdown
    assert "threshold 0.3" in capsys.readouterr().out
    refused = ["--drafter", "prompt-lookup", "--accept_threshold", "0.2", "--output_dir", str(tmp_path / "no")]
    assert draftsmith(["eval", *argv, *refused]) == 2
    err = capsys.readouterr().err
    assert "--accept_threshold 0.2: the drafter prompt-lookup (PromptLookupProposer) gives no estimate" in err
    assert not (tmp_path / "no").exists()


def test_eval_rejects_bad_inputs(saved, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"other": "no prompt key"}\n')
    base = ["--target", str(saved / "target"), "--output_dir", str(tmp_path / "o")]
    assert draftsmith(["eval", *base, *["--drafter", "prompt-lookup", "--prompts", str(bad)]]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert (
        draftsmith(["eval", *base, *["--drafter", "no-such-drafter", "--prompts", str(saved / "prompts.jsonl")]]) == 2
    )
    assert "no-such-drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--drafter", "prompt-lookup", "--prompts", str(bad), "--k", "0"])
    # a prompt longer than the target's context (256 positions) less the output budget
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": " ".join(TEXT * 30)}) + "\n")
    assert draftsmith(["eval", *base, *["--drafter", "prompt-lookup", "--prompts", str(long)]]) == 2
    err = capsys.readouterr().err
    assert "long.jsonl:1" in err and "context" in err
    # ... unless cut to its first tokens
    assert main(base + ["--drafter", "prompt-lookup", "--prompts", str(long), "--prompt_tokens", "32"]) == 0
    capsys.readouterr()
    # a target folder that is not a model, and a drafter of another vocabulary (its own tokenizer says so)
    prompts = str(saved / "prompts.jsonl")
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    assert (
        draftsmith(
            [
                "eval",
                "--target",
                str(empty),
                "--drafter",
                "none",
                "--prompts",
                prompts,
                "--output_dir",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "not a local model folder" in capsys.readouterr().err
    other = tmp_path / "other_vocab"
    tiny_llama(3, 77, dtype=torch.float32).save_pretrained(other)
    assert draftsmith(["eval", *base, *["--drafter", str(other), "--prompts", prompts]]) == 2
    assert "other_vocab: a drafter of 77 output tokens for a target of" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # a refused run writes nothing


def test_the_drafting_flags_are_the_fields_of_proposer_options(tmp_path) -> None:
    """One flag per ProposerOptions field, its default and help read from the class; parsed back into the options,
    a sweep of exit layers giving one options each and a tree file its paths."""
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    described = field_help()
    for field in dataclasses.fields(ProposerOptions):
        action = actions[field.name]
        assert action.option_strings == [f"--{field.name}"] and action.help.startswith(described[field.name])
        assert action.default == field.default
    base = ["--target", "t", "--drafter", "d", "--prompts", "p", "--output_dir", "o"]
    assert options_from_arguments(parser.parse_args(base)) == [ProposerOptions()]
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"paths": [[0], [1], [0, 0]], "nodes": 3}))
    argv = base + ["--tree", "--tree_nodes", "16", "--tree_choices", str(tree), "--exit_layer", "1,3"]
    first, second = options_from_arguments(parser.parse_args(argv))
    assert first == ProposerOptions(tree=True, tree_nodes=16, tree_choices=((0,), (1,), (0, 0)), exit_layer=1)
    assert second.exit_layer == 3 and second.tree_nodes == 16
    with pytest.raises(ValueError, match="--tree_choices .*not a readable JSON file"):
        options_from_arguments(parser.parse_args(base + ["--tree_choices", str(tmp_path / "missing.json")]))
    with pytest.raises(ValueError, match="tree_nodes >= 1"):
        options_from_arguments(parser.parse_args(base + ["--tree_nodes", "0"]))
    # thresholds of dynamic draft length: one options each, inside every exit layer of a sweep
    swept = options_from_arguments(parser.parse_args(base + ["--exit_layer", "1,2", "--accept_threshold", "0,0.25"]))
    assert [(o.exit_layer, o.accept_threshold) for o in swept] == [(1, 0.0), (1, 0.25), (2, 0.0), (2, 0.25)]
    with pytest.raises(UsageError, match="accept_threshold must be in \\[0, 1\\], got 1.5"):
        options_from_arguments(parser.parse_args(base + ["--accept_threshold", "0.2,1.5"]))


def test_what_eval_asks_a_proposer_has_its_defaults_in_one_place(saved, tmp_path, capsys) -> None:
    lookup = PromptLookupProposer()
    assert lookup.max_drafts is None and lookup.needs_hidden_states == ()
    lookup.check_k(1000)  # unbounded
    bounded = BaseProposer()
    bounded.max_drafts = 2
    with pytest.raises(ValueError, match="--k 3: this drafter drafts at most 2 tokens per round"):
        bounded.check_k(3)
    with pytest.raises(ValueError, match="--write_tree: a PromptLookupProposer does not draft with parallel heads"):
        lookup.write_tree(tmp_path / "tree.json", None, [[1, 2]], 4, 8)
    argv = ["--target", str(saved / "target"), "--drafter", "prompt-lookup", "--prompts", str(saved / "prompts.jsonl")]
    assert main([*argv, "--write_tree", str(tmp_path / "t.json"), "--output_dir", str(tmp_path / "o")]) == 2
    assert "prompt-lookup: --write_tree: a PromptLookupProposer does not draft" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


class DraftModule(SpeculativeEvalModule):
    """The callback's protocol on a float32 target and student of 64 tokens."""

    def __init__(self) -> None:
        super().__init__(64, torch.float32)


def test_callback_logs_tau_every_n_steps(tmp_path) -> None:
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12)))
    callback = SpeculativeEvalCallback(
        prompts=[[1, 2, 3], [4, 5, 6, 7]], k=3, max_new_tokens=10, every_n_steps=2, temperature=1.0
    )
    trainer = pl.Trainer(
        max_steps=3, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    module = DraftModule()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    assert callback._last_step == 3  # step 2, then the last step
    assert 1.0 <= callback.last["spec_eval/tau"] <= 4.0
    assert 1.0 <= callback.last["spec_eval/tau_sampling"] <= 4.0
    expected = {"spec_eval/tau", "spec_eval/acceptance_rate", "spec_eval/loop_share", "spec_eval/near_ties"}
    expected |= {f"spec_eval/acceptance_{d}" for d in (1, 2, 3)}
    expected |= {"spec_eval/tau_sampling", "spec_eval/acceptance_rate_sampling"}
    expected |= {f"spec_eval/acceptance_sampling_{d}" for d in (1, 2, 3)}
    assert set(callback.last) == expected
    assert module.training  # restored after the evaluation


def test_callback_drafts_with_the_threshold_of_its_options() -> None:
    """``options: {accept_threshold: X}`` reaches the engine (greedy output still checked identical) and the drafts
    per round are logged; a threshold no draft of this random student reaches leaves plain decoding."""
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    values = {}
    for threshold in (1e-9, 1.0):
        options = ProposerOptions(accept_threshold=threshold)
        callback = SpeculativeEvalCallback(prompts=prompts, k=3, max_new_tokens=10, options=options)
        values[threshold] = callback.evaluate(DraftModule())
    assert values[1e-9]["spec_eval/drafts_per_round"] > 2.0  # nearly every round drafts 3 (not the prefill)
    assert values[1.0]["spec_eval/drafts_per_round"] == 0.0 and values[1.0]["spec_eval/tau"] == 1.0


class TrainedTargetModule(DraftModule):
    """A module whose target trains too (as Medusa-2 and LayerSkip fine-tunes do), at a rate that changes its greedy
    output from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.target_model.requires_grad_(True)

    def training_step(self, batch, batch_idx):
        return self.target_model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.target_model.parameters(), lr=5.0)


def test_callback_decodes_a_training_target_anew_at_every_evaluation(tmp_path) -> None:
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12)))
    callback = SpeculativeEvalCallback(prompts=[[1, 2, 3], [4, 5, 6, 7]], k=3, max_new_tokens=10, every_n_steps=1)
    trainer = pl.Trainer(
        max_steps=3, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    module = TrainedTargetModule()
    before = module.target_model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=10, do_sample=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))  # a stale reference would fail identity
    after = module.target_model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=10, do_sample=False)
    assert not torch.equal(before, after)  # the target's greedy output did change while it trained
    assert callback._reference[0].tokens == after[0, 3:].tolist()


def test_measured_speedup_is_the_median_of_side_by_side_ratios(monkeypatch) -> None:
    """Each prompt runs alone and with the drafter back to back, the order alternating by prompt and pass; the speedup
    is the median of the per-prompt ratios, quartiles beside it (durations here are given, not timed)."""
    from trainer.decoding import evaluate
    from trainer.decoding.proposers import NoProposer

    calls = []
    seconds = {"alone": [4.0, 6.0, 9.0], "drafter": [2.0, 2.0, 3.0]}  # per prompt: ratios 2, 3, 3

    def fake_run_prompts(target, proposer, prompts, k, max_new_tokens, temperature, eos, seed, threshold):
        who = "alone" if isinstance(proposer, NoProposer) else "drafter"
        index = prompts[0][0]
        calls.append((index, who))
        return [GenerationResult(tokens=[1, 2], total_seconds=seconds[who][index])]

    monkeypatch.setattr(evaluate, "run_prompts", fake_run_prompts)
    alone, drafted, ratios = evaluate.run_side_by_side(None, object(), [[0], [1], [2]], 4, 2, repeats=2)
    first, second = ["alone", "drafter"], ["drafter", "alone"]
    assert [who for _, who in calls] == first + second + first + second + first + second
    assert [index for index, _ in calls] == [0, 0, 1, 1, 2, 2] * 2
    assert ratios == [2.0, 3.0, 3.0, 2.0, 3.0, 3.0] and len(alone) == len(drafted) == 3
    entry = evaluate.summarize(drafted, alone, 4, ratios)
    assert entry["measured_speedup"] == 3.0 and entry["measured_pairs"] == 6
    assert entry["measured_speedup_quartiles"][0] <= 3.0 <= entry["measured_speedup_quartiles"][1]
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        evaluate.run_side_by_side(None, object(), [[0]], 4, 2, repeats=0)


def test_eval_takes_a_hub_id_from_the_local_cache_offline(saved, tmp_path) -> None:
    """``--target org/name`` (as a recipe and a fit's next-step line name an 8B target) is read from the local
    Hugging Face cache with HF_HUB_OFFLINE=1: the same report as the folder; an id not in the cache is one line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import cache_as_hub_repository

    cache = tmp_path / "hub"
    cache_as_hub_repository(saved / "target", cache, "draftsmith-test/tiny-target")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    reports = {}
    for name, target in (("folder", str(saved / "target")), ("hub", "draftsmith-test/tiny-target")):
        argv = ["--target", target, "--drafter", str(saved / "draft"), "--prompts", str(saved / "prompts.jsonl")]
        argv += ["--k", "3", "--max_new_tokens", "8", "--output_dir", str(tmp_path / name), "--target_dtype", "float64"]
        run = subprocess.run([sys.executable, "-m", "trainer.cli", "eval", *argv], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    assert [e["tau"] for e in reports["hub"]["greedy"]] == [e["tau"] for e in reports["folder"]["greedy"]]
    assert reports["hub"]["greedy"][0]["identical"]
    argv = ["eval", "--target", "draftsmith-test/not-cached", "--drafter", "none"]
    argv += ["--prompts", str(saved / "prompts.jsonl"), "--output_dir", str(tmp_path / "none")]
    run = subprocess.run([sys.executable, "-m", "trainer.cli", *argv], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--target 'draftsmith-test/not-cached'" in errors[0], run.stderr
    assert "local Hugging Face cache (HF_HUB_OFFLINE is set)" in errors[0], run.stderr
