//! c2s against upstream Cell2Sentence's own code (committed fixture tests/fixtures/c2s/, made by
//! scripts/c2s_reference.py with torch + transformers; CI never installs them): a tiny GPT-NeoX
//! checkpoint saved by transformers (config.json with Pythia's transformers-4 keys,
//! model.safetensors), a byte-level BPE tokenizer.json, and for the first 24 demo cells the cell
//! sentences, prompts, token ids and embeddings upstream gives (seed 42, top 100 genes, each
//! cell alone). Sentences, prompts and tokens must be identical, embeddings within 1e-4 relative
//! error; a cell's embedding must not depend on its batch; the embed command end to end; bad
//! weights give clear errors.

use std::path::PathBuf;

use candle_core::{DType, Device};
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::c2s::{C2sTokenizer, GptNeoX, Prompter};

use crate::common::{max_rel_err, repo, TestContext, Tiny};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/c2s")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect()
}

/// Our sentences and prompts of the fixture's cells, in data order.
fn ours(f: &Value) -> (Vec<String>, Vec<String>) {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let x = ad.matrix(None).unwrap();
    let n = f["n_cells"].as_u64().unwrap() as usize;
    let b = x.read_rows(0, n).unwrap();
    let mut pr = Prompter::new(&ad.var_names, f["top_genes"].as_u64().unwrap() as usize, f["seed"].as_u64().unwrap()).unwrap();
    let organism = f["organism"].as_str().unwrap();
    let mut sentences = Vec::new();
    let mut prompts = Vec::new();
    for i in 0..n {
        let (idx, vals) = b.row(i);
        let s = pr.sentence(idx, vals);
        prompts.push(pr.prompt(&s, organism));
        sentences.push(s);
    }
    (sentences, prompts)
}

fn token_ids(f: &Value) -> Vec<Vec<u32>> {
    f["token_ids"].as_array().unwrap().iter().map(|s| s.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()).collect()
}

#[test]
fn c2s_sentences_prompts_and_tokens_match_upstream() {
    let f = fixture();
    let (sentences, prompts) = ours(&f);
    let want = strings(&f["sentences"]);
    for (i, (a, b)) in sentences.iter().zip(&want).enumerate() {
        assert_eq!(a, b, "cell {i}: sentence (ranked, upper-cased genes; ties by numpy's shuffle)");
    }
    assert_eq!(sentences.len(), want.len());
    let want = strings(&f["prompts"]);
    for (i, (a, b)) in prompts.iter().zip(&want).enumerate() {
        assert_eq!(a, b, "cell {i}: prompt (template by Python's random, first 100 genes)");
    }
    // the templates are not all the same one: the choice really is exercised
    let firsts: std::collections::BTreeSet<&str> = prompts.iter().map(|p| p.split(' ').next().unwrap()).collect();
    assert!(firsts.len() > 3, "{firsts:?}");
    let tok = C2sTokenizer::load(&dir().join("tokenizer.json")).unwrap();
    for (i, (p, want)) in prompts.iter().zip(token_ids(&f)).enumerate() {
        assert_eq!(tok.encode(p).unwrap(), want, "cell {i}: token ids");
    }
    // another seed changes ties and templates
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let b = ad.matrix(None).unwrap().read_rows(0, 1).unwrap();
    let mut pr = Prompter::new(&ad.var_names, 100, 7).unwrap();
    let s = pr.sentence(b.row(0).0, b.row(0).1);
    assert_ne!(s, sentences[0]);
}

fn check_model(sub: &str, key: &str) {
    let f = fixture();
    let d = if sub.is_empty() { dir() } else { dir().join(sub) };
    let model = GptNeoX::load(&d.join("config.json"), &d.join("model.safetensors"), DType::F32, Device::Cpu).unwrap();
    let m = &f["models"][key];
    assert_eq!(model.cfg.num_hidden_layers as u64, m["layers"].as_u64().unwrap());
    assert_eq!(model.cfg.use_parallel_residual, m["use_parallel_residual"].as_bool().unwrap());
    assert!(m["hidden_states_last_is_final_layer_norm"].as_bool().unwrap());
    let ids = token_ids(&f);
    let refs: Vec<&[u32]> = ids.iter().map(|s| s.as_slice()).collect();
    let dim = model.hidden();
    let mut rows = Vec::new();
    for batch in refs.chunks(5) {
        rows.extend(model.embed(batch).unwrap());
    }
    let err = max_rel_err(&rows, &m["embeddings"], dim);
    eprintln!("c2s {key} float32: largest relative error {err:.3e} over {} cells", refs.len());
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    // a cell alone and in a batch with longer and shorter cells: the same row
    let shortest = (0..refs.len()).min_by_key(|&i| refs[i].len()).unwrap();
    let alone = model.embed(&refs[shortest..shortest + 1]).unwrap();
    let k = shortest % 5;
    let in_batch = &rows[shortest * dim..(shortest + 1) * dim];
    let d: f32 = alone.iter().zip(in_batch).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(d < 1e-5, "cell {shortest} (position {k} of its batch): {d}");
    // upstream's own left-padded batches of 8 differ from the cells alone: the fixture says how much
    assert!(m["upstream_batched_8_max_rel_diff"].as_f64().unwrap() > 1e-3);
}

#[test]
fn c2s_embeddings_match_upstream_parallel_residual() {
    check_model("", "parallel");
}

#[test]
fn c2s_embeddings_match_upstream_sequential_residual_tied() {
    check_model("sequential", "sequential");
}

#[test]
fn c2s_bad_weights_are_named() {
    let ctx = TestContext::new();
    let cfg = dir().join("config.json");
    // missing weights file
    let e = GptNeoX::load(&cfg, &ctx.path("model.safetensors"), DType::F32, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    // a checkpoint of another model: names the key it looked for
    let e = GptNeoX::load(&cfg, &repo().join("tests/fixtures/scgpt/best_model_inproj.pt"), DType::F32, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("gpt_neox.embed_in.weight") && e.contains("best_model_inproj.pt"), "{e}");
    // a config that does not fit the weights
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["num_hidden_layers"] = 3.into();
    std::fs::write(ctx.path("config.json"), c.to_string()).unwrap();
    let e = GptNeoX::load(&ctx.path("config.json"), &dir().join("model.safetensors"), DType::F32, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("model.safetensors") && e.contains("layers.2"), "{e}");
    // not a GPT-NeoX config
    c["model_type"] = "bert".into();
    std::fs::write(ctx.path("config.json"), c.to_string()).unwrap();
    let e = GptNeoX::load(&ctx.path("config.json"), &dir().join("model.safetensors"), DType::F32, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("config.json") && e.contains("model_type"), "{e}");
    // a broken tokenizer
    std::fs::write(ctx.path("tokenizer.json"), "{}").unwrap();
    let e = C2sTokenizer::load(&ctx.path("tokenizer.json")).err().unwrap().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}

/// A weights folder holding the fixture files where weights.toml puts the C2S model's.
pub(crate) fn weights_with(ctx: &TestContext) -> PathBuf {
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    for (id, file) in [("c2s-pythia-410m-ctp-config", "config.json"), ("c2s-pythia-410m-ctp-model", "model.safetensors"), ("c2s-pythia-410m-ctp-tokenizer", "tokenizer.json")] {
        let to = w.join(&man.weights[id].file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(dir().join(file), &to).unwrap();
    }
    w
}

#[test]
fn c2s_embed_needs_its_weights() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "--method", "c2s", "--data", "t.h5ad"]);
    r.user_error().stderr_has("weights for c2s are not in").stderr_has("c2s-pythia-410m-ctp-model").has_hint();
    assert!(!ctx.path("t.c2s.h5ad").exists());
}

#[test]
fn c2s_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "c2s", "-d", "cells.h5ad", "--seed", "42", "--batch-size", "3"]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "c2s", "-d", "cells.h5ad", "--seed", "42", "--batch-size", "3"], &[], "X_c2s", 3, 0);
    assert!(r.stderr.contains("no `organism` column"), "{}", r.stderr);
    let out = ctx.path("cells.c2s.h5ad");
    let h = hdf5::File::open(&out).unwrap();
    let ds = h.dataset("obsm/X_c2s").unwrap();
    let dim = ds.shape()[1];
    let got = ds.read_raw::<f32>().unwrap();
    assert_eq!((got.len() / dim, dim), (50, 32));
    // the fixture's 24 cells are the file's first 24 (the RNG streams run in data order)
    let n = f["n_cells"].as_u64().unwrap() as usize;
    let err = max_rel_err(&got[..n * dim], &f["models"]["parallel"]["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    let p = |k: &str| -> i64 { h.dataset(&format!("uns/scfoundry/parameters/{k}")).unwrap().read_scalar().unwrap() };
    assert_eq!(p("top_genes"), 100);
    assert_eq!(p("batch_size"), 3);
    assert_eq!(p("layers"), 2);
    // --top-genes 0 is refused with the option named
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "c2s", "-d", "cells.h5ad", "--top-genes", "0", "-o", "x.h5ad"]);
    r.failed().stderr_has("--top-genes");
}

/// `--model-dir` with the model as a Hugging Face cache entry
/// (`models--vandijklab--C2S-Pythia-410m-cell-type-prediction`: refs/main naming its snapshot,
/// the files linked from blobs/) and no weights folder: the weights folder's embedding bit for
/// bit, with the snapshot and the files' sha256 in the provenance; a snapshot without
/// tokenizer.json is refused naming the folder and the file.
#[test]
fn c2s_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    let args = ["embed", "-m", "c2s", "-d", "cells.h5ad", "--seed", "42", "--batch-size", "3"];
    ctx.run(&[&["--weights-dir", w.to_str().unwrap()][..], &args[..], &["-o", "w.h5ad"]].concat()).success();
    let rev = "5a1ac2d04f2e5ae8b7a3de8bfa9b5bcd7d0c7e41";
    let files = ["config.json", "model.safetensors", "tokenizer.json"].map(|n| (dir().join(n), n));
    let entry = crate::common::hf_cache_entry(&ctx.path("hub"), "models--vandijklab--C2S-Pythia-410m-cell-type-prediction", rev, &files);
    let snapshot = entry.join("snapshots").join(rev);
    let r = ctx.run(&[&args[..], &["-o", "m.h5ad", "--model-dir", entry.to_str().unwrap()]].concat());
    r.success();
    assert!(!r.stderr.contains("does not honour"), "{}", r.stderr);
    let ids = ["c2s-pythia-410m-ctp-config", "c2s-pythia-410m-ctp-model", "c2s-pythia-410m-ctp-tokenizer"];
    let shas: Vec<(&str, PathBuf)> = ids.iter().zip(&files).map(|(id, (file, _))| (*id, file.clone())).collect();
    crate::common::assert_model_dir_run(&ctx.path("m.h5ad"), &ctx.path("w.h5ad"), "X_c2s", &snapshot, &shas);
    let (got, dim) = crate::common::read_obsm(&ctx.path("m.h5ad"), "X_c2s");
    let n = f["n_cells"].as_u64().unwrap() as usize;
    let err = max_rel_err(&got[..n * dim], &f["models"]["parallel"]["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    // the snapshot without its tokenizer
    std::fs::remove_file(snapshot.join("tokenizer.json")).unwrap();
    crate::common::assert_model_dir_lacks(&ctx, &[&args[..], &["-o", "x.h5ad", "--model-dir", entry.to_str().unwrap()]].concat(), "c2s", &snapshot, "tokenizer.json", "x.h5ad");
}
