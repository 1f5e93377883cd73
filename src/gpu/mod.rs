//! The GPU runtime every GPU method runs on: device choice, the allocator (RMM-style memory
//! resources on the CUDA driver's pools, with statistics, a limit and a log), the cost report of
//! a GPU task, and the out-of-memory back-off.
//!
//! - `cards.rs`: `--gpu` lists and the lock by which each task takes one card of a node.
//! - `options.rs`: what the user chose (device, allocator, sizes); plain data, no GPU needed.
//! - `accounting.rs`: the statistics/limit/log adaptors; pure bookkeeping, tested without a GPU.
//! - `backoff.rs`: halve the batch on out-of-memory, retry down to 1, say what to pass next time.
//! - `varlen_attention.rs`: attention over packed cells (no padding); a fused CUDA kernel
//!   (`kernels/varlen_attention.cu`) with a plain-candle reference path.
//! - `train_attention.rs` (feature `cuda`): training attention in bf16 (FlashAttention-2's forward
//!   with dropout and its backward pass) over cells of one length, for `nn/flash_attention.rs`.
//! - `dropout.rs`: the kernels of `nn/dropout.rs`'s counter-based dropout mask and of the
//!   training ops that apply it (`nn/train_ops.rs`).
//! - `adam.rs` (feature `cuda`): Adam's step with gradient clipping in three kernels a parameter.
//! - `embedding.rs`: BERT's input embedding (two gathers, the token type, layer norm) in one kernel.
//! - `readback.rs`: batch results read back one batch behind, so the GPU does not wait between batches.
//! - `upload.rs`: a batch's token ids sent up from page-locked memory (the host never waits there).
//! - `pinned.rs` (feature `cuda`): the pair of page-locked buffers those two copy through.
//! - `fused_encoder.rs`: a stack of post-norm encoder layers in bf16 on a GPU, cuBLASLt epilogues
//!   for biases and residuals, `kernels/encoder_ops.cu` for layer norm and GELU.
//! - `gemm_layer_norm.rs` (feature `cuda`): for 256-wide layers on Hopper, a product with its
//!   residual and the layer norm after it in one kernel (`kernels/gemm_layer_norm_sm90.cu`).
//! - `tma.rs` (feature `cuda`): TMA tensor maps for the Hopper kernels that move tiles with TMA.
//! - `pairwise.rs` (feature `cuda`): the scIB metrics' dense passes (exact kNN, the silhouette's
//!   per-label distance sums) in tiles of distances, `kernels/pairwise.cu`.
//! - `cuda.rs` (feature `cuda`): the resources on the driver API, the hook that makes every
//!   tensor candle allocates come from the chosen resource, device probing for `doctor`.
//!
//! How tensors reach the resource: candle allocates through cudarc's `CudaStream::alloc` and frees
//! by dropping `CudaSlice`. Our patch to cudarc (cuda/patches/) adds a process-wide hook there;
//! the task process installs the chosen resource as that hook before it creates candle's device,
//! so model weights, activations and cuBLAS's workspace all come from it.

/// A kernel module as this binary carries it (build.rs): PTX text in the CUDA 13 build, a fatbin
/// (machine code for several GPU generations plus PTX) in the CUDA 12 one (feature `cuda12`).
#[cfg(all(feature = "cuda", not(feature = "cuda12")))]
macro_rules! kernel_image {
    ($name:literal) => {
        include_str!(concat!(env!("OUT_DIR"), "/", $name, ".ptx"))
    };
}
#[cfg(feature = "cuda12")]
macro_rules! kernel_image {
    ($name:literal) => {
        include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".fatbin"))
    };
}
/// The type of a [kernel_image]: `&'static str` (PTX) or `&'static [u8]` (fatbin).
#[cfg(all(feature = "cuda", not(feature = "cuda12")))]
pub(crate) type KernelImage = &'static str;
#[cfg(feature = "cuda12")]
pub(crate) type KernelImage = &'static [u8];
/// `dev`'s function `name` of module `module`, loading the module from `image` (a [KernelImage]) the first time.
#[cfg(all(feature = "cuda", not(feature = "cuda12")))]
macro_rules! load_kernel {
    ($dev:expr, $name:expr, $module:expr, $image:expr) => {
        $dev.get_or_load_custom_func($name, $module, $image)
    };
}
#[cfg(feature = "cuda12")]
macro_rules! load_kernel {
    ($dev:expr, $name:expr, $module:expr, $image:expr) => {
        $dev.get_or_load_custom_image($name, $module, $image)
    };
}
// (the macros reach the modules below by textual scope: they are defined before them)

pub mod accounting;
#[cfg(feature = "cuda")]
pub mod adam;
pub mod backoff;
pub mod build;
pub mod cards;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod csr_dense;
pub mod favor;
pub mod gat_attention;
pub mod retention;
#[cfg(feature = "cuda")]
pub mod dropout;
#[cfg(feature = "cuda")]
pub mod train_rows;
#[cfg(feature = "cuda")]
pub mod train_attention;
#[cfg(feature = "cuda")]
pub mod pairwise;
pub mod options;
pub mod embedding;
#[cfg(feature = "cuda")]
pub mod pinned;
pub mod fused_encoder;
#[cfg(feature = "cuda")]
pub mod kernel_io;
#[cfg(feature = "cuda")]
pub(crate) mod gemm;
#[cfg(feature = "cuda")]
pub(crate) mod gemm_layer_norm;
pub mod readback;
pub mod segment_pool;
#[cfg(feature = "cuda")]
pub(crate) mod tma;
pub mod upload;
pub mod varlen_attention;

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use accounting::MemoryStats;
pub use options::{AllocatorKind, AllocatorOptions, ByteSize, DeviceKind, DeviceSpec};

/// Whether this binary was built with the `cuda` feature.
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

/// GPU problems, each saying which part is missing; `hint()` says what to do.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("--device cuda: this scfoundry was built without CUDA")]
    NotCompiled,
    #[error("--device cuda: the NVIDIA driver library could not be loaded ({detail})")]
    NoDriver { detail: String },
    #[error("--device cuda: {library} could not be loaded ({detail})")]
    NoLibrary { library: String, detail: String },
    #[error("--device cuda: no CUDA device {ordinal}: {found}{visible}")]
    NoDevice { ordinal: usize, found: String, visible: String },
    #[error("invalid --{option}: {value}")]
    BadOption { option: String, value: String, hint: String },
    #[error("CUDA driver call {call} failed: {detail}")]
    Driver { call: String, detail: String },
    #[error("CUDA ran out of memory even with a batch of 1 cell (allocator {allocator}): {detail}")]
    OutOfMemory { allocator: String, detail: String, hint: String },
    #[error("CUDA ran out of memory {what} (allocator {allocator}): the model does not fit")]
    ModelTooLarge { what: String, allocator: String, hint: String },
    #[error("{detail}")]
    Cards { detail: String, hint: String },
    #[error("the GPU lock folder {path}: {detail}")]
    LockFolder { path: std::path::PathBuf, detail: String },
    /// the driver or the card cannot run this binary's kernels (build::Targets::check)
    #[error("--device cuda: {detail}")]
    Unsupported { detail: String, hint: String },
}

impl GpuError {
    pub fn hint(&self) -> Option<String> {
        Some(match self {
            GpuError::NotCompiled => "build the GPU binary with scripts/build-cuda.sh (README, \"GPU build\"), or run with --device cpu".into(),
            GpuError::NoDriver { .. } => "is an NVIDIA driver installed? `nvidia-smi` should list the GPUs, and libcuda.so.1 must be on the loader path".into(),
            GpuError::NoLibrary { .. } if build::CUDA_VERSION.starts_with("12.") => "install the CUDA 12 (or 13) libraries (cuBLAS, cuBLASLt, cuRAND 10) and put their folder on LD_LIBRARY_PATH, e.g. export LD_LIBRARY_PATH=/usr/local/cuda-12.8/targets/x86_64-linux/lib:$LD_LIBRARY_PATH".into(),
            GpuError::NoLibrary { .. } => "install the CUDA 13 libraries (cuBLAS 13, cuRAND 10) and put their folder on LD_LIBRARY_PATH, e.g. export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH".into(),
            GpuError::NoDevice { .. } => "`scfoundry doctor` lists the devices; pass --gpu with one of them".into(),
            GpuError::BadOption { hint, .. } | GpuError::OutOfMemory { hint, .. } | GpuError::ModelTooLarge { hint, .. } | GpuError::Cards { hint, .. } | GpuError::Unsupported { hint, .. } => hint.clone(),
            GpuError::LockFolder { .. } => format!("set ${} to a folder on this node that you can write (every task of a node must use the same one)", crate::env::EnvVars::GPU_LOCKS),
            GpuError::Driver { .. } => return None,
        })
    }
}

/// What a GPU task leaves in its task folder (`gpu.json`) and the runner copies into the run's
/// cost report: the device, the allocator in effect and the memory it measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GpuReport {
    pub device: String,
    pub ordinal: usize,
    pub allocator: String,
    pub options: AllocatorOptions,
    /// The resource's own counters over the whole task.
    pub stats: MemoryStats,
    /// Bytes live once the model was loaded, before the first batch (weights, workspaces).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loaded_bytes: Option<u64>,
    /// Bytes the resource's pool held at most (pool modes), as the driver reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_reserved_high: Option<u64>,
    /// Bytes the device's default pool served at most during the task: allocations that did not
    /// go through the chosen resource would show here (0 expected unless --allocator async).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_pool_used_high: Option<u64>,
    /// Pointer attributes of sampled allocations, checked against the mode.
    #[serde(default)]
    pub pointer_checks: PointerChecks,
    /// Out-of-memory back-off, when it happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<backoff::BackoffReport>,
    /// Cells per batch the task ran at (after any back-off): with `stats.peak_bytes`, what
    /// `scfoundry trace` sizes batches from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    /// Milliseconds inside the allocator's allocation and free calls (`stats.alloc_ns` +
    /// `stats.free_ns`), and their share of the task's wall time: set by the runner, which
    /// knows the wall time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alloc_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alloc_share: Option<f64>,
}

/// Sampled allocations whose driver attributes were read back (cuPointerGetAttribute).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointerChecks {
    pub checked: u64,
    /// CU_POINTER_ATTRIBUTE_IS_MANAGED was set.
    pub managed: u64,
    /// CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE was the resource's own pool.
    pub from_own_pool: u64,
    /// Pointers whose attributes contradict the mode (must be 0).
    pub mismatched: u64,
}

impl GpuReport {
    pub const FILE: &'static str = "gpu.json";

    pub fn read(dir: &Path) -> Option<GpuReport> {
        let t = std::fs::read_to_string(dir.join(Self::FILE)).ok()?;
        serde_json::from_str(&t).ok()
    }

    /// Fill `alloc_ms` and `alloc_share` from the task's wall time (`None`: unknown, or zero).
    pub fn with_wall_ms(mut self, wall_ms: Option<u64>) -> GpuReport {
        let ms = self.stats.alloc_ms();
        self.alloc_ms = Some(ms);
        self.alloc_share = wall_ms.filter(|&w| w > 0).map(|w| ms / w as f64);
        self
    }
}

/// Check `--device`/`--gpu` before a run starts: the CUDA build, the driver, the libraries and
/// the device. `visible` is the CUDA_VISIBLE_DEVICES the task will get, for messages.
pub fn preflight(spec: &DeviceSpec) -> Result<(), GpuError> {
    spec.allocator.validate()?;
    match spec.kind {
        DeviceKind::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => cuda::preflight(spec.ordinal),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => Err(GpuError::NotCompiled),
    }
}

/// candle's device on CUDA GPU `ordinal`, as every GPU path of scfoundry opens it: with cudarc's
/// event tracking off. candle queues all of a device's work on one stream (CUDA's per-thread
/// default stream), and our own copies (`pinned.rs`, `readback.rs`) record the events they need
/// themselves, so tracking only adds work: cudarc creates two events for every allocation (and
/// destroys them with it) whether or not a second stream ever exists.
pub fn cuda_device(ordinal: usize) -> candle_core::Result<candle_core::Device> {
    let device = candle_core::Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = &device {
        // Safety: one stream a device (candle's); nothing of ours waits on cudarc's events
        unsafe { d.disable_event_tracking() };
    }
    Ok(device)
}


/// Whether an error message is CUDA's out-of-memory (from the driver or our limit).
pub fn is_out_of_memory(message: &str) -> bool {
    message.contains("CUDA_ERROR_OUT_OF_MEMORY") || message.contains("out of memory")
}
