#!/usr/bin/env python3
"""Summarise an Nsight Compute CSV (`ncu --csv --print-units base`, one row a launch and metric)
by kernel group: device-time share and time-weighted counters in % of peak (bench/ncu_bound.sh).

    ncu_bound.py CSV                 the table, then the same as one JSON line
    ncu_bound.py --first REGEX CSV   the index of the first launch whose kernel name matches"""
import collections
import csv
import json
import re
import sys

SHORT = {
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM",
    "sm__inst_issued.avg.pct_of_peak_sustained_active": "issue",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor (wgmma)",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "FMA",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active": "ALU",
}


def group(name):
    name = re.sub(r"\(.*", "", name).strip()
    if name.startswith("nvjet") or "gemm" in name.lower() or name.startswith("sm90_xmma") or name.startswith("cutlass"):
        return "cuBLAS/cuBLASLt products"
    return name[:56]


def read(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        sys.exit(f"{path}: no ncu rows (see the .err beside it)")
    return rows[0], rows[1:]


def first(pattern, path):
    """The launch index (ncu's ID, in launch order when nothing is filtered) of the first match."""
    head, rows = read(path)
    ki, ii = head.index("Kernel Name"), head.index("ID")
    hits = [int(r[ii]) for r in rows if re.search(pattern, r[ki])]
    if not hits:
        sys.exit(1)
    print(min(hits))


def main(path):
    head, rows = read(path)
    ki, ni, vi, ii = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value"), head.index("ID")
    launches = collections.defaultdict(dict)
    names = {}
    for r in rows:
        try:
            v = float(r[vi].replace(",", ""))
        except ValueError:
            continue
        launches[r[ii]][r[ni]] = v
        names[r[ii]] = r[ki]
    total = sum(m.get("gpu__time_duration.sum", 0.0) for m in launches.values())
    if total <= 0:
        sys.exit(f"{path}: no gpu__time_duration.sum")
    present = [k for k in SHORT if any(k in m for m in launches.values())]
    agg = collections.defaultdict(lambda: collections.Counter())
    count = collections.Counter()
    for lid, m in launches.items():
        g = group(names[lid])
        t = m.get("gpu__time_duration.sum", 0.0)
        agg[g]["time"] += t
        count[g] += 1
        for k in present:
            agg[g][k] += t * m.get(k, 0.0)
    cols = [SHORT[k] for k in present]
    groups = []
    print(f"{len(launches)} launches, device time {total / 1e6:.3f} ms; counters in % of peak, weighted by each launch's time")
    print(f"{'kernel':<58}{'n':>5}{'time %':>8}" + "".join(f"{c:>15}" for c in cols) + "  highest")
    for g, a in sorted(agg.items(), key=lambda kv: -kv[1]["time"]):
        vals = [a[k] / a["time"] if a["time"] else 0.0 for k in present]
        hi = max(range(len(vals)), key=lambda i: vals[i]) if vals else None
        tag = f"{cols[hi]} {vals[hi]:.0f}%" if hi is not None else "-"
        print(f"{g:<58}{count[g]:>5}{100 * a['time'] / total:>8.1f}" + "".join(f"{v:>15.1f}" for v in vals) + f"  {tag}")
        groups.append({"kernel": g, "launches": count[g], "time_pct": round(100 * a["time"] / total, 1),
                       "counters": {c: round(v, 1) for c, v in zip(cols, vals)},
                       "highest": cols[hi] if hi is not None else None, "highest_pct": round(vals[hi], 1) if hi is not None else None})
    # the same as one JSON line, last (bench/record_table.py reads it)
    print(json.dumps({"tool": "ncu_bound", "launches": len(launches), "device_ms": round(total / 1e6, 3), "groups": groups}))


if __name__ == "__main__":
    if sys.argv[1] == "--first":
        first(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
