#!/usr/bin/env python3
"""Produce scib-metrics reference fixtures for scfoundry's Rust metrics.

The oracle is scib-metrics itself (see ci/reference/scib-metrics.txt for the pinned
versions: scib-metrics 0.6.1, Python >= 3.12). For each synthetic case this writes
tests/fixtures/scib/<case>.json with the inputs (embedding, labels, batches, unintegrated
X_pre, the exact 90-NN lists, self first, that both scib-metrics' metrics and its
Benchmarker are given here, so neighbour search plays no part in the comparison) and every
metric value, plus
timings of each scib-metrics call (cold = first call incl. JAX compile, warm =
second call). The case `kbet_lanczos` holds kBET per label only: labels of 900 and 600
cells (the Lanczos eigen path, k0 = 70 and 50), scored on exact 50-NN lists and on the
same lists with a round-off self distance (see SELF_ROUNDOFF).

Usage:  python scripts/scib_reference.py [--out tests/fixtures/scib]
"""

import argparse
import json
import os
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import scib_metrics  # noqa: E402
from scib_metrics.nearest_neighbors import NeighborsResults, pynndescent  # noqa: E402
from sklearn.metrics.cluster import adjusted_rand_score, normalized_mutual_info_score  # noqa: E402


def f32list(a):
    """float32 values written with 9 significant digits: round-trips exactly."""
    a = np.asarray(a, dtype=np.float32).ravel()
    return [float(f"{v:.9g}") for v in a]


def make_case(name):
    if name == "easy":
        rng = np.random.default_rng(0)
        n, d, d_pre, n_lab, n_bat = 600, 20, 24, 5, 3
        labels = rng.integers(0, n_lab, n)
        batches = rng.integers(0, n_bat, n)
        centers = rng.normal(0, 3.0, (n_lab, d_pre))
        shifts = rng.normal(0, 2.0, (n_bat, d_pre))
        x_pre = centers[labels] + shifts[batches] + rng.normal(0, 1.0, (n, d_pre))
        proj = np.linalg.qr(rng.normal(size=(d_pre, d)))[0]
        emb = (centers[labels] + 0.3 * shifts[batches] + rng.normal(0, 1.0, (n, d_pre))) @ proj
    elif name == "hard":
        rng = np.random.default_rng(1)
        n, d, d_pre, n_bat = 500, 16, 20, 4
        # 7 labels, unbalanced; label 5 is tiny (<10 cells: kBET skips it), label 6
        # lives in batch 0 only (isolated label; skipped by batch silhouette / kBET),
        # label 2 is split into two far-apart sub-clusters (graph connectivity < 1).
        props = np.array([0.28, 0.22, 0.18, 0.14, 0.10, 0.016, 0.064])
        labels = rng.choice(7, size=n, p=props / props.sum())
        labels[:7] = 5
        labels[labels == 5] = 1
        labels[:7] = 5
        batches = rng.choice(n_bat, size=n, p=[0.4, 0.3, 0.2, 0.1])
        batches[labels == 6] = 0
        centers = rng.normal(0, 2.0, (7, d_pre))
        shifts = rng.normal(0, 2.5, (n_bat, d_pre))
        sub = (rng.random(n) < 0.5) & (labels == 2)
        far = rng.normal(0, 6.0, d_pre)
        x_pre = centers[labels] + shifts[batches] + rng.normal(0, 1.0, (n, d_pre)) + np.outer(sub, far)
        proj = np.linalg.qr(rng.normal(size=(d_pre, d)))[0]
        emb = (centers[labels] + 0.6 * shifts[batches] + rng.normal(0, 1.2, (n, d_pre)) + np.outer(sub, far)) @ proj
    elif name == "mixed":
        # well-mixed batches (no batch effect left in the embedding): kBET / iLISI
        # are far from 0 here, and the labels overlap a little (KMeans/Leiden not perfect)
        rng = np.random.default_rng(2)
        n, d, d_pre, n_lab, n_bat = 450, 10, 12, 4, 3
        labels = rng.choice(n_lab, size=n, p=[0.4, 0.3, 0.2, 0.1])
        batches = rng.choice(n_bat, size=n, p=[0.5, 0.3, 0.2])
        centers = rng.normal(0, 1.6, (n_lab, d_pre))
        shifts = rng.normal(0, 1.5, (n_bat, d_pre))
        x_pre = centers[labels] + shifts[batches] + rng.normal(0, 1.0, (n, d_pre))
        proj = np.linalg.qr(rng.normal(size=(d_pre, d)))[0]
        emb = (centers[labels] + 0.05 * shifts[batches] + rng.normal(0, 1.0, (n, d_pre))) @ proj
    elif name == "edge":
        # kBET corner cases: a label split in two far components (both kept), a
        # label of exactly 10 cells (k0 + 1 > n: pynndescent pads with -1), a label
        # with a small far-away component (dropped, >= 75% kept), and a label whose
        # components are all < 3*k0 (score 0).
        rng = np.random.default_rng(3)
        d, d_pre = 8, 10
        sizes = [150, 10, 100, 40]
        labels = np.repeat(np.arange(4), sizes)
        n = labels.size
        batches = rng.integers(0, 2, n)
        centers = rng.normal(0, 8.0, (4, d_pre))
        offs = np.zeros((n, d_pre))
        i0 = np.flatnonzero(labels == 0)
        offs[i0[75:]] += rng.normal(0, 15.0, d_pre)
        i2 = np.flatnonzero(labels == 2)
        offs[i2[85:]] += rng.normal(0, 15.0, d_pre)
        i3 = np.flatnonzero(labels == 3)
        offs[i3[25:]] += rng.normal(0, 15.0, d_pre)
        shifts = rng.normal(0, 0.3, (2, d_pre))
        x_pre = centers[labels] + offs + 5 * shifts[batches] + rng.normal(0, 1.0, (n, d_pre))
        proj = np.linalg.qr(rng.normal(size=(d_pre, d)))[0]
        emb = (centers[labels] + offs + shifts[batches] + rng.normal(0, 1.0, (n, d_pre))) @ proj
    else:
        raise ValueError(name)
    return (
        emb.astype(np.float32),
        x_pre.astype(np.float32),
        labels.astype(np.int64),
        batches.astype(np.int64),
    )


def exact_knn(x, k):
    """Exact Euclidean k-NN (self first), as scib-metrics' NeighborsResults."""
    x = np.asarray(x, dtype=np.float32)
    sq = (x.astype(np.float64) ** 2).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (x.astype(np.float64) @ x.astype(np.float64).T), 0.0)
    np.fill_diagonal(d2, -1.0)
    idx = np.argsort(d2, axis=1, kind="stable")[:, :k]
    np.fill_diagonal(d2, 0.0)
    dist = np.sqrt(np.take_along_axis(d2, idx, axis=1))
    return NeighborsResults(indices=idx.astype(np.int64), distances=dist.astype(np.float32))


# Self-distance that a GEMM-based brute-force search (|x|^2 + |y|^2 - 2 x.y) leaves on a
# cell's own row instead of 0; scikit-learn's brute kneighbors gave 3e-7 to 7.5e-7 on 68% of
# the rows of a 10,000-cell PCA embedding. umap's smooth_knn_dist takes rho as the first
# distance > 0, so such a row's rho becomes that round-off instead of the distance to the
# nearest other cell, and the UMAP connectivities (and kBET) change.
SELF_ROUNDOFF = 2.0**-21


def run_kbet_lanczos_case():
    """kBET per label where every label's subgraph takes the Lanczos path (> 400 cells) and
    k0 is large (70 and 50). The 50-NN indices are stored, not their distances (the test
    recomputes them from the embedding) to keep the file small. Scored twice: with the
    exact lists (self at distance 0, as pynndescent gives) and with the self distance of
    two rows in three set to SELF_ROUNDOFF."""
    rng = np.random.default_rng(11)
    sizes, n_bat, d = [900, 600], 3, 10
    labels = np.repeat(np.arange(len(sizes)), sizes)
    n = len(labels)
    batches = rng.integers(0, n_bat, n)
    centers = rng.normal(0, 4.0, (len(sizes), d)) + 12.0
    shifts = rng.normal(0, 0.3, (n_bat, d))
    emb = (centers[labels] + shifts[batches] + rng.normal(0, 1.0, (n, d))).astype(np.float32)
    perm = rng.permutation(n)
    emb, labels, batches = emb[perm], labels[perm].astype(np.int64), batches[perm].astype(np.int64)
    nn50 = exact_knn(emb, 50)
    rows = np.arange(n) % 3 != 2
    d_round = nn50.distances.copy()
    d_round[rows, 0] = SELF_ROUNDOFF
    nn50_round = NeighborsResults(indices=nn50.indices, distances=d_round)
    m = {}
    for tag, nn in (("", nn50), ("_self_roundoff", nn50_round)):
        kb, df = scib_metrics.kbet_per_label(nn, batches, labels, return_df=True)
        m["kbet_per_label" + tag] = float(kb)
        m["kbet_per_label_scores" + tag] = [None if np.isnan(v) else float(v) for v in df["kBET"]]
    m["k0"] = [int(min(70, max(10, np.floor(np.mean(pd.Series(batches[labels == c]).value_counts()) / 4))))
               for c in np.unique(labels)]
    return {
        "case": "kbet_lanczos",
        "scib_metrics_version": scib_metrics.__version__,
        "n": n,
        "d": d,
        "embedding": f32list(emb),
        "labels": labels.tolist(),
        "batches": batches.tolist(),
        "knn_k": 50,
        "knn_indices": nn50.indices.astype(np.int64).ravel().tolist(),
        "self_roundoff": SELF_ROUNDOFF,
        "self_roundoff_rows": "i % 3 != 2",
        "metrics": m,
    }


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    warm = time.perf_counter() - t0
    return out, {"cold_s": cold, "warm_s": warm}


def run_case(name):
    emb, x_pre, labels, batches = make_case(name)
    n = emb.shape[0]
    out = {
        "case": name,
        "scib_metrics_version": scib_metrics.__version__,
        "n": n,
        "d": emb.shape[1],
        "d_pre": x_pre.shape[1],
        "embedding": f32list(emb),
        "x_pre": f32list(x_pre),
        "labels": labels.tolist(),
        "batches": batches.tolist(),
    }
    timings = {}

    # Benchmarker.prepare computes one 90-NN and takes subsets 15/50/90; here it is exact.
    t0 = time.perf_counter()
    nn90 = exact_knn(emb, 90)
    timings["exact_knn_90"] = time.perf_counter() - t0
    nn15, nn50 = nn90.subset_neighbors(15), nn90.subset_neighbors(50)
    out["knn_k"] = 90
    out["knn_indices"] = nn90.indices.astype(np.int64).ravel().tolist()
    out["knn_distances"] = f32list(nn90.distances)

    m = {}
    m["silhouette_label"], timings["silhouette_label"] = timed(scib_metrics.silhouette_label, emb, labels)
    m["silhouette_label_raw"] = float(scib_metrics.silhouette_label(emb, labels, rescale=False))
    m["silhouette_batch"], timings["silhouette_batch"] = timed(scib_metrics.silhouette_batch, emb, labels, batches)
    m["silhouette_batch_furthest"] = float(
        scib_metrics.silhouette_batch(emb, labels, batches, between_cluster_distances="furthest")
    )
    m["silhouette_batch_cosine_mean_other"] = float(
        scib_metrics.silhouette_batch(emb, labels, batches, metric="cosine", between_cluster_distances="mean_other")
    )
    m["bras"], timings["bras"] = timed(scib_metrics.bras, emb, labels, batches)
    m["bras_euclidean"] = float(scib_metrics.bras(emb, labels, batches, metric="euclidean"))
    m["bras_furthest"] = float(scib_metrics.bras(emb, labels, batches, between_cluster_distances="furthest"))
    m["isolated_labels"], timings["isolated_labels"] = timed(scib_metrics.isolated_labels, emb, labels, batches)
    m["ilisi_knn"], timings["ilisi_knn"] = timed(scib_metrics.ilisi_knn, nn90, batches)
    m["clisi_knn"], timings["clisi_knn"] = timed(scib_metrics.clisi_knn, nn90, labels)
    m["ilisi_knn_k15"] = float(scib_metrics.ilisi_knn(nn15, batches))
    m["ilisi_knn_unscaled"] = float(scib_metrics.ilisi_knn(nn90, batches, scale=False))
    m["lisi_batches_per_cell"] = f32list(scib_metrics.lisi_knn(nn90, batches))
    m["graph_connectivity"], timings["graph_connectivity"] = timed(scib_metrics.graph_connectivity, nn15, labels)
    m["graph_connectivity_k50"] = float(scib_metrics.graph_connectivity(nn50, labels))
    m["pcr_comparison"], timings["pcr_comparison"] = timed(
        scib_metrics.pcr_comparison, x_pre, emb, batches, categorical=True
    )
    m["pcr_comparison_unscaled"] = float(
        scib_metrics.pcr_comparison(x_pre, emb, batches, scale=False, categorical=True)
    )
    m["pcr_pre"] = float(scib_metrics.utils.principal_component_regression(x_pre, batches, categorical=True))
    m["pcr_post"] = float(scib_metrics.utils.principal_component_regression(emb, batches, categorical=True))
    m["pcr_post_5comps"] = float(
        scib_metrics.utils.principal_component_regression(emb, batches, categorical=True, n_components=5)
    )
    (kb, kb_df), timings["kbet_per_label"] = timed(scib_metrics.kbet_per_label, nn50, batches, labels, return_df=True)
    m["kbet_per_label"] = float(kb)
    m["kbet_per_label_clusters"] = [int(c) for c in kb_df["cluster"]]
    m["kbet_per_label_scores"] = [None if np.isnan(v) else float(v) for v in kb_df["kBET"]]
    acc, _, _ = scib_metrics.kbet(nn50, batches)
    m["kbet_global_k50"] = float(acc)
    m["sbee"], timings["sbee"] = timed(scib_metrics.sbee, nn90, emb, batches, labels)

    # KMeans: JAX PRNG, cannot be replicated bit-for-bit; store scib's clustering too
    km, timings["nmi_ari_cluster_labels_kmeans"] = timed(scib_metrics.nmi_ari_cluster_labels_kmeans, emb, labels)
    m["kmeans_nmi"], m["kmeans_ari"] = float(km["nmi"]), float(km["ari"])
    from scib_metrics.metrics._nmi_ari import _compute_clustering_kmeans

    km_labels = _compute_clustering_kmeans(emb, len(np.unique(labels)))
    out["kmeans_labels_scib"] = np.asarray(km_labels).astype(int).tolist()
    # deterministic check of the NMI/ARI helpers on a fixed pair of labelings
    m["nmi_labels_vs_kmeans"] = float(normalized_mutual_info_score(labels, km_labels, average_method="arithmetic"))
    m["ari_labels_vs_kmeans"] = float(adjusted_rand_score(labels, km_labels))
    m["nmi_labels_vs_batches"] = float(normalized_mutual_info_score(labels, batches, average_method="arithmetic"))
    m["ari_labels_vs_batches"] = float(adjusted_rand_score(labels, batches))

    t0 = time.perf_counter()
    ld = scib_metrics.nmi_ari_cluster_labels_leiden(nn15, labels, optimize_resolution=True, seed=42)
    timings["nmi_ari_cluster_labels_leiden"] = time.perf_counter() - t0
    m["leiden_nmi"], m["leiden_ari"] = float(ld["nmi"]), float(ld["ari"])

    out["metrics"] = {k: (float(v) if isinstance(v, (float, np.floating, int, np.integer)) else v) for k, v in m.items()}
    out["timings_s"] = timings
    out["benchmarker"] = run_benchmarker(emb, x_pre, labels, batches)
    return out


def run_benchmarker(emb, x_pre, labels, batches):
    """Full Benchmarker run on three embeddings, to test the aggregation."""
    import anndata as ad
    from scib_metrics.benchmark import Benchmarker

    rng = np.random.default_rng(5)
    adata = ad.AnnData(np.zeros((emb.shape[0], 1), dtype=np.float32))
    adata.obs["batch"] = pd.Categorical(batches.astype(str))
    adata.obs["cell_type"] = pd.Categorical(labels.astype(str))
    adata.obsm["emb"] = emb
    adata.obsm["pre"] = x_pre
    adata.obsm["noisy"] = (emb + rng.normal(0, 2.0, emb.shape)).astype(np.float32)
    t0 = time.perf_counter()
    bm = Benchmarker(
        adata,
        batch_key="batch",
        label_key="cell_type",
        embedding_obsm_keys=["emb", "pre", "noisy"],
        pre_integrated_embedding_obsm_key="pre",
        progress_bar=False,
    )
    bm.prepare(neighbor_computer=exact_knn)
    bm.benchmark()
    elapsed = time.perf_counter() - t0
    res = {"elapsed_s": elapsed}
    for scaled in (False, True):
        df = bm.get_results(min_max_scale=scaled, clean_names=False)
        types = df.loc["Metric Type"]
        body = df.drop("Metric Type").astype(float)
        res["scaled" if scaled else "raw"] = {
            "metric_types": {c: str(types[c]) for c in df.columns},
            "rows": {emb_key: {c: float(body.loc[emb_key, c]) for c in df.columns} for emb_key in body.index},
        }
    return res


def make_large(n, seed=7):
    """Larger synthetic set for timing only (not a committed fixture)."""
    rng = np.random.default_rng(seed)
    d, d_pre, n_lab, n_bat = 30, 40, 12, 4
    labels = rng.choice(n_lab, size=n, p=np.linspace(1, 3, n_lab) / np.linspace(1, 3, n_lab).sum())
    batches = rng.integers(0, n_bat, n)
    centers = rng.normal(0, 2.0, (n_lab, d_pre))
    shifts = rng.normal(0, 1.5, (n_bat, d_pre))
    x_pre = centers[labels] + shifts[batches] + rng.normal(0, 1.0, (n, d_pre))
    proj = np.linalg.qr(rng.normal(size=(d_pre, d)))[0]
    emb = (centers[labels] + 0.2 * shifts[batches] + rng.normal(0, 1.0, (n, d_pre))) @ proj
    return emb.astype(np.float32), x_pre.astype(np.float32), labels.astype(np.int64), batches.astype(np.int64)


def run_timing(n, out_dir):
    """Time every scib-metrics call on an n-cell set; dump raw inputs for the Rust side."""
    os.makedirs(out_dir, exist_ok=True)
    emb, x_pre, labels, batches = make_large(n)
    t = {}
    m = {}
    t0 = time.perf_counter()
    nn90 = pynndescent(emb, n_neighbors=90, random_state=0, n_jobs=1)
    t["pynndescent_90"] = time.perf_counter() - t0
    nn15, nn50 = nn90.subset_neighbors(15), nn90.subset_neighbors(50)
    calls = {
        "silhouette_label": lambda: scib_metrics.silhouette_label(emb, labels),
        "silhouette_batch": lambda: scib_metrics.silhouette_batch(emb, labels, batches),
        "bras": lambda: scib_metrics.bras(emb, labels, batches),
        "isolated_labels": lambda: scib_metrics.isolated_labels(emb, labels, batches),
        "ilisi_knn": lambda: scib_metrics.ilisi_knn(nn90, batches),
        "clisi_knn": lambda: scib_metrics.clisi_knn(nn90, labels),
        "graph_connectivity": lambda: scib_metrics.graph_connectivity(nn15, labels),
        "pcr_comparison": lambda: scib_metrics.pcr_comparison(x_pre, emb, batches, categorical=True),
        "kbet_per_label": lambda: scib_metrics.kbet_per_label(nn50, batches, labels),
        "nmi_ari_cluster_labels_kmeans": lambda: scib_metrics.nmi_ari_cluster_labels_kmeans(emb, labels),
        "nmi_ari_cluster_labels_leiden": lambda: scib_metrics.nmi_ari_cluster_labels_leiden(nn15, labels),
    }
    for name, fn in calls.items():
        t0 = time.perf_counter()
        v = fn()
        t[name] = time.perf_counter() - t0
        m[name] = {k: float(x) for k, x in v.items()} if isinstance(v, dict) else float(v)
        print(f"  {name:32s} {t[name]:8.2f}s  {m[name]}", flush=True)
    emb.tofile(os.path.join(out_dir, "emb.f32"))
    x_pre.tofile(os.path.join(out_dir, "x_pre.f32"))
    labels.astype(np.uint32).tofile(os.path.join(out_dir, "labels.u32"))
    batches.astype(np.uint32).tofile(os.path.join(out_dir, "batches.u32"))
    nn90.indices.astype(np.uint32).tofile(os.path.join(out_dir, "knn_idx.u32"))
    nn90.distances.astype(np.float32).tofile(os.path.join(out_dir, "knn_dist.f32"))
    meta = {"n": n, "d": emb.shape[1], "d_pre": x_pre.shape[1], "k": 90, "metrics": m, "timings_s": t}
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(t, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "scib"))
    ap.add_argument("--cases", default="easy,hard,mixed,edge,kbet_lanczos")
    ap.add_argument("--timing-n", type=int, default=0, help="only time scib-metrics on an n-cell set")
    ap.add_argument("--timing-dir", default="/tmp/scib-timing")
    args = ap.parse_args()
    if args.timing_n:
        run_timing(args.timing_n, args.timing_dir)
        return
    os.makedirs(args.out, exist_ok=True)
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        res = run_kbet_lanczos_case() if name == "kbet_lanczos" else run_case(name)
        path = os.path.join(args.out, f"{name}.json")
        with open(path, "w") as f:
            json.dump(res, f, separators=(",", ":"))
        print(f"{name}: wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB) in {time.perf_counter() - t0:.1f}s")
        for k, v in res["metrics"].items():
            if not isinstance(v, list):
                print(f"  {k:40s} {v}")
        if "timings_s" in res:
            print("  timings:", json.dumps(res["timings_s"]))


if __name__ == "__main__":
    main()
