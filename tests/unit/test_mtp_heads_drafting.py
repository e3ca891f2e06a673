"""Self-speculative decoding with parallel MTP heads (lossless chain and tree, drafts from exactly the training-time
heads), the drafter kind ``mtp_heads`` (record, checkpoint, export through the registry, proposer factory) and the
export format (a plain HF checkpoint transformers loads, the heads beside it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.helpers import tiny_llama
from trainer.decoding.callback import SpeculativeEvalCallback
from trainer.decoding.evaluate import resolve_drafter
from trainer.decoding.generate import speculative_generate
from trainer.decoding.head_tree import tree_for_budget
from trainer.decoding.options import ProposerOptions
from trainer.decoding.proposers import NoProposer
from trainer.export.cli import export
from trainer.methods.mtp_heads import export as mtp_export
from trainer.methods.mtp_heads import kind as mtp_kind
from trainer.methods.mtp_heads.module import MTPHeads, default_accuracy
from trainer.methods.mtp_heads.proposer import MTPHeadsProposer
from trainer.training.registry import load_drafter

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 16  # a small vocabulary: random heads' guesses are often right, so paths get accepted


def heads_of(seed: int = 0, n: int = 4, dtype: torch.dtype = torch.float64) -> MTPHeads:
    model = tiny_llama(seed, vocab=VOCAB, hidden=32, layers=3, dtype=dtype)
    torch.manual_seed(seed + 1)
    return MTPHeads(model, n, head_init="random").eval()


class Recorder(MTPHeadsProposer):
    """Keeps every round's committed tokens and the heads' logits it drafted from."""

    rounds: list[tuple[torch.Tensor, torch.Tensor]]

    def head_logits(self, ctx):
        logits = super().head_logits(ctx)
        self.rounds.append((ctx.tokens.clone(), logits))
        return logits


@pytest.mark.parametrize("tree", [False, True])
def test_drafts_are_lossless_and_come_from_exactly_the_training_heads(tree) -> None:
    heads = heads_of(2)
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(0))
    reference = speculative_generate(heads.model, prompt, NoProposer(), 1, 40).tokens
    choices = tree_for_budget(default_accuracy(3, 4), 12) if tree else None
    proposer = Recorder(heads, choices)
    proposer.rounds = []
    result = speculative_generate(heads.model, prompt, proposer, 3, 40)
    assert result.tokens == reference
    assert sum(r.accepted for r in result.rounds) > 0 and max(r.nodes for r in result.rounds) == (12 if tree else 3)
    # every round drafted from the logits the training forward gives at the last position with a known z (T - 2)
    sequence = torch.cat([prompt, torch.tensor(result.tokens)])
    with torch.no_grad():
        training = heads.all_logits(sequence[None])[0]  # [S, n, V]
    assert len(proposer.rounds) == sum(r.drafted > 0 for r in result.rounds)  # not the prefill, nor a k = 0 end
    for tokens, logits in proposer.rounds:
        assert torch.equal(tokens, sequence[: tokens.numel()])
        torch.testing.assert_close(logits, training[tokens.numel() - 2, 1:], rtol=1e-12, atol=1e-12)
    sampled = speculative_generate(heads.model, prompt, proposer, 3, 40, 1.0, None, torch.Generator().manual_seed(1))
    assert len(sampled.tokens) == 40
    with pytest.raises(ValueError, match="4 drafts per round asked of 3 heads"):
        speculative_generate(heads.model, prompt, proposer, 4, 10)


def training_checkpoint(path, heads: MTPHeads, target_dir) -> tuple:
    record = mtp_kind.make_record(heads, "mtp", str(target_dir), None)
    state = {"mtp." + k: v for k, v in heads.state_dict().items()}
    torch.save({"state_dict": state, "drafter": record.to_dict()}, path)
    return path, record


def test_export_is_a_plain_hf_model_with_the_heads_beside_it_and_reloads_for_eval(tmp_path) -> None:
    heads = heads_of(2, dtype=torch.float32)
    hits = torch.zeros(3, heads.agreement.shape[1])
    hits[:, :3] = torch.tensor([[6.0, 2.0, 1.0], [4.0, 2.0, 2.0], [2.0, 1.0, 1.0]])  # of 10 positions each
    heads.record_agreement(hits, torch.tensor([10.0] * 3))
    ckpt, record = training_checkpoint(tmp_path / "mtp.ckpt", heads, tmp_path / "exported")
    out, fmt = export(str(ckpt), str(tmp_path / "exported"))  # the registry: the kind's default format
    assert fmt == "mtp_heads" and mtp_export.is_export(out)
    # transformers loads the folder as the ordinary model: trunk + head 0, heads dropped
    plain = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, VOCAB, (1, 9))
    torch.testing.assert_close(plain(ids).logits, heads.model(ids).logits, rtol=0, atol=0)
    config = json.loads((out / "mtp_heads.json").read_text())
    assert (config["num_heads"], config["hidden_state"], config["head_class"]) == (4, 2, "LlamaDecoderLayer")
    assert config["agreement"][0][:3] == [0.6, 0.2, 0.1]
    stored = load_file(out / "mtp_heads.safetensors")
    assert sorted({k.split(".")[1] for k in stored}) == ["1", "2", "3"]  # heads 1..n-1; head 0 is model.layers.2
    torch.testing.assert_close(stored["heads.2.mlp.up_proj.weight"], heads.heads[1].mlp.up_proj.weight)
    reloaded = mtp_export.load(out)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.all_logits(ids), heads.all_logits(ids), rtol=0, atol=0)
    torch.testing.assert_close(reloaded.measured_agreement(), heads.measured_agreement())
    # a training checkpoint and the export give the same proposer, against the model the heads belong to
    for path in (ckpt, out):
        module, _ = load_drafter(str(path))
        assert isinstance(module, MTPHeads) and module.num_heads == 4
    proposer = resolve_drafter(str(ckpt), plain, ProposerOptions(tree=True, tree_nodes=7, tree_top_k=3))
    assert isinstance(proposer, MTPHeadsProposer) and proposer.max_drafts == 3 and len(proposer.choices) == 7
    # the tree comes from the measured agreement: the budget goes to head 1's alternatives and the chain
    assert proposer.choices == tree_for_budget(heads.measured_agreement(), 7)
    other = tiny_llama(9, vocab=VOCAB, hidden=32, layers=3, dtype=torch.float32)
    with pytest.raises(ValueError, match="not those of the model they were trained with"):
        resolve_drafter(str(ckpt), other)


def test_an_exported_folder_is_recognised_as_mtp_heads(tmp_path) -> None:
    """In a fresh process, as ``draftsmith eval --drafter DIR`` runs (the kinds imported in their modules' order)."""
    heads = heads_of(3, dtype=torch.float32)
    mtp_export.save(heads, tmp_path / "out", None)
    code = (
        "import sys; from pathlib import Path; from trainer.training.registry import recognise as r; "
        "k, f = r(Path(sys.argv[1])); print(k.name, f.name)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["mtp_heads", "mtp_heads"]


def test_a_broken_heads_file_is_refused_naming_it(tmp_path) -> None:
    heads = heads_of(4, n=3, dtype=torch.float32)
    out = mtp_export.save(heads, tmp_path / "out", None)
    stored = load_file(out / "mtp_heads.safetensors")
    stored.pop("heads.2.mlp.up_proj.weight")
    stored["heads.3.extra"] = torch.zeros(1)
    save_file(stored, str(out / "mtp_heads.safetensors"))
    with pytest.raises(ValueError, match=r"mtp_heads.safetensors: missing \['heads.2.mlp.up_proj.weight'\], unexpe"):
        mtp_export.load(out)
    config = json.loads((out / "mtp_heads.json").read_text())
    (out / "mtp_heads.json").write_text(json.dumps({**config, "version": 7}))
    with pytest.raises(ValueError, match="mtp_heads.json: format 'draftsmith-mtp-heads' version 7"):
        mtp_export.load(out)


class HeadsModule(torch.nn.Module):
    """The training callback's protocol over a model with parallel heads (the model drafts for itself)."""

    def __init__(self, heads: MTPHeads) -> None:
        super().__init__()
        self.mtp = heads

    def speculative_eval_target(self):
        return self.mtp.model

    def trainable_module(self):
        return self.mtp

    def drafter_record(self):
        return mtp_kind.make_record(self.mtp, "mtp", None, None)


def test_the_training_callback_drafts_with_the_same_options_as_eval(monkeypatch) -> None:
    """``options`` of SpeculativeEvalCallback reach the kind's proposer factory as eval's flags do: ``tree_nodes 16``
    is the tree of 16 nodes the logged tau is measured with; a K the heads cannot draft is refused before decoding."""
    built: list[MTPHeadsProposer] = []

    class Built(MTPHeadsProposer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(mtp_kind, "MTPHeadsProposer", Built)
    module = HeadsModule(heads_of(2))
    prompts = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0)).tolist()
    for options in (ProposerOptions(), ProposerOptions(tree=True, tree_nodes=16), ProposerOptions(tree=True)):
        callback = SpeculativeEvalCallback(prompts=prompts, k=3, max_new_tokens=12, every_n_steps=1, options=options)
        assert callback.evaluate(module)["spec_eval/tau"] >= 1.0
        assert built[-1].choices is None if not options.tree else len(built[-1].choices) == options.tree_nodes
    assert [len(p.choices or ()) for p in built] == [0, 16, 24]
    callback = SpeculativeEvalCallback(prompts=prompts, k=4, max_new_tokens=12, options=ProposerOptions(tree=True))
    with pytest.raises(ValueError, match="--k 4: this drafter drafts at most 3 tokens per round"):
        callback.evaluate(module)
