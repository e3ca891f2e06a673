"""Sequence parallelism (trainer/distributed/sequence_parallel.py): DeepSpeed-Ulysses around EAGLE-3's
training-time-test attention and around a target's forward, in two gloo processes on CPU, gives the single process's
outputs and gradients; refusals name the key."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests._multiproc import run_group
from trainer.distributed.sequence_parallel import check_sequence_parallel
from trainer.interface.errors import RecipeError

WORKER = """
import os, sys
import torch
import torch.distributed as dist
import deepspeed

from trainer.methods.eagle3.module import ttt_attention
from trainer.distributed.sequence_parallel import ulysses_attention

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
torch.manual_seed(0)  # every rank draws the same full tensors, then keeps its slice of positions
B, nh, nkv, S, D, steps = 2, 4, 2, 16, 8, 3
q = torch.randn(B, nh, S, D, dtype=torch.float64)  # [B, nh, S, D]
keys = [torch.randn(B, nkv, S, D, dtype=torch.float64) for _ in range(steps)]  # TTT steps 0..2
values = [torch.randn(B, nkv, S, D, dtype=torch.float64) for _ in range(steps)]
documents = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])  # [B, S] a packed row and a single document
grad_out = torch.randn(B, nh, S, D, dtype=torch.float64)
for window in (None, 6):
    full = [t.clone().requires_grad_() for t in (q, *keys, *values)]
    out = ttt_attention(full[0], full[1 : 1 + steps], full[1 + steps :], "dense", window, documents)
    (out * grad_out).sum().backward()  # the single process: naive reference
    part = slice(rank * S // world, (rank + 1) * S // world)
    local = [t[:, :, part].clone().requires_grad_() for t in (q, *keys, *values)]
    wrapped = ulysses_attention(lambda a, k, v, w, d: ttt_attention(a, k, v, "dense", w, d))
    mine = wrapped(local[0], local[1 : 1 + steps], local[1 + steps :], window, documents)  # [B, nh, S / P, D]
    (mine * grad_out[:, :, part]).sum().backward()
    torch.testing.assert_close(mine, out[:, :, part], rtol=1e-12, atol=1e-12)
    for a, b in zip(local, full):
        torch.testing.assert_close(a.grad, b.grad[:, :, part], rtol=1e-12, atol=1e-12)
print("rank", rank, "ttt equal", flush=True)

# the frozen target's forward: each rank runs its slice, positions counted from the slice's first global position
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.distributed.sequence_parallel import register_ulysses_sdpa

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, attn_implementation="sdpa")
model = LlamaForCausalLM(config).double().eval()
ids = torch.randint(0, 128, (B, S))  # [B, S]
with torch.no_grad():
    full = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
model.set_attn_implementation(register_ulysses_sdpa())
positions = torch.arange(S)[part][None].expand(B, -1)  # [B, S / P]
with torch.no_grad():
    mine = model.model(input_ids=ids[:, part], position_ids=positions, output_hidden_states=True, use_cache=False)
for a, b in zip(mine.hidden_states, full):
    torch.testing.assert_close(a, b[:, part], rtol=1e-10, atol=1e-10)
print("rank", rank, "target equal", flush=True)
from tests._multiproc import end_worker

end_worker()  # not the interpreter's teardown, where gloo's threads can abort a finished rank
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ulysses_in_two_processes_equals_one(tmp_path, torch_extensions_dir):
    """Two gloo processes, each holding 8 of 16 positions, through DeepSpeed's DistributedAttention: around EAGLE-3's
    TTT attention (3 steps, grouped-query heads, a packed row's documents, with and without a window) each rank's
    output and the gradients of its queries, keys and values equal the single process's slice; a Llama target under
    the registered ``ulysses_sdpa`` attention gives each rank the slice of every hidden state of the whole row's
    forward (float64)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}  # PATH: the C++ op's compiler
    result = run_group([sys.executable, str(script)], 600, tmp_path / "logs", nprocs=2, env=env, rank_env=True)
    assert result.ok, result.output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} ttt equal" in result.output and f"rank {rank} target equal" in result.output


@pytest.mark.parametrize(
    ("size", "kv", "seq", "match"),
    [
        (0, 8, 4096, r"sequence_parallel_size=0: the sequence-parallel degree is a positive"),
        (3, 8, 4096, r"sequence_parallel_size=3 does not divide the attention's 8 key/value heads"),
        (16, 8, 4096, r"sequence_parallel_size=16 does not divide the attention's 8 key/value heads"),
        (2, 8, 4095, r"sequence_parallel_size=2 does not divide data\.seq_len=4095"),
    ],
)
def test_degrees_ulysses_cannot_run_are_refused_by_name(size, kv, seq, match):
    with pytest.raises(RecipeError, match=match):
        check_sequence_parallel(size, kv, seq)
    check_sequence_parallel(2, 8, 4096)
