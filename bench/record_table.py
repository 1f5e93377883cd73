#!/usr/bin/env python3
"""The GPU table of record from bench/record_gpu.sh's runs (standard library only).

    python3 bench/record_table.py OUT_DIR [OUT_DIR...]   # the markdown table (one OUT_DIR a family run)
    python3 bench/record_table.py --assemble OUT_DIR     # OUT_DIR/record.jsonl from OUT_DIR/steps.jsonl
    python3 bench/record_table.py --self-test            # record_gpu.sh on stub tools, then the table

record_gpu.sh writes one line a command to OUT_DIR/steps.jsonl (the method, what it measures
in `field`, its settings in `meta`, the command, exit code, seconds and log files; lines whose
command is null say what a method is, or that a measurement is the same as another) and calls
`--assemble` at its end. `--assemble` keeps each measurement's latest run and writes one object
a method to OUT_DIR/record.jsonl:

    method, family, shape, notes, machine (nvidia-smi name, driver, date, binary version, torch),
    ceiling_tflops (the card's bf16 matrix ceiling in the same run),
    scfoundry_default, scfoundry_fastest, torch_upstream, torch_careful (+ sweep), end_to_end,
    peak_gpu_memory, accuracy

each with the command that produced it (`command`, null where nothing ran). The table: one row a
method, the ratios against the targets (scfoundry's default at least 1x and 3x upstream-style
PyTorch, the fastest at least 1.3x the careful PyTorch), the runs' machines, dates and binaries.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

METHODS = ["geneformer", "scgpt", "uce", "sccello", "langcell", "scfoundation", "scprint", "c2s", "cellfm",
           "scbert", "cellplm", "novae", "scimilarity", "scvi", "cellama"]
TARGET_DEFAULT = (1.0, 3.0)  # scfoundry default / upstream-style PyTorch
TARGET_CAREFUL = 1.3         # scfoundry fastest / careful PyTorch


# --- assembling record.jsonl ---------------------------------------------------------------------

def read_steps(out):
    steps = []
    path = os.path.join(out, "steps.jsonl")
    if not os.path.exists(path):
        return steps
    for i, line in enumerate(open(path), 1):
        line = line.strip()
        if not line:
            continue
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError as e:
            print(f"{path}:{i}: skipped ({e})", file=sys.stderr)
    return steps


def last_json(path):
    """The last line of a file that parses as a JSON object (None when there is none)."""
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def last_line(path):
    try:
        lines = [l for l in open(path, errors="replace").read().splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def number(v):
    """A meta value as an int or float where it is one."""
    if isinstance(v, str):
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
    return v


def latest(steps, method, field):
    """The steps of (method, field) from the latest run that has any."""
    found = [s for s in steps if s.get("method") == method and s.get("field") == field]
    if not found:
        return []
    run = max(s["run"] for s in found)
    return sorted((s for s in found if s["run"] == run), key=lambda s: s.get("n", 0))


def measurement(out, s):
    """One step as a measurement: its settings, command, exit, seconds, the tool's JSON line and
    the figure named by meta's `metric`."""
    meta = {k: number(v) for k, v in s.get("meta", {}).items()}
    d = {k: v for k, v in meta.items() if not k.startswith("note")}
    d.update(command=s.get("command"), run=s.get("run"))
    if s.get("command") is None:
        return d
    d.update(rc=s.get("rc"), seconds=s.get("seconds"), log=s.get("out"))
    result = last_json(os.path.join(out, s["out"])) if s.get("rc") == 0 else None
    d["result"] = result
    d["cells_per_s"] = result.get(meta.get("metric", "cells_per_s")) if isinstance(result, dict) else None
    if s.get("rc") != 0:
        d["error"] = last_line(os.path.join(out, s.get("err", "")))
        if s.get("rc") in (124, 137):
            d["error"] = f"timed out after {s.get('timeout_s')} s; " + d["error"]
    elif d["cells_per_s"] is None:
        d["error"] = f"no {meta.get('metric', 'cells_per_s')} in its output"
    notes = [v for k, v in s.get("meta", {}).items() if k.startswith("note")]
    if notes:
        d["note"] = "; ".join(notes)
    return d


def find_report(path):
    """report.json under a runs folder (the first found) and the allocator's peak in it."""
    reports = sorted(glob.glob(os.path.join(path, "**", "report.json"), recursive=True)) if os.path.isdir(path) else []
    if not reports and os.path.isfile(path):
        reports = [path]
    if not reports:
        return None, None
    try:
        rep = json.load(open(reports[0]))
    except (OSError, json.JSONDecodeError):
        return reports[0], None
    peaks = [g.get("stats", {}).get("peak_bytes") for g in rep.get("gpu") or []]
    peaks = [p for p in peaks if isinstance(p, (int, float))]
    return reports[0], (max(peaks) if peaks else None)


def smi_peak(path):
    """nvidia-smi memory.used samples (MiB, one a line): (peak, first)."""
    try:
        vals = [int(float(l)) for l in open(path).read().split() if l.strip().replace(".", "", 1).isdigit()]
    except OSError:
        return None, None
    return (max(vals), vals[0]) if vals else (None, None)


def end_to_end(out, steps, m):
    found = latest(steps, m, "e2e")
    if not found:
        return {"not_run": True}, {"not_run": True}
    wired = [s for s in found if "not_wired" in s.get("meta", {})]
    if wired:
        why = wired[-1]["meta"]["not_wired"]
        return {"not_wired": why, "command": None}, {"not_wired": why, "command": None}
    s0 = found[-1]
    meta = s0.get("meta", {})
    runs = []
    if "pipeline_results" in meta:  # bench/embed_pipeline_gpu.sh's results.tsv: model, cells, wall, report
        path = os.path.join(out, meta["pipeline_results"])
        try:
            rows = [l.rstrip("\n").split("\t") for l in open(path) if l.strip()]
        except OSError:
            rows = []
        for model, n, wall, report in (r for r in rows if len(r) == 4):
            if model != m:
                continue
            if not os.path.exists(report):  # the folder moved: look beside the results
                report = os.path.join(out, "e2e-pipeline", os.path.basename(report))
            runs.append({"cells": int(n), "wall_s": float(wall), "report": report, "smi": None})
        source = "bench/embed_pipeline_gpu.sh (results.tsv)"
    else:
        for s in found:
            if s.get("rc") != 0:
                continue
            runs.append({"cells": int(s["meta"]["cells"]), "wall_s": float(s["seconds"]),
                         "report": os.path.join(out, s["meta"].get("runs_dir", "")), "smi": s["meta"].get("smi")})
        source = "the step's wall time (process start to exit)"
    e = {"command": s0.get("command"), "rc": s0.get("rc"), "precision": meta.get("precision"), "source": source,
         "repeats": [{"wall_s": r["wall_s"], "cells": r["cells"]} for r in runs] or
                    [{"rc": s.get("rc"), "seconds": s.get("seconds")} for s in found]}
    if not runs:
        e["error"] = last_line(os.path.join(out, s0.get("err", ""))) or "no run finished"
        return e, {"command": s0.get("command"), "error": "no end-to-end run finished"}
    best = min(runs, key=lambda r: r["wall_s"])
    e.update(cells=best["cells"], wall_s=best["wall_s"], cells_per_s=best["cells"] / best["wall_s"])
    report, peak = find_report(best["report"])
    e["report"] = os.path.relpath(report, out) if report else None
    mem = {"command": s0.get("command"), "allocator_peak_bytes": peak,
           "source": "report.json gpu[].stats.peak_bytes (the allocator's peak)" if peak is not None else None}
    if best["smi"]:
        p, first = smi_peak(os.path.join(out, best["smi"]))
        mem.update(nvidia_smi_peak_mib=p, nvidia_smi_first_mib=first, nvidia_smi_samples=best["smi"])
        if peak is None and p is not None:
            mem["source"] = "nvidia-smi memory.used sampled every 200 ms (the whole card)"
    return e, mem


def fidelity_row(out, steps, m):
    for s in sorted((s for s in steps if s.get("method") == "_family" and s.get("field") == "accuracy"),
                    key=lambda s: (s["run"], s.get("n", 0)), reverse=True):
        if m not in s.get("meta", {}).get("models", "").split():
            continue
        acc = {"command": s.get("command"), "rc": s.get("rc"), "tsv": s["meta"].get("tsv")}
        try:
            lines = [l.rstrip("\n").split("\t") for l in open(os.path.join(out, s["meta"]["tsv"])) if l.strip()]
        except OSError:
            lines = []
        head = lines[0] if lines else []
        for row in lines[1:]:
            r = dict(zip(head, row))
            if r.get("method") == m and r.get("lowest_cosine", "-") != "-":
                acc.update(kind="measured", default_resolved=r.get("default_resolved"), lowest_cosine=r["lowest_cosine"],
                           largest_rel_error=r.get("largest_rel_error"), cells=r.get("cells"),
                           scib_total_f32=r.get("scib_total_f32"), scib_total_default=r.get("scib_total_default"))
                return acc
        acc.update(kind="missing", why=f"no figures for {m} in {s['meta'].get('tsv')} (the script's exit {s.get('rc')}; "
                                      f"its logs: {os.path.dirname(s['meta'].get('tsv') or '')}/{m}_*.log)")
        return acc
    return None


def assemble(out):
    steps = read_steps(out)
    machines = {}
    for p in glob.glob(os.path.join(out, "machine-*.json")):
        try:
            m = json.load(open(p))
            machines[m["run"]] = m
        except (OSError, json.JSONDecodeError, KeyError):
            pass
    methods = [m for m in METHODS if any(s.get("method") == m for s in steps)]
    methods += sorted({s["method"] for s in steps if not s["method"].startswith("_")} - set(methods))
    records = []
    for m in methods:
        mine = [s for s in steps if s.get("method") == m]
        info = latest(steps, m, "info")
        meta = info[-1]["meta"] if info else {}
        rec = {"method": m, "family": mine[-1].get("family"), "shape": meta.get("shape"),
               "notes": [v for k, v in meta.items() if k.startswith("note")]}
        fields = {}
        for f in ("sf_default", "torch_upstream"):
            got = latest(steps, m, f)
            fields[f] = measurement(out, got[-1]) if got else None
        # the fastest: the best of its precision's batch sweep, or the default where that is faster
        fast = [measurement(out, s) for s in latest(steps, m, "sf_fastest")]
        same = [d for d in fast if "same_as" in d]
        ok = [d for d in fast if value(d) is not None]
        if same or not fast:
            fields["sf_fastest"] = same[-1] if same else None
        else:
            runs = summary(fast, ("batch", "precision", "cells_per_s", "rc", "error", "command"))
            if ok and value(fields["sf_default"]) is not None and value(fields["sf_default"]) >= max(map(value, ok)):
                fields["sf_fastest"] = {"same_as": "sf_default", "why": "the default's precision and batch were the fastest of the sweep", "sweep": runs}
            else:
                best = dict(max(ok, key=value)) if ok else dict(fast[-1], error="every batch of the sweep failed")
                if len(fast) > 1:
                    best["sweep"] = runs
                fields["sf_fastest"] = best
        sweep = [measurement(out, s) for s in latest(steps, m, "torch_careful")]
        same = [d for d in sweep if "same_as" in d]
        if same:
            fields["torch_careful"] = same[-1]
        elif sweep:
            ok = [d for d in sweep if value(d) is not None]
            best = dict(max(ok, key=value)) if ok else {"error": "every batch of the sweep failed", "command": sweep[-1]["command"]}
            best["sweep"] = summary(sweep, ("batch", "cells_per_s", "rc", "error", "command"))
            fields["torch_careful"] = best
        else:
            fields["torch_careful"] = None
        for f, ref in (("sf_fastest", "sf_default"), ("torch_careful", "torch_upstream")):
            d = fields[f]
            if d and "same_as" in d and fields.get(ref):
                fields[f] = dict(fields[ref], same_as=ref, why=d.get("why"), command=fields[ref].get("command"))
                if d.get("sweep"):
                    fields[f]["sweep"] = d["sweep"]
        rec["scfoundry_default"] = fields["sf_default"]
        rec["scfoundry_fastest"] = fields["sf_fastest"]
        rec["torch_upstream"] = fields["torch_upstream"]
        rec["torch_careful"] = fields["torch_careful"]
        rec["end_to_end"], rec["peak_gpu_memory"] = end_to_end(out, steps, m)
        rec["ncu"] = {}
        for st in latest(steps, m, "ncu"):
            d = measurement(out, st)
            res = d.get("result")
            rec["ncu"][str(d.get("precision"))] = (
                {"groups": res.get("groups"), "launches": res.get("launches"), "device_ms": res.get("device_ms"), "command": d.get("command")}
                if isinstance(res, dict) and res.get("groups") else {"error": d.get("error") or "no ncu_bound line in its output", "command": d.get("command")})
        exact = latest(steps, m, "accuracy")
        if exact:
            rec["accuracy"] = {"kind": "exact", "text": "f32 (exact)", "why": exact[-1]["meta"].get("why"), "command": None}
        else:
            rec["accuracy"] = fidelity_row(out, steps, m) or {"kind": "not_run", "command": None}
        sd = rec["scfoundry_default"] or {}
        if isinstance(sd.get("result"), dict) and isinstance(sd["result"].get("against_f32"), dict):
            rec["accuracy"]["bench_first_batch"] = sd["result"]["against_f32"]
        # the fastest path's own checks: bf16 against f32, or the one-kernel path against candle's ops
        fr = (rec["scfoundry_fastest"] or {}).get("result")
        for key in ("against_f32", "fused_vs_candle_ops"):
            if isinstance(fr, dict) and isinstance(fr.get(key), dict):
                rec["accuracy"][f"fastest_{key}"] = fr[key]
        run = sd.get("run") or (mine[-1].get("run"))
        rec["machine"] = machines.get(run) or (machines[max(machines)] if machines else None)
        ceiling = [s for s in latest(steps, "_family", "ceiling") if s.get("run") == run] or latest(steps, "_family", "ceiling")
        c = measurement(out, ceiling[-1]) if ceiling else {}
        rec["ceiling_tflops"] = c.get("cells_per_s")
        records.append(rec)
    with open(os.path.join(out, "record.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return records


# --- the table ------------------------------------------------------------------------------------

def rate(v):
    if not isinstance(v, (int, float)):
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def failed(d):
    if d is None:
        return "not run"
    if d.get("not_run"):
        return "not run"
    if d.get("not_wired"):
        return "not wired"
    rc = d.get("rc")
    if rc in (124, 137):
        return "timed out"
    if rc not in (0, None):
        return f"failed (exit {rc})"
    return "failed"


def summary(runs, keys):
    """A sweep's runs as their `keys` (record.jsonl's `sweep` lists)."""
    return [{k: d.get(k) for k in keys} for d in runs]


def value(d):
    return d.get("cells_per_s") if isinstance(d, dict) and isinstance(d.get("cells_per_s"), (int, float)) else None


def ratio(a, b, floors):
    if a is None or b is None or b == 0:
        return "-"
    r = a / b
    text = f"{r:.2f}x" if r < 10 else f"{r:.1f}x"
    below = [f for f in floors if r < f]
    if below:  # bold: slower than that PyTorch
        return f"{'**' + text + '**' if r < 1 else text} (below {below[0]:g}x)"
    return text


def torch_cell(d, upstream_ref=False):
    v = value(d)
    if v is None:
        return failed(d)
    if d.get("same_as") == "torch_upstream":
        return f"{rate(v)} (= upstream-style)"
    b = d.get("batch", "?")
    return f"{rate(v)} ({d.get('dtype', '?')}, {d.get('order', '?')}, {f'{b:,}' if isinstance(b, int) else b})"


def mib(b):
    return f"{b / 2**20:,.0f} MiB"


def row(r):
    sd, sf, up, ca = r["scfoundry_default"], r["scfoundry_fastest"], r["torch_upstream"], r["torch_careful"]
    e2e, mem, acc = r["end_to_end"], r["peak_gpu_memory"], r["accuracy"]
    name = f"{r['method']} ({r['shape']})" if r.get("shape") else r["method"]
    default = f"{rate(value(sd))} ({sd.get('precision')})" if value(sd) is not None else failed(sd)
    if value(sf) is None:
        fastest = failed(sf)
    elif sf.get("same_as"):
        fastest = f"{rate(value(sf))} ({sf.get('precision')}, = default)"
    else:
        b = sf.get("batch")
        at = f", batch {b:,}" if isinstance(b, int) and b != sd.get("batch") else ""
        fastest = f"{rate(value(sf))} ({sf.get('precision')}{at}{', bench only' if 'bench only' in (sf.get('note') or '') else ''})"
    r_up = ratio(value(sd), value(up), TARGET_DEFAULT)
    r_ca = ratio(value(sf), value(ca), (TARGET_CAREFUL,))
    end = f"{rate(e2e['cells_per_s'])} ({e2e['cells']:,} cells)" if isinstance(e2e.get("cells_per_s"), (int, float)) else failed(e2e)
    if mem.get("allocator_peak_bytes") is not None:
        peak = mib(mem["allocator_peak_bytes"])
        if mem.get("nvidia_smi_peak_mib") is not None:
            peak += f" ({mem['nvidia_smi_peak_mib']:,} MiB nvidia-smi)"
    elif mem.get("nvidia_smi_peak_mib") is not None:
        peak = f"{mem['nvidia_smi_peak_mib']:,} MiB (nvidia-smi)"
    else:
        peak = "not wired" if mem.get("not_wired") else "-"
    if acc.get("kind") == "measured":
        accuracy = f"{acc['lowest_cosine']} / {acc['largest_rel_error']}"
    elif acc.get("kind") == "exact":
        accuracy = "f32 (exact)"
    elif acc.get("kind") == "not_run":
        accuracy = recorded_accuracy(r["method"]) or "not measured"
    else:
        accuracy = "not measured"
    cells = [name, default, fastest, torch_cell(up), torch_cell(ca), r_up, r_ca, end, peak, accuracy, bound(r.get("ncu") or {})]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def bound(ncu, top=2):
    """What bounds a run, per precision measured: its `top` kernel groups by device time, each
    with its share of the time and its highest throughput counter in % of peak."""
    if not ncu:
        return "-"
    parts = []
    for p, d in ncu.items():
        if d.get("error"):
            parts.append(f"{p}: failed")
            continue
        shown = []
        for g in sorted(d["groups"], key=lambda g: -g["time_pct"])[:top]:
            name = "products" if g["kernel"].startswith("cuBLAS") else g["kernel"]
            highest = f" ({g['highest']} {g['highest_pct']:.0f}%)" if g.get("highest") else ""
            shown.append(f"{name} {g['time_pct']:.0f}% of the time{highest}")
        parts.append(f"{p}: {', '.join(shown)}")
    return "; ".join(parts)


def recorded_accuracy(method):
    """Where a run did not measure accuracy: what methods/<method>.toml records of its GPU default
    (`[precision.fidelity]`, from bench/precision_fidelity_gpu.sh), with where and when it was
    measured; "f32 (exact)" where the GPU default is f32; None without a readable file."""
    try:
        import tomllib
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "methods", f"{method}.toml"), "rb") as f:
            t = tomllib.load(f)
    except (ImportError, OSError, ValueError):
        return None
    p = t.get("precision") or {}
    if p.get("gpu_default", "f32") == "f32":
        return "f32 (exact)"
    fid = p.get("fidelity") or {}
    if "lowest_cosine" not in fid:
        return None
    return (f"{fid['lowest_cosine']} / {fid['largest_rel_error']:.1e} (methods/{method}.toml: {fid.get('date', '?')}, "
            f"commit {fid.get('commit', '?')})")


def notes(r):
    out = []
    m = r["method"]
    out += [f"{m}: {n}" for n in r.get("notes") or []]
    for key, label in (("scfoundry_default", "scfoundry default"), ("scfoundry_fastest", "scfoundry fastest"),
                       ("torch_upstream", "upstream-style PyTorch"), ("torch_careful", "careful PyTorch")):
        d = r.get(key) or {}
        if d.get("note") and key != "scfoundry_default":
            out.append(f"{m}, {label}: {d['note']}")
        if d.get("same_as") and d.get("why") and key == "torch_careful":
            out.append(f"{m}, {label}: {d['why']}")
        if d.get("error"):
            out.append(f"{m}, {label}: {d['error']}")
        for s in d.get("sweep") or []:
            if s.get("error"):
                out.append(f"{m}, {label} at batch {s.get('batch')}: {s['error']}")
    e = r.get("end_to_end") or {}
    if e.get("not_wired"):
        out.append(f"{m}, end to end: not wired, {e['not_wired']}")
    elif e.get("error"):
        out.append(f"{m}, end to end: {e['error']}")
    a = r.get("accuracy") or {}
    if a.get("kind") == "missing":
        out.append(f"{m}, accuracy: {a.get('why')}")
    return out


def machine_line(m):
    if not m:
        return "machine not recorded"
    version = ", ".join(p.strip() for p in (m.get("version") or "").splitlines() if p.strip()) or "version not recorded"
    return (f"{m.get('gpu') or 'no GPU named'} ({m.get('memory_total', '?')}, driver {m.get('driver', '?')}, {m.get('cpus', '?')} CPUs), "
            f"{m.get('date', '?')}, {version}; PyTorch {m.get('torch', '?')}")


def table(out_dirs):
    records = []
    for out in out_dirs:
        path = os.path.join(out, "record.jsonl")
        if os.path.exists(os.path.join(out, "steps.jsonl")) and (
                not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(os.path.join(out, "steps.jsonl"))):
            assemble(out)
        if not os.path.exists(path):
            print(f"{out}: no record.jsonl nor steps.jsonl", file=sys.stderr)
            continue
        records += [json.loads(l) for l in open(path) if l.strip()]
    # a method measured in several folders: the latest run's record
    by_method = {}
    for r in records:
        run = (r.get("machine") or {}).get("run", "")
        if r["method"] not in by_method or run >= (by_method[r["method"]].get("machine") or {}).get("run", ""):
            by_method[r["method"]] = r
    order = [m for m in METHODS if m in by_method] + sorted(set(by_method) - set(METHODS))
    rows = [by_method[m] for m in order]
    lines = []
    runs = {}
    for r in rows:
        m = r.get("machine") or {}
        runs.setdefault((r.get("family"), m.get("run")), (m, r.get("ceiling_tflops")))
    lines.append("Runs (family: card, date, binary, PyTorch; bf16 matrix ceiling of the card in the same run):")
    lines.append("")
    for (family, _), (m, ceiling) in runs.items():  # in the rows' order
        lines.append(f"- {family}: {machine_line(m)}" + (f"; ceiling {ceiling:,.1f} TFLOP/s" if isinstance(ceiling, (int, float)) else ""))
    cards = {(m.get("gpu") or "?") for m, _ in runs.values()}
    if len(cards) > 1:
        lines.append(f"- the rows come from different cards ({', '.join(sorted(cards))}): compare within a row")
    lines.append("")
    lines.append("| method (shape) | scfoundry default, cells/s (precision) | fastest, cells/s (precision) | upstream-style PyTorch (dtype, order, batch) "
                 "| careful PyTorch (dtype, order, batch) | default / upstream-style | fastest / careful | `embed` end to end, cells/s "
                 "| peak GPU memory | accuracy vs f32 (lowest cosine / largest rel. error) "
                 "| what bounds it (ncu: largest kernel groups, highest counter in % of peak) |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    lines += [row(r) for r in rows]
    lines.append("")
    lines.append(f"Targets: scfoundry's default at least {TARGET_DEFAULT[0]:g}x and {TARGET_DEFAULT[1]:g}x upstream-style PyTorch, its fastest "
                 f"precision at least {TARGET_CAREFUL:g}x the careful PyTorch; a ratio below its target says which, in bold where "
                 "scfoundry is the slower. Peak GPU memory: the allocator's peak in the "
                 "end-to-end run's report.json (nvidia-smi's peak for the whole card, CUDA context included, in brackets). "
                 "What bounds it: bench/ncu_bound.sh over one forward pass of the bench's run at the default batch (per precision "
                 "measured), its two largest kernel groups by device time with the highest of their SM, memory, DRAM, "
                 "issue, tensor and FMA / ALU throughputs; 70% or more of peak is that resource's bound, less is latency "
                 "or occupancy; \"-\" where no ncu run was made (STEPS=ncu).")
    missing = [m for m in METHODS if m not in by_method]
    if missing:
        lines.append("")
        lines.append(f"Not in these runs: {', '.join(missing)}.")
    n = [x for r in rows for x in notes(r)]
    if n:
        lines.append("")
        lines.append("Notes:")
        lines.append("")
        lines += [f"- {x}" for x in n]
    return "\n".join(lines)


# --- self-test ------------------------------------------------------------------------------------

STUB_PY = r'''#!/usr/bin/env python3
# stands in for the GPU machine's python: the bench/*_torch.py scripts print canned JSON lines,
# the writers make their outputs empty, anything else runs the real interpreter
import json, os, sys
real = os.environ["RECORD_SELFTEST_PY"]
a = sys.argv[1:]
def opt(name, default=None):
    return a[a.index(name) + 1] if name in a else default
if not a or a[0] not in ("-c",) and not a[0].startswith("bench/") or a[0] == "bench/record_table.py":
    os.execv(real, [real] + a)
if a[0] == "-c":
    print("2.11.0+stub"); sys.exit(0)
script, batch, dtype = a[0], int(opt("--batch", "0")), opt("--dtype", "f32")
def out(**kw):
    print("some progress line"); print(json.dumps(dict(tool="pytorch", batch=batch, dtype=dtype, **kw))); sys.exit(0)
def oom():
    print("Traceback (most recent call last):", file=sys.stderr)
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr); sys.exit(1)
if script == "bench/encoder_torch.py":
    layers = int(opt("--layers"))
    if layers == 6:
        if dtype == "f32": out(cells_per_s=1064.0)
        if batch == 128: oom()
        out(cells_per_s=2000.0 + 10 * batch)
    if dtype == "f16": out(cells_per_s=733.3)
    out(cells_per_s=1000.0 + batch)
if script == "bench/scbert_torch.py":
    if "--bf16" in a: out(cells_per_s=30.0 + batch)
    if "--tf32" not in a: out(cells_per_s=20.0)
    if batch == 8: oom()
    out(cells_per_s=40.0 + batch)
if script == "bench/cellplm_torch.py": out(cells_per_s=150000.0 if dtype == "bf16" else 89768.0)
if script == "bench/scimilarity_torch.py":
    out(cells_per_s=286350.0, upstream_cells_per_s=80777.0 if batch == 10000 else 1.0,
        careful_cells_per_s=396152.0 if batch == 8192 else 300000.0)
if script == "bench/scvi_torch.py":
    out(cells_per_s={128: 793124.0, 1024: 3410895.0, 8192: 5586509.0}.get(batch, 1.0))
if script in ("bench/tile_h5ad.py", "bench/random_models.py"):
    sys.exit(0)
print(f"stub python: no stand-in for {a}", file=sys.stderr); sys.exit(3)
'''

STUB_BENCH = r'''#!/usr/bin/env python3
import json, sys
a = sys.argv[1:]
if a[:1] == ["--version"]:
    print("scfoundry-bench 0.9.0\ncommit: abc1234\ngpu: CUDA 12.8; machine code sm_80, sm_90, sm_90a"); sys.exit(0)
def opt(name, default=None):
    return a[a.index(name) + 1] if name in a else default
sub, arch = a[0], opt("--arch", "bert")
def out(**kw):
    print(json.dumps(dict(tool="scfoundry", version="0.9.0", **kw))); sys.exit(0)
if sub == "__bench-encoder":
    if arch == "gemm": out(ceiling_tflops=790.5)
    if arch == "bert" and opt("--layers") == "6": out(cells_per_s=30151.0, dtype=opt("--dtype"))
    if arch == "scgpt": out(cells_per_s=7945.0, dtype=opt("--dtype"))
    if arch == "scbert" and opt("--dtype") == "bf16":
        if opt("--batch") == "32": print("Error: CUDA out of memory", file=sys.stderr); sys.exit(1)
        out(cells_per_s={"3": 45.0, "8": 60.0}[opt("--batch")], dtype="bf16")
    if arch == "scbert": out(cells_per_s=16.2 if "--unfused" in a else 40.0, dtype=opt("--dtype"))
if sub == "__bench-cellplm": out(cells_per_s=250000.0 if opt("--dtype") == "bf16" else 68412.0, dtype=opt("--dtype"))
if sub == "__bench-scimilarity": out(cells_per_s=76356.0, sparse_cells_per_s={"8192": 420000.0, "16384": 410000.0}.get(opt("--batch"), 339918.0))
if sub == "__bench-scvi": out(cells_per_s=624064.0, sparse_cells_per_s={"16384": 5600000.0, "65536": 3000000.0}.get(opt("--batch"), 4856645.0))
print(f"error: no stand-in for {a}", file=sys.stderr); sys.exit(2)
'''

STUB_SCFOUNDRY = r'''#!/usr/bin/env python3
import json, os, sys, time
a = sys.argv[1:]
if a[:1] == ["--version"]:
    print("scfoundry 0.9.0\ncommit: abc1234\ngpu: CUDA 12.8; machine code sm_80, sm_90, sm_90a"); sys.exit(0)
runs = a[a.index("--runs-dir") + 1]
time.sleep(0.2)
os.makedirs(os.path.join(runs, "run-1"), exist_ok=True)
peak = {"scimilarity": 633, "scvi": 581}[a[a.index("-m") + 1]] * 2**20
json.dump({"status": "completed", "gpu": [{"stats": {"peak_bytes": peak}}]}, open(os.path.join(runs, "run-1", "report.json"), "w"))
'''

# `bash` on PATH: the two GPU scripts record_gpu.sh calls write what they would write; the rest
# goes to the real bash
STUB_BASH = r'''#!/bin/sh
case "$1" in
  bench/embed_pipeline_gpu.sh)
    mkdir -p "$2"; : > "$2/results.tsv"
    for w in 9.1 8.03; do
      r="$2/$MODELS-$w.report.json"
      echo '{"status": "completed", "gpu": [{"stats": {"peak_bytes": 461373440}}]}' > "$r"
      printf '%s\t%s\t%s\t%s\n' "$MODELS" "$CELLS" "$w" "$r" >> "$2/results.tsv"
    done
    echo "model cells wall e2e c/s"; exit 0 ;;
  bench/precision_fidelity_gpu.sh)
    mkdir -p "$2"
    printf 'method\tdevice\tcells\tdim\tdefault_requested\tdefault_resolved\tlowest_cosine\tlargest_rel_error\tscib_total_f32\tscib_total_default\twall_s_f32\twall_s_default\tfinite\n' > "$2/fidelity.tsv"
    printf 'geneformer\tcuda\t200\t256\tauto\tbf16\t0.999981\t6.1e-3\t0.3976\t0.3948\t20.2\t3.2\ttrue\n' >> "$2/fidelity.tsv"
    printf 'scgpt\tcuda\t200\t512\tauto\tbf16\t-\t-\t-\t-\texit 1\texit 1\t-\n' >> "$2/fidelity.tsv"
    exit 0 ;;
esac
exec /bin/bash "$@"
'''

STUB_SMI = r'''#!/bin/sh
case "$*" in
  *name,driver_version*) echo "NVIDIA Stub 80GB, 580.1, 81559 MiB" ;;
  *memory.used*) printf '512\n1500\n1137\n' ;;
esac
'''


# `ncu` on PATH: the launches of a run (the random weights' making, then forward passes) as
# bench/ncu_bound.sh asks for them, with made-up counters
STUB_NCU = r'''#!/usr/bin/env python3
import csv, sys
a = sys.argv[1:]
if "--query-metrics" in a:
    print("sm__pipe_tensor_op_gmma_cycles_active   Counter   # of cycles where the GMMA pipe was active"); sys.exit(0)
def opt(name, default=None):
    return a[a.index(name) + 1] if name in a else default
metrics = opt("--metrics").split(",")
skip, count = int(opt("--launch-skip", "0")), int(opt("--launch-count", "60"))
dtype = opt("--dtype", "bf16")
if "scbert" in a:  # four products before the first features
    forward = ["nvjet_sm90_sss_128x64(x)"] * 4 + [f"favor_features_{dtype}", f"favor_features_{dtype}", "gelu_erf_f32"]
else:  # six launches before the attention
    forward = ["layer_norm_bf16_p2", "nvjet_hsh_128x256(x)", "nvjet_hsh_64x128(x)"] * 2 + ["varlen_attention_bf16_d64_sm90"]
names = ["gen_sequenced<curandStateXORWOW>(x)"] * 7 + ["cast_f32_bf16"] * 3 + forward * 50
# kernel -> (ns, counters by metric prefix)
KINDS = {"nvjet": (3000, dict(sm__throughput=70, gpu__compute_memory=40, dram=30, sm__inst=20, sm__pipe_tensor_op_hmma=0, sm__pipe_fma=5, sm__pipe_alu=3, sm__pipe_tensor_op_gmma=72)),
         "varlen": (2000, dict(sm__throughput=60, gpu__compute_memory=50, dram=20, sm__inst=45, sm__pipe_tensor_op_hmma=0, sm__pipe_fma=10, sm__pipe_alu=15, sm__pipe_tensor_op_gmma=48)),
         "favor": (2500, dict(sm__throughput=30, gpu__compute_memory=85, dram=83, sm__inst=20, sm__pipe_tensor_op_hmma=0, sm__pipe_fma=12, sm__pipe_alu=9, sm__pipe_tensor_op_gmma=0)),
         "": (500, dict(sm__throughput=20, gpu__compute_memory=80, dram=75, sm__inst=10, sm__pipe_tensor_op_hmma=0, sm__pipe_fma=2, sm__pipe_alu=4, sm__pipe_tensor_op_gmma=0))}
with open(opt("--log-file"), "w", newline="") as f:
    w = csv.writer(f, quoting=csv.QUOTE_ALL)
    w.writerow(["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size", "Grid Size",
                "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
    for i in range(skip, min(skip + count, len(names))):
        ns, counters = next(v for k, v in KINDS.items() if k in names[i])
        for m in metrics:
            v = ns if m.startswith("gpu__time_duration") else next((c for k, c in counters.items() if m.startswith(k)), 0)
            w.writerow([i - skip, 1, "stub", "host", names[i], 1, 7, "(128, 1, 1)", "(132, 1, 1)", 0, "9.0", "", m, "%", v])
'''


def self_test():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    tmp = tempfile.mkdtemp(prefix="record-selftest-")
    try:
        stubs = os.path.join(tmp, "stubs")
        os.makedirs(stubs)
        for name, text in (("python", STUB_PY), ("scfoundry-bench", STUB_BENCH), ("scfoundry", STUB_SCFOUNDRY),
                           ("bash", STUB_BASH), ("nvidia-smi", STUB_SMI), ("ncu", STUB_NCU)):
            p = os.path.join(stubs, name)
            with open(p, "w") as f:
                f.write(text.replace("#!/usr/bin/env python3", f"#!{sys.executable}", 1))
            os.chmod(p, 0o755)
        env = dict(os.environ, PATH=stubs + os.pathsep + os.environ.get("PATH", ""), RECORD_SELFTEST_PY=sys.executable,
                   BIN=os.path.join(stubs, "scfoundry"), BENCH_BIN=os.path.join(stubs, "scfoundry-bench"),
                   PY=os.path.join(stubs, "python"), STEP_TIMEOUT="30", LONG_TIMEOUT="30", E2E_CELLS="1000",
                   E2E_REPEAT="2", MLP_BATCHES="1024 8192", BATCHES="8 64 128")
        env.pop("DRY_RUN", None)
        outs = {}
        for family in ("bert", "scbert", "cellplm", "mlp"):
            out = os.path.join(tmp, family)
            e = dict(env, BATCHES="1 3 8") if family == "scbert" else env
            p = subprocess.run(["/bin/bash", os.path.join(here, "record_gpu.sh"), family, out], cwd=repo, env=e,
                               capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, f"record_gpu.sh {family}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
            outs[family] = out
        # STEPS=ncu alone into the same folders: the bound of each bench run, throughput kept
        for family in ("bert", "scbert"):
            p = subprocess.run(["/bin/bash", os.path.join(here, "record_gpu.sh"), family, outs[family]], cwd=repo,
                               env=dict(env, STEPS="ncu"), capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, f"record_gpu.sh {family} STEPS=ncu: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        # a dry run prints the commands and writes nothing
        dry = os.path.join(tmp, "dry")
        p = subprocess.run(["/bin/bash", os.path.join(here, "record_gpu.sh"), "uce", dry], cwd=repo,
                           env=dict(env, DRY_RUN="1"), capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and not os.path.exists(dry), p.stderr
        assert "--pad-to 1536" in p.stdout and "bench/precision_fidelity_gpu.sh" in p.stdout and "PRECISION=auto" in p.stdout, p.stdout

        # record.jsonl: one object a method, each measurement with its command
        recs = {r["method"]: r for out in outs.values() for r in map(json.loads, open(os.path.join(out, "record.jsonl")))}
        assert sorted(recs) == sorted(["geneformer", "scgpt", "scbert", "cellplm", "scimilarity", "scvi"]), sorted(recs)
        g = recs["geneformer"]
        assert g["scfoundry_default"]["cells_per_s"] == 30151.0 and g["scfoundry_default"]["precision"] == "bf16"
        assert "__bench-encoder --arch bert --layers 6" in g["scfoundry_default"]["command"], g["scfoundry_default"]["command"]
        assert g["scfoundry_fastest"]["same_as"] == "sf_default" and g["scfoundry_fastest"]["cells_per_s"] == 30151.0
        assert g["torch_upstream"]["cells_per_s"] == 1064.0 and g["torch_upstream"]["order"] == "sorted"
        assert g["torch_careful"]["batch"] == 64 and g["torch_careful"]["cells_per_s"] == 2640.0
        assert [s["batch"] for s in g["torch_careful"]["sweep"]] == [8, 64, 128]
        assert g["torch_careful"]["sweep"][2]["rc"] == 1 and "out of memory" in g["torch_careful"]["sweep"][2]["error"]
        assert g["end_to_end"]["wall_s"] == 8.03 and g["end_to_end"]["cells"] == 1000
        assert "bench/embed_pipeline_gpu.sh" in g["end_to_end"]["command"] and "PRECISION=auto" in g["end_to_end"]["command"]
        assert g["peak_gpu_memory"]["allocator_peak_bytes"] == 461373440
        assert g["accuracy"]["kind"] == "measured" and g["accuracy"]["lowest_cosine"] == "0.999981"
        assert "precision_fidelity_gpu.sh" in g["accuracy"]["command"]
        assert g["machine"]["gpu"] == "NVIDIA Stub 80GB" and g["machine"]["torch"] == "2.11.0+stub"
        assert g["ceiling_tflops"] == 790.5
        assert recs["scgpt"]["accuracy"]["kind"] == "missing"
        assert recs["scgpt"]["torch_upstream"]["dtype"] == "f16" and recs["scgpt"]["torch_upstream"]["order"] == "file"
        b = recs["scbert"]
        assert b["accuracy"]["kind"] == "exact" and "embed -m scbert --model-dir" in b["end_to_end"]["command"], b["end_to_end"]
        assert b["torch_careful"]["cells_per_s"] == 43.0 and b["torch_careful"]["dtype"] == "tf32"
        # the fastest: the best of bf16's batch sweep (batch 32 failed)
        assert b["scfoundry_fastest"]["batch"] == 8 and b["scfoundry_fastest"]["cells_per_s"] == 60.0, b["scfoundry_fastest"]
        assert [(x["batch"], x["rc"]) for x in b["scfoundry_fastest"]["sweep"]] == [(3, 0), (8, 0), (32, 1)], b["scfoundry_fastest"]
        # geneformer: no sweep of its own, the default is the fastest; scvi: the default's batch
        # loses to 16,384
        assert recs["scvi"]["scfoundry_fastest"]["batch"] == 16384 and recs["scvi"]["scfoundry_fastest"]["cells_per_s"] == 5600000.0
        # ncu: the window starts at the method's own kernel, past the random weights' making
        gb = g["ncu"]["bf16"]["groups"]
        assert [x["kernel"] for x in gb] == ["cuBLAS/cuBLASLt products", "varlen_attention_bf16_d64_sm90", "layer_norm_bf16_p2"], gb
        assert gb[0]["highest"] == "tensor (wgmma)" and gb[0]["highest_pct"] == 72.0 and gb[0]["time_pct"] == 79.8, gb[0]
        assert g["ncu"]["bf16"]["launches"] == 120, g["ncu"]  # NCU_COUNT's for geneformer
        assert sorted(b["ncu"]) == ["bf16", "f32"] and "--dtype f32" in b["ncu"]["f32"]["command"], b["ncu"]
        assert [x["kernel"] for x in b["ncu"]["bf16"]["groups"]] == ["cuBLAS/cuBLASLt products", "favor_features_bf16", "gelu_erf_f32"], b["ncu"]["bf16"]
        assert g["scfoundry_default"]["cells_per_s"] == 30151.0  # the throughput run's, kept
        c = recs["cellplm"]
        assert c["torch_careful"]["cells_per_s"] == 150000.0 and c["torch_careful"]["dtype"] == "bf16", c["torch_careful"]
        # bf16, its GPU default (methods/cellplm.toml): the fastest is the same run
        assert c["scfoundry_default"]["cells_per_s"] == 250000.0 and c["scfoundry_default"]["precision"] == "bf16", c["scfoundry_default"]
        assert c["scfoundry_fastest"]["same_as"] == "sf_default" and c["torch_upstream"]["cells_per_s"] == 89768.0
        s = recs["scimilarity"]
        assert s["scfoundry_default"]["cells_per_s"] == 339918.0 and s["torch_upstream"]["cells_per_s"] == 80777.0
        assert s["torch_careful"]["cells_per_s"] == 396152.0 and s["torch_careful"]["batch"] == 8192
        assert s["end_to_end"]["cells"] == 1000 and 0.15 < s["end_to_end"]["wall_s"] < 30
        assert s["peak_gpu_memory"]["allocator_peak_bytes"] == 633 * 2**20 and s["peak_gpu_memory"]["nvidia_smi_peak_mib"] == 1500
        assert "embed -m scimilarity" in s["end_to_end"]["command"] and "--embedding-only" in s["end_to_end"]["command"]
        assert len(s["end_to_end"]["repeats"]) == 2

        # the table
        text = table(list(outs.values()))
        rows = {l.split(" (", 1)[0].lstrip("| "): l for l in text.splitlines() if l.startswith("| ") and not l.startswith("| method")}
        gr = rows["geneformer"]
        for want in ("30,151 (bf16)", "30,151 (bf16, = default)", "1,064 (f32, sorted, 100)", "2,640 (bf16, sorted, 64)",
                     "| 28.3x |", "| 11.4x |", "440 MiB", "0.999981 / 6.1e-3"):
            assert want in gr, (want, gr)
        assert "| 125 (1,000 cells) |" in gr, gr  # 1,000 cells in 8.03 s
        assert gr.endswith("| bf16: products 80% of the time (tensor (wgmma) 72%), varlen_attention_bf16_d64_sm90 13% of the time (SM 60%) |"), gr
        assert rows["scbert"].endswith("| f32: products 69% of the time (tensor (wgmma) 72%), favor_features_f32 28% of the time (memory 85%); "
                                       "bf16: products 69% of the time (tensor (wgmma) 72%), favor_features_bf16 28% of the time (memory 85%) |"), rows["scbert"]
        assert rows["cellplm"].endswith("| - |"), rows["cellplm"]
        assert "| 2.00x (below 3x) |" in rows["scbert"] and "| 1.40x |" in rows["scbert"], rows["scbert"]
        assert "f32 (exact)" in rows["scbert"], rows["scbert"]
        assert "250,000 (bf16) | 250,000 (bf16, = default)" in rows["cellplm"] and "150,000 (bf16, file, 50,000)" in rows["cellplm"], rows["cellplm"]
        assert "| 2.78x (below 3x) |" in rows["cellplm"] and "1.67x" in rows["cellplm"], rows["cellplm"]
        # f32 is its GPU default; the fastest is bf16 at the best batch of its sweep
        # (", bench only" after it while methods/scbert.toml has no --precision knob)
        assert "| 40.0 (f32) | 60.0 (bf16, batch 8" in rows["scbert"], rows["scbert"]
        assert "scbert, scfoundry fastest at batch 32: Error: CUDA out of memory" in text, text
        assert "| 4.21x |" in rows["scimilarity"] and "| 420,000 (f32, batch 8,192) |" in rows["scimilarity"], rows["scimilarity"]
        assert "| 1.06x (below 1.3x) |" in rows["scimilarity"], rows["scimilarity"]
        assert "80,777 (f32, file, 10,000)" in rows["scimilarity"], rows["scimilarity"]
        assert "633 MiB (1,500 MiB nvidia-smi)" in rows["scimilarity"]
        assert "| 6.12x |" in rows["scvi"] and "| 5,600,000 (f32, batch 16,384) |" in rows["scvi"] and "| 1.00x (below 1.3x) |" in rows["scvi"], rows["scvi"]
        assert "7,945 (bf16)" in rows["scgpt"] and "| 10.8x |" in rows["scgpt"] and "not measured" in rows["scgpt"], rows["scgpt"]
        assert "- bert: NVIDIA Stub 80GB (81559 MiB, driver 580.1, " in text, text
        assert "scfoundry 0.9.0, commit: abc1234, gpu: CUDA 12.8; machine code sm_80, sm_90, sm_90a; PyTorch 2.11.0+stub" in text, text
        assert "ceiling 790.5 TFLOP/s" in text
        assert "Not in these runs: uce, sccello, langcell, scfoundation, scprint, c2s, cellfm, novae, cellama." in text, text
        assert "geneformer, careful PyTorch at batch 128: " in text and "out of memory" in text
        assert "scbert, end to end: not wired" not in text
        # accuracy not run: what methods/<m>.toml records of the default (bf16 or f32)
        assert recorded_accuracy("geneformer").startswith("0.999981 / 6.1e-03 (methods/geneformer.toml: 2026-12-05, commit "), recorded_accuracy("geneformer")
        assert recorded_accuracy("scvi") == "f32 (exact)" and recorded_accuracy("no-such-method") is None
        # a second run into the same folder replaces the measurements it makes and keeps the others
        p = subprocess.run(["/bin/bash", os.path.join(here, "record_gpu.sh"), "scbert", outs["scbert"]], cwd=repo,
                           env=dict(env, STEPS="throughput", BATCHES="1 3"), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        r2 = [json.loads(l) for l in open(os.path.join(outs["scbert"], "record.jsonl"))][0]
        # (the first run's end-to-end measurement is kept: this run made none)
        assert [s["batch"] for s in r2["torch_careful"]["sweep"]] == [1, 1, 3, 3] and "embed -m scbert" in r2["end_to_end"]["command"]
        print(text)
        print("\nself-test passed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    if argv[:1] == ["--assemble"]:
        for out in argv[1:]:
            recs = assemble(out)
            print(f"{out}/record.jsonl: {len(recs)} methods ({', '.join(r['method'] for r in recs)})")
        return
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    print(table(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
