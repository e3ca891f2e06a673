"""A matmul peak measured on the machine itself, the denominator of MFU.

Vendor peaks are rarely reached, and a CPU has none to quote: the best of a few large square matmuls in the training
dtype is a peak that this device demonstrably reaches, so MFU against it is honest on every machine.
"""

from __future__ import annotations

import time

import torch


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of the fastest of ``repeats`` [n, n] @ [n, n] matmuls on ``device`` in ``dtype``."""
    if size is None:
        size = 4096 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best
