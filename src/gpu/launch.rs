//! Launching our own kernels with programmatic dependent launch (PDL, Hopper): a kernel launched
//! this way may be scheduled while the kernel before it on the stream is still finishing; its
//! blocks then wait in `griddepcontrol.wait` (kernels/sm90_common.cuh `wait_for_previous_grid`)
//! until that kernel has completed and its writes are visible. What it hides is the gap between
//! two kernels: the launch's own processing and the new blocks' start, paid otherwise after the
//! last block of the kernel before has left (issue #5's Geneformer V1 runs 30 kernels a batch).
//!
//! Taken by the attention kernel and the fused product + layer norm on Hopper when
//! `SCFOUNDRY_PDL` is not `0` and cudarc's cross-stream event tracking is off (`gpu::cuda_device`
//! turns it off): with tracking on, cudarc puts event waits and records between the kernels of a
//! launch, which would serialise them anyway, and this launch does not record them. Every kernel
//! launched here calls `griddepcontrol.wait` before it touches memory, so the order on the stream
//! stays what it was: a kernel's blocks may start early, not its reads or writes.

use std::ffi::c_void;
use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction, CudaStream, LaunchConfig};
use candle_core::cuda_backend::{DeviceId, WrapErr};
use candle_core::{CudaDevice, Result};

/// Whether kernels on `dev` are launched with PDL (decided once per device): a Hopper, event
/// tracking off, and SCFOUNDRY_PDL not `0`.
pub(crate) fn pdl(dev: &CudaDevice) -> bool {
    static CHOSEN: Mutex<Vec<(DeviceId, bool)>> = Mutex::new(Vec::new());
    let mut chosen = CHOSEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, on)) = chosen.iter().find(|(id, _)| *id == dev.id()) {
        return on;
    }
    let hopper = matches!(dev.cuda_stream().context().compute_capability(), Ok((9, _)));
    let on = hopper && !dev.is_event_tracking() && std::env::var("SCFOUNDRY_PDL").map_or(true, |v| v != "0");
    chosen.push((dev.id(), on));
    on
}

/// `func` on `stream` with `params` (pointers to each argument's value, in the kernel's order),
/// with PDL when `pdl`. cudarc's builder is not used: it would add event waits and records, and
/// the caller has made sure there are none to keep ([`pdl`] is false while tracking is on).
///
/// # Safety
/// As for any kernel launch: `params` must match the kernel's parameters, and the memory they
/// point to must stay valid until the kernel has run.
pub(crate) unsafe fn launch(func: &CudaFunction, stream: &CudaStream, cfg: LaunchConfig, params: &mut [*mut c_void], pdl: bool) -> Result<()> {
    let mut value: sys::CUlaunchAttributeValue = std::mem::zeroed();
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute { id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, pad: [0; 4], value };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
        numAttrs: u32::from(pdl),
    };
    stream.context().bind_to_thread().w()?;
    sys::cuLaunchKernelEx(&config, func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()).result().w()
}

/// A kernel argument's address for [`launch`]'s `params`.
pub(crate) fn param<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}
