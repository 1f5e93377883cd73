//! `scfoundry integrate --method scvi_denovo`: the NB likelihood against an independent formula,
//! the ELBO going down, a seed reproducing the embedding, and on the demo batches an embedding
//! that mixes patients better than uncorrected PCA without losing the cell types.

use scfoundry::anndata::AnnData;
use scfoundry::methods::scvi::log_nb_positive;
use scfoundry::metrics::lisi::{clisi_knn, ilisi_knn};
use scfoundry::metrics::neighbors::exact_knn;
use scfoundry::metrics::silhouette::silhouette_label;

use crate::common::{python, python_json, sha256, TestContext, Tiny};

#[test]
fn scvi_nb_log_likelihood_matches_python() {
    let Some(py) = python() else { return };
    let v = python_json(&py, "scvi_nb_check.py", &[]);
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() > 100);
    for c in cases {
        let f = |i: usize| c[i].as_f64().unwrap();
        let (x, mu, theta, formula, scipy) = (f(0), f(1), f(2), f(3), f(4));
        let got = log_nb_positive(x, mu, theta, 1e-8);
        assert!((got - formula).abs() <= 1e-9 * formula.abs().max(1.0), "x={x} mu={mu} theta={theta}: {got} vs {formula}");
        // the eps of scvi-tools' formula shifts it a little from the exact pmf
        assert!((got - scipy).abs() <= 1e-4 * scipy.abs().max(1.0), "x={x} mu={mu} theta={theta}: {got} vs scipy {scipy}");
    }
}

fn codes(ad: &AnnData, key: &str) -> Vec<u32> {
    let obs = ad.obs().unwrap();
    let labels = obs.column(key).unwrap().as_labels().unwrap();
    let mut levels: Vec<String> = labels.iter().map(|l| l.clone().unwrap()).collect();
    levels.sort();
    levels.dedup();
    labels.iter().map(|l| levels.binary_search(l.as_ref().unwrap()).unwrap() as u32).collect()
}

/// (batch iLISI scaled, label cLISI scaled, label silhouette rescaled) of an embedding.
fn scores(ad: &AnnData, key: &str) -> (f64, f64, f64) {
    let (x, n, d) = ad.dense_entry("obsm", key).unwrap();
    let nn = exact_knn(&x, n, d, 45);
    let batch = codes(ad, "batch");
    let label = codes(ad, "cell_type");
    (ilisi_knn(&nn, &batch, None, true), clisi_knn(&nn, &label, None, true), silhouette_label(&x, n, d, &label, true, 256))
}

/// Columns of elbo.tsv by name.
fn tsv_column(path: &std::path::Path, name: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split('\t').collect();
    let i = header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no column {name} in {header:?}"));
    lines.map(|l| l.split('\t').nth(i).unwrap().parse().unwrap()).collect()
}

#[test]
fn scvi_denovo_mixes_demo_batches_and_keeps_cell_types() {
    let ctx = TestContext::new();
    ctx.demo("wu2020_tcells.h5ad");
    ctx.run(&["embed", "-m", "pca", "-d", "wu2020_tcells.h5ad", "-o", "pca.h5ad", "--n-comps", "30"]).success();
    let before = sha256(&ctx.path("pca.h5ad"));
    // scvi-tools' defaults (2,000 genes, 400 epochs for 200 cells) but 1,000 genes and 200
    // epochs to keep the test short
    let args = ["integrate", "-m", "scvi_denovo", "-d", "pca.h5ad", "--batch-key", "batch", "--n-top-genes", "1000", "--max-epochs", "200", "--seed", "3"];
    let r = ctx.run(&args);
    r.success().stderr_has("obsm['X_scvi_denovo'] (200 cells x 10)").stderr_has("1000 genes").stderr_has("14 batches");
    assert_eq!(before, sha256(&ctx.path("pca.h5ad")), "input modified");
    let ad = AnnData::open(&ctx.path("pca.scvi_denovo.h5ad")).unwrap();
    let (ib, cb, sb) = scores(&ad, "X_pca");
    let (ia, ca, sa) = scores(&ad, "X_scvi_denovo");
    eprintln!("iLISI {ib:.4} -> {ia:.4}, cLISI {cb:.4} -> {ca:.4}, silhouette {sb:.4} -> {sa:.4}");
    assert!(ia > ib + 0.02, "batch mixing did not improve: iLISI {ib} -> {ia}");
    // bio conservation may drop a little on 200 cells; more than this margin is a regression
    assert!(ca >= cb - 0.05, "cLISI dropped: {cb} -> {ca}");
    assert!(sa >= sb - 0.05, "label silhouette dropped: {sb} -> {sa}");
    let uns = ad.uns();
    let p = &uns["scfoundry_integrate"];
    assert_eq!(p["method"], "scvi_denovo");
    assert_eq!(p["seed"], 3);
    assert_eq!(p["n_genes"], 1000);
    assert_eq!(p["max_epochs"], 200);
    assert_eq!(p["n_train"], 180);
    assert_eq!(p["n_validation"], 20);
    // the ELBO goes down: train and validation, first epochs against the last
    let tsv = ctx.path("pca.scvi_denovo/elbo.tsv");
    let train = tsv_column(&tsv, "elbo_train");
    let val = tsv_column(&tsv, "elbo_validation");
    assert_eq!(train.len(), 200);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (t0, t1) = (mean(&train[..10]), mean(&train[190..]));
    let (v0, v1) = (mean(&val[..10]), mean(&val[190..]));
    eprintln!("ELBO train {t0:.1} -> {t1:.1}, validation {v0:.1} -> {v1:.1}");
    assert!(t1 < 0.9 * t0, "train ELBO did not go down: {t0} -> {t1}");
    assert!(v1 < 0.95 * v0, "validation ELBO did not go down: {v0} -> {v1}");
    // the provenance holds the last epoch's ELBO
    assert!((p["elbo_train"].as_f64().unwrap() - train[199]).abs() < 1e-3 * train[199].abs());
    // a seed reproduces the embedding; another seed gives another one (short runs)
    let short = ["integrate", "-m", "scvi_denovo", "-d", "pca.h5ad", "--batch-key", "batch", "--n-top-genes", "300", "--max-epochs", "15"];
    let emb = |seed: &str, out: &str| {
        ctx.run(&[&short[..], &["--seed", seed, "-o", out]].concat()).success();
        AnnData::open(&ctx.path(out)).unwrap().dense_entry("obsm", "X_scvi_denovo").unwrap().0
    };
    let a = emb("3", "a.h5ad");
    assert_eq!(a, emb("3", "b.h5ad"), "same seed, different embedding");
    assert_ne!(a, emb("4", "c.h5ad"), "another seed, same embedding");
}

#[test]
fn scvi_denovo_bad_input_is_clear() {
    let ctx = TestContext::new();
    let n = 40;
    let batch: Vec<String> = (0..n).map(|i| format!("b{}", i % 2)).collect();
    let mut t = Tiny::counts(n, 12).with_obs("batch", batch.clone()).with_obs("donor", batch);
    t.write(&ctx.path("t.h5ad"));
    ctx.run(&["integrate", "-m", "scvi_denovo", "-d", "t.h5ad", "--batch-key", "lane"]).user_error().stderr_has("t.h5ad: obs/lane: is missing");
    ctx.run(&["integrate", "-m", "scvi_denovo", "-d", "t.h5ad", "--batch-key", "batch,donor"]).user_error().stderr_has("one batch column");
    ctx.run(&["integrate", "-m", "scvi_denovo", "-d", "t.h5ad", "--batch-key", "batch", "--layer", "counts"]).user_error().stderr_has("layers/counts");
    // normalised values are not counts
    t.x[5] = 0.5;
    t.write(&ctx.path("norm.h5ad"));
    ctx.run(&["integrate", "-m", "scvi_denovo", "-d", "norm.h5ad", "--batch-key", "batch"]).failed().stderr_has("counts check: X holds fractional values").stderr_has("needs raw counts").stderr_has("non-integer").has_hint();
    // a cell without counts has no library size
    t.x[5] = 1.0;
    for j in 0..12 {
        t.x[7 * 12 + j] = 0.0;
    }
    t.write(&ctx.path("empty.h5ad"));
    ctx.run(&["integrate", "-m", "scvi_denovo", "-d", "empty.h5ad", "--batch-key", "batch"]).user_error().stderr_has("cell 7 (cell_7) has no counts").has_hint();
    // and a small good run works end to end, with the embedding width asked for
    ctx.run(&["integrate", "-m", "scvi_denovo", "-d", "t.h5ad", "--batch-key", "batch", "--n-latent", "4", "--max-epochs", "3", "-o", "ok.h5ad"]).success().stderr_has("(40 cells x 4)");
}
