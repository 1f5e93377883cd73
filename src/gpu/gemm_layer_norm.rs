//! `y <- LayerNorm(x + a W^T + b)` (y = x in place, or beside x for the first layer) in one Hopper kernel (`kernels/gemm_layer_norm_sm90.cu`) for
//! post-norm layers 256 wide (Geneformer V1): the fused encoder's output projection with its
//! residual and norm1, and its second feed-forward product with its residual and norm2, each one
//! pass over memory instead of a cuBLASLt product and a layer-norm kernel that reads the sum back.
//! The kernel is persistent (one block an SM) and moves its operands with TMA, so it takes three
//! or four tensor maps (`cuTensorMapEncodeTiled`; the output's is the residual's when in place),
//! made here for each launch: a host call, no GPU work.
//!
//! Taken when the layer is 256 wide, the product's depth `k` a multiple of 64, the GPU a Hopper
//! (compute capability 9.x, the binary built for it), the operands 16-byte aligned, and
//! `SCFOUNDRY_FUSED_NORM` is not `0` (which keeps the two-kernel path, for an A/B). Decided once
//! per device. Other widths keep cuBLASLt and the layer-norm kernel: at 512 and wider a block of
//! whole rows cannot keep its accumulators in registers with enough rows to reuse each weight.

use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{DeviceId, WrapErr};
use candle_core::{CudaDevice, Result};
use half::bf16;

use super::tma::{self, tensor_map};
use super::KernelImage;

/// Empty unless the binary was built for compute capability 9.0 (build.rs); runs on 9.0 alone (sm_90a).
static PTX: KernelImage = kernel_image!("gemm_layer_norm_sm90");
const MODULE: &str = "scfoundry_gemm_layer_norm_sm90";
const KERNEL: &str = "gemm_bias_residual_layer_norm_n256_tma_sm90";
/// The layer width the kernel is written for.
pub(crate) const WIDTH: usize = 256;
/// Rows a tile (a block's step) takes.
const ROWS: usize = 128;
/// Threads a block: two compute warpgroups and the memory one.
const THREADS: u32 = 384;
/// Dynamic shared memory (the kernel's kPlnSmem): three buffers of a 64-wide chunk of A (128
/// rows) and of W (256 rows), the residual/output tile (128 x 256 bf16), 1024 bytes to align,
/// 128 for the mbarriers.
const SHARED: u32 = (3 * (128 + 256) * 128 + 128 * 256 * 2 + 1024 + 128) as u32;

/// Whether this device runs the fused kernel (Hopper, built for it, not switched off); the first
/// call loads the kernel and raises its shared-memory limit.
fn enabled(dev: &CudaDevice) -> Result<bool> {
    static CHOSEN: Mutex<Vec<(DeviceId, bool)>> = Mutex::new(Vec::new());
    let mut chosen = CHOSEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, on)) = chosen.iter().find(|(id, _)| *id == dev.id()) {
        return Ok(on);
    }
    let hopper = !PTX.is_empty() && matches!(dev.cuda_stream().context().compute_capability(), Ok((9, 0)));
    let on = hopper && std::env::var(crate::env::EnvVars::FUSED_NORM).map_or(true, |v| v != "0");
    if on {
        let func = load_kernel!(dev, KERNEL, MODULE, PTX)?;
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SHARED as i32).w()?;
    }
    chosen.push((dev.id(), on));
    Ok(on)
}

/// Whether [`launch`] is for a layer `d` wide whose product is `k` deep, on `dev`.
pub(crate) fn applies(dev: &CudaDevice, d: usize, k: usize) -> Result<bool> {
    Ok(d == WIDTH && k > 0 && k % 64 == 0 && enabled(dev)?)
}

/// `x (tokens x 256) <- LayerNorm(r + a W^T + bias) * gamma + beta`, `a` tokens x k, `w` 256 x k
/// (PyTorch's Linear layout), bf16, where [`applies`] said yes; the residual `r` is `residual`
/// when given (the first layer reads the encoder's input there instead of copying it into `x`
/// first), else `x` itself (in place). Returns false, having done nothing, when an operand is not
/// aligned as the kernel reads it (`a`, `w`, `x` and `residual` on 16-byte boundaries, the
/// vectors on 4-byte ones): the caller then takes the two-kernel path.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    dev: &CudaDevice,
    a: &CudaView<bf16>,
    w: &CudaView<bf16>,
    bias: &CudaView<bf16>,
    gamma: &CudaView<bf16>,
    beta: &CudaView<bf16>,
    x: &mut CudaSlice<bf16>,
    residual: Option<&CudaView<bf16>>,
    tokens: usize,
    k: usize,
    eps: f32,
) -> Result<bool> {
    let stream = dev.cuda_stream();
    // the matrices as the tensor maps take them (gpu/tma.rs), the vectors read as bf16 pairs
    let aligned = tma::fits(a.device_ptr(&stream).0, k)
        && tma::fits(w.device_ptr(&stream).0, k)
        && tma::fits(x.device_ptr(&stream).0, WIDTH)
        && residual.is_none_or(|r| tma::fits(r.device_ptr(&stream).0, WIDTH))
        && [bias, gamma, beta].iter().all(|v| v.device_ptr(&stream).0 % 4 == 0);
    if !aligned {
        return Ok(false);
    }
    if tokens == 0 {
        return Ok(true);
    }
    let func = load_kernel!(dev, KERNEL, MODULE, PTX)?;
    let sms = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()?.max(1) as usize;
    // the guards record the kernel's reads and write on the stream when they drop, after the launch
    let (pa, _read_a) = a.device_ptr(&stream);
    let (pw, _read_w) = w.device_ptr(&stream);
    let (px, _write_x) = x.device_ptr_mut(&stream);
    let ta = tensor_map(pa, tokens, k, ROWS as u32)?;
    let tw = tensor_map(pw, WIDTH, k, WIDTH as u32)?;
    let ty = tensor_map(px, tokens, WIDTH, ROWS as u32)?;
    let tx = match residual {
        Some(r) => tensor_map(r.device_ptr(&stream).0, tokens, WIDTH, ROWS as u32)?,
        None => ty,
    };
    let cfg = LaunchConfig { grid_dim: (tokens.div_ceil(ROWS).min(sms) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: SHARED };
    let (tokens, k) = (tokens as i32, k as i32);
    let mut b = func.builder();
    b.arg(&ta);
    b.arg(&tw);
    b.arg(&tx);
    b.arg(&ty);
    b.arg(bias);
    b.arg(gamma);
    b.arg(beta);
    b.arg(&tokens);
    b.arg(&k);
    b.arg(&eps);
    unsafe { b.launch(cfg) }.w()?;
    Ok(true)
}
