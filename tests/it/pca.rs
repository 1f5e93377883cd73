//! PCA end to end: the output opens in anndata with everything of the input preserved,
//! agrees with scanpy on the demo data, is deterministic, and honours --in-place.

use crate::common::{python, python_json, sha256, TestContext};

#[test]
fn demo_pbmc_agrees_with_scanpy() {
    let ctx = TestContext::new();
    let input = ctx.demo("pbmc68k_counts.h5ad");
    let before = sha256(&input);
    let r = ctx.run(&["embed", "--method", "pca", "--data", "pbmc68k_counts.h5ad"]);
    r.success();
    assert_eq!(before, sha256(&input), "input modified");
    let out = ctx.path("pbmc68k_counts.pca.h5ad");
    assert!(out.exists());
    // our own reader sees the embedding
    let ad = scfoundry::anndata::AnnData::open(&out).unwrap();
    let (emb, n, d) = ad.dense_entry("obsm", "X_pca").unwrap();
    assert_eq!((n, d), (700, 50));
    assert!(emb.iter().all(|v| v.is_finite()) && emb.iter().any(|&v| v != 0.0));
    let Some(py) = python() else { return };
    let m = python_json(&py, "pca_vs_scanpy.py", &[&input, &out]);
    assert_eq!(m["hvg_disagree"], 0, "{m}");
    assert!(m["mean_cos_top20"].as_f64().unwrap() >= 0.999, "{m}");
    assert!(m["max_abs_dvr"].as_f64().unwrap() <= 1e-3, "{m}");
    assert!(m["min_corr_top20"].as_f64().unwrap() >= 0.99, "{m}");
    assert_eq!(m["obsm_dtype"], "float32");
}

#[test]
fn demo_wu2020_agrees_with_scanpy_and_keeps_content() {
    let ctx = TestContext::new();
    let input = ctx.demo("wu2020_tcells.h5ad");
    ctx.run(&["embed", "--method", "pca", "--data", "wu2020_tcells.h5ad", "--out", "sub/out.h5ad", "--seed", "7"]).success();
    let out = ctx.path("sub/out.h5ad");
    let Some(py) = python() else { return };
    let m = python_json(&py, "pca_vs_scanpy.py", &[&input, &out]);
    assert_eq!(m["hvg_ours"], 2000, "{m}");
    assert!(m["hvg_disagree"].as_i64().unwrap() <= 2, "{m}");
    assert!(m["mean_cos_top20"].as_f64().unwrap() >= 0.999, "{m}");
    assert!(m["max_abs_dvr"].as_f64().unwrap() <= 1e-3, "{m}");
    let o = python_json(&py, "read_output.py", &[&input, &out, std::path::Path::new("X_pca")]);
    for k in ["shape_equal", "X_equal", "obs_equal", "var_equal", "obs_names_equal", "layers_equal", "embedding_finite"] {
        assert_eq!(o[k], true, "{k}: {o}");
    }
    assert_eq!(o["embedding_shape"], serde_json::json!([200, 50]));
    assert_eq!(o["provenance"]["method"], "pca");
    assert_eq!(o["provenance"]["seed"], 7);
    assert_eq!(o["provenance"]["tool"], "scfoundry");
    assert!(o["provenance"]["date"].as_str().unwrap().starts_with("20"));
    assert_eq!(o["parameters"]["n_comps"], 50);
    assert_eq!(o["parameters"]["n_top_genes"], 2000);
    // every uns key of the input survives
    for k in o["uns_keys_in"].as_array().unwrap() {
        assert!(o["uns_keys_out"].as_array().unwrap().contains(k), "lost uns key {k}");
    }
}

#[test]
fn same_seed_same_embedding_and_n_comps() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "-o", "a.h5ad", "--n-comps", "12"]).success();
    ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "-o", "b.h5ad", "--n-comps", "12"]).success();
    let read = |p: &str| scfoundry::anndata::AnnData::open(&ctx.path(p)).unwrap().dense_entry("obsm", "X_pca").unwrap();
    let (a, _, d) = read("a.h5ad");
    let (b, _, _) = read("b.h5ad");
    assert_eq!(d, 12);
    assert_eq!(a, b);
}

#[test]
fn in_place_replaces_atomically() {
    let ctx = TestContext::new();
    let input = ctx.demo("pbmc68k_counts.h5ad");
    let before = sha256(&input);
    ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--in-place", "--n-comps", "5"]).success();
    assert_ne!(before, sha256(&input), "--in-place did not write the input");
    assert!(!ctx.path("pbmc68k_counts.pca.h5ad").exists());
    let ad = scfoundry::anndata::AnnData::open(&input).unwrap();
    assert_eq!(ad.dense_entry("obsm", "X_pca").unwrap().2, 5);
    assert_eq!(ad.n_obs, 700);
}

#[test]
fn unhonoured_option_is_accepted_with_a_warning() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--batch-size", "64", "--nlayers", "4", "--n-comps", "3"]);
    r.success()
        .stderr_has("warning: pca does not honour --batch-size when embedding; ignored")
        .stderr_has("warning: pca does not honour --nlayers; ignored");
}

#[test]
fn layer_is_used_when_named() {
    // the counts in layers/counts give the same embedding as the same counts in X
    let ctx = TestContext::new();
    let src = ctx.demo("pbmc68k_counts.h5ad");
    let with_layer = ctx.path("layered.h5ad");
    std::fs::copy(&src, &with_layer).unwrap();
    {
        let f = hdf5::File::open_rw(&with_layer).unwrap();
        let layers = if f.link_exists("layers") { f.group("layers").unwrap() } else { f.create_group("layers").unwrap() };
        // copy X to layers/counts, then scale X so it is no longer counts
        let x = f.group("X").unwrap();
        let c = layers.create_group("counts").unwrap();
        crate::common::enc(&c, "csr_matrix", "0.1.0");
        let shape: Vec<i64> = x.attr("shape").unwrap().read_raw().unwrap();
        c.new_attr::<i64>().shape([2]).create("shape").unwrap().write_raw(&shape).unwrap();
        let data: Vec<f32> = x.dataset("data").unwrap().read_raw().unwrap();
        for (name, v) in [("indices", x.dataset("indices").unwrap().read_raw::<i64>().unwrap()), ("indptr", x.dataset("indptr").unwrap().read_raw::<i64>().unwrap())] {
            c.new_dataset::<i64>().shape([v.len()]).create(name).unwrap().write_raw(&v).unwrap();
        }
        c.new_dataset::<f32>().shape([data.len()]).create("data").unwrap().write_raw(&data).unwrap();
        let scaled: Vec<f32> = data.iter().map(|v| (v + 1.0).ln()).collect();
        x.dataset("data").unwrap().write_raw(&scaled).unwrap();
    }
    ctx.run(&["embed", "-m", "pca", "-d", "layered.h5ad", "-o", "no_layer.h5ad"]).user_error().stderr_has("counts check: pca needs raw counts").stderr_has("--layer counts");
    ctx.run(&["embed", "-m", "pca", "-d", "layered.h5ad", "-o", "l.h5ad", "--layer", "counts", "--n-comps", "8"]).success();
    ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "-o", "x.h5ad", "--n-comps", "8"]).success();
    let read = |p: &str| scfoundry::anndata::AnnData::open(&ctx.path(p)).unwrap().dense_entry("obsm", "X_pca").unwrap().0;
    assert_eq!(read("l.h5ad"), read("x.h5ad"));
}
