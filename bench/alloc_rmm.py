"""Allocation + free latency of RMM's memory resources, measured the way
`scfoundry doctor --bench-alloc` measures ours, for bench/gpu_alloc.sh.

Sizes are log-uniform in 1 KiB..64 MiB (seeded); per resource: a warm-up of 200 pairs, then
`pairs` immediate allocate/deallocate pairs, then `pairs` steps that free one of 64 live buffers
(chosen at random) and allocate a new one. The stream is synchronised before each timer stops.
A raw cuMemAllocAsync/cuMemFreeAsync pair through cuda.bindings is timed too: it is the
Python-call floor that RMM's figures should be read against (ours are read against the same
pair called from Rust).

Prints one JSON object: {"rows": [{"resource", "pair_us", "with_live_us"}], ...}.
"""

import argparse
import json
import random
import time

import rmm
import rmm.mr as mr
from cuda.bindings import driver, runtime


def sizes(n, rng):
    return [int(2 ** rng.uniform(10, 26)) for _ in range(n)]


def sync():
    runtime.cudaDeviceSynchronize()


def bench(alloc, free, pairs, seed):
    rng = random.Random(seed)
    sz = sizes(2 * pairs, rng)
    picks = [rng.randrange(64) for _ in range(pairs)]
    for b in sz[:200]:
        free(alloc(b), b)
    sync()
    t = time.perf_counter()
    for b in sz[:pairs]:
        free(alloc(b), b)
    sync()
    pair = (time.perf_counter() - t) * 1e6 / pairs
    live = [(alloc(b), b) for b in sz[pairs:pairs + 64]]
    sync()
    t = time.perf_counter()
    for i, k in enumerate(picks):
        p, b = live[k]
        free(p, b)
        nb = sz[pairs + (i % pairs)]
        live[k] = (alloc(nb), nb)
    sync()
    with_live = (time.perf_counter() - t) * 1e6 / pairs
    for p, b in live:
        free(p, b)
    sync()
    return pair, with_live


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    runtime.cudaFree(0)  # create the context
    rows = []

    err, stream = driver.cuStreamCreate(0)

    def raw_alloc(b):
        err, p = driver.cuMemAllocAsync(b, stream)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        return p

    def raw_free(p, b):
        (err,) = driver.cuMemFreeAsync(p, stream)
        assert err == driver.CUresult.CUDA_SUCCESS, err

    pr, wl = bench(raw_alloc, raw_free, a.pairs, a.seed)
    rows.append({"resource": "raw cuMemAllocAsync/cuMemFreeAsync (Python)", "pair_us": pr, "with_live_us": wl})

    gib = 1 << 30
    resources = [
        ("rmm cuda", lambda: mr.CudaMemoryResource()),
        ("rmm async", lambda: mr.CudaAsyncMemoryResource()),
        ("rmm pool over cuda", lambda: mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=8 * gib, maximum_pool_size=16 * gib)),
        ("rmm pool over async", lambda: mr.PoolMemoryResource(mr.CudaAsyncMemoryResource(), initial_pool_size=8 * gib, maximum_pool_size=16 * gib)),
        ("rmm arena", lambda: mr.ArenaMemoryResource(mr.CudaMemoryResource(), arena_size=16 * gib)),
        ("rmm managed", lambda: mr.ManagedMemoryResource()),
        ("rmm pool over managed", lambda: mr.PoolMemoryResource(mr.ManagedMemoryResource(), initial_pool_size=8 * gib, maximum_pool_size=16 * gib)),
    ]
    for name, make in resources:
        r = make()
        pr, wl = bench(lambda b: r.allocate(b), lambda p, b: r.deallocate(p, b), a.pairs, a.seed)
        rows.append({"resource": name, "pair_us": pr, "with_live_us": wl})
        del r
    print(json.dumps({"rmm": rmm.__version__, "pairs": a.pairs, "seed": a.seed, "rows": rows}))


if __name__ == "__main__":
    main()
