//! sccello against the committed fixture (tests/fixtures/sccello/, made by
//! scripts/sccello_reference.py from upstream's own code; CI never installs torch): a small
//! random `PrototypeContrastiveForMaskedLM` in the release layout (config.json,
//! model.safetensors and pytorch_model.bin with upstream's key names), the V1-format
//! dictionaries, and the 50 demo cells of tests/fixtures/geneformer/pbmc68k_50.h5ad.
//! Token ids must be identical for every cell; embeddings within 1e-4 relative error.

use std::path::{Path, PathBuf};

use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::tasks::embed::cls_encoder::load;
use scfoundry::nn::cls_encoder::{Arch, ClsEncoder};

use crate::common::{TestContext, read_obsm, repo};

pub const MAX_REL: f64 = 1e-4;

fn fx() -> PathBuf {
    repo().join("tests/fixtures/sccello")
}

pub fn cells_h5ad() -> PathBuf {
    repo().join("tests/fixtures/geneformer/pbmc68k_50.h5ad")
}

pub fn reference(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap()
}

pub fn matrix(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()).collect()
}

/// Token ids of the fixture's cells as the embed task makes them.
pub fn our_tokens(model: &ClsEncoder) -> Vec<Vec<u32>> {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&cells_h5ad()).unwrap();
    let x = ad.matrix(None).unwrap();
    let ids: Vec<String> = ad.var().unwrap().column("ensembl_id").unwrap().as_labels().unwrap().into_iter().map(Option::unwrap_or_default).collect();
    let table = model.gene_table(&ids).unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    (0..b.n_rows())
        .map(|i| {
            let (idx, vals) = b.row(i);
            model.cell_tokens(&table, idx, vals).0
        })
        .collect()
}

/// Worst relative error (per cell: max |a - b| / max |b|) against the reference rows.
pub fn max_rel(got: &[f32], want: &[Vec<f64>], dim: usize) -> f64 {
    let mut worst = 0f64;
    for (i, w) in want.iter().enumerate() {
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (k, &wv) in w.iter().enumerate() {
            worst = worst.max((got[i * dim + k] as f64 - wv).abs() / scale);
        }
    }
    worst
}


/// Tokens identical to upstream's for every cell, embeddings within MAX_REL at `batch`.
pub fn check(arch: Arch, dir: &Path, reference_dir: &Path, batch: usize) -> f64 {
    let r = reference(reference_dir);
    let model = load(arch, dir, candle_core::Device::Cpu).unwrap();
    assert_eq!(model.input_size, r["input_size"].as_u64().unwrap() as usize);
    assert_eq!(model.cls as u64, r["cls"].as_u64().unwrap());
    let tokens = our_tokens(&model);
    let want: Vec<Vec<u32>> = r["tokens"].as_array().unwrap().iter().map(|c| c.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()).collect();
    assert_eq!(tokens.len(), want.len());
    for (i, (a, b)) in tokens.iter().zip(&want).enumerate() {
        assert_eq!(a, b, "{} cell {i}: token ids differ", arch.name());
    }
    // the fixture exercises the cut at the input size
    assert!(tokens.iter().any(|t| t.len() == model.input_size));
    let got = model.embed(&tokens, batch, |_| {}).unwrap();
    let err = max_rel(&got, &matrix(&r["embeddings"]), model.dim());
    eprintln!("{} ({}), batch {batch}: max relative error {err:.3e}", arch.name(), model.weights_path.file_name().unwrap().to_string_lossy());
    assert!(err < MAX_REL, "{}: max relative error {err}", arch.name());
    err
}

#[test]
fn sccello_safetensors_matches_upstream() {
    check(Arch::Sccello, &fx(), &fx(), 24);
    // batches of 7: padding differs, results do not
    check(Arch::Sccello, &fx(), &fx(), 7);
}

#[test]
fn sccello_pytorch_bin_matches_upstream() {
    let ctx = TestContext::new();
    let dir = ctx.path("bin");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "pytorch_model.bin", "token_dictionary.pkl", "gene_median_dictionary.pkl"] {
        std::fs::copy(fx().join(f), dir.join(f)).unwrap();
    }
    let m = load(Arch::Sccello, &dir, candle_core::Device::Cpu).unwrap();
    assert!(m.weights_path.ends_with("pytorch_model.bin"));
    check(Arch::Sccello, &dir, &fx(), 24);
}

#[test]
fn sccello_checkpoint_holds_upstream_names() {
    // the fixture's keys are the class's own, legacy embedding rows included
    let keys: Vec<String> = reference(&fx())["checkpoint_keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()).collect();
    for k in ["bert.embeddings.tf_class_embeddings.weight", "bert.embeddings.expbin_embeddings.weight", "cell_cls.predictions.dense_1.weight", "learned_centroid.weight"] {
        assert!(keys.iter().any(|x| x == k), "{k}");
    }
    assert!(!keys.iter().any(|k| k.contains("token_type")));
}

#[test]
fn sccello_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    std::fs::copy(cells_h5ad(), ctx.path("cells.h5ad")).unwrap();
    let r = ctx.run(&["embed", "-m", "sccello", "-d", "cells.h5ad", "--model-dir", fx().to_str().unwrap(), "--batch-size", "8"]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["embed", "-m", "sccello", "-d", "cells.h5ad", "--model-dir", fx().to_str().unwrap(), "--batch-size", "1"], &[], "X_sccello", 2, 0);
    // the file has var['ensembl_id'], not scCello's var['ensembl_ids']: found, said, and used
    assert!(r.stderr.contains("var['ensembl_id'] (Ensembl ids)"), "{}", r.stderr);
    assert!(r.stderr.contains("were truncated"), "{}", r.stderr);
    let (got, dim) = read_obsm(&ctx.path("cells.sccello.h5ad"), "X_sccello");
    assert_eq!(dim, 32);
    let err = max_rel(&got, &matrix(&reference(&fx())["embeddings"]), dim);
    assert!(err < MAX_REL, "{err}");
    // symbols (var_names) are mapped to Ensembl ids
    let r = ctx.run(&["embed", "-m", "sccello", "-d", "cells.h5ad", "-o", "x.h5ad", "--model-dir", fx().to_str().unwrap(), "--gene-column", "index"]);
    r.success();
    assert!(r.stderr.contains("var_names (gene symbols, 700 mapped to Ensembl ids"), "{}", r.stderr);
}

#[test]
fn sccello_bad_checkpoints_name_the_file_and_key() {
    let ctx = TestContext::new();
    std::fs::copy(cells_h5ad(), ctx.path("cells.h5ad")).unwrap();
    // a Geneformer checkpoint has no legacy rows: not a scCello checkpoint
    let gf = repo().join("tests/fixtures/geneformer/v1");
    let r = ctx.run(&["embed", "-m", "sccello", "-d", "cells.h5ad", "--model-dir", gf.to_str().unwrap()]);
    r.failed().stderr_has("model.safetensors").stderr_has("bert.embeddings.tf_class_embeddings.weight");
    // no weights file at all
    let dir = ctx.path("empty");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "token_dictionary.pkl", "gene_median_dictionary.pkl"] {
        std::fs::copy(fx().join(f), dir.join(f)).unwrap();
    }
    let r = ctx.run(&["embed", "-m", "sccello", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap()]);
    r.failed().stderr_has("no model.safetensors or pytorch_model.bin").stderr_has("katarinayuan/scCello-zeroshot");
    // a token dictionary larger than the vocabulary: <cls> would fall outside it
    let e = scfoundry::methods::sccello::check_vocab(
        &serde_json::from_str(&std::fs::read_to_string(fx().join("config.json")).unwrap()).unwrap(),
        &scfoundry::methods::geneformer::Dictionaries::find(&fx()).unwrap(),
        10_000,
        &fx().join("config.json"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("vocab_size is 603") && e.contains("config.json"), "{e}");
    // without pinned weights the run stops before it starts, naming the entries
    let r = ctx.run(&["embed", "-m", "sccello", "-d", "cells.h5ad", "--weights-dir", ctx.path("w").to_str().unwrap()]);
    r.user_error().stderr_has("sccello-zeroshot-model");
}

#[test]
fn sccello_cell_without_genes_is_cls_alone() {
    let model = load(Arch::Sccello, &fx(), candle_core::Device::Cpu).unwrap();
    let ids = vec!["ENSG_NOT_THERE".to_string(), "".to_string()];
    let table = model.gene_table(&ids).unwrap();
    assert_eq!(table.n_genes(), 0);
    let (t, cut) = model.cell_tokens(&table, &[0, 1], &[3.0, 4.0]);
    assert_eq!(t, vec![model.cls]);
    assert!(!cut);
    let rows = model.embed(&[t], 1, |_| {}).unwrap();
    assert!(rows.iter().all(|v| v.is_finite()));
}
