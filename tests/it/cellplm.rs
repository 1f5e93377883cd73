//! cellplm against upstream's own code (committed fixture tests/fixtures/cellplm/, made by
//! scripts/cellplm_reference.py with the cellplm 0.1.0.post2 package and torch; CI never
//! installs either): a small checkpoint in upstream's format (`tiny.config.json` +
//! `tiny.best.ckpt`, torch.save of {"model_state_dict": ...} with the pre-training decoder's
//! keys too), 64 demo cells with obs['batch'], and what CellEmbeddingPipeline.predict gives in
//! four batch compositions (by obs['batch'], in chunks of 4, all cells together, chunks of 24),
//! with the genes it uses and its embedder output. Genes identical, embeddings within 1e-4
//! relative error; the embedding depends on which cells share a forward pass; the command end
//! to end; shards of whole forward passes (the fixture's batches interleave across rows) equal
//! the whole run byte for byte, and resume; bad checkpoints and data.

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::cellplm::{attention_batches, Alignment, CellPlm, Config};

use crate::common::{TestContext, Tiny, read_obsm, repo};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/cellplm")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn rows_of(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()).collect()
}

fn max_rel_err(got: &[f32], want: &[Vec<f64>]) -> f64 {
    let dim = want[0].len();
    let mut worst = 0f64;
    for (i, w) in want.iter().enumerate() {
        let g = &got[i * dim..(i + 1) * dim];
        let d2: f64 = g.iter().zip(w).map(|(a, b)| (*a as f64 - b).powi(2)).sum();
        let n2: f64 = w.iter().map(|b| b * b).sum();
        worst = worst.max((d2 / n2).sqrt());
    }
    worst
}

struct Loaded {
    model: CellPlm,
    align: Alignment,
    cells: Vec<Vec<(u32, f32)>>,
    labels: Vec<String>,
}

fn load() -> Loaded {
    crate::common::no_hdf5_locking();
    let model = CellPlm::load(&dir().join("ckpt"), "tiny", candle_core::DType::F32, Device::Cpu).unwrap();
    let ad = AnnData::open(&dir().join("cells.h5ad")).unwrap();
    let align = Alignment::new(&ad.var_names, &model.cfg.gene_list);
    let b = ad.matrix(None).unwrap().read_rows(0, ad.n_obs).unwrap();
    let cells = (0..ad.n_obs).map(|i| align.cell(b.row(i).0, b.row(i).1)).collect();
    let obs = ad.obs().unwrap();
    let labels = obs.column("batch").unwrap().as_labels().unwrap().into_iter().map(Option::unwrap).collect();
    Loaded { model, align, cells, labels }
}

/// Our embeddings of all cells, running each pass of `passes`.
fn run(l: &Loaded, passes: &[Vec<usize>]) -> Vec<f32> {
    let dim = l.model.dim();
    let mut rows = vec![0f32; l.cells.len() * dim];
    for p in passes {
        let input: Vec<Vec<(u32, f32)>> = p.iter().map(|&i| l.cells[i].clone()).collect();
        let z = l.model.embed(&input).unwrap();
        for (k, &i) in p.iter().enumerate() {
            rows[i * dim..(i + 1) * dim].copy_from_slice(&z[k * dim..(k + 1) * dim]);
        }
    }
    rows
}

#[test]
fn cellplm_genes_and_embedder_match_upstream() {
    let f = fixture();
    let l = load();
    let c = &f["config"];
    assert_eq!(l.model.cfg.enc_hid as u64, c["enc_hid"].as_u64().unwrap());
    assert_eq!(l.model.cfg.enc_layers as u64, c["enc_layers"].as_u64().unwrap());
    assert_eq!(l.model.dim() as u64, c["post_latent_dim"].as_u64().unwrap());
    assert_eq!(l.model.cfg.gene_list.len() as u64, f["model_genes"].as_u64().unwrap());
    // the genes used, in upstream's order (gene_idx of OmicsEmbedder)
    let want: Vec<u32> = f["gene_idx"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(l.align.gene_idx(), want);
    assert_eq!(l.align.matched as u64, f["genes_used"].as_u64().unwrap());
    assert!(l.align.matched < f["data_genes"].as_u64().unwrap() as usize, "some data genes are left out");
    // the embedder's output (features, Linear, ReLU, GroupNorm) for all 64 cells
    let h = l.model.embedder(&l.model.features(&l.cells).unwrap()).unwrap();
    let got: Vec<f32> = h.flatten_all().unwrap().to_vec1().unwrap();
    let err = max_rel_err(&got, &rows_of(&f["h0_one_group"]));
    eprintln!("cellplm embedder: largest relative error {err:.3e}");
    assert!(err < MAX_REL_ERR, "{err:.3e}");
}

#[test]
fn cellplm_embeddings_match_upstream_in_each_batch_composition() {
    let f = fixture();
    let l = load();
    let scenarios = f["scenarios"].as_object().unwrap();
    assert_eq!(scenarios.len(), 4);
    for (name, s) in scenarios {
        let bs = s["batch_size"].as_u64().unwrap() as usize;
        let labels = if s["batch_column"].as_bool().unwrap() { Some(l.labels.as_slice()) } else { None };
        let passes = attention_batches(labels, l.cells.len(), bs);
        // the same cells in the same forward passes as upstream's pipeline
        let want: Vec<Vec<usize>> = s["forwards"].as_array().unwrap().iter().map(|p| p.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect()).collect();
        assert_eq!(passes, want, "{name}: forward passes");
        let got = run(&l, &passes);
        let err = max_rel_err(&got, &rows_of(&s["embeddings"]));
        eprintln!("cellplm {name} ({} passes): largest relative error {err:.3e}", passes.len());
        assert!(err < MAX_REL_ERR, "{name}: largest relative error {err:.3e}");
    }
}

#[test]
fn cellplm_embedding_depends_on_the_cells_of_its_pass() {
    let l = load();
    let dim = l.model.dim();
    let together = run(&l, &attention_batches(None, l.cells.len(), 0));
    let grouped = run(&l, &attention_batches(Some(&l.labels), l.cells.len(), 0));
    // the same cell in two different passes: a different embedding
    let cell0 = |r: &[f32]| r[..dim].to_vec();
    let d: f32 = cell0(&together).iter().zip(cell0(&grouped)).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(d > 1e-3, "cell 0 alike in both passes ({d})");
    // the same pass in another order: the same embeddings (no positions among cells)
    let mut rev: Vec<usize> = (0..l.cells.len()).collect();
    rev.reverse();
    let reversed = run(&l, &[rev]);
    let d: f32 = together.iter().zip(&reversed).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(d < 1e-5, "order within a pass changed the embedding by {d}");
    // the fixture says upstream's compositions differ too
    let f = fixture();
    assert!(f["composition_effect"]["one_group_vs_by_batch_max_abs"].as_f64().unwrap() > 1e-3);
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The `start..end` of each project task of the run folder's plan.
fn planned_shards(run: &Path) -> Vec<(usize, usize)> {
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(run.join("plan.json")).unwrap()).unwrap();
    plan["tasks"].as_array().unwrap().iter().filter(|t| t["step"]["kind"] == "project").map(|t| (t["step"]["start"].as_u64().unwrap() as usize, t["step"]["end"].as_u64().unwrap() as usize)).collect()
}

#[test]
fn cellplm_shards_are_whole_passes_and_equal_the_whole_run() {
    let l = load();
    let f = fixture();
    for (shards, extra, scenario) in [(3usize, &[][..], "by_batch"), (2, &["--batch-size", "4"][..], "by_batch_chunks_4")] {
        let ctx = TestContext::new();
        std::fs::copy(dir().join("cells.h5ad"), ctx.path("cells.h5ad")).unwrap();
        let m = ckpt_copy(&ctx, "m", |_| {});
        let mut args = vec!["embed", "-m", "cellplm", "-d", "cells.h5ad", "--model-dir", m.to_str().unwrap()];
        args.extend_from_slice(extra);
        // byte-equal to the whole run, and each shard read exactly its own cells' rows of X
        let run = crate::common::assert_shards_equal(&ctx, &args, &[], "X_cellplm", shards, 0);
        let (got, _) = read_obsm(&ctx.path("sharded-X_cellplm.h5ad"), "X_cellplm");
        let err = max_rel_err(&got, &rows_of(&f["scenarios"][scenario]["embeddings"]));
        assert!(err < MAX_REL_ERR, "{scenario}: {err:.3e}");
        // the shards are whole passes, balanced by cells, and their rows are scattered over the file
        let bs = if extra.is_empty() { 50_000 } else { 4 };
        let passes = attention_batches(Some(&l.labels), l.cells.len(), bs);
        let order = scfoundry::tasks::shard::GroupOrder::new(&passes);
        let planned = planned_shards(&run);
        assert_eq!(planned, order.ranges(shards), "{scenario}");
        for &(s, e) in &planned {
            assert!(order.bounds.contains(&s) && order.bounds.contains(&e), "{scenario}: {s}..{e} splits a pass");
            let mut rows = order.rows[s..e].to_vec();
            rows.sort_unstable();
            assert!(rows.last().unwrap() - rows[0] + 1 > rows.len(), "{scenario}: shard {s}..{e} is one range of rows {rows:?}");
            assert!(e - s >= 64 / shards / 2, "{scenario}: shard {s}..{e} is far from a fair share of 64 cells");
        }
    }
}

#[test]
fn cellplm_resumes_a_killed_or_corrupted_shard() {
    let ctx = TestContext::new();
    std::fs::copy(dir().join("cells.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let m = ckpt_copy(&ctx, "m", |_| {});
    let base = ["embed", "-m", "cellplm", "-d", "cells.h5ad", "--model-dir", m.to_str().unwrap()];
    ctx.run(&[&base[..], &["-o", "whole.h5ad"]].concat()).success();
    // shard 1 of 3 is killed as a scheduler kills a job, after writing its rows
    let r = ctx.run_env(&[&base[..], &["-o", "split.h5ad", "--shards", "3", "--runs-dir", "runs-split"]].concat(), &[("SCFOUNDRY_KILL_SHARD", Path::new("1"))]);
    assert_ne!(r.code, 0, "{}", r.stderr);
    assert!(!ctx.path("split.h5ad").exists());
    let run = std::fs::read_dir(ctx.path("runs-split")).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir() && !p.ends_with(".locks")).unwrap();
    assert!(!run.join("work/shard1.json").exists(), "the killed shard left no record");
    ctx.run(&["embed", "--resume", run.to_str().unwrap()]).success().stderr_has("of 3 shards finished and checked").stderr_has("shard 0): cached");
    let (whole, _) = read_obsm(&ctx.path("whole.h5ad"), "X_cellplm");
    let (split, _) = read_obsm(&ctx.path("split.h5ad"), "X_cellplm");
    assert_eq!(bits(&whole), bits(&split), "the resumed output differs from the uninterrupted run");
    // a finished shard's rows corrupted, another's removed: both run again, the same bytes
    let rows = run.join("work/shard2.f32");
    let mut bytes = std::fs::read(&rows).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&rows, bytes).unwrap();
    std::fs::remove_file(run.join("work/shard0.f32")).unwrap();
    std::fs::remove_file(ctx.path("split.h5ad")).unwrap();
    ctx.run(&["embed", "--resume", run.to_str().unwrap()]).success().stderr_has("1 of 3 shards finished and checked");
    let (again, _) = read_obsm(&ctx.path("split.h5ad"), "X_cellplm");
    assert_eq!(bits(&whole), bits(&again));
    // a shard cut from another order (another --batch-size) is refused by the merge
    let rec_path = run.join("work/shard1.json");
    let mut rec: Value = serde_json::from_str(&std::fs::read_to_string(&rec_path).unwrap()).unwrap();
    assert!(rec["order_sha256"].is_string(), "{rec}");
    rec["order_sha256"] = "0".repeat(64).into();
    std::fs::write(&rec_path, rec.to_string()).unwrap();
    std::fs::remove_file(ctx.path("split.h5ad")).unwrap();
    let r = ctx.run(&["embed", "--resume", run.to_str().unwrap()]);
    assert_ne!(r.code, 0, "{}", r.stderr);
    r.stderr_has("order_sha256").stderr_has("cut from another order").stderr_has("start the run again");
    assert!(!ctx.path("split.h5ad").exists());
    // --shards auto: 64 cells, no card: one shard
    ctx.run(&[&base[..], &["-o", "auto.h5ad", "--shards", "auto"]].concat()).success().stderr_has("(2 tasks)");
    let (auto, _) = read_obsm(&ctx.path("auto.h5ad"), "X_cellplm");
    assert_eq!(bits(&whole), bits(&auto));
    // more shards than passes (--batch-key '': one pass of 64 cells): one shard, said so
    ctx.run(&[&base[..], &["-o", "one.h5ad", "--batch-key", "", "--shards", "4"]].concat()).success().stderr_has("1 shard(s), not 4").stderr_has("1 groups");
}

fn read_i64(path: &Path, name: &str) -> i64 {
    hdf5::File::open(path).unwrap().dataset(name).unwrap().read_scalar().unwrap()
}

fn ckpt_copy(ctx: &TestContext, name: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let d = ctx.path(name);
    std::fs::create_dir_all(&d).unwrap();
    for f in ["tiny.best.ckpt", "tiny.config.json"] {
        std::fs::copy(dir().join("ckpt").join(f), d.join(f)).unwrap();
    }
    edit(&d);
    d
}

#[test]
fn cellplm_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let f = fixture();
    std::fs::copy(dir().join("cells.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let want = |s: &str| rows_of(&f["scenarios"][s]["embeddings"]);
    // the pinned layout under a weights folder (unpinned entries: any bytes are taken)
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    for (id, src) in scfoundry::methods::cellplm::REQUIRED_ENTRIES.iter().zip(["tiny.best.ckpt", "tiny.config.json"]) {
        let to = w.join(&man.weights[*id].file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(dir().join("ckpt").join(src), to).unwrap();
    }
    let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "cellplm", "-d", "cells.h5ad"]);
    r.success();
    r.stderr_has("240 of the data's 300 genes are in the model's gene_list").stderr_has("obs['batch'] group");
    let out = ctx.path("cells.cellplm.h5ad");
    let (got, dim) = read_obsm(&out, "X_cellplm");
    assert_eq!(dim, 16);
    let err = max_rel_err(&got, &want("by_batch"));
    assert!(err < MAX_REL_ERR, "by_batch: {err:.3e}");
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/batch_size"), 50000);
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/forward_passes"), 13);
    // --model-dir, chunks of 4 cells
    let m = ckpt_copy(&ctx, "m", |_| {});
    let runs = ctx.path("runs-b");
    let r = ctx.run(&["embed", "-m", "cellplm", "-d", "cells.h5ad", "-o", "b.h5ad", "--model-dir", m.to_str().unwrap(), "--batch-size", "4", "--runs-dir", runs.to_str().unwrap()]);
    r.success();
    let (got, _) = read_obsm(&ctx.path("b.h5ad"), "X_cellplm");
    let err = max_rel_err(&got, &want("by_batch_chunks_4"));
    assert!(err < MAX_REL_ERR, "chunks of 4: {err:.3e}");
    // where the task's time went, as the pipelined methods report it
    let run = std::fs::read_dir(&runs).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).unwrap();
    let report: Value = serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    let phases: Vec<(String, f64)> = serde_json::from_value(report["tasks"][0]["result"]["phases"].clone()).unwrap();
    let phases: std::collections::HashMap<String, f64> = phases.into_iter().collect();
    for stage in ["setup", "read", "tokenise", "device", "write", "blocks wall", "wall"] {
        assert!(phases.get(stage).is_some_and(|&s| s >= 0.0), "no `{stage}` in {phases:?}");
    }
    assert!(phases["device"] > 0.0 && phases["read"] > 0.0 && phases["blocks wall"] <= phases["wall"], "{phases:?}");
    // all cells one group (no batch key), in passes of 24, in 2 shards (of 1 and 2 passes)
    let r = ctx.run(&["embed", "-m", "cellplm", "-d", "cells.h5ad", "-o", "c.h5ad", "--model-dir", m.to_str().unwrap(), "--batch-size", "24", "--batch-key", "", "--shards", "2"]);
    r.success().stderr_has("(3 tasks)");
    assert!(!r.stderr.contains("ignored"), "{}", r.stderr);
    let (got, _) = read_obsm(&ctx.path("c.h5ad"), "X_cellplm");
    let err = max_rel_err(&got, &want("one_group_chunks_24"));
    assert!(err < MAX_REL_ERR, "one group in 24s: {err:.3e}");
    // a batch column that is not there: one group, as upstream
    let r = ctx.run(&["embed", "-m", "cellplm", "-d", "cells.h5ad", "-o", "d.h5ad", "--model-dir", m.to_str().unwrap(), "--batch-key", "donor"]);
    r.success().stderr_has("obs has no `donor` column");
    let (got, _) = read_obsm(&ctx.path("d.h5ad"), "X_cellplm");
    let err = max_rel_err(&got, &want("one_group"));
    assert!(err < MAX_REL_ERR, "one group: {err:.3e}");
}

#[test]
fn cellplm_bad_checkpoints_and_data() {
    let ctx = TestContext::new();
    std::fs::copy(dir().join("cells.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let err = |d: &Path, extra: &[&str]| {
        let mut args = vec!["embed", "-m", "cellplm", "-d", "cells.h5ad", "-o", "x.h5ad", "--model-dir", d.to_str().unwrap()];
        args.extend_from_slice(extra);
        let r = ctx.run(&args);
        r.user_error();
        assert!(!ctx.path("x.h5ad").exists());
        r.stderr
    };
    // no weights at all: the entries are named, with a hint
    let r = ctx.run(&["embed", "-m", "cellplm", "-d", "cells.h5ad"]);
    r.user_error().stderr_has("weights for cellplm are not in").stderr_has("cellplm-20231027-85m-ckpt").has_hint();
    // a folder without a checkpoint
    let d = ckpt_copy(&ctx, "nockpt", |d| std::fs::remove_file(d.join("tiny.best.ckpt")).unwrap());
    assert!(err(&d, &[]).contains(".best.ckpt"), "{}", err(&d, &[]));
    // a checkpoint without its config
    let d = ckpt_copy(&ctx, "noconfig", |d| std::fs::remove_file(d.join("tiny.config.json")).unwrap());
    assert!(err(&d, &[]).contains("tiny.config.json"), "{}", err(&d, &[]));
    // not a torch file
    let d = ckpt_copy(&ctx, "junk", |d| std::fs::write(d.join("tiny.best.ckpt"), b"not a zip").unwrap());
    let e = err(&d, &[]);
    assert!(e.contains("tiny.best.ckpt") && e.contains("model_state_dict"), "{e}");
    // another model's checkpoint (no model_state_dict key)
    let d = ckpt_copy(&ctx, "wrong", |d| std::fs::copy(repo().join("tests/fixtures/scgpt/best_model_inproj.pt"), d.join("tiny.best.ckpt")).map(drop).unwrap());
    let e = err(&d, &[]);
    assert!(e.contains("tiny.best.ckpt") && e.contains("model_state_dict"), "{e}");
    // a config that does not fit the checkpoint: the tensor and both shapes are named
    let d = ckpt_copy(&ctx, "wide", |d| {
        let p = d.join("tiny.config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        v["enc_hid"] = 64.into();
        std::fs::write(&p, v.to_string()).unwrap();
    });
    let e = err(&d, &[]);
    assert!(e.contains("embedder.feat_enc.emb") && e.contains("[280, 32]") && e.contains("[280, 64]"), "{e}");
    // a config of another encoder
    let d = ckpt_copy(&ctx, "performer", |d| {
        let p = d.join("tiny.config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        v["enc_mod"] = "performer".into();
        std::fs::write(&p, v.to_string()).unwrap();
    });
    let e = err(&d, &[]);
    assert!(e.contains("enc_mod") && e.contains("flowformer"), "{e}");
    // two checkpoints in one folder
    let d = ckpt_copy(&ctx, "two", |d| std::fs::copy(d.join("tiny.best.ckpt"), d.join("other.best.ckpt")).map(drop).unwrap());
    assert!(err(&d, &[]).contains("2 checkpoints"), "{}", err(&d, &[]));
    // data whose genes the model does not know (symbols vs the gene_list)
    let m = ckpt_copy(&ctx, "ok", |_| {});
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "-m", "cellplm", "-d", "t.h5ad", "--model-dir", m.to_str().unwrap()]);
    r.user_error().stderr_has("only 0 of 8 genes matched the model's vocabulary").stderr_has("--gene-column").has_hint();
    // the fine-tuning batch options are accepted with a warning (embed honours --batch-size)
    let reg = scfoundry::registry::Registry::builtin();
    let method = reg.get("cellplm").unwrap();
    assert!(method.honoured("finetune").is_empty());
    assert_eq!(method.honoured("embed"), &["--batch-size".to_string()]);
    // a wrong config path straight to the loader
    let e = Config::read(&ctx.path("nothing.config.json")).unwrap_err();
    assert!(e.to_string().contains("nothing.config.json"), "{e}");
}
