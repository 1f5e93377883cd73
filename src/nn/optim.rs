//! Optimisers and schedules with PyTorch's semantics, for models trained with candle's
//! autograd: `torch.optim.Adam` (L2 weight decay added to the gradient), `clip_grad_norm_`, and
//! `lr_scheduler.StepLR`.
//!
//! On a GPU (f32 parameters and gradients, no weight decay) a step runs as `gpu/adam.rs`'
//! kernels: each parameter's two moments in one (2, n) buffer updated in place, then its value
//! in place, the clipping folded in ([`Adam::step_clipped`]): three launches a parameter and no
//! read-back, where the composed ops below take fourteen passes and a read-back of the norm.
//! The kernels repeat the composed ops' f32 arithmetic; the norm is summed in another order.

use candle_core::{Result, Tensor, Var};

/// A parameter's moments: m and v apart (the composed ops), or packed as (2, n) for the
/// GPU's kernels.
enum Moments {
    Pair { m: Tensor, v: Tensor },
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Packed(Tensor),
}

/// `torch.optim.Adam(params, lr, betas=(0.9, 0.999), eps, weight_decay)`.
pub struct Adam {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Each parameter's moments, from its first step on (zeros before, as torch's).
    state: Vec<Option<Moments>>,
    t: i32,
}

impl Adam {
    pub fn new(vars: &[Var], lr: f64, eps: f64, weight_decay: f64) -> Result<Adam> {
        Ok(Adam { lr, beta1: 0.9, beta2: 0.999, eps, weight_decay, state: vars.iter().map(|_| None).collect(), t: 0 })
    }

    /// One step; `grads[i]` is the gradient of `vars[i]` (None: the parameter is left as is,
    /// as torch skips parameters whose `.grad` is None).
    pub fn step(&mut self, vars: &[Var], grads: &[Option<Tensor>]) -> Result<()> {
        self.step_with(vars, grads, None)
    }

    /// `clip_grad_norm(grads, max_norm)` then [`Adam::step`]; on a GPU the clipping runs inside
    /// the step's kernels (the gradients are not changed).
    pub fn step_clipped(&mut self, vars: &[Var], grads: &mut [Option<Tensor>], max_norm: f64) -> Result<()> {
        if self.fused(vars, grads) {
            return self.step_with(vars, grads, Some(max_norm));
        }
        clip_grad_norm(grads, max_norm)?;
        self.step_with(vars, grads, None)
    }

    /// Whether the GPU's kernels take this step: every parameter with a gradient f32 and
    /// contiguous on a CUDA device, its gradient likewise, no weight decay.
    fn fused(&self, vars: &[Var], grads: &[Option<Tensor>]) -> bool {
        let ok = |t: &Tensor| cfg!(feature = "cuda") && t.device().is_cuda() && t.dtype() == candle_core::DType::F32 && t.is_contiguous();
        self.weight_decay == 0.0 && vars.iter().zip(grads).all(|(v, g)| g.as_ref().is_none_or(|g| ok(v.as_tensor()) && ok(g) && g.dims() == v.dims()))
    }

    /// One step; with `clip` (the fused path only) the gradients are clipped to that norm inside
    /// the kernels.
    fn step_with(&mut self, vars: &[Var], grads: &[Option<Tensor>], clip: Option<f64>) -> Result<()> {
        self.t += 1;
        let bc1 = 1.0 - self.beta1.powi(self.t);
        let bc2 = 1.0 - self.beta2.powi(self.t);
        if self.fused(vars, grads) && vars.iter().any(|v| v.as_tensor().device().is_cuda()) {
            return self.fused_step(vars, grads, clip, bc1, bc2);
        }
        for (i, (var, g)) in vars.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let g = if self.weight_decay != 0.0 { (g + (var.as_tensor() * self.weight_decay)?)? } else { g.clone() };
            let (m, v) = match self.state[i].take() {
                Some(Moments::Pair { m, v }) => (m, v),
                _ => (var.as_tensor().zeros_like()?, var.as_tensor().zeros_like()?),
            };
            let m = ((&m * self.beta1)? + (&g * (1.0 - self.beta1))?)?;
            let v = ((&v * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
            let denom = ((v.sqrt()? / bc2.sqrt())? + self.eps)?;
            let upd = ((&m / denom)? * (self.lr / bc1))?;
            var.set(&(var.as_tensor() - upd)?)?;
            self.state[i] = Some(Moments::Pair { m, v });
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn fused_step(&mut self, vars: &[Var], grads: &[Option<Tensor>], clip: Option<f64>, bc1: f64, bc2: f64) -> Result<()> {
        let Some(dev) = vars.first().map(|v| v.as_tensor().device().clone()) else { return Ok(()) };
        let total = Tensor::zeros(1, candle_core::DType::F64, &dev)?;
        if clip.is_some() {
            for g in grads.iter().flatten() {
                total.inplace_op2(g, &fused::SumSquares)?;
            }
        }
        let moments = fused::Moments { max_norm: clip.unwrap_or(0.0), beta1: self.beta1, beta2: self.beta2 };
        let update = fused::Update { inv_bc2_sqrt: (1.0 / bc2.sqrt()) as f32, eps: self.eps as f32, step_size: (self.lr / bc1) as f32 };
        for (i, (var, g)) in vars.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let mv = match self.state[i].take() {
                Some(Moments::Packed(mv)) => mv,
                _ => Tensor::zeros((2, var.elem_count()), candle_core::DType::F32, &dev)?,
            };
            mv.inplace_op3(g, &total, &moments)?;
            var.as_tensor().inplace_op2(&mv, &update)?;
            self.state[i] = Some(Moments::Packed(mv));
        }
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    fn fused_step(&mut self, _: &[Var], _: &[Option<Tensor>], _: Option<f64>, _: f64, _: f64) -> Result<()> {
        candle_core::bail!("adam: the fused step runs on a GPU")
    }
}

/// The in-place ops of the fused step (`gpu/adam.rs`); GPU only.
#[cfg(feature = "cuda")]
mod fused {
    use candle_core::backend::BackendStorage;
    use candle_core::{CpuStorage, CudaStorage, Layout, Result};

    fn no_cpu(name: &str) -> Result<()> {
        candle_core::bail!("{name}: runs on a GPU")
    }

    fn range(l: &Layout, name: &str) -> Result<(usize, usize)> {
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{name}: takes contiguous tensors")))
    }

    /// total (1, f64) += the sum of squares of the source.
    pub struct SumSquares;

    impl candle_core::InplaceOp2 for SumSquares {
        fn name(&self) -> &'static str {
            "adam-sum-squares"
        }
        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            no_cpu(self.name())
        }
        fn cuda_fwd(&self, total: &mut CudaStorage, tl: &Layout, g: &CudaStorage, gl: &Layout) -> Result<()> {
            let dev = g.device().clone();
            let (g0, g1) = range(gl, self.name())?;
            let (t0, t1) = range(tl, self.name())?;
            let gv = g.as_cuda_slice::<f32>()?.slice(g0..g1);
            crate::gpu::adam::sum_squares(&dev, &gv, g1 - g0, &mut total.as_cuda_slice_mut::<f64>()?.slice_mut(t0..t1))
        }
    }

    /// mv (2, n) <- the moments after gradient g (clipped against total when max_norm > 0).
    pub struct Moments {
        pub max_norm: f64,
        pub beta1: f64,
        pub beta2: f64,
    }

    impl candle_core::InplaceOp3 for Moments {
        fn name(&self) -> &'static str {
            "adam-moments"
        }
        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            no_cpu(self.name())
        }
        fn cuda_fwd(&self, mv: &mut CudaStorage, ml: &Layout, g: &CudaStorage, gl: &Layout, total: &CudaStorage, tl: &Layout) -> Result<()> {
            let dev = g.device().clone();
            let ((g0, g1), (m0, m1), (t0, t1)) = (range(gl, self.name())?, range(ml, self.name())?, range(tl, self.name())?);
            if m1 - m0 != 2 * (g1 - g0) {
                candle_core::bail!("adam-moments: {} moments for {} values", m1 - m0, g1 - g0);
            }
            let gv = g.as_cuda_slice::<f32>()?.slice(g0..g1);
            let tv = total.as_cuda_slice::<f64>()?.slice(t0..t1);
            crate::gpu::adam::moments(&dev, &gv, &mut mv.as_cuda_slice_mut::<f32>()?.slice_mut(m0..m1), g1 - g0, &tv, self.max_norm, self.beta1, self.beta2)
        }
    }

    /// p <- p - m / (sqrt(v) / sqrt(bc2) + eps) * lr / bc1, mv (2, n) the source.
    pub struct Update {
        pub inv_bc2_sqrt: f32,
        pub eps: f32,
        pub step_size: f32,
    }

    impl candle_core::InplaceOp2 for Update {
        fn name(&self) -> &'static str {
            "adam-update"
        }
        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            no_cpu(self.name())
        }
        fn cuda_fwd(&self, p: &mut CudaStorage, pl: &Layout, mv: &CudaStorage, ml: &Layout) -> Result<()> {
            let dev = mv.device().clone();
            let ((p0, p1), (m0, m1)) = (range(pl, self.name())?, range(ml, self.name())?);
            if m1 - m0 != 2 * (p1 - p0) {
                candle_core::bail!("adam-update: {} moments for {} values", m1 - m0, p1 - p0);
            }
            let mvv = mv.as_cuda_slice::<f32>()?.slice(m0..m1);
            crate::gpu::adam::update(&dev, &mut p.as_cuda_slice_mut::<f32>()?.slice_mut(p0..p1), &mvv, p1 - p0, self.inv_bc2_sqrt, self.eps, self.step_size)
        }
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

    /// On the CPU `step_clipped` is `clip_grad_norm` then `step`, to the bit, and it clips the
    /// gradients in place as torch's `clip_grad_norm_` does.
    #[test]
    fn step_clipped_is_clip_then_step_on_the_cpu() {
        let dev = Device::Cpu;
        let start = [vec![1f32, -2.0, 0.5], vec![0.25f32, 3.0]];
        let grads = [vec![3f32, -4.0, 1.0], vec![2.0f32, -0.5]];
        let vars = |v: &[Vec<f32>; 2]| v.iter().map(|x| Var::from_vec(x.clone(), x.len(), &dev).unwrap()).collect::<Vec<_>>();
        let g = || grads.iter().map(|x| Some(Tensor::new(x.as_slice(), &dev).unwrap())).collect::<Vec<_>>();
        let (a, b) = (vars(&start), vars(&start));
        let (mut oa, mut ob) = (Adam::new(&a, 0.1, 1e-8, 0.0).unwrap(), Adam::new(&b, 0.1, 1e-8, 0.0).unwrap());
        for _ in 0..2 {
            let mut ga = g();
            oa.step_clipped(&a, &mut ga, 1.0).unwrap();
            let mut gb = g();
            clip_grad_norm(&mut gb, 1.0).unwrap();
            ob.step(&b, &gb).unwrap();
            let norm: f32 = ga.iter().flatten().map(|t| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "the gradients were not clipped to norm 1: {norm}");
        }
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.as_tensor().to_vec1::<f32>().unwrap(), y.as_tensor().to_vec1::<f32>().unwrap());
        }
        assert_ne!(a[0].as_tensor().to_vec1::<f32>().unwrap(), start[0]);
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
