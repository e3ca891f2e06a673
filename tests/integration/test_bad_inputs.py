"""A table of user mistakes through the real ``draftsmith`` command line: every row ends with exit status 2, the last
line (or the line before a ``hint:`` line) names the file, key or value at fault, the output holds no traceback, and
nothing is left behind that a corrected rerun into the same folder would trip over (no checkpoint, no held lock; for
some rows the corrected command is run there and succeeds).

Every row is a fresh process (tests/cli_server.py forks one that has imported ``trainer.cli``, so that a row costs its
own work, not ten seconds of imports); one fit setup serves them all: the tiny corpus, a random 2-layer target with
its tokenizer, and shards precomputed from a few documents. ``test_the_console_script_ends_a_user_error_in_one_line``
runs the installed ``draftsmith`` script itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

from tests.cli_server import CliResult, CliServer
from tests.recipe_runs import RECIPES, ROOT, TINY_STUDENT, save_random_target

FIXTURES = ROOT / "tests" / "fixtures" / "pre_move"
DOCS = 6  # training documents: enough rows for a few batches of 4 x 64 tokens
LOCK_FILE = ".draftsmith-fit.lock"


# ---------------------------------------------------------------------------------------------------------- setup


class RunsACommand:
    """Unpickling this calls os.system (a crafted checkpoint: weights_only must refuse it before running anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@dataclass
class World:
    """What the rows share, built once."""

    root: Path
    corpus: object
    target: Path
    shards: Path
    other_tokenizer: Path
    drafter_export: Path
    chat_input: Path
    other_target: Path  # a second random target of the same shapes (other weights)
    medusa_export: Path  # vLLM Medusa heads exported from a checkpoint trained against ``target``
    mtp_checkpoint: Path  # an MTP pre-training checkpoint whose trunk is ``target``'s weights


@pytest.fixture(scope="module")
def world(tiny_corpus, tmp_path_factory) -> World:
    from transformers import AutoTokenizer

    from trainer.data.precompute import main as precompute_main
    from trainer.export.cli import export

    root = tmp_path_factory.mktemp("bad_inputs")
    target = save_random_target(root / "target", tiny_corpus.tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(tiny_corpus.tokenizer_dir)
    other = root / "other_tokenizer"  # one token more: another tokenizer hash, another length
    tok.add_special_tokens({"additional_special_tokens": ["<|other|>"]})
    tok.save_pretrained(other)
    shards = root / "shards"
    data = {"class_path": "trainer.data.text.TextDataModule", "init_args": _text_data(tiny_corpus)}
    argv = ["--target", str(target), "--output_dir", str(shards), "--data", json.dumps(data), "--progress", "false"]
    assert precompute_main([*argv, "--samples_per_shard", "64", "--batch_size", "8", "--top_logprobs", "8"]) == 0
    drafter, _ = export(str(FIXTURES / "medusa1.ckpt"), str(root / "medusa1_export"))
    chat = root / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]})
    )
    other_target = save_random_target(root / "other_target", tiny_corpus.tokenizer_dir, seed=1)
    medusa = _export_of_heads_for(target, root)
    return World(
        root, tiny_corpus, target, shards, other, Path(drafter), chat, other_target, medusa, _mtp_for(target, root)
    )


def _export_of_heads_for(target: Path, root: Path) -> Path:
    """``draftsmith export`` of Medusa heads whose training checkpoint recorded ``target``'s fingerprint."""
    from transformers import AutoConfig

    from trainer.export.cli import export
    from trainer.methods.medusa import kind as medusa_kind
    from trainer.methods.medusa.module import MedusaConfig, MedusaDrafter
    from trainer.training.fingerprint import fingerprint

    config = AutoConfig.from_pretrained(target)
    heads = MedusaDrafter(MedusaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_heads=2))
    checkpoint = {
        "state_dict": {f"drafter.{k}": v for k, v in heads.state_dict().items()},
        "drafter": medusa_kind.make_record(heads.config, str(target), config).to_dict(),
        "frozen_models": {"target": fingerprint(str(target), config)},
    }
    torch.save(checkpoint, root / "medusa.ckpt")
    folder, _ = export(str(root / "medusa.ckpt"), str(root / "medusa_export"))
    return Path(folder)


def _mtp_for(target: Path, root: Path) -> Path:
    """An MTP pre-training checkpoint (modules and the trunk trained with them) whose trunk is ``target``'s."""
    from transformers import AutoModelForCausalLM

    from trainer.methods.mtp import record as mtp_record
    from trainer.methods.mtp.module import MTPConfig, MTPDrafter

    trunk = AutoModelForCausalLM.from_pretrained(target)
    config = MTPConfig.for_trunk(trunk.config, depth=1)
    drafter = MTPDrafter(config, trunk)
    record = mtp_record.make_record(config, None, ["LlamaForCausalLM"], with_trunk=True, tokenizer=str(target))
    state = {f"drafter.{k}": v for k, v in drafter.state_dict().items()}
    torch.save({"state_dict": state, "drafter": record.to_dict()}, root / "mtp.ckpt")
    return root / "mtp.ckpt"


@pytest.fixture(scope="module")
def cli():
    with CliServer() as server:
        yield server


def _text_data(corpus, **extra) -> dict:
    return {
        "tokenizer": str(corpus.tokenizer_dir),
        "train_files": [str(corpus.train_file)],
        "val_files": [str(corpus.heldout_file)],
        "seq_len": 64,
        "batch_size": 4,
        "max_documents": DOCS,
        "cache_dir": str(Path(corpus.out_dir) / "tokenized"),
        **extra,
    }


@dataclass
class Ctx:
    """One row's world and folder: ``run`` is its run folder (logs and checkpoints), ``tmp`` its working folder."""

    world: World
    tmp: Path
    notes: dict = field(default_factory=dict)

    @property
    def run(self) -> Path:
        return self.tmp / "run"

    def fit(
        self,
        recipe: str,
        model: dict | None = None,
        data: dict | None = None,
        trainer: dict | None = None,
        *extra: str,
        name: str = "override",
    ) -> list[str]:
        """``fit --config RECIPE --config OVERRIDE [extra]``: the recipe with the shared target and data, 2 steps, a
        checkpoint every 2 steps into ``run/checkpoints``, and the given ``model`` / ``data`` / ``trainer`` values."""
        override = {
            "trainer": {
                "max_steps": 2,
                "default_root_dir": str(self.run),
                "logger": False,
                "enable_progress_bar": False,
                "enable_model_summary": False,
                "num_sanity_val_steps": 0,
                "val_check_interval": 2,
                "limit_val_batches": 1,
                "callbacks": [
                    {
                        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                        "init_args": {
                            "dirpath": str(self.run / "checkpoints"),
                            "every_n_train_steps": 2,
                            "save_last": True,
                        },
                    }
                ],
                **(trainer or {}),
            },
            "model": {"init_args": {"target": str(self.world.target), **(model or {})}},
            "data": {"init_args": _text_data(self.world.corpus) if data is None else data},
        }
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(override))
        return ["fit", "--config", str(RECIPES / "quickstart" / recipe), "--config", str(path), *extra]

    def kd(self, model: dict | None = None, **kwargs) -> list[str]:
        """The KD recipe with the tiny student."""
        student = {"drafter_config": TINY_STUDENT, "loss_chunk_size": 64, "export_dir": str(self.run / "student")}
        return self.fit("kd.yaml", {**student, **(model or {})}, **kwargs)

    def kd_offline(self, shards: Path, name: str = "override", trainer: dict | None = None, **data) -> list[str]:
        """The offline KD recipe reading ``shards`` (more ShardDataModule arguments in ``data``)."""
        student = {"drafter_config": TINY_STUDENT, "loss_chunk_size": 64, "export_dir": str(self.run / "student")}
        data = {"shards": str(shards), "tokenizer": str(self.world.corpus.tokenizer_dir), "batch_size": 4, **data}
        data.setdefault("num_workers", 1)  # one DataLoader worker: its errors reach the main process re-raised
        return self.fit("kd_offline.yaml", student, data, trainer, name=name)

    def shards_copy(self, change: Callable[[Path], None]) -> Path:
        """A copy of the shared shards, changed by ``change``."""
        folder = self.tmp / "shards"
        shutil.copytree(self.world.shards, folder)
        change(folder)
        return folder

    def target_copy(self, change: Callable[[Path], None]) -> Path:
        """A copy of the shared target, changed by ``change``."""
        folder = self.tmp / "target_copy"
        shutil.copytree(self.world.target, folder)
        change(folder)
        return folder


# ------------------------------------------------------------------------------------------------------------ rows


def _write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _drop_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)


def _first_tar(folder: Path) -> Path:
    return sorted(folder.glob("*.tar"))[0]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _recount(folder: Path) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["shards"][0]["samples"] += 1
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _truncated_checkpoint(ctx: Ctx) -> Path:
    data = (FIXTURES / "kd.ckpt").read_bytes()
    path = ctx.tmp / "cut.ckpt"
    path.write_bytes(data[: len(data) // 2])
    return path


def _crafted_checkpoint(ctx: Ctx) -> Path:
    path = ctx.tmp / "crafted.ckpt"
    ctx.notes["marker"] = ctx.tmp / "ran"
    torch.save({"state_dict": {}, "drafter": {}, "x": RunsACommand(ctx.notes["marker"])}, path)
    return path


def _eval(ctx: Ctx, target: Path, drafter: Path | str) -> list[str]:
    """``draftsmith eval`` of ``drafter`` against ``target`` on the held-out file's first 16 tokens, into ``out``."""
    prompts = ["--prompts", str(ctx.world.corpus.heldout_file), "--prompt_tokens", "16", "--max_new_tokens", "8"]
    return ["eval", "--target", str(target), "--drafter", str(drafter), *prompts, "--output_dir", str(ctx.tmp / "out")]


@dataclass
class Row:
    """A command line that must end in one clear error."""

    id: str
    args: Callable[[Ctx], list[str]]
    named: Callable[[Ctx], str] | str  # what the error line must contain
    prefix: str = "error: "  # how the error line starts
    rerun: Callable[[Ctx], list[str]] | None = None  # the corrected command, run into the same folder
    xfail: str | None = None  # why the row does not pass yet (it still runs: XPASS once it does)
    absent: str | None = None  # what the output must not hold (the data module's log: refused before reading)


ROWS = [
    Row(
        "misspelled-key",
        lambda c: c.kd({"loss_chunk_sise": 64}),
        "model.init_args.loss_chunk_sise",
    ),
    Row("renamed-key", lambda c: c.kd({"teacher": str(c.world.target)}), "model.init_args.teacher was renamed"),
    Row(
        "missing-train-file",
        lambda c: c.kd(data=_text_data(c.world.corpus, train_files=[str(c.tmp / "train.jsonl")])),
        lambda c: str(c.tmp / "train.jsonl"),
        rerun=lambda c: c.kd(name="corrected"),
    ),
    Row(
        "missing-val-file",
        lambda c: c.kd(data=_text_data(c.world.corpus, val_files=[str(c.tmp / "val.jsonl")])),
        lambda c: str(c.tmp / "val.jsonl"),
    ),
    Row("target-does-not-exist", lambda c: c.kd({"target": str(c.tmp / "no_target")}), lambda c: str(c.tmp)),
    Row(
        "config-json-not-json",
        lambda c: c.kd({"target": str(c.target_copy(lambda f: (f / "config.json").write_text("{not json")))}),
        "config.json",
    ),
    Row(
        "data-of-another-tokenizer",
        lambda c: c.kd(data=_text_data(c.world.corpus, tokenizer=str(c.world.other_tokenizer))),
        lambda c: str(c.world.other_tokenizer),
        rerun=lambda c: c.kd(name="corrected"),
        absent="trainer.data.text",
    ),
    Row(
        "medusa1-target-without-tokenizer",
        lambda c: c.fit("medusa1.yaml", {"target": str(c.target_copy(_drop_tokenizer)), "loss_chunk_size": 64}),
        lambda c: f"{c.tmp / 'target_copy'}: holds no tokenizer",
        absent="trainer.data.text",
    ),
    Row(
        "medusa1-data-of-another-tokenizer",
        lambda c: c.fit(
            "medusa1.yaml",
            {"loss_chunk_size": 64},
            _text_data(c.world.corpus, tokenizer=str(c.world.other_tokenizer)),
        ),
        lambda c: str(c.world.other_tokenizer),
        absent="trainer.data.text",
    ),
    Row(
        "truncated-shard",
        lambda c: c.kd_offline(c.shards_copy(lambda f: _truncate(_first_tar(f)))),
        lambda c: _first_tar(c.tmp / "shards").name,
        rerun=lambda c: c.kd_offline(c.world.shards, name="corrected"),
    ),
    Row(
        "missing-shard",
        lambda c: c.kd_offline(c.shards_copy(lambda f: _first_tar(f).unlink())),
        lambda c: f"shard {_first_tar(c.world.shards).name!r} is missing",
    ),
    Row(
        "wrong-sample-count-in-manifest",
        # read to the end of the first shard (16 batches of 4), in the DataLoader worker
        lambda c: c.kd_offline(c.shards_copy(_recount), trainer={"max_steps": 24}, shuffle_shards=False),
        lambda c: _first_tar(c.world.shards).name,
    ),
    Row("medusa-heads-0", lambda c: c.fit("medusa1.yaml", {"num_heads": 0}), "model.num_heads"),
    Row(
        "mtp-heads-0",
        lambda c: c.fit("mtp_heads_finetune.yaml", {"num_heads": 0, "export_dir": str(c.run / "model")}),
        "model.num_heads must be >= 1",
    ),
    Row("mtp-depth-0", lambda c: c.fit("mtp_refresh.yaml", {"mtp_depth": 0, "init_from": None}), "model.mtp_depth"),
    Row(
        "mtp-extend-depth-1",
        lambda c: c.fit("mtp_extend.yaml", {"mtp_depth": 1, "init_from": None}),
        "mtp_depth must be >= 2",
    ),
    Row(
        "dflash-mask-pad",
        lambda c: c.fit("dflash.yaml", {"mask_token_id": 1, "target_layers": [1], "block_size": 4}),
        "model.mask_token_id=1",
    ),
    Row(
        "dflash-mask-eos",
        lambda c: c.fit("dflash.yaml", {"mask_token_id": 0, "target_layers": [1], "block_size": 4}),
        "model.mask_token_id=0",
    ),
    Row(
        "dflash-mask-past-embedding",
        lambda c: c.fit("dflash.yaml", {"mask_token_id": 100000, "target_layers": [1], "block_size": 4}),
        "model.mask_token_id=100000",
    ),
    Row(
        "layerskip-exit-past-last-layer",
        lambda c: c.fit("layerskip_finetune.yaml", {"early_exit_layers": [5], "export_dir": str(c.run / "model")}),
        "model.early_exit_layers: [5]",
    ),
    Row(
        "layerskip-p-max-1.5",
        lambda c: c.fit("layerskip_finetune.yaml", {"p_max": 1.5, "export_dir": str(c.run / "model")}),
        "model.p_max",
    ),
    Row(
        "nan-loss-at-lr-1e30",
        lambda c: c.kd({"optim": {"lr": 1e30, "warmup_steps": 0}}, trainer={"max_steps": 4}),
        "model.init_args.optim.lr=1e+30",
        rerun=lambda c: c.kd(name="corrected"),
    ),
    Row(
        "dead-model-at-lr-1e6",
        lambda c: c.kd({"optim": {"lr": 1e6, "warmup_steps": 0}}, trainer={"max_steps": 12, "log_every_n_steps": 1}),
        "model.init_args.optim.lr=1000000.0",
    ),
    Row(
        "medusa2-float16-target",
        lambda c: c.fit("medusa2.yaml", {"target_dtype": "float16"}),
        "model.stage=2 trains the target's weights, which float16",
    ),
    Row(
        "export-truncated-checkpoint",
        lambda c: ["export", "--ckpt_path", str(_truncated_checkpoint(c)), "--output_dir", str(c.tmp / "out")],
        lambda c: str(c.tmp / "cut.ckpt"),
    ),
    Row(
        "export-crafted-pickle",
        lambda c: ["export", "--ckpt_path", str(_crafted_checkpoint(c)), "--output_dir", str(c.tmp / "out")],
        lambda c: str(c.tmp / "crafted.ckpt"),
    ),
    Row(
        "eval-target-is-a-drafter",
        lambda c: [
            "eval",
            "--target",
            str(c.world.drafter_export),
            "--drafter",
            str(c.world.drafter_export),
            "--prompts",
            str(c.world.corpus.heldout_file),
            "--output_dir",
            str(c.tmp / "out"),
        ],  # fmt: skip
        lambda c: f"--target {c.world.drafter_export}: a drafter export",
    ),
    Row(
        "eval-target-with-empty-weights",
        lambda c: _eval(c, c.target_copy(lambda f: (f / "model.safetensors").write_bytes(b"")), "none"),
        lambda c: f"{c.tmp / 'target_copy' / 'model.safetensors'} is empty (0 bytes)",
    ),
    Row(
        "eval-medusa-export-against-another-target",
        lambda c: _eval(c, c.world.other_target, c.world.medusa_export),
        lambda c: f"--drafter {c.world.medusa_export}: exported for another target",
    ),
    Row(
        "eval-mtp-with-its-trunk-against-another-target",
        lambda c: _eval(c, c.world.other_target, c.world.mtp_checkpoint),
        lambda c: f"--target {c.world.other_target} is not that model",
    ),
    Row(
        "generate-misspelled-target",
        lambda c: [
            "generate",
            "--target",
            "./tiny_targt",
            "--input_file",
            str(c.world.chat_input),
            "--output_file",
            str(c.tmp / "out.jsonl"),
        ],  # fmt: skip
        "'./tiny_targt'",
    ),
    Row(
        "dashed-flag",
        lambda c: [
            "eval",
            "--target",
            str(c.world.target),
            "--drafter",
            "none",
            "--prompts",
            str(c.world.chat_input),
            "--output_dir",
            str(c.tmp / "out"),
            "--max-new-tokens",
            "8",
        ],  # fmt: skip
        "--max-new-tokens is spelled --max_new_tokens",
        prefix="draftsmith eval: ",
    ),
]


def error_line(result: CliResult) -> str:
    """The line that names the error: the last one, or the one before a closing ``hint:`` line."""
    lines = result.lines
    assert lines, "no output"
    if lines[-1].startswith("hint: ") and len(lines) > 1:
        return lines[-2]
    return lines[-1]


def assert_nothing_left_that_trips_a_rerun(run: Path) -> None:
    """No checkpoint, no partial file, and no checkpoint-folder lock still held."""
    if not run.exists():
        return
    left = [p for p in run.rglob("*") if p.suffix in (".ckpt", ".tmp") or p.name.endswith(".ckpt.tmp")]
    assert not left, f"left behind: {left}"
    for lock in run.rglob(LOCK_FILE):
        with lock.open("a") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a process holds it


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, id=r.id, marks=[pytest.mark.xfail(reason=r.xfail)] if r.xfail else []) for r in ROWS],
)
def test_a_user_mistake_ends_in_one_clear_error(row: Row, cli: CliServer, world: World, tmp_path: Path):
    ctx = Ctx(world, tmp_path)
    args = row.args(ctx)
    result = cli.run(args, tmp_path / "output.log", cwd=tmp_path)
    tail = "\n".join(result.lines[-15:])
    assert not result.timed_out, tail
    assert "Traceback" not in result.output, result.output[-6000:]
    assert result.status == 2, f"exit status {result.status}:\n{tail}"
    named = row.named(ctx) if callable(row.named) else row.named
    line = error_line(result)
    assert line.startswith(row.prefix), tail
    assert named in line, f"{named!r} not in the error line {line!r}"
    assert row.absent is None or row.absent not in result.output, tail
    assert_nothing_left_that_trips_a_rerun(ctx.run)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.jsonl").exists()  # the tools wrote nothing
    if "marker" in ctx.notes:
        assert not ctx.notes["marker"].exists(), "the crafted checkpoint ran its command"
    if row.rerun is not None:
        again = cli.run(row.rerun(ctx), tmp_path / "corrected.log", cwd=tmp_path)
        assert again.status == 0, "\n".join(again.lines[-15:])
        assert (ctx.run / "checkpoints" / "last.ckpt").is_file()


def test_debug_shows_the_traceback(cli: CliServer, world: World, tmp_path: Path):
    """``--debug`` before the subcommand, or DRAFTSMITH_DEBUG=1, shows the traceback of a user error; a bug of ours
    (not a user error) keeps its traceback without either."""
    ctx = Ctx(world, tmp_path)
    args = ctx.fit("medusa1.yaml", {"num_heads": 0})
    for argv, env in (
        ([args[0], "--debug", *args[1:]], None),
        (["--debug", *args], None),
        (args, {"DRAFTSMITH_DEBUG": "1"}),
    ):
        result = cli.run(argv, tmp_path / "debug.log", cwd=tmp_path, env=env)
        assert "Traceback" in result.output and "model.num_heads is out of range" in result.output
        assert result.status == 1
    plain = cli.run(args, tmp_path / "plain.log", cwd=tmp_path)
    assert plain.status == 2 and "Traceback" not in plain.output


def test_the_console_script_ends_a_user_error_in_one_line(world: World, tmp_path: Path):
    """The installed ``draftsmith`` script (not the forking server): a missing data file, exit status 2, the path
    in the error line, the hint after it, no traceback."""
    ctx = Ctx(world, tmp_path)
    missing = tmp_path / "nope.jsonl"
    args = ctx.kd(data=_text_data(world.corpus, train_files=[str(missing)]))
    script = Path(sys.executable).parent / "draftsmith"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "trainer.cli"]
    env = {k: v for k, v in os.environ.items() if k != "DRAFTSMITH_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([*command, *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-2] == f"error: data.train_files: data file not found: {missing}"
    assert lines[-1].startswith("hint: ")
