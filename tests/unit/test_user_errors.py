"""The user-error family: found inside the exceptions that wrap it (jsonargparse's, a DataLoader worker's re-raise),
kept whole across pickling, reported in the lines ``draftsmith`` prints; ``--debug`` parsed before the subcommand."""

from __future__ import annotations

import pickle

import pytest
from torch._utils import ExceptionWrapper

from trainer.cli import _without_debug_flag
from trainer.interface.errors import DataError, RecipeError, TokenizerError, UserError, error_report, user_error_in
from trainer.training.recipe import RecipeError as RecipeErrorOfRecipes


def test_one_recipe_error_class():
    assert RecipeErrorOfRecipes is RecipeError and issubclass(RecipeError, (UserError, ValueError))


def test_a_user_error_keeps_its_hint_across_pickling():
    err = pickle.loads(pickle.dumps(DataError("shard s.tar: truncated", hint="rerun precompute")))
    assert type(err) is DataError and err.message == "shard s.tar: truncated" and err.hint == "rerun precompute"
    assert error_report(err) == "error: shard s.tar: truncated\nhint: rerun precompute"
    assert error_report(RecipeError("model.num_heads is out of range: 0"), "rank 1: ") == (
        "error: rank 1: model.num_heads is out of range: 0"
    )


def test_a_user_error_is_found_along_the_chain_of_its_wrappers():
    def wrapped():
        try:
            raise TokenizerError("folder: holds no tokenizer", hint="save one")
        except TokenizerError as inner:
            try:
                raise ValueError("Problem with given class_path") from inner
            except ValueError:
                raise ValueError("Does not validate against any of the Union subtypes")  # noqa: B904 - a context

    with pytest.raises(ValueError) as outer:
        wrapped()
    found = user_error_in(outer.value)
    assert isinstance(found, TokenizerError) and found.hint == "save one"
    assert user_error_in(ValueError("a bug of ours")) is None


def test_a_user_error_re_raised_by_a_dataloader_worker_gets_its_message_and_hint_back():
    try:
        try:
            raise OSError("read failed")
        except OSError as cause:
            raise DataError("/data/s-000001.tar: 63 samples, the manifest says 64", hint="rerun precompute") from cause
    except DataError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataError) as reraised:
        wrapper.reraise()
    assert reraised.value.message.startswith("Caught DataError in DataLoader worker process 0")
    found = user_error_in(reraised.value)
    assert type(found) is DataError
    assert found.message == "/data/s-000001.tar: 63 samples, the manifest says 64" and found.hint == "rerun precompute"


@pytest.mark.parametrize(
    ("argv", "debug", "rest"),
    [
        (["--debug", "fit", "--config", "r.yaml"], True, ["fit", "--config", "r.yaml"]),
        (["fit", "--debug", "--config", "r.yaml"], True, ["fit", "--config", "r.yaml"]),
        (["fit", "--config", "r.yaml"], False, ["fit", "--config", "r.yaml"]),
        (["fit", "--config", "r.yaml", "--debug"], False, ["fit", "--config", "r.yaml", "--debug"]),  # fit's own
    ],
)
def test_debug_is_a_flag_before_the_subcommand_s_own_arguments(argv, debug, rest):
    assert _without_debug_flag(argv) == (debug, rest)
