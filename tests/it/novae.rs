//! novae against upstream's own package (committed fixture tests/fixtures/novae/, made by
//! scripts/novae_reference.py with novae 1.1.2 + torch-geometric 2.8.1; CI never installs
//! torch): a small Novae saved by `save_pretrained` (model.safetensors + config.json, the
//! released format), 160 demo cells with seeded coordinates, and what upstream computed on them:
//! scipy's Delaunay edges, the radius-filtered graph, the genes used and their vocabulary rows,
//! the z-score statistics, each cell's subgraph, the valid cells and obsm['novae_latent'].
//! Edge sets and subgraphs must be identical, latents within 1e-4 relative error.

use std::path::PathBuf;

use candle_core::Device;
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::novae::{self, delaunay_neighbors, Config, GraphBatch, Novae, SpatialGraph};

use crate::common::{repo, TestContext, Tiny};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/novae")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect()
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn coords() -> Vec<[f64; 2]> {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&dir().join("cells.h5ad")).unwrap();
    let v: Vec<f64> = ad.file.dataset("obsm/spatial").unwrap().read_raw().unwrap();
    v.chunks(2).map(|c| [c[0], c[1]]).collect()
}

/// CSR rows (indptr, indices) as sorted neighbour lists.
fn csr_lists(indptr: &[usize], indices: &[usize]) -> Vec<Vec<usize>> {
    indptr.windows(2).map(|w| {
        let mut l = indices[w[0]..w[1]].to_vec();
        l.sort_unstable();
        l
    }).collect()
}

#[test]
fn novae_delaunay_and_radius_edges_match_scipy() {
    let f = fixture();
    let c = coords();
    let want = csr_lists(&usizes(&f["delaunay_indptr"]), &usizes(&f["delaunay_indices"]));
    let got = delaunay_neighbors(&c).unwrap();
    assert_eq!(got, want, "Delaunay edge set differs from scipy.spatial.Delaunay");
    let radius = f["radius"].as_f64().unwrap();
    let g = SpatialGraph::build(&c, Some((0.0, radius))).unwrap();
    let indptr = usizes(&f["radius_indptr"]);
    let indices = usizes(&f["radius_indices"]);
    let dists = f64s(&f["radius_distances"]);
    assert_eq!(g.n_edges(), indices.len());
    for (i, w) in indptr.windows(2).enumerate() {
        let want: Vec<(usize, f64)> = (w[0]..w[1]).map(|k| (indices[k], dists[k])).collect();
        assert_eq!(g.adj[i].len(), want.len(), "cell {i}");
        for (&(j, d), &(wj, wd)) in g.adj[i].iter().zip(&want) {
            assert_eq!(j, wj, "cell {i}");
            assert!((d - wd).abs() <= 1e-12 * wd, "cell {i} -> {j}: {d} vs {wd}");
        }
    }
    // the far cell lost every edge to the radius
    assert!(g.adj[c.len() - 1].is_empty());
}

#[test]
fn novae_subgraphs_and_valid_cells_match_upstream() {
    let f = fixture();
    let g = SpatialGraph::build(&coords(), Some((0.0, f["radius"].as_f64().unwrap()))).unwrap();
    let (valid, sub) = g.subgraphs(2, 2);
    let want_valid: Vec<bool> = f["valid"].as_array().unwrap().iter().map(|v| v.as_bool().unwrap()).collect();
    assert_eq!(valid, want_valid);
    assert_eq!(valid.iter().filter(|v| !**v).count(), 1);
    for (i, s) in f["subgraphs"].as_array().unwrap().iter().enumerate() {
        if valid[i] {
            assert_eq!(sub[i], usizes(s), "subgraph of cell {i}");
        }
    }
}

#[test]
fn novae_config_and_gene_rows_match_upstream() {
    let f = fixture();
    let cfg = Config::load(&dir().join("model/config.json")).unwrap();
    let c = &f["config"];
    assert_eq!(cfg.embedding_size as u64, c["embedding_size"].as_u64().unwrap());
    assert_eq!(cfg.num_layers as u64, c["num_layers"].as_u64().unwrap());
    assert_eq!(cfg.var_names.len(), 100);
    let vocab = cfg.gene_index();
    let used: Vec<String> = f["used_genes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    let rows: Vec<usize> = used.iter().map(|g| vocab[g.to_lowercase().as_str()]).collect();
    assert_eq!(rows, usizes(&f["gene_indices"]));
}

/// Sharded (3 shards of blocks of 8 cells): the fit normalises and z-scores the whole slide,
/// each shard reads its own rows of z and the other cells of its cells' 2-hop subgraphs (the
/// halo, at most the largest such set over the shards, computed here from the graph; the demo
/// cells are not in spatial order, so a shard's halo spans much of the slide), and the merged
/// latents equal the whole run's byte for byte.
#[test]
fn novae_shards_read_their_cells_and_the_subgraph_halo() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(dir().join("cells.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let g = SpatialGraph::build(&coords(), Some((0.0, 50.0))).unwrap();
    let (valid, sub) = g.subgraphs(2, 2);
    let n = valid.len();
    let mut halo = 0;
    for (s, e) in scfoundry::runner::shard_ranges(n, 3, 8) {
        let mut outside: Vec<usize> = (s..e).filter(|&c| valid[c]).flat_map(|c| sub[c].iter().copied()).filter(|&v| v < s || v >= e).collect();
        outside.sort_unstable();
        outside.dedup();
        halo = halo.max(outside.len());
    }
    assert!(halo > 0);
    let run = crate::common::assert_shards_equal(&ctx, &["--weights-dir", w.to_str().unwrap(), "embed", "-m", "novae", "-d", "cells.h5ad", "--radius", "50", "--batch-size", "8"], &[], "X_novae", 3, halo as u64);
    assert!(run.join("work/novae_z.f32").is_file());
    assert_eq!(f["latent"].as_array().unwrap().len(), n);
}

#[test]
fn novae_latent_matches_upstream_at_any_batch_size() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(dir().join("cells.h5ad"), ctx.path("cells.h5ad")).unwrap();
    for batch in ["256", "7"] {
        let out = format!("cells.b{batch}.h5ad");
        let r = ctx.run(&["--weights-dir", w.to_str().unwrap(), "embed", "-m", "novae", "-d", "cells.h5ad", "-o", &out, "--radius", "50", "--batch-size", batch]);
        r.success();
        assert!(r.stderr.contains("70 of 80 genes used"), "{}", r.stderr);
        assert!(r.stderr.contains("1 of 160 cells have no cell exactly 2 hops away"), "{}", r.stderr);
        let h = hdf5::File::open(ctx.path(&out)).unwrap();
        let ds = h.dataset("obsm/X_novae").unwrap();
        let dim = ds.shape()[1];
        let got = ds.read_raw::<f32>().unwrap();
        assert_eq!((got.len() / dim, dim), (160, 12));
        let want = f["latent"].as_array().unwrap();
        let mut worst = 0f64;
        for (i, row) in want.iter().enumerate() {
            let row = f64s(row);
            let scale = row.iter().fold(0f64, |m, v| m.max(v.abs()));
            if scale == 0.0 {
                assert!(got[i * dim..(i + 1) * dim].iter().all(|&v| v == 0.0), "invalid cell {i} must be zeros");
                continue;
            }
            for (k, wv) in row.iter().enumerate() {
                worst = worst.max((got[i * dim + k] as f64 - wv).abs() / scale);
            }
        }
        assert!(worst < MAX_REL_ERR, "batch {batch}: largest relative error {worst:.3e}");
        let p = |k: &str| -> i64 { h.dataset(&format!("uns/scfoundry/parameters/{k}")).unwrap().read_scalar().unwrap() };
        assert_eq!(p("cells_valid"), 159);
        assert_eq!(p("genes_used"), 70);
        assert_eq!(p("edges"), f["radius_indices"].as_array().unwrap().len() as i64);
    }
}

#[test]
fn novae_z_scores_and_gene_matrix_follow_upstream() {
    // the statistics of the log-normalised used genes, as ZScoreTorch's
    let f = fixture();
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&dir().join("cells.h5ad")).unwrap();
    let x = ad.matrix(None).unwrap();
    let b = x.read_rows(0, ad.n_obs).unwrap();
    let used: Vec<String> = f["used_genes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
    let col: Vec<Option<usize>> = ad.var_names.iter().map(|g| used.iter().position(|u| u == g)).collect();
    let g = used.len();
    let mut totals = vec![0f64; ad.n_obs];
    let mut dense = vec![0f32; ad.n_obs * g];
    for i in 0..ad.n_obs {
        let (idx, vals) = b.row(i);
        for (&j, &v) in idx.iter().zip(vals) {
            totals[i] += v as f64;
            if let Some(k) = col[j as usize] {
                dense[i * g + k] = v;
            }
        }
    }
    let target = novae::median_total(&totals);
    for (i, r) in dense.chunks_mut(g).enumerate() {
        for v in r.iter_mut() {
            *v = ((*v as f64 * target / totals[i]) as f32).ln_1p();
        }
    }
    let (mean, std) = novae::mean_std(&dense, ad.n_obs, g);
    for (a, b) in mean.iter().zip(f64s(&f["means"])) {
        assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
    }
    for (a, b) in std.iter().zip(f64s(&f["stds"])) {
        assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
    }
    // the model loads from the real format and its gene matrix has unit columns
    let cfg = Config::load(&dir().join("model/config.json")).unwrap();
    let m = Novae::load(&dir().join("model/model.safetensors"), cfg, Device::Cpu).unwrap();
    let rows: Vec<u32> = usizes(&f["gene_indices"]).into_iter().map(|r| r as u32).collect();
    let gm = m.gene_matrix(&rows).unwrap();
    let norms = gm.sqr().unwrap().sum(0).unwrap().to_vec1::<f32>().unwrap();
    assert!(norms.iter().all(|n| (n - 1.0).abs() < 1e-5), "{norms:?}");
    // a batch of one cell runs and its output has the model's width
    let graph = SpatialGraph::build(&coords(), Some((0.0, 50.0))).unwrap();
    let (_, sub) = graph.subgraphs(2, 2);
    let gb = GraphBatch::new(&graph, &sub, &[0], 1.0);
    let z = vec![0.5f32; gb.nodes.len() * g];
    assert_eq!(m.encode(&gm, &z, &gb).unwrap().len(), 12);
}

/// A weights folder holding the fixture files where weights.toml puts novae-human-0's.
fn weights_with(ctx: &TestContext) -> PathBuf {
    let w = ctx.path("weights");
    let man = scfoundry::weights::Manifest::builtin();
    let (model, config) = novae::files(&w, &man).unwrap();
    std::fs::create_dir_all(model.parent().unwrap()).unwrap();
    std::fs::copy(dir().join("model/model.safetensors"), &model).unwrap();
    std::fs::copy(dir().join("model/config.json"), &config).unwrap();
    w
}

#[test]
fn novae_embed_needs_weights_and_coordinates() {
    let ctx = TestContext::new();
    Tiny::counts(10, 30).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "--method", "novae", "--data", "t.h5ad"]);
    r.user_error().stderr_has("weights for novae are not in").stderr_has("novae-human-0-model").has_hint();
    let w = weights_with(&ctx);
    let ws = w.to_str().unwrap();
    // no obsm['spatial']
    let r = ctx.run(&["--weights-dir", ws, "embed", "--method", "novae", "--data", "t.h5ad"]);
    r.user_error().stderr_has("t.h5ad").stderr_has("obsm/spatial").stderr_has("is missing").has_hint();
    // NaN coordinates
    let mut xy: Vec<f32> = (0..20).map(|i| (i * 7 % 13) as f32).collect();
    xy[7] = f32::NAN;
    Tiny::counts(10, 30).with_obsm("spatial", xy, 2).write(&ctx.path("nan.h5ad"));
    let r = ctx.run(&["--weights-dir", ws, "embed", "--method", "novae", "--data", "nan.h5ad"]);
    r.user_error().stderr_has("obsm/spatial").stderr_has("row 3").stderr_has("finite");
    // three columns
    Tiny::counts(10, 30).with_obsm("spatial", vec![1.0; 30], 3).write(&ctx.path("3d.h5ad"));
    let r = ctx.run(&["--weights-dir", ws, "embed", "--method", "novae", "--data", "3d.h5ad"]);
    r.user_error().stderr_has("obsm/spatial").stderr_has("expected (10, 2)");
    assert!(!ctx.path("t.novae.h5ad").exists() && !ctx.path("nan.novae.h5ad").exists());
}

#[test]
fn novae_bad_checkpoint_is_a_clear_error() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let (model, config) = novae::files(&w, &scfoundry::weights::Manifest::builtin()).unwrap();
    // a checkpoint without the encoder's keys
    let cfg = Config::load(&config).unwrap();
    std::fs::write(&model, b"not safetensors").unwrap();
    let e = Novae::load(&model, cfg.clone(), Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("model.safetensors") && e.contains("not a safetensors file"), "{e}");
    let t = candle_core::Tensor::zeros((3, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(&std::collections::HashMap::from([("cell_embedder.wrong_key".to_string(), t)]), &model).unwrap();
    let e = Novae::load(&model, cfg, Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("does not hold a Novae model") && e.contains("cell_embedder.embedding.weight"), "{e}");
    // a config.json without the vocabulary
    std::fs::write(&config, r#"{"embedding_size": 16}"#).unwrap();
    let e = Config::load(&config).err().unwrap().to_string();
    assert!(e.contains("var_names") && e.contains("config.json"), "{e}");
    std::fs::write(&config, r#"{"var_names": ["a"], "mode_kwargs": {"multimodal": true}}"#).unwrap();
    assert!(Config::load(&config).err().unwrap().to_string().contains("multimodal"));
}

/// `--model-dir` with the model as a Hugging Face cache entry (`models--prism-oncology--novae-human-0`:
/// refs/main naming its snapshot, model.safetensors and config.json linked from blobs/) and no
/// weights folder: the weights folder's latents bit for bit, with the snapshot and the files'
/// sha256 in the provenance; a snapshot without config.json is refused before the run, naming
/// the folder and the file.
#[test]
fn novae_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    let w = weights_with(&ctx);
    let f = fixture();
    std::fs::copy(dir().join("cells.h5ad"), ctx.path("cells.h5ad")).unwrap();
    let args = ["embed", "-m", "novae", "-d", "cells.h5ad", "--radius", "50", "--batch-size", "7"];
    ctx.run(&[&["--weights-dir", w.to_str().unwrap()][..], &args[..], &["-o", "w.h5ad"]].concat()).success();
    let rev = "9e4b1f0c7a2d5e8b3c6f1a4d7e0b2c5f8a1d4e7b";
    let files = ["model.safetensors", "config.json"].map(|n| (dir().join("model").join(n), n));
    let entry = crate::common::hf_cache_entry(&ctx.path("hub"), "models--prism-oncology--novae-human-0", rev, &files);
    let snapshot = entry.join("snapshots").join(rev);
    let r = ctx.run(&[&args[..], &["-o", "m.h5ad", "--model-dir", entry.to_str().unwrap()]].concat());
    r.success();
    assert!(r.stderr.contains("70 of 80 genes used"), "{}", r.stderr);
    let shas = [("novae-human-0-model", files[0].0.clone()), ("novae-human-0-config", files[1].0.clone())];
    crate::common::assert_model_dir_run(&ctx.path("m.h5ad"), &ctx.path("w.h5ad"), "X_novae", &snapshot, &shas);
    let (got, dim) = crate::common::read_obsm(&ctx.path("m.h5ad"), "X_novae");
    assert_eq!((got.len() / dim, dim), (f["latent"].as_array().unwrap().len(), 12));
    std::fs::remove_file(snapshot.join("config.json")).unwrap();
    crate::common::assert_model_dir_lacks(&ctx, &[&args[..], &["-o", "x.h5ad", "--model-dir", entry.to_str().unwrap()]].concat(), "novae", &snapshot, "config.json", "x.h5ad");
}
