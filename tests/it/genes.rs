//! Gene ids that just work (src/tasks/genes.rs, docs/genes.md): one `--gene-column` for every
//! method, symbols and Ensembl ids mapped through the offline human and mouse tables, the match
//! reported ("N of M genes matched the model's vocabulary (K% of the counts)") in the output's
//! provenance and report.json, and a run that stops below `--min-gene-match`.
//!
//! Fixtures (tests/fixtures/genes/, scripts/make_gene_fixtures.py): the geneformer fixture's
//! cells with symbols only, and demo cells with versioned Ensembl ids only.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::{read_obsm, repo, TestContext, Tiny};

fn genes_fx(name: &str) -> PathBuf {
    repo().join("tests/fixtures/genes").join(name)
}

/// The report.json of the only run in `runs`.
fn report(runs: &Path) -> Value {
    let run = std::fs::read_dir(runs).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).expect("a run folder");
    serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap()
}

fn read_str(path: &Path, name: &str) -> String {
    let s: hdf5::types::VarLenUnicode = hdf5::File::open(path).unwrap().dataset(name).unwrap().read_scalar().unwrap();
    s.as_str().to_string()
}

/// A file with gene symbols only (no Ensembl column) embeds with Geneformer through the map:
/// the same tokens, so the same embedding as the fixture's Ensembl ids give upstream; the match
/// is printed, kept in the provenance and in report.json.
#[test]
fn geneformer_embeds_a_symbols_only_file_through_the_map() {
    let ctx = TestContext::new();
    std::fs::copy(genes_fx("pbmc68k_50_symbols.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let dir = crate::geneformer::fx().join("v1");
    let runs = ctx.path("runs");
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap(), "--runs-dir", runs.to_str().unwrap()]);
    r.success();
    assert!(r.stderr.contains("note: 600 of 765 genes matched the model's vocabulary ("), "{}", r.stderr);
    assert!(r.stderr.contains("var_names (gene symbols, 700 mapped to Ensembl ids through the offline GENCODE 44 table"), "{}", r.stderr);
    let out = ctx.path("cells.geneformer.h5ad");
    let (got, dim) = read_obsm(&out, "X_geneformer");
    let err = crate::geneformer::max_rel(&got, &crate::geneformer::matrix(&crate::geneformer::reference()["v1"]["embeddings"]["emb_layer_-1_cell"]), dim);
    assert!(err < crate::geneformer::MAX_REL, "symbols through the map: max relative error {err}");
    assert_eq!(read_str(&out, "uns/scfoundry/parameters/gene_column"), "index");
    let m = &report(&runs)["tasks"][0]["result"]["gene_match"];
    assert_eq!((m["genes"].as_u64(), m["matched"].as_u64(), m["mapped"].as_u64()), (Some(765), Some(600), Some(700)), "{m}");
    assert_eq!((m["found"].as_str(), m["model_reads"].as_str(), m["column"].as_str()), (Some("symbols"), Some("ensembl"), Some("var_names")), "{m}");
    let share = m["count_share"].as_f64().unwrap();
    assert!(share > 0.5 && share < 1.0, "{m}");
    assert!(m["map_source"].as_str().unwrap().contains("GENCODE release 44"), "{m}");
}

/// A file with versioned Ensembl ids only embeds with scGPT through the reverse map: the
/// symbols it gets back are the demo's, so the embedding is upstream's.
#[test]
fn scgpt_embeds_versioned_ensembl_ids_through_the_reverse_map() {
    let ctx = TestContext::new();
    let w = crate::scgpt::weights_with(&ctx, &crate::scgpt::fixture_dir().join("tiny"));
    std::fs::copy(genes_fx("pbmc68k_50_versioned.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "scgpt", "-d", "cells.h5ad", "--batch-size", "16"]);
    r.success();
    assert!(r.stderr.contains("note: 680 of 765 genes matched the model's vocabulary ("), "{}", r.stderr);
    assert!(r.stderr.contains("var_names (Ensembl ids, 700 mapped to gene symbols through the offline GENCODE 44 table, 700 version suffixes stripped)"), "{}", r.stderr);
    let out = ctx.path("cells.scgpt.h5ad");
    let (got, dim) = read_obsm(&out, "X_scgpt");
    let f = crate::scgpt::fixture();
    let case = &f["cases"][0];
    let n = case["n_cells"].as_u64().unwrap() as usize;
    assert_eq!(got.len() / dim, n);
    let (rel, _) = crate::scgpt::compare(&got, &case["embeddings"], dim);
    assert!(rel <= crate::scgpt::MAX_REL_ERR, "versioned ids through the map: max relative error {rel}");
    let matched: i64 = hdf5::File::open(&out).unwrap().dataset("uns/scfoundry/parameters/gene_match/matched").unwrap().read_scalar().unwrap();
    assert_eq!(matched, 680);
}

/// Below the threshold the run stops before embedding, naming the file, the column, the
/// figures and the flag that overrides it; the flag then lets it run.
#[test]
fn a_file_below_the_threshold_stops_with_the_figures_and_the_override() {
    let ctx = TestContext::new();
    std::fs::copy(genes_fx("pbmc68k_50_symbols.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let dir = crate::geneformer::fx().join("v1");
    let d = dir.to_str().unwrap();
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "-o", "x.h5ad", "--model-dir", d, "--min-gene-match", "0.999"]);
    r.user_error()
        .stderr_has("cells.h5ad: var_names: only 600 of 765 genes matched the model's vocabulary (")
        .stderr_has("% of the counts) (var_names read as gene symbols; the minimum is 100% of the counts, --min-gene-match)")
        .stderr_has("--gene-column")
        .stderr_has("--min-gene-match 0");
    assert!(!ctx.path("x.h5ad").exists());
    // genes that are no gene ids at all: 0 matched, whatever the threshold
    let t = Tiny::counts(6, 5);
    t.write(&ctx.path("nomatch.h5ad"));
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "nomatch.h5ad", "--model-dir", d, "--min-gene-match", "0"]);
    r.user_error().stderr_has("nomatch.h5ad: var_names: only 0 of 5 genes matched the model's vocabulary (0.0% of the counts)");
    // a column named by --gene-col (the alias) that is not there
    let r = ctx.run(&["embed", "-m", "geneformer", "-d", "cells.h5ad", "--model-dir", d, "--gene-col", "symbol"]);
    r.user_error().stderr_has("--gene-column").stderr_has("var has no column `symbol`");
    // a method that reads no gene ids warns that it ignores the options
    let r = ctx.run(&["embed", "-m", "pca", "-d", "cells.h5ad", "-o", "p.h5ad", "--n-comps", "5", "--gene-column", "index"]);
    r.success();
    assert!(r.stderr.contains("does not honour --gene-column (it reads no gene ids); ignored"), "{}", r.stderr);
}

/// Mouse Ensembl ids reach a model that reads symbols through the offline mouse table: C2S on a
/// file of mouse Ensembl ids (one with a version suffix) embeds exactly as on the same file with
/// the mouse symbols. Without the mouse table no id would match and the run would stop.
#[test]
fn mouse_ensembl_ids_embed_as_their_symbols() {
    let ctx = TestContext::new();
    let w = crate::c2s::weights_with(&ctx);
    let w = w.to_str().unwrap();
    let pairs = [
        ("ENSMUSG00000032093.9", "Cd3e"),
        ("ENSMUSG00000023274", "Cd4"),
        ("ENSMUSG00000053977", "Cd8a"),
        ("ENSMUSG00000026395", "Ptprc"),
        ("ENSMUSG00000024673", "Ms4a1"),
        ("ENSMUSG00000069516", "Lyz2"),
        ("ENSMUSG00000029580", "Actb"),
        ("ENSMUSG00000059552", "Trp53"),
        // C3 is also a human symbol: the mouse id maps to it all the same
        ("ENSMUSG00000024164", "C3"),
        ("ENSMUSG00000057666", "Gapdh"),
    ];
    let mut t = Tiny::counts(12, pairs.len());
    t.var_names = pairs.iter().map(|(_, s)| s.to_string()).collect();
    t.write(&ctx.path("symbols.h5ad"));
    t.var_names = pairs.iter().map(|(id, _)| id.to_string()).collect();
    t.write(&ctx.path("ids.h5ad"));
    // the symbols run goes to the default runs folder, this one to its own
    let runs = ctx.path("runs-ids");
    let runs_s = runs.to_str().unwrap();
    ctx.run(&["--weights-dir", w, "embed", "-m", "c2s", "-d", "symbols.h5ad", "--seed", "42", "--batch-size", "4"]).success();
    let r = ctx.run(&["--weights-dir", w, "embed", "-m", "c2s", "-d", "ids.h5ad", "--seed", "42", "--batch-size", "4", "--runs-dir", runs_s]);
    r.success();
    assert!(r.stderr.contains("note: 10 of 10 genes matched the model's vocabulary (100.0% of the counts); var_names (Ensembl ids, 10 mapped to gene symbols through the offline Ensembl mouse table, 1 version suffixes stripped)"), "{}", r.stderr);
    let (a, dim) = read_obsm(&ctx.path("symbols.c2s.h5ad"), "X_c2s");
    let (b, _) = read_obsm(&ctx.path("ids.c2s.h5ad"), "X_c2s");
    assert_eq!((a.len() / dim, a == b), (12, true));
    let m = &report(&runs)["tasks"][0]["result"]["gene_match"];
    assert_eq!(m["map_species"], serde_json::json!(["mouse"]), "{m}");
    assert!(m["map_source"].as_str().unwrap().starts_with("mouse: Ensembl BioMart export of the mouse genes"), "{m}");
}
