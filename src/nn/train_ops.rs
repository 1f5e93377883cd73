//! Training's residual and feed-forward steps with dropout, each one pass over memory each way
//! (on a GPU `kernels/encoder_ops.cu` `add_dropped_*`, `dropped_to_*`, `act_dropped_*`,
//! `act_dropped_bwd_*`; the CPU twins below), where candle's graph would take a pass for the
//! mask, one for the sum and, under mixed precision, casts between bf16 and f32:
//!
//! - [`add_dropped`]: `x + dropout(y)`, a post-norm layer's residual sum: `x` and the sum f32,
//!   the branch `y` f32 or bf16 (a bf16 linear output is read as it is, as autocast's sum of an
//!   f32 residual and a bf16 branch). Backward: `dx = g`, `dy = dropout(g)` in y's dtype.
//! - [`relu_dropped`]: `dropout(relu(h))`, and [`leaky_relu`], in h's dtype. Backward from the
//!   output (`dh = g * scale` where it is positive; else 0 for ReLU, the slope's share for a
//!   leaky ReLU where the mask, drawn again, kept the element), so the op holds nothing that the
//!   next linear layer does not hold already; PyTorch's rules at h = 0 (no gradient through
//!   ReLU, the slope's through the leaky ReLU).
//!
//! The mask is `Mask::keeps` of the element's index, so the CPU and a GPU drop the same elements.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use super::dropout::Mask;

/// `x + dropout(y)` (x f32; y f32 or bf16, of x's shape): f32, differentiable in both.
pub fn add_dropped(x: &Tensor, y: &Tensor, mask: Option<Mask>) -> Result<Tensor> {
    if x.dtype() != DType::F32 || !matches!(y.dtype(), DType::F32 | DType::BF16) || x.dims() != y.dims() {
        candle_core::bail!("add-dropped: takes an f32 x and an f32 or bf16 y of its shape, got {:?} {:?} and {:?} {:?}", x.dtype(), x.dims(), y.dtype(), y.dims());
    }
    x.contiguous()?.apply_op2(&y.contiguous()?, AddDropped { mask })
}

/// `dropout(relu(h))` (f32 or bf16), differentiable.
pub fn relu_dropped(h: &Tensor, mask: Option<Mask>) -> Result<Tensor> {
    act_dropped(h, 0.0, mask)
}

/// `leaky_relu(h, slope)` (f32 or bf16), differentiable (PyTorch's rule at h = 0: the slope).
pub fn leaky_relu(h: &Tensor, slope: f32) -> Result<Tensor> {
    act_dropped(h, slope, None)
}

fn act_dropped(h: &Tensor, slope: f32, mask: Option<Mask>) -> Result<Tensor> {
    if !matches!(h.dtype(), DType::F32 | DType::BF16) {
        candle_core::bail!("act-dropped: takes f32 or bf16, got {:?}", h.dtype());
    }
    h.contiguous()?.apply_op1(ActDropped { slope, mask })
}

/// Whether element `i` is kept and the scale of those kept.
fn rule(mask: Option<Mask>) -> (impl Fn(u64) -> bool + Sync, f32) {
    (move |i| mask.is_none_or(|m| m.keeps(i)), mask.map_or(1.0, |m| m.scale))
}

/// The contiguous values of `s` as f32 (a bf16 tensor converted).
fn values(s: &CpuStorage, l: &Layout, op: &str) -> Result<Vec<f32>> {
    let Some((a, z)) = l.contiguous_offsets() else { candle_core::bail!("{op}: inputs must be contiguous") };
    Ok(match s {
        CpuStorage::F32(v) => v[a..z].to_vec(),
        CpuStorage::BF16(v) => v[a..z].iter().map(|x| x.to_f32()).collect(),
        _ => candle_core::bail!("{op}: takes f32 or bf16, got {:?}", s.dtype()),
    })
}

/// `v` stored as `dtype` (f32 or bf16, rounded to nearest even as `__float2bfloat16`).
fn storage(v: Vec<f32>, dtype: DType) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}

/// `out[i] = f(i, a[i])` on the CPU's threads, in chunks of 2^16 elements.
fn map_indexed(a: &[f32], f: impl Fn(u64, f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; a.len()];
    out.par_chunks_mut(1 << 16).zip(a.par_chunks(1 << 16)).enumerate().for_each(|(c, (o, a))| {
        let base = (c << 16) as u64;
        for (j, (o, &a)) in o.iter_mut().zip(a).enumerate() {
            *o = f(base + j as u64, a);
        }
    });
    out
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::CudaView;
    use candle_core::{CudaStorage, Layout, Result};

    /// The contiguous view of `s` as T.
    pub fn view<'a, T: candle_core::cuda_backend::CudaDType>(s: &'a CudaStorage, l: &Layout, op: &str) -> Result<CudaView<'a, T>> {
        let Some((a, z)) = l.contiguous_offsets() else { candle_core::bail!("{op}: inputs must be contiguous") };
        Ok(s.as_cuda_slice::<T>()?.slice(a..z))
    }

    /// `s` as candle's storage on `dev`.
    pub fn wrap<T: candle_core::cuda_backend::CudaDType>(s: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>, dev: &candle_core::CudaDevice) -> CudaStorage {
        CudaStorage::wrap_cuda_slice(s, dev.clone())
    }
}

#[derive(Clone, Copy)]
struct AddDropped {
    mask: Option<Mask>,
}

impl candle_core::CustomOp2 for AddDropped {
    fn name(&self) -> &'static str {
        "add-dropped"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, y: &CpuStorage, yl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, y) = (values(x, xl, "add-dropped")?, values(y, yl, "add-dropped")?);
        let (keeps, scale) = rule(self.mask);
        let z = map_indexed(&y, |i, y| if keeps(i) { y * scale } else { 0.0 });
        let z = z.into_par_iter().zip(x.par_iter()).map(|(d, &x)| x + d).collect();
        Ok((CpuStorage::F32(z), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, xl: &Layout, y: &candle_core::CudaStorage, yl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dev = x.device().clone();
        let n = xl.shape().elem_count();
        let xv = cuda::view::<f32>(x, xl, "add-dropped")?;
        // SAFETY: the kernel writes every element.
        let mut z = unsafe { dev.alloc::<f32>(n)? };
        let m = super::dropout::kernel_args(self.mask);
        match y.dtype() {
            DType::BF16 => crate::gpu::dropout::add_dropped(&dev, "bf16", &xv, &cuda::view::<bf16>(y, yl, "add-dropped")?, &mut z, n, m)?,
            _ => crate::gpu::dropout::add_dropped(&dev, "f32", &xv, &cuda::view::<f32>(y, yl, "add-dropped")?, &mut z, n, m)?,
        }
        Ok((cuda::wrap(z, &dev), xl.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.detach().to_dtype(DType::F32)?.contiguous()?;
        let dy = g.apply_op1_no_bwd(&DroppedTo { mask: self.mask, dtype: y.dtype() })?;
        Ok((Some(g), Some(dy)))
    }
}

/// `dropout(g)` stored as `dtype`: add_dropped's gradient of its branch.
struct DroppedTo {
    mask: Option<Mask>,
    dtype: DType,
}

impl candle_core::CustomOp1 for DroppedTo {
    fn name(&self) -> &'static str {
        "dropped-to"
    }

    fn cpu_fwd(&self, g: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = values(g, l, "dropped-to")?;
        let (keeps, scale) = rule(self.mask);
        Ok((storage(map_indexed(&g, |i, g| if keeps(i) { g * scale } else { 0.0 }), self.dtype), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, g: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dev = g.device().clone();
        let n = l.shape().elem_count();
        let gv = cuda::view::<f32>(g, l, "dropped-to")?;
        let m = super::dropout::kernel_args(self.mask);
        // SAFETY: the kernels write every element.
        let out = match self.dtype {
            DType::BF16 => {
                let mut dy = unsafe { dev.alloc::<bf16>(n)? };
                crate::gpu::dropout::dropped_to(&dev, "bf16", &gv, &mut dy, n, m)?;
                cuda::wrap(dy, &dev)
            }
            _ => {
                let mut dy = unsafe { dev.alloc::<f32>(n)? };
                crate::gpu::dropout::dropped_to(&dev, "f32", &gv, &mut dy, n, m)?;
                cuda::wrap(dy, &dev)
            }
        };
        Ok((out, l.shape().clone()))
    }
}

#[derive(Clone, Copy)]
struct ActDropped {
    slope: f32,
    mask: Option<Mask>,
}

impl ActDropped {
    /// `a(v) = v > 0 ? v : slope v`.
    fn act(&self, v: f32) -> f32 {
        if v > 0.0 {
            v
        } else {
            v * self.slope
        }
    }
}

impl candle_core::CustomOp1 for ActDropped {
    fn name(&self) -> &'static str {
        "act-dropped"
    }

    fn cpu_fwd(&self, h: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dtype = h.dtype();
        let h = values(h, l, "act-dropped")?;
        let (keeps, scale) = rule(self.mask);
        Ok((storage(map_indexed(&h, |i, h| if keeps(i) { self.act(h) * scale } else { 0.0 }), dtype), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, h: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dev = h.device().clone();
        let n = l.shape().elem_count();
        let m = super::dropout::kernel_args(self.mask);
        // SAFETY: the kernels write every element.
        let out = match h.dtype() {
            DType::BF16 => {
                let mut out = unsafe { dev.alloc::<bf16>(n)? };
                crate::gpu::dropout::act_dropped(&dev, "bf16", &cuda::view::<bf16>(h, l, "act-dropped")?, &mut out, n, self.slope, m)?;
                cuda::wrap(out, &dev)
            }
            _ => {
                let mut out = unsafe { dev.alloc::<f32>(n)? };
                crate::gpu::dropout::act_dropped(&dev, "f32", &cuda::view::<f32>(h, l, "act-dropped")?, &mut out, n, self.slope, m)?;
                cuda::wrap(out, &dev)
            }
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _h: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.detach().to_dtype(res.dtype())?.contiguous()?;
        Ok(Some(res.detach().contiguous()?.apply_op2_no_bwd(&g, &ActDroppedBackward(*self))?))
    }
}

/// (out, g) -> the gradient of act-dropped's input, in out's dtype: `g scale` where the output
/// is positive; else 0 for ReLU and for dropped elements (the mask drawn again), `g slope scale`
/// for the rest.
struct ActDroppedBackward(ActDropped);

impl candle_core::CustomOp2 for ActDroppedBackward {
    fn name(&self) -> &'static str {
        "act-dropped-backward"
    }

    fn cpu_fwd(&self, out: &CpuStorage, ol: &Layout, g: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let dtype = out.dtype();
        let (out, g) = (values(out, ol, "act-dropped")?, values(g, gl, "act-dropped")?);
        let (keeps, scale) = rule(self.0.mask);
        let slope = self.0.slope;
        let dh = map_indexed(&g, |i, g| {
            if out[i as usize] > 0.0 {
                g * scale
            } else if slope == 0.0 || !keeps(i) {
                0.0
            } else {
                g * slope * scale
            }
        });
        Ok((storage(dh, dtype), ol.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, out: &candle_core::CudaStorage, ol: &Layout, g: &candle_core::CudaStorage, gl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let dev = out.device().clone();
        let n = ol.shape().elem_count();
        let (slope, m) = (self.0.slope, super::dropout::kernel_args(self.0.mask));
        // SAFETY: the kernels write every element.
        let dh = match out.dtype() {
            DType::BF16 => {
                let mut dh = unsafe { dev.alloc::<bf16>(n)? };
                crate::gpu::dropout::act_dropped_bwd(&dev, "bf16", &cuda::view::<bf16>(out, ol, "act-dropped")?, &cuda::view::<bf16>(g, gl, "act-dropped")?, &mut dh, n, slope, m)?;
                cuda::wrap(dh, &dev)
            }
            _ => {
                let mut dh = unsafe { dev.alloc::<f32>(n)? };
                crate::gpu::dropout::act_dropped_bwd(&dev, "f32", &cuda::view::<f32>(out, ol, "act-dropped")?, &cuda::view::<f32>(g, gl, "act-dropped")?, &mut dh, n, slope, m)?;
                cuda::wrap(dh, &dev)
            }
        };
        Ok((dh, ol.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::dropout::Dropout;
    use candle_core::{Device, Var};

    fn grads_of(out: &Tensor, probe: &Tensor, vars: &[&Var]) -> Vec<Vec<f32>> {
        let g = (out.to_dtype(DType::F32).unwrap() * probe).unwrap().sum_all().unwrap().backward().unwrap();
        vars.iter().map(|v| g.get(v.as_tensor()).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()).collect()
    }

    #[test]
    fn add_dropped_equals_the_composed_graph_bit_for_bit() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 50, 16), &dev).unwrap()).unwrap();
        let y = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 50, 16), &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (3, 50, 16), &dev).unwrap();
        for p in [0.0, 0.3] {
            let m = Dropout::new(p, 5).next_mask();
            let ours = add_dropped(x.as_tensor(), y.as_tensor(), m).unwrap();
            let dropped = match m {
                Some(m) => m.apply(y.as_tensor()).unwrap(),
                None => y.as_tensor().clone(),
            };
            let theirs = (x.as_tensor() + dropped).unwrap();
            assert_eq!(ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(), theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            assert_eq!(grads_of(&ours, &probe, &[&x, &y]), grads_of(&theirs, &probe, &[&x, &y]), "p {p}");
        }
        // a bf16 branch: summed in f32, its gradient in bf16
        let m = Dropout::new(0.25, 9).next_mask();
        let y16 = Var::from_tensor(&y.as_tensor().to_dtype(DType::BF16).unwrap()).unwrap();
        let z = add_dropped(x.as_tensor(), y16.as_tensor(), m).unwrap();
        assert_eq!(z.dtype(), DType::F32);
        let want = add_dropped(x.as_tensor(), &y16.as_tensor().to_dtype(DType::F32).unwrap(), m).unwrap();
        assert_eq!(z.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let g = (&z * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gy = g.get(y16.as_tensor()).unwrap();
        assert_eq!(gy.dtype(), DType::BF16);
        let gy: Vec<f32> = gy.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let pv: Vec<f32> = probe.flatten_all().unwrap().to_vec1().unwrap();
        let m = m.unwrap();
        for i in 0..pv.len() {
            let want = if m.keeps(i as u64) { bf16::from_f32(pv[i] * m.scale).to_f32() } else { 0.0 };
            assert_eq!(gy[i], want, "element {i}");
        }
    }

    #[test]
    fn activations_equal_their_formulas_with_pytorchs_rules_at_zero() {
        let dev = Device::Cpu;
        let mut v: Vec<f32> = Tensor::randn(0f32, 1.0, 2400, &dev).unwrap().to_vec1().unwrap();
        v[7] = 0.0;
        let h = Var::from_vec(v.clone(), (3, 50, 16), &dev).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (3, 50, 16), &dev).unwrap();
        let pv: Vec<f32> = probe.flatten_all().unwrap().to_vec1().unwrap();
        for p in [0.0, 0.3] {
            let m = Dropout::new(p, 11).next_mask();
            let ours = relu_dropped(h.as_tensor(), m).unwrap();
            let relu = h.as_tensor().relu().unwrap();
            let theirs = match m {
                Some(m) => m.apply(&relu).unwrap(),
                None => relu,
            };
            assert_eq!(ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(), theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let g = &grads_of(&ours, &probe, &[&h])[0];
            let scale = m.map_or(1.0, |m| m.scale);
            for i in 0..v.len() {
                let kept = m.is_none_or(|m| m.keeps(i as u64));
                // PyTorch's threshold_backward: no gradient where the input is 0 (candle's relu
                // passes one there)
                let want = if v[i] > 0.0 && kept { pv[i] * scale } else { 0.0 };
                assert_eq!(g[i], want, "element {i}, p {p}");
            }
        }
        // a leaky slope, with and without a mask: the slope's share of the gradient where the
        // element is kept and not positive
        for p in [0.0, 0.3] {
            let m = Dropout::new(p, 13).next_mask();
            let ours = act_dropped(h.as_tensor(), 0.01, m).unwrap();
            let o: Vec<f32> = ours.flatten_all().unwrap().to_vec1().unwrap();
            let g = &grads_of(&ours, &probe, &[&h])[0];
            let scale = m.map_or(1.0, |m| m.scale);
            for i in 0..v.len() {
                let kept = m.is_none_or(|m| m.keeps(i as u64));
                let a = if v[i] > 0.0 { v[i] } else { v[i] * 0.01 };
                assert_eq!(o[i], if kept { a * scale } else { 0.0 }, "element {i}, p {p}");
                let want = if !kept { 0.0 } else if v[i] > 0.0 { pv[i] * scale } else { pv[i] * 0.01 * scale };
                assert_eq!(g[i], want, "element {i}, p {p}");
            }
        }
        // bf16 in, bf16 out and gradient
        let h16 = Var::from_tensor(&h.as_tensor().to_dtype(DType::BF16).unwrap()).unwrap();
        let m = Dropout::new(0.1, 3).next_mask();
        let o = relu_dropped(h16.as_tensor(), m).unwrap();
        assert_eq!(o.dtype(), DType::BF16);
        let g = (o.to_dtype(DType::F32).unwrap() * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(h16.as_tensor()).unwrap().dtype(), DType::BF16);
    }
}
