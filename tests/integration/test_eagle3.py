"""EAGLE-3 end to end through the real CLI: a short fit of recipes/quickstart/eagle3.yaml, both exports through
``draftsmith export`` reloaded with the engines' naming rules, lossless chain and tree decoding on the tiny target,
and a vocabulary map that survives resume and fine-tuning on other data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.recipe_runs import data_overrides, fit, merge, trainer_overrides
from trainer.checkpoints.reading import load_training_checkpoint
from trainer.compare.fit_logs import read_scalars
from trainer.decoding.generate import speculative_generate
from trainer.decoding.proposers import NoProposer
from trainer.decoding.tree import DraftTree
from trainer.export.cli import main as export_main
from trainer.methods.eagle3.export import load_native, load_speculators
from trainer.methods.eagle3.proposer import Eagle3Proposer, Eagle3TreeProposer
from trainer.methods.eagle3.vocab_map import vocab_map_from_rows
from trainer.training.registry import load_drafter

pytestmark = pytest.mark.slow


def eagle3_override(run: Path, corpus, target: Path, max_steps: int, every_n: int, **model) -> dict:
    return merge(
        trainer_overrides(run, max_steps=max_steps, every_n=every_n, log_every_n_steps=every_n),
        data_overrides(corpus),
        {"model": {"init_args": {"target": str(target), "draft_vocab_size": 256, "ttt_steps": 3, **model}}},
    )


@pytest.fixture(scope="module")
def eagle3_run(tiny_corpus, tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("eagle3")
    override = eagle3_override(run, tiny_corpus, tiny_target, 6, 3, target_layers=[0, 1, 2])
    cli = fit("quickstart/eagle3.yaml", override, run)
    return run, cli


def _map(ckpt: Path) -> tuple[torch.Tensor, torch.Tensor]:
    state, _ = load_training_checkpoint(str(ckpt))
    return state["drafter.d2t"], state["drafter.t2d"]


def test_fit_logs_per_step_accuracy_and_records_the_drafter(eagle3_run, tiny_corpus):
    run, cli = eagle3_run
    metrics = cli.trainer.callback_metrics
    assert {"train/acc_0", "train/acc_2", "val/acc_1"} <= set(metrics)
    # the expected acceptance (with kl a metric whose whole-vocabulary log-partition is taken only on the steps whose
    # metrics Lightning writes, DraftObjective.metrics_due) reaches TensorBoard at exactly the steps the others do
    scalars = read_scalars(run / "tensorboard", ("train/acc_0", "train/alpha_0", "train/alpha_2"))
    assert len(scalars["train/acc_0"]) >= 2
    assert set(scalars["train/alpha_0"]) == set(scalars["train/alpha_2"]) == set(scalars["train/acc_0"])
    assert all(0.0 < value < 1.0 for value in scalars["train/alpha_0"].values())
    state, record = load_training_checkpoint(str(run / "checkpoints" / "last.ckpt"))
    assert record["kind"] == "eagle3" and record["config"]["aux_layers"] == [0, 1, 2]
    assert record["draft_tokens"] == 3 and record["target_layers"] == [0, 1, 2]
    assert all(k.startswith("drafter.") for k in state)  # the target is not in the checkpoint
    # the map is the one counted from the training rows
    dataset = cli.datamodule.train_dataset
    counts = np.bincount(np.asarray(dataset.ids)[:, 1:][np.asarray(dataset.trained)[:, 1:]], minlength=512)
    expected = sorted(sorted(range(512), key=lambda i: (-counts[i], i))[:256])
    assert (torch.arange(256) + state["drafter.d2t"]).tolist() == expected


def test_exports_reload_with_the_same_logits(eagle3_run, tmp_path):
    run, cli = eagle3_run
    drafter = cli.model.drafter.eval()
    ckpt = str(run / "checkpoints" / "last.ckpt")
    for fmt, loader in (("eagle3", load_native), ("eagle3-speculators", load_speculators)):
        out = tmp_path / fmt
        assert export_main(["--ckpt_path", ckpt, "--output_dir", str(out), "--format", fmt]) == 0
        reloaded = loader(str(out)).eval()
        g = torch.Generator().manual_seed(0)
        hidden = [torch.randn(1, 10, 64, generator=g) for _ in range(3)]
        tokens = torch.randint(0, 512, (1, 10), generator=g)
        emb = cli.model.target.model.get_input_embeddings()
        with torch.no_grad():
            a = list(drafter.unroll(emb, drafter.fuse(hidden), tokens, 3))
            b = list(reloaded.unroll(emb, reloaded.fuse(hidden), tokens, 3))
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]


def test_chain_and_tree_are_lossless_on_the_tiny_target(eagle3_run, tiny_target, tiny_corpus):
    run, _ = eagle3_run
    target = AutoModelForCausalLM.from_pretrained(tiny_target).to(torch.float64).eval()
    drafter = load_drafter(str(run / "checkpoints" / "last.ckpt"))[0].to(torch.float64)
    emb = target.get_input_embeddings()
    texts = [json.loads(line)["text"] for line in Path(tiny_corpus.heldout_file).read_text().splitlines()[:2]]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: far faster on one thread of a busy machine
    try:
        for text in texts:
            prompt = torch.tensor(tok(text[:300]).input_ids[:32])
            alone = speculative_generate(target, prompt, NoProposer(), k=0, max_new_tokens=16).tokens
            for proposer in (Eagle3Proposer(drafter, emb), Eagle3TreeProposer(drafter, emb, top_k=3, budget=8)):
                assert speculative_generate(target, prompt, proposer, k=4, max_new_tokens=16).tokens == alone
    finally:
        torch.set_num_threads(threads)


class RecordingProposer(Eagle3Proposer):
    """The chain proposer, recording each round's committed tokens and draft tree."""

    def __init__(self, drafter, embedding) -> None:
        super().__init__(drafter, embedding)
        self.rounds: list[tuple[torch.Tensor, DraftTree]] = []

    def propose(self, ctx):
        tree = super().propose(ctx)
        self.rounds.append((ctx.tokens.clone(), tree))
        return tree


def test_decoding_drafts_with_the_distributions_of_the_training_unroll(eagle3_run, tiny_target, tiny_corpus):
    """Every round of real speculative decoding on the tiny target (sampling, so that the drafts' full distributions
    are returned) drafts from exactly the distributions of the training-time unroll at the last committed position,
    computed from the target features the training step takes (FrozenTarget's hidden_layers) and fed the same draft
    tokens: the layer indices, the fused features, the rotary positions and the attention of cached drafting agree
    with training."""
    run, cli = eagle3_run
    target = cli.model.target.to(torch.float64)
    drafter = load_drafter(str(run / "checkpoints" / "last.ckpt"))[0].to(torch.float64).eval()
    emb = target.model.get_input_embeddings()
    text = json.loads(Path(tiny_corpus.heldout_file).read_text().splitlines()[0])["text"]
    from transformers import AutoTokenizer

    prompt = torch.tensor(AutoTokenizer.from_pretrained(tiny_target)(text[:300]).input_ids[:24])
    K, temperature = 5, 0.7
    proposer = RecordingProposer(drafter, emb)
    try:
        generator = torch.Generator().manual_seed(0)
        speculative_generate(target.model, prompt, proposer, K, 24, temperature=temperature, generator=generator)
        checked = 0
        for tokens, tree in proposer.rounds:
            if tree.tokens.numel() < K:
                continue  # the last rounds, shortened by the output budget
            stream = torch.cat([tokens, tree.tokens])[None]  # [1, T + K]: step i > 0 is fed draft i
            with torch.no_grad():
                out = target(tokens[None], hidden_layers=drafter.config.aux_layers)  # hidden states [1, T, H] each
                fused = drafter.fuse([h[:, :-1] for h in out.hidden_states])  # [1, T - 1, H]
                steps = list(drafter.unroll(emb, fused, tokens[None, 1:], K, data_tokens=stream))  # K x [1, T-1, Vd]
            for i, logits in enumerate(steps):
                p_draft = torch.softmax(logits[0, -1] / temperature, dim=-1)  # [Vd]
                expected = torch.zeros(512, dtype=torch.float64).index_add_(0, drafter.draft_ids(), p_draft)  # [V]
                torch.testing.assert_close(tree.probs[i].double(), expected, rtol=0, atol=1e-6)  # float32 draws
            checked += 1
        assert checked >= 3
    finally:
        target.to(torch.float32)


def test_resume_and_fine_tuning_keep_the_checkpoint_map(eagle3_run, tiny_corpus, tiny_target, tmp_path):
    run, _ = eagle3_run
    ckpt = run / "checkpoints" / "last.ckpt"
    original = _map(ckpt)
    # other data: the held-out file only, whose token counts give another map
    other = {"data": {"init_args": {"train_files": [str(tiny_corpus.heldout_file)], "max_documents": 3}}}
    fine = tmp_path / "fine"
    override = merge(eagle3_override(fine, tiny_corpus, tiny_target, 2, 2, init_from=str(ckpt)), other)
    cli = fit("quickstart/eagle3.yaml", override, fine)
    ds = cli.datamodule.train_dataset
    recount = vocab_map_from_rows([(ds.ids, ds.trained)], 512, 256)[0]
    assert not torch.equal(recount, original[0])  # a recount on this data would show
    tuned = _map(fine / "checkpoints" / "last.ckpt")
    assert torch.equal(tuned[0], original[0]) and torch.equal(tuned[1], original[1])
    # resuming: the checkpoint's map is restored over the one setup() counts. The checkpoint's map is replaced by
    # another valid one (ids 256..511), which no count of this data gives, so a recount would show.
    data = torch.load(ckpt, map_location="cpu", weights_only=True)
    data["state_dict"]["drafter.d2t"] = torch.full((256,), 256, dtype=torch.long)
    data["state_dict"]["drafter.t2d"] = torch.arange(512) >= 256
    assert not torch.equal(data["state_dict"]["drafter.d2t"], original[0])
    torch.save(data, tmp_path / "tampered.ckpt")
    resumed = tmp_path / "resumed"
    override = eagle3_override(resumed, tiny_corpus, tiny_target, 8, 4, target_layers=[0, 1, 2])
    cli = fit("quickstart/eagle3.yaml", override, resumed, ("--ckpt_path", str(tmp_path / "tampered.ckpt")))
    assert bool((cli.model.drafter.d2t == 256).all()) and int(cli.model.drafter.t2d.sum()) == 256
    assert bool((_map(resumed / "checkpoints" / "last.ckpt")[0] == 256).all())


def test_data_of_another_tokenizer_is_refused(tiny_corpus, tiny_target, tmp_path):
    """One tokenizer check for every objective: EAGLE-3 refuses data tokenized for another vocabulary, as KD does."""
    from trainer.data.corpus import prepare_corpus

    other = prepare_corpus(str(tmp_path / "other"), vocab_size=300, seed=1, max_files=20)
    run = tmp_path / "run"
    override = eagle3_override(run, tiny_corpus, tiny_target, 2, 2, target_layers=[0, 1, 2])
    override = merge(override, data_overrides(other))
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        fit("quickstart/eagle3.yaml", override, tmp_path / "run")


def test_the_drafter_and_the_data_take_different_seeds(tiny_corpus, tiny_target, tmp_path):
    """``model.seed`` and ``data.seed`` set apart (as bench/studies/long_context.py's --seed sets both, or a user sets
    one): the fit runs and logs its hyperparameters (Lightning refused to merge two different ``seed`` values)."""
    run = tmp_path / "run"
    override = eagle3_override(run, tiny_corpus, tiny_target, 1, 1, target_layers=[0, 1, 2], seed=1)
    cli = fit("quickstart/eagle3.yaml", override, run)
    assert cli.trainer.global_step == 1 and cli.model.hparams.seed == 1 and cli.datamodule.seed == 0
