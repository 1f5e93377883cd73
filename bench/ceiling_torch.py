"""The bf16 matrix ceiling as PyTorch measures it (about 790 TFLOP/s on an H200): square
torch.matmul at n = 4,096, 8,192 and 16,384, a quarter of a second of products a timing at
~790 TFLOP/s (at most 200 products), the best of 3 timings; the ceiling is the fastest size.
The same measurement as `scfoundry __bench-encoder --arch gemm`, for the same call.

    python3 bench/ceiling_torch.py        # on a GPU machine; one JSON line
"""
import json
import time

import torch


def main():
    dev = torch.device("cuda")
    by_size = {}
    for n in (4096, 8192, 16384):
        x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * n**3
        reps = max(1, min(200, int(2e14 / flops)))
        torch.matmul(x, y)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                torch.matmul(x, y)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) / reps)
        by_size[str(n)] = flops / best / 1e12
    ceiling = max(by_size.values())
    print(json.dumps({"tool": "pytorch", "torch": torch.__version__, "arch": "gemm", "dtype": "bf16", "tflops_by_size": by_size,
                      "ceiling_tflops": ceiling, "half_ceiling_tflops": ceiling / 2}))


if __name__ == "__main__":
    main()
