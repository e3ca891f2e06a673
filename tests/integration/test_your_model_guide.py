"""docs/guides/your-model.md runs as written: every line of its bash blocks, in the page's order, from a folder laid
out as the repository (recipes/ linked in), with the target named by its hub id.

The stand-in for what a user brings: a random Llama of Llama-3.1-8B-Instruct's published config shrunk to 6 layers of
width 64 (its rope scaling, special ids and eos kept), with Llama-3.1's tokenizer shape (every special token at its
real id, tests/real_shapes.py) and its published chat template, verbatim; laid out as the Hugging Face cache holds
``meta-llama/Llama-3.1-8B-Instruct`` (and a 2-layer one as ``meta-llama/Llama-3.2-1B-Instruct``, cached when the page
downloads it). Conversations cut from the standard library's source. What the test changes in a line, and only this:

- ``http://localhost:8000`` is a real ``transformers serve`` of the cached stand-in (vLLM and SGLang cannot run here);
- a command that reads a recipe gets one more ``--config``, the stand-in's sizes: CPU and one process, 32-bit, a few
  steps, rows of 256 tokens, no data workers, DFlash's dense attention (CPU torch has no flex-attention backward) and
  32 anchors a row; the recipe's 8 GPUs become 2 processes in ``torchrun``;
- ``generate`` and ``eval`` get a short ``--max_new_tokens``.

``slurm submit`` goes through a real single-node SLURM cluster; the job's fit prints the export and eval commands the
page gives next (compared, then run as the page writes them); a fit from shards, which knows no held-out prompts as
text, prints how to measure instead, and the page's eval names the prompts; the export prints the serve line the page
gives; eval checks every decoded token against the target's own greedy output (it writes its report only then).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import cache_as_hub_repository
from tests.real_shapes import build_tokenizer, published_config
from tests.recipe_runs import ROOT, write_override
from tests.serving import TransformersServe, require_serving
from tests.slurm_cluster import running_cluster
from trainer.interface.output import NO_PROMPTS

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

GUIDE = ROOT / "docs" / "guides" / "your-model.md"
TARGET, STUDENT = "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"
SERVER = "http://localhost:8000"
JOB_TIMEOUT = 900  # seconds; generous for a loaded 2-core machine
STEP_TIMEOUT = 600
BIN = Path(sys.executable).parent  # the venv's draftsmith, torchrun and hf

FIT = {  # the stand-in's sizes, for a fit's recipe
    "trainer": {
        "accelerator": "cpu",
        "devices": 1,
        "precision": "32-true",
        "max_steps": 4,
        "val_check_interval": 2,
        "limit_val_batches": 1,
        "enable_progress_bar": False,
    },
    "data": {"init_args": {"seq_len": 256, "num_workers": 0}},
}
DFLASH_FIT = {**FIT, "model": {"init_args": {"attention": "dense", "max_anchors": 32}}}  # no flex backward on CPU
SHARD_FIT = {**FIT, "data": {"init_args": {"batch_size": 2, "num_workers": 0, "shuffle_buffer": 8}}}
PRECOMPUTE = {"samples_per_shard": 4, "batch_size": 4, "data": {"init_args": {"seq_len": 256, "batch_size": 4}}}
STAND_IN = {  # recipe -> its stand-in sizes
    "recipes/eagle3_1_llama31_8b.yaml": ("fit.yaml", FIT),
    "recipes/kd_offline_llama31_8b.yaml": ("shard_fit.yaml", SHARD_FIT),
    "recipes/dflash_llama31_8b.yaml": ("dflash_fit.yaml", DFLASH_FIT),
    "recipes/precompute_llama31_8b.yaml": ("precompute.yaml", PRECOMPUTE),
}


def guide_lines() -> list[str]:
    """Every non-blank line of the page's bash blocks, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", GUIDE.read_text(), flags=re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def stand_in(out: Path, layers: int) -> Path:
    """A random Llama of Llama-3.1-8B-Instruct's config at width 64 and ``layers`` layers, with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer("llama31_8b", out)
    config = published_config("llama31_8b")
    config.update(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    config.update(num_key_value_heads=2, head_dim=16, torch_dtype="float32")
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(out)
    return out


def conversations(count: int, skip: int) -> list[dict]:
    """``count`` two-turn conversations about standard-library modules (their first lines as the replies)."""
    sources = sorted(Path(os.__file__).parent.glob("*.py"))[skip : skip + count]
    out = []
    for source in sources:
        text = source.read_text(errors="replace")
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"What does the module {source.stem} do?"},
                    {"role": "assistant", "content": text[:160]},
                    {"role": "user", "content": "Show me more."},
                    {"role": "assistant", "content": text[160:320]},
                ]
            }
        )
    return out


def run(argv: list[str], cwd: Path, env: dict, log: list[str]) -> str:
    """Runs one command; returns its output, failing the test with it on a non-zero status."""
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT)
    output = done.stdout + done.stderr
    log.append(f"$ {shlex.join(argv)}\n{output[-3000:]}")
    assert done.returncode == 0, "\n".join(log)[-8000:]
    assert "Traceback" not in output, output[-4000:]
    return output


def printed_commands(output: str, workdir: Path) -> list[str]:
    """The ``draftsmith ...`` commands of a closing block's ``next`` row, paths under ``workdir`` made relative."""
    commands = re.findall(r"^(?:next)?\s+(draftsmith \S+ .*)$", output, flags=re.M)
    return [c.replace(f"{workdir.resolve()}/", "").strip() for c in commands]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The user's folder: recipes/ linked in, data/ with their conversations, the hub cache with the stand-ins (the
    student's kept aside until the page downloads it)."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "recipes").symlink_to(ROOT / "recipes")
    for name, records in (("chats.jsonl", conversations(12, 0)), ("heldout_chats.jsonl", conversations(3, 12))):
        (folder / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    cache = tmp_path / "hub"
    cache_as_hub_repository(stand_in(tmp_path / "target", layers=6), cache, TARGET)
    stand_in(tmp_path / "student", layers=2)
    for file, sizes in STAND_IN.values():
        write_override(tmp_path / file, sizes)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the page sets it too; no hub can be reached from here
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return folder


def test_every_command_of_the_guide_runs_on_the_stand_in(project, tmp_path, tmp_path_factory, monkeypatch):
    require_serving()
    lines = guide_lines()
    assert [line.split()[0] for line in lines].count("draftsmith") >= 8, lines
    log: list[str] = []
    env = dict(os.environ)
    printed: list[str] = []  # what the last fit or export printed next
    measure = False  # the last fit printed how to measure instead of an eval command
    served: list[str] = []  # the serve lines the last export printed
    with (
        running_cluster(tmp_path_factory.mktemp("slurm"), pythonpath=ROOT) as cluster,
        TransformersServe(TARGET, log=tmp_path / "serve.log") as server,
    ):
        env = {**env, "SLURM_CONF": os.environ["SLURM_CONF"]}
        for line in lines:
            argv = shlex.split(line, comments=True)
            if argv[0] == "export":  # export HF_HUB_OFFLINE=1
                key, value = argv[1].split("=", 1)
                env[key] = value
                continue
            if argv[0] == "vllm" or argv[:3] == ["python", "-m", "sglang.launch_server"]:  # as the export printed it
                assert any(s.endswith(": " + line) for s in served), f"{line}\nis not one of\n" + "\n".join(served)
                continue
            if argv[0] == "hf":
                if argv[2] == STUDENT:  # fetched where the hub can be reached: here, laid out in the cache
                    cache_as_hub_repository(tmp_path / "student", Path(env["HF_HUB_CACHE"]), STUDENT)
                run([str(BIN / "hf"), *argv[1:]], project, env, log)
                continue
            recipe = next((a for a in argv if a in STAND_IN), None)
            extra = ["--config", str(tmp_path / STAND_IN[recipe][0])] if recipe else []
            if argv[0] == "torchrun":
                assert argv[1:3] == ["--nproc_per_node", "8"], line
                output = run([str(BIN / "torchrun"), "--nproc_per_node", "2", *argv[3:], *extra], project, env, log)
                continue
            assert argv[0] == "draftsmith", line
            command = argv[1]
            if command == "generate":
                argv = [server.url if a == SERVER else a for a in argv] + ["--max_new_tokens", "24"]
            if command == "eval":
                extra += ["--max_new_tokens", "16"]
            if command == "export" or (command == "eval" and not measure):
                assert line in printed, f"the page's\n{line}\nis not what the run printed next:\n" + "\n".join(printed)
            output = run([str(BIN / "draftsmith"), *argv[1:], *extra], project, env, log)
            if command == "slurm":
                job = output.strip().splitlines()[-1]
                assert job.isdigit(), output
                info = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=JOB_TIMEOUT)
                output = (project / "slurm-logs" / f"draftsmith-{job}.out").read_text(errors="replace")
                log.append(output[-4000:])
                assert info["JobState"] == "COMPLETED", "\n".join(log)[-8000:]
                assert "#SBATCH --gpus-per-node" not in (project / "slurm-logs" / "draftsmith.sbatch").read_text()
            if command in ("slurm", "fit"):
                printed = printed_commands(output, project)
                measure = NO_PROMPTS in " ".join(output.split())  # no held-out prompts known: eval is the page's
                assert printed and "Traceback" not in output, output[-4000:]
            if command == "export":
                printed += printed_commands(output, project)
                served = re.findall(r"^(?:serve)?\s+(\S+ [\d.]+: .*)$", output, flags=re.M)
                assert served, output
            if command == "eval":
                report = Path(argv[argv.index("--output_dir") + 1])
                assert json.loads((project / report / "report.json").read_text())["greedy"], output
    assert any("draft_model" in s for s in served) and any("assistant_model" in s for s in served), served
