//! Fine-tuning: a linear classification head on a cell embedding, and optionally the last N
//! encoder layers of a transformer, trained with candle's autograd and AdamW
//! (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019; candle-nn's
//! `AdamW`, which follows `torch.optim.AdamW`).
//!
//! - The head is `torch.nn.Linear(d, k)`: logits = x Wᵀ + b, initialised as PyTorch does
//!   (uniform in ±1/√d for W and b), from the seed.
//! - The loss is the mean softmax cross-entropy over the batch (`torch.nn.CrossEntropyLoss`).
//! - The labelled cells are split into training and validation sets per class (stratified),
//!   seeded; each epoch shuffles the training cells (seeded) and steps AdamW once per batch.
//! - Early stopping watches the validation loss (the training loss when there is no validation
//!   set): after `patience` epochs without a new minimum training stops, and the weights of the
//!   best epoch are the result.
//! - Unfrozen layers: a model loads its weights through [`LoadHook`], which turns the tensors of
//!   its last N encoder layers into candle `Var`s (and can replace them with fine-tuned ones);
//!   AdamW updates exactly those and the head. Layers before them carry no gradient.
//!
//! Three random streams come from one seed (ChaCha8 streams 1, 2, 3): the split, the head's
//! initial weights and the shuffling, so the same seed gives identical weights.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor, Var, D};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

fn model_err(context: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Model { context: context.into(), detail: e.to_string() }
}

/// A seeded random stream: 1 the split, 2 the head's initial weights, 3 the shuffling.
pub fn stream(seed: u64, which: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(which);
    r
}

/// Training and validation cells (indices into the labelled cells), each sorted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub train: Vec<usize>,
    pub val: Vec<usize>,
    /// Classes with a single cell: they stay in training only.
    pub singletons: usize,
}

/// Stratified split: per class, `round(fraction x count)` cells go to validation, but at least
/// one cell of each class stays in training (a class of one cell is not validated).
pub fn split(labels: &[u32], n_classes: usize, val_fraction: f64, seed: u64) -> Split {
    let mut rng = stream(seed, 1);
    let mut by_class: Vec<Vec<usize>> = vec![Vec::new(); n_classes];
    for (i, &c) in labels.iter().enumerate() {
        by_class[c as usize].push(i);
    }
    let (mut train, mut val, mut singletons) = (Vec::new(), Vec::new(), 0);
    for mut cells in by_class {
        if cells.is_empty() {
            continue;
        }
        if cells.len() == 1 {
            singletons += 1;
        }
        cells.shuffle(&mut rng);
        let k = ((val_fraction * cells.len() as f64).round() as usize).min(cells.len() - 1);
        val.extend_from_slice(&cells[..k]);
        train.extend_from_slice(&cells[k..]);
    }
    train.sort_unstable();
    val.sort_unstable();
    Split { train, val, singletons }
}

/// A linear head `d -> k`, PyTorch's `nn.Linear` initialisation from stream 2 of the seed.
pub struct Head {
    pub w: Var,
    pub b: Var,
}

impl Head {
    pub fn init(d: usize, k: usize, seed: u64, device: &Device) -> Result<Head> {
        let mut rng = stream(seed, 2);
        let bound = 1.0 / (d.max(1) as f32).sqrt();
        let w: Vec<f32> = (0..k * d).map(|_| rng.gen_range(-bound..bound)).collect();
        let b: Vec<f32> = (0..k).map(|_| rng.gen_range(-bound..bound)).collect();
        let ctx = model_err("creating the classification head");
        let w = Var::from_vec(w, (k, d), device).map_err(&ctx)?;
        let b = Var::from_vec(b, k, device).map_err(&ctx)?;
        Ok(Head { w, b })
    }

    /// From saved tensors (`head.weight` k x d, `head.bias` k).
    pub fn from_tensors(w: &Tensor, b: &Tensor) -> Result<Head> {
        let ctx = model_err("loading the classification head");
        Ok(Head { w: Var::from_tensor(w).map_err(&ctx)?, b: Var::from_tensor(b).map_err(&ctx)? })
    }

    pub fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.matmul(&self.w.as_tensor().t()?)?.broadcast_add(self.b.as_tensor())
    }
}

/// The mean cross-entropy of logits against class codes.
pub fn loss(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::loss::cross_entropy(logits, targets)
}

/// Per row: the most probable class and its softmax probability.
pub fn predict_rows(logits: &Tensor) -> candle_core::Result<(Vec<u32>, Vec<f32>)> {
    let p = candle_nn::ops::softmax_last_dim(logits)?;
    let best = p.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let conf = p.max(D::Minus1)?.to_vec1::<f32>()?;
    Ok((best, conf))
}

/// The cells' features for the head: the frozen embedding, or a model's forward pass whose
/// last layers are trainable.
pub trait Features {
    /// Rows `(cells.len(), dim)` on the training device.
    fn forward(&mut self, cells: &[usize]) -> Result<Tensor>;

    /// Whether the features are a fixed embedding already (nothing to run before training).
    fn precomputed(&self) -> bool {
        false
    }
}

/// A fixed embedding (n x d) held on the device.
pub struct Cached(pub Tensor);

impl Features for Cached {
    fn forward(&mut self, cells: &[usize]) -> Result<Tensor> {
        let ctx = model_err("selecting embedding rows");
        let idx = Tensor::from_vec(cells.iter().map(|&i| i as u32).collect::<Vec<_>>(), cells.len(), self.0.device()).map_err(&ctx)?;
        self.0.index_select(&idx, 0).map_err(&ctx)
    }

    fn precomputed(&self) -> bool {
        true
    }
}

#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub epochs: usize,
    pub batch_size: usize,
    /// Batch for validation and prediction (no gradients).
    pub predict_batch_size: usize,
    pub lr: f64,
    pub weight_decay: f64,
    /// Epochs without a new best monitored loss before stopping; 0 never stops early.
    pub patience: usize,
    pub seed: u64,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions { epochs: 20, batch_size: 64, predict_batch_size: 256, lr: 1e-3, weight_decay: 0.01, patience: 5, seed: 0 }
    }
}

/// One epoch's record.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EpochStats {
    pub epoch: usize,
    pub train_loss: f64,
    pub train_accuracy: f64,
    pub val_loss: Option<f64>,
    pub val_accuracy: Option<f64>,
    pub seconds: f64,
}

/// The result: the head and the unfrozen tensors of the best epoch, and the curves.
pub struct Trained {
    pub head_w: Tensor,
    pub head_b: Tensor,
    pub layers: Vec<(String, Tensor)>,
    pub history: Vec<EpochStats>,
    pub best_epoch: usize,
    pub stopped_early: bool,
    /// `val_loss` or `train_loss`: what early stopping watched.
    pub monitor: &'static str,
}

/// Loss and accuracy over `cells` without updating anything.
pub fn evaluate(feat: &mut dyn Features, head: &Head, labels: &[u32], cells: &[usize], batch: usize) -> Result<(f64, f64)> {
    let ctx = model_err("evaluating the head");
    let (mut total, mut correct) = (0f64, 0usize);
    for chunk in cells.chunks(batch.max(1)) {
        let x = feat.forward(chunk)?.detach();
        let logits = head.logits(&x).map_err(&ctx)?.detach();
        let y = Tensor::from_vec(chunk.iter().map(|&i| labels[i]).collect::<Vec<_>>(), chunk.len(), x.device()).map_err(&ctx)?;
        let l = loss(&logits, &y).and_then(|l| l.to_scalar::<f32>()).map_err(&ctx)? as f64;
        total += l * chunk.len() as f64;
        let (pred, _) = predict_rows(&logits).map_err(&ctx)?;
        correct += pred.iter().zip(chunk).filter(|(p, &i)| **p == labels[i]).count();
    }
    let n = cells.len().max(1) as f64;
    Ok((total / n, correct as f64 / n))
}

/// Train the head (and `layers`, the unfrozen model tensors) on `split.train`, validating on
/// `split.val`. `labels` are class codes of the cells `feat` indexes. `on_epoch` hears each epoch.
#[allow(clippy::too_many_arguments)]
pub fn train(
    feat: &mut dyn Features,
    dim: usize,
    labels: &[u32],
    n_classes: usize,
    split: &Split,
    layers: &[(String, Var)],
    o: &TrainOptions,
    device: &Device,
    mut on_epoch: impl FnMut(&EpochStats),
) -> Result<Trained> {
    let ctx = model_err("training the head");
    let head = Head::init(dim, n_classes, o.seed, device)?;
    let mut vars = vec![head.w.clone(), head.b.clone()];
    vars.extend(layers.iter().map(|(_, v)| v.clone()));
    let mut opt = AdamW::new(vars, ParamsAdamW { lr: o.lr, weight_decay: o.weight_decay, ..Default::default() }).map_err(&ctx)?;
    let mut rng = stream(o.seed, 3);
    let snapshot = |head: &Head| -> Result<(Tensor, Tensor, Vec<(String, Tensor)>)> {
        let c = model_err("copying weights");
        Ok((
            head.w.as_tensor().copy().map_err(&c)?,
            head.b.as_tensor().copy().map_err(&c)?,
            layers.iter().map(|(n, v)| Ok((n.clone(), v.as_tensor().copy().map_err(&c)?))).collect::<Result<Vec<_>>>()?,
        ))
    };
    let monitor = if split.val.is_empty() { "train_loss" } else { "val_loss" };
    let mut best = (f64::INFINITY, 0usize, snapshot(&head)?);
    let mut history = Vec::new();
    let mut stopped_early = false;
    let mut order = split.train.clone();
    for epoch in 1..=o.epochs {
        let t0 = std::time::Instant::now();
        order.shuffle(&mut rng);
        let (mut total, mut correct) = (0f64, 0usize);
        for chunk in order.chunks(o.batch_size.max(1)) {
            let x = feat.forward(chunk)?;
            let logits = head.logits(&x).map_err(&ctx)?;
            let y = Tensor::from_vec(chunk.iter().map(|&i| labels[i]).collect::<Vec<_>>(), chunk.len(), device).map_err(&ctx)?;
            let l = loss(&logits, &y).map_err(&ctx)?;
            let grads = l.backward().map_err(&ctx)?;
            if let Some((name, _)) = layers.iter().find(|(_, v)| grads.get(v.as_tensor()).is_none()) {
                // a kernel without a backward pass between the layer and the head
                return Err(Error::Model { context: "training the unfrozen layers".into(), detail: format!("no gradient reaches {name}: the model runs a kernel without a backward pass after it") });
            }
            opt.step(&grads).map_err(&ctx)?;
            total += l.to_scalar::<f32>().map_err(&ctx)? as f64 * chunk.len() as f64;
            let (pred, _) = predict_rows(&logits.detach()).map_err(&ctx)?;
            correct += pred.iter().zip(chunk).filter(|(p, &i)| **p == labels[i]).count();
        }
        let n = order.len().max(1) as f64;
        let (val_loss, val_accuracy) = if split.val.is_empty() {
            (None, None)
        } else {
            let (l, a) = evaluate(feat, &head, labels, &split.val, o.predict_batch_size)?;
            (Some(l), Some(a))
        };
        let s = EpochStats { epoch, train_loss: total / n, train_accuracy: correct as f64 / n, val_loss, val_accuracy, seconds: t0.elapsed().as_secs_f64() };
        on_epoch(&s);
        let watched = val_loss.unwrap_or(s.train_loss);
        history.push(s);
        if watched < best.0 {
            best = (watched, epoch, snapshot(&head)?);
        } else if o.patience > 0 && epoch - best.1 >= o.patience {
            stopped_early = epoch < o.epochs;
            break;
        }
    }
    let (_, best_epoch, (head_w, head_b, layers)) = best;
    Ok(Trained { head_w, head_b, layers, history, best_epoch, stopped_early, monitor })
}

/// Predicted class and confidence of every cell in `cells`, in batches.
pub fn predict(feat: &mut dyn Features, head: &Head, cells: &[usize], batch: usize, mut progress: impl FnMut(usize)) -> Result<(Vec<u32>, Vec<f32>)> {
    let ctx = model_err("predicting labels");
    let (mut codes, mut conf) = (Vec::with_capacity(cells.len()), Vec::with_capacity(cells.len()));
    for chunk in cells.chunks(batch.max(1)) {
        let x = feat.forward(chunk)?.detach();
        let (c, p) = predict_rows(&head.logits(&x).map_err(&ctx)?).map_err(&ctx)?;
        codes.extend(c);
        conf.extend(p);
        progress(chunk.len());
    }
    Ok((codes, conf))
}

// ---- unfrozen layers --------------------------------------------------------------------

/// The layer index of a tensor name under `marker` (e.g. `encoder.layer.` in
/// `bert.encoder.layer.5.output.dense.weight` gives 5).
pub fn layer_of(name: &str, marker: &str) -> Option<usize> {
    let at = name.find(marker)?;
    let rest = &name[at + marker.len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    if digits.is_empty() || !rest[digits.len()..].starts_with('.') {
        return None;
    }
    digits.parse().ok()
}

/// How a model loads its weights for fine-tuning: which of its encoder layers become
/// trainable `Var`s (the last `unfreeze` of them), and fine-tuned tensors that replace the
/// checkpoint's (from a saved model.safetensors).
#[derive(Clone, Default)]
pub struct LoadHook {
    pub unfreeze: usize,
    pub overrides: HashMap<String, Tensor>,
    vars: Arc<Mutex<Vec<(String, Var)>>>,
    /// Record every tensor handed out (see `loaded`); off by default.
    record: bool,
    loaded: Arc<Mutex<Vec<(String, Tensor)>>>,
}

impl LoadHook {
    pub fn new(unfreeze: usize, overrides: HashMap<String, Tensor>) -> LoadHook {
        LoadHook { unfreeze, overrides, vars: Default::default(), record: false, loaded: Default::default() }
    }

    /// Keep a handle on every tensor the model takes, for `loaded`.
    pub fn recording(mut self) -> LoadHook {
        self.record = true;
        self
    }

    /// With `recording`: every tensor the model took, by checkpoint name, as the model holds it
    /// (a trainable tensor's handle shows the optimiser's updates), to check the live weights.
    pub fn loaded(&self) -> Vec<(String, Tensor)> {
        self.loaded.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The trainable tensors the model took, by checkpoint name, in load order.
    pub fn vars(&self) -> Vec<(String, Var)> {
        self.vars.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Wrap a model's root VarBuilder: tensors of layers `n_layers - unfreeze ..` under
    /// `marker` come back as Vars. Fails when the model has fewer layers than asked.
    pub fn wrap(&self, vb: VarBuilder<'static>, marker: &str, n_layers: usize, device: &Device) -> Result<VarBuilder<'static>> {
        if self.unfreeze > n_layers {
            return Err(Error::BadOption {
                option: "--unfreeze-layers".into(),
                detail: format!("{} layers asked, but the model runs {n_layers} encoder layers", self.unfreeze),
                hint: Some(format!("pass --unfreeze-layers {n_layers} or fewer")),
            });
        }
        let backend = Backend { inner: vb, marker: marker.to_string(), first: n_layers - self.unfreeze, unfreeze: self.unfreeze, overrides: self.overrides.clone(), vars: self.vars.clone(), loaded: self.record.then(|| self.loaded.clone()) };
        Ok(VarBuilder::from_backend(Box::new(backend), DType::F32, device.clone()))
    }
}

struct Backend {
    inner: VarBuilder<'static>,
    marker: String,
    first: usize,
    unfreeze: usize,
    overrides: HashMap<String, Tensor>,
    vars: Arc<Mutex<Vec<(String, Var)>>>,
    loaded: Option<Arc<Mutex<Vec<(String, Tensor)>>>>,
}

impl Backend {
    fn finish(&self, name: &str, t: Tensor) -> candle_core::Result<Tensor> {
        let t = self.trainable(name, t)?;
        if let Some(Ok(mut l)) = self.loaded.as_ref().map(|l| l.lock()) {
            l.push((name.to_string(), t.clone()));
        }
        Ok(t)
    }

    fn trainable(&self, name: &str, t: Tensor) -> candle_core::Result<Tensor> {
        if self.unfreeze == 0 || !layer_of(name, &self.marker).is_some_and(|l| l >= self.first) {
            return Ok(t);
        }
        let mut vars = self.vars.lock().map_err(|_| candle_core::Error::Msg("poisoned lock".into()))?;
        if let Some((_, v)) = vars.iter().find(|(n, _)| n == name) {
            return Ok(v.as_tensor().clone());
        }
        let v = Var::from_tensor(&t)?;
        vars.push((name.to_string(), v.clone()));
        Ok(v.as_tensor().clone())
    }
}

impl SimpleBackend for Backend {
    fn get(&self, s: Shape, name: &str, h: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = match self.overrides.get(name) {
            Some(t) => {
                if t.shape() != &s {
                    candle_core::bail!("fine-tuned tensor {name} is {:?}, the model expects {:?}", t.shape(), s)
                }
                t.to_dtype(dtype)?.to_device(dev)?
            }
            None => self.inner.get_with_hints_dtype(s, name, h, dtype)?,
        };
        self.finish(name, t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = match self.overrides.get(name) {
            Some(t) => t.to_dtype(dtype)?.to_device(dev)?,
            None => self.inner.get_unchecked_dtype(name, dtype)?,
        };
        self.finish(name, t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.overrides.contains_key(name) || self.inner.contains_tensor(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_is_stratified_and_seeded() {
        let labels: Vec<u32> = (0..100).map(|i| if i < 80 { 0 } else if i < 99 { 1 } else { 2 }).collect();
        let s = split(&labels, 3, 0.1, 7);
        assert_eq!(s.val.iter().filter(|&&i| labels[i] == 0).count(), 8);
        assert_eq!(s.val.iter().filter(|&&i| labels[i] == 1).count(), 2);
        assert_eq!(s.val.iter().filter(|&&i| labels[i] == 2).count(), 0);
        assert_eq!(s.singletons, 1);
        assert_eq!(s.train.len() + s.val.len(), 100);
        assert_eq!(s, split(&labels, 3, 0.1, 7));
        assert_ne!(s.val, split(&labels, 3, 0.1, 8).val);
    }

    #[test]
    fn layer_names() {
        assert_eq!(layer_of("bert.encoder.layer.5.output.dense.weight", "encoder.layer."), Some(5));
        assert_eq!(layer_of("transformer_encoder.layers.11.norm1.bias", "transformer_encoder.layers."), Some(11));
        assert_eq!(layer_of("encoder.embedding.weight", "encoder.layer."), None);
    }
}
