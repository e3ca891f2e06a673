"""Packing with document masking (trainer/models/documents.py's convention): the target runs a packed row as its
documents alone; the data module serves the packer's exact boundaries; the KD loss sums each document's own loss."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.helpers import text_datamodule, tiny_llama, tiny_model, write_jsonl
from trainer.interface.errors import CheckpointError, RecipeError
from trainer.models.target import FrozenTarget

# --------------------------------------------------------------------------------------------------- the target


def packed_row(lengths: list[list[int]], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [B, S] and document_ids [B, S] for rows made of documents of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (sum(row),), generator=generator) for row in lengths]
    documents = [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths]
    return torch.stack(ids), torch.stack(documents)


def each_alone(document_ids: torch.Tensor, b: int) -> list[slice]:
    """The span of every document of row b."""
    row = document_ids[b].tolist()
    starts = [t for t in range(len(row)) if t == 0 or row[t] != row[t - 1]] + [len(row)]
    return [slice(starts[i], starts[i + 1]) for i in range(len(starts) - 1)]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_packed_row_gives_each_documents_own_hidden_states_and_logits(implementation):
    model = tiny_llama(0, layers=2, attn_implementation=implementation)
    target = FrozenTarget(model)
    ids, documents = packed_row([[5, 1, 9, 3], [11, 7]], vocab=128)  # [2, 18]
    out = target(ids, hidden_layers=(1, 2), document_ids=documents)
    final = target.final_hidden(ids, document_ids=documents)  # [B, S, H]
    for b in range(ids.shape[0]):
        for span in each_alone(documents, b):
            alone = target(ids[b : b + 1, span], hidden_layers=(1, 2))
            torch.testing.assert_close(out.logits[b, span], alone.logits[0], atol=1e-5, rtol=0)
            for got, want in zip(out.hidden_states, alone.hidden_states, strict=True):
                torch.testing.assert_close(got[b, span], want[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(final[b, span], alone.hidden_states[1][0], atol=1e-5, rtol=0)
    plain = target(ids).logits  # without document_ids the second document sees the first
    assert not torch.allclose(plain[0, 5:6], out.logits[0, 5:6], atol=1e-5)


def test_a_sliding_window_model_keeps_its_window_within_documents():
    """Mistral with a 3-token window: the position_ids path (no explicit mask) runs each document alone, window kept."""
    target = FrozenTarget(tiny_model("mistral", 1, sliding_window=3))
    ids, documents = packed_row([[6, 2, 8]], vocab=96, seed=1)
    out = target(ids, document_ids=documents)
    for span in each_alone(documents, 0):
        torch.testing.assert_close(out.logits[0, span], target(ids[:, span]).logits[0], atol=1e-5, rtol=0)


def test_document_ids_refuse_a_cache_and_explicit_positions():
    target = FrozenTarget(tiny_llama(0))
    ids, documents = packed_row([[3, 4]], vocab=128)
    with pytest.raises(ValueError, match="KV cache"):
        target(ids, document_ids=documents, use_cache=True)
    with pytest.raises(ValueError, match="exclusive"):
        target(ids, document_ids=documents, position_ids=torch.arange(7)[None])


# ----------------------------------------------------------------------------------------------------------- data

DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 4) for i in range(14)]


def alone(tok, docs: list[str]) -> tuple[list[int], list[int]]:
    """Each document tokenized alone with its EOS, concatenated: the stream and the document of every token."""
    stream, owner = [], []
    for d, text in enumerate(docs):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        stream += ids
        owner += [d] * len(ids)
    return stream, owner


def dense(owners: list[int]) -> list[int]:
    """Documents renumbered from 0 along a row, one more at every change."""
    out = [0]
    for a, b in zip(owners, owners[1:]):
        out.append(out[-1] + (a != b))
    return out


def test_batches_carry_the_packers_document_boundaries(tiny_corpus, tok, tmp_path):
    """document_ids against each document tokenized alone, a document holding EOS inside included (boundaries are not
    guessed from EOS); a document's first token is no label."""
    docs = DOCS[:5] + [f"a = 1{tok.eos_token}b = 2\n"] + DOCS[5:]
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    seq = 16
    dm = text_datamodule(
        tiny_corpus, tmp_path, train_files=[data], seq_len=seq, batch_size=3, shuffle=False, document_masking=True
    )
    dm.setup("fit")
    stream, owner = alone(tok, docs)
    assert stream.count(tok.eos_token_id) == len(docs) + 1
    first = [t == 0 or owner[t] != owner[t - 1] for t in range(len(stream))]
    assert len(dm.train_dataset) == (len(stream) - 1) // seq  # no row lacks a trained label here
    for r in range(len(dm.train_dataset)):
        item = dm.train_dataset[r]
        span = range(r * seq, r * seq + seq)
        assert item["input_ids"].tolist() == [stream[t] for t in span]
        assert item["document_ids"].tolist() == dense([owner[t] for t in span])
        assert item["loss_mask"].tolist() == [not first[t + 1] for t in span]
    batch = next(iter(dm.train_dataloader()))
    assert batch["document_ids"].shape == (3, seq) and batch["document_ids"].dtype == torch.long
    assert (batch["document_ids"][:, 0] == 0).all() and (batch["document_ids"].diff(dim=1) >= 0).all()
    val = text_datamodule(
        tiny_corpus, tmp_path, train_files=[data], val_files=[data], seq_len=seq, document_masking=True
    )
    val.setup("fit")
    assert next(iter(val.val_dataloader()))["document_ids"].shape[1] == seq


def test_document_masking_without_packing_is_refused(tiny_corpus, tmp_path):
    with pytest.raises(RecipeError, match="document_masking.*pack"):
        text_datamodule(tiny_corpus, tmp_path, train_files=[], pack=False, document_masking=True)


# ----------------------------------------------------------------------------------------------------- objectives


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_llama(4, vocab=64, dtype=torch.float32).save_pretrained(path)
    return str(path)


def packed_batch(lengths: list[int], vocab: int = 64, seed: int = 2) -> dict[str, torch.Tensor]:
    """One packed row of documents of these lengths: a document's last position (whose label would be the next
    document's first token) is not trained, as TextDataModule serves it with document masking."""
    ids, documents = packed_row([lengths], vocab, seed)  # [1, S] each
    mask = torch.ones_like(ids, dtype=torch.bool)  # [1, S]
    mask[0, :-1] = documents[0, 1:] == documents[0, :-1]
    labels = torch.where(mask, ids.roll(-1, 1), torch.full_like(ids, -100))  # [1, S]
    return {"input_ids": ids, "labels": labels, "loss_mask": mask, "document_ids": documents}


def per_document_sum(loss_of, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row's loss times its trained positions, and the sum of each document's loss (computed alone, as
    a row of its own) times its trained positions."""
    packed = loss_of(batch) * batch["loss_mask"].sum()
    total = torch.zeros((), dtype=packed.dtype)
    for span in each_alone(batch["document_ids"], 0):
        alone = {k: v[:, span] for k, v in batch.items() if k != "document_ids"}
        total = total + loss_of(alone) * alone["loss_mask"].sum()
    return packed, total


@pytest.mark.parametrize("loss", ["kl", "tv"])
def test_kd_loss_of_a_packed_row_is_the_sum_of_each_documents_own(target_dir, loss):
    from trainer.methods.draft_model.kd import KnowledgeDistillation

    model = KnowledgeDistillation(
        target=target_dir, drafter_config={"num_hidden_layers": 1}, loss=loss, loss_chunk_size=5, alpha=0.3
    )
    batch = packed_batch([6, 3, 8, 5])
    packed, total = per_document_sum(lambda b: model.compute_loss(b)[0], batch)
    torch.testing.assert_close(packed, total, atol=1e-5, rtol=1e-5)
    unmasked = model.compute_loss({k: v for k, v in batch.items() if k != "document_ids"})[0]
    assert not torch.isclose(unmasked * batch["loss_mask"].sum(), total, atol=1e-3)


def test_on_policy_distills_a_packed_row_per_document_and_prompts_stay_in_the_first(target_dir):
    from trainer.methods.draft_model.on_policy import OnPolicyDistillation

    model = OnPolicyDistillation(
        target=target_dir, drafter_config={"num_hidden_layers": 1}, lmbda=0.0, prompt_len=9, loss_chunk_size=4
    ).eval()
    batch = packed_batch([4, 7, 5], seed=3)
    packed, total = per_document_sum(lambda b: model.compute_loss(b)[0], batch)
    torch.testing.assert_close(packed, total, atol=1e-5, rtol=1e-5)
    generated = model.generate(model.student, batch, sample_seed=0)
    assert int(generated.prompt_lengths.max()) == 4  # the first document, not prompt_len tokens across two


def test_objectives_that_ignore_document_ids_refuse_document_masking(tiny_corpus, tmp_path):
    from trainer.methods.draft_model.pretrain import CausalLMPretraining
    from trainer.training.objective import DraftObjective

    class Ignoring(DraftObjective):
        """An objective whose forwards would attend across documents."""

    data = text_datamodule(tiny_corpus, tmp_path, train_files=[], document_masking=True)
    with pytest.raises(RecipeError, match="document_masking=true: Ignoring does not pass document_ids"):
        Ignoring().check_document_masking(data)
    CausalLMPretraining(tokenizer=tiny_corpus.tokenizer_dir).check_document_masking(data)  # it honours them


def test_precompute_refuses_document_masking(tiny_corpus, tmp_path, target_dir):
    from trainer.data.precompute import precompute
    from trainer.interface.errors import UsageError

    data = text_datamodule(tiny_corpus, tmp_path, train_files=[], document_masking=True)
    with pytest.raises(UsageError, match="document_masking=true: precomputed shards store no document boundaries"):
        precompute(data, target_dir, str(tmp_path / "shards"))
    assert not (tmp_path / "shards").exists()


# ---------------------------------------------------------------------------------------------- mixed-length rows


def test_mixed_length_steps_hold_equal_tokens_and_serve_every_label_once(tiny_corpus, tok, tmp_path):
    """Long steps serve batch_size / k rows of long_seq_len, short steps batch_size rows of seq_len cut as packing at
    seq_len would; over an epoch every label of the stream is served exactly once, with document_ids of its row."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS * 3])
    seq, k, batch = 8, 4, 4
    options = dict(train_files=[data], seq_len=seq, batch_size=batch, long_seq_len=k * seq, document_masking=True)
    dm = text_datamodule(tiny_corpus, tmp_path, long_fraction=0.5, shuffle=False, **options)
    dm.setup("fit")
    stream, owner = alone(tok, DOCS * 3)
    units, per_batch = len(dm.train_dataset), batch // k  # long rows in the data, and per step
    assert units == (len(stream) - 1) // (k * seq)
    batches = list(dm.train_dataloader())
    assert len(batches) == units // per_batch
    assert sum(b["input_ids"].shape[1] == k * seq for b in batches) == round(0.5 * len(batches))
    served = []
    for i, b in enumerate(batches):
        assert b["input_ids"].numel() == batch * seq  # equal tokens per step
        long = b["input_ids"].shape == (per_batch, k * seq)
        assert long or b["input_ids"].shape == (batch, seq)
        first = i * per_batch * k * seq  # shuffle=False: step i serves long rows i * per_batch ...
        starts = [first + r * b["input_ids"].shape[1] for r in range(b["input_ids"].shape[0])]
        for r, start in enumerate(starts):
            span = range(start, start + b["input_ids"].shape[1])
            assert b["input_ids"][r].tolist() == [stream[t] for t in span]
            assert b["labels"][r][b["loss_mask"][r]].tolist() == [
                stream[t + 1] for t in span if owner[t + 1] == owner[t]
            ]
            assert b["document_ids"][r].tolist() == dense([owner[t] for t in span])
            served += [t + 1 for t in span]
    assert served == list(range(1, len(batches) * per_batch * k * seq + 1))  # each label once, none lost

    def steps(seed: int) -> list[torch.Tensor]:
        module = text_datamodule(tiny_corpus, tmp_path, long_fraction=0.5, seed=seed, **options)
        return [b["input_ids"] for b in module.train_dataloader()]

    first_run = steps(1)
    assert all(torch.equal(a, b) for a, b in zip(first_run, steps(1), strict=True))  # a function of the seed
    assert [a.shape for a in first_run] != [a.shape for a in steps(2)]  # and another seed, another schedule


class Recorder(L.LightningModule):
    """Records every training batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return (self.w * batch["input_ids"].float().mean() - 1.0) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(dm, root, max_steps: int, ckpt_every: int | None = None, ckpt_path: str | None = None) -> list[dict]:
    callbacks = [ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=ckpt_every, save_top_k=-1)]
    model = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(ckpt_every), callbacks=callbacks if ckpt_every else [], limit_val_batches=0,
        default_root_dir=str(root), max_steps=max_steps,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("long_fraction", [0.0, 0.4])
def test_resume_serves_the_uninterrupted_batches(tiny_corpus, tmp_path, long_fraction):
    """Document masking alone, and with mixed lengths: a checkpoint mid-epoch, resumed into the next epoch, serves
    the batches (tokens, document_ids, lengths) of an uninterrupted run."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS * 2])
    options = dict(train_files=[data], seq_len=8, batch_size=4, document_masking=True, seed=3)
    if long_fraction:
        options.update(long_seq_len=16, long_fraction=long_fraction)

    def module():
        return text_datamodule(tiny_corpus, tmp_path, **options)

    probe = module()
    n = len(probe.train_dataloader())  # batches per epoch
    total, stop = n + n // 2, n // 2 + 1
    straight = fit(module(), tmp_path / "a", total)
    first = fit(module(), tmp_path / "b", stop, ckpt_every=stop)
    checkpoint = str(tmp_path / "b" / f"step={stop}.ckpt")
    rest = fit(module(), tmp_path / "c", total, ckpt_path=checkpoint)
    assert len(straight) == total and len(first) + len(rest) == total
    for got, want in zip(first + rest, straight, strict=True):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    if long_fraction:
        assert {b["input_ids"].shape[1] for b in straight} == {8, 16}
        changed = dict(options, long_fraction=0.6)
        with pytest.raises(CheckpointError, match="long_fraction=0.4.*data.long_fraction=0.6"):
            fit(text_datamodule(tiny_corpus, tmp_path, **changed), tmp_path / "d", total, ckpt_path=checkpoint)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"long_seq_len": 20}, r"data.long_seq_len=20 must be a multiple \(2x or more\) of data.seq_len=8"),
        ({"long_seq_len": 8}, "data.long_seq_len=8 must be a multiple"),
        ({"long_seq_len": 24}, "data.batch_size=4 must be divisible by data.long_seq_len / data.seq_len = 3"),
        ({"long_seq_len": 16, "pack": False}, "data.long_seq_len needs data.pack=true"),
        ({"long_fraction": 0.5}, "data.long_fraction=0.5 needs data.long_seq_len"),
        ({"long_seq_len": 16, "long_fraction": 1.5}, r"data.long_fraction=1.5: a share of the training steps"),
    ],
)
def test_mixed_length_settings_that_cannot_keep_tokens_equal_are_refused(tiny_corpus, tmp_path, options, message):
    with pytest.raises(RecipeError, match=message):
        text_datamodule(tiny_corpus, tmp_path, train_files=[], seq_len=8, batch_size=4, **options)


def test_long_rows_beyond_the_targets_context_are_refused_naming_long_seq_len(tiny_corpus, tmp_path, target_dir):
    from trainer.methods.draft_model.kd import KnowledgeDistillation

    model = KnowledgeDistillation(target=target_dir, drafter_config={"num_hidden_layers": 1})
    data = text_datamodule(tiny_corpus, tmp_path, train_files=[], seq_len=128, batch_size=4, long_seq_len=512)
    with pytest.raises(RecipeError, match="data.long_seq_len=512 is beyond the context .*max_position_embeddings=256"):
        model.check_data_tokenizer(data)


def test_the_planner_plans_the_step_of_the_longest_rows():
    """A recipe of mixed lengths is planned at whichever of its two steps needs more activations (the long one on a
    tie); --seq_len plans the step it names."""
    from pathlib import Path

    from trainer.planner import plan_from_recipe

    kd = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "kd.yaml")  # batch 8 x 256
    mixed = ["--data.init_args.long_seq_len", "2048", "--data.init_args.long_fraction", "0.25"]
    plan = plan_from_recipe([kd], target="llama-3.2-1b", overrides=mixed)
    short = plan_from_recipe([kd], target="llama-3.2-1b", batch=8, seq=256)
    long = plan_from_recipe([kd], target="llama-3.2-1b", batch=1, seq=2048)
    assert plan.activations == max(short.activations, long.activations)
    expected = long if long.activations >= short.activations else short
    assert (plan.batch, plan.seq) == (expected.batch, expected.seq)
    assert plan_from_recipe([kd], target="llama-3.2-1b", overrides=mixed, seq=256).seq == 256
    unmixed = plan_from_recipe([kd], target="llama-3.2-1b", overrides=mixed[:2])  # long_fraction 0: no long step
    assert (unmixed.batch, unmixed.seq) == (8, 256)
