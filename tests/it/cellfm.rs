//! cellfm against the PyTorch port of CellFM (committed fixture tests/fixtures/cellfm/, made by
//! scripts/cellfm_reference.py with the port's own layers/ under torch; CI never installs
//! torch): a small FinetuneModel state_dict saved as the port's main.py saves it (under
//! `extractor.net.`, with a classifier head), its config (heads), a 160-gene table in
//! gene_info.csv's format, 50 demo cells (three scaled past 1e5 counts), and per cell the gene ids
//! and float32 values the port's data path gives and the 32-d cls embeddings of `encode` and of
//! `embedding_infer`. Tokens must be identical, embeddings within 1e-4 relative error, whatever
//! the batch; also bad checkpoints and the embed command end to end.

use std::path::PathBuf;

use candle_core::{DType, Device};
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::cellfm::{self, cell_input, read_gene_info, read_state_dict, CellFm, CellInput, GeneMap};

use crate::common::{TestContext, assert_embed_needs_weights, manifest_without_checksum, max_rel_err, repo};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/cellfm")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

/// The fixture's cells through our gene map and token builder.
fn ours(f: &Value) -> (GeneMap, Vec<CellInput>) {
    crate::common::no_hdf5_locking();
    let genes = read_gene_info(&dir().join("gene_info.csv")).unwrap();
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let map = GeneMap::new(&genes, &ad.var_names, cellfm::NONZ_LEN);
    let x = ad.matrix(None).unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    let cells = (0..ad.n_obs)
        .map(|i| {
            let (idx, vals) = b.row(i);
            cell_input(idx, vals, &map).unwrap()
        })
        .collect();
    (map, cells)
}

#[test]
fn cellfm_genes_and_tokens_match_the_port() {
    let f = fixture();
    let (map, cells) = ours(&f);
    let table: Vec<&str> = f["genes"]["table"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(read_gene_info(&dir().join("gene_info.csv")).unwrap(), table);
    assert_eq!(map.kept as u64, f["genes"]["kept"].as_u64().unwrap());
    let inputs = f["inputs"].as_array().unwrap();
    assert_eq!(cells.len(), inputs.len());
    let mut worst_ulps = 0u32;
    for (i, (c, w)) in cells.iter().zip(inputs).enumerate() {
        let genes: Vec<u32> = w["genes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let vals: Vec<f32> = w["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(c.genes, genes, "cell {i}: gene ids differ from the port's nonz_gene");
        assert_eq!(c.values.len(), vals.len());
        for (a, b) in c.values.iter().zip(&vals) {
            worst_ulps = worst_ulps.max((a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32);
        }
    }
    eprintln!("cellfm tokens: gene ids identical; values differ by at most {worst_ulps} float32 ulp(s)");
    assert_eq!(worst_ulps, 0, "values differ from the port's dw_nzdata (bit for bit in float32)");
    // the scaled cells went through read_h5ad's scaling: their totals are below their raw sums
    for (k, v) in f["scaled_cells"].as_object().unwrap() {
        let i: usize = k.parse().unwrap();
        assert!(v["total_all_genes"].as_f64().unwrap() > 1e5);
        assert!(inputs[i]["total"].as_f64().unwrap() <= 1e5);
    }
    let lens: std::collections::BTreeSet<usize> = cells.iter().map(|c| c.genes.len()).collect();
    assert!(lens.len() > 5, "{lens:?}");
}

#[test]
fn cellfm_state_dict_reads_the_port_format() {
    let t = read_state_dict(&dir().join("cellfm_torch.pt")).unwrap();
    let f = fixture();
    let c = &f["config"];
    assert_eq!(t["gene_emb"].dims(), &[c["gene_emb_rows"].as_u64().unwrap() as usize, c["enc_dims"].as_u64().unwrap() as usize]);
    assert!(t.contains_key("ST_emb") && t.contains_key("encoder.3.post_norm2.bias"));
    assert!(!t.keys().any(|k| k.starts_with("extractor.") || k.starts_with("cls.")), "the wrapper prefix is removed and the classifier head left out");
    let m = CellFm::load(&dir().join("cellfm_torch.pt")).unwrap();
    assert_eq!((m.dims.dim, m.dims.depth, m.dims.heads, m.dims.st_tokens), (32, 4, 4, true));
}

#[test]
fn cellfm_embeddings_match_the_port_at_any_batch_size() {
    let f = fixture();
    let (_, cells) = ours(&f);
    let model = CellFm::load(&dir().join("cellfm_torch.pt")).unwrap();
    let dim = model.dim();
    let refs: Vec<&CellInput> = cells.iter().collect();
    let mut alone = Vec::new();
    for c in &refs {
        alone.extend(model.embed(std::slice::from_ref(c)).unwrap());
    }
    let err = max_rel_err(&alone, &f["embeddings"], dim);
    eprintln!("cellfm float32, batch 1: largest relative error {err:.3e} over {} cells", refs.len());
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    for size in [4, 7, 50] {
        let mut rows = Vec::new();
        for batch in refs.chunks(size) {
            rows.extend(model.embed(batch).unwrap());
        }
        let err = max_rel_err(&rows, &f["embeddings"], dim);
        assert!(err < MAX_REL_ERR, "batch {size}: largest relative error {err:.3e}");
        let d = rows.iter().zip(&alone).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("cellfm batch {size}: largest relative error {err:.3e}; vs batch 1: largest difference {d:.2e}");
        assert!(d < 1e-5, "batch {size} vs 1: {d}");
    }
}

#[test]
fn cellfm_without_st_tokens_matches_embedding_infer() {
    let f = fixture();
    let (_, cells) = ours(&f);
    let path = dir().join("cellfm_torch.pt");
    let mut t = read_state_dict(&path).unwrap();
    t.remove("ST_emb");
    let model = CellFm::from_tensors(t, 4, &path, DType::F32, Device::Cpu).unwrap();
    assert!(!model.dims.st_tokens);
    let refs: Vec<&CellInput> = cells.iter().collect();
    let mut rows = Vec::new();
    for batch in refs.chunks(7) {
        rows.extend(model.embed(batch).unwrap());
    }
    let err = max_rel_err(&rows, &f["embeddings_without_st"], model.dim());
    eprintln!("cellfm without ST_emb (embedding_infer): largest relative error {err:.3e}");
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    // and it is another read-out than encode's
    assert!(max_rel_err(&rows, &f["embeddings"], model.dim()) > 1e-3);
}

#[test]
fn cellfm_bad_checkpoints() {
    let ctx = TestContext::new();
    let e = CellFm::load(&ctx.path("cellfm_torch.pt")).err().unwrap();
    assert!(e.to_string().contains("cellfm_torch.pt"), "{e}");
    // a MindSpore checkpoint (protobuf, not a zip) is not read: the error says how to convert it
    std::fs::write(ctx.path("base_weight.ckpt"), b"\x0a\x10\x0a\x08gene_emb").unwrap();
    let e = CellFm::load(&ctx.path("base_weight.ckpt")).err().unwrap();
    assert!(e.to_string().contains("base_weight.ckpt") && e.to_string().contains("cellfm_convert.py"), "{e}");
    // another model's state_dict
    let e = CellFm::load(&repo().join("tests/fixtures/uce/tiny.torch")).err().unwrap();
    assert!(e.to_string().contains("tiny.torch") && e.to_string().contains("gene_emb"), "{e}");
    // a config beside the state_dict that does not fit it
    std::fs::copy(dir().join("cellfm_torch.pt"), ctx.path("m.pt")).unwrap();
    std::fs::write(ctx.path("m.json"), r#"{"enc_dims": 32, "enc_nlayers": 40, "enc_num_heads": 4}"#).unwrap();
    let e = CellFm::load(&ctx.path("m.pt")).err().unwrap();
    assert!(e.to_string().contains("m.json") && e.to_string().contains("enc_nlayers"), "{e}");
    // without a config, the released 48 heads do not divide 32
    std::fs::remove_file(ctx.path("m.json")).unwrap();
    let e = CellFm::load(&ctx.path("m.pt")).err().unwrap();
    assert!(e.to_string().contains("48 heads"), "{e}");
}

#[test]
fn cellfm_embed_needs_its_weights() {
    assert_embed_needs_weights("cellfm", "cellfm-torch-state-dict");
}

/// A weights folder holding the fixture files where weights.toml puts CellFM's, and a manifest
/// (weights.toml less the real gene table's size and sha256, which the small fixture table
/// cannot match) for $SCFOUNDRY_MANIFEST.
fn weights_with(ctx: &TestContext) -> (PathBuf, PathBuf) {
    let manifest = manifest_without_checksum(ctx, "cellfm-gene-info");
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    let (ckpt, info) = cellfm::files(&w, &man);
    std::fs::create_dir_all(ckpt.parent().unwrap()).unwrap();
    std::fs::copy(dir().join("cellfm_torch.pt"), &ckpt).unwrap();
    std::fs::copy(dir().join("cellfm_torch.json"), cellfm::config_path(&ckpt)).unwrap();
    std::fs::copy(dir().join("gene_info.csv"), &info).unwrap();
    (w, manifest)
}

#[test]
fn cellfm_embed_command_matches_the_port() {
    let ctx = TestContext::new();
    let (w, manifest) = weights_with(&ctx);
    let env = [("SCFOUNDRY_MANIFEST", manifest.as_path())];
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    // the fixture's 160-gene table holds 48% of the data's counts: below --min-gene-match's default
    let r = ctx.run_env(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellfm", "--min-gene-match", "0", "-d", "cells.h5ad", "--batch-size", "3"], &env);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellfm", "--min-gene-match", "0", "-d", "cells.h5ad", "--batch-size", "3"], &env, "X_cellfm", 2, 0);
    assert!(r.stderr.contains("140 of the data's 300 genes are in the model's 160-gene table"), "{}", r.stderr);
    let out = ctx.path("cells.cellfm.h5ad");
    let h = hdf5::File::open(&out).unwrap();
    let ds = h.dataset("obsm/X_cellfm").unwrap();
    let dim = ds.shape()[1];
    let got = ds.read_raw::<f32>().unwrap();
    assert_eq!((got.len() / dim, dim), (50, 32));
    let err = max_rel_err(&got, &f["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    let p = |k: &str| -> i64 { h.dataset(&format!("uns/scfoundry/parameters/{k}")).unwrap().read_scalar().unwrap() };
    assert_eq!((p("layers"), p("heads"), p("genes_read"), p("batch_size")), (4, 4, 140, 3));
    // longest first, batched by tokens (Batches::run_longest_first), as the parameters say
    let batching: hdf5::types::VarLenUnicode = h.dataset("uns/scfoundry/parameters/batching").unwrap().read_scalar().unwrap();
    assert!(batching.as_str().starts_with("by tokens"), "{batching}");
    // a gene table that does not fit the checkpoint's gene_emb
    let (_, info) = cellfm::files(&w, &scfoundry::weights::Manifest::builtin());
    let text = std::fs::read_to_string(dir().join("gene_info.csv")).unwrap();
    let short: Vec<&str> = text.lines().take(141).collect(); // header + 140 of the 160 genes
    std::fs::write(&info, short.join("\n")).unwrap();
    let r = ctx.run_env(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellfm", "--min-gene-match", "0", "-d", "cells.h5ad", "-o", "again.h5ad"], &env);
    r.user_error().stderr_has("do not belong together");
    assert!(!ctx.path("again.h5ad").exists());
}

/// `--model-dir` with the port's state_dict (and its config) beside CellFM's gene table where
/// the CellFM repository keeps it (csv/gene_info.csv), and no weights folder: the weights
/// folder's embedding bit for bit, with the folder and the files' sha256 in the provenance (a
/// folder's files are not held to weights.toml's pins, so the small table needs no manifest); a
/// folder without the gene table is refused before the run, naming the folder and the file.
#[test]
fn cellfm_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    let (w, manifest) = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    let args = ["embed", "-m", "cellfm", "--min-gene-match", "0", "-d", "cells.h5ad", "--batch-size", "3"];
    ctx.run_env(&[&["--weights-dir", w.to_str().unwrap()][..], &args[..], &["-o", "w.h5ad"]].concat(), &[("SCFOUNDRY_MANIFEST", manifest.as_path())]).success();
    let files = [(dir().join("cellfm_torch.pt"), "cellfm_torch.pt"), (dir().join("cellfm_torch.json"), "cellfm_torch.json"), (dir().join("gene_info.csv"), "csv/gene_info.csv")];
    let m = crate::common::model_folder(&ctx.path("CellFM"), &files);
    let r = ctx.run(&[&args[..], &["-o", "m.h5ad", "--model-dir", m.to_str().unwrap()]].concat());
    r.success();
    assert!(r.stderr.contains("140 of the data's 300 genes are in the model's 160-gene table"), "{}", r.stderr);
    let shas = [("cellfm-torch-state-dict", files[0].0.clone()), ("cellfm-gene-info", files[2].0.clone())];
    crate::common::assert_model_dir_run(&ctx.path("m.h5ad"), &ctx.path("w.h5ad"), "X_cellfm", &m, &shas);
    let (got, dim) = crate::common::read_obsm(&ctx.path("m.h5ad"), "X_cellfm");
    let err = max_rel_err(&got, &f["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    std::fs::remove_dir_all(m.join("csv")).unwrap();
    crate::common::assert_model_dir_lacks(&ctx, &[&args[..], &["-o", "x.h5ad", "--model-dir", m.to_str().unwrap()]].concat(), "cellfm", &m, "gene_info.csv", "x.h5ad");
}
