"""`draftsmith eval` end to end on a saved tiny target, its error handling, and the Lightning callback."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trainer.decoding.callback import SpeculativeEvalCallback
from trainer.decoding.evaluate import SpeculativeMismatchError, check_identity, main
from trainer.decoding.generate import GenerationResult
from trainer.decoding.proposers import DraftModelProposer

TEXT = ["the cat sat on the mat and the dog sat on the log", "a b c d e f g h i j k l m n o p", "def f(x): return x"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(seed: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(TEXT * 4, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    vocab = len(tokenizer)
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_llama(seed, vocab).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXT))
    return root


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft"])
def test_eval_writes_report(saved, drafter: str, capsys) -> None:
    out = saved / f"out-{drafter}"
    spec = str(saved / "draft") if drafter == "draft" else drafter
    argv = ["--target", str(saved / "target"), "--drafter", spec, "--prompts", str(saved / "prompts.jsonl")]
    argv += ["--k", "1,3", "--max-new-tokens", "12", "--out", str(out), "--dtype", "float64", "--temperature", "0.8"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert [e["k"] for e in report["greedy"]] == [1, 3] and [e["k"] for e in report["sampling"]] == [1, 3]
    for entry in report["greedy"] + report["sampling"]:
        assert 1.0 <= entry["tau"] <= entry["k"] + 1
        assert len(entry["acceptance_per_position"]) == entry["k"]
        assert entry["target_forwards"] <= entry["baseline_target_forwards"] == 3 * 12
    assert all(e["identical"] for e in report["greedy"])
    assert 0.0 <= report["loops"]["share"] <= 1.0
    assert report["best_k"] in (1, 3)
    assert "tau" in (out / "report.md").read_text()
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best K" in capsys.readouterr().out


def test_eval_rejects_bad_inputs(saved, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    base = ["--target", str(saved / "target"), "--out", str(tmp_path / "o")]
    assert main(base + ["--drafter", "prompt-lookup", "--prompts", str(bad)]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(base + ["--drafter", "no-such-drafter", "--prompts", str(saved / "prompts.jsonl")]) == 1
    assert "no-such-drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--drafter", "prompt-lookup", "--prompts", str(bad), "--k", "0"])


def test_mismatch_is_an_error_not_a_statistic() -> None:
    reference = [GenerationResult(tokens=[1, 2, 3, 4])]
    with pytest.raises(SpeculativeMismatchError, match="prompt 0.*position 2"):
        check_identity(reference, [GenerationResult(tokens=[1, 2, 9, 4])], k=4)
    check_identity(reference, [GenerationResult(tokens=[1, 2, 3, 4])], k=4)


class DraftModule(pl.LightningModule):
    """The protocol a training objective implements: target_model and make_proposer()."""

    def __init__(self) -> None:
        super().__init__()
        self.target_model = tiny_llama(0, 64).requires_grad_(False)
        self.student = tiny_llama(1, 64)

    def make_proposer(self) -> DraftModelProposer:
        return DraftModelProposer(self.student)

    def training_step(self, batch, batch_idx):
        return self.student(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=1e-3)


def test_callback_logs_tau_every_n_steps(tmp_path) -> None:
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 12)))
    callback = SpeculativeEvalCallback(prompts=[[1, 2, 3], [4, 5, 6, 7]], k=3, max_new_tokens=10, every_n_steps=2)
    trainer = pl.Trainer(
        max_steps=4, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path,
    )  # fmt: skip
    module = DraftModule()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    assert callback._last_step == 4
    assert 1.0 <= trainer.callback_metrics["spec_eval/tau"] <= 4.0
    assert set(callback.last) == {"spec_eval/tau", "spec_eval/acceptance_rate", "spec_eval/loop_share"}
    assert module.training  # restored after the evaluation
