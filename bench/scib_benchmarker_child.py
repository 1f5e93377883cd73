#!/usr/bin/env python3
"""One scib-metrics Benchmarker run for bench/metrics_vs_scib.py, in a fresh process.

    python bench/scib_benchmarker_child.py IN.h5ad OBSM_KEY[,KEY...] LABEL_KEY BATCH_KEY

Default metric set (scib-metrics 0.6.1), the exact 90-NN (sklearn brute force with each cell's
self distance set to exactly 0, as pynndescent gives it; as `scfoundry benchmark --neighbors exact`; SCIB_NEIGHBORS=pynndescent for the Benchmarker's own
search), X_pre = sc.tl.pca of X in prepare (as `scfoundry benchmark` does). Then scib-metrics'
own KMeans NMI/ARI over seeds 0..4 (SCIB_KMEANS_SEEDS) on each embedding: the spread that its
one-run (seed 0) value comes from. The embeddings are copied to `emb:<key>` first,
because prepare's sc.tl.pca writes obsm['X_pca']. Prints one JSON line: per-step seconds
and the raw metric table.
"""
import json
import os
import sys
import time
import warnings

t0 = time.perf_counter()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore")
import anndata as ad  # noqa: E402
import numpy as np  # noqa: E402
from scib_metrics.benchmark import Benchmarker  # noqa: E402

t = {"import": time.perf_counter() - t0}
src, keys, label_key, batch_key = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
s = time.perf_counter()
adata = ad.read_h5ad(src)
names = []
for k in keys:
    adata.obsm[f"emb:{k}"] = np.asarray(adata.obsm[k])
    names.append(f"emb:{k}")
t["read"] = time.perf_counter() - s
bm = Benchmarker(adata, batch_key=batch_key, label_key=label_key, embedding_obsm_keys=names, progress_bar=False)
s = time.perf_counter()


def exact_knn(x, k):
    from scib_metrics.nearest_neighbors import NeighborsResults
    from sklearn.neighbors import NearestNeighbors

    dist, idx = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(x).kneighbors(x)
    # scikit-learn's brute force computes |a|^2 + |b|^2 - 2ab and gives a cell a self distance of
    # ~1e-7 on many rows; pynndescent (the Benchmarker's own search) and scfoundry give exactly 0,
    # and kBET's UMAP connectivities depend on it (src/metrics/README.md, "kBET and the self
    # distance"): set it to 0 so both tools score the same lists
    dist[idx == np.arange(len(x))[:, None]] = 0.0
    return NeighborsResults(indices=idx, distances=dist)


bm.prepare(neighbor_computer=None if os.environ.get("SCIB_NEIGHBORS") == "pynndescent" else exact_knn)
t["prepare_pca_and_neighbors"] = time.perf_counter() - s
s = time.perf_counter()
bm.benchmark()
t["benchmark_metrics"] = time.perf_counter() - s
res = bm.get_results(min_max_scale=False, clean_names=False)
t["total_in_process"] = time.perf_counter() - t0
table = {n.split(":", 1)[1]: {c: (None if v != v else float(v)) for c, v in res.loc[n].items() if c != "Metric Type"} for n in names}
from scib_metrics.utils import KMeans  # noqa: E402
from sklearn.metrics.cluster import adjusted_rand_score, normalized_mutual_info_score  # noqa: E402

spread = {}
labels = np.asarray(adata.obs[label_key])
for n in names:
    x = np.asarray(adata.obsm[n], dtype=np.float32)
    s = time.perf_counter()
    vals = {"seeds": [], "nmi": [], "ari": []}
    for seed in range(int(os.environ.get("SCIB_KMEANS_SEEDS", "5"))):
        km = KMeans(len(np.unique(labels)), seed=seed).fit(x.copy())
        vals["seeds"].append(seed)
        vals["nmi"].append(float(normalized_mutual_info_score(labels, km.labels_, average_method="arithmetic")))
        vals["ari"].append(float(adjusted_rand_score(labels, km.labels_)))
    t[f"kmeans_seeds:{n}"] = time.perf_counter() - s
    spread[n.split(":", 1)[1]] = vals
print(json.dumps({"seconds": t, "results": table, "kmeans_spread": spread}))
