"""A CPU-bound torch process on one thread, the load the multi-process tests must pass beside (``make test-loaded``).

CI shares its machine, and the nodes of a real cluster are busy: rank 0's death once reached its peer in an order
that only a busy core produced (tests/integration/test_rank_faults.py). A pure-Python busy loop did not reproduce it;
a one-thread torch matmul did. ``python -m tests.cpu_load SECONDS PARENT_PID`` runs ``a = tanh(a @ a)`` on a
1024 x 1024 tensor until SECONDS have passed or the process PARENT_PID is gone, whichever comes first, and prints
how many products it computed.
"""

from __future__ import annotations

import os
import sys
import time


def parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid


def main(seconds: float, parent: int) -> int:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(1024, 1024)
    deadline = time.monotonic() + seconds
    products = 0
    print("busy", flush=True)
    while time.monotonic() < deadline and parent_alive(parent):
        for _ in range(8):
            a = torch.tanh(a @ a)
        products += 8
    print(f"{products} products", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]), int(sys.argv[2])))
