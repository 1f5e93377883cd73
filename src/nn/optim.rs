//! Optimisers and schedules with PyTorch's semantics, for models trained with candle's
//! autograd: `torch.optim.Adam` (L2 weight decay added to the gradient), `clip_grad_norm_`, and
//! `lr_scheduler.StepLR`.

use candle_core::{Result, Tensor, Var};

/// `torch.optim.Adam(params, lr, betas=(0.9, 0.999), eps, weight_decay)`.
pub struct Adam {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: i32,
}

impl Adam {
    pub fn new(vars: &[Var], lr: f64, eps: f64, weight_decay: f64) -> Result<Adam> {
        let z = |v: &Var| v.as_tensor().zeros_like();
        Ok(Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps,
            weight_decay,
            m: vars.iter().map(z).collect::<Result<_>>()?,
            v: vars.iter().map(z).collect::<Result<_>>()?,
            t: 0,
        })
    }

    /// One step; `grads[i]` is the gradient of `vars[i]` (None: the parameter is left as is,
    /// as torch skips parameters whose `.grad` is None).
    pub fn step(&mut self, vars: &[Var], grads: &[Option<Tensor>]) -> Result<()> {
        self.t += 1;
        let bc1 = 1.0 - self.beta1.powi(self.t);
        let bc2 = 1.0 - self.beta2.powi(self.t);
        for (i, (var, g)) in vars.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let g = if self.weight_decay != 0.0 { (g + (var.as_tensor() * self.weight_decay)?)? } else { g.clone() };
            self.m[i] = ((&self.m[i] * self.beta1)? + (&g * (1.0 - self.beta1))?)?;
            self.v[i] = ((&self.v[i] * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
            let denom = ((self.v[i].sqrt()? / bc2.sqrt())? + self.eps)?;
            let upd = ((&self.m[i] / denom)? * (self.lr / bc1))?;
            var.set(&(var.as_tensor() - upd)?)?;
        }
        Ok(())
    }
}

/// `torch.nn.utils.clip_grad_norm_(params, max_norm)`: scales the gradients in place when
/// their total L2 norm exceeds `max_norm` (coefficient `max_norm / (norm + 1e-6)`); returns
/// the norm before clipping.
pub fn clip_grad_norm(grads: &mut [Option<Tensor>], max_norm: f64) -> Result<f64> {
    // each tensor's sum of squares stays on the device; one read-back for all of them
    let sums: Vec<Tensor> = grads.iter().flatten().map(|g| g.to_dtype(candle_core::DType::F32)?.sqr()?.sum_all()?.reshape(1)).collect::<Result<_>>()?;
    if sums.is_empty() {
        return Ok(0.0);
    }
    let sq: f64 = Tensor::cat(&sums, 0)?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?.iter().sum();
    let norm = sq.sqrt();
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for g in grads.iter_mut().flatten() {
            *g = (&*g * coef)?;
        }
    }
    Ok(norm)
}

/// `lr_scheduler.StepLR(optimizer, step_size, gamma)`: the learning rate of epoch `epoch`
/// (0-based, stepped once per epoch).
pub fn step_lr(base: f64, gamma: f64, step_size: usize, epoch: usize) -> f64 {
    base * gamma.powi((epoch / step_size.max(1)) as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Two Adam steps on one parameter against torch.optim.Adam (lr 0.1, eps 1e-8):
    /// p = [1, -2], grads [0.5, 0.25] then [-1, 2] give [0.8, -2.2] after step 1 (each moves by
    /// lr, sign of the gradient) and torch's [0.7452..., -2.2999...] after step 2.
    #[test]
    fn adam_matches_torch() {
        let v = Var::from_vec(vec![1f32, -2.0], 2, &Device::Cpu).unwrap();
        let mut a = Adam::new(std::slice::from_ref(&v), 0.1, 1e-8, 0.0).unwrap();
        a.step(std::slice::from_ref(&v), &[Some(Tensor::new(&[0.5f32, 0.25], &Device::Cpu).unwrap())]).unwrap();
        let p = v.as_tensor().to_vec1::<f32>().unwrap();
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] + 2.1).abs() < 1e-6, "{p:?}");
        a.step(std::slice::from_ref(&v), &[Some(Tensor::new(&[-1f32, 2.0], &Device::Cpu).unwrap())]).unwrap();
        // m = 0.9*0.05 - 0.1 = -0.055 -> /0.19; v = 0.999*0.00025 + 0.001 -> /0.001999
        let (m0, v0) = ((0.9f64 * 0.05 + 0.1 * -1.0) / 0.19, (0.999f64 * 0.00025 + 0.001) / (1.0 - 0.999f64.powi(2)));
        let want0 = 0.9 - 0.1 * m0 / (v0.sqrt() + 1e-8);
        let p = v.as_tensor().to_vec1::<f32>().unwrap();
        assert!((p[0] as f64 - want0).abs() < 1e-5, "{p:?} {want0}");
    }

    #[test]
    fn clipping_scales_to_max_norm() {
        let mut g = vec![Some(Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap()), None];
        let n = clip_grad_norm(&mut g, 1.0).unwrap();
        assert!((n - 5.0).abs() < 1e-9);
        let v = g[0].as_ref().unwrap().to_vec1::<f32>().unwrap();
        assert!((v[0] - 0.6).abs() < 1e-5 && (v[1] - 0.8).abs() < 1e-5);
        assert!((step_lr(1e-4, 0.9, 1, 2) - 0.81e-4).abs() < 1e-12);
    }
}
