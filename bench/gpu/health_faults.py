"""Faults for the GPU health gate, made with processes only (no clock, power limit or MIG setting is
touched): run on a GPU machine, each prints "ready" once the fault is in place and holds it until killed.

    python3 bench/gpu/health_faults.py matmul [GPU]        another tenant: bf16 8192^3 matmuls back to back
    python3 bench/gpu/health_faults.py hold FRACTION [GPU] a process holding FRACTION of the GPU's memory

CUDA_VISIBLE_DEVICES hiding GPUs needs no process: the gate runs with it set (bench/gpu/health_device.sh).
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    import torch

    mode = argv[1] if len(argv) > 1 else ""
    if mode == "matmul":
        dev = torch.device("cuda", int(argv[2]) if len(argv) > 2 else 0)
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        c = torch.empty_like(a)
        torch.matmul(a, b, out=c)
        torch.cuda.synchronize(dev)
        print("ready: bf16 matmuls on", dev, flush=True)
        while True:
            for _ in range(20):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize(dev)
    if mode == "hold":
        frac = float(argv[2])
        dev = torch.device("cuda", int(argv[3]) if len(argv) > 3 else 0)
        free, total = torch.cuda.mem_get_info(dev)
        want = min(int(total * frac), free - (512 << 20))  # plain cudaMalloc through torch, never more than is free
        x = torch.empty(want, dtype=torch.uint8, device=dev)
        x.fill_(1)
        torch.cuda.synchronize(dev)
        print(f"ready: holding {want / 2**30:.1f} GiB of {total / 2**30:.1f} GiB on {dev}", flush=True)
        while True:
            time.sleep(60)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
