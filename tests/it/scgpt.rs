//! scgpt against upstream scGPT 0.2.4 (committed fixture tests/fixtures/scgpt/, made by
//! scripts/scgpt_reference.py with torch; CI never installs torch): a small checkpoint in the
//! upstream format (best_model.pt with flash-attn key names, vocab.json, args.json) and the
//! token ids, binned values and cell embeddings that upstream's embed_data code path gives for
//! demo cells. Tokens and bins must be identical, embeddings within 1e-4 relative error.
//! Also: numpy's binning and RNG, both checkpoint key namings, the embed command end to end,
//! bad checkpoints and data whose genes are not in the vocabulary, and the real vocabularies
//! shipped in the scgpt wheel (installed without its dependencies in the test venv).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::formats::numpy_rng::Mt19937;
use scfoundry::methods::scgpt::{self, bin_values, match_genes, read_checkpoint, Args, Cell, Model, Vocab};

use crate::common::{TestContext, Tiny, python, read_obsm, repo};

pub(crate) const MAX_REL_ERR: f64 = 1e-4;

pub(crate) fn fixture_dir() -> PathBuf {
    repo().join("tests/fixtures/scgpt")
}

pub(crate) fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("reference.json")).unwrap()).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Our cells for a fixture case: the demo rows tokenized with the fixture's seed.
fn our_cells(model: &Model, case: &Value, seed: u64) -> Vec<Cell> {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&repo().join("demo/pbmc68k_counts.h5ad")).unwrap();
    let names: Vec<Option<String>> = ad.var_names.iter().cloned().map(Some).collect();
    let ids = match_genes(&names, &model.vocab);
    let first = case["first_cell"].as_u64().unwrap() as usize;
    let n = case["n_cells"].as_u64().unwrap() as usize;
    let block = ad.matrix(None).unwrap().read_rows(first, first + n).unwrap();
    (0..n)
        .map(|i| {
            let (idx, vals) = block.row(i);
            model.tokenizer.cell(idx, vals, &ids, seed, first + i)
        })
        .collect()
}

/// Largest per-cell relative L2 error and largest absolute element difference.
pub(crate) fn compare(got: &[f32], want: &Value, dim: usize) -> (f64, f64) {
    let (mut rel, mut abs) = (0f64, 0f64);
    for (i, w) in want.as_array().unwrap().iter().enumerate() {
        let w = f32s(w);
        let g = &got[i * dim..(i + 1) * dim];
        let (mut d2, mut n2) = (0f64, 0f64);
        for (a, b) in g.iter().zip(&w) {
            d2 += ((a - b) as f64).powi(2);
            n2 += (*b as f64).powi(2);
            abs = abs.max((a - b).abs() as f64);
        }
        rel = rel.max((d2 / n2).sqrt());
    }
    (rel, abs)
}

#[test]
fn scgpt_tokens_and_bins_match_upstream() {
    let f = fixture();
    let seed = f["seed"].as_u64().unwrap();
    assert_eq!(f["vocab"]["demo_genes_matched"].as_u64(), Some(680));
    for case in f["cases"].as_array().unwrap() {
        let max_len = case["max_length"].as_u64().unwrap() as usize;
        let model = Model::load(&fixture_dir().join("tiny"), max_len).unwrap();
        assert_eq!(model.vocab.len as u64, f["vocab"]["tokens_with_appended"].as_u64().unwrap());
        assert_eq!(model.vocab.appended, vec!["<eoc>".to_string()]);
        let cells = our_cells(&model, case, seed);
        let want = case["cells"].as_array().unwrap();
        assert_eq!(cells.len(), want.len());
        for (i, (c, w)) in cells.iter().zip(want).enumerate() {
            assert_eq!(c.genes, u32s(&w["genes"]), "case max_len {max_len}, cell {i}: token ids");
            assert_eq!(c.values, f32s(&w["values"]), "case max_len {max_len}, cell {i}: binned values");
            assert_eq!(c.sampled, c.genes.len() == max_len && max_len < 1200);
        }
    }
}

#[test]
fn scgpt_embeddings_match_upstream() {
    let f = fixture();
    let seed = f["seed"].as_u64().unwrap();
    for case in f["cases"].as_array().unwrap() {
        let max_len = case["max_length"].as_u64().unwrap() as usize;
        let model = Model::load(&fixture_dir().join("tiny"), max_len).unwrap();
        let cells = our_cells(&model, case, seed);
        let dim = model.dim();
        // sorted by length in batches of 7 (upstream: file order, 64 or 3 a batch), and one by one
        let got = model.embed(&cells, 7, |_| {}).unwrap();
        let (rel, abs) = compare(&got, &case["embeddings"], dim);
        eprintln!("scgpt vs upstream, max_len {max_len}, {} cells: max relative L2 error {rel:.2e}, max abs diff {abs:.2e}", cells.len());
        assert!(rel <= MAX_REL_ERR, "max relative error {rel}");
        let single = model.embed(&cells, 1, |_| {}).unwrap();
        let (rel1, _) = compare(&single, &case["embeddings"], dim);
        assert!(rel1 <= MAX_REL_ERR, "one cell a batch: max relative error {rel1}");
        for i in 0..cells.len() {
            let n: f32 = got[i * dim..(i + 1) * dim].iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((n - 1.0).abs() < 1e-5, "cell {i}: norm {n}");
        }
    }
}

#[test]
fn scgpt_binning_and_rng_match_numpy() {
    let f = fixture();
    for b in f["binning"].as_array().unwrap() {
        let mut rng = Mt19937::new(b["seed"].as_u64().unwrap() as u32);
        let got = bin_values(&f32s(&b["values"]), 51, &mut rng);
        let want: Vec<f32> = f32s(&b["bins"]);
        assert_eq!(got, want, "binning with seed {}", b["seed"]);
    }
    for p in f["permutations"].as_array().unwrap() {
        let mut rng = Mt19937::new(p["seed"].as_u64().unwrap() as u32);
        let got: Vec<u64> = rng.permutation(p["n"].as_u64().unwrap() as usize).into_iter().map(|x| x as u64).collect();
        let want: Vec<u64> = p["permutation"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert_eq!(got, want, "permutation seed {}", p["seed"]);
    }
}

/// A copy of the fixture checkpoint folder, with `edit` applied.
fn tiny_copy(ctx: &TestContext, name: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let d = ctx.path(name);
    std::fs::create_dir_all(&d).unwrap();
    for f in ["best_model.pt", "vocab.json", "args.json"] {
        std::fs::copy(fixture_dir().join("tiny").join(f), d.join(f)).unwrap();
    }
    edit(&d);
    d
}

fn edit_args(dir: &Path, change: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let p = dir.join("args.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    change(v.as_object_mut().unwrap());
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn scgpt_checkpoint_keys_load_under_both_namings() {
    let f = fixture();
    // flash-attn names (as the released checkpoints) map to nn.MultiheadAttention's
    let keys: Vec<String> = f["state_dict_keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()).collect();
    assert!(keys.iter().any(|k| k == "transformer_encoder.layers.1.self_attn.Wqkv.weight"));
    let flash = read_checkpoint(&fixture_dir().join("tiny/best_model.pt")).unwrap();
    let inproj = read_checkpoint(&fixture_dir().join("best_model_inproj.pt")).unwrap();
    assert_eq!(flash.len(), keys.len());
    let mut a: Vec<&String> = flash.keys().collect();
    let mut b: Vec<&String> = inproj.keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
    for (k, t) in &flash {
        let diff = (t - &inproj[k]).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{k}");
    }
    // the same embeddings from either file
    let ctx = TestContext::new();
    let plain = tiny_copy(&ctx, "plain", |d| {
        std::fs::copy(fixture_dir().join("best_model_inproj.pt"), d.join("best_model.pt")).unwrap();
    });
    let case = &f["cases"][1];
    let m1 = Model::load(&fixture_dir().join("tiny"), 60).unwrap();
    let m2 = Model::load(&plain, 60).unwrap();
    let cells = our_cells(&m1, case, 0);
    assert_eq!(m1.embed(&cells, 8, |_| {}).unwrap(), m2.embed(&cells, 8, |_| {}).unwrap());
    // the decoders are in the checkpoint but not used for embedding
    assert!(m1.unused_keys.iter().any(|k| k.starts_with("mvc_decoder.")), "{:?}", m1.unused_keys);
    assert!(m1.unused_keys.iter().all(|k| !k.starts_with("transformer_encoder.") && !k.starts_with("encoder.")));
}

#[test]
fn scgpt_bad_checkpoints_say_what_is_wrong() {
    let ctx = TestContext::new();
    let err = |d: &Path| Model::load(d, 1200).err().expect("must fail").to_string();
    // a missing args.json field names the file and the field
    let d = tiny_copy(&ctx, "noembsize", |d| edit_args(d, |a| drop(a.remove("embsize"))));
    let e = err(&d);
    assert!(e.contains("args.json: embsize: missing"), "{e}");
    // more layers than the checkpoint holds: the first missing tensor is named
    let d = tiny_copy(&ctx, "layers", |d| edit_args(d, |a| drop(a.insert("nlayers".into(), 3.into()))));
    let e = err(&d);
    assert!(e.contains("best_model.pt") && e.contains("no tensor `transformer_encoder.layers.2.self_attn.in_proj_weight`"), "{e}");
    // fewer layers than the checkpoint holds
    let d = tiny_copy(&ctx, "fewer", |d| edit_args(d, |a| drop(a.insert("nlayers".into(), 1.into()))));
    assert!(err(&d).contains("more than the 1 layers"), "{}", err(&d));
    // a vocabulary of another checkpoint
    let d = tiny_copy(&ctx, "vocab", |d| std::fs::write(d.join("vocab.json"), r#"{"<pad>": 0, "<cls>": 1, "CD3E": 2}"#).unwrap());
    let e = err(&d);
    assert!(e.contains("encoder.embedding.weight is 686 x 32") && e.contains("are not one checkpoint"), "{e}");
    // not a PyTorch file
    let d = tiny_copy(&ctx, "garbage", |d| std::fs::write(d.join("best_model.pt"), b"not a zip").unwrap());
    assert!(err(&d).contains("not a PyTorch state_dict checkpoint"), "{}", err(&d));
    // a missing file
    let d = tiny_copy(&ctx, "novocab", |d| std::fs::remove_file(d.join("vocab.json")).unwrap());
    assert!(err(&d).ends_with("vocab.json: no such file"), "{}", err(&d));
}

/// A weights folder holding the fixture checkpoint where weights.toml puts scgpt.
pub(crate) fn weights_with(ctx: &TestContext, src: &Path) -> PathBuf {
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    let dest = scgpt::model_dir(&w, &man);
    std::fs::create_dir_all(&dest).unwrap();
    for f in ["best_model.pt", "vocab.json", "args.json"] {
        std::fs::copy(src.join(f), dest.join(f)).unwrap();
    }
    for id in scgpt::REQUIRED_ENTRIES {
        assert!(w.join(&man.weights[*id].file).is_file(), "{id}");
    }
    w
}


fn read_i64(path: &Path, name: &str) -> i64 {
    hdf5::File::open(path).unwrap().dataset(name).unwrap().read_scalar().unwrap()
}

#[test]
fn scgpt_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx, &fixture_dir().join("tiny"));
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad", "--batch-size", "16"]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad", "--batch-size", "4"], &[], "X_scgpt", 3, 0);
    assert!(r.stderr.contains("680 of 765 genes matched the model's vocabulary (") && r.stderr.contains("; var_names (gene symbols)"), "{}", r.stderr);
    let out = ctx.path("pbmc68k_counts.scgpt.h5ad");
    let (got, dim) = read_obsm(&out, "X_scgpt");
    assert_eq!((got.len() / dim, dim), (700, 32));
    let f = fixture();
    let case = &f["cases"][0];
    let n = case["n_cells"].as_u64().unwrap() as usize;
    let (rel, _) = compare(&got[..n * dim], &case["embeddings"], dim);
    assert!(rel <= MAX_REL_ERR, "max relative error {rel}");
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/genes_matched"), 680);
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/batch_size"), 16);
    // the demo cells differ in length: batched by tokens (16 of the longest, more of the shorter)
    let batching: hdf5::types::VarLenUnicode = hdf5::File::open(&out).unwrap().dataset("uns/scfoundry/parameters/batching").unwrap().read_scalar().unwrap();
    assert!(batching.as_str().starts_with("by tokens"), "{batching}");
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/max_len"), 1200);
    // --max-len samples long cells, seeded: the second case's cells come out as upstream's
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad", "-o", "short.h5ad", "--max-len", "60"]);
    r.success();
    assert!(r.stderr.contains("cell(s) had more than 59 genes and were sampled"), "{}", r.stderr);
    let (got, _) = read_obsm(&ctx.path("short.h5ad"), "X_scgpt");
    let case = &f["cases"][1];
    let first = case["first_cell"].as_u64().unwrap() as usize;
    let n = case["n_cells"].as_u64().unwrap() as usize;
    let (rel, _) = compare(&got[first * dim..(first + n) * dim], &case["embeddings"], dim);
    assert!(rel <= MAX_REL_ERR, "sampled: max relative error {rel}");
}

#[test]
fn scgpt_data_outside_the_vocabulary() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx, &fixture_dir().join("tiny"));
    let wd = w.to_str().unwrap();
    // no gene of the data is in the vocabulary: a user error that says where to look
    let t = Tiny::counts(6, 5);
    t.write(&ctx.path("nomatch.h5ad"));
    let r = ctx.run(&["--weights-dir", wd, "embed", "-m", "scgpt", "-d", "nomatch.h5ad"]);
    r.user_error()
        .stderr_has("nomatch.h5ad: var_names: only 0 of 5 genes matched the model's vocabulary (0.0% of the counts)")
        .stderr_has("hint: the model reads gene symbols");
    // --gene-col (the alias of --gene-column) names a column that is not there
    let r = ctx.run(&["--weights-dir", wd, "embed", "-m", "scgpt", "-d", "nomatch.h5ad", "--gene-col", "symbol"]);
    r.user_error().stderr_has("--gene-column: ").stderr_has("nomatch.h5ad: var has no column `symbol`");
    // cells that express no vocabulary gene are embedded from <cls> alone, with a note
    let mut t = Tiny::counts(6, 4);
    t.var_names = vec!["CD3D".into(), "LYZ".into(), "NOTAGENE".into(), "MS4A1".into()];
    for j in [0, 1, 3] {
        t.x[2 * 4 + j] = 0.0;
        t.x[4 * 4 + j] = 0.0;
    }
    t.x[2 * 4 + 2] = 5.0;
    t.write(&ctx.path("some.h5ad"));
    let r = ctx.run(&["--weights-dir", wd, "embed", "-m", "scgpt", "-d", "some.h5ad"]);
    r.success();
    assert!(r.stderr.contains("2 cell(s) express no gene of the vocabulary (cell_2, cell_4): embedded from <cls> alone"), "{}", r.stderr);
    assert!(r.stderr.contains("3 of 4 genes matched the model's vocabulary"), "{}", r.stderr);
    let (got, dim) = read_obsm(&ctx.path("some.scgpt.h5ad"), "X_scgpt");
    assert_eq!(&got[2 * dim..3 * dim], &got[4 * dim..5 * dim]);
    assert_ne!(&got[0..dim], &got[2 * dim..3 * dim]);
    assert!(got.iter().all(|v| v.is_finite()));
}

#[test]
fn scgpt_without_weights_says_how_to_get_them() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["--weights-dir", "empty-weights", "embed", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad"]);
    r.user_error().stderr_has("error: weights for scgpt are not in empty-weights").stderr_has("scgpt-whole-human-model");
    assert!(!ctx.path("runs").exists(), "no run folder for a run that cannot start");
}

/// The vocabularies in the scgpt 0.2.4 wheel (installed with --no-deps in the test venv: the
/// files are read, the package is never imported).
#[test]
fn scgpt_real_vocabularies_from_the_wheel() {
    let Some(py) = python() else { return };
    let code = "import importlib.metadata as m; d = m.distribution('scgpt'); print(d.locate_file('scgpt/tokenizer'))";
    let out = Command::new(&py).args(["-c", code]).output().unwrap();
    if !out.status.success() {
        if std::env::var_os("CI").is_some() {
            panic!("CI: scgpt is not installed in {} (ci/requirements-nodeps.txt)", py.display());
        }
        eprintln!("scgpt not installed in {}: skipping the real-vocabulary test", py.display());
        return;
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let census = Vocab::load(&dir.join("default_census_vocab.json")).unwrap();
    // 60,694 genes; embed_data appends <pad>, <cls>, <eoc>: 60,697 tokens
    assert_eq!((census.n_entries(), census.len), (60_697, 60_697));
    assert_eq!(census.appended, vec!["<pad>", "<cls>", "<eoc>"]);
    assert_eq!(census.get("<pad>"), Some(60_694));
    let genes = Vocab::load(&dir.join("default_gene_vocab.json")).unwrap();
    assert_eq!(genes.len, 48_292 + 3);
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&repo().join("demo/pbmc68k_counts.h5ad")).unwrap();
    let names: Vec<Option<String>> = ad.var_names.iter().cloned().map(Some).collect();
    let matched = match_genes(&names, &census).iter().filter(|g| g.is_some()).count();
    eprintln!("pbmc68k demo genes in the census vocabulary: {matched}/{}", names.len());
    assert!(matched > 700, "{matched}");
    let args = Args::parse(
        r#"{"embsize": 512, "nheads": 8, "d_hid": 512, "nlayers": 12, "n_layers_cls": 3, "dropout": 0.2, "pad_token": "<pad>", "pad_value": -2, "mask_value": -1, "n_bins": 51, "input_emb_style": "continuous", "fast_transformer": true}"#,
        Path::new("args.json"),
    )
    .unwrap();
    assert_eq!((args.embsize, args.nlayers, args.pad_value), (512, 12, -2.0));
}

/// `__bench-encoder --arch scgpt` (scGPT's own model as `embed` runs it, random weights) on the
/// CPU at a small shape: batches by tokens, every cell counted, FLOPs from the lengths file.
#[test]
fn bench_encoder_scgpt_runs_the_model_in_token_batches() {
    let t = TestContext::new();
    let lengths = t.path("lengths.txt");
    // 8 cells: 3 long (29 genes + <cls> = 30 tokens), 5 short (5 + 1)
    std::fs::write(&lengths, "29\n29\n29\n5\n5\n5\n5\n5\n").unwrap();
    let args = ["__bench-encoder", "--arch", "scgpt", "--device", "cpu", "--dtype", "f32", "--layers", "1", "--hidden", "32", "--heads", "4", "--ffn", "32", "--cells", "8", "--batch", "2", "--repeat", "1", "--lengths", lengths.to_str().unwrap()];
    let run = t.run(&args);
    run.success();
    let v: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    assert_eq!(v["arch"], "scgpt");
    assert!(v["cells_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["mean_tokens"].as_f64().unwrap(), (3.0 * 30.0 + 5.0 * 6.0) / 8.0);
    // a budget of 2 x 30 tokens, a batch sized at its first cell: [30, 30], [30, 6], then the
    // other four 6-token cells together (up to 10 fit, at most 8 x 2 cells)
    assert_eq!(v["batches"].as_u64().unwrap(), 3, "{v}");
    let by_cells = t.run(&[&args[..], &["--batching", "cells"]].concat());
    by_cells.success();
    let c: Value = serde_json::from_str(by_cells.stdout.trim()).unwrap();
    assert_eq!(c["batches"].as_u64().unwrap(), 4, "{c}");
}

/// `--model-dir` takes an scGPT folder as upstream releases it (best_model.pt, vocab.json,
/// args.json): the fixture's tiny checkpoint is in that format. `weights import` places it.
#[test]
fn scgpt_runs_from_an_upstream_folder() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let tiny = fixture_dir().join("tiny");
    let r = ctx.run(&["--weights-dir", "no-weights", "embed", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad", "-o", "a.h5ad", "--model-dir", tiny.to_str().unwrap()]);
    r.success();
    assert!(!r.stderr.contains("does not honour"), "{}", r.stderr);
    let (got, dim) = read_obsm(&ctx.path("a.h5ad"), "X_scgpt");
    let f = fixture();
    let case = &f["cases"][0];
    let n = case["n_cells"].as_u64().unwrap() as usize;
    let (rel, _) = compare(&got[..n * dim], &case["embeddings"], dim);
    assert!(rel <= MAX_REL_ERR, "max relative error {rel}");
    let sha: hdf5::types::VarLenUnicode = hdf5::File::open(ctx.path("a.h5ad")).unwrap().dataset("uns/scfoundry/weights/sha256/best_model.pt").unwrap().read_scalar().unwrap();
    assert_eq!(sha.as_str(), crate::common::sha256(&tiny.join("best_model.pt")));
    // a folder without args.json: the folder, the file and what upstream calls it
    let partial = tiny_copy(&ctx, "partial", |d| std::fs::remove_file(d.join("args.json")).unwrap());
    let r = ctx.run(&["--weights-dir", "no-weights", "embed", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad", "-o", "b.h5ad", "--model-dir", partial.to_str().unwrap()]);
    r.user_error().stderr_has(&format!("{}: --model-dir for scgpt has no args.json (the model's hyperparameters", partial.display())).has_hint();
    // imported (nothing pinned upstream: each file's sha256 is pinned locally), then found
    let r = ctx.run(&["weights", "import", "scgpt", tiny.to_str().unwrap()]);
    r.success();
    assert_eq!(r.stderr.matches("cannot be verified: weights.toml pins no sha256").count(), 3, "{}", r.stderr);
    let r = ctx.run(&["embed", "-m", "scgpt", "-d", "pbmc68k_counts.h5ad", "-o", "c.h5ad"]);
    r.success();
    assert_eq!(read_obsm(&ctx.path("c.h5ad"), "X_scgpt").0, got);
}
