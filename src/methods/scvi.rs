//! scVI trained from scratch ("de novo") on raw counts, with the batch as a covariate.
//!
//! Paper: Lopez R, Regier J, Cole MB, Jordan MI, Yosef N, *Deep generative modeling for
//! single-cell transcriptomics*, Nature Methods 2018, doi:10.1038/s41592-018-0229-2.
//! Upstream: scverse/scvi-tools (read at 0.20.3): `src/scvi/module/_vae.py` (`VAE`),
//! `src/scvi/nn/_base_components.py` (`FCLayers`, `Encoder`, `DecoderSCVI`),
//! `src/scvi/distributions/_negative_binomial.py` (`log_nb_positive`),
//! `src/scvi/train/_trainingplans.py` (`TrainingPlan`, `_compute_kl_weight`),
//! `src/scvi/dataloaders/_data_splitting.py` (`DataSplitter`).
//!
//! The module, as scvi-tools' `SCVI` builds it with its defaults except the likelihood:
//! - encoder `FCLayers(n_genes -> n_hidden, n_layers)` on `log1p(x)` (no covariates:
//!   `encode_covariates=False`), each layer Linear -> BatchNorm1d(momentum 0.01, eps 1e-3) ->
//!   ReLU -> Dropout(0.1); then `q_m = Linear(n_hidden, n_latent)`,
//!   `q_v = exp(Linear(n_hidden, n_latent)) + 1e-4`, `z = q_m + sqrt(q_v) * eps`;
//! - library: observed, `log(sum_g x_g)` (`use_observed_lib_size=True`), no library prior;
//! - decoder `FCLayers(n_latent -> n_hidden)` with the batch one-hot concatenated to every
//!   layer's input (`deeply_inject_covariates=True`), BatchNorm, ReLU, no dropout; then
//!   `px_scale = softmax(Linear(n_hidden, n_genes))`, `px_rate = exp(library) * px_scale`;
//! - dispersion `'gene'`: `theta = exp(px_r)`, `px_r ~ N(0, 1)` at init;
//! - likelihood: negative binomial (scvi-tools' default is ZINB; the issue asks for NB);
//! - loss per minibatch: `mean_cells(-log NB(x) + kl_weight * KL(q(z|x) || N(0, I)))`,
//!   `kl_weight = min(1, epoch / 400)`; the ELBO logged per epoch is the unweighted
//!   `reconstruction + KL` summed over the epoch's cells divided by their number;
//! - Adam (torch semantics: L2 weight decay added to the gradient) lr 1e-3, eps 0.01,
//!   weight decay 1e-6; minibatches of 128, shuffled each epoch, the last one dropped when it
//!   holds fewer than 3 cells; 90 % of the cells train, 10 % validate;
//!   `max_epochs = min(round(20000 / n_cells * 400), 400)`;
//! - the embedding is `q_m` in evaluation mode (BatchNorm running statistics, no dropout).
//!
//! Initialisation follows torch (`nn.Linear`: weight and bias uniform in +-1/sqrt(fan_in)),
//! drawn from one seeded ChaCha8 stream, as are the split, the minibatch order, the dropout
//! masks and the reparameterisation noise: a seed gives the same embedding on the same machine.

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor, Var};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

use crate::progress::Reporter;

/// Options of the model and its training (scvi-tools' names and defaults).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ScviOptions {
    pub n_latent: usize,
    pub n_hidden: usize,
    pub n_layers: usize,
    pub dropout_rate: f32,
    /// None: `min(round(20000 / n_cells * 400), 400)`.
    pub max_epochs: Option<usize>,
    pub batch_size: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub eps: f64,
    pub n_epochs_kl_warmup: usize,
    pub train_size: f64,
    pub seed: u64,
}

impl Default for ScviOptions {
    fn default() -> Self {
        ScviOptions {
            n_latent: 10,
            n_hidden: 128,
            n_layers: 1,
            dropout_rate: 0.1,
            max_epochs: None,
            batch_size: 128,
            lr: 1e-3,
            weight_decay: 1e-6,
            eps: 0.01,
            n_epochs_kl_warmup: 400,
            train_size: 0.9,
            seed: 0,
        }
    }
}

/// scvi-tools' default epoch count for `n_cells` cells.
pub fn default_max_epochs(n_cells: usize) -> usize {
    ((20000.0 / n_cells.max(1) as f64) * 400.0).round().min(400.0) as usize
}

#[derive(Debug, thiserror::Error)]
pub enum ScviError {
    #[error("{0}")]
    Input(String),
    #[error("training diverged at epoch {epoch}: the loss is {value}")]
    Diverged { epoch: usize, value: f64 },
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

impl ScviError {
    pub fn hint(&self) -> Option<String> {
        match self {
            ScviError::Diverged { .. } => Some("check that the matrix holds raw counts (not normalised or log values); try another --seed or a smaller learning rate".into()),
            _ => None,
        }
    }
}

type Result<T> = std::result::Result<T, ScviError>;

/// Raw counts of the training genes, CSR, with one batch code per cell.
pub struct CountData {
    pub n_cells: usize,
    pub n_genes: usize,
    pub indptr: Vec<usize>,
    pub indices: Vec<u32>,
    pub values: Vec<f32>,
    pub batch: Vec<u32>,
    pub n_batch: usize,
}

impl CountData {
    /// Dense rows `cells` (row-major, cells x genes).
    fn dense(&self, cells: &[usize]) -> Vec<f32> {
        let g = self.n_genes;
        let mut out = vec![0f32; cells.len() * g];
        for (r, &c) in cells.iter().enumerate() {
            for k in self.indptr[c]..self.indptr[c + 1] {
                out[r * g + self.indices[k] as usize] = self.values[k];
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------
// log-gamma and digamma

/// ln Gamma(x) for x > 0 (Lanczos, g = 7, 9 terms; relative error below 1e-13).
pub fn lgamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // reflection
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - lgamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, &c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// digamma(x) for x > 0: recurrence up to 6, then the asymptotic series.
pub fn digamma(mut x: f64) -> f64 {
    let mut r = 0.0;
    while x < 6.0 {
        r -= 1.0 / x;
        x += 1.0;
    }
    let f = 1.0 / (x * x);
    r + x.ln() - 0.5 / x - f * (1.0 / 12.0 - f * (1.0 / 120.0 - f * (1.0 / 252.0 - f * (1.0 / 240.0 - f / 132.0))))
}

fn map_f32(storage: &CpuStorage, layout: &Layout, f: fn(f64) -> f64) -> candle_core::Result<(CpuStorage, Shape)> {
    let CpuStorage::F32(v) = storage else { candle_core::bail!("lgamma/digamma: f32 only") };
    let out: Vec<f32> = match layout.contiguous_offsets() {
        Some((a, b)) => v[a..b].iter().map(|&x| f(x as f64) as f32).collect(),
        None => candle_core::bail!("lgamma/digamma: contiguous input only"),
    };
    Ok((CpuStorage::F32(out), layout.shape().clone()))
}

struct Lgamma;
struct Digamma;

impl CustomOp1 for Digamma {
    fn name(&self) -> &'static str {
        "digamma"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        map_f32(s, l, digamma)
    }
}

impl CustomOp1 for Lgamma {
    fn name(&self) -> &'static str {
        "lgamma"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        map_f32(s, l, lgamma)
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let d = arg.contiguous()?.apply_op1_no_bwd(&Digamma)?;
        Ok(Some(grad.mul(&d)?))
    }
}

fn t_lgamma(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Lgamma)
}

/// scvi-tools' `log_nb_positive(x, mu, theta, eps=1e-8)` for one value.
pub fn log_nb_positive(x: f64, mu: f64, theta: f64, eps: f64) -> f64 {
    let log_theta_mu_eps = (theta + mu + eps).ln();
    theta * ((theta + eps).ln() - log_theta_mu_eps) + x * ((mu + eps).ln() - log_theta_mu_eps) + lgamma(x + theta) - lgamma(theta) - lgamma(x + 1.0)
}

/// Per-cell NB log-likelihood summed over genes, as a tensor op: x, mu (b x g), theta (g).
/// `lgx1` holds `lgamma(x + 1)` summed per cell (b), a constant.
fn log_nb_sum(x: &Tensor, mu: &Tensor, theta: &Tensor, lgx1: &Tensor) -> candle_core::Result<Tensor> {
    let eps = 1e-8;
    let theta = theta.unsqueeze(0)?;
    let log_theta_mu_eps = mu.broadcast_add(&theta)?.affine(1.0, eps)?.log()?;
    let log_theta_eps = theta.affine(1.0, eps)?.log()?;
    let a = log_theta_mu_eps.broadcast_sub(&log_theta_eps)?.broadcast_mul(&theta)?.neg()?;
    let b = mu.affine(1.0, eps)?.log()?.sub(&log_theta_mu_eps)?.mul(x)?;
    let c = t_lgamma(&x.broadcast_add(&theta)?)?;
    let lt = t_lgamma(&theta)?; // 1 x g
    let per = a.add(&b)?.add(&c)?.broadcast_sub(&lt)?;
    per.sum(1)?.sub(lgx1)
}

// ---------------------------------------------------------------------------------------
// layers

pub(crate) struct Linear {
    w: Var, // out x in
    b: Var, // out
}

impl Linear {
    fn new(n_in: usize, n_out: usize, rng: &mut ChaCha8Rng, vars: &mut Vec<Var>) -> Result<Linear> {
        let bound = 1.0 / (n_in as f64).sqrt();
        let w: Vec<f32> = (0..n_in * n_out).map(|_| rng.gen_range(-bound..bound) as f32).collect();
        let b: Vec<f32> = (0..n_out).map(|_| rng.gen_range(-bound..bound) as f32).collect();
        let w = Var::from_vec(w, (n_out, n_in), &Device::Cpu)?;
        let b = Var::from_vec(b, n_out, &Device::Cpu)?;
        vars.push(w.clone());
        vars.push(b.clone());
        Ok(Linear { w, b })
    }
    /// A layer with given weights (out x in) and bias (out), on their device.
    pub(crate) fn from_tensors(w: Tensor, b: Tensor) -> candle_core::Result<Linear> {
        Ok(Linear { w: Var::from_tensor(&w)?, b: Var::from_tensor(&b)? })
    }
    fn n_in(&self) -> usize {
        self.w.as_tensor().dims()[1]
    }
    fn n_out(&self) -> usize {
        self.w.as_tensor().dims()[0]
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.w.as_tensor().t()?)?.broadcast_add(self.b.as_tensor())
    }
}

/// torch's BatchNorm1d(momentum=0.01, eps=0.001).
pub(crate) struct BatchNorm {
    gamma: Var,
    beta: Var,
    running_mean: Vec<f32>,
    running_var: Vec<f32>,
}

impl BatchNorm {
    fn new(n: usize, vars: &mut Vec<Var>) -> Result<BatchNorm> {
        let gamma = Var::from_vec(vec![1f32; n], n, &Device::Cpu)?;
        let beta = Var::from_vec(vec![0f32; n], n, &Device::Cpu)?;
        vars.push(gamma.clone());
        vars.push(beta.clone());
        Ok(BatchNorm { gamma, beta, running_mean: vec![0.0; n], running_var: vec![1.0; n] })
    }
    /// A trained layer: weight (gamma), bias (beta) and the running statistics.
    pub(crate) fn from_tensors(gamma: Tensor, beta: Tensor, running_mean: &Tensor, running_var: &Tensor) -> candle_core::Result<BatchNorm> {
        Ok(BatchNorm { gamma: Var::from_tensor(&gamma)?, beta: Var::from_tensor(&beta)?, running_mean: running_mean.to_dtype(candle_core::DType::F32)?.to_vec1()?, running_var: running_var.to_dtype(candle_core::DType::F32)?.to_vec1()? })
    }
    fn len(&self) -> usize {
        self.running_mean.len()
    }
    fn forward(&mut self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        const EPS: f64 = 1e-3;
        const MOMENTUM: f32 = 0.01;
        let n = self.running_mean.len();
        let (mean, var) = if train {
            let b = x.dim(0)?;
            let mean = x.mean_keepdim(0)?;
            let xc = x.broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(0)?; // biased, for normalising
            let m: Vec<f32> = mean.flatten_all()?.to_vec1()?;
            let v: Vec<f32> = var.flatten_all()?.to_vec1()?;
            let unbias = if b > 1 { b as f32 / (b as f32 - 1.0) } else { 1.0 };
            for j in 0..n {
                self.running_mean[j] = (1.0 - MOMENTUM) * self.running_mean[j] + MOMENTUM * m[j];
                self.running_var[j] = (1.0 - MOMENTUM) * self.running_var[j] + MOMENTUM * v[j] * unbias;
            }
            (mean, var)
        } else {
            (Tensor::from_vec(self.running_mean.clone(), (1, n), x.device())?, Tensor::from_vec(self.running_var.clone(), (1, n), x.device())?)
        };
        let xhat = x.broadcast_sub(&mean)?.broadcast_div(&var.affine(1.0, EPS)?.sqrt()?)?;
        xhat.broadcast_mul(&self.gamma.as_tensor().unsqueeze(0)?)?.broadcast_add(&self.beta.as_tensor().unsqueeze(0)?)
    }
}

/// torch's LayerNorm(n, elementwise_affine=False): each row to mean 0, variance 1 (biased), eps 1e-5.
fn layer_norm(x: &Tensor) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(1)?;
    xc.broadcast_div(&var.affine(1.0, 1e-5)?.sqrt()?)
}

/// scvi-tools' FCLayers: per layer Linear -> BatchNorm1d (`use_batch_norm`) -> LayerNorm
/// without affine (`use_layer_norm`) -> ReLU -> Dropout; covariates (one-hot, `n_cat` columns
/// in all) concatenated to the input of the first layer, and of every layer when
/// `inject_covariates` (upstream's `deeply_inject_covariates`, default True).
pub(crate) struct FcLayers {
    layers: Vec<(Linear, Option<BatchNorm>)>,
    layer_norm: bool,
    n_cat: usize,
    inject_covariates: bool,
    dropout: f32,
}

impl FcLayers {
    fn new(n_in: usize, n_out: usize, n_cat: usize, n_layers: usize, n_hidden: usize, dropout: f32, rng: &mut ChaCha8Rng, vars: &mut Vec<Var>) -> Result<FcLayers> {
        let mut dims = vec![n_in];
        dims.extend(std::iter::repeat(n_hidden).take(n_layers - 1));
        dims.push(n_out);
        let mut layers = Vec::new();
        for w in dims.windows(2) {
            let lin = Linear::new(w[0] + n_cat, w[1], rng, vars)?;
            let bn = BatchNorm::new(w[1], vars)?;
            layers.push((lin, Some(bn)));
        }
        Ok(FcLayers { layers, n_cat, dropout, layer_norm: false, inject_covariates: true })
    }

    /// Trained layers (evaluation only): each layer's Linear and, with `use_batch_norm`, its
    /// BatchNorm; the shapes must chain, with `n_cat` covariate columns where injected.
    pub(crate) fn from_layers(layers: Vec<(Linear, Option<BatchNorm>)>, layer_norm: bool, n_cat: usize, inject_covariates: bool) -> std::result::Result<FcLayers, String> {
        let mut prev: Option<usize> = None;
        for (i, (lin, bn)) in layers.iter().enumerate() {
            let cat = if i == 0 || inject_covariates { n_cat } else { 0 };
            if let Some(p) = prev {
                if lin.n_in() != p + cat {
                    return Err(format!("layer {i} takes {} inputs, but the layer before gives {p} (+ {cat} covariate columns)", lin.n_in()));
                }
            }
            if let Some(bn) = bn {
                if bn.len() != lin.n_out() {
                    return Err(format!("layer {i}'s BatchNorm has {} features for {} outputs", bn.len(), lin.n_out()));
                }
            }
            prev = Some(lin.n_out());
        }
        Ok(FcLayers { layers, layer_norm, n_cat, inject_covariates, dropout: 0.0 })
    }

    fn n_out(&self) -> usize {
        self.layers.last().map(|(l, _)| l.n_out()).unwrap_or(0)
    }

    fn forward(&mut self, x: &Tensor, onehot: Option<&Tensor>, train: bool, rng: &mut ChaCha8Rng) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, (lin, bn)) in self.layers.iter_mut().enumerate() {
            if self.n_cat > 0 && (i == 0 || self.inject_covariates) {
                h = Tensor::cat(&[&h, onehot.expect("covariates")], 1)?;
            }
            h = lin.forward(&h)?;
            if let Some(bn) = bn {
                h = bn.forward(&h, train)?;
            }
            if self.layer_norm {
                h = layer_norm(&h)?;
            }
            h = h.relu()?;
            if train && self.dropout > 0.0 {
                let (b, d) = h.dims2()?;
                let keep = 1.0 - self.dropout;
                let mask: Vec<f32> = (0..b * d).map(|_| if rng.gen::<f32>() < keep { 1.0 / keep } else { 0.0 }).collect();
                h = h.mul(&Tensor::from_vec(mask, (b, d), h.device())?)?;
            }
        }
        Ok(h)
    }
}

/// scvi-tools' `Encoder` (the VAE's `z_encoder`): FCLayers, then `q_m = mean_encoder(q)` and
/// `q_v = exp(var_encoder(q)) + 1e-4` (`var_eps`). The VAE trained here and a pretrained
/// model loaded by `scvi_pretrained.rs` share it.
pub(crate) struct ZEncoder {
    pub(crate) encoder: FcLayers,
    mean_encoder: Linear,
    var_encoder: Linear,
}

impl ZEncoder {
    pub(crate) fn new(encoder: FcLayers, mean_encoder: Linear, var_encoder: Linear) -> std::result::Result<ZEncoder, String> {
        let h = encoder.n_out();
        for (name, l) in [("mean_encoder", &mean_encoder), ("var_encoder", &var_encoder)] {
            if l.n_in() != h {
                return Err(format!("{name} takes {} inputs, but the encoder gives {h}", l.n_in()));
            }
        }
        if mean_encoder.n_out() != var_encoder.n_out() {
            return Err(format!("mean_encoder gives {} latent dimensions, var_encoder {}", mean_encoder.n_out(), var_encoder.n_out()));
        }
        Ok(ZEncoder { encoder, mean_encoder, var_encoder })
    }

    /// Inputs the first layer takes (genes + covariate columns).
    pub(crate) fn n_input(&self) -> usize {
        self.encoder.layers.first().map(|(l, _)| l.n_in()).unwrap_or(0)
    }

    pub(crate) fn n_latent(&self) -> usize {
        self.mean_encoder.n_out()
    }

    /// (q_m, q_v) of the encoder's input (already log1p'd when the model says so).
    pub(crate) fn forward(&mut self, x: &Tensor, onehot: Option<&Tensor>, train: bool, rng: &mut ChaCha8Rng) -> candle_core::Result<(Tensor, Tensor)> {
        let q = self.encoder.forward(x, onehot, train, rng)?;
        let qm = self.mean_encoder.forward(&q)?;
        let qv = self.var_encoder.forward(&q)?.exp()?.affine(1.0, 1e-4)?;
        Ok((qm, qv))
    }
}

/// The VAE.
pub struct Vae {
    z_encoder: ZEncoder,
    decoder: FcLayers,
    px_scale_decoder: Linear,
    px_r: Var,
    vars: Vec<Var>,
    n_batch_cat: usize,
    pub n_genes: usize,
    pub n_latent: usize,
}

/// Losses of one forward pass, per cell.
struct Losses {
    recon: Tensor, // b
    kl: Tensor,    // b
}

impl Vae {
    pub fn new(n_genes: usize, n_batch: usize, o: &ScviOptions, rng: &mut ChaCha8Rng) -> Result<Vae> {
        let mut vars = Vec::new();
        // torch registers (and initialises) px_r first, then the encoders, then the decoder
        let r: Vec<f32> = (0..n_genes).map(|_| rng.sample::<f64, _>(StandardNormal) as f32).collect();
        let px_r = Var::from_vec(r, n_genes, &Device::Cpu)?;
        vars.push(px_r.clone());
        let encoder = FcLayers::new(n_genes, o.n_hidden, 0, o.n_layers, o.n_hidden, o.dropout_rate, rng, &mut vars)?;
        let mean_encoder = Linear::new(o.n_hidden, o.n_latent, rng, &mut vars)?;
        let var_encoder = Linear::new(o.n_hidden, o.n_latent, rng, &mut vars)?;
        let z_encoder = ZEncoder { encoder, mean_encoder, var_encoder };
        // FCLayers ignores a covariate with one category
        let n_batch_cat = if n_batch > 1 { n_batch } else { 0 };
        let decoder = FcLayers::new(o.n_latent, o.n_hidden, n_batch_cat, o.n_layers, o.n_hidden, 0.0, rng, &mut vars)?;
        let px_scale_decoder = Linear::new(o.n_hidden, n_genes, rng, &mut vars)?;
        Ok(Vae { z_encoder, decoder, px_scale_decoder, px_r, vars, n_batch_cat, n_genes, n_latent: o.n_latent })
    }

    pub fn n_params(&self) -> usize {
        self.vars.iter().map(|v| v.elem_count()).sum()
    }

    /// q(z|x): mean and variance. `x` is raw counts (b x g).
    fn encode(&mut self, x: &Tensor, train: bool, rng: &mut ChaCha8Rng) -> candle_core::Result<(Tensor, Tensor)> {
        let xl = x.affine(1.0, 1.0)?.log()?;
        self.z_encoder.forward(&xl, None, train, rng)
    }

    fn onehot(&self, codes: &[u32]) -> candle_core::Result<Option<Tensor>> {
        if self.n_batch_cat == 0 {
            return Ok(None);
        }
        let k = self.n_batch_cat;
        let mut v = vec![0f32; codes.len() * k];
        for (i, &c) in codes.iter().enumerate() {
            v[i * k + c as usize] = 1.0;
        }
        Ok(Some(Tensor::from_vec(v, (codes.len(), k), &Device::Cpu)?))
    }

    /// One pass over a minibatch: encoder, sample z, decoder, per-cell losses.
    fn losses(&mut self, xd: Vec<f32>, codes: &[u32], train: bool, rng: &mut ChaCha8Rng) -> candle_core::Result<Losses> {
        let b = codes.len();
        let g = self.n_genes;
        let lgx1: Vec<f32> = xd.chunks(g).map(|r| r.iter().filter(|&&v| v > 0.0).map(|&v| lgamma(v as f64 + 1.0)).sum::<f64>() as f32).collect();
        let lib: Vec<f32> = xd.chunks(g).map(|r| r.iter().map(|&v| v as f64).sum::<f64>().ln() as f32).collect();
        let x = Tensor::from_vec(xd, (b, g), &Device::Cpu)?;
        let (qm, qv) = self.encode(&x, train, rng)?;
        let noise: Vec<f32> = (0..b * self.n_latent).map(|_| rng.sample::<f64, _>(StandardNormal) as f32).collect();
        let noise = Tensor::from_vec(noise, (b, self.n_latent), &Device::Cpu)?;
        let z = qm.add(&qv.sqrt()?.mul(&noise)?)?;
        let oh = self.onehot(codes)?;
        let h = self.decoder.forward(&z, oh.as_ref(), train, rng)?;
        let logits = self.px_scale_decoder.forward(&h)?;
        let max = logits.max_keepdim(1)?.detach();
        let e = logits.broadcast_sub(&max)?.exp()?;
        let scale = e.broadcast_div(&e.sum_keepdim(1)?)?;
        let lib = Tensor::from_vec(lib, (b, 1), &Device::Cpu)?.exp()?;
        let mu = scale.broadcast_mul(&lib)?;
        let theta = self.px_r.as_tensor().exp()?;
        let lgx1 = Tensor::from_vec(lgx1, b, &Device::Cpu)?;
        let recon = log_nb_sum(&x, &mu, &theta, &lgx1)?.neg()?;
        // KL(N(m, v) || N(0, 1)) summed over the latent dimensions
        let kl = qv.add(&qm.sqr()?)?.sub(&qv.log()?)?.affine(0.5, -0.5)?.sum(1)?;
        Ok(Losses { recon, kl })
    }

    /// The latent mean of `cells` in evaluation mode.
    pub fn latent_mean(&mut self, data: &CountData, cells: &[usize]) -> Result<Vec<f32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(0); // unused in evaluation mode
        let mut out = Vec::with_capacity(cells.len() * self.n_latent);
        for chunk in cells.chunks(1024) {
            let x = Tensor::from_vec(data.dense(chunk), (chunk.len(), data.n_genes), &Device::Cpu)?;
            let (qm, _) = self.encode(&x, false, &mut rng)?;
            out.extend(qm.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    }
}

/// torch.optim.Adam with L2 weight decay.
struct Adam {
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: i32,
    lr: f64,
    eps: f64,
    wd: f64,
}

impl Adam {
    fn new(vars: &[Var], lr: f64, eps: f64, wd: f64) -> Result<Adam> {
        let z = |v: &Var| v.as_tensor().zeros_like();
        Ok(Adam { m: vars.iter().map(z).collect::<candle_core::Result<_>>()?, v: vars.iter().map(z).collect::<candle_core::Result<_>>()?, t: 0, lr, eps, wd })
    }
    fn step(&mut self, vars: &[Var], grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        self.t += 1;
        let (b1, b2) = (0.9f64, 0.999f64);
        let bc1 = 1.0 - b1.powi(self.t);
        let bc2 = 1.0 - b2.powi(self.t);
        for (i, var) in vars.iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            // detached: the optimiser state must not record a graph through the variables
            // (it would chain every step to the previous one and keep them all alive)
            let p = var.as_tensor().detach();
            let g = g.detach();
            let g = if self.wd != 0.0 { g.add(&p.affine(self.wd, 0.0)?)? } else { g };
            self.m[i] = self.m[i].affine(b1, 0.0)?.add(&g.affine(1.0 - b1, 0.0)?)?;
            self.v[i] = self.v[i].affine(b2, 0.0)?.add(&g.sqr()?.affine(1.0 - b2, 0.0)?)?;
            let denom = self.v[i].affine(1.0 / bc2, 0.0)?.sqrt()?.affine(1.0, self.eps)?;
            let upd = self.m[i].affine(self.lr / bc1, 0.0)?.div(&denom)?;
            var.set(&p.sub(&upd)?)?;
        }
        Ok(())
    }
}

/// One epoch's record.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct EpochLog {
    pub epoch: usize,
    pub kl_weight: f64,
    /// Mean over the epoch's training cells of `reconstruction + kl_weight * KL`.
    pub train_loss: f64,
    /// Mean over training cells of `reconstruction + KL` (scvi-tools' `elbo_train`).
    pub elbo_train: f64,
    pub reconstruction_train: f64,
    pub kl_train: f64,
    /// The same on the validation cells, evaluation mode (None without validation cells).
    pub elbo_validation: Option<f64>,
    pub reconstruction_validation: Option<f64>,
    pub kl_validation: Option<f64>,
}

pub struct ScviResult {
    /// n_cells x n_latent, row-major.
    pub latent: Vec<f32>,
    pub history: Vec<EpochLog>,
    pub epochs: usize,
    pub n_params: usize,
    pub n_train: usize,
    pub n_validation: usize,
}

/// Train scVI on `data` and return the latent mean of every cell.
pub fn train(data: &CountData, o: &ScviOptions, rep: &dyn Reporter) -> Result<ScviResult> {
    let n = data.n_cells;
    if n < 2 {
        return Err(ScviError::Input(format!("{n} cell(s): scVI needs at least 2")));
    }
    if o.n_layers == 0 || o.n_latent == 0 || o.n_hidden == 0 || o.batch_size == 0 {
        return Err(ScviError::Input("--n-layers, --n-latent, --n-hidden and --batch-size must be at least 1".into()));
    }
    if !(0.0..1.0).contains(&o.dropout_rate) {
        return Err(ScviError::Input(format!("dropout rate {} is not in [0, 1)", o.dropout_rate)));
    }
    let max_epochs = o.max_epochs.unwrap_or_else(|| default_max_epochs(n));
    let mut rng = ChaCha8Rng::seed_from_u64(o.seed);
    // split as DataSplitter: a permutation, the first n_val cells validate
    let n_train = ((o.train_size * n as f64).ceil() as usize).clamp(1, n);
    let n_val = n - n_train;
    let mut perm: Vec<usize> = (0..n).collect();
    perm.shuffle(&mut rng);
    let val: Vec<usize> = perm[..n_val].to_vec();
    let mut train_idx: Vec<usize> = perm[n_val..].to_vec();
    let mut vae = Vae::new(data.n_genes, data.n_batch, o, &mut rng)?;
    let mut opt = Adam::new(&vae.vars, o.lr, o.eps, o.weight_decay)?;
    let mut val_rng = ChaCha8Rng::seed_from_u64(o.seed ^ 0x5eed_0f_5c71);
    let mut history = Vec::with_capacity(max_epochs);
    let p = rep.step("training scVI", max_epochs as u64, "epochs");
    for epoch in 0..max_epochs {
        let kl_weight = if o.n_epochs_kl_warmup > 0 && epoch < o.n_epochs_kl_warmup { epoch as f64 / o.n_epochs_kl_warmup as f64 } else { 1.0 };
        train_idx.shuffle(&mut rng);
        let (mut s_loss, mut s_rec, mut s_kl, mut cells) = (0.0, 0.0, 0.0, 0usize);
        for mb in train_idx.chunks(o.batch_size) {
            if mb.len() < 3 && train_idx.len() >= 3 {
                continue; // drop_last=3
            }
            let codes: Vec<u32> = mb.iter().map(|&c| data.batch[c]).collect();
            let l = vae.losses(data.dense(mb), &codes, true, &mut rng)?;
            let per = l.recon.add(&l.kl.affine(kl_weight, 0.0)?)?;
            let loss = per.mean_all()?;
            let grads = loss.backward()?;
            opt.step(&vae.vars, &grads)?;
            let rec: f64 = l.recon.sum_all()?.to_scalar::<f32>()? as f64;
            let kl: f64 = l.kl.sum_all()?.to_scalar::<f32>()? as f64;
            s_loss += per.sum_all()?.to_scalar::<f32>()? as f64;
            s_rec += rec;
            s_kl += kl;
            cells += mb.len();
        }
        let c = cells.max(1) as f64;
        let mut log = EpochLog {
            epoch,
            kl_weight,
            train_loss: s_loss / c,
            elbo_train: (s_rec + s_kl) / c,
            reconstruction_train: s_rec / c,
            kl_train: s_kl / c,
            elbo_validation: None,
            reconstruction_validation: None,
            kl_validation: None,
        };
        if !log.train_loss.is_finite() {
            return Err(ScviError::Diverged { epoch, value: log.train_loss });
        }
        if !val.is_empty() {
            let (mut vr, mut vk) = (0.0, 0.0);
            for mb in val.chunks(1024) {
                let codes: Vec<u32> = mb.iter().map(|&c| data.batch[c]).collect();
                let l = vae.losses(data.dense(mb), &codes, false, &mut val_rng)?;
                vr += l.recon.sum_all()?.to_scalar::<f32>()? as f64;
                vk += l.kl.sum_all()?.to_scalar::<f32>()? as f64;
            }
            let c = val.len() as f64;
            log.elbo_validation = Some((vr + vk) / c);
            log.reconstruction_validation = Some(vr / c);
            log.kl_validation = Some(vk / c);
        }
        history.push(log);
        p.inc(1);
    }
    p.finish();
    let all: Vec<usize> = (0..n).collect();
    let latent = vae.latent_mean(data, &all)?;
    if latent.iter().any(|v| !v.is_finite()) {
        return Err(ScviError::Diverged { epoch: max_epochs, value: f64::NAN });
    }
    Ok(ScviResult { latent, history, epochs: max_epochs, n_params: vae.n_params(), n_train: train_idx.len(), n_validation: n_val })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lgamma_and_digamma_known_values() {
        // Gamma(5) = 24, Gamma(0.5) = sqrt(pi)
        assert!((lgamma(5.0) - 24f64.ln()).abs() < 1e-12);
        assert!((lgamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-12);
        assert!((lgamma(1e-3) - 6.907_178_885_383_853_5).abs() < 1e-9);
        // digamma(1) = -euler gamma; digamma is the derivative of lgamma
        // the asymptotic series from x >= 6 is accurate to ~1e-11 (its next term, 691 / (32760 x^12))
        assert!((digamma(1.0) + 0.577_215_664_901_532_9).abs() < 1e-10);
        for &x in &[0.3, 2.5, 17.0, 300.0] {
            let h = 1e-5;
            let fd = (lgamma(x + h) - lgamma(x - h)) / (2.0 * h);
            assert!((digamma(x) - fd).abs() < 1e-6, "x={x}: {} vs {fd}", digamma(x));
        }
    }

    #[test]
    fn lgamma_op_backward_is_digamma() {
        let v = Var::from_vec(vec![0.7f32, 3.0, 12.5], 3, &Device::Cpu).unwrap();
        let y = t_lgamma(v.as_tensor()).unwrap().sum_all().unwrap();
        let g = y.backward().unwrap();
        let gv: Vec<f32> = g.get(v.as_tensor()).unwrap().to_vec1().unwrap();
        for (x, d) in [0.7, 3.0, 12.5].iter().zip(gv) {
            assert!((digamma(*x) as f32 - d).abs() < 1e-5);
        }
    }

    #[test]
    fn nb_tensor_matches_scalar() {
        let xs = [0f32, 1.0, 7.0, 30.0, 2.0, 0.0];
        let mus = [0.5f32, 2.0, 6.0, 12.0, 0.01, 40.0];
        let thetas = [0.3f32, 1.5, 20.0];
        let x = Tensor::from_vec(xs.to_vec(), (2, 3), &Device::Cpu).unwrap();
        let mu = Tensor::from_vec(mus.to_vec(), (2, 3), &Device::Cpu).unwrap();
        let th = Tensor::from_vec(thetas.to_vec(), 3, &Device::Cpu).unwrap();
        let lgx1: Vec<f32> = xs.chunks(3).map(|r| r.iter().map(|&v| lgamma(v as f64 + 1.0)).sum::<f64>() as f32).collect();
        let got: Vec<f32> = log_nb_sum(&x, &mu, &th, &Tensor::from_vec(lgx1, 2, &Device::Cpu).unwrap()).unwrap().to_vec1().unwrap();
        for r in 0..2 {
            let want: f64 = (0..3).map(|j| log_nb_positive(xs[r * 3 + j] as f64, mus[r * 3 + j] as f64, thetas[j] as f64, 1e-8)).sum();
            assert!((got[r] as f64 - want).abs() < 1e-3 * want.abs().max(1.0), "row {r}: {} vs {want}", got[r]);
        }
    }
}
