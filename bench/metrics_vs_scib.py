#!/usr/bin/env python3
"""Benchmark `scfoundry benchmark` against scib-metrics 0.6.1's Benchmarker on SYNTHETIC data.

    python bench/metrics_vs_scib.py --scfoundry target/release/scfoundry \
        --scib-python $VENV/bin/python \
        --cells 10000,100000 [--workdir /tmp/bench] [--repeats 1] [--json out.json]

For each size it generates (once, cached in --workdir) a synthetic counts file with
scripts/make_synthetic.py (seed 0, 10 cell types, 3 batches; labels `cell_type`, batches
`batch`), embeds it once with `scfoundry embed --method pca` (obsm['X_pca']), then runs, each
in a FRESH process and on the same file:

  (a) scib-metrics' Benchmarker with its default metrics (bench/scib_benchmarker_child.py):
      prepare (sc.tl.pca of X for PCR, the exact 90-NN) + benchmark, then its KMeans over
      seeds 0..4 (their time is in the wall time; the child reports it apart);
  (b) scfoundry benchmark --embedding X_pca --label-key cell_type --batch-key batch --quiet
      (same metric set: exact 90-NN, the same PCA of X for PCR, KMeans over seeds 0..4
      beside the one-run value: --kmeans-seeds 5, the default).

Wall time is the child's whole life (imports and JAX compilation included for (a)); CPU time
is the child's user + system seconds and peak RSS its own ru_maxrss (both from os.wait4). The
load average is sampled every 30 s while each child runs and reported (min/median/max): on a
shared machine the wall ratio depends on the load, the CPU-time ratio much less. The measuring helpers are those of
bench/pca_vs_scanpy.py. Values are printed side by side with |diff| (KMeans differs by design: a
different random stream; both tools' 5-seed spreads are printed beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pca_vs_scanpy import check_binary, ensure_data, machine, run_measured, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "bench" / "scib_benchmarker_child.py"
CLEAN = {"isolated_labels": "Isolated labels", "nmi_ari_cluster_labels_kmeans_nmi": "KMeans NMI",
         "nmi_ari_cluster_labels_kmeans_ari": "KMeans ARI", "silhouette_label": "Silhouette label",
         "clisi_knn": "cLISI", "bras": "BRAS", "ilisi_knn": "iLISI", "kbet_per_label": "KBET",
         "graph_connectivity": "Graph connectivity", "pcr_comparison": "PCR comparison"}


class LoadSampler:
    """Samples /proc/loadavg every `every` seconds in a thread while a child runs."""

    def __init__(self, every: float = 30.0):
        import threading
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._every = every
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(float(Path("/proc/loadavg").read_text().split()[0]))
            if self._stop.wait(self._every):
                return

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        import statistics
        v = self.samples or [float("nan")]
        return {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(self.samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scfoundry", required=True)
    ap.add_argument("--scib-python", required=True, help="Python of a venv from ci/reference/scib-metrics.txt")
    ap.add_argument("--python", default=sys.executable, help="Python with h5py/numpy for make_synthetic.py")
    ap.add_argument("--cells", default="10000,100000")
    ap.add_argument("--genes", type=int, default=3000)
    ap.add_argument("--workdir", default="/tmp/bench")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=7200.0)
    ap.add_argument("--skip-scib", action="store_true")
    ap.add_argument("--reuse-scib", action="store_true", help="reuse scib-metrics' result of an earlier run in --workdir (scib_N.json)")
    ap.add_argument("--json")
    a = ap.parse_args()
    exe = check_binary(a.scfoundry)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print("machine:", json.dumps(machine()), flush=True)
    env_scib = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env_scib["JAX_PLATFORMS"] = "cpu"
    out = {"machine": machine(), "sizes": {}}
    for n in [int(x) for x in a.cells.split(",")]:
        raw = ensure_data(work, n, a.genes, a.python)
        emb = raw.with_name(raw.stem + ".pca.h5ad")
        if not emb.exists():
            subprocess.run([exe, "embed", "--method", "pca", "--data", str(raw), "--out", str(emb), "--quiet",
                            "--runs-dir", str(work / "runs")], check=True)
        rec = {}
        cached = work / f"scib_{n}.json"
        if a.reuse_scib and cached.exists():
            rec["scib"] = json.loads(cached.read_text())
            print(f"scib-metrics result for {n} cells reused from {cached}", flush=True)
        elif not a.skip_scib:
            with LoadSampler() as load:
                runs = [run_measured([a.scib_python, str(CHILD), str(emb), "X_pca", "cell_type", "batch"],
                                     env=env_scib, timeout=a.timeout) for _ in range(a.repeats)]
            rec["scib"] = summarize(runs)
            rec["scib"]["load"] = load.summary()
            if runs[-1]["rc"] == 0:
                rec["scib"]["child"] = json.loads(runs[-1]["stdout"].strip().splitlines()[-1])
                cached.write_text(json.dumps(rec["scib"], default=str))
        with tempfile.TemporaryDirectory() as td:
            cmd = [exe, "benchmark", "--data", str(emb), "--embedding", "X_pca", "--label-key", "cell_type",
                   "--batch-key", "batch", "--out", td, "--quiet"]
            with LoadSampler() as load:
                runs = [run_measured(cmd, timeout=a.timeout) for _ in range(a.repeats)]
            rec["scfoundry"] = summarize(runs)
            rec["scfoundry"]["load"] = load.summary()
            if runs[-1]["rc"] == 0:
                rec["scfoundry"]["results"] = json.loads(Path(td, "results.json").read_text())
        out["sizes"][n] = rec
        print(f"\n== {n} cells x {a.genes} genes (SYNTHETIC), one embedding (X_pca, 50 dims), default metric set ==")
        print(f"{'tool':<34} {'wall s':>10} {'CPU s':>10} {'peak MB':>10}  load avg (min/median/max)")
        for tool, label in (("scib", "scib-metrics 0.6.1 Benchmarker"), ("scfoundry", "scfoundry benchmark")):
            s = rec.get(tool)
            if s and s.get("wall_s") is not None:
                ld = s["load"]
                print(f"{label:<34} {s['wall_s']:>10.1f} {s['cpu_s']:>10.1f} {s['peak_mb']:>10.0f}  "
                      f"{ld['min']:.1f}/{ld['median']:.1f}/{ld['max']:.1f}")
            elif s:
                print(f"{label:<34} failed (rc {s.get('rc')}): {s.get('stderr_tail', '')[-400:]}")
        if rec.get("scib", {}).get("wall_s") and rec["scfoundry"].get("wall_s"):
            print(f"ratio (scib / scfoundry): wall time {rec['scib']['wall_s'] / rec['scfoundry']['wall_s']:.1f}x, "
                  f"CPU time {rec['scib']['cpu_s'] / rec['scfoundry']['cpu_s']:.1f}x, "
                  f"peak memory {rec['scib']['peak_mb'] / rec['scfoundry']['peak_mb']:.1f}x")
            print("scib steps (s):", {k: round(v, 1) for k, v in rec["scib"]["child"]["seconds"].items()})
            ours = rec["scfoundry"]["results"]["results"][0]
            print("scfoundry steps (s):", {k: round(v, 1) for k, v in ours["seconds"].items()})
            if "step_seconds" in ours:
                print("scfoundry per step (s):", {s["step"]: round(s["seconds"], 1) for s in ours["step_seconds"]})
            theirs = rec["scib"]["child"]["results"]["X_pca"]
            f = lambda v: "NaN" if v is None else f"{v:.4f}"
            print(f"| {'metric':<22} | {'scib-metrics 0.6.1':>18} | {'scfoundry':>10} | {'abs diff':>9} |")
            print(f"|{'-' * 24}|{'-' * 19}:|{'-' * 11}:|{'-' * 10}:|")
            for key, name in list(CLEAN.items()) + [("Batch correction", "Batch correction"), ("Bio conservation", "Bio conservation"), ("Total", "Total")]:
                tv = theirs.get(key)
                ov = (ours["metrics"].get(key) or ours["aggregates"].get(key) or {}).get("value")
                dv = "" if tv is None or ov is None else f"{abs(tv - ov):.1e}"
                print(f"| {name:<22} | {f(tv):>18} | {f(ov):>10} | {dv:>9} |")
            sp_t = rec["scib"]["child"].get("kmeans_spread", {}).get("X_pca")
            sp_o = ours.get("kmeans_seed_spread")
            for which in ("nmi", "ari"):
                if sp_t:
                    v = sp_t[which]
                    print(f"KMeans {which.upper()} scib-metrics seeds {sp_t['seeds']}: " + " / ".join(f"{x:.4f}" for x in v) + f" (min {min(v):.4f}, max {max(v):.4f})")
                if sp_o:
                    v = sp_o[which]
                    print(f"KMeans {which.upper()} scfoundry    seeds {sp_o['seeds']}: " + " / ".join(f"{x:.4f}" for x in v) + f" (min {min(v):.4f}, max {max(v):.4f})")
            if sp_o:
                km = [x for x in ours["step_seconds"] if "seed spread" in x["step"]]
                if km:
                    print(f"scfoundry --kmeans-seeds 5 cost: {km[0]['seconds']:.1f} s of {rec['scfoundry']['wall_s']:.1f} s wall "
                          f"({100 * km[0]['seconds'] / rec['scfoundry']['wall_s']:.0f}%)")
        sys.stdout.flush()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
