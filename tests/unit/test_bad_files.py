"""Broken or foreign files the user hands draftsmith end in one error naming the file: truncated or crafted
checkpoints, empty or truncated safetensors, non-UTF-8 text data, missing data paths (checked when the datamodule is
built), and data of another tokenizer (refused from the tokenizer files, before anything is tokenized)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from jsonargparse import Namespace

from trainer.checkpoints.reading import load_training_checkpoint
from trainer.data.shard_datamodule import ShardDataModule
from trainer.data.sources import DocumentReader, check_data_paths
from trainer.data.text import TextDataModule
from trainer.data.vocab import check_data_tokenizer, load_tokenizer_if_present
from trainer.export.files import read_folder, write_folder
from trainer.interface.errors import CheckpointError, DataError, ModelFolderError, PathError, TokenizerError, UserError
from trainer.models.target import FrozenTarget, TargetEmbeddings, load_target_tensors, weight_map

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pre_move"
TINY_TARGET = FIXTURES / "tiny_target"


# ------------------------------------------------------------------------------------------------- checkpoints


class Foreign:
    """A class no draftsmith checkpoint holds."""

    def __init__(self) -> None:
        self.value = 1


class RunsACommand:
    """Unpickling this calls os.system (what weights_only must refuse before running anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _truncated_copy(tmp_path: Path, keep: float) -> Path:
    data = (FIXTURES / "kd.ckpt").read_bytes()
    out = tmp_path / "cut.ckpt"
    out.write_bytes(data[: int(len(data) * keep)])
    return out


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_truncated_checkpoint_is_named_as_truncated(tmp_path, keep):
    cut = _truncated_copy(tmp_path, keep)
    with pytest.raises(CheckpointError, match=rf"checkpoint {cut}: truncated .*not a whole checkpoint") as err:
        load_training_checkpoint(str(cut))
    assert "miniz" not in str(err.value) and "PytorchStreamReader" not in str(err.value)
    assert err.value.hint


def test_an_empty_file_or_another_kind_of_file_is_not_a_checkpoint(tmp_path):
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"{empty}: empty file \(0 bytes\)"):
        load_training_checkpoint(str(empty))
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint at all\n" * 20)
    with pytest.raises(CheckpointError, match=rf"{text}: not a checkpoint \(not a file torch.save wrote\)"):
        load_training_checkpoint(str(text))
    with pytest.raises(PathError, match="does not exist"):
        load_training_checkpoint(str(tmp_path / "nope.ckpt"))


def test_a_pickle_of_a_foreign_class_is_refused_naming_it(tmp_path):
    path = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}, "extra": Foreign()}, path)
    with pytest.raises(CheckpointError, match=r"refused: it holds objects no checkpoint draftsmith writes") as err:
        load_training_checkpoint(str(path))
    message = str(err.value)
    assert str(path) in message and f"{__name__}.Foreign" in message and "nothing in it was run" in message
    assert "file an issue" not in message and "weights_only=True compatible" not in message


def test_a_pickle_that_would_run_a_command_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": RunsACommand(marker)}, path)
    with pytest.raises(CheckpointError, match=r"refused.*system.*nothing in it was run"):
        load_training_checkpoint(str(path))
    assert not marker.exists()
    # the draftsmith export path reads it the same way
    from trainer.export.cli import export

    with pytest.raises(CheckpointError, match=str(path)):
        export(str(path), str(tmp_path / "out"))
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_deepspeed_folder_is_screened_before_deepspeed_unpickles_it(tmp_path):
    """DeepSpeed's consolidation loads the folder's files with weights_only=False: a file naming anything beyond
    DeepSpeed's own records is refused before that."""
    marker = tmp_path / "ran"
    folder = tmp_path / "last.ckpt" / "checkpoint"
    folder.mkdir(parents=True)
    torch.save({"module": {}, "drafter": {}}, folder / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": RunsACommand(marker)}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt: refused.*system"):
        load_training_checkpoint(str(tmp_path / "last.ckpt"))
    assert not marker.exists()


def _distributed_folder(path: Path) -> dict[str, torch.Tensor]:
    """An FSDP2-style distributed checkpoint folder written in one process: the model's tensors and an optimizer
    entry in ``__0_0.distcp`` (indexed by ``.metadata``), Lightning's other entries in ``meta.pt``."""
    import torch.distributed.checkpoint as dcp

    weights = {"net.head.weight": torch.randn(5, 3), "net.norm.weight": torch.randn(3).bfloat16()}
    state = {"state_dict": weights, "optimizer_0": {"state": {"net.head.weight": {"exp_avg": torch.ones(5, 3)}}}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 2, "drafter": {"kind": "toy"}}, path / "meta.pt")
    return weights


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_distributed_checkpoint_folder_reads_and_a_broken_one_is_named(tmp_path):
    folder = tmp_path / "last.ckpt"
    weights = _distributed_folder(folder)
    state, record = load_training_checkpoint(str(folder))
    assert record == {"kind": "toy"} and state.keys() == weights.keys()  # the model's tensors only
    for key, value in weights.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="distributed checkpoint folder"):
        load_training_checkpoint(str(folder))
    (folder / "meta.pt").unlink()
    with pytest.raises(PathError, match="without its meta.pt"):
        load_training_checkpoint(str(folder))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_each_checkpoint_layout_is_told_and_its_client_state_found(tmp_path):
    """One rule for the three layouts, which export, eval and the fingerprint check all follow."""
    from trainer.checkpoints.reading import checkpoint_layout, client_state_file
    from trainer.training.fingerprint import recorded_fingerprints

    single = tmp_path / "single.ckpt"
    torch.save({"state_dict": {}, "frozen_models": {"target": {"config": "a"}}}, single)
    deepspeed = tmp_path / "zero.ckpt"
    (deepspeed / "checkpoint").mkdir(parents=True)
    distributed = tmp_path / "fsdp.ckpt"
    _distributed_folder(distributed)
    assert [checkpoint_layout(p) for p in (single, deepspeed, distributed, tmp_path)] == [
        "file", "deepspeed", "distributed", None,
    ]  # fmt: skip
    assert client_state_file(deepspeed) is None  # no rank-0 model states yet: nothing to read
    torch.save({"frozen_models": {"target": {"config": "b"}}}, deepspeed / "checkpoint" / "mp_rank_00_model_states.pt")
    assert client_state_file(deepspeed) == deepspeed / "checkpoint" / "mp_rank_00_model_states.pt"
    assert client_state_file(distributed) == distributed / "meta.pt" and client_state_file(tmp_path) is None
    assert recorded_fingerprints(single) == {"target": {"config": "a"}}
    assert recorded_fingerprints(deepspeed) == {"target": {"config": "b"}}
    assert recorded_fingerprints(distributed) == {} and recorded_fingerprints(tmp_path) == {}


def test_a_whole_checkpoint_still_loads():
    state, record = load_training_checkpoint(str(FIXTURES / "kd.ckpt"))
    assert state and record["kind"]


# ------------------------------------------------------------------------------------------------- safetensors


def _target_copy(tmp_path: Path, weights: bytes | None) -> Path:
    folder = tmp_path / "target"
    shutil.copytree(TINY_TARGET, folder)
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


@pytest.mark.parametrize(("cut", "state"), [(0, r"empty \(0 bytes\)"), (0.5, "truncated or not a safetensors file")])
def test_a_broken_target_safetensors_is_named(tmp_path, cut, state):
    data = (TINY_TARGET / "model.safetensors").read_bytes()
    folder = _target_copy(tmp_path, data[: int(len(data) * cut)])
    file = folder / "model.safetensors"
    for read in (
        lambda: weight_map(str(folder)),
        lambda: load_target_tensors(str(folder), {"embedding": ("model.embed_tokens.weight",)}),
        lambda: TargetEmbeddings.from_pretrained(str(folder)),
        lambda: FrozenTarget.from_pretrained(str(folder)),
    ):
        with pytest.raises(ModelFolderError, match=rf"target '{folder}': {file} is {state}") as err:
            read()
        assert "header too small" not in str(err.value).split("(")[0]


@pytest.mark.parametrize("cut", [0, 0.5])
def test_a_broken_drafter_export_is_named(tmp_path, cut):
    folder = write_folder(tmp_path / "export", {"model_type": "x"}, {"w": torch.ones(64, 64)})
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ModelFolderError, match=rf"an EAGLE-3 export: {folder / 'model.safetensors'} is "):
        read_folder(folder, "an EAGLE-3 export")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=r"config.json is not valid JSON"):
        read_folder(folder, "an EAGLE-3 export")


# ------------------------------------------------------------------------------------------------- text data


def test_a_text_file_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\ncaf\u00e9 au lait\n".encode("latin-1"))
    reader = DocumentReader("text", "text", "messages", str(tmp_path / "cache"))
    with pytest.raises(DataError, match=rf"{path}: not UTF-8 text at byte 14 \(line 2") as err:
        reader.read_file(str(path))
    assert "UTF-8" in err.value.hint
    good = tmp_path / "utf8.txt"
    good.write_text("caf\u00e9\n", encoding="utf-8")
    assert reader.read_file(str(good))[0] == ["caf\u00e9\n"]


# ------------------------------------------------------------------------------------------------- data paths


def test_a_missing_data_path_is_refused_when_the_datamodule_is_built(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "a"}\n')
    missing = tmp_path / "heldout.jsonl"
    with pytest.raises(PathError, match=rf"data.val_files: data file not found: {missing}"):
        TextDataModule(tokenizer=str(TINY_TARGET), train_files=[str(train)], val_files=[str(missing)])
    with pytest.raises(PathError, match=rf"data.train_files: data file not found: {missing}"):
        TextDataModule(tokenizer=str(TINY_TARGET), train_files=[str(missing)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(PathError, match=r"data.train_files: data folder .*empty holds no data file"):
        TextDataModule(tokenizer=str(TINY_TARGET), train_files=[str(tmp_path / "empty")])
    with pytest.raises(PathError, match=r"data.train_files: data pattern .*\*.parquet matches no data file"):
        TextDataModule(tokenizer=str(TINY_TARGET), train_files=[str(tmp_path / "*.parquet")])
    TextDataModule(tokenizer=str(TINY_TARGET), train_files=[str(train)], val_files=[str(tmp_path / "*.jsonl")])


def test_check_data_paths_reads_a_recipe_data_section(tmp_path):
    train = tmp_path / "a.txt"
    train.write_text("hello")
    check_data_paths({"train_files": [str(train)], "val_files": None, "tokenizer": "x"})
    # chat data is never read from .txt files
    with pytest.raises(PathError, match=r"data.train_files: data folder .* holds no data file \(\.jsonl"):
        check_data_paths(Namespace(train_files=[str(tmp_path)], format="chat"))
    with pytest.raises(PathError, match=rf"data.shards: {tmp_path / 'shards'}: no such folder"):
        check_data_paths({"shards": str(tmp_path / "shards")})
    (tmp_path / "shards").mkdir()
    with pytest.raises(PathError, match=r"data.shards: .*: no manifest.json \(0 finished shards there\)"):
        ShardDataModule(str(tmp_path / "shards"))


# ------------------------------------------------------------------------------------------------- tokenizers


def _tokenizer_copy(tmp_path: Path, name: str, swap: bool) -> Path:
    """The tiny target's tokenizer in ``tmp_path/name``; with ``swap`` two of its token ids exchanged (another
    tokenizer of the same size)."""
    folder = tmp_path / name
    folder.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TARGET / file, folder / file)
    if swap:
        data = json.loads((folder / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        a, b = "a", "b"
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    same = _tokenizer_copy(tmp_path, "same", swap=False)
    other = _tokenizer_copy(tmp_path, "other", swap=True)
    target_tok = load_tokenizer_if_present(str(TINY_TARGET))
    assert len(load_tokenizer_if_present(str(other))) == len(target_tok)
    width = len(target_tok)
    check_data_tokenizer(SimpleNamespace(tokenizer_path=str(same)), str(TINY_TARGET), target_tok, width, width)
    with pytest.raises(TokenizerError, match=rf"the data's tokenizer {other} .* is not the tokenizer of") as err:
        check_data_tokenizer(SimpleNamespace(tokenizer_path=str(other)), str(TINY_TARGET), target_tok, width, width)
    assert str(TINY_TARGET) in str(err.value)
    check_data_tokenizer(SimpleNamespace(tokenizer_path=None), str(TINY_TARGET), target_tok, width, width)


def test_a_target_without_a_tokenizer_is_named_as_such(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(TINY_TARGET / "config.json", bare / "config.json")
    assert load_tokenizer_if_present(str(bare)) is None
    with pytest.raises(TokenizerError, match=rf"{bare}: holds no tokenizer \(none of tokenizer.json"):
        check_data_tokenizer(SimpleNamespace(tokenizer_path=str(TINY_TARGET)), str(bare), None, 512, 512)


def test_the_model_refuses_the_data_tokenizer_before_anything_is_tokenized(tmp_path, monkeypatch):
    """TextDataModule asks the fitted module (``check_data_tokenizer(datamodule)``) before it reads or tokenizes:
    Lightning runs the datamodule's prepare_data and setup before the module's setup."""
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "a = 1"}\n' * 50)
    other = _tokenizer_copy(tmp_path, "other", swap=True)
    target_tok = load_tokenizer_if_present(str(TINY_TARGET))

    class Module:
        def check_data_tokenizer(self, datamodule) -> None:
            check_data_tokenizer(datamodule, str(TINY_TARGET), target_tok, len(target_tok), len(target_tok))

    def tokenized(self):
        raise AssertionError("the data was read and tokenized before the tokenizer check")

    monkeypatch.setattr(TextDataModule, "_build", tokenized)
    dm = TextDataModule(tokenizer=str(other), train_files=[str(train)], cache_dir=str(tmp_path / "cache"))
    dm.trainer = SimpleNamespace(lightning_module=Module())
    with pytest.raises(TokenizerError, match="vocabulary mismatch"):
        dm.prepare_data()
    with pytest.raises(TokenizerError, match="vocabulary mismatch"):
        dm.setup("fit")


def test_every_error_here_is_a_user_error():
    for cls in (CheckpointError, DataError, ModelFolderError, PathError, TokenizerError):
        assert issubclass(cls, UserError)


def test_an_export_onto_a_full_disk_is_named_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (no OSError): the export names the file and says
    what to do, and removes the partial file, which would otherwise read as a truncated export."""
    from safetensors import SafetensorError

    import trainer.export.files as files

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(files, "save_file", full_disk)
    with pytest.raises(PathError, match=r"model\.safetensors: could not be written .*No space left") as err:
        files.write_folder(tmp_path / "out", {"a": 1}, {"w": torch.zeros(2)})
    assert err.value.hint and "--output_dir" in err.value.hint
    assert list((tmp_path / "out").iterdir()) == []
