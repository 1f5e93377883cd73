"""The timing loop shared by the bench/*_torch.py scripts (imported as `_timing`: Python puts the
script's folder on sys.path): best wall time of several passes over the batches, after one untimed
warm-up batch, with CUDA work synchronised before each clock read, under inference_mode.
"""

import time

import torch


def best_pass(run, batches, device, repeat):
    """Seconds of the fastest of `repeat` passes of `run(batch)` over `batches`."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        run(batches[0])
        sync()
        best = float("inf")
        for _ in range(max(1, repeat)):
            t = time.perf_counter()
            for b in batches:
                run(b)
            sync()
            best = min(best, time.perf_counter() - t)
    return best
