#!/usr/bin/env python3
"""KMeans reference for scfoundry's Rust KMeans: tests/fixtures/scib/kmeans.json.

scib-metrics' KMeans draws its k-means++ centres from JAX's PRNG, which the Rust code does not
replay, so this writes two things the tests can hold it to:

- exact: scib-metrics' KMeans (`scib_metrics.utils.KMeans`, the class its
  `nmi_ari_cluster_labels_kmeans` uses) run from injected initial centroids (rows
  `round(i * n / k)` of the data, i = 0..k-1) instead of its k-means++ draw, on each committed
  case (easy, hard, mixed, edge) and on the 10k-cell spread set: the labels, NMI and ARI. The
  Rust KMeans run from the same centroids must give the same labels.
- spread: `nmi_ari_cluster_labels_kmeans` as scib-metrics runs it (k-means++, n_init = 1) with
  seeds 0..4 on a 10,000-cell set that both sides generate from one integer stream (splitmix64,
  below; no data committed). The Rust headline value (seed 0) must lie inside that spread.

Usage:  python scripts/scib_kmeans_reference.py [--out tests/fixtures/scib/kmeans.json]
(the venv of ci/reference/scib-metrics.txt, Python >= 3.12 for scib-metrics 0.6.1)
"""

import argparse
import json
import os
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scib_metrics  # noqa: E402
from scib_metrics.utils import KMeans  # noqa: E402
from sklearn.metrics.cluster import adjusted_rand_score, normalized_mutual_info_score  # noqa: E402

MASK = (1 << 64) - 1

# The spread set: n cells, d dims, L labels of unequal sizes (weight 1/(l+1)), centres uniform in
# [-3, 3]^d, noise the sum of three uniforms (mean 0, sd 1); the same in the Rust test.
SPREAD = {"n": 10000, "d": 10, "labels": 12, "seed": 47}


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def uniform(self):
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def spread_set(n, d, n_labels, seed):
    rng = SplitMix64(seed)
    centres = [[6.0 * rng.uniform() - 3.0 for _ in range(d)] for _ in range(n_labels)]
    weights = [1.0 / (lab + 1) for lab in range(n_labels)]
    total = 0.0
    for w in weights:
        total += w
    labels = []
    x = np.zeros((n, d), dtype=np.float64)
    for i in range(n):
        r = rng.uniform() * total
        lab = n_labels - 1
        acc = 0.0
        for li, w in enumerate(weights):
            acc += w
            if r < acc:
                lab = li
                break
        labels.append(lab)
        for j in range(d):
            noise = (rng.uniform() + rng.uniform() + rng.uniform() - 1.5) * 2.0
            x[i, j] = centres[lab][j] + noise
    return x.astype(np.float32), np.asarray(labels, dtype=np.int64)


def init_rows(n, k):
    return [int(round(i * n / k)) for i in range(k)]


def kmeans_from(x, k, rows):
    """scib-metrics' KMeans with its initialisation replaced by the given rows (centred as fit() centres X)."""
    km = KMeans(k)
    xc_mean = x.mean(axis=0)
    init = jnp.asarray((x[rows] - xc_mean).astype(np.float32))
    km._initialize = lambda X, n_clusters, key: init
    km.fit(x.copy())
    return np.asarray(km.labels_).astype(np.int64)


def exact_case(x, labels):
    k = len(np.unique(labels))
    rows = init_rows(x.shape[0], k)
    pred = kmeans_from(x, k, rows)
    return {
        "k": k,
        "init_rows": rows,
        "labels_scib": pred.tolist(),
        "nmi": float(normalized_mutual_info_score(labels, pred, average_method="arithmetic")),
        "ari": float(adjusted_rand_score(labels, pred)),
    }


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "scib", "kmeans.json"))
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    out = {"scib_metrics_version": scib_metrics.__version__, "exact": {}, "spread": dict(SPREAD)}
    for case in ["easy", "hard", "mixed", "edge"]:
        with open(os.path.join(here, "..", "tests", "fixtures", "scib", f"{case}.json")) as f:
            fx = json.load(f)
        x = np.asarray(fx["embedding"], dtype=np.float32).reshape(fx["n"], fx["d"])
        out["exact"][case] = exact_case(x, np.asarray(fx["labels"]))
        print(f"exact {case}: nmi {out['exact'][case]['nmi']:.6f} ari {out['exact'][case]['ari']:.6f}")
    x, labels = spread_set(SPREAD["n"], SPREAD["d"], SPREAD["labels"], SPREAD["seed"])
    out["spread"]["x_checksum"] = float(np.asarray(x, dtype=np.float64).sum())
    out["spread"]["x_first_row"] = [float(v) for v in x[0]]
    out["exact"]["spread"] = exact_case(x, labels)
    print(f"exact spread: nmi {out['exact']['spread']['nmi']:.6f} ari {out['exact']['spread']['ari']:.6f}")
    nmis, aris, secs = [], [], []
    k = len(np.unique(labels))
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        km = KMeans(k, seed=seed)
        km.fit(x.copy())
        pred = np.asarray(km.labels_)
        secs.append(time.perf_counter() - t0)
        nmis.append(float(normalized_mutual_info_score(labels, pred, average_method="arithmetic")))
        aris.append(float(adjusted_rand_score(labels, pred)))
        print(f"spread seed {seed}: nmi {nmis[-1]:.6f} ari {aris[-1]:.6f} ({secs[-1]:.1f}s)")
    # the Benchmarker's own call (no seed argument: seed 0), for the record
    bm = scib_metrics.nmi_ari_cluster_labels_kmeans(x, labels)
    out["spread"]["seeds"] = list(range(args.seeds))
    out["spread"]["nmi"] = nmis
    out["spread"]["ari"] = aris
    out["spread"]["benchmarker_nmi"] = float(bm["nmi"])
    out["spread"]["benchmarker_ari"] = float(bm["ari"])
    out["spread"]["seconds"] = secs
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
