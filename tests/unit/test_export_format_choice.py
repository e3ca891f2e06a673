"""The export format a drafter gets by default, and the one a fit's closing block names: the first of its kind's that
can hold it. An EAGLE-3.1 drafter (norm flags) and a windowed EAGLE-3 or DFlash drafter cannot be written in their
kind's first format, whose loaders have no key for those options; each format's ``refuses`` agrees with its writer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.unit.test_dflash_drafter import small_drafter as small_dflash
from tests.unit.test_eagle3_drafter import small_drafter as small_eagle3
from trainer.interface.errors import UserError
from trainer.methods.dflash import export as dflash_export
from trainer.methods.dflash import kind as dflash_kind
from trainer.methods.eagle3 import export as eagle3_export
from trainer.methods.eagle3 import kind as eagle3_kind
from trainer.training.progress import next_commands
from trainer.training.registry import get_kind

SLIDING = {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 5}


def _eagle3(**options):
    drafter, _ = small_eagle3(0, **{k: v for k, v in options.items() if k != "window"})
    if "window" in options:
        drafter.config.window = options["window"]
    record = eagle3_kind.make_record(drafter.config, "org/target", ["LlamaForCausalLM"], ttt_steps=3)
    return drafter, record, lambda out: eagle3_export.save_native(drafter, str(out))


def _dflash(**options):
    drafter = small_dflash(0, **options)
    record = dflash_kind.make_record(drafter.config, "org/target", ["LlamaForCausalLM"])
    return drafter, record, lambda out: dflash_export.save_zlab(drafter, str(out))


CASES = {
    "eagle3": (_eagle3, {}, "eagle3"),
    "eagle3.1": (_eagle3, {"fc_norm": True, "norm_output": True, "norm_before_residual": True}, "eagle3-speculators"),
    "eagle3-window": (_eagle3, {"window": 16}, "eagle3-speculators"),
    "dflash": (_dflash, {}, "dflash"),
    "dflash-sliding": (_dflash, {**SLIDING, "sliding_window_non_causal": False}, "dflash-speculators"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_default_format_is_the_first_that_holds_the_drafter(case, tmp_path):
    make, options, expected = CASES[case]
    drafter, record, write_first = make(**options)
    kind = get_kind(record.kind, "test")
    assert kind.format(None, record).name == expected
    assert kind.formats_for(record)[0].name == expected
    # the first format's refusal and its writer agree: it writes exactly the drafters it does not refuse
    first = kind.formats[0]
    reason = first.refuses(record)
    if reason is None:
        write_first(tmp_path / "out")
    else:
        with pytest.raises(UserError) as refused:
            write_first(tmp_path / "out")
        assert str(refused.value.message) == reason


@pytest.mark.parametrize("case", list(CASES))
def test_the_fit_closing_block_names_a_format_the_drafter_takes(case, tmp_path):
    make, options, expected = CASES[case]
    _, record, _ = make(**options)
    module = SimpleNamespace(drafter_record=lambda: record)
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), callbacks=[], datamodule=None)
    commands, formats, _ = next_commands(trainer, module, str(tmp_path / "last.ckpt"), None)
    assert commands[0].startswith("draftsmith export --ckpt_path ") and commands[0].endswith(f" --format {expected}")
    assert formats.split(", ")[0] == expected
    refused = [f.name for f in get_kind(record.kind, "test").formats if f.name not in formats.split(", ")]
    assert refused == ([] if expected == get_kind(record.kind, "test").formats[0].name else [record.kind])


# What the engines' released source accepts (trainer/export/serving.py names the files read)
VLLM_METHODS = {"eagle3", "dflash", "mtp", "draft_model", "medusa"}  # vLLM 0.34 config/speculative.py (medusa: 0.32)
SGLANG_ALGORITHMS = {"EAGLE3", "DFLASH", "NEXTN", "STANDALONE"}  # SGLang 0.5.23 arg_groups/fields/spec.py
# the default format's serve lines per case: (engine, vLLM method or SGLang algorithm, drafts per round)
SERVED = {
    "eagle3": [("vLLM", "eagle3", 3), ("SGLang", "EAGLE3", None)],
    "eagle3.1": [("vLLM", "eagle3", 3)],  # SGLang reads no speculators folder
    "eagle3-window": [("vLLM", "eagle3", 3)],
    "dflash": [("vLLM", "dflash", 3), ("SGLang", "DFLASH", None)],  # a block of 4: 3 drafts
    "dflash-sliding": [("vLLM", "dflash", 3)],
}


def _parse_serve(line: str) -> tuple[str, str, int | None, str, str]:
    """(engine, method or algorithm, drafts per round, target, draft folder) of a serve line."""
    import json
    import shlex

    engine, command = line.split(": ", 1)
    words = shlex.split(command)
    if words[:2] == ["vllm", "serve"]:
        config = json.loads(words[words.index("--speculative-config") + 1])
        assert set(config) <= {"method", "model", "num_speculative_tokens"}, config
        return "vLLM", config["method"], config.get("num_speculative_tokens"), words[2], config.get("model")
    assert words[:3] == ["python", "-m", "sglang.launch_server"], line
    option = dict(zip(words[3::2], words[4::2]))
    assert set(option) == {"--model-path", "--speculative-algorithm", "--speculative-draft-model-path"}, option
    return (
        "SGLang",
        option["--speculative-algorithm"],
        None,
        option["--model-path"],
        option["--speculative-draft-model-path"],
    )


@pytest.mark.parametrize("case", list(CASES))
def test_an_export_ends_with_the_serve_lines_of_its_format(case, tmp_path):
    make, options, _ = CASES[case]
    _, record, _ = make(**options)
    folder = tmp_path / "export"
    lines = get_kind(record.kind, "test").format(None, record).serve(folder, record)
    parsed = [_parse_serve(line) for line in lines]
    assert [(engine, method, drafts) for engine, method, drafts, _, _ in parsed] == SERVED[case]
    for engine, method, _, target, draft in parsed:
        assert method in (VLLM_METHODS if engine == "vLLM" else SGLANG_ALGORITHMS)
        assert target == "org/target" and draft == str(folder)
