//! `scfoundry integrate --method harmony` on the demo batches: the integrated embedding mixes
//! batches better than uncorrected PCA without losing the cell types, and bad input is clear.

use scfoundry::anndata::AnnData;
use scfoundry::metrics::lisi::{clisi_knn, ilisi_knn};
use scfoundry::metrics::neighbors::exact_knn;
use scfoundry::metrics::silhouette::silhouette_label;

use crate::common::{sha256, TestContext, Tiny};

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

#[test]
fn harmony_mixes_demo_batches_and_keeps_cell_types() {
    let ctx = TestContext::new();
    ctx.demo("wu2020_tcells.h5ad");
    ctx.run(&["embed", "-m", "pca", "-d", "wu2020_tcells.h5ad", "-o", "pca.h5ad", "--n-comps", "30"]).success();
    let before = sha256(&ctx.path("pca.h5ad"));
    let r = ctx.run(&["integrate", "-m", "harmony", "-d", "pca.h5ad", "--batch-key", "batch", "--seed", "3"]);
    r.success().stderr_has("obsm['X_harmony'] (200 cells x 30)");
    assert_eq!(before, sha256(&ctx.path("pca.h5ad")), "input modified");
    let ad = AnnData::open(&ctx.path("pca.harmony.h5ad")).unwrap();
    let (ib, cb, sb) = scores(&ad, "X_pca");
    let (ia, ca, sa) = scores(&ad, "X_harmony");
    eprintln!("iLISI {ib:.4} -> {ia:.4}, cLISI {cb:.4} -> {ca:.4}, silhouette {sb:.4} -> {sa:.4}");
    assert!(ia > ib + 0.01, "batch mixing did not improve: iLISI {ib} -> {ia}");
    // bio conservation may drop a little on 200 cells; more than this margin is a regression
    assert!(ca >= cb - 0.05, "cLISI dropped: {cb} -> {ca}");
    assert!(sa >= sb - 0.05, "label silhouette dropped: {sb} -> {sa}");
    let uns = ad.uns();
    assert_eq!(uns["scfoundry_integrate"]["method"], "harmony");
    assert_eq!(uns["scfoundry_integrate"]["seed"], 3);
    // deterministic for a seed
    ctx.run(&["integrate", "-m", "harmony", "-d", "pca.h5ad", "--batch-key", "batch", "--seed", "3", "-o", "again.h5ad"]).success();
    let again = AnnData::open(&ctx.path("again.h5ad")).unwrap();
    assert_eq!(ad.dense_entry("obsm", "X_harmony").unwrap().0, again.dense_entry("obsm", "X_harmony").unwrap().0);
}

#[test]
fn integrate_bad_input_is_clear() {
    let ctx = TestContext::new();
    ctx.demo("wu2020_tcells.h5ad");
    ctx.run(&["embed", "-m", "pca", "-d", "wu2020_tcells.h5ad", "-o", "pca.h5ad", "--n-comps", "10"]).success();
    ctx.run(&["integrate", "-m", "harmony", "-d", "pca.h5ad", "--batch-key", "donor"]).user_error().stderr_has("pca.h5ad: obs/donor: is missing").stderr_has("obs columns in this file:");
    ctx.run(&["integrate", "-m", "harmony", "-d", "pca.h5ad", "--batch-key", "batch", "--embedding", "X_scvi"]).user_error().stderr_has("obsm/X_scvi").stderr_has("X_pca");
    ctx.run(&["integrate", "-m", "pca", "-d", "pca.h5ad", "--batch-key", "batch"]).user_error().stderr_has("is an embedding method");
    ctx.run(&["integrate", "-m", "scgpt_integrated", "-d", "pca.h5ad", "--batch-key", "batch"]).user_error().stderr_has("weights for scgpt_integrated are not in").has_hint();
    // one batch: nothing to integrate
    Tiny::counts(30, 12).write(&ctx.path("t.h5ad"));
    ctx.run(&["embed", "-m", "pca", "-d", "t.h5ad", "-o", "tp.h5ad", "--n-comps", "5"]).success();
    {
        let f = hdf5::File::open_rw(ctx.path("tp.h5ad")).unwrap();
        let obs = f.group("obs").unwrap();
        let vals: Vec<hdf5::types::VarLenUnicode> = (0..30).map(|_| "b1".parse().unwrap()).collect();
        let ds = obs.new_dataset::<hdf5::types::VarLenUnicode>().shape([30]).create("batch").unwrap();
        ds.write_raw(&vals).unwrap();
        crate::common::enc(&ds, "string-array", "0.2.0");
        obs.delete_attr("column-order").unwrap();
        let names: Vec<hdf5::types::VarLenUnicode> = vec!["batch".parse().unwrap()];
        obs.new_attr::<hdf5::types::VarLenUnicode>().shape([1]).create("column-order").unwrap().write_raw(&names).unwrap();
    }
    ctx.run(&["integrate", "-m", "harmony", "-d", "tp.h5ad", "--batch-key", "batch"]).user_error().stderr_has("single batch");
}
