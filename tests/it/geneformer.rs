//! geneformer against the committed transformers fixture (tests/fixtures/geneformer/, made by
//! scripts/geneformer_reference.py; CI never installs torch): two small random
//! BertForMaskedLM folders in upstream's formats (v1: no <cls>/<eos>, pickled dictionaries,
//! model.safetensors and pytorch_model.bin; v2: <cls>/<eos>, JSON token dictionary, numpy-scalar
//! median pickle), 50 real demo cells with var['ensembl_id'] and obs['n_counts'].
//! Token ids must be identical for every cell; embeddings within 1e-4 relative error.

use std::path::{Path, PathBuf};

use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::geneformer::{Dictionaries, EmbMode, GeneTable, Geneformer};

use crate::common::{TestContext, read_obsm, repo};

pub(crate) const MAX_REL: f64 = 1e-4;

pub(crate) fn fx() -> PathBuf {
    repo().join("tests/fixtures/geneformer")
}

pub(crate) fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fx().join("reference.json")).unwrap()).unwrap()
}

pub(crate) fn matrix(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()).collect()
}

/// Token ids of the fixture's cells as scfoundry makes them.
fn our_tokens(model: &Geneformer) -> Vec<Vec<u32>> {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&fx().join("pbmc68k_50.h5ad")).unwrap();
    let x = ad.matrix(None).unwrap();
    let ids: Vec<String> = ad.var().unwrap().column("ensembl_id").unwrap().as_labels().unwrap().into_iter().map(Option::unwrap_or_default).collect();
    let table = GeneTable::new(&ids, &model.dict).unwrap();
    let obs = ad.obs().unwrap();
    let Some(scfoundry::anndata::dataframe::Column::Numeric(n)) = obs.column("n_counts") else { panic!("n_counts") };
    let b = x.read_rows(0, ad.n_obs).unwrap();
    (0..b.n_rows())
        .map(|i| {
            let (idx, vals) = b.row(i);
            model.tokens(table.rank(idx, vals, n[i]))
        })
        .collect()
}

/// Worst relative error (per cell: max |a - b| / max |b|) against the reference rows.
pub(crate) fn max_rel(got: &[f32], want: &[Vec<f64>], dim: usize) -> f64 {
    let mut worst = 0f64;
    for (i, w) in want.iter().enumerate() {
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (k, &wv) in w.iter().enumerate() {
            let g = got[i * dim + k] as f64;
            worst = worst.max((g - wv).abs() / scale);
        }
    }
    worst
}

fn check(dir: &Path, variant: &str, emb_layer: i32, mode: EmbMode, key: &str, batch: usize) -> f64 {
    let r = reference();
    let model = Geneformer::load(dir, emb_layer, mode).unwrap();
    assert_eq!(model.input_size, r[variant]["input_size"].as_u64().unwrap() as usize);
    let tokens = our_tokens(&model);
    let want: Vec<Vec<u32>> = r[variant]["tokens"].as_array().unwrap().iter().map(|c| c.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()).collect();
    assert_eq!(tokens.len(), want.len());
    for (i, (a, b)) in tokens.iter().zip(&want).enumerate() {
        assert_eq!(a, b, "{variant} cell {i}: token ids differ");
    }
    let got = model.embed(&tokens, batch, |_| {}).unwrap();
    let err = max_rel(&got, &matrix(&r[variant]["embeddings"][key]), model.hidden());
    eprintln!("geneformer {variant} {key} ({}), batch {batch}: max relative error {err:.3e}", model.weights_path.file_name().unwrap().to_string_lossy());
    assert!(err < MAX_REL, "{variant} {key}: max relative error {err}");
    err
}

#[test]
fn geneformer_v1_safetensors_matches_transformers() {
    check(&fx().join("v1"), "v1", -1, EmbMode::Cell, "emb_layer_-1_cell", 100);
    // batches of 7 cells: padding differs, results do not
    check(&fx().join("v1"), "v1", 0, EmbMode::Cell, "emb_layer_0_cell", 7);
}

#[test]
fn geneformer_v1_pytorch_bin_matches_transformers() {
    // the same folder with only pytorch_model.bin: the pickle path
    let ctx = TestContext::new();
    let dir = ctx.path("v1bin");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "pytorch_model.bin", "token_dictionary.pkl", "gene_median_dictionary.pkl"] {
        std::fs::copy(fx().join("v1").join(f), dir.join(f)).unwrap();
    }
    let m = Geneformer::load(&dir, -1, EmbMode::Cell).unwrap();
    assert!(m.weights_path.ends_with("pytorch_model.bin"));
    check(&dir, "v1", -1, EmbMode::Cell, "emb_layer_-1_cell", 100);
}

#[test]
fn geneformer_v2_special_tokens_match_transformers() {
    let dir = fx().join("v2");
    let d = Dictionaries::find(&dir).unwrap();
    assert_eq!(d.specials, Some((2, 3)));
    check(&dir, "v2", -1, EmbMode::Cell, "emb_layer_-1_cell", 100);
    check(&dir, "v2", -1, EmbMode::Cls, "emb_layer_-1_cls", 16);
}


#[test]
fn geneformer_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    std::fs::copy(fx().join("pbmc68k_50.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let dir = fx().join("v1");
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap(), "--batch-size", "8"]);
    r.success();
    // blocks are whole groups of 20 batches: batches of 2 give blocks of 40 of the 50 cells
    crate::common::assert_shards_equal(&ctx, &["embed", "-m", "geneformer", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap(), "--batch-size", "2"], &[], "X_geneformer", 2, 0);
    let out = ctx.path("cells.geneformer.h5ad");
    let (got, dim) = read_obsm(&out, "X_geneformer");
    assert_eq!(dim, 32);
    let err = max_rel(&got, &matrix(&reference()["v1"]["embeddings"]["emb_layer_-1_cell"]), dim);
    assert!(err < MAX_REL, "{err}");
    assert!(r.stderr.contains("were truncated"), "{}", r.stderr);
    // --emb-layer 0; the var index (symbols) as gene column: mapped to Ensembl ids, the same tokens
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "-o", "last.h5ad", "--model-dir", dir.to_str().unwrap(), "--emb-layer", "0"]);
    r.success();
    let (got, dim) = read_obsm(&ctx.path("last.h5ad"), "X_geneformer");
    assert!(max_rel(&got, &matrix(&reference()["v1"]["embeddings"]["emb_layer_0_cell"]), dim) < MAX_REL);
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "-o", "x.h5ad", "--model-dir", dir.to_str().unwrap(), "--gene-column", "index"]);
    r.success();
    assert!(r.stderr.contains("600 of 765 genes matched the model's vocabulary") && r.stderr.contains("700 mapped to Ensembl ids"), "{}", r.stderr);
    let (got, dim) = read_obsm(&ctx.path("x.h5ad"), "X_geneformer");
    assert!(max_rel(&got, &matrix(&reference()["v1"]["embeddings"]["emb_layer_-1_cell"]), dim) < MAX_REL);
}

/// `--precision` on the CPU: the default (`auto`) runs f32 with no precision note, and the output
/// records what was asked and what ran; an explicit bf16 still runs f32 and says so.
#[test]
fn geneformer_default_precision_on_the_cpu_is_f32_and_recorded() {
    let ctx = TestContext::new();
    std::fs::copy(fx().join("pbmc68k_50.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let dir = fx().join("v1");
    let param = |out: &str, k: &str| -> String {
        let f = hdf5::File::open(ctx.path(out)).unwrap();
        let v: hdf5::types::VarLenUnicode = f.dataset(&format!("uns/scfoundry/parameters/{k}")).unwrap().read_scalar().unwrap();
        v.to_string()
    };
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "-o", "auto.h5ad", "--model-dir", dir.to_str().unwrap()]);
    r.success();
    assert_eq!((param("auto.h5ad", "precision_requested"), param("auto.h5ad", "precision")), ("auto".to_string(), "f32".to_string()));
    assert!(!r.stderr.contains("bf16") && !r.stderr.contains("precision"), "the default on the CPU says nothing of precision:\n{}", r.stderr);
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "-o", "bf16.h5ad", "--model-dir", dir.to_str().unwrap(), "--precision", "bf16"]);
    r.success().stderr_has("--precision bf16 applies on a GPU; this CPU run used float32");
    assert_eq!((param("bf16.h5ad", "precision_requested"), param("bf16.h5ad", "precision")), ("bf16".to_string(), "f32".to_string()));
    let (auto, _) = read_obsm(&ctx.path("auto.h5ad"), "X_geneformer");
    let (bf16, _) = read_obsm(&ctx.path("bf16.h5ad"), "X_geneformer");
    assert_eq!(auto, bf16, "both ran f32 on the CPU");
}

/// The row-block pipeline (tasks/pipeline.rs): 50 cells in blocks of 20 (batches of 1, groups of
/// 20) read and tokenised two blocks ahead on two threads give the same bytes, notes and
/// parameters as each block read, tokenised, run and written in turn on one thread, and as the
/// whole file in one block; the report names each stage's seconds.
#[test]
fn geneformer_pipelined_blocks_equal_one_block_at_a_time() {
    let ctx = TestContext::new();
    std::fs::copy(fx().join("pbmc68k_50.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let dir = fx().join("v1");
    let run = |name: &str, env: &[(&str, &Path)]| {
        let out = format!("{name}.h5ad");
        let runs = ctx.path(&format!("runs-{name}"));
        ctx.run_env(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "-o", &out, "--model-dir", dir.to_str().unwrap(), "--batch-size", "1", "--runs-dir", runs.to_str().unwrap()], env).success();
        let run = std::fs::read_dir(&runs).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).unwrap();
        let report: Value = serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
        (read_obsm(&ctx.path(&out), "X_geneformer").0, report["tasks"][0]["result"].clone())
    };
    let rows = Path::new("8");
    let (serial, serial_result) = run("serial", &[("SCFOUNDRY_BLOCK_ROWS", rows), ("SCFOUNDRY_BLOCKS_AHEAD", Path::new("0")), ("RAYON_NUM_THREADS", Path::new("1"))]);
    let (piped, piped_result) = run("piped", &[("SCFOUNDRY_BLOCK_ROWS", rows), ("SCFOUNDRY_BLOCKS_AHEAD", Path::new("2")), ("RAYON_NUM_THREADS", Path::new("2"))]);
    let (whole, _) = run("whole", &[]);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(serial.len(), 50 * 32);
    assert_eq!(bits(&piped), bits(&serial), "pipelined blocks differ from one block at a time");
    assert_eq!(bits(&whole), bits(&serial), "blocks of 20 differ from the file in one block");
    assert_eq!(piped_result["notes"], serial_result["notes"]);
    assert!(serial_result["notes"].to_string().contains("were truncated"), "{}", serial_result["notes"]);
    let phases: Vec<(String, f64)> = serde_json::from_value(piped_result["phases"].clone()).unwrap();
    let phases: std::collections::HashMap<String, f64> = phases.into_iter().collect();
    for stage in ["setup", "read", "tokenise", "device", "write", "blocks wall", "wall"] {
        assert!(phases.get(stage).is_some_and(|&s| s >= 0.0), "no `{stage}` in {phases:?}");
    }
    assert!(phases["device"] > 0.0 && phases["blocks wall"] <= phases["wall"], "{phases:?}");
}

#[test]
fn geneformer_missing_dictionary_names_the_file_and_fields() {
    let ctx = TestContext::new();
    let dir = ctx.path("model");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "gene_median_dictionary.pkl"] {
        std::fs::copy(fx().join("v1").join(f), dir.join(f)).unwrap();
    }
    std::fs::copy(fx().join("pbmc68k_50.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap()]);
    r.user_error().stderr_has("token_dictionary.pkl").stderr_has("{Ensembl id: token id (int)}");
    assert!(!ctx.path("runs").exists(), "no run folder for a run that cannot start");
    // a dictionary that is not a dict of numbers says what it should be
    std::fs::write(dir.join("token_dictionary.json"), r#"{"ENSG00000000003": "seven"}"#).unwrap();
    let e = Dictionaries::find(&dir).unwrap_err().to_string();
    assert!(e.contains("token_dictionary.json") && e.contains("not a number"), "{e}");
    // a missing gene column names the column and lists what var has
    std::fs::write(dir.join("token_dictionary.json"), r#"{"<pad>": 0}"#).unwrap();
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap(), "--gene-column", "gene_ids"]);
    r.user_error().stderr_has("var has no column `gene_ids`").stderr_has("ensembl_id");
}

#[test]
fn geneformer_cells_without_dictionary_genes_get_nan() {
    let model = Geneformer::load(&fx().join("v1"), -1, EmbMode::Cell).unwrap();
    let mut cells = our_tokens(&model);
    cells.truncate(3);
    cells.insert(1, vec![]);
    let rows = model.embed(&cells, 2, |_| {}).unwrap();
    let h = model.hidden();
    assert!(rows[h..2 * h].iter().all(|v| v.is_nan()));
    let want = matrix(&reference()["v1"]["embeddings"]["emb_layer_-1_cell"]);
    let kept: Vec<f32> = [0usize, 2, 3].iter().flat_map(|&i| rows[i * h..(i + 1) * h].to_vec()).collect();
    assert!(max_rel(&kept, &want[..3], h) < MAX_REL);
    // a gene row with only unknown genes ranks to nothing, and gets no special tokens
    let ids = vec!["ENSG_NOT_THERE".to_string(), "".to_string()];
    let table = GeneTable::new(&ids, &model.dict).unwrap();
    assert_eq!(table.n_genes(), 0);
    assert!(model.tokens(table.rank(&[0, 1], &[3.0, 4.0], 7.0)).is_empty());
    // --emb-mode cls is refused for a V1 dictionary
    let e = Geneformer::load(&fx().join("v1"), -1, EmbMode::Cls).err().unwrap().to_string();
    assert!(e.contains("cls needs a <cls> token"), "{e}");
}

/// `__bench-encoder --arch bert` (the throughput benchmark of bench/encoder_throughput.sh) on
/// the CPU at a tiny shape: its packed encoder agrees with candle-transformers' padded BertModel
/// on the same random weights for both feed-forward activations it offers (ReLU, which the four
/// encoder shapes' models use, and BERT's GELU), and the JSON line names the activation it ran; the
/// batches' embeddings read back one batch behind agree with plain reads.
#[test]
fn bench_encoder_packed_matches_padded_bert_for_both_activations() {
    let t = TestContext::new();
    let lengths = t.path("lengths.txt");
    std::fs::write(&lengths, "17\n40\n3\n64\n25\n9\n").unwrap();
    for act in ["gelu", "relu"] {
        let lengths = lengths.to_str().unwrap();
        let run = t.run(&[
            "__bench-encoder", "--arch", "bert", "--device", "cpu", "--dtype", "f32", "--layers", "2", "--hidden", "32", "--heads", "2",
            "--ffn", "64", "--max-len", "64", "--lengths", lengths, "--cells", "12", "--batch", "5", "--repeat", "1", "--check",
            "--activation", act,
        ]);
        run.success();
        let v: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
        assert_eq!(v["activation"], act);
        let rel = v["check_embedding_packed_vs_padded"].as_f64().unwrap();
        assert!(rel < 1e-5, "{act}: packed vs padded {rel}");
        // the lagged read-back (gpu/readback.rs) returns the plain reads' values, batch for batch
        let lag = v["check_readback_lagged_vs_plain"].as_f64().unwrap();
        assert!(lag < 1e-6, "{act}: lagged vs plain read-back {lag}");
        assert_eq!(v["read_back"], "one batch behind");
        assert!(v["cells_per_s"].as_f64().unwrap() > 0.0);
    }
    let bad = t.run(&["__bench-encoder", "--arch", "bert", "--activation", "swish"]);
    bad.user_error();
    assert!(bad.stderr.contains("gelu") && bad.stderr.contains("relu"), "{}", bad.stderr);
}

/// `__bench-encoder --arch gemm` (the matrix ceiling the benchmark scripts measure in the same
/// call as the encoders) times the size it is given and reports it as the ceiling.
#[test]
fn bench_encoder_gemm_reports_the_ceiling_it_measured() {
    let t = TestContext::new();
    let lengths = t.path("lengths.txt");
    std::fs::write(&lengths, "1\n").unwrap();
    let run = t.run(&["__bench-encoder", "--arch", "gemm", "--device", "cpu", "--dtype", "f32", "--hidden", "96", "--repeat", "2", "--lengths", lengths.to_str().unwrap()]);
    run.success();
    let v: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    let sizes = v["tflops_by_size"].as_object().unwrap();
    assert_eq!(sizes.keys().collect::<Vec<_>>(), vec!["96"]);
    let ceiling = v["ceiling_tflops"].as_f64().unwrap();
    assert!(ceiling > 0.0 && ceiling.is_finite(), "{ceiling}");
    // (to the last bit but one: serde_json's default float parser may read a printed value one
    // ulp off, which failed this test once in CI as 0.007010886639003833 vs ...834)
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * y.abs();
    assert!(close(ceiling, sizes["96"].as_f64().unwrap()), "{v}");
    assert!(close(v["half_ceiling_tflops"].as_f64().unwrap(), ceiling / 2.0), "{v}");
}
