//! scvi (a pretrained scVI model's encoder) against scvi-tools 1.3.3 (committed fixtures in
//! tests/fixtures/scvi_pretrained/, made by scripts/scvi_pretrained_reference.py; CI never
//! installs scvi-tools): two tiny models trained and saved by scvi-tools (`model.save(dir)`),
//! one with its defaults (1 layer, BatchNorm, normal latent, no covariate in the encoder) and
//! one with 2 layers, LayerNorm without BatchNorm, the batch injected into every encoder layer
//! and the "ln" latent; a query whose genes are shuffled, lack 10 of the model's and hold 15
//! others. The gene alignment must be scvi-tools' (zero-filled), q_m and q_v within 1e-4
//! relative error, the embedding q_m (normal) or the Monte Carlo softmax mean within its
//! sampling error (ln). Also: `scfoundry embed --method scvi` end to end, and bad inputs.

use std::path::PathBuf;

use candle_core::Device;
use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::scvi_pretrained::{GeneAlignment, Latent, PretrainedScvi, SavedModel};

use crate::common::{TestContext, Tiny, max_rel_err, read_obsm, repo};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/scvi_pretrained")
}

fn reference(config: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join(config).join("reference.json")).unwrap()).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect()
}

/// Largest per-cell relative error ||got - want|| / ||want||.
/// The query through our alignment: dense model-gene counts, batch codes.
fn query(m: &SavedModel) -> (GeneAlignment, Vec<f32>, Vec<u32>) {
    crate::common::no_hdf5_locking();
    let ad = AnnData::open(&dir().join("query.h5ad")).unwrap();
    let genes = GeneAlignment::new(&m.var_names, &ad.var_names);
    let g = m.var_names.len();
    let b = ad.matrix(None).unwrap().read_rows(0, ad.n_obs).unwrap();
    let mut dense = vec![0f32; ad.n_obs * g];
    for i in 0..ad.n_obs {
        let (idx, vals) = b.row(i);
        genes.fill(idx, vals, &mut dense[i * g..(i + 1) * g]);
    }
    let obs = ad.obs().unwrap();
    let labels = obs.column("batch").unwrap().as_labels().unwrap();
    let codes = labels.iter().map(|l| m.arch.batch_categories.iter().position(|c| Some(c) == l.as_ref()).map(|p| p as u32).unwrap_or(0)).collect();
    (genes, dense, codes)
}

fn check_config(config: &str) -> (SavedModel, Value) {
    let r = reference(config);
    let m = SavedModel::read(&dir().join(config)).unwrap();
    assert_eq!(m.var_names, strings(&r["model_genes"]));
    let (genes, dense, codes) = query(&m);
    // the alignment: the model gene each query column feeds, as the reference script built it
    let want_idx: Vec<i64> = r["aligned_index"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    let mut got_idx = vec![-1i64; m.var_names.len()];
    for (q, c) in genes.model_col.iter().enumerate() {
        if let Some(c) = c {
            got_idx[*c as usize] = q as i64;
        }
    }
    assert_eq!(got_idx, want_idx);
    assert_eq!(genes.missing.iter().cloned().collect::<std::collections::BTreeSet<_>>(), strings(&r["missing_genes"]).into_iter().collect());
    let mut model = PretrainedScvi::load(&m, &Device::Cpu).unwrap();
    let dim = model.dim();
    let g = model.n_genes;
    // q_m and q_v at two batch sizes: both within 1e-4 of scvi-tools'
    for chunk in [7usize, 128] {
        let (mut qm, mut qv) = (Vec::new(), Vec::new());
        for (k, rows) in dense.chunks(chunk * g).enumerate() {
            let (a, b) = model.qz(rows.to_vec(), &codes[k * chunk..(k * chunk + rows.len() / g)]).unwrap();
            qm.extend(a);
            qv.extend(b);
        }
        let (em, ev) = (max_rel_err(&qm, &r["qz_mean"], dim), max_rel_err(&qv, &r["qz_var"], dim));
        eprintln!("scvi {config}: batches of {chunk}: q_m relative error {em:.2e}, q_v {ev:.2e}");
        assert!(em < MAX_REL_ERR && ev < MAX_REL_ERR, "{config}: q_m {em:.2e}, q_v {ev:.2e}");
    }
    (m, r)
}

#[test]
fn scvi_default_model_matches_scvi_tools() {
    let (m, r) = check_config("default");
    let a = &m.arch;
    assert_eq!((a.n_layers, a.n_hidden, a.n_latent), (1, 128, 10));
    assert!(a.batch_norm_encoder && !a.layer_norm_encoder && !a.uses_batch());
    assert_eq!(a.latent_distribution, Latent::Normal);
    // the embedding is q_m: get_latent_representation()
    let (_, dense, codes) = query(&m);
    let mut model = PretrainedScvi::load(&m, &Device::Cpu).unwrap();
    let rows: Vec<usize> = (0..codes.len()).collect();
    let z = model.embed(dense, &codes, 0, &rows).unwrap();
    let e = max_rel_err(&z, &r["latent"], 10);
    eprintln!("scvi default: embedding relative error {e:.2e}");
    assert!(e < MAX_REL_ERR, "{e:.2e}");
}

#[test]
fn scvi_deep_layernorm_batch_ln_model_matches_scvi_tools() {
    let (m, r) = check_config("deep_ln");
    let a = &m.arch;
    assert_eq!((a.n_layers, a.n_hidden, a.n_latent), (2, 32, 6));
    assert!(!a.batch_norm_encoder && a.layer_norm_encoder && a.uses_batch() && a.deeply_inject_covariates);
    assert_eq!(a.batch_categories, vec!["donor_a", "donor_b", "donor_c"]);
    assert_eq!(a.batch_key.as_deref(), Some("batch"));
    assert_eq!(a.latent_distribution, Latent::Ln);
    // a wrong batch changes q_m: the covariate is really injected
    let (_, dense, codes) = query(&m);
    let mut model = PretrainedScvi::load(&m, &Device::Cpu).unwrap();
    let g = model.n_genes;
    let (q0, _) = model.qz(dense[..g].to_vec(), &[0]).unwrap();
    let (q1, _) = model.qz(dense[..g].to_vec(), &[1]).unwrap();
    assert!(q0.iter().zip(&q1).any(|(x, y)| (x - y).abs() > 1e-4));
    // the ln embedding: Monte Carlo softmax means, within sampling error of scvi-tools'
    let rows: Vec<usize> = (0..codes.len()).collect();
    let z = model.embed(dense.clone(), &codes, 0, &rows).unwrap();
    let want = r["latent"].as_array().unwrap();
    for i in 0..want.len() {
        assert!((z[i * 6..(i + 1) * 6].iter().sum::<f32>() - 1.0).abs() < 1e-4, "row {i} does not sum to 1");
    }
    let (worst, mean) = ln_diff(&z, &r["latent"], 6);
    eprintln!("scvi deep_ln: ln embedding vs scvi-tools: largest absolute difference {worst:.2e}, mean {mean:.2e} (5,000 draws each side)");
    assert!(worst < LN_MAX_ABS && mean < LN_MEAN_ABS, "{worst} {mean}");
    // seeded: the same rows from any batch split; another seed moves them a little
    let z2: Vec<f32> = (0..codes.len()).step_by(9).flat_map(|s| {
        let e = (s + 9).min(codes.len());
        let rows: Vec<usize> = (s..e).collect();
        model.embed(dense[s * g..e * g].to_vec(), &codes[s..e], 0, &rows).unwrap()
    }).collect();
    // equal up to float32 rounding (the matrix products block differently by batch size)
    let split = z.iter().zip(&z2).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(z.len() == z2.len() && split < 1e-6, "batch split moved the ln embedding by {split}");
    let z3 = model.embed(dense, &codes, 1, &rows).unwrap();
    assert_ne!(z, z3);
}

/// Two independent 5,000-draw estimates of the "ln" mean differ by sampling error alone: on this
/// fixture's q_m and q_v, numpy draws against scvi-tools' give a largest absolute difference of
/// 0.009-0.015 and a mean of 0.0022-0.0026 over 5 seeds. A wrong q_m, q_v or softmax moves
/// the mean far more.
const LN_MAX_ABS: f64 = 3e-2;
const LN_MEAN_ABS: f64 = 4e-3;

/// (largest, mean) absolute difference between rows and the reference.
fn ln_diff(got: &[f32], want: &Value, dim: usize) -> (f64, f64) {
    let d: Vec<f64> = want.as_array().unwrap().iter().enumerate().flat_map(|(i, w)| w.as_array().unwrap().iter().enumerate().map(move |(k, w)| (i * dim + k, w.as_f64().unwrap()))).map(|(j, w)| (got[j] as f64 - w).abs()).collect();
    (d.iter().cloned().fold(0f64, f64::max), d.iter().sum::<f64>() / d.len() as f64)
}


#[test]
fn scvi_embed_command_runs_saved_models() {
    let ctx = TestContext::new();
    std::fs::copy(dir().join("query.h5ad"), ctx.path("q.h5ad")).unwrap();
    let model = dir().join("default");
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "q.h5ad", "--model-dir", model.to_str().unwrap(), "--batch-size", "16"]);
    r.success().stderr_has("10 of the model's 120 genes are not in the data and are zero-filled").stderr_has("15 of the data's 125 genes are not in the model");
    crate::common::assert_shards_equal(&ctx, &["embed", "-m", "scvi", "-d", "q.h5ad", "--model-dir", model.to_str().unwrap(), "--batch-size", "4"], &[], "X_scvi", 2, 0);
    let (got, dim) = read_obsm(&ctx.path("q.scvi.h5ad"), "X_scvi");
    assert_eq!(dim, 10);
    let e = max_rel_err(&got, &reference("default")["latent"], dim);
    assert!(e < MAX_REL_ERR, "{e:.2e}");
    // the ln model with the batch in the encoder: the query's obs['batch'] (the model's key)
    let model = dir().join("deep_ln");
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "q.h5ad", "-o", "ln.h5ad", "--model-dir", model.to_str().unwrap()]);
    r.success();
    let (got, dim) = read_obsm(&ctx.path("ln.h5ad"), "X_scvi");
    assert_eq!(dim, 6);
    let (worst, mean) = ln_diff(&got, &reference("deep_ln")["latent"], dim);
    assert!(worst < LN_MAX_ABS && mean < LN_MEAN_ABS, "{worst} {mean}");
    // the input is untouched
    assert_eq!(crate::common::sha256(&ctx.path("q.h5ad")), crate::common::sha256(&dir().join("query.h5ad")));
}

#[test]
fn scvi_embed_bad_inputs() {
    let ctx = TestContext::new();
    std::fs::copy(dir().join("query.h5ad"), ctx.path("q.h5ad")).unwrap();
    // no model
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "q.h5ad"]);
    r.user_error().stderr_has("--model-dir").has_hint();
    // a folder without model.pt
    std::fs::create_dir_all(ctx.path("empty")).unwrap();
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "q.h5ad", "--model-dir", "empty"]);
    r.user_error().stderr_has("model.pt");
    // a torch file that is not an scvi-tools model (a scGPT state_dict)
    std::fs::create_dir_all(ctx.path("notscvi")).unwrap();
    std::fs::copy(repo().join("tests/fixtures/scgpt/best_model_inproj.pt"), ctx.path("notscvi/model.pt")).unwrap();
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "q.h5ad", "--model-dir", "notscvi"]);
    r.user_error().stderr_has("notscvi/model.pt").stderr_has("model_state_dict").has_hint();
    // not a zip at all
    std::fs::create_dir_all(ctx.path("junk")).unwrap();
    std::fs::write(ctx.path("junk/model.pt"), b"not a zip").unwrap();
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "q.h5ad", "--model-dir", "junk"]);
    r.user_error().stderr_has("junk/model.pt").stderr_has("not a PyTorch file");
    // a query with none of the model's genes
    Tiny::counts(12, 30).write(&ctx.path("t.h5ad"));
    let model = dir().join("default");
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "t.h5ad", "--model-dir", model.to_str().unwrap()]);
    r.user_error().stderr_has("var_names").stderr_has("0 of the 120 genes").has_hint();
    // the batch-encoding model: batches it was not trained on, and a missing column
    let m = SavedModel::read(&dir().join("deep_ln")).unwrap();
    let mut t = Tiny::counts(12, m.var_names.len());
    t.var_names = m.var_names.clone();
    let batches: Vec<String> = (0..12).map(|i| if i % 4 == 0 { "donor_x".to_string() } else { "donor_a".to_string() }).collect();
    t.with_obs("batch", batches).write(&ctx.path("b.h5ad"));
    let model = dir().join("deep_ln");
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "b.h5ad", "--model-dir", model.to_str().unwrap()]);
    r.user_error().stderr_has("donor_x").stderr_has("donor_a, donor_b, donor_c").has_hint();
    let r = ctx.run(&["embed", "-m", "scvi", "-d", "b.h5ad", "--model-dir", model.to_str().unwrap(), "--batch-key", "donor"]);
    r.user_error().stderr_has("obs/donor").stderr_has("--batch-key");
    assert!(!ctx.path("b.scvi.h5ad").exists() && !ctx.path("t.scvi.h5ad").exists());
}
