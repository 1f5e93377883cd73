#!/usr/bin/env python3
"""Benchmark `scfoundry embed --method pca` against scanpy 1.11.5 on SYNTHETIC data.

    python bench/pca_vs_scanpy.py --scfoundry target/release/scfoundry \
        --cells 10000,100000 [--workdir /tmp/bench] [--repeats 3] [--genes 3000]
        [--skip-scanpy | --skip-scfoundry] [--json results.json]

For each size it generates (once, cached in --workdir) a synthetic file with
scripts/make_synthetic.py (seed 0, 10 cell types, 3 batches, uncompressed CSR float32), then
runs, each time in a FRESH process:

  (a) scanpy end to end (bench/scanpy_pca_child.py, with this Python):
      read_h5ad -> normalize_total(1e4) -> log1p -> hvg seurat 2000 -> pca 50 arpack -> write_h5ad
  (b) PATH_TO_BINARY embed --method pca --data FILE --out OUT --quiet

Wall time is the child's whole life (start-up and imports included); peak RSS is the child's
own ru_maxrss from os.wait4 on its pid (not this process's). Each measurement is repeated
--repeats times (default 3) and the median is reported, with the first run in brackets. The
file is read once beforehand so the page cache is warm for every run.

BLAS: on some processors this machine sets OPENBLAS_CORETYPE (and OPENBLAS_L2_SIZE) so that
old OpenBLAS builds run correctly; they slow the current numpy/scipy. For the scanpy child
ONLY, both are unset together, and the kernel threadpoolctl then reports is printed. The
scfoundry child gets the environment unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYNTH = ROOT / "scripts" / "make_synthetic.py"
CHILD = ROOT / "bench" / "scanpy_pca_child.py"
BLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def run_measured(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run cmd as a child; return wall seconds, the child's own peak RSS (MB), rc and output."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Read the pipes in threads so a chatty child cannot block; reap with wait4 for its rusage.
    import threading

    buf = {"out": "", "err": ""}

    def pump(stream, key):
        buf[key] = stream.read()

    th = [threading.Thread(target=pump, args=(p.stdout, "out")), threading.Thread(target=pump, args=(p.stderr, "err"))]
    for x in th:
        x.start()
    deadline = None if timeout is None else t0 + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            break
        if deadline is not None and time.perf_counter() > deadline:
            p.kill()
            pid, status, ru = os.wait4(p.pid, 0)
            break
        time.sleep(0.005)
    wall = time.perf_counter() - t0
    for x in th:
        x.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_mb": ru.ru_maxrss / 1024.0,
            "rc": p.returncode, "stdout": buf["out"], "stderr": buf["err"]}


def machine() -> dict:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "mem": mem, "python": platform.python_version(),
            "blas_env": {k: os.environ.get(k) for k in BLAS_VARS}}


def ensure_data(workdir: Path, cells: int, genes: int, python: str) -> Path:
    f = workdir / f"synthetic_{cells}x{genes}_seed0.h5ad"
    if not f.exists():
        print(f"generating {f} (SYNTHETIC) ...", flush=True)
        subprocess.run([python, str(SYNTH), "--cells", str(cells), "--genes", str(genes),
                        "--out", str(f), "--seed", "0", "--types", "10", "--batches", "3"], check=True)
    # warm the page cache
    with open(f, "rb") as fh:
        while fh.read(1 << 24):
            pass
    return f


def check_binary(path: str | None) -> str:
    if not path:
        sys.exit("error: --scfoundry PATH is required (or pass --skip-scfoundry)")
    resolved = shutil.which(path) if os.sep not in path else path
    if not resolved or not Path(resolved).is_file():
        sys.exit(f"error: scfoundry binary not found: {path!r}. Build it first "
                 "(cargo build --release) and pass --scfoundry target/release/scfoundry, "
                 "or use --skip-scfoundry to time scanpy alone.")
    if not os.access(resolved, os.X_OK):
        sys.exit(f"error: scfoundry binary is not executable: {resolved}")
    return str(Path(resolved).resolve())


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["rc"] == 0]
    if not ok:
        return {"ok": False, "rc": runs[-1]["rc"], "stderr_tail": runs[-1]["stderr"][-2000:]}
    return {"ok": len(ok) == len(runs), "wall_s": statistics.median(r["wall_s"] for r in ok),
            "first_s": ok[0]["wall_s"], "peak_mb": statistics.median(r["peak_mb"] for r in ok),
            "all_s": [r["wall_s"] for r in ok], "all_peak_mb": [r["peak_mb"] for r in ok],
            "cpu_s": statistics.median(r["cpu_s"] for r in ok)}


def fmt_s(s: dict) -> str:
    return f"{s['wall_s']:.2f} ({s['first_s']:.2f})" if s.get("wall_s") is not None else "failed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scfoundry", help="path to the scfoundry binary")
    ap.add_argument("--cells", default="10000,100000", help="comma-separated cell counts")
    ap.add_argument("--genes", type=int, default=3000)
    ap.add_argument("--workdir", default="/tmp/bench")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--python", default=sys.executable, help="Python with scanpy (default: this one)")
    ap.add_argument("--skip-scanpy", action="store_true")
    ap.add_argument("--skip-scfoundry", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per child run")
    ap.add_argument("--json", help="also write all measurements here")
    args = ap.parse_args()

    binary = None if args.skip_scfoundry else check_binary(args.scfoundry)
    sizes = [int(x.replace("_", "")) for x in args.cells.split(",") if x.strip()]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    scanpy_env = dict(os.environ)
    unset = [k for k in BLAS_VARS if k in scanpy_env]
    for k in BLAS_VARS:                       # both together, for the scanpy child only
        scanpy_env.pop(k, None)

    mach = machine()
    results = {"machine": mach, "sizes": {}}
    kernel_note = None
    for n in sizes:
        f = ensure_data(workdir, n, args.genes, args.python)
        res = {"file": str(f), "file_mb": f.stat().st_size / 1e6}
        if not args.skip_scanpy:
            runs = []
            for i in range(args.repeats):
                out = workdir / f"scanpy_out_{n}.h5ad"
                r = run_measured([args.python, str(CHILD), str(f), str(out)], env=scanpy_env, timeout=args.timeout)
                if r["rc"] == 0:
                    info = json.loads(r["stdout"].strip().splitlines()[-1])
                    r["child"] = info
                    if kernel_note is None:
                        blas = [p for p in info["threadpools"] if p.get("internal_api") == "openblas"]
                        kernel_note = ", ".join(f"{p['prefix']} {p['version']} kernel={p['architecture']} "
                                                f"threads={p['num_threads']}" for p in blas) or "no OpenBLAS seen"
                else:
                    print(f"scanpy run failed (rc {r['rc']}):\n{r['stderr'][-2000:]}", file=sys.stderr)
                runs.append(r)
                print(f"  {n} cells scanpy run {i + 1}: {r['wall_s']:.2f}s, {r['peak_mb']:.0f} MB", flush=True)
            res["scanpy"] = summarize(runs)
            if runs[0].get("child"):
                steps = [r["child"]["seconds"] for r in runs if r.get("child")]
                res["scanpy"]["steps_median_s"] = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
                res["scanpy"]["n_hvg"] = runs[0]["child"]["n_hvg"]
                res["scanpy"]["variance_ratio_head"] = runs[0]["child"]["variance_ratio_head"]
        if binary:
            runs = []
            for i in range(args.repeats):
                out = workdir / f"scfoundry_out_{n}.h5ad"
                r = run_measured([binary, "embed", "--method", "pca", "--data", str(f), "--out", str(out), "--quiet"],
                                 timeout=args.timeout)
                if r["rc"] != 0:
                    print(f"scfoundry run failed (rc {r['rc']}):\n{r['stderr'][-2000:]}", file=sys.stderr)
                runs.append(r)
                print(f"  {n} cells scfoundry run {i + 1}: {r['wall_s']:.2f}s, {r['peak_mb']:.0f} MB", flush=True)
            res["scfoundry"] = summarize(runs)
        results["sizes"][n] = res

    # ---- report
    print()
    print(f"Machine: {mach['nproc']} CPUs ({mach['cpu']}), {mach['mem']} RAM, Python {mach['python']}")
    if unset:
        print(f"OpenBLAS: {', '.join(f'{k}={os.environ[k]}' for k in unset)} set here; unset for the scanpy child only.")
    else:
        print("OpenBLAS: OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE not set here; scanpy child ran with the environment as is.")
    if kernel_note:
        print(f"scanpy child's BLAS (threadpoolctl): {kernel_note}")
    print("Data: SYNTHETIC negative-binomial counts (scripts/make_synthetic.py, seed 0, "
          f"{args.genes} genes, 10 types, 3 batches), uncompressed CSR float32.")
    print(f"Wall seconds for the whole fresh process: median of {args.repeats} (first run in brackets); "
          "peak RSS = the child's own ru_maxrss.")
    print()
    print("| cells | file MB | scanpy s | scfoundry s | speed-up (scanpy/scfoundry) | scanpy peak MB | scfoundry peak MB | memory ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, res in results["sizes"].items():
        a, b = res.get("scanpy", {}), res.get("scfoundry", {})
        sa = fmt_s(a) if a else "-"
        sb = fmt_s(b) if b else "-"
        ratio = f"{a['wall_s'] / b['wall_s']:.1f}x" if a.get("wall_s") and b.get("wall_s") else "-"
        pa = f"{a['peak_mb']:.0f}" if a.get("peak_mb") else "-"
        pb = f"{b['peak_mb']:.0f}" if b.get("peak_mb") else "-"
        mr = f"{a['peak_mb'] / b['peak_mb']:.1f}x" if a.get("peak_mb") and b.get("peak_mb") else "-"
        print(f"| {n:,} | {res['file_mb']:.0f} | {sa} | {sb} | {ratio} | {pa} | {pb} | {mr} |")
    if any("steps_median_s" in r.get("scanpy", {}) for r in results["sizes"].values()):
        print()
        print("scanpy in-process steps (median seconds):")
        print()
        print("| cells | import | read | normalize+log1p+hvg | pca | write |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n, res in results["sizes"].items():
            st = res.get("scanpy", {}).get("steps_median_s")
            if st:
                print(f"| {n:,} | {st['import']:.2f} | {st['read']:.2f} | {st['normalize_log1p_hvg']:.2f} | "
                      f"{st['pca']:.2f} | {st['write']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    failed = [n for n, r in results["sizes"].items() for k in ("scanpy", "scfoundry") if k in r and not r[k].get("ok")]
    if failed:
        sys.exit(f"some runs failed: {failed}")


if __name__ == "__main__":
    main()
