//! Adam's step on a GPU with the gradient clipping folded in (`kernels/optim.cu`): the sum of
//! squares of every gradient into one f64 on the device, then per parameter its two moments and
//! its value updated in place. `nn/optim.rs` holds the rule, the CPU path and the ops that call
//! these; nothing is read back to the host (the clipping coefficient is computed by the kernel
//! from the device's sum).

use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use super::KernelImage;

static PTX: KernelImage = kernel_image!("optim");
const MODULE: &str = "scfoundry_optim";

fn config(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(256).clamp(1, 132 * 16) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// `*total += sum of g^2` over n values.
pub fn sum_squares(dev: &CudaDevice, g: &CudaView<f32>, n: usize, total: &mut CudaViewMut<f64>) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, "sum_squares_f32", MODULE, PTX)?;
    let n64 = n as u64;
    let mut b = func.builder();
    b.arg(g);
    b.arg(&n64);
    b.arg(total);
    // SAFETY: the arguments match the kernel's signature; g holds n values, total one.
    unsafe { b.launch(config(n)) }.w()?;
    Ok(())
}

/// The moments' update of one parameter of n values (`mv`: m then v, 2 n values) from its
/// gradient, clipped by `max_norm` against `total`'s norm when `max_norm > 0`.
#[allow(clippy::too_many_arguments)]
pub fn moments(dev: &CudaDevice, g: &CudaView<f32>, mv: &mut CudaViewMut<f32>, n: usize, total: &CudaView<f64>, max_norm: f64, beta1: f64, beta2: f64) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, "adam_moments_f32", MODULE, PTX)?;
    let n64 = n as u64;
    let (b1, omb1, b2, omb2) = (beta1 as f32, (1.0 - beta1) as f32, beta2 as f32, (1.0 - beta2) as f32);
    let mut b = func.builder();
    b.arg(g);
    b.arg(mv);
    b.arg(&n64);
    b.arg(total);
    b.arg(&max_norm);
    b.arg(&b1);
    b.arg(&omb1);
    b.arg(&b2);
    b.arg(&omb2);
    // SAFETY: the arguments match the kernel's signature; g holds n values, mv 2 n, total one.
    unsafe { b.launch(config(n)) }.w()?;
    Ok(())
}

/// `p -= m / (sqrt(v) * inv_bc2_sqrt + eps) * step_size` over n values.
pub fn update(dev: &CudaDevice, p: &mut CudaViewMut<f32>, mv: &CudaView<f32>, n: usize, inv_bc2_sqrt: f32, eps: f32, step_size: f32) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, "adam_update_f32", MODULE, PTX)?;
    let n64 = n as u64;
    let mut b = func.builder();
    b.arg(p);
    b.arg(mv);
    b.arg(&n64);
    b.arg(&inv_bc2_sqrt);
    b.arg(&eps);
    b.arg(&step_size);
    // SAFETY: the arguments match the kernel's signature; p holds n values, mv 2 n.
    unsafe { b.launch(config(n)) }.w()?;
    Ok(())
}
