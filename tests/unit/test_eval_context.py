"""``draftsmith eval --context_lengths``: prompts cut from long documents at each length, tau and acceptance per
length, the target's own loss per length, greedy output identical to the target's at every length, and refusals."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from tests.helpers import tiny_llama
from trainer.cli import main as draftsmith
from trainer.decoding.context import cut_buckets, flatten
from trainer.decoding.eval_cli import main
from trainer.decoding.evaluate import evaluate_drafter, load_prompts, resolve_drafter, run_prompts
from trainer.decoding.proposers import NoProposer
from trainer.decoding.report import markdown

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the cat sat on the mat and the dog sat on the log a b c d e f g h i j k l m n o p def f(x): return x".split()
LENGTHS = (16, 48, 96)  # context lengths of the tests
NEW = 8  # max_new_tokens of the tests
WORDS_PER_DOCUMENT = (10, 30, 60, 90, 140, 200)  # documents from shorter than every bucket to longer than all


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A random float32 target and draft model (256 positions) with a small BPE tokenizer, and a documents file."""
    root = tmp_path_factory.mktemp("context")
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(vocab_size=110, special_tokens=["<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_llama(seed, len(tokenizer), dtype=torch.float32, eos_token_id=None).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rng = random.Random(0)
    documents = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in WORDS_PER_DOCUMENT]
    (root / "documents.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return root


def naive_buckets(saved, max_prompts: int = 0) -> dict[int, list[list[int]]]:
    """Each length's prompts by hand: every document tokenized alone, kept when it holds the length and the output
    budget, cut to the length."""
    tokenizer = AutoTokenizer.from_pretrained(saved / "target")
    texts = [json.loads(line)["text"] for line in (saved / "documents.jsonl").read_text().splitlines()]
    tokenized = [tokenizer(t).input_ids for t in texts]
    out = {}
    for length in LENGTHS:
        kept = [ids[:length] for ids in tokenized if len(ids) >= length + NEW]
        out[length] = kept[:max_prompts] if max_prompts else kept
    return out


def run(saved, out, *extra: str) -> int:
    argv = ["--target", str(saved / "target"), "--drafter", str(saved / "draft"), "--target_dtype", "float64"]
    argv += [
        "--prompts",
        str(saved / "documents.jsonl"),
        "--max_new_tokens",
        str(NEW),
        "--output_dir",
        str(out),
        *extra,
    ]
    return draftsmith(["eval", *argv])


def test_buckets_are_each_documents_first_tokens_and_short_documents_are_skipped(saved) -> None:
    expected = naive_buckets(saved)
    assert [len(b) for b in expected.values()] != [len(WORDS_PER_DOCUMENT)] * len(LENGTHS)  # some are skipped
    assert all(expected.values())  # ... and no bucket is empty
    tokenizer = AutoTokenizer.from_pretrained(saved / "target")
    documents = load_prompts(saved / "documents.jsonl", tokenizer)
    # a document holds a length but not the output budget after it: skipped for that length
    assert any(length <= len(ids) < length + NEW for ids in documents for length in LENGTHS)
    assert cut_buckets(documents, [96, 16, 48, 16], NEW) == expected  # sorted, each length once
    assert cut_buckets(documents, LENGTHS, NEW, max_prompts=2) == naive_buckets(saved, max_prompts=2)
    prompts, indices = flatten(expected)
    assert [prompts[i] for i in indices[48]] == expected[48]
    assert sorted(i for idx in indices.values() for i in idx) == list(range(len(prompts)))


def test_report_by_context_length(saved, tmp_path, capsys) -> None:
    """The report's ``by_context``: each length's prompt count, the target's loss on its prompts (against a naive
    per-token sum in float64), and tau and acceptance per position equal to an evaluation of that bucket alone; every
    existing key stays, the pooled entries covering every bucket's prompts."""
    out = tmp_path / "report"
    assert run(saved, out, "--context_lengths", ",".join(map(str, LENGTHS)), "--k", "1,3", "--max_prompts", "3") == 0
    report = json.loads((out / "report.json").read_text())
    expected = naive_buckets(saved, max_prompts=3)
    assert [b["context_length"] for b in report["by_context"]] == list(LENGTHS)
    assert [b["prompts"] for b in report["by_context"]] == [len(expected[n]) for n in LENGTHS]
    assert report["prompts"] == sum(len(b) for b in expected.values())
    for key in ("greedy", "sampling", "loops", "best_k", "baseline", "target", "drafter", "max_new_tokens"):
        assert key in report
    target = AutoModelForCausalLM.from_pretrained(saved / "target", dtype=torch.float64).eval()
    proposer = resolve_drafter(str(saved / "draft"), target)
    for bucket in report["by_context"]:
        prompts = expected[bucket["context_length"]]
        total, count = 0.0, 0
        with torch.no_grad():
            for prompt in prompts:
                logits = target(input_ids=torch.tensor([prompt])).logits[0]  # [S, V]
                for t in range(len(prompt) - 1):
                    total -= float(logits[t, prompt[t + 1]] - torch.logsumexp(logits[t], dim=0))
                    count += 1
        assert bucket["target_loss_tokens"] == count == len(prompts) * (bucket["context_length"] - 1)
        assert bucket["target_loss"] == pytest.approx(total / count, rel=1e-9)
        alone = evaluate_drafter(target, proposer, prompts, [1, 3], NEW, 1.0, None, 0)
        assert [e["k"] for e in bucket["greedy"]] == [e["k"] for e in bucket["sampling"]] == [1, 3]
        for mine, reference in zip(bucket["greedy"], alone["greedy"]):
            assert mine["identical"] and mine["tau"] == reference["tau"]
            assert mine["acceptance_per_position"] == reference["acceptance_per_position"]
            assert mine["target_forwards"] == reference["target_forwards"]
            assert mine["measured_pairs"] == len(prompts)
        for mine in bucket["sampling"]:  # seeded by prompt index: other draws than the bucket alone
            assert mine["baseline_target_forwards"] == len(prompts) * NEW and 1.0 <= mine["tau"] <= mine["k"] + 1
        assert bucket["loops"]["share"] == alone["loops"]["share"]
    text = (out / "report.md").read_text()
    assert "## By context length" in text and f"| {LENGTHS[-1]} | {len(expected[LENGTHS[-1]])} | " in text
    assert markdown(report) == text
    assert (out / "acceptance_by_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"context {LENGTHS[0]} ({len(expected[LENGTHS[0]])} prompts, target loss" in capsys.readouterr().out


def test_greedy_output_is_the_targets_at_every_context_length(saved) -> None:
    """At every length, the speculative greedy output equals the target's own, decoded by hand with one whole forward
    per token (no cache)."""
    target = AutoModelForCausalLM.from_pretrained(saved / "target", dtype=torch.float64).eval()
    proposer = resolve_drafter(str(saved / "draft"), target)
    for length, prompts in naive_buckets(saved, max_prompts=2).items():
        for prompt in prompts:
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(NEW):
                    ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            expected = ids[length:]
            assert run_prompts(target, proposer, [prompt], 3, NEW)[0].tokens == expected, length
            assert run_prompts(target, NoProposer(), [prompt], 1, NEW)[0].tokens == expected, length


def test_without_context_lengths_the_report_has_no_by_context(saved, tmp_path) -> None:
    out = tmp_path / "plain"
    assert run(saved, out, "--prompt_tokens", "12", "--max_prompts", "2", "--k", "2", "--temperature", "0") == 0
    report = json.loads((out / "report.json").read_text())
    assert "by_context" not in report and report["prompts"] == 2
    assert "By context length" not in (out / "report.md").read_text()
    assert not (out / "acceptance_by_context.png").exists()


def test_refusals_name_the_value(saved, tmp_path, capsys) -> None:
    """A length the target's context (256 positions) cannot hold beside the output budget, a length no document is
    long enough for, a malformed list, and --prompt_tokens beside it: one line each, nothing written."""
    out = tmp_path / "refused"
    assert run(saved, out, "--context_lengths", "16,250") == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line == (
        "error: --context_lengths 250: longer than the 248 tokens the target's context (max_position_embeddings 256) "
        "leaves beside --max_new_tokens 8"
    )
    assert "Traceback" not in err
    tokenizer = AutoTokenizer.from_pretrained(saved / "target")
    longest = max(len(ids) for ids in load_prompts(saved / "documents.jsonl", tokenizer))
    too_long = longest - NEW + 1
    assert run(saved, out, "--context_lengths", f"16,{too_long}") == 2
    err = capsys.readouterr().err
    assert f"error: --context_lengths {too_long}: no document of " in err
    assert f"the longest has {longest})" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything is decoded or written
    assert run(saved, out, "--context_lengths", f"16,{too_long - 1}", "--k", "1", "--max_prompts", "1") == 0
    capsys.readouterr()
    for bad in ("16,abc", "16,0", ","):
        with pytest.raises(SystemExit) as exit_:
            main(
                [
                    "--target",
                    "t",
                    "--drafter",
                    "d",
                    "--prompts",
                    "p",
                    "--output_dir",
                    str(out),
                    "--context_lengths",
                    bad,
                ]
            )
        assert exit_.value.code == 2 and "--context_lengths" in (err := capsys.readouterr().err) and repr(bad) in err
    assert run(saved, tmp_path / "both", "--context_lengths", "16", "--prompt_tokens", "8") == 2
    assert "--prompt_tokens 8 with --context_lengths" in capsys.readouterr().err
    assert not (tmp_path / "both").exists()
