//! scimilarity against upstream's own code (committed fixture tests/fixtures/scimilarity/, made
//! by scripts/scimilarity_reference.py with the scimilarity 0.4.1 package and torch; CI never
//! installs either): a small model folder in upstream's format (encoder.ckpt saved by
//! Encoder.save_state, layer_sizes.json, gene_order.tsv, label_ints.csv), the gene alignment,
//! the log-normalised values and the embeddings that CellEmbedding gives for the demo cells.
//! Embeddings must be within 1e-4 relative error; the command end to end; bad model folders.

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::scimilarity::{read_gene_order, read_layer_sizes, Alignment, Encoder};

use crate::common::{TestContext, Tiny, max_rel_err, read_obsm, repo};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/scimilarity")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

/// The fixture's cells aligned and log-normalised by our code: (alignment, dense rows).
fn ours(f: &Value, order: &[String]) -> (Alignment, Vec<f32>, usize) {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let a = Alignment::new(&ad.var_names, order);
    let x = ad.matrix(None).unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    let mut rows = vec![0f32; ad.n_obs * order.len()];
    for i in 0..ad.n_obs {
        let (idx, vals) = b.row(i);
        a.lognorm_row(idx, vals, &mut rows[i * order.len()..(i + 1) * order.len()]).unwrap();
    }
    (a, rows, ad.n_obs)
}

#[test]
fn scimilarity_alignment_and_lognorm_match_upstream() {
    let f = fixture();
    let order = read_gene_order(&dir().join("tiny/gene_order.tsv")).unwrap();
    let aligned: Vec<String> = f["aligned_var_names"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    assert_eq!(order, aligned, "align_dataset puts the columns in gene_order.tsv's order");
    let (a, rows, _) = ours(&f, &order);
    let g = &f["genes"];
    assert_eq!(a.matched as u64, g["in_data"].as_u64().unwrap());
    assert_eq!(a.missing as u64, g["missing"].as_u64().unwrap());
    assert!(a.missing > 0 && a.column.iter().any(Option::is_none), "the fixture has both kinds of unmatched genes");
    let n = order.len();
    for (i, want) in f["lognorm_first_cells"].as_array().unwrap().iter().enumerate() {
        for (j, w) in want.as_array().unwrap().iter().enumerate() {
            let (got, w) = (rows[i * n + j] as f64, w.as_f64().unwrap());
            assert!((got - w).abs() <= 1e-5 * w.abs().max(1.0), "cell {i} gene {} ({j}): {got} vs upstream {w}", order[j]);
        }
    }
}

#[test]
fn scimilarity_embeddings_match_upstream_at_any_batch_size() {
    let f = fixture();
    let (enc, order) = Encoder::load(&dir().join("tiny"), Device::Cpu).unwrap();
    let c = &f["config"];
    assert_eq!(enc.n_genes as u64, c["n_genes"].as_u64().unwrap());
    assert_eq!(enc.latent as u64, c["latent_dim"].as_u64().unwrap());
    assert_eq!(enc.hidden.iter().map(|&h| h as u64).collect::<Vec<_>>(), c["hidden_dim"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect::<Vec<_>>());
    let (_, rows, n_obs) = ours(&f, &order);
    let dim = enc.latent;
    let all = enc.embed_rows(&rows, n_obs).unwrap();
    let err = max_rel_err(&all, &f["embeddings"], dim);
    eprintln!("scimilarity float32: largest relative error {err:.3e} over {n_obs} cells");
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    // rows are unit vectors (Encoder.forward's F.normalize)
    for r in all.chunks(dim) {
        let norm: f32 = r.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    }
    // batches of 7: the same rows (BatchNorm uses its running statistics)
    let mut batched = Vec::new();
    for chunk in rows.chunks(7 * enc.n_genes) {
        batched.extend(enc.embed_rows(chunk, chunk.len() / enc.n_genes).unwrap());
    }
    let d = batched.iter().zip(&all).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d < 1e-6, "{d}");
}

/// A copy of the fixture model folder with `edit` applied.
fn model_copy(ctx: &TestContext, name: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let d = ctx.path(name);
    std::fs::create_dir_all(&d).unwrap();
    for f in ["encoder.ckpt", "gene_order.tsv", "layer_sizes.json", "label_ints.csv"] {
        std::fs::copy(dir().join("tiny").join(f), d.join(f)).unwrap();
    }
    edit(&d);
    d
}


fn read_i64(path: &Path, name: &str) -> i64 {
    hdf5::File::open(path).unwrap().dataset(name).unwrap().read_scalar().unwrap()
}

#[test]
fn scimilarity_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("pbmc.h5ad")).unwrap();
    // the pinned layout: the archive (unpinned, so any bytes) with model_v1.1/ extracted beside it
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    let model = scfoundry::methods::scimilarity::model_dir(&w, &man);
    std::fs::create_dir_all(model.parent().unwrap()).unwrap();
    std::fs::write(w.join(&man.weights[scfoundry::methods::scimilarity::ARCHIVE_ENTRY].file), b"stands for the tar.gz").unwrap();
    std::fs::rename(model_copy(&ctx, "m", |_| {}), &model).unwrap();
    // the fixture model knows 240 of the data's 765 genes (29% of the counts): below --min-gene-match's default
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scimilarity", "--min-gene-match", "0", "-d", "pbmc.h5ad", "--batch-size", "16"]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scimilarity", "--min-gene-match", "0", "-d", "pbmc.h5ad", "--batch-size", "4"], &[], "X_scimilarity", 3, 0);
    r.stderr_has("240 of the model's 300 genes are in the data; 60 are not and were zero-filled");
    r.stderr_has("upstream's align_dataset refuses data with fewer than 5000");
    let out = ctx.path("pbmc.scimilarity.h5ad");
    let (got, dim) = read_obsm(&out, "X_scimilarity");
    assert_eq!((got.len() / dim, dim), (50, 16));
    let err = max_rel_err(&got, &f["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/genes_missing_zero_filled"), 60);
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/genes_matched"), 240);
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/batch_size"), 16);
    // --model-dir, and the default batch of 2048
    let d = model_copy(&ctx, "other", |_| {});
    let r = ctx.run(&["embed", "-m", "scimilarity", "--min-gene-match", "0", "-d", "pbmc.h5ad", "-o", "b.h5ad", "--model-dir", d.to_str().unwrap()]);
    r.success();
    // the same rows up to float32 rounding (the matmul blocks differ with the batch's size)
    let (got2, _) = read_obsm(&ctx.path("b.h5ad"), "X_scimilarity");
    let d = got.iter().zip(&got2).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d < 1e-6, "{d}");
    assert_eq!(read_i64(&ctx.path("b.h5ad"), "uns/scfoundry/parameters/batch_size"), 2048);
}

#[test]
fn scimilarity_bad_model_folders_and_data() {
    let ctx = TestContext::new();
    std::fs::copy(repo().join("tests/fixtures/geneformer/pbmc68k_50.h5ad"), ctx.path("pbmc.h5ad")).unwrap();
    let err = |d: &Path| {
        let r = ctx.run(&["embed", "-m", "scimilarity", "-d", "pbmc.h5ad", "-o", "x.h5ad", "--model-dir", d.to_str().unwrap()]);
        r.user_error();
        assert!(!ctx.path("x.h5ad").exists());
        r.stderr
    };
    // no weights at all: the hint says how to get them
    let r = ctx.run(&["embed", "-m", "scimilarity", "-d", "pbmc.h5ad"]);
    r.user_error().stderr_has("weights for scimilarity are not in").stderr_has("scimilarity-model-v1.1").has_hint();
    // a missing checkpoint
    let d = model_copy(&ctx, "nockpt", |d| std::fs::remove_file(d.join("encoder.ckpt")).unwrap());
    assert!(err(&d).contains("encoder.ckpt"), "{}", err(&d));
    // not a torch file
    let d = model_copy(&ctx, "junk", |d| std::fs::write(d.join("encoder.ckpt"), b"not a zip").unwrap());
    let e = err(&d);
    assert!(e.contains("encoder.ckpt") && e.contains("not a PyTorch checkpoint"), "{e}");
    // another model's checkpoint: the missing key is named
    let d = model_copy(&ctx, "wrong", |d| std::fs::copy(repo().join("tests/fixtures/scgpt/best_model_inproj.pt"), d.join("encoder.ckpt")).map(drop).unwrap());
    let e = err(&d);
    assert!(e.contains("network.0.1.weight"), "{e}");
    // a gene order that does not fit the checkpoint
    let d = model_copy(&ctx, "order", |d| std::fs::write(d.join("gene_order.tsv"), "CD3E\nCD4\n").unwrap());
    let e = err(&d);
    assert!(e.contains("network.0.1.weight") && e.contains("[32, 2]"), "{e}");
    // layer sizes that are not JSON
    let d = model_copy(&ctx, "sizes", |d| std::fs::write(d.join("layer_sizes.json"), "[").unwrap());
    assert!(err(&d).contains("layer_sizes.json"), "{}", err(&d));
    assert!(read_layer_sizes(&d.join("layer_sizes.json")).is_err());
    // data whose genes the model does not know
    let model = model_copy(&ctx, "ok", |_| {});
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "-m", "scimilarity", "-d", "t.h5ad", "--model-dir", model.to_str().unwrap()]);
    r.user_error().stderr_has("var_names").stderr_has("gene symbols").has_hint();
}
