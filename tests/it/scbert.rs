//! scbert against upstream scBERT's own performer_pytorch (committed fixture tests/fixtures/scbert/,
//! made by scripts/scbert_reference.py with torch; CI never installs torch): a small PerformerLM
//! checkpoint in upstream's format (a torch.save dict with `model_state_dict`), a reference gene
//! h5ad in place of panglao_10000.h5ad, demo cells, and the tokens and cell embeddings that
//! upstream's preprocess.py / predict.py path gives. Tokens must be identical, embeddings within
//! 1e-4 relative error. Also: the embed command end to end, and bad weights.

use std::path::PathBuf;

use candle_core::Device;
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::scbert::{self, GeneAlign, ScBert};

use crate::common::{max_rel_err, repo, TestContext, Tiny};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/scbert")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Our tokens of the fixture's cells and the gene alignment.
fn ours(f: &Value) -> (GeneAlign, Vec<Vec<u32>>) {
    crate::common::no_hdf5_locking();
    let reference = AnnData::open(&dir().join("scbert/panglao_10000.h5ad")).unwrap().var_names;
    let want_ref: Vec<String> = f["reference_genes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    assert_eq!(reference, want_ref, "the reference h5ad's var_names are the gene order");
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let align = GeneAlign::new(&reference, &ad.var_names);
    let x = ad.matrix(None).unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    let cells = (0..ad.n_obs)
        .map(|i| {
            let (idx, vals) = b.row(i);
            scbert::tokens(idx, vals, &align).unwrap().0
        })
        .collect();
    (align, cells)
}

#[test]
fn scbert_tokens_match_upstream() {
    let f = fixture();
    let (align, cells) = ours(&f);
    assert_eq!(align.matched as u64, f["genes_matched"].as_u64().unwrap());
    assert!(align.matched < align.n_genes, "some reference genes are absent from the data");
    let want = f["tokens"].as_array().unwrap();
    assert_eq!(cells.len(), want.len());
    for (i, (c, w)) in cells.iter().zip(want).enumerate() {
        assert_eq!(c, &u32s(w), "cell {i}: tokens differ from upstream's");
    }
    // every bin occurs, and the appended token is 0
    let seen: std::collections::BTreeSet<u32> = cells.iter().flatten().copied().collect();
    assert_eq!(seen, (0..=5).collect());
    assert!(cells.iter().all(|c| *c.last().unwrap() == 0));
}

#[test]
fn scbert_embeddings_match_upstream_at_any_batch_size() {
    let f = fixture();
    let (_, cells) = ours(&f);
    let model = ScBert::load_on(&dir().join("scbert/panglao_pretrained.pth"), candle_core::DType::F32, Device::Cpu).unwrap();
    let c = &f["config"];
    let d = model.dims;
    assert_eq!(
        (d.dim, d.depth, d.heads, d.dim_head, d.nb_features, d.seq_len, d.num_tokens),
        (
            c["dim"].as_u64().unwrap() as usize,
            c["depth"].as_u64().unwrap() as usize,
            c["heads"].as_u64().unwrap() as usize,
            c["dim_head"].as_u64().unwrap() as usize,
            c["nb_features"].as_u64().unwrap() as usize,
            c["seq_len"].as_u64().unwrap() as usize,
            c["num_tokens"].as_u64().unwrap() as usize
        )
    );
    let dim = model.dim();
    let refs: Vec<&[u32]> = cells.iter().map(|s| s.as_slice()).collect();
    let mut rows = Vec::new();
    for batch in refs.chunks(7) {
        rows.extend(model.embed(batch).unwrap());
    }
    let err = max_rel_err(&rows, &f["cell_embedding_mean"], dim);
    eprintln!("scbert float32: largest relative error {err:.3e} over {} cells", refs.len());
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    // a cell alone gives its row in the batch of 7 (the keys' stabiliser is per cell)
    let alone = model.embed(&refs[3..4]).unwrap();
    let diff: f32 = alone.iter().zip(&rows[3 * dim..4 * dim]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(diff < 1e-5, "{diff}");
    // upstream's batches of 3 differ from cells alone: the fixture says by how much
    assert!(f["batch_of_3_max_rel_diff"].as_f64().unwrap() > 1e-4);
    // a cell of the wrong length is refused
    let e = model.embed(&[&refs[0][1..]]).unwrap_err();
    assert!(e.to_string().contains("positions"), "{e}");
}

#[test]
fn scbert_bad_checkpoints() {
    let ctx = TestContext::new();
    let e = ScBert::load_on(&ctx.path("panglao_pretrained.pth"), candle_core::DType::F32, Device::Cpu).err().unwrap();
    assert!(e.to_string().contains("panglao_pretrained.pth"), "{e}");
    std::fs::write(ctx.path("junk.pth"), b"not a zip").unwrap();
    let e = ScBert::load_on(&ctx.path("junk.pth"), candle_core::DType::F32, Device::Cpu).err().unwrap();
    assert!(e.to_string().contains("junk.pth"), "{e}");
    // another model's state_dict: the missing key is named
    let e = ScBert::load_on(&repo().join("tests/fixtures/uce/tiny.torch"), candle_core::DType::F32, Device::Cpu).err().unwrap();
    assert!(e.to_string().contains("token_emb.weight"), "{e}");
}

fn weights_with(ctx: &TestContext) -> PathBuf {
    let w = ctx.path("weights");
    std::fs::create_dir_all(w.join("scbert")).unwrap();
    for file in ["panglao_pretrained.pth", "panglao_10000.h5ad"] {
        std::fs::copy(dir().join("scbert").join(file), w.join("scbert").join(file)).unwrap();
    }
    w
}

#[test]
fn scbert_embed_needs_its_weights() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "--method", "scbert", "--data", "t.h5ad"]);
    r.user_error().stderr_has("weights for scbert are not in").stderr_has("scbert-panglao-pretrained").has_hint();
    assert!(!ctx.path("t.scbert.h5ad").exists());
}

#[test]
fn scbert_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    // the fixture's 300 reference genes hold 34% of the data's counts: below --min-gene-match's default
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scbert", "--min-gene-match", "0", "-d", "cells.h5ad", "--batch-size", "4"]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scbert", "--min-gene-match", "0", "-d", "cells.h5ad", "--batch-size", "4"], &[], "X_scbert", 2, 0);
    // the genes and the cells upstream's preprocess.py would drop are reported
    assert!(r.stderr.contains("260 of the 300 reference genes"), "{}", r.stderr);
    assert!(r.stderr.contains("fewer than 200"), "{}", r.stderr);
    let h = hdf5::File::open(ctx.path("cells.scbert.h5ad")).unwrap();
    let ds = h.dataset("obsm/X_scbert").unwrap();
    let dim = ds.shape()[1];
    let got = ds.read_raw::<f32>().unwrap();
    assert_eq!((got.len() / dim, dim), (60, 32));
    let err = max_rel_err(&got, &f["cell_embedding_mean"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    let p = |k: &str| -> i64 { h.dataset(&format!("uns/scfoundry/parameters/{k}")).unwrap().read_scalar().unwrap() };
    assert_eq!(p("batch_size"), 4);
    assert_eq!(p("genes_matched"), 260);
}

#[test]
fn scbert_embed_refuses_a_mismatched_gene_list() {
    // a reference gene list whose length is not the checkpoint's gene2vec rows - 1
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    Tiny::counts(10, 8).write(&w.join("scbert/panglao_10000.h5ad"));
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scbert", "-d", "t.h5ad"]);
    r.failed().stderr_has("panglao_10000.h5ad").stderr_has("301");
    assert!(!ctx.path("t.scbert.h5ad").exists());
}

/// `--model-dir` with a folder as the README's Checkpoint and Data links leave it
/// (panglao_pretrained.pth, panglao_10000.h5ad) and no weights folder: the weights folder's
/// embedding bit for bit, with the folder and the files' sha256 in the provenance; a folder
/// without the reference is refused before the run, naming the folder and the file.
#[test]
fn scbert_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    let args = ["embed", "-m", "scbert", "--min-gene-match", "0", "-d", "cells.h5ad", "--batch-size", "4"];
    ctx.run(&[&["--weights-dir", w.to_str().unwrap()][..], &args[..], &["-o", "w.h5ad"]].concat()).success();
    let files = ["panglao_pretrained.pth", "panglao_10000.h5ad"].map(|n| (dir().join("scbert").join(n), n));
    let m = crate::common::model_folder(&ctx.path("scbert-release"), &files);
    let r = ctx.run(&[&args[..], &["-o", "m.h5ad", "--model-dir", m.to_str().unwrap()]].concat());
    r.success();
    assert!(r.stderr.contains("260 of the 300 reference genes"), "{}", r.stderr);
    let shas = [("scbert-panglao-pretrained", files[0].0.clone()), ("scbert-panglao-reference", files[1].0.clone())];
    crate::common::assert_model_dir_run(&ctx.path("m.h5ad"), &ctx.path("w.h5ad"), "X_scbert", &m, &shas);
    let (got, dim) = crate::common::read_obsm(&ctx.path("m.h5ad"), "X_scbert");
    let err = max_rel_err(&got, &f["cell_embedding_mean"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    std::fs::remove_file(m.join("panglao_10000.h5ad")).unwrap();
    crate::common::assert_model_dir_lacks(&ctx, &[&args[..], &["-o", "x.h5ad", "--model-dir", m.to_str().unwrap()]].concat(), "scbert", &m, "panglao_10000.h5ad", "x.h5ad");
}
