//! scGPT fine-tuned for batch integration: Cui H, Wang C, Maan H, et al., "scGPT: toward
//! building a foundation model for single-cell multi-omics using generative AI", Nature Methods
//! 21:1470-1480 (2024), doi:10.1038/s41592-024-02201-0; upstream code
//! https://github.com/bowang-lab/scGPT (`examples/finetune_integration.py`, the integration
//! tutorial, `scgpt/model/model.py`, `scgpt/model/dsbn.py`, `scgpt/model/grad_reverse.py`,
//! `scgpt/loss.py`, `scgpt/tokenizer/gene_tokenizer.py` random_mask_value; read at v0.2.4).
//!
//! The model is upstream's TransformerModel as finetune_integration.py builds it:
//! `do_mvc=True, do_dab=True, use_batch_labels=True, domain_spec_batchnorm=True,
//! explicit_zero_prob=True, ecs_threshold=0.8`, post-norm layers, run dense (every cell is the
//! same 1 + n_hvg tokens: zero genes are kept), with candle's autograd on the CPU (or CUDA).
//! - input: GeneEncoder (embedding, LayerNorm) + ContinuousValueEncoder (Linear(1, d), ReLU,
//!   Linear(d, d), LayerNorm, dropout), then DSBN: one `BatchNorm1d(d, eps=6.1e-5,
//!   affine=False)` per batch, the minibatch's first cell's batch choosing it (upstream's
//!   sampler gives minibatches of one batch); batch statistics over cells and tokens in
//!   training, running statistics (momentum 0.1, unbiased variance) in eval;
//! - `nlayers` nn.TransformerEncoderLayer (ReLU, LayerNorm eps 1e-5, dropout);
//! - ExprDecoder on [h, batch embedding] (Linear(2d, d), LeakyReLU, Linear(d, d), LeakyReLU,
//!   Linear(d, 1); and the same for the zero logit) gives GEP's prediction and zero probability;
//! - MVCDecoder ("inner product") on the gene embeddings and [cell emb, batch emb] gives GEPC's;
//! - ECS on the L2-normalised `<cls>` outputs: mean(1 - (relu(cos) - 0.8)^2), diagonal zeroed;
//! - AdversarialDiscriminator after a gradient reversal (lambda 1): [Linear, LeakyReLU,
//!   LayerNorm] x 2, Linear(d, n_batches), cross-entropy against the batch labels.
//!
//! Loss, as upstream's `train()`: GEP (masked MSE) + its Bernoulli NLL + GEPC + its Bernoulli
//! NLL + 10 x ECS + dab_weight x DAB. Adam (eps 1e-4 as upstream under AMP), gradient norm
//! clipped at 1, StepLR(gamma 0.9) per epoch, the epoch with the lowest validation GEP MSE kept.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::nn::step_profile::StepProfile;
use crate::nn::train_ops::{add_dropped, relu_dropped};
pub use crate::nn::dropout::Dropout;

/// Upstream's constants (finetune_integration.py).
pub const MASK_VALUE: f32 = -1.0;
pub const PAD_VALUE: f32 = -2.0;
pub const DSBN_EPS: f64 = 6.1e-5;
pub const DSBN_MOMENTUM: f64 = 0.1;
pub const ECS_WEIGHT: f64 = 10.0;
const LN_EPS: f64 = 1e-5;
const LEAKY: f64 = 0.01;

fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

/// The sizes and the objectives' settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub embsize: usize,
    pub nheads: usize,
    pub d_hid: usize,
    pub nlayers: usize,
    pub ntoken: usize,
    pub n_batches: usize,
    pub dropout: f64,
    pub ecs_threshold: f64,
    pub dab_weight: f64,
}

/// Each objective's loss of one minibatch (scalars), and the weighted total.
pub struct Losses {
    pub gep: Tensor,
    pub gep_zero: Tensor,
    pub gepc: Tensor,
    pub gepc_zero: Tensor,
    pub ecs: Tensor,
    pub dab: Tensor,
    pub total: Tensor,
}

impl Losses {
    /// The values, in the order of [`OBJECTIVES`], then the total.
    pub fn values(&self) -> candle_core::Result<Vec<f64>> {
        [&self.gep, &self.gep_zero, &self.gepc, &self.gepc_zero, &self.ecs, &self.dab, &self.total]
            .iter()
            .map(|t| t.to_dtype(DType::F64).and_then(|t| t.to_scalar::<f64>()))
            .collect()
    }
}

/// The objectives' names, as the history and the provenance list them.
pub const OBJECTIVES: [&str; 6] = ["gep", "gep_zero", "gepc", "gepc_zero", "ecs", "dab"];

/// One minibatch: `b` cells of `l` tokens (row-major), one batch label per cell.
pub struct Minibatch {
    pub b: usize,
    pub l: usize,
    pub gene_ids: Vec<u32>,
    pub input_values: Vec<f32>,
    pub target_values: Vec<f32>,
    pub batch_labels: Vec<u32>,
}

/// DSBN's running statistics of each batch (buffers, not trained).
#[derive(Debug, Clone)]
pub struct Dsbn {
    pub running_mean: Vec<Vec<f32>>,
    pub running_var: Vec<Vec<f32>>,
    pub tracked: Vec<i64>,
}

/// The trainable parameters by upstream state_dict name, and DSBN's buffers.
pub struct TrainModel {
    pub cfg: Config,
    pub params: BTreeMap<String, Var>,
    pub dsbn: Dsbn,
    pub device: Device,
    /// Mixed precision (as torch.autocast with bf16): the matrix products of the linear layers
    /// and the attention take bf16 copies of their inputs and weights; layer norms, softmax,
    /// losses, the parameters and the optimiser stay f32.
    pub mixed: bool,
    /// Time by region of the model (`SCFOUNDRY_STEP_PROFILE=1`).
    pub profile: Option<StepProfile>,
    /// Under mixed precision on a GPU, attention through the fused kernels
    /// (`nn::flash_attention`); off, through the (l x l) scores (`nn::recompute_attention`,
    /// `SCFOUNDRY_TRAIN_ATTENTION=materialized`). The CPU and f32 always take the latter.
    pub fused_attention: bool,
}

/// The trained tensors' names and shapes (upstream's state_dict, less cls_decoder which the
/// integration loss never reaches).
pub fn param_shapes(c: &Config) -> Vec<(String, Vec<usize>)> {
    let (d, h, nb) = (c.embsize, c.d_hid, c.n_batches);
    let mut s: Vec<(String, Vec<usize>)> = Vec::new();
    let mut lin = |p: &str, o: usize, i: usize, bias: bool| {
        s.push((format!("{p}.weight"), vec![o, i]));
        if bias {
            s.push((format!("{p}.bias"), vec![o]));
        }
    };
    lin("value_encoder.linear1", d, 1, true);
    lin("value_encoder.linear2", d, d, true);
    for i in 0..c.nlayers {
        let p = format!("transformer_encoder.layers.{i}");
        lin(&format!("{p}.self_attn.out_proj"), d, d, true);
        lin(&format!("{p}.linear1"), h, d, true);
        lin(&format!("{p}.linear2"), d, h, true);
    }
    for dec in ["decoder.fc", "decoder.zero_logit"] {
        lin(&format!("{dec}.0"), d, 2 * d, true);
        lin(&format!("{dec}.2"), d, d, true);
        lin(&format!("{dec}.4"), 1, d, true);
    }
    lin("mvc_decoder.gene2query", d, d, true);
    lin("mvc_decoder.W", 2 * d, d, false);
    lin("mvc_decoder.W_zero_logit", 2 * d, d, true);
    lin("grad_reverse_discriminator._decoder.0", d, d, true);
    lin("grad_reverse_discriminator._decoder.3", d, d, true);
    lin("grad_reverse_discriminator.out_layer", nb, d, true);
    s.push(("encoder.embedding.weight".into(), vec![c.ntoken, d]));
    s.push(("batch_encoder.embedding.weight".into(), vec![nb, d]));
    let mut norms = vec!["encoder.enc_norm".to_string(), "value_encoder.norm".into(), "batch_encoder.enc_norm".into(), "grad_reverse_discriminator._decoder.2".into(), "grad_reverse_discriminator._decoder.5".into()];
    for i in 0..c.nlayers {
        let p = format!("transformer_encoder.layers.{i}");
        s.push((format!("{p}.self_attn.in_proj_weight"), vec![3 * d, d]));
        s.push((format!("{p}.self_attn.in_proj_bias"), vec![3 * d]));
        norms.push(format!("{p}.norm1"));
        norms.push(format!("{p}.norm2"));
    }
    for n in norms {
        s.push((format!("{n}.weight"), vec![d]));
        s.push((format!("{n}.bias"), vec![d]));
    }
    s
}

/// `GradReverse`: the identity forward, the gradient times `-lambda` backward.
pub fn grad_reverse(x: &Tensor, lambda: f64) -> candle_core::Result<Tensor> {
    // -lambda x + (1 + lambda) x, the second term detached: x forward, -lambda backward
    let neg = (x * (-lambda))?;
    let pos = (x.detach() * (1.0 + lambda))?;
    neg + pos
}

fn leaky_relu(x: &Tensor) -> candle_core::Result<Tensor> {
    crate::nn::train_ops::leaky_relu(x, LEAKY as f32)
}

fn sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// `masked_mse_loss`: sum over masked positions of the squared error / their number.
fn masked_mse(pred: &Tensor, target: &Tensor, mask: &Tensor, n_masked: f64) -> candle_core::Result<Tensor> {
    ((pred - target)?.sqr()? * mask)?.sum_all()? / n_masked
}

/// `criterion_neg_log_bernoulli`: Bernoulli(probs) with torch's clamp of the probabilities to
/// [eps, 1 - eps] (float32 eps), the NLL of `target > 0` over masked positions.
fn neg_log_bernoulli(probs: &Tensor, target: &Tensor, mask: &Tensor, n_masked: f64) -> candle_core::Result<Tensor> {
    let eps = f32::EPSILON as f64;
    let p = probs.clamp(eps, 1.0 - eps)?;
    let y = target.gt(0.0)?.to_dtype(probs.dtype())?;
    let lp = ((&y * p.log()?)? + ((1.0 - &y)? * (1.0 - &p)?.log()?)?)?;
    (lp * mask)?.sum_all()?.neg()? / n_masked
}

impl TrainModel {
    /// A model from a state_dict (upstream names; flash-attn names already renamed by
    /// `scgpt::read_checkpoint`). Tensors that the checkpoint lacks or holds in another shape
    /// (the integration heads, which the pretrained checkpoint does not have) are drawn as
    /// PyTorch initialises them, seeded; the names so drawn are returned. `buffers` may hold
    /// DSBN's running statistics (`dsbn.bns.{i}.running_mean` / `running_var`).
    pub fn new(cfg: Config, tensors: &std::collections::HashMap<String, Tensor>, seed: u64, device: &Device) -> Result<(TrainModel, Vec<String>)> {
        let ctx = model_err("building the scGPT integration model");
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5c9e_11a7);
        let mut params = BTreeMap::new();
        let mut drawn = Vec::new();
        for (name, shape) in param_shapes(&cfg) {
            let t = match tensors.get(&name) {
                Some(t) if t.dims() == shape.as_slice() => t.to_dtype(DType::F32).and_then(|t| t.to_device(device)).map_err(&ctx)?,
                _ => {
                    drawn.push(name.clone());
                    let n: usize = shape.iter().product();
                    let v: Vec<f32> = if name.ends_with("norm.weight") || name.contains("norm1.weight") || name.contains("norm2.weight") || (name.starts_with("grad_reverse_discriminator._decoder.") && (name.contains(".2.weight") || name.contains(".5.weight"))) {
                        vec![1.0; n]
                    } else if name.ends_with("norm.bias") || name.contains("norm1.bias") || name.contains("norm2.bias") || (name.starts_with("grad_reverse_discriminator._decoder.") && (name.contains(".2.bias") || name.contains(".5.bias"))) || name.ends_with("in_proj_bias") {
                        vec![0.0; n]
                    } else if name.ends_with("embedding.weight") {
                        let nd = rand_distr::Normal::new(0.0f32, 1.0).unwrap();
                        (0..n).map(|_| rng.sample(nd)).collect()
                    } else {
                        // nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias
                        let fan_in = if name.ends_with(".bias") { tensors_fan_in(&cfg, &name) } else { shape[1] };
                        let a = 1.0 / (fan_in as f32).sqrt();
                        (0..n).map(|_| rng.gen_range(-a..a)).collect()
                    };
                    Tensor::from_vec(v, shape.as_slice(), device).map_err(&ctx)?
                }
            };
            params.insert(name, Var::from_tensor(&t).map_err(&ctx)?);
        }
        let d = cfg.embsize;
        let mut dsbn = Dsbn { running_mean: vec![vec![0.0; d]; cfg.n_batches], running_var: vec![vec![1.0; d]; cfg.n_batches], tracked: vec![0; cfg.n_batches] };
        for i in 0..cfg.n_batches {
            for (key, dst) in [("running_mean", &mut dsbn.running_mean[i]), ("running_var", &mut dsbn.running_var[i])] {
                if let Some(t) = tensors.get(&format!("dsbn.bns.{i}.{key}")) {
                    *dst = t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1()).map_err(&ctx)?;
                }
            }
        }
        Ok((TrainModel { cfg, params, dsbn, device: device.clone(), mixed: false, profile: None, fused_attention: true }, drawn))
    }

    fn p(&self, name: &str) -> &Tensor {
        self.params.get(name).unwrap_or_else(|| panic!("no parameter {name}")).as_tensor()
    }

    fn lin(&self, x: &Tensor, name: &str) -> candle_core::Result<Tensor> {
        self.lin_as(x, name, DType::F32)
    }

    /// [`Self::lin`] with its output stored as `out`.
    fn lin_as(&self, x: &Tensor, name: &str, out: DType) -> candle_core::Result<Tensor> {
        let b = self.params.get(&format!("{name}.bias")).map(|v| v.as_tensor());
        crate::nn::lean_linear::linear_as(x, self.p(&format!("{name}.weight")), b, self.mixed, out)
    }

    /// `x` at the end of profiled region `region` (itself when not profiling).
    fn mark(&self, x: Tensor, region: &str) -> candle_core::Result<Tensor> {
        match &self.profile {
            Some(p) => p.mark(&x, region),
            None => Ok(x),
        }
    }

    fn ln(&self, x: &Tensor, name: &str) -> candle_core::Result<Tensor> {
        crate::nn::layer_norm::layer_norm(x, self.p(&format!("{name}.weight")), self.p(&format!("{name}.bias")), LN_EPS as f32)
    }

    /// The trainable variables in name order.
    pub fn vars(&self) -> Vec<Var> {
        self.params.values().cloned().collect()
    }

    /// `_encode` up to the transformer output, and the gene token embeddings (for GEPC): (l, d)
    /// when every cell has the same genes, else (b, l, d).
    /// `train`: DSBN uses (and updates) batch statistics and dropout applies.
    fn encode(&mut self, mb: &Minibatch, values: &[f32], train: bool, drop: &mut Dropout) -> candle_core::Result<(Tensor, Tensor)> {
        let (b, l, d) = (mb.b, mb.l, self.cfg.embsize);
        let dev = self.device.clone();
        // every cell with the same genes in the same order (as `TrainData` builds them): the
        // embedding and its norm once, (l, d), broadcast over the cells; its gradient is then a
        // sum over the cells and a scatter of l rows, not of b x l
        let shared = mb.gene_ids.chunks(l.max(1)).all(|c| c == &mb.gene_ids[..l]);
        let genes = if shared {
            let ids = Tensor::from_vec(mb.gene_ids[..l].to_vec(), l, &dev)?;
            self.p("encoder.embedding.weight").index_select(&ids, 0)?
        } else {
            let ids = Tensor::from_vec(mb.gene_ids.clone(), b * l, &dev)?;
            self.p("encoder.embedding.weight").index_select(&ids, 0)?.reshape((b, l, d))?
        };
        let genes = self.mark(self.ln(&genes, "encoder.enc_norm")?, "gene embedding")?;
        let v = Tensor::from_vec(values.iter().map(|&x| x.min(512.0)).collect::<Vec<f32>>(), (b, l, 1), &dev)?;
        let v = relu_dropped(&self.lin(&v, "value_encoder.linear1")?, None)?;
        let v = self.ln(&self.lin(&v, "value_encoder.linear2")?, "value_encoder.norm")?;
        let v = if train { drop.apply(&v)? } else { v };
        let v = self.mark(v, "value encoder")?;
        let x = genes.broadcast_add(&v)?;
        // DSBN: the first cell's batch
        let k = mb.batch_labels[0] as usize;
        let x = if train {
            let mean = x.mean_keepdim(0)?.mean_keepdim(1)?;
            let xc = x.broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(0)?.mean_keepdim(1)?;
            let y = xc.broadcast_div(&(var.clone() + DSBN_EPS)?.sqrt()?)?;
            let n = (b * l) as f64;
            let mean_v: Vec<f32> = mean.flatten_all()?.to_vec1()?;
            let var_v: Vec<f32> = var.flatten_all()?.to_vec1()?;
            for j in 0..d {
                let rm = &mut self.dsbn.running_mean[k][j];
                *rm = ((1.0 - DSBN_MOMENTUM) * *rm as f64 + DSBN_MOMENTUM * mean_v[j] as f64) as f32;
                let rv = &mut self.dsbn.running_var[k][j];
                let unbiased = if n > 1.0 { var_v[j] as f64 * n / (n - 1.0) } else { var_v[j] as f64 };
                *rv = ((1.0 - DSBN_MOMENTUM) * *rv as f64 + DSBN_MOMENTUM * unbiased) as f32;
            }
            self.dsbn.tracked[k] += 1;
            y
        } else {
            let rm = Tensor::from_vec(self.dsbn.running_mean[k].clone(), (1, 1, d), &dev)?;
            let rv = Tensor::from_vec(self.dsbn.running_var[k].iter().map(|&v| ((v as f64 + DSBN_EPS).sqrt()) as f32).collect::<Vec<f32>>(), (1, 1, d), &dev)?;
            x.broadcast_sub(&rm)?.broadcast_div(&rv)?
        };
        let mut h = self.mark(x, "dsbn")?;
        for i in 0..self.cfg.nlayers {
            h = self.layer(&h, i, train, drop)?;
        }
        Ok((h, genes))
    }

    /// nn.TransformerEncoderLayer (post-norm, ReLU), no padding (every cell has all tokens).
    fn layer(&self, x: &Tensor, i: usize, train: bool, drop: &mut Dropout) -> candle_core::Result<Tensor> {
        let p = format!("transformer_encoder.layers.{i}");
        let (b, l, d) = x.dims3()?;
        let (nh, hd) = (self.cfg.nheads, d / self.cfg.nheads);
        // q, k and v: bf16 under mixed precision, laid out by heads in one copy, (3, b, h, l, hd)
        let dt = self.branch_dtype();
        let qkv = crate::nn::lean_linear::linear_as(x, self.p(&format!("{p}.self_attn.in_proj_weight")), Some(self.p(&format!("{p}.self_attn.in_proj_bias"))), self.mixed, dt)?;
        let qkv = self.mark(qkv, "qkv projection")?;
        let mask = if train { drop.next_mask() } else { None };
        let o = if self.fused_attention && crate::nn::flash_attention::applies(&qkv, nh) {
            // bf16 on a GPU with heads of 64: the fused kernels read qkv as it is
            crate::nn::flash_attention::attention(&qkv, nh, mask)?
        } else {
            let heads = qkv.reshape((b, l, 3, nh, hd))?.permute((2, 0, 3, 1, 4))?.contiguous()?;
            let scale = 1.0 / (hd as f32).sqrt();
            crate::nn::recompute_attention::attention(&heads, scale, mask, self.profile.as_ref())?.transpose(1, 2)?.reshape((b, l, d))?
        };
        let o = self.mark(o, "attention")?;
        // the branches' linear outputs in bf16 under mixed precision (as autocast's), the
        // residual sums and norms in f32; dropout applied inside the sum and the ReLU
        let o = self.lin_as(&o, &format!("{p}.self_attn.out_proj"), dt)?;
        let o = add_dropped(x, &o, if train { drop.next_mask() } else { None })?;
        let x = self.mark(self.ln(&o, &format!("{p}.norm1"))?, "out projection + norm1")?;
        let h = self.lin_as(&x, &format!("{p}.linear1"), dt)?;
        let h = relu_dropped(&h, if train { drop.next_mask() } else { None })?;
        let h = self.lin_as(&h, &format!("{p}.linear2"), dt)?;
        let h = add_dropped(&x, &h, if train { drop.next_mask() } else { None })?;
        self.mark(self.ln(&h, &format!("{p}.norm2"))?, "feed-forward + norm2")
    }

    /// The batch embeddings (BatchLabelEncoder) of the cells: (b, d).
    fn batch_emb(&self, labels: &[u32]) -> candle_core::Result<Tensor> {
        let ids = Tensor::from_vec(labels.to_vec(), labels.len(), &self.device)?;
        let e = self.p("batch_encoder.embedding.weight").index_select(&ids, 0)?;
        self.ln(&e, "batch_encoder.enc_norm")
    }

    /// The dtype of activations that only feed linear layers: bf16 under mixed precision.
    fn branch_dtype(&self) -> DType {
        if self.mixed {
            DType::BF16
        } else {
            DType::F32
        }
    }

    fn mlp3(&self, x: &Tensor, p: &str) -> candle_core::Result<Tensor> {
        let dt = self.branch_dtype();
        let h = leaky_relu(&self.lin_as(x, &format!("{p}.0"), dt)?)?;
        let h = leaky_relu(&self.lin_as(&h, &format!("{p}.2"), dt)?)?;
        self.lin(&h, &format!("{p}.4"))?.squeeze(D::Minus1)
    }

    /// One training step's forward pass: every objective's loss (training mode: DSBN's batch
    /// statistics, which it also records, and dropout).
    pub fn losses(&mut self, mb: &Minibatch, drop: &mut Dropout) -> candle_core::Result<Losses> {
        let (b, l, d) = (mb.b, mb.l, self.cfg.embsize);
        let dev = self.device.clone();
        let (h, genes) = self.encode(mb, &mb.input_values, true, drop)?;
        let be = self.batch_emb(&mb.batch_labels)?; // (b, d)
        let hb = Tensor::cat(&[&h, &be.unsqueeze(1)?.broadcast_as((b, l, d))?.contiguous()?], 2)?;
        let pred = self.mlp3(&hb, "decoder.fc")?;
        let zero = sigmoid(&self.mlp3(&hb, "decoder.zero_logit")?)?;
        let (pred, zero) = (self.mark(pred, "GEP decoder")?, self.mark(zero, "GEP decoder")?);
        let cell = h.narrow(1, 0, 1)?.squeeze(1)?; // (b, d)
        // MVC: sigmoid(gene2query(gene embs)), W(query) . [cell, batch]
        let query = sigmoid(&self.lin(&genes, "mvc_decoder.gene2query")?)?;
        let cb = Tensor::cat(&[&cell, &be], 1)?; // (b, 2d)
        // (W query) . cb per cell: with genes shared, one (l, 2d) x (2d, b) product
        let per_cell = |w: Tensor| -> candle_core::Result<Tensor> {
            if w.rank() == 2 {
                w.matmul(&cb.t()?)?.t()?.contiguous()
            } else {
                w.matmul(&cb.unsqueeze(2)?)?.squeeze(2)
            }
        };
        let mvc = per_cell(self.lin(&query, "mvc_decoder.W")?)?;
        let mvc_zero = sigmoid(&per_cell(self.lin(&query, "mvc_decoder.W_zero_logit")?)?)?;
        // the masked positions
        let mask_v: Vec<f32> = mb.input_values.iter().map(|&v| if v == MASK_VALUE { 1.0 } else { 0.0 }).collect();
        let n_masked: f64 = mask_v.iter().map(|&m| m as f64).sum();
        let mask = Tensor::from_vec(mask_v, (b, l), &dev)?;
        let target = Tensor::from_vec(mb.target_values.clone(), (b, l), &dev)?;
        let gep = masked_mse(&pred, &target, &mask, n_masked)?;
        let gep_zero = neg_log_bernoulli(&zero, &target, &mask, n_masked)?;
        let gepc = masked_mse(&mvc, &target, &mask, n_masked)?;
        let gepc_zero = neg_log_bernoulli(&mvc_zero, &target, &mask, n_masked)?;
        // ECS
        let norm = cell.sqr()?.sum_keepdim(1)?.sqrt()?;
        let cn = cell.broadcast_div(&norm)?;
        let cos = cn.matmul(&cn.t()?)?;
        let off: Vec<f32> = (0..b * b).map(|i| if i / b == i % b { 0.0 } else { 1.0 }).collect();
        let cos = (cos * Tensor::from_vec(off, (b, b), &dev)?)?.relu()?;
        let ecs = (1.0 - (cos - self.cfg.ecs_threshold)?.sqr()?)?.mean_all()?;
        // DAB: the discriminator on the reversed cell embedding
        let x = grad_reverse(&cell, 1.0)?;
        let x = self.ln(&leaky_relu(&self.lin(&x, "grad_reverse_discriminator._decoder.0")?)?, "grad_reverse_discriminator._decoder.2")?;
        let x = self.ln(&leaky_relu(&self.lin(&x, "grad_reverse_discriminator._decoder.3")?)?, "grad_reverse_discriminator._decoder.5")?;
        let logits = self.lin(&x, "grad_reverse_discriminator.out_layer")?;
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        let onehot: Vec<f32> = mb.batch_labels.iter().flat_map(|&y| (0..self.cfg.n_batches).map(move |j| if j == y as usize { 1.0 } else { 0.0 })).collect();
        let dab = ((logp * Tensor::from_vec(onehot, (b, self.cfg.n_batches), &dev)?)?.sum_all()? / (-(b as f64)))?;
        let total = ((&gep + &gep_zero)? + &gepc)?;
        let total = ((total + &gepc_zero)? + (&ecs * ECS_WEIGHT)?)?;
        let total = (total + (&dab * self.cfg.dab_weight)?)?;
        Ok(Losses { gep, gep_zero, gepc, gepc_zero, ecs, dab, total })
    }

    /// Validation as upstream's `evaluate()`: eval mode (running statistics, no dropout), the
    /// GEP masked MSE of the minibatch.
    pub fn eval_mse(&mut self, mb: &Minibatch) -> candle_core::Result<f64> {
        let (b, l, d) = (mb.b, mb.l, self.cfg.embsize);
        let mut nodrop = Dropout::new(0.0, 0);
        let (h, _) = self.encode(mb, &mb.input_values, false, &mut nodrop)?;
        let be = self.batch_emb(&mb.batch_labels)?;
        let hb = Tensor::cat(&[&h, &be.unsqueeze(1)?.broadcast_as((b, l, d))?.contiguous()?], 2)?;
        let pred = self.mlp3(&hb, "decoder.fc")?;
        let mask_v: Vec<f32> = mb.input_values.iter().map(|&v| if v == MASK_VALUE { 1.0 } else { 0.0 }).collect();
        let n_masked: f64 = mask_v.iter().map(|&m| m as f64).sum();
        if n_masked == 0.0 {
            return Ok(0.0);
        }
        let mask = Tensor::from_vec(mask_v, (b, l), &self.device)?;
        let target = Tensor::from_vec(mb.target_values.clone(), (b, l), &self.device)?;
        masked_mse(&pred, &target, &mask, n_masked)?.to_dtype(DType::F64)?.to_scalar::<f64>()
    }

    /// The L2-normalised `<cls>` outputs of cells of one batch label (eval mode, the target
    /// values unmasked), as upstream's `encode_batch(..., time_step=0)` then normalised.
    pub fn embed(&mut self, mb: &Minibatch) -> candle_core::Result<Vec<f32>> {
        let mut nodrop = Dropout::new(0.0, 0);
        let (h, _) = self.encode(mb, &mb.target_values, false, &mut nodrop)?;
        let cell = h.narrow(1, 0, 1)?.squeeze(1)?;
        let norm = cell.sqr()?.sum_keepdim(1)?.sqrt()?;
        cell.broadcast_div(&norm)?.flatten_all()?.to_vec1()
    }

    /// A snapshot of the parameters' values (to keep the best epoch).
    pub fn snapshot(&self) -> candle_core::Result<(BTreeMap<String, Tensor>, Dsbn)> {
        let mut m = BTreeMap::new();
        for (k, v) in &self.params {
            m.insert(k.clone(), v.as_tensor().copy()?);
        }
        Ok((m, self.dsbn.clone()))
    }

    /// Restore a [`Self::snapshot`].
    pub fn restore(&mut self, s: &(BTreeMap<String, Tensor>, Dsbn)) -> candle_core::Result<()> {
        for (k, v) in &self.params {
            v.set(&s.0[k])?;
        }
        self.dsbn = s.1.clone();
        Ok(())
    }

    /// Every tensor as upstream's state_dict names it (parameters and DSBN's buffers), f32 on
    /// the CPU.
    pub fn state_dict(&self) -> candle_core::Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (k, v) in &self.params {
            out.push((k.clone(), v.as_tensor().to_device(&Device::Cpu)?));
        }
        let d = self.cfg.embsize;
        for i in 0..self.cfg.n_batches {
            out.push((format!("dsbn.bns.{i}.running_mean"), Tensor::from_vec(self.dsbn.running_mean[i].clone(), d, &Device::Cpu)?));
            out.push((format!("dsbn.bns.{i}.running_var"), Tensor::from_vec(self.dsbn.running_var[i].clone(), d, &Device::Cpu)?));
            out.push((format!("dsbn.bns.{i}.num_batches_tracked"), Tensor::new(&[self.dsbn.tracked[i]], &Device::Cpu)?.squeeze(0)?));
        }
        Ok(out)
    }
}

/// The fan-in of a bias's layer (its weight's second dimension).
fn tensors_fan_in(c: &Config, bias: &str) -> usize {
    let w = bias.trim_end_matches(".bias").to_string() + ".weight";
    param_shapes(c).into_iter().find(|(n, _)| *n == w).map_or(1, |(_, s)| s.get(1).copied().unwrap_or(1))
}

// --------------------------------------------------------------------------------- training

/// The training options (defaults in methods/scgpt_integrated.toml).
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub epochs: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub adam_eps: f64,
    pub schedule_ratio: f64,
    pub mask_ratio: f64,
    pub valid_fraction: f64,
    pub max_grad_norm: f64,
    pub seed: u64,
}

/// The cells to train on: each cell's binned values over the genes (row-major n x g; bins,
/// zeros kept), the genes' token ids, and each cell's batch code.
pub struct TrainData {
    pub n: usize,
    pub g: usize,
    pub cls_id: u32,
    pub gene_ids: Vec<u32>,
    pub binned: Vec<f32>,
    pub batch: Vec<u32>,
}

/// One epoch's record.
#[derive(Debug, Clone)]
pub struct EpochLog {
    pub epoch: usize,
    pub lr: f64,
    /// Mean over minibatches of each objective (OBJECTIVES order) and the total.
    pub train: Vec<f64>,
    pub valid_mse: Option<f64>,
    pub seconds: f64,
    /// Training steps taken and cells they trained on.
    pub steps: usize,
    pub cells: usize,
    /// Where the epoch's time went (s): minibatches built on the host, forward passes (to the
    /// losses read back), backward passes with gradient clipping, optimiser steps, validation.
    pub phases: Phases,
}

/// An epoch's time by phase, in seconds; the device is synchronised at each phase's end.
#[derive(Debug, Clone, Copy, Default)]
pub struct Phases {
    pub batches: f64,
    pub forward: f64,
    pub backward: f64,
    pub optimizer: f64,
    pub validation: f64,
}

pub struct TrainResult {
    pub embedding: Vec<f32>,
    pub history: Vec<EpochLog>,
    pub best_epoch: usize,
    pub final_batch: usize,
    pub oom_retries: u32,
    pub n_train: usize,
    pub n_valid: usize,
    /// `SCFOUNDRY_STEP_PROFILE`'s table (TSV) of the training steps, when it was set.
    pub profile: Option<String>,
}

/// `random_mask_value`: per cell, `floor(tokens x ratio)` positions (the `<cls>` among them,
/// its value 0 not being pad_value) set to mask_value, drawn without replacement.
pub fn mask_values(values: &[f32], ratio: f64, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let mut out = values.to_vec();
    let candidates: Vec<usize> = (0..values.len()).filter(|&i| values[i] != PAD_VALUE).collect();
    let n_mask = (candidates.len() as f64 * ratio) as usize;
    for i in rand::seq::index::sample(rng, candidates.len(), n_mask) {
        out[candidates[i]] = MASK_VALUE;
    }
    out
}

impl TrainData {
    /// A cell's tokens' values: `<cls>` (0, as tokenize_and_pad_batch) then its bins.
    fn cell_values(&self, c: usize) -> Vec<f32> {
        std::iter::once(0.0).chain(self.binned[c * self.g..(c + 1) * self.g].iter().copied()).collect()
    }

    fn minibatch(&self, cells: &[usize], masked: &[Vec<f32>]) -> Minibatch {
        let l = self.g + 1;
        let ids: Vec<u32> = std::iter::once(self.cls_id).chain(self.gene_ids.iter().copied()).collect();
        let mut mb = Minibatch { b: cells.len(), l, gene_ids: Vec::new(), input_values: Vec::new(), target_values: Vec::new(), batch_labels: Vec::new() };
        for &c in cells {
            mb.gene_ids.extend(&ids);
            mb.input_values.extend(&masked[c]);
            mb.target_values.extend(self.cell_values(c));
            mb.batch_labels.push(self.batch[c]);
        }
        mb
    }
}

/// Minibatches of cells of one batch each (upstream's SubsetsBatchSampler: batches in label
/// order, cells shuffled within a label when `shuffle`).
fn per_batch_minibatches(cells: &[usize], batch: &[u32], size: usize, shuffle: Option<&mut ChaCha8Rng>) -> Vec<Vec<usize>> {
    let mut labels: Vec<u32> = cells.iter().map(|&c| batch[c]).collect();
    labels.sort();
    labels.dedup();
    let mut subsets: Vec<Vec<usize>> = labels.iter().map(|&k| cells.iter().copied().filter(|&c| batch[c] == k).collect()).collect();
    if let Some(rng) = shuffle {
        for s in subsets.iter_mut() {
            rand::seq::SliceRandom::shuffle(s.as_mut_slice(), rng);
        }
    }
    subsets.iter().flat_map(|s| s.chunks(size.max(1)).map(<[usize]>::to_vec).collect::<Vec<_>>()).collect()
}

/// Whether an error is CUDA running out of memory.
fn is_oom(e: &candle_core::Error) -> bool {
    crate::gpu::is_out_of_memory(&e.to_string())
}

/// Fine-tune `model` on `data` as upstream's finetune_integration.py does, then embed every
/// cell with the best epoch's weights. `progress(epoch, epochs, log)` is told of each epoch.
pub fn train(model: &mut TrainModel, data: &TrainData, o: &TrainOptions, mut progress: impl FnMut(&EpochLog)) -> Result<TrainResult> {
    let ctx = model_err("fine-tuning scGPT for integration");
    let mut rng = ChaCha8Rng::seed_from_u64(o.seed);
    // train_test_split(test_size=0.1, shuffle=True)
    let mut order: Vec<usize> = (0..data.n).collect();
    rand::seq::SliceRandom::shuffle(order.as_mut_slice(), &mut rng);
    let n_valid = if data.n >= 10 { ((data.n as f64) * o.valid_fraction).ceil() as usize } else { 0 };
    let (valid, train_cells) = order.split_at(n_valid);
    let (valid, train_cells) = (valid.to_vec(), train_cells.to_vec());
    let vars = model.vars();
    let mut opt = crate::nn::optim::Adam::new(&vars, o.lr, o.adam_eps, 0.0).map_err(&ctx)?;
    let mut dropout = Dropout::new(model.cfg.dropout, o.seed.wrapping_add(1));
    let mut batch_size = o.batch_size.max(1);
    let mut retries = 0u32;
    let mut history = Vec::new();
    let mut best: Option<(f64, usize, (BTreeMap<String, Tensor>, Dsbn))> = None;
    for epoch in 0..o.epochs {
        let started = std::time::Instant::now();
        let lr = crate::nn::optim::step_lr(o.lr, o.schedule_ratio, 1, epoch);
        opt.lr = lr;
        // masks drawn anew each epoch (prepare_data)
        let masked: Vec<Vec<f32>> = (0..data.n).map(|c| mask_values(&data.cell_values(c), o.mask_ratio, &mut rng)).collect();
        let mut sums = vec![0f64; OBJECTIVES.len() + 1];
        let (mut steps, mut trained) = (0usize, 0usize);
        let mut ph = Phases::default();
        let batches = per_batch_minibatches(&train_cells, &data.batch, batch_size, Some(&mut rng));
        let mut queue: std::collections::VecDeque<Vec<usize>> = batches.into();
        while let Some(cells) = queue.pop_front() {
            let t = std::time::Instant::now();
            let mb = data.minibatch(&cells, &masked);
            let stats = model.dsbn.clone();
            ph.batches += t.elapsed().as_secs_f64();
            let step = (|| -> candle_core::Result<Vec<f64>> {
                let t = std::time::Instant::now();
                if let Some(p) = &model.profile {
                    p.start()?;
                }
                let l = model.losses(&mb, &mut dropout)?;
                if let Some(p) = &model.profile {
                    p.start_backward("MVC decoder + losses")?;
                }
                let vals = l.values()?;
                ph.forward += t.elapsed().as_secs_f64();
                let t = std::time::Instant::now();
                let gs = l.total.backward()?;
                if let Some(p) = &model.profile {
                    p.end_backward()?;
                }
                drop(l); // the graph goes before the optimiser step
                let mut grads: Vec<Option<Tensor>> = vars.iter().map(|v| gs.get(v.as_tensor()).cloned()).collect();
                drop(gs);
                ph.backward += t.elapsed().as_secs_f64();
                let t = std::time::Instant::now();
                // clip_grad_norm_ then Adam (one pass of kernels on a GPU)
                opt.step_clipped(&vars, &mut grads, o.max_grad_norm)?;
                model.device.synchronize()?;
                ph.optimizer += t.elapsed().as_secs_f64();
                Ok(vals)
            })();
            match step {
                Ok(vals) => {
                    for (s, v) in sums.iter_mut().zip(vals) {
                        *s += v;
                    }
                    steps += 1;
                    trained += cells.len();
                }
                Err(e) if is_oom(&e) && cells.len() > 1 => {
                    // halve and retry the same cells (the statistics as before the failed step)
                    model.dsbn = stats;
                    retries += 1;
                    batch_size = cells.len().div_ceil(2);
                    let (a, b) = cells.split_at(batch_size);
                    queue.push_front(b.to_vec());
                    queue.push_front(a.to_vec());
                }
                Err(e) => return Err(ctx(e)),
            }
        }
        let t = std::time::Instant::now();
        let valid_mse = if valid.is_empty() {
            None
        } else {
            let (mut tot, mut n) = (0f64, 0usize);
            for cells in per_batch_minibatches(&valid, &data.batch, batch_size, None) {
                let mb = data.minibatch(&cells, &masked);
                tot += model.eval_mse(&mb).map_err(&ctx)? * cells.len() as f64;
                n += cells.len();
            }
            Some(tot / n as f64)
        };
        ph.validation = t.elapsed().as_secs_f64();
        let log = EpochLog { epoch: epoch + 1, lr, train: sums.iter().map(|s| s / steps.max(1) as f64).collect(), valid_mse, seconds: started.elapsed().as_secs_f64(), steps, cells: trained, phases: ph };
        progress(&log);
        let score = valid_mse.unwrap_or(log.train[OBJECTIVES.len()]);
        if !score.is_finite() {
            return Err(Error::Model { context: "fine-tuning scGPT for integration".into(), detail: format!("the loss is not finite at epoch {}", epoch + 1) });
        }
        if best.as_ref().is_none_or(|b| score < b.0) {
            best = Some((score, epoch + 1, model.snapshot().map_err(&ctx)?));
        }
        history.push(log);
    }
    let best_epoch = match &best {
        Some((_, e, snap)) => {
            model.restore(snap).map_err(&ctx)?;
            *e
        }
        None => 0,
    };
    // embed every cell, each batch with its own statistics
    let d = model.cfg.embsize;
    let mut embedding = vec![0f32; data.n * d];
    let all: Vec<usize> = (0..data.n).collect();
    let unmasked: Vec<Vec<f32>> = (0..data.n).map(|c| data.cell_values(c)).collect();
    for cells in per_batch_minibatches(&all, &data.batch, batch_size, None) {
        let mb = data.minibatch(&cells, &unmasked);
        let e = model.embed(&mb).map_err(&ctx)?;
        for (i, &c) in cells.iter().enumerate() {
            embedding[c * d..(c + 1) * d].copy_from_slice(&e[i * d..(i + 1) * d]);
        }
    }
    Ok(TrainResult { embedding, history, best_epoch, final_batch: batch_size, oom_retries: retries, n_train: train_cells.len(), n_valid: valid.len(), profile: model.profile.as_ref().map(|p| p.tsv()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reversal_negates_the_gradient() {
        let x = Var::from_vec(vec![0.5f32, -1.5, 2.0], 3, &Device::Cpu).unwrap();
        let w = Tensor::new(&[1f32, 2.0, -3.0], &Device::Cpu).unwrap();
        let y = grad_reverse(x.as_tensor(), 1.0).unwrap();
        assert_eq!(y.to_vec1::<f32>().unwrap(), vec![0.5, -1.5, 2.0]);
        let g = (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap(), vec![-1.0, -2.0, 3.0]);
    }

    #[test]
    fn masks_take_the_ratio_of_tokens() {
        let v: Vec<f32> = (0..1201).map(|i| (i % 7) as f32).collect();
        let m = mask_values(&v, 0.4, &mut ChaCha8Rng::seed_from_u64(1));
        assert_eq!(m.iter().filter(|&&x| x == MASK_VALUE).count(), 480);
        assert!(m.iter().zip(&v).all(|(a, b)| *a == MASK_VALUE || a == b));
    }

    #[test]
    fn minibatches_hold_one_batch_each() {
        let batch = [0u32, 1, 0, 2, 1, 0, 0];
        let mb = per_batch_minibatches(&[0, 1, 2, 3, 4, 5, 6], &batch, 2, None);
        assert_eq!(mb, vec![vec![0, 2], vec![5, 6], vec![1, 4], vec![3]]);
        assert!(mb.iter().all(|m| m.iter().all(|&c| batch[c] == batch[m[0]])));
    }
}
