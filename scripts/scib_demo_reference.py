#!/usr/bin/env python3
"""scib-metrics' Benchmarker on the demo data's PCA, as a fixture for scfoundry's agreement test.

    $VENV/bin/python scripts/scib_demo_reference.py   # VENV: see ci/reference/scib-metrics.txt \
        [--data demo/wu2020_tcells.h5ad] [--out tests/fixtures/scib/demo_wu2020_pca.json]

The embedding is scanpy's standard PCA of the demo counts (normalize_total 1e4, log1p,
seurat HVGs 2000, 50 components), stored in the fixture as float32. The Benchmarker then
runs with its defaults on obsm['X_pca_scanpy'] with the unintegrated X as stored (its
`prepare` computes `sc.tl.pca(adata, svd_solver='arpack', use_highly_variable=False)` for
PCR comparison, exactly what `scfoundry benchmark` reproduces). The Rust test
(tests/it/benchmark.rs::benchmark_agrees_with_scib_on_demo) writes the same embedding into
a copy of the demo file, runs `scfoundry benchmark` and compares every value.

KMeans NMI/ARI depend on the k-means++ random stream (JAX's here, ChaCha8 in scfoundry);
the script measures how much scib-metrics' own values move over seeds 0..9 and stores
`kmeans_tolerance` = that spread (at least 0.05). The exact 90-NN of scfoundry and
pynndescent are compared here too (`knn_sets_identical`): on 200 cells they coincide.
The Benchmarker gets the exact 90-NN (`exact_knn`, self first), as scfoundry's default
--neighbors exact does. Pins: ci/reference/scib-metrics.txt (scib-metrics 0.6.1).
"""

import argparse
import json
import os
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore")

import anndata as ad  # noqa: E402
import numpy as np  # noqa: E402
import scanpy as sc  # noqa: E402
import scib_metrics  # noqa: E402
from scib_metrics.benchmark import Benchmarker  # noqa: E402
from scib_metrics.nearest_neighbors import NeighborsResults, pynndescent  # noqa: E402
from scib_metrics.utils import KMeans  # noqa: E402
from sklearn.metrics.cluster import adjusted_rand_score, normalized_mutual_info_score  # noqa: E402


def exact_knn(x, k):
    """Exact Euclidean k-NN (self first), as scib-metrics' NeighborsResults."""
    x64 = np.asarray(x, dtype=np.float64)
    d2 = ((x64[:, None, :] - x64[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d2, -1.0)
    idx = np.argsort(d2, axis=1, kind="stable")[:, :k]
    np.fill_diagonal(d2, 0.0)
    dist = np.sqrt(np.take_along_axis(d2, idx, axis=1))
    return NeighborsResults(indices=idx.astype(np.int64), distances=dist.astype(np.float32))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="demo/wu2020_tcells.h5ad")
    p.add_argument("--out", default="tests/fixtures/scib/demo_wu2020_pca.json")
    a = p.parse_args()

    adata = ad.read_h5ad(a.data)
    work = adata.copy()
    sc.pp.normalize_total(work, target_sum=1e4)
    sc.pp.log1p(work)
    sc.pp.highly_variable_genes(work, flavor="seurat", n_top_genes=2000)
    sc.pp.pca(work, n_comps=50, mask_var="highly_variable")
    emb = np.asarray(work.obsm["X_pca"], dtype=np.float32)
    emb = np.array([float(f"{v:.9g}") for v in emb.ravel()], dtype=np.float32).reshape(emb.shape)
    adata.obsm["X_pca_scanpy"] = emb

    bm = Benchmarker(adata, batch_key="batch", label_key="cell_type", embedding_obsm_keys=["X_pca_scanpy"], progress_bar=False)
    # exact neighbours on both sides (scfoundry's --neighbors exact), so the search plays no part
    bm.prepare(neighbor_computer=exact_knn)
    bm.benchmark()
    res = bm.get_results(min_max_scale=False, clean_names=False)
    rows = {k: (None if np.isnan(float(v)) else float(v)) for k, v in res.loc["X_pca_scanpy"].items() if k in bm._results.index}

    labels = adata.obs["cell_type"].values
    spread_nmi, spread_ari = [], []
    n_clusters = len(np.unique(labels))
    for seed in range(10):
        km = KMeans(n_clusters, seed=seed).fit(emb)
        spread_nmi.append(normalized_mutual_info_score(labels, km.labels_, average_method="arithmetic"))
        spread_ari.append(adjusted_rand_score(labels, km.labels_))
    spread = max(max(spread_nmi) - min(spread_nmi), max(spread_ari) - min(spread_ari))

    nn = pynndescent(emb, n_neighbors=90, random_state=0)
    d2 = ((emb[:, None, :].astype(np.float64) - emb[None, :, :]) ** 2).sum(-1)
    exact = np.argsort(d2, axis=1, kind="stable")[:, :90]
    same = all(set(nn.indices[i]) == set(exact[i]) for i in range(emb.shape[0]))

    out = {
        "source": "scripts/scib_demo_reference.py",
        "scib_metrics_version": scib_metrics.__version__,
        "data": a.data,
        "n": int(emb.shape[0]),
        "d": int(emb.shape[1]),
        "embedding": [float(v) for v in emb.ravel()],
        "benchmarker": rows,
        "kmeans_seed_values": {"nmi": spread_nmi, "ari": spread_ari},
        "kmeans_tolerance": float(max(0.05, np.ceil(spread * 100) / 100)),
        "knn_sets_identical": bool(same),
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "embedding"}, indent=1))


if __name__ == "__main__":
    main()
