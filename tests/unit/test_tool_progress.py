"""The progress of the tools' long stages (trainer/interface/output.py's CountProgress, used by ``draftsmith
precompute`` and ``generate``): plain lines in a log file, at every interval and at the end; the bar on a terminal
only."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipe_runs import save_random_target
from trainer.interface.output import CountProgress, duration

REPO = Path(__file__).resolve().parents[2]
_LINE = re.compile(r"^INFO: precompute (\d+)/(\d+) seq \| [\d.,]+ seq/s \| elapsed \S+( \| eta \S+)?$")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines_at(total: int, done: int, every_n: int, updates: list[int]) -> list[int]:
    """The counts with a line, by the rule written out: past a multiple of ``every_n``, or the last item."""
    out = []
    for n in updates:
        before, done = done, done + n
        if done // every_n > before // every_n or done >= total:
            out.append(done)
    return out


@pytest.mark.parametrize(("total", "done", "every_n", "updates"), [(10, 0, 3, [1] * 10), (17, 4, 5, [2, 3, 4, 4])])
def test_off_a_terminal_a_line_per_interval_and_at_the_end(total, done, every_n, updates, caplog):
    stream = io.StringIO()
    progress = CountProgress("precompute", total, "seq", done, every_n=every_n, every_seconds=0, stream=stream)
    with caplog.at_level(logging.INFO, logger="trainer.interface.output"):
        for n in updates:
            progress.update(n)
        progress.close()
    counts = [int(re.match(r"precompute (\d+)/", r.getMessage())[1]) for r in caplog.records]
    assert counts == _lines_at(total, done, every_n, updates)
    assert all(r.getMessage().startswith(f"precompute {c}/{total} seq | ") for r, c in zip(caplog.records, counts))
    assert stream.getvalue() == ""  # no bar


def test_the_line_reads_rate_elapsed_and_eta_of_this_run():
    """A resumed run (4 of 20 done before it) that did 6 more in 30 s: its rate and time left, computed by hand."""
    progress = CountProgress("generate", 20, "records", done=4, every_seconds=0, stream=io.StringIO())
    progress.done = 10
    assert progress.line(30.0, "12.5 tokens/s") == (
        f"generate 10/20 records | {6 / 30:.2f} records/s | elapsed 30s | eta {duration(30 / 6 * 10)} | 12.5 tokens/s"
    )


def test_on_a_terminal_the_bar_and_no_lines(caplog):
    stream = _Terminal()
    progress = CountProgress("generate", 4, "records", every_n=1, every_seconds=0, stream=stream)
    with caplog.at_level(logging.INFO, logger="trainer.interface.output"):
        for _ in range(4):
            progress.update(1, "3.0 tokens/s")
        progress.close()
    assert not caplog.records
    assert "generate" in stream.getvalue() and "4/4" in stream.getvalue()


def test_precompute_into_a_file_writes_lines_and_no_carriage_return(tiny_corpus, tmp_path):
    """``draftsmith precompute`` with its output in a file: no bar's ``\\r`` updates, progress lines in the fit's
    format, the last one at every sequence written (the count of the closing block)."""
    target = save_random_target(tmp_path / "target", tiny_corpus.tokenizer_dir)
    data = {
        "class_path": "trainer.data.text.TextDataModule",
        "init_args": {
            "tokenizer": str(tiny_corpus.tokenizer_dir),
            "train_files": [str(tiny_corpus.train_file)],
            "seq_len": 32,
            "batch_size": 4,
            "shuffle": False,
            "max_documents": 4,
            "cache_dir": str(tmp_path / "tokenized"),
        },
    }
    cmd = [str(Path(sys.executable).parent / "draftsmith"), "precompute", "--target", str(target)]
    cmd += [
        "--output_dir",
        str(tmp_path / "shards"),
        "--data",
        json.dumps(data),
        "--top_logprobs",
        "8",
        "--batch_size",
        "4",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log_file = tmp_path / "precompute.log"
    with log_file.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), timeout=240)
    text = log_file.read_text()
    assert done.returncode == 0, text[-3000:]
    assert "\r" not in text
    lines = [m for line in text.splitlines() if (m := _LINE.match(line))]
    written = int(re.search(r"^sequences\s+(\d+) written", text, re.M)[1])
    assert lines and written > 0, text
    assert [int(m[2]) for m in lines] == [written] * len(lines)
    assert int(lines[-1][1]) == written and lines[-1][3] is None  # the last line: all done, no time left to show
    assert [int(m[1]) for m in lines] == sorted({int(m[1]) for m in lines})  # rising, each count once


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eval_logs_a_line_per_tenth_of_its_side_by_side_decodes(temperature, caplog, one_thread):
    """``draftsmith eval``'s long stage: every prompt of every pass (K, threshold, greedy then sampling, repeat) counted
    once, the last line at the total computed by hand."""
    import torch

    from tests.helpers import tiny_llama
    from trainer.decoding.evaluate import evaluate_drafter
    from trainer.decoding.proposers import NoProposer

    target = tiny_llama(0, 64, dtype=torch.float32, eos_token_id=None).eval()
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    ks, thresholds, repeats = [1, 2], [0.0], 2
    total = len(prompts) * len(ks) * len(thresholds) * repeats * (2 if temperature > 0 else 1)
    with caplog.at_level(logging.INFO, logger="trainer.interface.output"):
        evaluate_drafter(target, NoProposer(), prompts, ks, 3, temperature, None, 0, repeats, thresholds, progress=True)
    counts = [int(m[1]) for r in caplog.records if (m := re.match(rf"eval (\d+)/{total} prompts \| ", r.getMessage()))]
    assert counts and counts[-1] == total and counts == sorted(set(counts))
    assert len(counts) == len(_lines_at(total, 0, -(-total // 10), [1] * total))
