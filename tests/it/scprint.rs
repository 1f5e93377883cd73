//! scprint against upstream scPRINT's code (committed fixture tests/fixtures/scprint/, made by
//! scripts/scprint_reference.py with scprint 2.3.8's scPrint and Embedder, simpler-flash and
//! scdataloader's Collator under torch; CI never installs torch): a small Lightning checkpoint
//! (120 Ensembl-id genes, d_model 32, 2 layers, 4 heads over 2 kv heads, six classes), the 50
//! demo cells with Ensembl ids as var_names, and for three (max_len, seed) runs the tokens the
//! Collator gave the model (gene ids, counts, depth) and the embeddings Embedder wrote to
//! obsm['scprint_emb']. Tokens must be identical (numpy's RandomState reproduced), embeddings
//! within 1e-4 relative error at any batch size; also bad checkpoints and the embed command end
//! to end.

use std::path::PathBuf;

use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::scprint::{self, read_checkpoint, tokenize, CellTokens, GeneAlignment, Normalization, RandomState, ScPrint};

use crate::common::{TestContext, Tiny, assert_embed_needs_weights, max_rel_err, repo};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/scprint")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn want_tokens(run: &Value) -> Vec<CellTokens> {
    run["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let genes: Vec<u32> = t["genes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let counts: Vec<f32> = t["counts"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
            let expressed = counts.iter().filter(|&&c| c > 0.0).count();
            CellTokens { genes, counts, depth: t["depth"].as_f64().unwrap() as f32, expressed }
        })
        .collect()
}

#[test]
fn scprint_tokens_match_upstream_collator() {
    crate::common::no_hdf5_locking();
    let f = fixture();
    let genes: Vec<String> = f["genes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let align = GeneAlignment::new(&genes, 1, &ad.var_names);
    assert_eq!(align.present, genes.len() - f["genes_absent_from_data"].as_array().unwrap().len());
    let x = ad.matrix(None).unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    let (mut sampled, mut filled) = (0, 0);
    for run in f["runs"].as_array().unwrap() {
        let (max_len, seed) = (run["max_len"].as_u64().unwrap() as usize, run["seed"].as_u64().unwrap() as u32);
        let want = want_tokens(run);
        let mut rng = RandomState::new(seed);
        for i in 0..ad.n_obs {
            let (idx, vals) = b.row(i);
            let c = tokenize(idx, vals, &align, max_len, &mut rng).unwrap();
            assert_eq!(c.genes, want[i].genes, "max_len {max_len} seed {seed} cell {i}: gene ids differ from the Collator's");
            assert_eq!(c.counts, want[i].counts, "max_len {max_len} seed {seed} cell {i}: counts differ");
            assert_eq!(c.depth, want[i].depth, "max_len {max_len} seed {seed} cell {i}: depth differs");
            sampled += (c.expressed > max_len) as usize;
            filled += (c.expressed < max_len) as usize;
        }
    }
    // both random paths of the Collator were taken
    assert!(sampled > 5 && filled > 5, "sampled {sampled}, filled {filled}");
}

#[test]
fn scprint_checkpoint_reads_lightning_format() {
    let (cfg, tensors) = read_checkpoint(&dir().join("tiny.ckpt")).unwrap();
    let f = fixture();
    let c = &f["config"];
    assert_eq!(cfg.d_model as u64, c["d_model"].as_u64().unwrap());
    assert_eq!(cfg.nhead as u64, c["nhead"].as_u64().unwrap());
    assert_eq!(cfg.num_heads_kv as u64, c["num_heads_kv"].as_u64().unwrap());
    assert_eq!(cfg.nlayers as u64, c["nlayers"].as_u64().unwrap());
    assert_eq!(cfg.normalization, Normalization::Log);
    let classes: Vec<&str> = f["classes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(cfg.classes, classes);
    let genes: Vec<&str> = f["genes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(cfg.genes, genes);
    assert_eq!(tensors["gene_encoder.embeddings.weight"].dims(), &[genes.len(), cfg.d_model]);
    assert_eq!(tensors["pos_encoder.pe"].dims(), &[genes.len(), cfg.d_model]);
    assert!(!tensors.keys().any(|k| k.starts_with("expr_decoder") || k.starts_with("cls_decoders")), "the decoders are not read");
    // Embedder's four classes, not the first four
    let pred = cfg.pred_tokens().unwrap();
    let want: Vec<usize> = f["pred_embedding"].as_array().unwrap().iter().map(|n| classes.iter().position(|c| c == &n.as_str().unwrap()).unwrap() + 2).collect();
    assert_eq!(pred, want);
    assert_ne!(pred, vec![2, 3, 4, 5]);
}

#[test]
fn scprint_embeddings_match_upstream_at_any_batch_size() {
    let f = fixture();
    let model = ScPrint::load(&dir().join("tiny.ckpt")).unwrap();
    let dim = model.dim();
    assert_eq!(dim, 32);
    for run in f["runs"].as_array().unwrap() {
        let cells = want_tokens(run);
        let refs: Vec<&CellTokens> = cells.iter().collect();
        let mut first: Option<Vec<f32>> = None;
        for size in [1, 16, 50] {
            let mut rows = Vec::new();
            for batch in refs.chunks(size) {
                rows.extend(model.embed(batch).unwrap());
            }
            let err = max_rel_err(&rows, &run["embeddings"], dim);
            eprintln!("scprint max_len {} seed {}, float32, batch {size}: largest relative error {err:.3e} over {} cells", run["max_len"], run["seed"], refs.len());
            assert!(err < MAX_REL_ERR, "batch {size}: largest relative error {err:.3e}");
            if let Some(one) = &first {
                let d = rows.iter().zip(one).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(d < 1e-5, "batch {size} vs 1: {d}");
            } else {
                first = Some(rows);
            }
        }
    }
}

#[test]
fn scprint_bad_checkpoints() {
    let ctx = TestContext::new();
    let e = ScPrint::load(&ctx.path("medium-v1.5.ckpt")).err().unwrap();
    assert!(e.to_string().contains("medium-v1.5.ckpt"), "{e}");
    std::fs::write(ctx.path("junk.ckpt"), b"not a zip").unwrap();
    let e = ScPrint::load(&ctx.path("junk.ckpt")).err().unwrap();
    assert!(e.to_string().contains("junk.ckpt") && e.to_string().contains("torch.save"), "{e}");
    // a plain state_dict, not a Lightning checkpoint
    let e = ScPrint::load(&repo().join("tests/fixtures/uce/tiny.torch")).err().unwrap();
    assert!(e.to_string().contains("tiny.torch") && e.to_string().contains("hyper_parameters"), "{e}");
}

#[test]
fn scprint_embed_needs_its_weights() {
    assert_embed_needs_weights("scprint", "scprint-medium-v1.5");
}

/// A weights folder with the tiny checkpoint where weights.toml puts scPRINT's, and the
/// fixture's cells as `cells.h5ad`; the fixture alongside.
fn weights_and_cells(ctx: &TestContext) -> (PathBuf, Value) {
    let w = ctx.path("weights");
    let ckpt = scprint::checkpoint_file(&w, &scfoundry::weights::Manifest::builtin());
    std::fs::create_dir_all(ckpt.parent().unwrap()).unwrap();
    std::fs::copy(dir().join("tiny.ckpt"), &ckpt).unwrap();
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    (w, f)
}

#[test]
fn scprint_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let (w, f) = weights_and_cells(&ctx);
    let run = &f["runs"][1];
    let (max_len, seed) = (run["max_len"].to_string(), run["seed"].to_string());
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scprint", "-d", "cells.h5ad", "--max-len", &max_len, "--seed", &seed, "--batch-size", "7"]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scprint", "-d", "cells.h5ad", "--max-len", &max_len, "--seed", &seed, "--batch-size", "7"], &[], "X_scprint", 3, 0);
    assert!(r.stderr.contains("100 of the model's 120 genes are in the data"), "{}", r.stderr);
    let out = ctx.path("cells.scprint.h5ad");
    let h = hdf5::File::open(&out).unwrap();
    let ds = h.dataset("obsm/X_scprint").unwrap();
    let dim = ds.shape()[1];
    let got = ds.read_raw::<f32>().unwrap();
    assert_eq!((got.len() / dim, dim), (50, 32));
    let err = max_rel_err(&got, &run["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    let p = |k: &str| -> i64 { h.dataset(&format!("uns/scfoundry/parameters/{k}")).unwrap().read_scalar().unwrap() };
    assert_eq!(p("max_len"), 73);
    assert_eq!(p("batch_size"), 7);
    // --max-len past the model's genes: all of them, said so
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scprint", "-d", "cells.h5ad", "--max-len", "500", "-o", "all.h5ad"]);
    r.success().stderr_has("more than the model's 120 genes");
    // symbols in var_names: a clear error
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scprint", "-d", "t.h5ad"]);
    r.user_error().stderr_has("var_names").stderr_has("Ensembl").has_hint();
    assert!(!ctx.path("t.scprint.h5ad").exists());
}

/// `--model-dir` with the checkpoint as a Hugging Face cache entry of jkobject/scPRINT
/// (`models--jkobject--scPRINT`: refs/main naming its snapshot, medium-v1.5.ckpt linked from
/// blobs/) and no weights folder: the weights folder's embedding bit for bit, with the snapshot
/// and the checkpoint's sha256 in the provenance; a snapshot without the checkpoint is refused
/// before the run, naming the folder and the file.
#[test]
fn scprint_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    let (w, f) = weights_and_cells(&ctx);
    let run = &f["runs"][1];
    let (max_len, seed) = (run["max_len"].to_string(), run["seed"].to_string());
    let args = ["embed", "-m", "scprint", "-d", "cells.h5ad", "--max-len", max_len.as_str(), "--seed", seed.as_str(), "--batch-size", "7"];
    ctx.run(&[&["--weights-dir", w.to_str().unwrap()][..], &args[..], &["-o", "w.h5ad"]].concat()).success();
    let rev = "0c1d6e8a2b9f4e37a5d0c8b61f2e9a7d3b4c5e6f";
    let entry = crate::common::hf_cache_entry(&ctx.path("hub"), "models--jkobject--scPRINT", rev, &[(dir().join("tiny.ckpt"), "medium-v1.5.ckpt")]);
    let snapshot = entry.join("snapshots").join(rev);
    let r = ctx.run(&[&args[..], &["-o", "m.h5ad", "--model-dir", entry.to_str().unwrap()]].concat());
    r.success();
    assert!(r.stderr.contains("100 of the model's 120 genes are in the data"), "{}", r.stderr);
    crate::common::assert_model_dir_run(&ctx.path("m.h5ad"), &ctx.path("w.h5ad"), "X_scprint", &snapshot, &[("scprint-medium-v1.5", dir().join("tiny.ckpt"))]);
    let (got, dim) = crate::common::read_obsm(&ctx.path("m.h5ad"), "X_scprint");
    let err = max_rel_err(&got, &run["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    std::fs::remove_file(snapshot.join("medium-v1.5.ckpt")).unwrap();
    crate::common::assert_model_dir_lacks(&ctx, &[&args[..], &["-o", "x.h5ad", "--model-dir", entry.to_str().unwrap()]].concat(), "scprint", &snapshot, "medium-v1.5.ckpt", "x.h5ad");
}
