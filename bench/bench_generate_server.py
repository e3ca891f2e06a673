"""Regeneration throughput: `draftsmith generate --server` at several concurrencies against the in-process path.

Starts `transformers serve TARGET` on a free localhost port (one thread, CPU; with --continuous_batching, its paged
continuous batching), regenerates the same chat rows through it with --concurrency 1, 4 and 16, and in-process with
--batch_size 1 and 16, and prints records/s and tokens/s of each (tokens: generated, EOS included), timed without
loading the model (the server is started before; the in-process runs share one loaded target). The paths take
turns for --rounds rounds and each keeps its fastest (the machine is shared). Every run writes a fresh output, and
each output is compared with the in-process one at batch size 1.

    python -m bench.bench_generate_server --target artifacts/tiny_target --rows 48 --max_new_tokens 32
    python -m bench.bench_generate_server --random artifacts/corpus/tokenizer --continuous_batching
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from trainer.data import generate as gen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: str, port: int, continuous_batching: bool, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", target, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--device", "cpu"]
    if continuous_batching:
        cmd.append("--continuous-batching")
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"transformers serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    raise SystemExit("transformers serve did not start")


def random_target(folder: Path, tokenizer: str) -> Path:
    """A Llama of recipes/quickstart/tiny_target.yaml's shape with random weights and ``tokenizer`` beside it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def chat_rows(heldout: Path, rows: int) -> list[dict]:
    texts = [json.loads(line)["text"] for line in heldout.read_text().splitlines()]
    snippets = [t[i : i + 60] for t in texts for i in range(0, min(len(t), 2000), 250) if len(t) > i + 60]
    return [
        {
            "id": n,
            "messages": [
                {"role": "user", "content": snippets[n % len(snippets)]},
                {"role": "assistant", "content": ""},
            ],
        }
        for n in range(rows)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="artifacts/tiny_target")
    random_help = "instead of --target: random weights of the tiny target's shape (4 layers, hidden 256) with this"
    random_help += " tokenizer (artifacts/corpus/tokenizer); replies then run to --max_new_tokens"
    parser.add_argument("--random", metavar="TOKENIZER", help=random_help)
    parser.add_argument("--heldout", default="artifacts/corpus/heldout.jsonl", help="documents to cut prompts from")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--batch_sizes", default="1,16", help="in-process batch sizes")
    parser.add_argument("--continuous_batching", action="store_true", help="start transformers serve with it")
    parser.add_argument("--rounds", type=int, default=2, help="each path runs this many times (in turns); best kept")
    args = parser.parse_args()
    torch.set_num_threads(1)

    work = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    if args.random:
        args.target = str(random_target(work / "random_target", args.random))
    src = work / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(Path(args.heldout), args.rows)))
    common = dict(
        target=args.target, input_file=str(src), max_new_tokens=args.max_new_tokens, chunk_size=16, progress=False
    )

    # the in-process runs reuse one loaded target, so that both paths are timed without loading the model
    loaded = gen.load_target(args.target, "float32", False, needs_chat_template=True)
    gen.load_target = lambda *a, **k: loaded
    port = free_port()
    proc = start_server(args.target, port, args.continuous_batching, work / "serve.log")
    url = f"http://127.0.0.1:{port}"
    paths = [(f"in-process, batch_size {b}", dict(batch_size=b)) for b in map(int, args.batch_sizes.split(","))]
    paths += [
        (f"--server, concurrency {c}", dict(server=url, concurrency=c)) for c in map(int, args.concurrency.split(","))
    ]
    best: dict[str, tuple] = {}
    try:
        gen.regenerate(output_file=str(work / "warmup.jsonl"), server=url, max_records=2, **common)
        for round_ in range(args.rounds):  # the paths take turns, and each keeps its fastest round
            for n, (name, options) in enumerate(paths):
                out = work / f"run_{round_}_{n}.jsonl"
                stats = gen.regenerate(output_file=str(out), **options, **common)
                if name not in best or stats.seconds < best[name][0].seconds:
                    best[name] = (stats, out)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
    results = [(name, *best[name]) for name, _ in paths]

    reference = results[0][2].read_text()
    base = results[0][1]
    print(f"{args.rows} chat rows, {args.max_new_tokens} new tokens at most, greedy, best of {args.rounds} rounds")
    print(f"target {args.target}")
    print(
        f"server: transformers serve, {'continuous batching' if args.continuous_batching else 'one request at a time'}"
    )
    print(f"{'path':32} {'records/s':>10} {'tokens/s':>10} {'vs in-process bs 1':>20} {'same output':>12}")
    for name, stats, out in results:
        rps, tps = stats.written / stats.seconds, stats.tokens / stats.seconds
        ratio = rps / (base.written / base.seconds)
        print(f"{name:32} {rps:10.2f} {tps:10.1f} {ratio:19.2f}x {str(out.read_text() == reference):>12}")


if __name__ == "__main__":
    main()
