//! TMA tensor maps (`cuTensorMapEncodeTiled`) for the Hopper kernels that move their tiles with
//! the Tensor Memory Accelerator (`kernels/varlen_attention_sm90.cu`,
//! `kernels/gemm_layer_norm_sm90.cu`): a row-major bf16 matrix in boxes of 64 columns (one
//! 128-byte row, swizzled the way `wgmma` reads shared memory) by `box_rows` rows, rows past the
//! end read as zeros. Encoding is a host call (no GPU work), done for each launch.

use candle_core::cuda_backend::cudarc::driver::{sys, DeviceRepr};
use candle_core::cuda_backend::WrapErr;
use candle_core::Result;

/// A tensor map as the kernels take it (a `__grid_constant__` parameter, by value).
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct TensorMap(sys::CUtensorMap);
// SAFETY: plain bytes that the driver copies into the kernel's parameter space.
unsafe impl DeviceRepr for TensorMap {}

/// Whether a matrix at `ptr` with `cols` bf16 columns can be a tensor map: the address on a
/// 16-byte boundary and each row a multiple of 16 bytes.
pub(crate) fn fits(ptr: u64, cols: usize) -> bool {
    ptr % 16 == 0 && (cols * 2) % 16 == 0
}

/// The `rows x cols` row-major bf16 matrix at `ptr` in boxes of 64 columns x `box_rows` rows
/// (at most 256), 128-byte swizzle, zero fill. The caller checks [`fits`].
pub(crate) fn tensor_map(ptr: u64, rows: usize, cols: usize, box_rows: u32) -> Result<TensorMap> {
    use sys::{CUtensorMapDataType as D, CUtensorMapFloatOOBfill as F, CUtensorMapInterleave as I, CUtensorMapL2promotion as L, CUtensorMapSwizzle as Z};
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let dims = [cols as u64, rows as u64];
    let strides = [cols as u64 * 2];
    let boxes = [64u32, box_rows];
    let unit = [1u32, 1];
    // SAFETY: every pointer is to a live local array of the length rank 2 implies; the driver
    // only writes `map`.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            D::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            I::CU_TENSOR_MAP_INTERLEAVE_NONE,
            Z::CU_TENSOR_MAP_SWIZZLE_128B,
            L::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            F::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .w()?;
        Ok(TensorMap(map.assume_init()))
    }
}
