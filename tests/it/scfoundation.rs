//! scfoundation against upstream scFoundation's code (committed fixture
//! tests/fixtures/scfoundation/, made by scripts/scfoundation_reference.py with upstream's own
//! load.py and pretrainmodels/ under torch; CI never installs torch): a small models.ckpt in
//! upstream's layout ('cell' and 'rde' versions, each state_dict + config), a 98-gene index in
//! upstream's tsv format, and for 50 demo cells the values and gene positions the encoder sees
//! and the 4 x 32-d cell embeddings get_embedding.py gives, one cell at a time. Inputs must be
//! identical, embeddings within 1e-4 relative error, whatever the batch; also bad checkpoints
//! and the embed command end to end.

use std::path::PathBuf;

use candle_core::{DType, Device};
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::scfoundation::{self, cell_input, read_checkpoint, read_gene_index, CellInput, GeneAlignment, ScFoundation};

use crate::common::{TestContext, assert_embed_needs_weights, manifest_without_checksum, max_rel_err, repo};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/scfoundation")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

/// The fixture's cells through our gene alignment and input builder.
fn ours(f: &Value) -> (GeneAlignment, Vec<CellInput>) {
    crate::common::no_hdf5_locking();
    let genes = read_gene_index(&dir().join("gene_index.tsv")).unwrap();
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let align = GeneAlignment::new(&genes, &ad.var_names);
    let x = ad.matrix(None).unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    let cells = (0..ad.n_obs)
        .map(|i| {
            let (idx, vals) = b.row(i);
            cell_input(idx, vals, &align, scfoundation::TGTHIGHRES).unwrap()
        })
        .collect();
    (align, cells)
}

#[test]
fn scfoundation_genes_and_inputs_match_upstream() {
    let f = fixture();
    let (align, cells) = ours(&f);
    let want_genes: Vec<&str> = f["genes"]["list"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(align.n_genes, want_genes.len());
    let want_missing: Vec<&str> = f["genes"]["absent_from_data"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let mut missing = align.missing.clone();
    missing.sort();
    assert_eq!(missing, want_missing, "zero-filled genes (main_gene_selection's to_fill_columns)");
    let inputs = f["inputs"].as_array().unwrap();
    assert_eq!(cells.len(), inputs.len());
    for (i, (c, w)) in cells.iter().zip(inputs).enumerate() {
        let pos: Vec<u32> = w["positions"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let vals: Vec<f32> = w["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(c.positions, pos, "cell {i}: gene positions differ from gatherData's");
        assert_eq!(c.values, vals, "cell {i}: values differ from get_embedding.py's (bit for bit in float32)");
    }
    // cells of different lengths, so that batches pad
    let lens: std::collections::BTreeSet<usize> = cells.iter().map(|c| c.values.len()).collect();
    assert!(lens.len() > 5, "{lens:?}");
}

#[test]
fn scfoundation_checkpoint_reads_upstream_layout() {
    let (cfg, tensors) = read_checkpoint(&dir().join("models.ckpt"), "cell").unwrap();
    let f = fixture();
    let c = &f["config"];
    assert_eq!(cfg.seq_len as u64, c["seq_len"].as_u64().unwrap());
    assert_eq!(cfg.hidden_dim as u64, c["encoder"]["hidden_dim"].as_u64().unwrap());
    assert_eq!(cfg.depth as u64, c["encoder"]["depth"].as_u64().unwrap());
    assert_eq!(cfg.heads as u64, c["encoder"]["heads"].as_u64().unwrap());
    assert_eq!(cfg.bin_num as u64, c["bin_num"].as_u64().unwrap());
    assert_eq!(cfg.bin_alpha, c["bin_alpha"].as_f64().unwrap());
    assert_eq!((cfg.pad_token_id, cfg.mask_token_id), (103.0, 102.0));
    assert_eq!(tensors["pos_emb.weight"].dims(), &[cfg.seq_len + 1, cfg.hidden_dim]);
    assert!(!tensors.keys().any(|k| k.starts_with("decoder")), "the decoder is not read");
}

#[test]
fn scfoundation_embeddings_match_upstream_at_any_batch_size() {
    let f = fixture();
    let (_, cells) = ours(&f);
    let model = ScFoundation::load(&dir().join("models.ckpt")).unwrap();
    let dim = model.dim();
    assert_eq!(dim, 4 * 32);
    let refs: Vec<&CellInput> = cells.iter().collect();
    // one cell at a time, as upstream
    let mut alone = Vec::new();
    for c in &refs {
        alone.extend(model.embed(std::slice::from_ref(c)).unwrap());
    }
    let err = max_rel_err(&alone, &f["embeddings"], dim);
    eprintln!("scfoundation float32, batch 1: largest relative error {err:.3e} over {} cells", refs.len());
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    // batches of 7 (padded to their longest cell) and all 50 at once give the same rows
    for size in [7, 50] {
        let mut rows = Vec::new();
        for batch in refs.chunks(size) {
            rows.extend(model.embed(batch).unwrap());
        }
        let err = max_rel_err(&rows, &f["embeddings"], dim);
        assert!(err < MAX_REL_ERR, "batch {size}: largest relative error {err:.3e}");
        let d = rows.iter().zip(&alone).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("scfoundation batch {size} vs batch 1: largest difference {d:.2e}");
        assert!(d < 1e-5, "batch {size} vs 1: {d}");
    }
    // the 'rde' version holds other weights: reading the right key matters
    let rde = ScFoundation::load_on(&dir().join("models.ckpt"), "rde", DType::F32, Device::Cpu).unwrap();
    let other = rde.embed(&refs[..3]).unwrap();
    let first3 = Value::Array(f["embeddings"].as_array().unwrap()[..3].to_vec());
    assert!(max_rel_err(&other, &first3, dim) > 0.1);
}

#[test]
fn scfoundation_bad_checkpoints() {
    let ctx = TestContext::new();
    // missing file
    let e = ScFoundation::load(&ctx.path("models.ckpt")).err().unwrap();
    assert!(e.to_string().contains("models.ckpt"), "{e}");
    // not a torch file
    std::fs::write(ctx.path("junk.ckpt"), b"not a zip").unwrap();
    let e = ScFoundation::load(&ctx.path("junk.ckpt")).err().unwrap();
    assert!(e.to_string().contains("junk.ckpt") && e.to_string().contains("torch.save"), "{e}");
    // a version the file lacks: the error names what it holds
    let e = ScFoundation::load_on(&dir().join("models.ckpt"), "gene", DType::F32, Device::Cpu).err().unwrap();
    assert!(e.to_string().contains("`gene`") && e.to_string().contains("'cell', 'rde'"), "{e}");
    // a plain state_dict (not models.ckpt's layout)
    let e = ScFoundation::load(&repo().join("tests/fixtures/uce/tiny.torch")).err().unwrap();
    assert!(e.to_string().contains("tiny.torch") && e.to_string().contains("`cell`"), "{e}");
    // every storage record cut to half (the zip packed again): an error naming the file and the
    // tensor (formats::torch_zip checks offset + extent against the record), not a panic
    let mut z = zip::ZipArchive::new(std::fs::File::open(dir().join("models.ckpt")).unwrap()).unwrap();
    let mut w = zip::ZipWriter::new(std::fs::File::create(ctx.path("short.ckpt")).unwrap());
    for i in 0..z.len() {
        let mut f = z.by_index(i).unwrap();
        let name = f.name().to_string();
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut b).unwrap();
        if name.contains("/data/") {
            b.truncate(b.len() / 2);
        }
        w.start_file(name.as_str(), zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored)).unwrap();
        std::io::Write::write_all(&mut w, &b).unwrap();
    }
    w.finish().unwrap();
    let e = ScFoundation::load(&ctx.path("short.ckpt")).err().unwrap().to_string();
    assert!(e.contains("short.ckpt") && e.contains("tensor `") && e.contains("fewer than the tensor needs"), "{e}");
}

#[test]
fn scfoundation_embed_needs_its_weights() {
    assert_embed_needs_weights("scfoundation", "scfoundation-models-ckpt");
}

/// A weights folder holding the fixture files where weights.toml puts scFoundation's, and a
/// manifest (weights.toml less the real gene list's size and sha256, which the small fixture
/// list cannot match) for $SCFOUNDRY_MANIFEST.
fn weights_with(ctx: &TestContext) -> (PathBuf, PathBuf) {
    let manifest = manifest_without_checksum(ctx, "scfoundation-gene-index");
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    let (ckpt, index) = scfoundation::files(&w, &man);
    std::fs::create_dir_all(ckpt.parent().unwrap()).unwrap();
    std::fs::copy(dir().join("models.ckpt"), &ckpt).unwrap();
    std::fs::copy(dir().join("gene_index.tsv"), &index).unwrap();
    (w, manifest)
}

#[test]
fn scfoundation_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let (w, manifest) = weights_with(&ctx);
    let env = [("SCFOUNDRY_MANIFEST", manifest.as_path())];
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    // the fixture model knows 90 of the data's 765 genes (19% of the counts): below --min-gene-match's default
    let r = ctx.run_env(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scfoundation", "--min-gene-match", "0", "-d", "cells.h5ad"], &env);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scfoundation", "--min-gene-match", "0", "-d", "cells.h5ad", "--batch-size", "4"], &env, "X_scfoundation", 2, 0);
    assert!(r.stderr.contains("90 of the model's 98 genes are in the data; 8 are zero-filled"), "{}", r.stderr);
    let out = ctx.path("cells.scfoundation.h5ad");
    let h = hdf5::File::open(&out).unwrap();
    let ds = h.dataset("obsm/X_scfoundation").unwrap();
    let dim = ds.shape()[1];
    let got = ds.read_raw::<f32>().unwrap();
    assert_eq!((got.len() / dim, dim), (50, 128));
    let err = max_rel_err(&got, &f["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    let p = |k: &str| -> i64 { h.dataset(&format!("uns/scfoundry/parameters/{k}")).unwrap().read_scalar().unwrap() };
    assert_eq!(p("genes_zero_filled"), 8);
    assert_eq!(p("layers"), 2);
    // a checkpoint whose position table does not fit the gene list
    let (_, index) = scfoundation::files(&w, &scfoundry::weights::Manifest::builtin());
    std::fs::write(&index, "gene_name\tindex\nCD3E\t0\nCD4\t1\n").unwrap();
    let r = ctx.run_env(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scfoundation", "--min-gene-match", "0", "-d", "cells.h5ad", "-o", "again.h5ad"], &env);
    r.user_error().stderr_has("do not belong together");
    assert!(!ctx.path("again.h5ad").exists());
}

/// `--model-dir` with a folder as the repository lays it out (models/models.ckpt,
/// OS_scRNA_gene_index.19264.tsv) and no weights folder: the weights folder's embedding bit for
/// bit, with the folder and the files' sha256 in the provenance (a folder's files are not held to
/// weights.toml's pins, so the small gene index needs no manifest); a folder with models.ckpt as
/// the SharePoint share names it but no gene index is refused before the run, naming the folder
/// and the file.
#[test]
fn scfoundation_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    let (w, manifest) = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    let args = ["embed", "-m", "scfoundation", "--min-gene-match", "0", "-d", "cells.h5ad"];
    ctx.run_env(&[&["--weights-dir", w.to_str().unwrap()][..], &args[..], &["-o", "w.h5ad"]].concat(), &[("SCFOUNDRY_MANIFEST", manifest.as_path())]).success();
    let files = [(dir().join("models.ckpt"), "models/models.ckpt"), (dir().join("gene_index.tsv"), "OS_scRNA_gene_index.19264.tsv")];
    let m = crate::common::model_folder(&ctx.path("scFoundation"), &files);
    let r = ctx.run(&[&args[..], &["-o", "m.h5ad", "--model-dir", m.to_str().unwrap()]].concat());
    r.success();
    assert!(r.stderr.contains("90 of the model's 98 genes are in the data; 8 are zero-filled"), "{}", r.stderr);
    let shas = [("scfoundation-models-ckpt", files[0].0.clone()), ("scfoundation-gene-index", files[1].0.clone())];
    crate::common::assert_model_dir_run(&ctx.path("m.h5ad"), &ctx.path("w.h5ad"), "X_scfoundation", &m, &shas);
    let (got, dim) = crate::common::read_obsm(&ctx.path("m.h5ad"), "X_scfoundation");
    let err = max_rel_err(&got, &f["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    let share = crate::common::model_folder(&ctx.path("share"), &[(dir().join("models.ckpt"), "models.ckpt")]);
    crate::common::assert_model_dir_lacks(&ctx, &[&args[..], &["-o", "x.h5ad", "--model-dir", share.to_str().unwrap()]].concat(), "scfoundation", &share, "OS_scRNA_gene_index.19264.tsv", "x.h5ad");
}
