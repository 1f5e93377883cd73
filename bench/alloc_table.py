"""Markdown table of allocation latency: scfoundry's resources (doctor --bench-alloc --json)
next to RMM's (bench/alloc_rmm.py), each read against the raw cuMemAllocAsync/cuMemFreeAsync
pair called from the same language.

    python3 bench/alloc_table.py alloc_ours.json [alloc_rmm.json]
"""

import json
import sys

ours = json.load(open(sys.argv[1]))["bench_alloc"]
rmm = None
if len(sys.argv) > 2:
    try:
        rmm = json.load(open(sys.argv[2]))
    except (OSError, ValueError):
        rmm = None

print(f"Allocation + free pairs, sizes log-uniform 1 KiB-64 MiB, {ours['pairs']} pairs (seed {ours['seed']}).")
print("'vs raw' divides by the raw cuMemAllocAsync/cuMemFreeAsync pair called from the same language.\n")
print("| resource | pair (us) | with 64 live (us) | pair vs raw async |")
print("|---|---|---|---|")
raw = ours["rows"][0]["pair_us"]
for r in ours["rows"]:
    print(f"| {r['resource']} | {r['pair_us']:.2f} | {r['with_live_us']:.2f} | {r['pair_us'] / raw:.2f}x |")
if rmm:
    raw_py = rmm["rows"][0]["pair_us"]
    for r in rmm["rows"]:
        print(f"| {r['resource']} (RMM {rmm['rmm']}, Python) | {r['pair_us']:.2f} | {r['with_live_us']:.2f} | {r['pair_us'] / raw_py:.2f}x |")
    by = {r["resource"]: r for r in ours["rows"]}
    by_rmm = {r["resource"]: r for r in rmm["rows"]}
    print()
    for ours_name, rmm_name in [("scfoundry async", "rmm async"), ("scfoundry pool", "rmm pool over cuda"), ("scfoundry managed", "rmm managed"), ("scfoundry managed-pool", "rmm pool over managed"), ("scfoundry cuda", "rmm cuda")]:
        if ours_name in by and rmm_name in by_rmm:
            o, m = by[ours_name]["pair_us"], by_rmm[rmm_name]["pair_us"]
            print(f"- {ours_name}: {o:.2f} us a pair vs {rmm_name} {m:.2f} us: {m / o:.2f}x faster")
    print(f"- scfoundry async vs a raw pair: {by['scfoundry async']['pair_us'] / raw:.3f}x (target <= 1.1x)")
