"""Peak memory and time of the chunked and fused KD losses against the naive full-logits loss, on CPU.

Each variant runs forward + backward in a fresh child process, which reports the rise of its peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) over the peak it had with the inputs allocated, and the median time
of a few further repetitions. Variants:

- naive:   full student and teacher logits, float32 log_softmax of both [B, S, V], KL, backward;
- chunked: full logits (the model's output), reduced by ``trainer.losses.distillation.kd_loss`` with ``chunk_size``;
- fused:   ``trainer.losses.distillation.fused_kd_loss`` on the hidden states and head weights (no full logits at all).

    python -m bench.bench_kd_loss_memory            # B=4, S=512, H=512, V=32768, chunk 256
"""

import argparse
import json
import statistics
import subprocess
import time

from bench.common import ROOT, module_command, peak_rss_mib

VARIANTS = ("naive", "chunked", "fused")


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from trainer.losses.distillation import fused_kd_loss, kd_loss

    torch.manual_seed(0)
    b, s, h, v, t = args.batch, args.seq, args.hidden, args.vocab, args.temperature

    def make(bb: int, ss: int, vv: int):
        hs = torch.randn(bb, ss, h, requires_grad=True)  # [B, S, H]
        ws = (torch.randn(vv, h) / h**0.5).requires_grad_(True)  # [V, H]
        ht, wt = torch.randn(bb, ss, h), torch.randn(vv, h) / h**0.5  # [B, S, H], [V, H]
        mask = torch.ones(bb, ss, dtype=torch.bool)  # [B, S]
        mask[:, : ss // 8] = False  # a prompt that is not trained on
        return hs, ws, ht, wt, mask

    def step(hs, ws, ht, wt, mask) -> float:
        if args.variant == "naive":
            logits_s = hs @ ws.t()  # [B, S, V]
            with torch.no_grad():
                logits_t = ht @ wt.t()  # [B, S, V]
            lq = F.log_softmax(logits_s.float() / t, dim=-1)  # [B, S, V]
            lp = F.log_softmax(logits_t.float() / t, dim=-1)  # [B, S, V]
            kl = F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)  # [B, S]
            loss = (kl * mask).sum() / mask.sum() * t * t
        elif args.variant == "chunked":
            with torch.no_grad():
                logits_t = ht @ wt.t()  # [B, S, V]
            loss = kd_loss(hs @ ws.t(), logits_t, mask, temperature=t, chunk_size=args.chunk_size).loss
        else:
            loss = fused_kd_loss(hs, ws, ht, wt, mask, temperature=t, chunk_size=args.chunk_size).loss
        loss.backward()
        hs.grad = ws.grad = None
        return float(loss)

    step(*make(2, 8, 64))  # load kernels and thread pools before the baseline
    inputs = make(b, s, v)
    base = peak_rss_mib()
    loss = step(*inputs)
    peak = peak_rss_mib() - base
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        step(*inputs)
        times.append(time.perf_counter() - start)
    print(json.dumps({"variant": args.variant, "peak_mib": peak, "seconds": statistics.median(times), "loss": loss}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--variant", choices=VARIANTS, help="internal: run one variant in this process")
    args = parser.parse_args()
    if args.variant:
        child(args)
        return

    results = {}
    for variant in VARIANTS:
        cmd = module_command("bench.bench_kd_loss_memory", "--variant", variant) + [
            f"--{k.replace('_', '-')}={val}" for k, val in vars(args).items() if k != "variant"
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])

    n = args.batch * args.seq * args.vocab * 4 / 2**20
    print(f"B={args.batch} S={args.seq} H={args.hidden} V={args.vocab} chunk={args.chunk_size}, forward+backward, CPU")
    print(f"(one float32 [B, S, V] tensor = {n:.0f} MiB)")
    print(f"{'variant':<10}{'peak MiB':>10}{'vs naive':>10}{'seconds':>10}{'vs naive':>10}{'loss':>12}")
    naive = results["naive"]
    for variant, r in results.items():
        mem_ratio = r["peak_mib"] / naive["peak_mib"]
        time_ratio = r["seconds"] / naive["seconds"]
        print(
            f"{variant:<10}{r['peak_mib']:>10.0f}{mem_ratio:>10.3f}{r['seconds']:>10.2f}{time_ratio:>10.2f}"
            f"{r['loss']:>12.6f}"
        )
    print(f"fused peak memory is {100 * (1 - results['fused']['peak_mib'] / naive['peak_mib']):.1f}% below naive")


if __name__ == "__main__":
    main()
