"""Checks of bench/gpu_runtime.sh's runs (python3 with h5py and numpy). Prints a JSON summary
and exits 1 if any check fails.

Per allocator mode, from the task's gpu.json (written by the resource itself):
- pointer attributes read back from the driver agree with the mode for every sampled
  allocation (managed iff managed modes; from our own pool iff pool modes);
- the device's default pool served nothing during pool/managed/cuda runs (its high-water mark
  is 0): no allocation bypassed the chosen resource through cuMemAllocAsync;
- allocations = frees + live at exit, peak > the loaded model;
- the embedding equals the CPU run's (max abs difference under 1e-4).
"""

import glob
import json
import sys

import h5py
import numpy as np

W = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
    return bool(cond)


def gpu(run):
    files = glob.glob(f"{W}/runs/{run}/*/tasks/1/gpu.json")
    return json.load(open(files[0])) if files else None


def emb(name):
    with h5py.File(f"{W}/{name}.h5ad", "r") as f:
        return f["obsm/X_cellama"][()]


cpu = emb("cpu")
summary = {"cells": int(cpu.shape[0]), "modes": {}}
for mode in ["async", "pool", "managed", "managed-pool", "cuda"]:
    g = gpu(mode)
    if not check(g is not None, f"{mode}: no gpu.json"):
        continue
    pc, st = g["pointer_checks"], g["stats"]
    row = {
        "allocator": g["allocator"],
        "peak_bytes": st["peak_bytes"],
        "loaded_bytes": g.get("loaded_bytes"),
        "allocations": st["allocations"],
        "frees": st["frees"],
        "pointer_checks": pc,
        "default_pool_used_high": g.get("default_pool_used_high"),
        "pool_reserved_high": g.get("pool_reserved_high"),
    }
    check(pc["checked"] > 0 and pc["mismatched"] == 0, f"{mode}: pointer attributes contradict the mode: {pc}")
    managed = mode in ("managed", "managed-pool")
    check((pc["managed"] == pc["checked"]) if managed else (pc["managed"] == 0), f"{mode}: managed pointers {pc}")
    pooled = mode in ("pool", "managed-pool")
    check((pc["from_own_pool"] == pc["checked"]) if pooled else (pc["from_own_pool"] == 0), f"{mode}: own-pool pointers {pc}")
    if mode != "async":
        check(g.get("default_pool_used_high") == 0, f"{mode}: the default pool served {g.get('default_pool_used_high')} bytes")
    check(st["allocations"] > 100, f"{mode}: only {st['allocations']} allocations counted")
    check(st["peak_bytes"] > (g.get("loaded_bytes") or 0) > 80_000_000, f"{mode}: peak {st['peak_bytes']} vs loaded {g.get('loaded_bytes')}")
    try:
        d = float(np.abs(emb(mode) - cpu).max())
        row["max_abs_diff_vs_cpu"] = d
        check(d < 1e-4, f"{mode}: embedding differs from the CPU's by {d}")
    except Exception as e:  # noqa: BLE001
        check(False, f"{mode}: no embedding ({e})")
    rep = glob.glob(f"{W}/runs/{mode}/*/report.json")
    if rep:
        r = json.load(open(rep[0]))
        row["task_seconds"] = r["tasks"][0]["stats"]["realtime_ms"] / 1000
    summary["modes"][mode] = row

lim = gpu("limited")
if check(lim is not None, "limited: no gpu.json"):
    b = lim.get("backoff")
    summary["backoff"] = {"limit": lim["options"].get("limit"), "backoff": b, "peak_bytes": lim["stats"]["peak_bytes"], "failed": lim["stats"]["failed"]}
    check(b is not None and b["final_batch"] < b["requested"], f"limited: no back-off recorded: {b}")
    check(lim["stats"]["failed"] >= 1, "limited: no refused allocation counted")
    d = float(np.abs(emb("limited") - cpu).max())
    summary["backoff"]["max_abs_diff_vs_cpu"] = d
    check(d < 1e-4, f"limited: embedding differs by {d}")

summary["toosmall_exit"] = int(open(f"{W}/toosmall.exit").read())
summary["toosmall_message"] = open(f"{W}/toosmall.err").read().strip().splitlines()[:2]
check(any("does not fit" in l for l in summary["toosmall_message"]), f"the model-too-large error is unclear: {summary['toosmall_message']}")
check(summary["toosmall_exit"] == 1, f"a pool smaller than the model should fail with exit 1, got {summary['toosmall_exit']}")
summary["nodev_exit"] = int(open(f"{W}/nodev.exit").read())
check(summary["nodev_exit"] == 1, f"--gpu 7 should fail with exit 1, got {summary['nodev_exit']}")

bud = gpu("budget")
if check(bud is not None, "budget: no gpu.json"):
    summary["budget"] = {"peak_bytes": bud["stats"]["peak_bytes"], "device_budget": bud["options"].get("device_budget"), "pointer_checks": bud["pointer_checks"]}
    check(bud["stats"]["peak_bytes"] > 64 * 2**20, "budget: the run never exceeded the simulated card")
    d = float(np.abs(emb("budget") - cpu).max())
    summary["budget"]["max_abs_diff_vs_cpu"] = d
    check(d < 1e-4, f"budget: embedding differs by {d}")

summary["models"] = {}
for name, key, mode in [("gf", "X_geneformer", "pool"), ("sg", "X_scgpt", "managed-pool")]:
    try:
        with h5py.File(f"{W}/{name}-cpu.h5ad", "r") as f:
            c = f[f"obsm/{key}"][()]
        with h5py.File(f"{W}/{name}-gpu.h5ad", "r") as f:
            g = f[f"obsm/{key}"][()]
        ok = ~np.isnan(c).any(axis=1)
        rel = float((np.linalg.norm(g[ok] - c[ok], axis=1) / np.linalg.norm(c[ok], axis=1)).max())
        gj = gpu(f"{name}-gpu")
        summary["models"][key] = {"cells": int(c.shape[0]), "max_rel_err_gpu_vs_cpu": rel, "allocator": gj and gj["allocator"], "peak_bytes": gj and gj["stats"]["peak_bytes"], "pointer_checks": gj and gj["pointer_checks"]}
        check(rel < 1e-4, f"{key}: GPU differs from CPU by {rel} relative")
        check(gj is not None and gj["pointer_checks"]["mismatched"] == 0, f"{key}: pointer checks {gj and gj['pointer_checks']}")
    except Exception as e:  # noqa: BLE001
        check(False, f"{key}: {e}")

summary["failures"] = failures
print(json.dumps(summary, indent=1))
sys.exit(1 if failures else 0)
