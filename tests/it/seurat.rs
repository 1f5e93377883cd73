//! `scfoundry integrate --method seurat`: the CCA against a numpy reference, the end-to-end run
//! on the demo batches scored against uncorrected PCA, and clear errors on bad input.

use rand::{Rng, SeedableRng};
use scfoundry::anndata::AnnData;
use scfoundry::methods::seurat::cca;
use scfoundry::metrics::lisi::{clisi_knn, ilisi_knn};
use scfoundry::metrics::neighbors::exact_knn;
use scfoundry::metrics::silhouette::{silhouette_batch, silhouette_label};

use crate::common::{python, python_json, sha256, TestContext, Tiny};

#[test]
fn seurat_cca_matches_numpy_svd() {
    let Some(py) = python() else { return };
    let ctx = TestContext::new();
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    // two small datasets sharing a 3-D signal over 25 features, plus noise; 80 cells uses the
    // Lanczos path, 30 the dense one
    let f = 25;
    let load: Vec<f64> = (0..3 * f).map(|_| r.gen::<f64>() - 0.5).collect();
    let mut make = |n: usize| -> Vec<f64> {
        (0..n)
            .flat_map(|_| {
                let z: Vec<f64> = (0..3).map(|_| r.gen::<f64>() * 2.0 - 1.0).collect();
                let noise: Vec<f64> = (0..f).map(|_| 0.3 * (r.gen::<f64>() - 0.5)).collect();
                (0..f).map(move |g| z[0] * load[g] + z[1] * load[f + g] + z[2] * load[2 * f + g] + noise[g]).collect::<Vec<_>>()
            })
            .collect()
    };
    let (n1, n2, k) = (80, 70, 6);
    let a = make(n1);
    let b = make(n2);
    let small = make(30);
    for (a, n1, b, n2) in [(&a, n1, &b, n2), (&small, 30, &b, n2)] {
        let input = ctx.path("cca.json");
        std::fs::write(&input, serde_json::json!({"a": a, "b": b, "n1": n1, "n2": n2, "f": f, "k": k}).to_string()).unwrap();
        let want = python_json(&py, "seurat_cca_reference.py", &[&input]);
        let got = cca(a, n1, b, n2, f, k, 7);
        assert_eq!(got.k, k);
        let wd: Vec<f64> = want["d"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        for j in 0..k {
            assert!((got.d[j] - wd[j]).abs() < 1e-7 * wd[0], "canonical value {j}: {} vs numpy {}", got.d[j], wd[j]);
        }
        // vectors up to sign (the sign convention is the same, but a tie at 0 could differ)
        for (name, mine, n) in [("u", &got.u, n1), ("v", &got.v, n2)] {
            let theirs: Vec<f64> = want[name].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            for j in 0..k {
                let dot: f64 = (0..n).map(|i| mine[i * k + j] * theirs[i * k + j]).sum();
                assert!((dot.abs() - 1.0).abs() < 1e-6, "{name} column {j}: |cos| {dot}");
                assert!(dot > 0.0, "{name} column {j}: sign differs from Seurat's convention");
            }
        }
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

/// (batch iLISI, batch silhouette, label cLISI, label silhouette), all scaled so that higher is better.
fn scores(ad: &AnnData, key: &str) -> (f64, f64, f64, f64) {
    let (x, n, d) = ad.dense_entry("obsm", key).unwrap();
    let nn = exact_knn(&x, n, d, 45.min(n));
    let batch = codes(ad, "batch");
    let label = codes(ad, "cell_type");
    (
        ilisi_knn(&nn, &batch, None, true),
        silhouette_batch(&x, n, d, &label, &batch, true, 256),
        clisi_knn(&nn, &label, None, true),
        silhouette_label(&x, n, d, &label, true, 256),
    )
}

#[test]
fn seurat_mixes_demo_batches_and_keeps_cell_types() {
    let ctx = TestContext::new();
    ctx.demo("wu2020_tcells.h5ad");
    // the uncorrected baseline: PCA of the same data (scanpy recipe, 30 components)
    ctx.run(&["embed", "-m", "pca", "-d", "wu2020_tcells.h5ad", "-o", "pca.h5ad", "--n-comps", "30"]).success();
    let before = sha256(&ctx.path("pca.h5ad"));
    let r = ctx.run(&["integrate", "-m", "seurat", "-d", "pca.h5ad", "--batch-key", "batch", "--seed", "3"]);
    // 14 batches of 2-32 cells: below Seurat's own limits, so the caps are announced
    r.success().stderr_has("obsm['X_seurat'] (200 cells x 30)").stderr_has("warning: seurat:").stderr_has("Max dimension too large");
    assert_eq!(before, sha256(&ctx.path("pca.h5ad")), "input modified");
    let ad = AnnData::open(&ctx.path("pca.seurat.h5ad")).unwrap();
    let (ib, sbb, cb, sb) = scores(&ad, "X_pca");
    let (ia, sba, ca, sa) = scores(&ad, "X_seurat");
    eprintln!("iLISI {ib:.4} -> {ia:.4}, batch ASW {sbb:.4} -> {sba:.4}, cLISI {cb:.4} -> {ca:.4}, label ASW {sb:.4} -> {sa:.4}");
    assert!(ia > ib + 0.02, "batch mixing did not improve: iLISI {ib} -> {ia}");
    // bio conservation on 200 cells in 16 types: a drop beyond this margin is a regression
    assert!(ca >= cb - 0.05, "cLISI dropped: {cb} -> {ca}");
    assert!(sa >= sb - 0.05, "label silhouette dropped: {sb} -> {sa}");
    let uns = ad.uns();
    let prov = &uns["scfoundry_integrate"];
    assert_eq!(prov["method"], "seurat");
    assert_eq!(prov["seed"], 3);
    assert_eq!(prov["matrix"], "X");
    assert_eq!(prov["merges"].as_array().unwrap().len(), 13, "14 batches merge in 13 steps");
    assert!(prov["anchors"].as_u64().unwrap() > 100);
    // deterministic for a seed
    ctx.run(&["integrate", "-m", "seurat", "-d", "pca.h5ad", "--batch-key", "batch", "--seed", "3", "-o", "again.h5ad"]).success();
    let again = AnnData::open(&ctx.path("again.h5ad")).unwrap();
    assert_eq!(ad.dense_entry("obsm", "X_seurat").unwrap().0, again.dense_entry("obsm", "X_seurat").unwrap().0);
}

#[test]
fn seurat_bad_input_is_clear() {
    let ctx = TestContext::new();
    // not counts
    let mut t = Tiny::counts(40, 30);
    t.x[3] = 0.5;
    let batches: Vec<String> = (0..40).map(|i| format!("b{}", i % 2)).collect();
    t.clone().with_obs("batch", batches.clone()).write(&ctx.path("frac.h5ad"));
    ctx.run(&["integrate", "-m", "seurat", "-d", "frac.h5ad", "--batch-key", "batch"]).user_error().stderr_has("X: holds 0.5 at cell 0 (cell_0), gene gene_3").stderr_has("not a raw count").stderr_has("--log-normalized");
    // a batch of one cell
    let mut one = batches.clone();
    one[0] = "lonely".into();
    Tiny::counts(40, 30).with_obs("batch", one).write(&ctx.path("one.h5ad"));
    ctx.run(&["integrate", "-m", "seurat", "-d", "one.h5ad", "--batch-key", "batch"]).user_error().stderr_has("obs/batch: batch 'lonely' has 1 cell");
    // a missing layer, and several batch keys
    Tiny::counts(40, 30).with_obs("batch", batches).write(&ctx.path("ok.h5ad"));
    ctx.run(&["integrate", "-m", "seurat", "-d", "ok.h5ad", "--batch-key", "batch", "--layer", "counts"]).user_error().stderr_has("layers/counts: is missing");
    ctx.run(&["integrate", "-m", "seurat", "-d", "ok.h5ad", "--batch-key", "batch,batch"]).user_error().stderr_has("one batch column");
}
