#!/usr/bin/env python3
"""Reference fixture for scfoundry's kNN label transfer and its scores.

    /root/.cache/venv-harmony/bin/python scripts/knn_transfer_reference.py \
        [--out tests/fixtures/knn_transfer/reference.json]

(venv: scikit-learn 1.9.1, numpy 2.4.6.) Seeded synthetic reference and query embeddings
(SYNTHETIC: Gaussian clusters, one label per cluster, some clusters overlapping so that votes
are split). The transfer is scArches' `weighted_knn_transfer` (theislab/scarches,
scarches/utils/knn.py), restated here: neighbours from sklearn's
KNeighborsTransformer(n_neighbors=k, mode="distance", algorithm="brute", metric="euclidean"),
weights exp(-d / (2 / std(d))^2) normalised per cell, the label with the largest total weight
(the first in sorted label order on a tie), confidence = that weight (uncertainty = 1 - it).
Scores: sklearn accuracy_score, f1_score(average="macro"), confusion_matrix(labels=range(L)),
also on a hand-made truth/prediction pair with labels missing from one side or both.
Floats are written with 7 significant digits; the embeddings are rounded before use.
"""
import argparse
import json
from pathlib import Path

import numpy as np
import sklearn
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score
from sklearn.neighbors import KNeighborsTransformer


def sig7(a):
    return [float(f"{v:.7g}") for v in np.asarray(a, dtype=np.float64).ravel()]


def scarches_vote(ref, ref_labels, query, k):
    knn = KNeighborsTransformer(n_neighbors=k, mode="distance", algorithm="brute", metric="euclidean").fit(ref)
    dist, idx = knn.kneighbors(X=query)
    s = (2.0 / np.std(dist, axis=1)) ** 2
    w = np.exp(-dist / s[:, None])
    w = w / w.sum(axis=1, keepdims=True)
    pred, conf = [], []
    for i in range(len(query)):
        labels = ref_labels[idx[i]]
        best, best_p = None, 0.0
        for lab in np.unique(labels):
            p = w[i, labels == lab].sum()
            if best_p < p:
                best, best_p = lab, p
        pred.append(int(best))
        conf.append(float(best_p))
    return pred, conf, idx, dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/knn_transfer/reference.json")
    a = ap.parse_args()
    rng = np.random.default_rng(11)
    d, n_labels = 8, 6
    centers = rng.normal(0, 2.0, (n_labels, d))
    centers[5] = centers[4] + 0.8  # two overlapping types: split votes
    n_ref, n_query = 600, 250
    ref_labels = rng.integers(0, n_labels - 1, n_ref)  # label 5 absent from the reference...
    ref_labels[:40] = 5  # ...except 40 cells
    ref = centers[ref_labels] + rng.normal(0, 1.0, (n_ref, d))
    truth = rng.integers(0, n_labels, n_query)
    query = centers[truth] + rng.normal(0, 1.0, (n_query, d)) + 0.3  # a small shift
    ref = np.asarray(sig7(ref)).reshape(n_ref, d).astype(np.float32)
    query = np.asarray(sig7(query)).reshape(n_query, d).astype(np.float32)
    out = {
        "source": f"scikit-learn {sklearn.__version__}, numpy {np.__version__}; vote as scArches weighted_knn_transfer",
        "d": d, "n_labels": n_labels, "n_ref": n_ref, "n_query": n_query,
        "ref": sig7(ref), "query": sig7(query),
        "ref_labels": [int(x) for x in ref_labels], "truth": [int(x) for x in truth],
        "cases": [],
    }
    for k in (1, 5, 15, 50):
        pred, conf, idx, dist = scarches_vote(ref, ref_labels, query, k)
        out["cases"].append({
            "k": k, "predicted": pred, "confidence": sig7(conf),
            "neighbors": [[int(j) for j in row] for row in idx[:20]],
            "distances": [sig7(row) for row in dist[:20]],
            "accuracy": float(accuracy_score(truth, pred)),
            "macro_f1": float(f1_score(truth, pred, average="macro")),
            "confusion": [int(x) for x in confusion_matrix(truth, pred, labels=list(range(n_labels))).ravel()],
        })
    # scores on a hand-made pair: label 2 never predicted, label 4 only predicted, label 6 nowhere
    t = [0, 0, 1, 1, 2, 2, 3, 3, 3, 5, 5, 0]
    p = [0, 1, 1, 1, 0, 3, 3, 3, 4, 5, 0, 0]
    out["scores"] = {
        "truth": t, "predicted": p, "n_labels": 7,
        "accuracy": float(accuracy_score(t, p)),
        "macro_f1": float(f1_score(t, p, average="macro", zero_division=0)),
        "confusion": [int(x) for x in confusion_matrix(t, p, labels=list(range(7))).ravel()],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, separators=(",", ":")))
    for c in out["cases"]:
        print(f"k={c['k']}: accuracy {c['accuracy']:.4f} macro-F1 {c['macro_f1']:.4f}")
    print(f"{a.out}: {Path(a.out).stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
