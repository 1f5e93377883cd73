//! CSR rows written into a zeroed dense matrix on the GPU (`kernels/encoder_ops.cu`
//! `csr_to_dense_f32`: a block a row, its threads over the row's values): how `nn::sparse_rows`
//! makes a batch of sparse cells dense on the device.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Result, Tensor};

/// The dense `n x n_cols` f32 matrix of the CSR rows (`offsets`, n + 1 of them; the columns and
/// the values, each given in parts that joined are the CSR arrays), each column at most once a
/// row; uploaded through page-locked memory (the parts copied there on all cores), so the host
/// does not wait for the GPU.
pub fn to_dense(offsets: &[u32], cols: &[&[u32]], vals: &[&[f32]], n: usize, n_cols: usize, dev: &CudaDevice) -> Result<Tensor> {
    let (nc, nv): (usize, usize) = (cols.iter().map(|c| c.len()).sum(), vals.iter().map(|v| v.len()).sum());
    if offsets.len() != n + 1 || nc != nv || offsets[n] as usize != nc {
        candle_core::bail!("csr-to-dense: {} offsets for {n} rows, {nc} columns, {nv} values", offsets.len());
    }
    let mut out = dev.alloc_zeros::<f32>(n * n_cols)?;
    if n > 0 && nc > 0 {
        let offs = crate::gpu::upload::upload_slice(offsets, dev)?;
        let c = crate::gpu::upload::upload_parts(cols, dev)?;
        let v = crate::gpu::upload::upload_parts(vals, dev)?;
        let func = load_kernel!(dev, "csr_to_dense_f32", super::fused_encoder::MODULE, super::fused_encoder::PTX)?;
        let n_cols64 = n_cols as u64;
        let mut b = func.builder();
        b.arg(&offs);
        b.arg(&c);
        b.arg(&v);
        b.arg(&mut out);
        b.arg(&n_cols64);
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(super::kernel_io::output(CudaStorage::wrap_cuda_slice(out, dev.clone()), (n, n_cols)))
}
