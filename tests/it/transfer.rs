//! `scfoundry transfer` end to end on real demo cells split into a reference and a query:
//! the predictions equal the library's kNN vote on the same embeddings and scArches' vote on
//! sklearn's neighbours; accuracy and macro-F1 equal scikit-learn's on the written predictions;
//! the query's projection equals numpy's redo from the saved fit; inputs are never modified;
//! anndata reads the output; genes missing from the query warn, too few fail; bad input fails
//! with one clear error.

use std::path::{Path, PathBuf};

use serde_json::Value;

use scfoundry::anndata::{AnnData, Column};
use scfoundry::nn::knn_transfer;

use crate::common::{python, python_json, repo, sha256, TestContext, Tiny};

/// Cells `rows` and genes `genes` of a demo file, with its categorical obs columns, as a Tiny.
fn subset(demo: &str, rows: &[usize], genes: Option<&[usize]>) -> Tiny {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&repo().join("demo").join(demo)).unwrap();
    let x = ad.matrix(None).unwrap();
    let block = x.read_rows(0, ad.n_obs).unwrap();
    let all: Vec<usize> = (0..ad.n_vars).collect();
    let genes = genes.unwrap_or(&all);
    let mut col = vec![usize::MAX; ad.n_vars];
    for (k, &g) in genes.iter().enumerate() {
        col[g] = k;
    }
    let mut dense = vec![0f32; rows.len() * genes.len()];
    for (r, &i) in rows.iter().enumerate() {
        let (idx, vals) = block.row(i);
        for (&j, &v) in idx.iter().zip(vals) {
            if col[j as usize] != usize::MAX {
                dense[r * genes.len() + col[j as usize]] = v;
            }
        }
    }
    let mut t = Tiny::counts(1, 1);
    t.n_obs = rows.len();
    t.n_vars = genes.len();
    t.x = dense;
    t.obs_names = rows.iter().map(|&i| ad.obs_names[i].clone()).collect();
    t.var_names = genes.iter().map(|&g| ad.var_names[g].clone()).collect();
    let obs = ad.obs().unwrap();
    for (name, c) in &obs.columns {
        if let Column::Categorical { .. } = c {
            let labels = c.as_labels().unwrap();
            t = t.with_obs(name, rows.iter().map(|&i| labels[i].clone().unwrap()).collect());
        }
    }
    t
}

/// pbmc68k split by cell parity: even cells are the reference, odd cells the query.
fn pbmc_split(ctx: &TestContext) -> (PathBuf, PathBuf) {
    let even: Vec<usize> = (0..700).step_by(2).collect();
    let odd: Vec<usize> = (1..700).step_by(2).collect();
    let (r, q) = (ctx.path("ref.h5ad"), ctx.path("query.h5ad"));
    subset("pbmc68k_counts.h5ad", &even, None).write(&r);
    subset("pbmc68k_counts.h5ad", &odd, None).write(&q);
    (r, q)
}

fn the_run_dir(ctx: &TestContext) -> PathBuf {
    let runs: Vec<PathBuf> = std::fs::read_dir(ctx.path("runs")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    assert_eq!(runs.len(), 1, "one run folder: {runs:?}");
    runs[0].clone()
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn labels_of(path: &Path, key: &str) -> Vec<String> {
    let ad = AnnData::open(path).unwrap();
    let obs = ad.obs().unwrap();
    obs.column(key).unwrap_or_else(|| panic!("no obs/{key} in {}", path.display())).as_labels().unwrap().into_iter().map(Option::unwrap).collect()
}

#[test]
fn pca_on_pbmc_split_matches_library_sklearn_and_scanpy() {
    let ctx = TestContext::new();
    let (r, q) = pbmc_split(&ctx);
    let (hr, hq) = (sha256(&r), sha256(&q));
    let run = ctx.run(&["transfer", "--method", "pca", "--reference", "ref.h5ad", "--query", "query.h5ad", "--label-key", "cell_type"]);
    run.success().stderr_has("accuracy").stderr_has("query.transfer.h5ad");
    assert_eq!(hr, sha256(&r), "reference modified");
    assert_eq!(hq, sha256(&q), "query modified");
    let out = ctx.path("query.transfer.h5ad");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(ctx.path("query.transfer/transfer.json")).unwrap()).unwrap();
    for f in ["per_label.tsv", "confusion.tsv", "confusion.svg", "confusion.png"] {
        assert!(ctx.path("query.transfer").join(f).is_file(), "report lacks {f}");
    }

    // run folder: a fit, then the two embeddings, all completed, in trace.txt and report.json
    let rd = the_run_dir(&ctx);
    let trace = std::fs::read_to_string(rd.join("trace.txt")).unwrap();
    assert_eq!(trace.lines().count(), 4, "header and three tasks:\n{trace}");
    assert_eq!(trace.matches("COMPLETED").count(), 3, "{trace}");
    assert!(trace.contains("TRANSFER_FIT_PCA (ref, reference)") && trace.contains("TRANSFER_EMBED_PCA (query, query)"), "{trace}");
    let rj: Value = serde_json::from_str(&std::fs::read_to_string(rd.join("report.json")).unwrap()).unwrap();
    assert_eq!(rj["command"], "transfer");

    // the predictions are the library's vote on the same embeddings
    let ref_emb = read_f32(&rd.join("work/reference.f32"));
    let o = AnnData::open(&out).unwrap();
    let (q_emb, nq, d) = o.dense_entry("obsm", "X_pca").unwrap();
    assert_eq!((nq, d), (350, 50));
    assert_eq!(ref_emb.len(), 350 * 50);
    let ref_labels = labels_of(&r, "cell_type");
    let mut cats = ref_labels.clone();
    cats.sort();
    cats.dedup();
    let codes: Vec<u32> = ref_labels.iter().map(|l| cats.binary_search(l).unwrap() as u32).collect();
    let lib = knn_transfer::transfer(&ref_emb, 350, &q_emb, 350, 50, &codes, cats.len(), 15);
    let written = labels_of(&out, "cell_type_pred");
    let lib_names: Vec<String> = lib.predicted.iter().map(|&c| cats[c as usize].clone()).collect();
    assert_eq!(written, lib_names, "written predictions differ from knn_transfer's");
    let obs = o.obs().unwrap();
    let Some(Column::Numeric(conf)) = obs.column("cell_type_pred_confidence") else { panic!("no float confidence column") };
    for (a, b) in conf.iter().zip(&lib.confidence) {
        assert_eq!(*a as f32, *b);
    }

    // scores: well above chance (the largest class is a third of the query)
    let truth = labels_of(&q, "cell_type");
    let acc = report["accuracy"].as_f64().unwrap();
    let hits = truth.iter().zip(&written).filter(|(a, b)| a == b).count();
    assert_eq!(acc, hits as f64 / 350.0);
    let majority = cats.iter().map(|c| truth.iter().filter(|t| *t == c).count()).max().unwrap() as f64 / 350.0;
    eprintln!("pbmc68k parity split, pca, k=15: accuracy {acc:.4} (largest class {majority:.3}), macro-F1 {}", report["macro_f1"]);
    assert!(acc > 0.7 && acc > 2.0 * majority, "accuracy {acc} vs largest class {majority}");
    assert_eq!(report["n_scored"], 350);

    let Some(py) = python() else { return };
    let k = Path::new("15");
    let m = python_json(&py, "transfer_check.py", &[&q, &out, &rd, Path::new("cell_type"), k, &r]);
    for key in ["obs_kept", "obs_names_equal", "X_equal", "sklearn_vote_equal"] {
        assert_eq!(m[key], true, "{key}: {m}");
    }
    assert_eq!(m["pred_dtype"], "category", "{m}");
    assert_eq!(m["conf_dtype"], "float32", "{m}");
    assert_eq!(m["uns_command"], "transfer");
    assert!((m["accuracy"].as_f64().unwrap() - acc).abs() < 1e-12, "sklearn accuracy {} vs ours {acc}", m["accuracy"]);
    assert!((m["macro_f1"].as_f64().unwrap() - report["macro_f1"].as_f64().unwrap()).abs() < 1e-12, "sklearn macro-F1 {} vs ours {}", m["macro_f1"], report["macro_f1"]);
    assert_eq!(m["confusion_labels"], report["confusion"]["labels"], "{m}");
    assert_eq!(m["confusion"], report["confusion"]["counts"], "{m}");
    assert!(m["confidence_max_abs_diff"].as_f64().unwrap() < 1e-5, "{m}");
    let diff = m["projection_max_abs_diff"].as_f64().unwrap();
    assert!(diff < 1e-4 * m["projection_scale"].as_f64().unwrap().max(1.0), "query projection differs from numpy by {diff}: {m}");
}

#[test]
fn missing_query_genes_warn_and_too_few_fail() {
    let ctx = TestContext::new();
    let even: Vec<usize> = (0..700).step_by(2).collect();
    let odd: Vec<usize> = (1..700).step_by(2).collect();
    subset("pbmc68k_counts.h5ad", &even, None).write(&ctx.path("ref.h5ad"));
    // every third gene dropped: about a third of the HVGs missing, still above half
    let some: Vec<usize> = (0..765).filter(|g| g % 3 != 0).collect();
    subset("pbmc68k_counts.h5ad", &odd, Some(&some)).write(&ctx.path("q_some.h5ad"));
    let r = ctx.run(&["transfer", "-m", "pca", "-r", "ref.h5ad", "--query", "q_some.h5ad", "--label-key", "cell_type", "--max-forks", "1"]);
    r.success().stderr_has("warning: ").stderr_has("highly variable genes are missing from").stderr_has("count as zero");
    let rep: Value = serde_json::from_str(&std::fs::read_to_string(ctx.path("q_some.transfer/transfer.json")).unwrap()).unwrap();
    assert!(rep["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().contains("missing")), "{rep}");
    eprintln!("a third of the genes missing: accuracy {}", rep["accuracy"]);
    // two genes in three dropped: below the 50% default
    let few: Vec<usize> = (0..765).filter(|g| g % 3 == 0).collect();
    subset("pbmc68k_counts.h5ad", &odd, Some(&few)).write(&ctx.path("q_few.h5ad"));
    let r = ctx.run(&["transfer", "-m", "pca", "-r", "ref.h5ad", "--query", "q_few.h5ad", "--label-key", "cell_type"]);
    r.failed().stderr_has("q_few.h5ad").stderr_has("ref.h5ad").stderr_has("highly variable genes").stderr_has("50%").stderr_has("--min-gene-overlap");
    assert!(!ctx.path("q_few.transfer.h5ad").exists());
}

#[test]
fn query_without_labels_gets_predictions_only() {
    let ctx = TestContext::new();
    let rows: Vec<usize> = (0..120).collect();
    let mut q = subset("pbmc68k_counts.h5ad", &(120..180).collect::<Vec<_>>(), None);
    q.obs_cols.clear();
    subset("pbmc68k_counts.h5ad", &rows, None).write(&ctx.path("ref.h5ad"));
    q.write(&ctx.path("q.h5ad"));
    let r = ctx.run(&["transfer", "-m", "pca", "-r", "ref.h5ad", "--query", "q.h5ad", "--label-key", "cell_type", "-k", "5", "--n-comps", "10", "--batch-size", "64", "-o", "out/labelled.h5ad"]);
    r.success().stderr_has("pca does not honour --batch-size when transferring labels; ignored");
    let rep: Value = serde_json::from_str(&std::fs::read_to_string(ctx.path("out/labelled/transfer.json")).unwrap()).unwrap();
    assert_eq!(rep["scored"], false);
    assert_eq!(rep["embedding"]["dim"], 10);
    assert!(!ctx.path("out/labelled/confusion.png").exists());
    assert_eq!(labels_of(&ctx.path("out/labelled.h5ad"), "cell_type_pred").len(), 60);
}

#[test]
fn bad_input_fails_with_one_clear_error() {
    let ctx = TestContext::new();
    let rows: Vec<usize> = (0..40).collect();
    subset("pbmc68k_counts.h5ad", &rows, None).write(&ctx.path("ref.h5ad"));
    subset("pbmc68k_counts.h5ad", &(40..60).collect::<Vec<_>>(), None).write(&ctx.path("q.h5ad"));
    let t = |extra: &[&str]| {
        let mut a = vec!["transfer", "-r", "ref.h5ad", "--query", "q.h5ad"];
        a.extend_from_slice(extra);
        ctx.run(&a)
    };
    // label key missing in the reference: the file, the field and the columns there are
    t(&["-m", "pca", "--label-key", "celltype"]).user_error().stderr_has("ref.h5ad: obs/celltype: is missing").stderr_has("hint: pass --label-key with one of the obs columns of this file: ").stderr_has("cell_type");
    // k larger than the reference
    t(&["-m", "pca", "--label-key", "cell_type", "-k", "41"]).user_error().stderr_has("k = 41").stderr_has("40 labelled cell(s)").has_hint();
    // an integration method cannot embed a query
    t(&["-m", "harmony", "--label-key", "cell_type"]).user_error().stderr_has("harmony is an integration method").has_hint();
    // registered but not implemented
    t(&["-m", "scgpt", "--label-key", "cell_type"]).user_error().stderr_has("not implemented").has_hint();
    t(&["-m", "pcaa", "--label-key", "cell_type"]).user_error().stderr_has("did you mean `pca`?");
    // the output may not be an input
    t(&["-m", "pca", "--label-key", "cell_type", "-o", "q.h5ad"]).user_error().stderr_has("transfer never modifies its inputs");
    t(&["-m", "pca", "--label-key", "cell_type", "--pred-key", "cell_type"]).user_error().stderr_has("overwrite the query's labels");
    t(&["-m", "pca", "--label-key", "cell_type", "-k", "0"]).failed();
    t(&["-m", "pca", "--label-key", "cell_type", "--min-gene-overlap", "1.5"]).failed().stderr_has("not between 0 and 1");
    // a missing query file is named
    ctx.run(&["transfer", "-m", "pca", "-r", "ref.h5ad", "--query", "nope.h5ad", "--label-key", "cell_type"]).user_error().stderr_has("nope.h5ad: no such file");
    assert!(!ctx.path("runs").exists(), "no run folder for input that fails the checks");
}

#[test]
fn cellama_embeds_both_files_at_once() {
    let ctx = TestContext::new();
    let Some(weights) = crate::cellama::minilm_weights(&ctx) else { return };
    subset("pbmc68k_counts.h5ad", &(0..96).collect::<Vec<_>>(), None).write(&ctx.path("ref.h5ad"));
    subset("pbmc68k_counts.h5ad", &(96..128).collect::<Vec<_>>(), None).write(&ctx.path("q.h5ad"));
    let w = weights.display().to_string();
    let r = ctx.run(&["--weights-dir", &w, "transfer", "-m", "cellama", "-r", "ref.h5ad", "--query", "q.h5ad", "--label-key", "cell_type", "--n-comps", "5"]);
    r.success().stderr_has("cellama does not honour --n-comps; ignored");
    let rd = the_run_dir(&ctx);
    let trace = std::fs::read_to_string(rd.join("trace.txt")).unwrap();
    assert_eq!(trace.matches("TRANSFER_EMBED_CELLAMA").count(), 2, "{trace}");
    let o = AnnData::open(&ctx.path("q.transfer.h5ad")).unwrap();
    let (q_emb, n, d) = o.dense_entry("obsm", "X_cellama").unwrap();
    assert_eq!((n, d), (32, 384));
    let ref_emb = read_f32(&rd.join("work/reference.f32"));
    let ref_labels = labels_of(&ctx.path("ref.h5ad"), "cell_type");
    let mut cats = ref_labels.clone();
    cats.sort();
    cats.dedup();
    let codes: Vec<u32> = ref_labels.iter().map(|l| cats.binary_search(l).unwrap() as u32).collect();
    let lib = knn_transfer::transfer(&ref_emb, 96, &q_emb, 32, 384, &codes, cats.len(), 15);
    let names: Vec<String> = lib.predicted.iter().map(|&c| cats[c as usize].clone()).collect();
    assert_eq!(labels_of(&ctx.path("q.transfer.h5ad"), "cell_type_pred"), names);
}

#[test]
fn help() {
    let ctx = TestContext::new();
    let r = ctx.run(&["transfer", "--help"]);
    r.success();
    insta::assert_snapshot!("transfer_help", r.stdout);
}

/// The bytes of the predictions, confidences and query embedding of a transfer output.
fn transfer_bytes(path: &Path, obsm: &str) -> (Vec<String>, Vec<u8>, Vec<u8>) {
    let f = hdf5::File::open(path).unwrap();
    let conf = f.dataset("obs/cell_type_pred_confidence").unwrap().read_raw::<f32>().unwrap();
    let emb = f.dataset(&format!("obsm/{obsm}")).unwrap().read_raw::<f32>().unwrap();
    let b = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    (labels_of(path, "cell_type_pred"), b(conf), b(emb))
}

/// `--executor slurm`: the fit job, then the reference and query embeddings as two jobs that
/// both wait for it (not for each other); the result equals the local run's byte for byte.
#[test]
fn slurm_transfer_equals_the_local_run() {
    let Some(conf) = crate::orchestration::slurm_conf() else { return };
    let ctx = TestContext::new();
    pbmc_split(&ctx);
    let args = ["transfer", "-m", "pca", "--reference", "ref.h5ad", "--query", "query.h5ad", "--label-key", "cell_type", "--seed", "4"];
    ctx.run(&[&args[..], &["-o", "local.h5ad", "--runs-dir", "runs-local"]].concat()).success();
    let out = std::process::Command::new(crate::common::BIN)
        .args(args)
        .args(["-o", "slurm.h5ad", "--runs-dir", "runs-slurm", "--executor", "slurm", "--time", "10", "--mem", "500M", "--cpus", "1"])
        .current_dir(ctx.dir.path())
        .env("SLURM_CONF", &conf)
        .env("SCFOUNDRY_NO_PROGRESS", "1")
        .env("SCFOUNDRY_WEIGHTS_DIR", ctx.path("w"))
        .output()
        .unwrap();
    let r = crate::common::Run::from(out);
    r.success().stderr_has("accuracy");
    assert_eq!(transfer_bytes(&ctx.path("local.h5ad"), "X_pca"), transfer_bytes(&ctx.path("slurm.h5ad"), "X_pca"), "Slurm's transfer differs from the local run");
    let runs: Vec<PathBuf> = std::fs::read_dir(ctx.path("runs-slurm")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(runs.len(), 1);
    let rd = &runs[0];
    // one batch script and log per task, named apart
    for label in ["fit", "transfer-2", "transfer-3"] {
        assert!(rd.join(format!("slurm/{label}.sh")).is_file(), "no slurm/{label}.sh");
        assert!(std::fs::read_to_string(rd.join(format!("logs/{label}.out"))).unwrap().contains("scfoundry: job "), "{label}'s log");
    }
    let trace = std::fs::read_to_string(rd.join("trace.txt")).unwrap();
    let rows: Vec<Vec<&str>> = trace.lines().skip(1).map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows.len(), 3, "{trace}");
    let ids: Vec<u64> = rows.iter().map(|r| r[2].parse().unwrap()).collect();
    assert!(rows.iter().all(|r| r[4] == "COMPLETED" && r[5] == "0"), "{trace}");
    assert_eq!(ids.iter().collect::<std::collections::BTreeSet<_>>().len(), 3, "three jobs: {trace}");
    r.stderr_has(&format!("fit job {}", ids[0]));
}

/// `--executor nextflow`: the pipeline's transfer branch with the reference, the query, the
/// label key and k as parameters; what it publishes is moved to --out and --report-dir.
#[test]
fn nextflow_transfer_command_line_and_results() {
    let ctx = TestContext::new();
    pbmc_split(&ctx);
    let bin = crate::orchestration::fake_nextflow(ctx.dir.path());
    let argv_file = ctx.path("argv.txt");
    let out = crate::orchestration::run_fake_nextflow(
        &ctx,
        &bin,
        &argv_file,
        &["transfer", "-m", "pca", "--reference", "ref.h5ad", "--query", "query.h5ad", "--label-key", "cell_type", "-k", "9", "-o", "nf.h5ad", "--runs-dir", "runs", "--executor", "nextflow", "--", "-resume"],
    );
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    let rd = the_run_dir(&ctx);
    let root = std::path::absolute(ctx.dir.path()).unwrap();
    let argv = std::fs::read_to_string(&argv_file).unwrap();
    let argv = argv.replace(&rd.display().to_string(), "[RUN]").replace(&repo().display().to_string(), "[REPO]").replace(&root.display().to_string(), "[TMP]");
    insta::assert_snapshot!("nextflow_transfer_argv", argv);
    // the published copy of the query and the report folder are moved into place
    assert_eq!(sha256(&ctx.path("nf.h5ad")), sha256(&ctx.path("query.h5ad")), "the fake pipeline publishes a copy of the query");
    assert!(std::fs::read_to_string(ctx.path("nf/transfer.json")).unwrap().contains("fake nextflow"), "report folder not moved: {err}");
    assert!(err.contains(&format!("wrote {};", root.join("nf.h5ad").display())), "{err}");
}

/// `--embedding KEY` votes in obsm[KEY] of both files: no embedding task, no run folder, and
/// the same predictions as the run that computed those embeddings.
#[test]
fn precomputed_embedding_gives_the_same_vote() {
    let ctx = TestContext::new();
    pbmc_split(&ctx);
    ctx.run(&["transfer", "-m", "pca", "--reference", "ref.h5ad", "--query", "query.h5ad", "--label-key", "cell_type", "-o", "first.h5ad"]).success();
    let rd = the_run_dir(&ctx);
    let ref_emb = read_f32(&rd.join("work/reference.f32"));
    let (q_emb, _, _) = AnnData::open(&ctx.path("first.h5ad")).unwrap().dense_entry("obsm", "X_pca").unwrap();
    let even: Vec<usize> = (0..700).step_by(2).collect();
    let odd: Vec<usize> = (1..700).step_by(2).collect();
    subset("pbmc68k_counts.h5ad", &even, None).with_obsm("X_mine", ref_emb.clone(), 50).write(&ctx.path("ref_e.h5ad"));
    subset("pbmc68k_counts.h5ad", &odd, None).with_obsm("X_mine", q_emb.clone(), 50).write(&ctx.path("query_e.h5ad"));
    let r = ctx.run(&["transfer", "--embedding", "X_mine", "--reference", "ref_e.h5ad", "--query", "query_e.h5ad", "--label-key", "cell_type", "-o", "second.h5ad"]);
    r.success().stderr_has("obsm['X_mine']");
    assert_eq!(std::fs::read_dir(ctx.path("runs")).unwrap().count(), 1, "no second run folder");
    assert_eq!(labels_of(&ctx.path("second.h5ad"), "cell_type_pred"), labels_of(&ctx.path("first.h5ad"), "cell_type_pred"));
    let (_, c1, _) = transfer_bytes(&ctx.path("first.h5ad"), "X_pca");
    let (_, c2, e2) = transfer_bytes(&ctx.path("second.h5ad"), "X_mine");
    assert_eq!(c1, c2, "confidences");
    assert_eq!(e2, q_emb.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    let report: Value = serde_json::from_str(&std::fs::read_to_string(ctx.path("second/transfer.json")).unwrap()).unwrap();
    assert_eq!(report["method"], "precomputed");
    assert!(report["run_id"].is_null());

    // widths that differ, a missing key: one clear error each
    subset("pbmc68k_counts.h5ad", &odd, None).with_obsm("X_mine", q_emb[..350 * 10].to_vec(), 10).write(&ctx.path("query_10.h5ad"));
    ctx.run(&["transfer", "--embedding", "X_mine", "--reference", "ref_e.h5ad", "--query", "query_10.h5ad", "--label-key", "cell_type", "-o", "x.h5ad"])
        .user_error()
        .stderr_has("obsm/X_mine")
        .stderr_has("10 wide but the reference's is 50 wide");
    ctx.run(&["transfer", "--embedding", "X_nope", "--reference", "ref_e.h5ad", "--query", "query_e.h5ad", "--label-key", "cell_type", "-o", "x.h5ad"]).user_error().stderr_has("X_nope");
    assert!(!ctx.path("x.h5ad").exists());
}
