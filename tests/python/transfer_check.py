"""Check a `scfoundry transfer` output with anndata, scikit-learn and numpy; print JSON.

Usage: python transfer_check.py QUERY.h5ad OUTPUT.h5ad RUN_DIR LABEL_KEY K REFERENCE.h5ad
- reads the output with anndata; the query's content is kept, the new columns are there;
- accuracy and macro-F1 of the written predictions by scikit-learn;
- the query's projection redone in numpy from the saved PCA fit (RUN_DIR/work/pca_fit.json,
  floats stored as bit patterns) with scanpy's normalize_total + log1p on the query, genes
  aligned by name (missing ones zero);
- the vote redone as scArches' weighted_knn_transfer on sklearn's brute-force neighbours of
  the reference embedding (RUN_DIR/work/reference.f32) and the written query embedding.
"""
import json
import sys
import warnings

import anndata as ad
import numpy as np
import scanpy as sc
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score
from sklearn.neighbors import NearestNeighbors

warnings.filterwarnings("ignore")
query, out, run_dir, key, k, reference = sys.argv[1:7]
k = int(k)
ref = ad.read_h5ad(reference)
q = ad.read_h5ad(query)
o = ad.read_h5ad(out)
pred_key, conf_key = f"{key}_pred", f"{key}_pred_confidence"
res = {
    "obs_kept": bool(o.obs[q.obs.columns].equals(q.obs)),
    "obs_names_equal": bool((o.obs_names == q.obs_names).all()),
    "X_equal": bool((abs(o.X - q.X)).sum() == 0),
    "pred_dtype": str(o.obs[pred_key].dtype),
    "conf_dtype": str(o.obs[conf_key].dtype),
    "uns_command": str(o.uns["scfoundry"]["command"]),
}
if key in q.obs:
    t = o.obs[key].astype(str).values
    p = o.obs[pred_key].astype(str).values
    res["accuracy"] = accuracy_score(t, p)
    res["macro_f1"] = f1_score(t, p, average="macro")
    labels = sorted(set(t) | set(p))
    res["confusion_labels"] = labels
    res["confusion"] = confusion_matrix(t, p, labels=labels).tolist()

emb = np.asarray(o.obsm["X_pca"], dtype=np.float64)
fit_path = f"{run_dir}/work/pca_fit.json"
try:
    fit = json.load(open(fit_path))
except FileNotFoundError:
    fit = None
if fit is not None:
    b = lambda v: np.array(v, dtype=np.uint64).view(np.float64)
    mean, comps = b(fit["mean"]), b(fit["components"]).reshape(-1, len(fit["hvg_genes"]))
    x = q.copy()
    sc.pp.normalize_total(x, target_sum=1e4)
    sc.pp.log1p(x)
    names = ref.var_names[fit["hvg_genes"]]
    pos = {g: j for j, g in enumerate(q.var_names)}
    dense = x.X.toarray() if hasattr(x.X, "toarray") else np.asarray(x.X)
    cols = np.zeros((q.n_obs, len(names)))
    for h, g in enumerate(names):
        if g in pos:
            cols[:, h] = dense[:, pos[g]]
    redo = (cols - mean) @ comps.T
    res["projection_max_abs_diff"] = float(np.abs(redo - emb).max())
    res["projection_scale"] = float(np.abs(redo).max())

r = np.fromfile(f"{run_dir}/work/reference.f32", dtype="<f4").astype(np.float64).reshape(-1, emb.shape[1])
if True:
    rl = ref.obs[key].astype(str).values
    cats = sorted(set(rl))
    codes = np.array([cats.index(v) for v in rl])
    nn = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(r)
    dist, idx = nn.kneighbors(emb)
    # scArches weighted_knn_transfer
    std = np.std(dist, axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        s = (2.0 / std) ** 2
    w = np.exp(-dist / s)
    w = w / w.sum(axis=1, keepdims=True)
    votes = np.zeros((emb.shape[0], len(cats)))
    for j in range(k):
        votes[np.arange(emb.shape[0]), codes[idx[:, j]]] += w[:, j]
    best = votes.argmax(axis=1)
    py_pred = [cats[c] for c in best]
    res["sklearn_vote_equal"] = bool((np.array(py_pred) == o.obs[pred_key].astype(str).values).all())
    res["sklearn_vote_mismatches"] = int((np.array(py_pred) != o.obs[pred_key].astype(str).values).sum())
    res["confidence_max_abs_diff"] = float(np.abs(votes.max(axis=1) - o.obs[conf_key].values).max())
print(json.dumps(res))
