//! uce against upstream UCE's code path (committed fixture tests/fixtures/uce/, made by
//! scripts/uce_reference.py with torch; CI never installs torch): a small checkpoint in the
//! upstream format (a TransformerModel state_dict saved with torch.save as a .torch file), the
//! species files in upstream's formats (protein-embedding .pt, species_offsets.pkl,
//! species_chrom.csv), and the kept genes, token ids of each cell's sentence and cell
//! embeddings that upstream's code gives for demo cells (numpy seeded per cell). Genes and
//! tokens must be identical, embeddings within 1e-4 relative error. Also: bfloat16, the
//! batch-size independence, bad species files, and the embed command's checks.

use std::path::PathBuf;

use candle_core::{DType, Device};
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::uce::{self, cell_counts, cells_expressing, protein_embedding_genes, sentence, species_offset, ChromTable, Config, GeneMap, Uce};

use crate::common::{max_rel_err, repo, TestContext, Tiny};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/uce")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn config(f: &Value) -> Config {
    let c = &f["config"];
    let u = |k: &str| c[k].as_u64().unwrap();
    Config {
        nhead: u("nhead") as usize,
        pad_length: u("pad_length") as usize,
        sample_size: u("sample_size") as usize,
        pad_token_idx: u("pad_token_idx") as u32,
        chrom_token_right_idx: u("chrom_token_right_idx") as u32,
        cls_token_idx: u("cls_token_idx") as u32,
        chrom_token_offset: u("CHROM_TOKEN_OFFSET") as i64,
        ..Config::default()
    }
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The fixture's data through our gene map and sampler: (names kept, map, sentences).
fn ours(f: &Value) -> (Vec<String>, GeneMap, Vec<Vec<u32>>) {
    crate::common::no_hdf5_locking();
    let cfg = config(f);
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let x = ad.matrix(None).unwrap();
    let expressing = cells_expressing(&x, ad.n_vars).unwrap();
    let pe = protein_embedding_genes(&dir().join(uce::HUMAN_PE_FILE)).unwrap();
    let offset = species_offset(&dir().join("species_offsets.pkl"), "human").unwrap();
    let chroms = ChromTable::load(&dir().join("species_chrom.csv"), "human").unwrap();
    let map = GeneMap::new(&ad.var_names, &expressing, cfg.min_cells, &pe, offset, &chroms);
    let kept: Vec<String> = ad.var_names.iter().zip(&map.kept).filter(|(_, k)| k.is_some()).map(|(n, _)| n.clone()).collect();
    let seed = f["seed"].as_u64().unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    let sentences = (0..ad.n_obs)
        .map(|i| {
            let (idx, vals) = b.row(i);
            let (g, c) = cell_counts(idx, vals, &map).unwrap();
            sentence(&g, &c, &map, &cfg, seed, i).unwrap().expect("cell has counts")
        })
        .collect();
    (kept, map, sentences)
}

#[test]
fn uce_genes_and_tokens_match_upstream() {
    let f = fixture();
    let (kept, map, sentences) = ours(&f);
    let g = &f["genes"];
    let want_kept: Vec<String> = g["kept"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    assert_eq!(kept, want_kept);
    assert_eq!(map.token, u32s(&g["token_ids"]), "token of each kept gene (position in the upper-cased embedding keys + offset)");
    let codes: Vec<i64> = g["chrom_codes"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    assert_eq!(map.chrom, codes);
    // 765 genes: 265 expressed in fewer than 10 cells, 76 of the rest without an embedding
    assert_eq!(map.filtered as u64, g["in_data"].as_u64().unwrap() - g["after_filter_genes"].as_u64().unwrap());
    assert_eq!(map.no_embedding as u64, g["after_filter_genes"].as_u64().unwrap() - g["with_embedding"].as_u64().unwrap());
    assert!(map.no_embedding > 0 && map.filtered > 0);
    assert_eq!(map.no_chromosome, 0);
    let want = f["sentences"].as_array().unwrap();
    assert_eq!(sentences.len(), want.len());
    for (i, (s, w)) in sentences.iter().zip(want).enumerate() {
        assert_eq!(s, &u32s(w), "cell {i}: sentence differs from upstream's");
    }
    // sentences of different lengths, so that batches pad
    let lens: std::collections::BTreeSet<usize> = sentences.iter().map(Vec::len).collect();
    assert!(lens.len() > 1, "{lens:?}");
    // another seed draws other genes
    let cfg = config(&f);
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let b = ad.matrix(None).unwrap().read_rows(0, 1).unwrap();
    let (g0, c0) = cell_counts(b.row(0).0, b.row(0).1, &map).unwrap();
    let other = sentence(&g0, &c0, &map, &cfg, 1, 0).unwrap().unwrap();
    assert_ne!(other, sentences[0]);
}

#[test]
fn uce_embeddings_match_upstream_at_any_batch_size() {
    let f = fixture();
    let (_, _, sentences) = ours(&f);
    let model = Uce::load(&dir().join("tiny.torch"), config(&f)).unwrap();
    let c = &f["config"];
    assert_eq!(model.dims.nlayers as u64, c["nlayers"].as_u64().unwrap());
    assert_eq!(model.dims.token_dim as u64, c["token_dim"].as_u64().unwrap());
    assert_eq!(model.dim() as u64, c["output_dim"].as_u64().unwrap());
    let dim = model.dim();
    let refs: Vec<&[u32]> = sentences.iter().map(|s| s.as_slice()).collect();
    let mut rows = Vec::new();
    for batch in refs.chunks(7) {
        rows.extend(model.embed(batch).unwrap());
    }
    let err = max_rel_err(&rows, &f["embeddings"], dim);
    eprintln!("uce float32: largest relative error {err:.3e} over {} cells", refs.len());
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    // one cell alone gives the same row as in its batch of 7 (cells packed, unlike upstream)
    let alone = model.embed(&refs[3..4]).unwrap();
    let d: f32 = alone.iter().zip(&rows[3 * dim..4 * dim]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(d < 1e-5, "{d}");
    // upstream's own batches of 25 differ from cells alone: the fixture says by how much
    assert!(f["upstream_batched_25"]["max_abs_diff"].as_f64().unwrap() > 1e-5);
}

#[test]
fn uce_runs_in_bfloat16() {
    let f = fixture();
    let (_, _, sentences) = ours(&f);
    let model = Uce::load_on(&dir().join("tiny.torch"), config(&f), DType::BF16, Device::Cpu).unwrap();
    let refs: Vec<&[u32]> = sentences.iter().take(4).map(|s| s.as_slice()).collect();
    let rows = model.embed(&refs).unwrap();
    let dim = model.dim();
    let want = f["embeddings"].as_array().unwrap();
    for i in 0..4 {
        let w: Vec<f64> = want[i].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let cos: f64 = rows[i * dim..(i + 1) * dim].iter().zip(&w).map(|(a, b)| *a as f64 * b).sum();
        eprintln!("uce bfloat16: cell {i} cosine {cos:.4} to the float32 reference");
        assert!(cos > 0.9, "cell {i}: cosine {cos} in bfloat16");
    }
}

#[test]
fn uce_bad_species_files() {
    let ctx = TestContext::new();
    // no protein-embedding file: the error names it
    let missing = ctx.path("protein_embeddings/Homo_sapiens.GRCh38.gene_symbol_to_embedding_ESM2.pt");
    let e = protein_embedding_genes(&missing).unwrap_err();
    assert!(e.to_string().contains("Homo_sapiens.GRCh38.gene_symbol_to_embedding_ESM2.pt"), "{e}");
    // not a torch file
    std::fs::write(ctx.path("junk.pt"), b"not a zip").unwrap();
    let e = protein_embedding_genes(&ctx.path("junk.pt")).unwrap_err();
    assert!(e.to_string().contains("junk.pt") && e.to_string().contains("protein embeddings"), "{e}");
    // an offsets file without the species
    let e = species_offset(&dir().join("species_offsets.pkl"), "zebrafish").unwrap_err();
    assert!(e.to_string().contains("species_offsets.pkl") && e.to_string().contains("zebrafish"), "{e}");
    // a chromosome table without the columns
    std::fs::write(ctx.path("c.csv"), "species,symbol,chromosome,start\nhuman,A,1,5\n").unwrap();
    let e = ChromTable::load(&ctx.path("c.csv"), "human").unwrap_err();
    assert!(e.to_string().contains("c.csv") && e.to_string().contains("gene_symbol"), "{e}");
    // the checkpoint must be a UCE state_dict
    let e = Uce::load(&repo().join("tests/fixtures/scgpt/best_model_inproj.pt"), Config::default()).err().expect("a scGPT checkpoint is not UCE's");
    assert!(e.to_string().contains("pe_embedding.weight"), "{e}");
    // a token beyond the checkpoint's table
    let f = fixture();
    let model = Uce::load(&dir().join("tiny.torch"), config(&f)).unwrap();
    assert!(model.check_tokens(model.dims.tokens as u32).is_err());
    assert!(model.check_tokens(model.dims.tokens as u32 - 1).is_ok());
}

#[test]
fn uce_embed_needs_its_weights() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "--method", "uce", "--data", "t.h5ad"]);
    r.user_error().stderr_has("weights for uce are not in").stderr_has("uce-33l-model").has_hint();
    let r = ctx.run(&["embed", "--method", "uce", "--data", "t.h5ad", "--nlayers", "4"]);
    r.user_error().stderr_has("uce-4l-model");
    let r = ctx.run(&["embed", "--method", "uce", "--data", "t.h5ad", "--nlayers", "12"]);
    r.user_error().stderr_has("--nlayers").stderr_has("33");
    assert!(!ctx.path("t.uce.h5ad").exists());
}

/// A weights folder holding the fixture files where weights.toml puts UCE's (33-layer name).
fn weights_with(ctx: &TestContext) -> PathBuf {
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    let (model, pe, chrom, offsets) = uce::files(&w, &man, 33).unwrap();
    std::fs::create_dir_all(pe.parent().unwrap()).unwrap();
    std::fs::copy(dir().join("tiny.torch"), &model).unwrap();
    std::fs::copy(dir().join(uce::HUMAN_PE_FILE), &pe).unwrap();
    std::fs::copy(dir().join("species_chrom.csv"), &chrom).unwrap();
    std::fs::copy(dir().join("species_offsets.pkl"), &offsets).unwrap();
    // the archive entry itself must be present (pull keeps it beside what it extracts)
    std::fs::write(w.join(&man.weights["uce-esm2-human-protein-embeddings"].file), b"archive").unwrap();
    w
}

#[test]
fn uce_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "uce", "-d", "cells.h5ad", "--batch-size", "8"]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "uce", "-d", "cells.h5ad", "--batch-size", "8"], &[], "X_uce", 3, 0);
    assert!(r.stderr.contains("424 of 765 genes are embedded"), "{}", r.stderr);
    assert!(r.stderr.contains("chromosome tokens start at row 1200"), "{}", r.stderr);
    let out = ctx.path("cells.uce.h5ad");
    let h = hdf5::File::open(&out).unwrap();
    let ds = h.dataset("obsm/X_uce").unwrap();
    let dim = ds.shape()[1];
    let got = ds.read_raw::<f32>().unwrap();
    assert_eq!((got.len() / dim, dim), (50, 16));
    let err = max_rel_err(&got, &f["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    let p = |k: &str| -> i64 { h.dataset(&format!("uns/scfoundry/parameters/{k}")).unwrap().read_scalar().unwrap() };
    assert_eq!(p("genes_embedded"), 424);
    assert_eq!(p("genes_without_embedding"), 76);
    assert_eq!(p("nlayers"), 2);
    assert_eq!(p("batch_size"), 8);
}

/// A gene expressed in exactly 10 cells (upstream's min_cells), 4, 3 and 3 of them in the three
/// shards: the fit counts over all cells, so every shard keeps it, as the whole run does.
#[test]
fn uce_shards_keep_a_gene_expressed_across_shards() {
    crate::common::no_hdf5_locking();
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    let cfg = config(&f);
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let x = ad.matrix(None).unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    let (n, g) = (ad.n_obs, ad.n_vars);
    let mut dense = vec![0f32; n * g];
    for i in 0..n {
        let (idx, vals) = b.row(i);
        for (&j, &v) in idx.iter().zip(vals) {
            dense[i * g + j as usize] = v;
        }
    }
    let pe = protein_embedding_genes(&dir().join(uce::HUMAN_PE_FILE)).unwrap();
    let offset = species_offset(&dir().join("species_offsets.pkl"), "human").unwrap();
    let chroms = ChromTable::load(&dir().join("species_chrom.csv"), "human").unwrap();
    let expressing = cells_expressing(&x, g).unwrap();
    let before = GeneMap::new(&ad.var_names, &expressing, cfg.min_cells, &pe, offset, &chroms);
    let all = GeneMap::new(&ad.var_names, &vec![cfg.min_cells; g], cfg.min_cells, &pe, offset, &chroms);
    // a gene upstream's filter drops here, that it would keep in 10 cells
    let j0 = (0..g).find(|&j| before.kept[j].is_none() && all.kept[j].is_some() && expressing[j] > 0).expect("a filtered gene with an embedding");
    assert_eq!(cfg.min_cells, 10);
    // blocks of 8 rows, 3 shards of 50 cells: 0..16, 16..32, 32..50
    let cells = [1, 5, 9, 13, 17, 22, 28, 35, 40, 49];
    for i in 0..n {
        dense[i * g + j0] = if cells.contains(&i) { 3.0 } else { 0.0 };
    }
    Tiny { n_obs: n, n_vars: g, x: dense, obs_names: ad.obs_names.clone(), var_names: ad.var_names.clone(), write_x: true, obs_cols: vec![], obsm: vec![] }.write(&ctx.path("ten.h5ad"));
    let w = w.to_str().unwrap();
    crate::common::assert_shards_equal(&ctx, &["--weights-dir", w, "embed", "-m", "uce", "-d", "ten.h5ad", "--batch-size", "8"], &[], "X_uce", 3, 0);
    for out in ["whole-X_uce.h5ad", "sharded-X_uce.h5ad"] {
        let h = hdf5::File::open(ctx.path(out)).unwrap();
        let kept: i64 = h.dataset("uns/scfoundry/parameters/genes_embedded").unwrap().read_scalar().unwrap();
        assert_eq!(kept as usize, before.n_kept() + 1, "{out}: the gene in 10 cells is kept");
    }
}

/// `--model-dir` with UCE's model_files folder as eval_single_anndata.py leaves it (the model,
/// species_chrom.csv, species_offsets.pkl, protein_embeddings/ extracted from its archive) and no
/// weights folder: the weights folder's embedding bit for bit, with the folder and the files'
/// sha256 in the provenance. A folder without the extracted protein embeddings, or without the
/// model --nlayers names, is refused before the run, naming the folder and the file.
#[test]
fn uce_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("cells.h5ad")).unwrap();
    let args = ["embed", "-m", "uce", "-d", "cells.h5ad", "--batch-size", "8"];
    ctx.run(&[&["--weights-dir", w.to_str().unwrap()][..], &args[..], &["-o", "w.h5ad"]].concat()).success();
    let files = [
        (dir().join("tiny.torch"), "33l_8ep_1024t_1280.torch"),
        (dir().join("species_chrom.csv"), "species_chrom.csv"),
        (dir().join("species_offsets.pkl"), "species_offsets.pkl"),
        (dir().join(uce::HUMAN_PE_FILE), uce::HUMAN_PE_FILE),
    ];
    let m = crate::common::model_folder(&ctx.path("model_files"), &files);
    let r = ctx.run(&[&args[..], &["-o", "m.h5ad", "--model-dir", m.to_str().unwrap()]].concat());
    r.success();
    assert!(r.stderr.contains("424 of 765 genes are embedded"), "{}", r.stderr);
    let shas = [("uce-33l-model", dir().join("tiny.torch")), ("uce-species-chrom", dir().join("species_chrom.csv")), ("uce-species-offsets", dir().join("species_offsets.pkl"))];
    crate::common::assert_model_dir_run(&ctx.path("m.h5ad"), &ctx.path("w.h5ad"), "X_uce", &m, &shas);
    let (got, dim) = crate::common::read_obsm(&ctx.path("m.h5ad"), "X_uce");
    let err = max_rel_err(&got, &f["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "largest relative error {err:.3e}");
    // the 4-layer model is not in the folder
    let a = [&args[..], &["-o", "x.h5ad", "--model-dir", m.to_str().unwrap()]].concat();
    crate::common::assert_model_dir_lacks(&ctx, &[&a[..], &["--nlayers", "4"]].concat(), "uce", &m, "4layer_model.torch", "x.h5ad");
    // the archive was not extracted
    std::fs::remove_dir_all(m.join("protein_embeddings")).unwrap();
    crate::common::assert_model_dir_lacks(&ctx, &a, "uce", &m, uce::HUMAN_PE_FILE, "x.h5ad");
}
