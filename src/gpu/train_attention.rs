//! Training attention's kernels (`kernels/varlen_attention.cu`, its training part): the forward
//! pass with dropout that keeps each query row's log-sum-exp, and FlashAttention-2's backward
//! pass, over cells of one length read straight from the qkv projection's output. `nn/flash_attention.rs`
//! is the op that runs them in candle's graph.

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchArgs, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use half::bf16;

use super::train_rows::MaskArgs;
use super::varlen_attention::cuda::{MODULE, PTX};

/// The head size the kernels take.
pub const HEAD_SIZE: usize = 64;

/// The backward kernel's dynamic shared memory (`TRAIN_BWD_SHARED`): K, dS^T and two buffers of
/// Q and dO tiles (64 rows padded to 72 bf16), two of the tile's lse and D (64 f32 each).
const BWD_SHARED: u32 = 6 * 64 * 72 * 2 + 4 * 64 * 4;

/// The shape of one call: `cells` cells of `len` tokens, `heads` heads of 64.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub cells: usize,
    pub len: usize,
    pub heads: usize,
}

impl Shape {
    fn tokens(&self) -> usize {
        self.cells * self.len
    }
}

/// The dropout's kernel arguments in the kernels' order: has one, key, the keep threshold to
/// 16 bits (the attention rule's draws are 16 bits), scale.
struct KernelMask {
    has: i32,
    key: u64,
    threshold16: u32,
    scale: f32,
}

impl KernelMask {
    fn new(m: MaskArgs) -> KernelMask {
        KernelMask { has: m.0, key: m.1, threshold16: m.2 >> 8, scale: m.3 }
    }

    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.has);
        b.arg(&self.key);
        b.arg(&self.threshold16);
        b.arg(&self.scale);
    }
}

/// 1 / sqrt(64) and the same in base 2.
fn scales() -> (f32, f32) {
    let scale = 1.0 / (HEAD_SIZE as f32).sqrt();
    (scale, scale * std::f32::consts::LOG2_E)
}

/// `out` (tokens x heads x 64) = dropout(softmax(q k^T / 8)) v of `qkv` (tokens x 3 heads x 64,
/// [q heads | k heads | v heads]), and `lse` (cells x heads x len, base 2) for the backward pass.
pub fn forward(dev: &CudaDevice, qkv: &CudaView<bf16>, out: &mut CudaSlice<bf16>, lse: &mut CudaSlice<f32>, s: Shape, mask: MaskArgs) -> Result<()> {
    if s.tokens() == 0 {
        return Ok(());
    }
    let offsets: Vec<u32> = (0..=s.cells).map(|c| (c * s.len) as u32).collect();
    let offsets = dev.clone_htod(&offsets)?;
    let func = load_kernel!(dev, "train_attention_fwd_bf16_d64", MODULE, PTX)?;
    let (_, scale_log2) = scales();
    let heads = s.heads as i32;
    let mask = KernelMask::new(mask);
    let mut b = func.builder();
    b.arg(qkv);
    b.arg(out);
    b.arg(&offsets);
    b.arg(&heads);
    b.arg(&scale_log2);
    b.arg(lse);
    mask.push(&mut b);
    let cfg = LaunchConfig { grid_dim: (s.len.div_ceil(128) as u32, s.heads as u32, s.cells as u32), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; the buffers hold the sizes above.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// The gradient of `qkv` (tokens x 3 heads x 64) from the forward pass's `qkv`, `out` and `lse`
/// and the gradient of the output, `dout` (tokens x heads x 64).
pub fn backward(dev: &CudaDevice, qkv: &CudaView<bf16>, out: &CudaView<bf16>, dout: &CudaView<bf16>, lse: &CudaView<f32>, s: Shape, mask: MaskArgs) -> Result<CudaSlice<bf16>> {
    let (tokens, width) = (s.tokens(), s.heads * HEAD_SIZE);
    // SAFETY: the backward kernel writes the k and v columns of every row, the dQ kernel the q ones.
    let mut dqkv = unsafe { dev.alloc::<bf16>(tokens * 3 * width)? };
    if tokens == 0 {
        return Ok(dqkv);
    }
    let (scale, scale_log2) = scales();
    let (len, heads) = (s.len as i32, s.heads as i32);
    // D = rowsum(dO * O)
    // SAFETY: the kernel writes one value a (token, head).
    let mut dsum = unsafe { dev.alloc::<f32>(tokens * s.heads)? };
    {
        let func = load_kernel!(dev, "train_attention_dsum_bf16", MODULE, PTX)?;
        let tokens64 = tokens as u64;
        let mut b = func.builder();
        b.arg(dout);
        b.arg(out);
        b.arg(&mut dsum);
        b.arg(&tokens64);
        b.arg(&heads);
        b.arg(&len);
        let cfg = LaunchConfig { grid_dim: ((tokens * s.heads).div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(cfg) }.w()?;
    }
    let mut dq = dev.alloc_zeros::<f32>(tokens * width)?;
    {
        let func = load_kernel!(dev, "train_attention_bwd_bf16_d64", MODULE, PTX)?;
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, BWD_SHARED as i32).w()?;
        let mask = KernelMask::new(mask);
        let mut b = func.builder();
        b.arg(qkv);
        b.arg(dout);
        b.arg(lse);
        b.arg(&dsum);
        b.arg(&mut dq);
        b.arg(&mut dqkv);
        b.arg(&len);
        b.arg(&heads);
        b.arg(&scale_log2);
        b.arg(&scale);
        mask.push(&mut b);
        let cfg = LaunchConfig { grid_dim: (s.len.div_ceil(64) as u32, s.heads as u32, s.cells as u32), block_dim: (128, 1, 1), shared_mem_bytes: BWD_SHARED };
        // SAFETY: the arguments match the kernel's signature; the buffers hold the sizes above.
        unsafe { b.launch(cfg) }.w()?;
    }
    {
        let func = load_kernel!(dev, "train_attention_dq_bf16", MODULE, PTX)?;
        let n = (tokens * width) as u64;
        let mut b = func.builder();
        b.arg(&dq);
        b.arg(&mut dqkv);
        b.arg(&n);
        b.arg(&heads);
        let cfg = LaunchConfig { grid_dim: ((tokens * width / 2).div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(dqkv)
}
