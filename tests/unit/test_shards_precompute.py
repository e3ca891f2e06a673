"""The precompute recipe parses with its own parser; rank and world come from torchrun's or SLURM's environment."""

from __future__ import annotations

import pytest

from tests.recipe_runs import RECIPES
from trainer.data.precompute import build_parser, rank_and_world


def test_precompute_recipe_parses_and_opens_with_its_command():
    recipe = RECIPES / "quickstart" / "precompute.yaml"
    assert recipe.read_text().splitlines()[0] == (
        "# draftsmith precompute --config recipes/quickstart/precompute.yaml --output_dir artifacts/shards"
    )
    cfg = build_parser().parse_args(["--config", str(recipe), "--output_dir", "x", "--top_logprobs", "32"])
    assert cfg.top_logprobs == 32 and cfg.output_dir == "x" and cfg.target == "artifacts/tiny_target"
    assert cfg.data.class_path == "trainer.data.text.TextDataModule" and cfg.data.init_args.seq_len == 256


def test_misspelled_precompute_key_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((RECIPES / "quickstart" / "precompute.yaml").read_text().replace("samples_per_shard", "sample_per"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", str(bad), "--output_dir", "x"])
    assert "sample_per" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, (0, 1, 0)),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (3, 8, 1)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}, (5, 6, 2)),
    ],
)
def test_rank_and_world_from_the_launcher(monkeypatch, env, expected):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert rank_and_world() == expected
