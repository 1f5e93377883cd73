//! The CUDA side of the runtime (feature `cuda`): memory resources on the driver API, modelled on
//! RMM's (async, pool, managed, managed-pool, cuda), the hook that routes candle's allocations to
//! the chosen one, and device probing for `doctor` and preflight.
//!
//! Each resource wraps one driver mechanism:
//! - async: `cuMemAllocAsync`/`cuMemFreeAsync` on the device's default pool, whose release
//!   threshold is set from `--release-threshold`, by default the card's memory (RMM's
//!   cuda_async_memory_resource does the same; the driver's own default is 0);
//! - pool: a pool of our own (`cuMemPoolCreate`, `maxSize` = `--maximum-pool-size`), filled to
//!   `--initial-pool-size` at start and never trimmed (release threshold = maximum);
//! - managed: `cuMemAllocManaged` + `cuMemPrefetchAsync` to the device, `cuMemFree` after the
//!   stream is done with it (RMM's managed_memory_resource frees synchronously too);
//! - managed-pool: a pool created with `CU_MEM_ALLOCATION_TYPE_MANAGED`, allocated from explicitly
//!   with `cuMemAllocFromPoolAsync` (making it the device's current pool does not make
//!   `cuMemAllocAsync` return managed memory, as measured on the H200);
//! - cuda: `cuMemAlloc`/`cuMemFree`.
//! Every resource sits under the accounting adaptors (statistics, limit, log).

use std::ffi::{c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdeviceptr, CUmemoryPool, CUstream};
use cudarc::driver::{CudaContext, DriverError};
use serde::Serialize;

use super::accounting::{Accounting, AllocFailure};
use super::options::human;
use super::{AllocatorKind, AllocatorOptions, GpuError, GpuReport, PointerChecks};

fn drv(call: &str) -> impl Fn(DriverError) -> GpuError + '_ {
    move |e| GpuError::Driver { call: call.into(), detail: e.to_string() }
}

fn oom() -> DriverError {
    DriverError(sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY)
}

/// Try to open a shared library by cudarc's candidate names; the name that loaded.
fn dlopen_any(lib: &str) -> Result<String, String> {
    let mut last = String::new();
    for name in cudarc::get_lib_name_candidates(lib) {
        let c = CString::new(name.clone()).unwrap();
        // SAFETY: dlopen/dlerror with a valid C string; the handle is kept (cudarc opens it too).
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !h.is_null() {
            return Ok(name);
        }
        let e = unsafe { libc::dlerror() };
        if !e.is_null() {
            last = unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned();
        }
    }
    Err(if last.is_empty() { format!("no lib{lib}.so found") } else { last })
}

fn visible_note() -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) => format!(" (CUDA_VISIBLE_DEVICES={v} is set and limits what this process sees)"),
        Err(_) => String::new(),
    }
}

/// The driver loaded and initialised, the device present, cuBLAS/cuRAND loadable. Never panics
/// (cudarc panics when a library is missing, so we look first).
pub fn preflight(ordinal: usize) -> Result<(), GpuError> {
    dlopen_any("cuda").map_err(|detail| GpuError::NoDriver { detail })?;
    // SAFETY: plain driver calls with valid out-pointers.
    let count = unsafe {
        match sys::cuInit(0).result() {
            Ok(()) => {}
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => {
                return Err(GpuError::NoDevice { ordinal, found: "the driver sees no CUDA device".into(), visible: visible_note() })
            }
            Err(e) => return Err(GpuError::NoDriver { detail: format!("cuInit: {e}") }),
        }
        let mut n = 0i32;
        sys::cuDeviceGetCount(&mut n).result().map_err(drv("cuDeviceGetCount"))?;
        n as usize
    };
    if ordinal >= count {
        let found = if count == 0 { "the driver sees no CUDA device".to_string() } else { format!("this machine shows {count} device(s), 0 to {}", count - 1) };
        return Err(GpuError::NoDevice { ordinal, found, visible: visible_note() });
    }
    // the driver and the card against what this binary carries (gpu/build.rs)
    let (driver, cap) = driver_and_capability(ordinal)?;
    super::build::Targets::this_binary()
        .check(driver, cap)
        .map_err(|u| GpuError::Unsupported { detail: format!("device {ordinal}: {}", u.detail), hint: u.hint })?;
    for lib in ["cublas", "cublasLt", "curand"] {
        dlopen_any(lib).map_err(|detail| GpuError::NoLibrary { library: format!("lib{lib}"), detail })?;
    }
    Ok(())
}

/// cuDriverGetVersion and device `ordinal`'s compute capability (the driver initialised).
pub fn driver_and_capability(ordinal: usize) -> Result<(i32, (u32, u32)), GpuError> {
    use sys::CUdevice_attribute_enum::*;
    let mut v = 0i32;
    let mut dev = 0;
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        sys::cuDriverGetVersion(&mut v).result().map_err(drv("cuDriverGetVersion"))?;
        sys::cuDeviceGet(&mut dev, ordinal as i32).result().map_err(drv("cuDeviceGet"))?;
    }
    let cap = (attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) as u32, attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) as u32);
    Ok((v, cap))
}

/// One device as `doctor` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub memory_pools: bool,
    pub managed_memory: bool,
    pub concurrent_managed_access: bool,
    /// how this binary's kernels run there ("machine code sm_90", "PTX compute_90, compiled at
    /// load"), or why they cannot
    pub kernels: Result<String, String>,
}

/// Driver and library versions and the devices, for `doctor`.
#[derive(Debug, Clone, Serialize)]
pub struct Inventory {
    pub driver_library: String,
    /// CUDA version the driver supports, e.g. "13.0".
    pub driver_cuda_version: String,
    /// What this binary carries: CUDA version and architectures (gpu/build.rs).
    pub built_for_cuda: String,
    pub cublas: Result<String, String>,
    pub curand: Result<String, String>,
    pub devices: Vec<DeviceInfo>,
}

fn attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> i32 {
    let mut v = 0i32;
    // SAFETY: valid out-pointer and device handle.
    unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) };
    v
}

pub fn inventory() -> Result<Inventory, GpuError> {
    let driver_library = dlopen_any("cuda").map_err(|detail| GpuError::NoDriver { detail })?;
    // SAFETY: driver calls with valid out-pointers; contexts are retained through cudarc.
    unsafe {
        sys::cuInit(0).result().map_err(|e| GpuError::NoDriver { detail: format!("cuInit: {e}") })?;
        let mut v = 0i32;
        sys::cuDriverGetVersion(&mut v).result().map_err(drv("cuDriverGetVersion"))?;
        let driver_cuda_version = format!("{}.{}", v / 1000, (v % 1000) / 10);
        let cublas = dlopen_any("cublas").map(|name| {
            let (mut ma, mut mi, mut pa) = (0, 0, 0);
            use cudarc::cublas::sys::{cublasGetProperty, libraryPropertyType_t as P};
            cublasGetProperty(P::MAJOR_VERSION, &mut ma);
            cublasGetProperty(P::MINOR_VERSION, &mut mi);
            cublasGetProperty(P::PATCH_LEVEL, &mut pa);
            format!("{ma}.{mi}.{pa} ({name})")
        });
        let curand = dlopen_any("curand");
        let mut n = 0i32;
        sys::cuDeviceGetCount(&mut n).result().map_err(drv("cuDeviceGetCount"))?;
        let mut devices = Vec::new();
        for i in 0..n as usize {
            let mut dev = 0;
            sys::cuDeviceGet(&mut dev, i as i32).result().map_err(drv("cuDeviceGet"))?;
            let mut name = [0 as std::ffi::c_char; 256];
            sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev).result().map_err(drv("cuDeviceGetName"))?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            use sys::CUdevice_attribute_enum::*;
            let ctx = CudaContext::new(i).map_err(drv("cuDevicePrimaryCtxRetain"))?;
            ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
            let cap = (attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) as u32, attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) as u32);
            let kernels = match super::build::Targets::this_binary().check(v, cap) {
                Ok(super::build::Fit::Sass(a)) => Ok(format!("machine code {a}")),
                Ok(super::build::Fit::Ptx(a)) => Ok(format!("PTX {a}, compiled by the driver at load")),
                Err(u) => Err(format!("{} (hint: {})", u.detail, u.hint)),
            };
            let (mut free, mut total) = (0usize, 0usize);
            sys::cuMemGetInfo_v2(&mut free, &mut total).result().map_err(drv("cuMemGetInfo"))?;
            devices.push(DeviceInfo {
                ordinal: i,
                name,
                compute_capability: format!("{}.{}", attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
                total_bytes: total as u64,
                free_bytes: free as u64,
                memory_pools: attr(dev, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) != 0,
                managed_memory: attr(dev, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY) != 0,
                concurrent_managed_access: attr(dev, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS) != 0,
                kernels,
            });
        }
        Ok(Inventory { driver_library, driver_cuda_version, built_for_cuda: super::build::Targets::this_binary().describe(), cublas, curand, devices })
    }
}

/// How a resource gets memory from the driver.
#[derive(Debug, Clone, Copy)]
enum Upstream {
    /// cuMemAllocAsync from the device's current (default) pool.
    DefaultPool,
    /// cuMemAllocFromPoolAsync from a pool we created.
    OwnPool(CUmemoryPool),
    /// cuMemAllocManaged.
    Managed,
    /// cuMemAlloc.
    Plain,
}

/// A device memory resource with its adaptors. `'static` once installed as the hook.
pub struct Resource {
    pub kind: AllocatorKind,
    pub options: AllocatorOptions,
    ordinal: i32,
    upstream: Upstream,
    default_pool: CUmemoryPool,
    acct: Accounting,
    /// managed modes: bytes prefetched to the device and live (for --device-budget).
    prefetched: AtomicU64,
    prefetched_ptrs: Mutex<std::collections::HashSet<u64>>,
    /// Read pointer attributes of the first allocations and then every `sample_every`-th.
    sample_every: u64,
    checks: Mutex<PointerChecks>,
    loaded: Mutex<Option<u64>>,
    _ctx: Arc<CudaContext>,
}

// SAFETY: the raw pool handles are plain driver handles, usable from any thread with the
// context bound; all mutable state is behind atomics and mutexes.
unsafe impl Send for Resource {}
unsafe impl Sync for Resource {}

impl Resource {
    /// Create the resource on device `ordinal` (as this process sees it). Pool modes reserve
    /// their initial size here.
    pub fn new(options: &AllocatorOptions, ordinal: usize) -> Result<Resource, GpuError> {
        options.validate()?;
        let ctx = CudaContext::new(ordinal).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let dev = ctx.cu_device();
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the context is bound.
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total).result().map_err(drv("cuMemGetInfo"))? };
        let mut default_pool: CUmemoryPool = std::ptr::null_mut();
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut default_pool, dev).result().map_err(drv("cuDeviceGetDefaultMemPool"))? };
        let kind = options.kind;
        // the managed modes prefetch and advise with cuMemPrefetchAsync_v2 and cuMemAdvise_v2,
        // which drivers have from CUDA 12.2 on (the CUDA 12 build also runs on 12.0 and 12.1)
        let mut driver = 0i32;
        // SAFETY: valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut driver).result().map_err(drv("cuDriverGetVersion"))? };
        if kind.is_managed() && driver < 12020 {
            return Err(GpuError::BadOption {
                option: "allocator".into(),
                value: format!("{} (the driver supports CUDA {}.{})", kind.name(), driver / 1000, (driver % 1000) / 10),
                hint: "the managed allocators need a driver for CUDA 12.2 or newer (cuMemPrefetchAsync_v2, cuMemAdvise_v2): update the driver, or use --allocator async".into(),
            });
        }
        let mut limit = options.limit.map(|b| b.0);
        let upstream = match kind {
            AllocatorKind::Async => {
                keep_in_default_pool(dev, options.release_threshold.map(|b| b.0))?;
                Upstream::DefaultPool
            }
            AllocatorKind::Pool | AllocatorKind::ManagedPool => {
                let managed = kind == AllocatorKind::ManagedPool;
                // RMM's pool defaults: start at half the free memory, grow to all of it.
                let maximum = options.maximum_pool_size.map(|b| b.0).unwrap_or(free as u64);
                let initial = options.initial_pool_size.map(|b| b.0).unwrap_or(if managed { 0 } else { (free as u64 / 2).min(maximum) });
                if managed && initial > free as u64 {
                    return Err(GpuError::BadOption {
                        option: "initial-pool-size".into(),
                        value: format!("{} with {} free on the device", human(initial), human(free as u64)),
                        hint: "a managed pool's initial reservation is prefetched to the card: keep it within the free memory (the maximum may exceed it)".into(),
                    });
                }
                let pool = create_pool(ordinal as i32, managed, maximum)?;
                set_release_threshold(pool, options.release_threshold.map(|b| b.0).unwrap_or(u64::MAX))?;
                if initial > 0 {
                    // fill the pool: one allocation of the initial size, freed back into it
                    unsafe {
                        let mut p: CUdeviceptr = 0;
                        let s = std::ptr::null_mut();
                        sys::cuMemAllocFromPoolAsync(&mut p, initial as usize, pool, s).result().map_err(|e| GpuError::BadOption {
                            option: "initial-pool-size".into(),
                            value: format!("{} could not be reserved ({e}); {} free", human(initial), human(free as u64)),
                            hint: "pass a smaller --initial-pool-size".into(),
                        })?;
                        sys::cuMemFreeAsync(p, s).result().map_err(drv("cuMemFreeAsync"))?;
                        sys::cuStreamSynchronize(s).result().map_err(drv("cuStreamSynchronize"))?;
                    }
                }
                limit = Some(limit.map_or(maximum, |l| l.min(maximum)));
                Upstream::OwnPool(pool)
            }
            AllocatorKind::Managed => Upstream::Managed,
            AllocatorKind::Cuda => Upstream::Plain,
        };
        let acct = Accounting::new(limit, options.log.as_deref()).map_err(|e| GpuError::BadOption {
            option: "allocation-log".into(),
            value: format!("{}: {e}", options.log.as_deref().unwrap_or(std::path::Path::new("")).display()),
            hint: "give a writable file path".into(),
        })?;
        Ok(Resource {
            kind,
            options: options.clone(),
            ordinal: ordinal as i32,
            upstream,
            default_pool,
            acct,
            prefetched: AtomicU64::new(0),
            prefetched_ptrs: Mutex::new(Default::default()),
            sample_every: 64,
            checks: Mutex::new(PointerChecks::default()),
            loaded: Mutex::new(None),
            _ctx: ctx,
        })
    }

    /// No pointer sampling (for latency benchmarks).
    pub fn without_sampling(mut self) -> Resource {
        self.sample_every = 0;
        self
    }

    fn device_location(&self) -> sys::CUmemLocation {
        sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: self.ordinal }
    }

    /// Allocate `bytes` ordered on `stream`.
    pub fn allocate(&self, bytes: usize, stream: CUstream) -> Result<CUdeviceptr, DriverError> {
        let ptr = self
            .acct
            .allocate(bytes as u64, stream as u64, || -> Result<u64, DriverError> {
                let mut p: CUdeviceptr = 0;
                // SAFETY: valid out-pointer; the caller has the context bound (cudarc binds it).
                unsafe {
                    match self.upstream {
                        Upstream::DefaultPool => sys::cuMemAllocAsync(&mut p, bytes, stream).result()?,
                        Upstream::OwnPool(pool) => sys::cuMemAllocFromPoolAsync(&mut p, bytes, pool, stream).result()?,
                        Upstream::Managed => sys::cuMemAllocManaged(&mut p, bytes.max(1), sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32).result()?,
                        Upstream::Plain => sys::cuMemAlloc_v2(&mut p, bytes.max(1)).result()?,
                    }
                }
                Ok(p)
            })
            .map_err(|e| match e {
                AllocFailure::OverLimit(_) => oom(),
                AllocFailure::Upstream(e) => e,
            })?;
        if self.kind.is_managed() && bytes > 0 {
            self.prefetch(ptr, bytes, stream)?;
        }
        if self.sample_every > 0 {
            let n = self.acct.stats().allocations;
            if n <= 8 || n % self.sample_every == 0 {
                self.check_pointer(ptr);
            }
        }
        Ok(ptr)
    }

    /// Managed memory goes to the device while the device budget allows; beyond it the pages
    /// stay on the host and migrate when touched (what a card smaller than the data does).
    fn prefetch(&self, ptr: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<(), DriverError> {
        if let Some(budget) = self.options.device_budget {
            let before = self.prefetched.fetch_add(bytes as u64, Ordering::Relaxed);
            if before + bytes as u64 > budget.0 {
                self.prefetched.fetch_sub(bytes as u64, Ordering::Relaxed);
                let host = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 };
                // SAFETY: ptr/bytes come from a managed allocation just made.
                return unsafe { sys::cuMemAdvise_v2(ptr, bytes, sys::CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host).result() };
            }
        }
        self.prefetched_ptrs.lock().unwrap().insert(ptr);
        // SAFETY: as above.
        unsafe { sys::cuMemPrefetchAsync_v2(ptr, bytes, self.device_location(), 0, stream).result() }
    }

    /// Free `ptr` if it is ours (false otherwise).
    pub fn deallocate(&self, ptr: CUdeviceptr, stream: CUstream) -> Result<bool, DriverError> {
        let freed = self.acct.free(ptr, stream as u64, |bytes| -> Result<(), DriverError> {
            if self.kind.is_managed() && self.prefetched_ptrs.lock().unwrap().remove(&ptr) {
                self.prefetched.fetch_sub(bytes, Ordering::Relaxed);
            }
            // SAFETY: ptr was allocated by this resource with the matching call.
            unsafe {
                match self.upstream {
                    Upstream::DefaultPool | Upstream::OwnPool(_) => sys::cuMemFreeAsync(ptr, stream).result(),
                    Upstream::Managed | Upstream::Plain => {
                        // the stream may still use the memory: wait for it, as cudaFree would
                        sys::cuStreamSynchronize(stream).result()?;
                        sys::cuMemFree_v2(ptr).result()
                    }
                }
            }
        })?;
        Ok(freed.is_some())
    }

    /// Read the driver's attributes of `ptr` and check them against the mode.
    pub fn check_pointer(&self, ptr: CUdeviceptr) -> PointerChecks {
        let mut managed: u32 = 0;
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointers of the attribute's type.
        let is_managed = unsafe { sys::cuPointerGetAttribute(&mut managed as *mut u32 as *mut c_void, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr).result() }.is_ok() && managed != 0;
        let pool_ok = unsafe { sys::cuPointerGetAttribute(&mut pool as *mut CUmemoryPool as *mut c_void, sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr).result() }.is_ok();
        let own = match self.upstream {
            Upstream::OwnPool(p) => pool_ok && pool == p,
            _ => false,
        };
        let consistent = match self.upstream {
            Upstream::DefaultPool => !is_managed && pool_ok && pool == self.default_pool,
            Upstream::OwnPool(_) => own && is_managed == (self.kind == AllocatorKind::ManagedPool),
            Upstream::Managed => is_managed && !(pool_ok && !pool.is_null()),
            Upstream::Plain => !is_managed && !(pool_ok && !pool.is_null()),
        };
        let mut c = self.checks.lock().unwrap();
        c.checked += 1;
        c.managed += is_managed as u64;
        c.from_own_pool += own as u64;
        c.mismatched += (!consistent) as u64;
        *c
    }

    pub fn stats(&self) -> super::MemoryStats {
        self.acct.stats()
    }

    /// Remember the bytes live now as the model's (called once the weights are on the device).
    pub fn mark_loaded(&self) {
        *self.loaded.lock().unwrap() = Some(self.stats().current_bytes);
    }

    pub fn pointer_checks(&self) -> PointerChecks {
        *self.checks.lock().unwrap()
    }

    fn pool_attr(pool: CUmemoryPool, a: sys::CUmemPool_attribute) -> Option<u64> {
        let mut v: u64 = 0;
        // SAFETY: these attributes are cuuint64_t.
        unsafe { sys::cuMemPoolGetAttribute(pool, a, &mut v as *mut u64 as *mut c_void).result().ok()? };
        Some(v)
    }

    /// Start counting the default pool's high-water mark from now (to show nothing bypasses us).
    pub fn reset_default_pool_high(&self) {
        let mut zero: u64 = 0;
        // SAFETY: resetting a high-water attribute takes a zero cuuint64_t.
        unsafe {
            let _ = sys::cuMemPoolSetAttribute(self.default_pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut zero as *mut u64 as *mut c_void);
            let _ = sys::cuMemPoolSetAttribute(self.default_pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &mut zero as *mut u64 as *mut c_void);
        }
    }

    /// The report a task writes to `gpu.json`.
    pub fn report(&self, device_name: &str) -> GpuReport {
        let _ = self.acct.flush_log();
        GpuReport {
            device: device_name.to_string(),
            ordinal: self.ordinal as usize,
            allocator: self.options.describe(),
            options: self.options.clone(),
            stats: self.stats(),
            loaded_bytes: *self.loaded.lock().unwrap(),
            pool_reserved_high: match self.upstream {
                Upstream::OwnPool(p) => Self::pool_attr(p, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
                Upstream::DefaultPool => Self::pool_attr(self.default_pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
                _ => None,
            },
            default_pool_used_high: Self::pool_attr(self.default_pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH),
            pointer_checks: self.pointer_checks(),
            backoff: None,
            batch_size: None,
            // the runner sets these: it knows the task's wall time
            alloc_ms: None,
            alloc_share: None,
        }
    }
}

/// `pool`'s release threshold: the bytes it keeps reserved after frees before it hands memory
/// back to the system (at the next synchronisation).
fn set_release_threshold(pool: CUmemoryPool, mut bytes: u64) -> Result<(), GpuError> {
    // SAFETY: a valid pool handle and a pointer to a u64, the attribute's type.
    unsafe {
        sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut bytes as *mut u64 as *mut c_void)
            .result()
            .map_err(drv("cuMemPoolSetAttribute(RELEASE_THRESHOLD)"))
    }
}

/// Device `dev`'s default memory pool keeps up to `threshold` bytes after frees, by default the
/// card's total memory: RMM's cuda_async_memory_resource default. The driver's own is 0, with
/// which every synchronisation (a batch's read-back) may hand the pool's free memory back for the
/// next batch to map again (BENCHMARKS.md). Taken by `--allocator async`
/// ([`Resource::new`]) and by the `__bench-*` commands, which allocate from the default pool with
/// no resource installed (`bench_device` in `src/bin/scfoundry-bench/encoder.rs`). Needs a context of `dev` bound.
pub fn keep_in_default_pool(dev: sys::CUdevice, threshold: Option<u64>) -> Result<(), GpuError> {
    let bytes = match threshold {
        Some(b) => b,
        None => {
            let mut total = 0usize;
            // SAFETY: a valid out-pointer and device handle.
            unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev).result().map_err(drv("cuDeviceTotalMem"))? };
            total as u64
        }
    };
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and device handle.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev).result().map_err(drv("cuDeviceGetDefaultMemPool"))? };
    set_release_threshold(pool, bytes)
}

/// Pools of managed memory came with CUDA 13 (the allocation type is not in the 12.x API).
#[cfg(not(feature = "cuda12"))]
fn managed_allocation_type() -> Result<sys::CUmemAllocationType, GpuError> {
    Ok(sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED)
}
#[cfg(feature = "cuda12")]
fn managed_allocation_type() -> Result<sys::CUmemAllocationType, GpuError> {
    Err(GpuError::BadOption {
        option: "allocator".into(),
        value: "managed-pool".into(),
        hint: "pools of managed memory need CUDA 13 (driver and build): use the CUDA 13 build (scripts/build-cuda.sh), or --allocator managed".into(),
    })
}

fn create_pool(ordinal: i32, managed: bool, maximum: u64) -> Result<CUmemoryPool, GpuError> {
    // SAFETY: zeroed props are the documented starting point; fields set below.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = if managed { managed_allocation_type()? } else { sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED };
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
    props.maxSize = maximum as usize;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    let r = unsafe { sys::cuMemPoolCreate(&mut pool, &props).result() };
    match r {
        Ok(()) => Ok(pool),
        Err(e) if managed => {
            // some drivers refuse maxSize on managed pools: the accounting limit enforces it then
            props.maxSize = 0;
            unsafe { sys::cuMemPoolCreate(&mut pool, &props).result() }.map_err(|e2| GpuError::Driver { call: "cuMemPoolCreate(managed)".into(), detail: format!("{e}; without maxSize: {e2}") })?;
            Ok(pool)
        }
        Err(e) => Err(GpuError::Driver { call: "cuMemPoolCreate".into(), detail: e.to_string() }),
    }
}

/// The resource behind cudarc's hook.
struct Hook(&'static Resource);

impl cudarc::driver::DeviceMemoryHook for Hook {
    fn allocate(&self, num_bytes: usize, stream: CUstream) -> Result<CUdeviceptr, DriverError> {
        self.0.allocate(num_bytes, stream)
    }
    fn deallocate(&self, ptr: CUdeviceptr, stream: CUstream) -> Result<bool, DriverError> {
        self.0.deallocate(ptr, stream)
    }
}

/// A task's GPU: the resource installed for every allocation, and candle's device on it.
pub struct Runtime {
    pub resource: &'static Resource,
    pub device: candle_core::Device,
    pub name: String,
}

/// Check the device, create the chosen resource, install it for all of cudarc's allocations,
/// then create candle's device (so its cuBLAS workspace comes from the resource too).
pub fn start(spec: &super::DeviceSpec) -> Result<Runtime, GpuError> {
    preflight(spec.ordinal)?;
    let resource: &'static Resource = Box::leak(Box::new(Resource::new(&spec.allocator, spec.ordinal)?));
    resource.reset_default_pool_high();
    if cudarc::driver::set_device_memory_hook(Box::new(Hook(resource))).is_err() {
        return Err(GpuError::Driver { call: "set_device_memory_hook".into(), detail: "a memory resource is already installed in this process".into() });
    }
    let device = crate::gpu::cuda_device(spec.ordinal).map_err(|e| GpuError::Driver { call: "candle Device::new_cuda".into(), detail: e.to_string() })?;
    let name = inventory().ok().and_then(|i| i.devices.into_iter().nth(spec.ordinal)).map(|d| d.name).unwrap_or_else(|| format!("cuda:{}", spec.ordinal));
    Ok(Runtime { resource, device, name })
}

/// Latency of allocation + free pairs under each mode, with sizes log-uniform in 1 KiB-64 MiB
/// (seeded), measured as bench/alloc_rmm.py measures RMM: `pairs` immediate pairs, then `pairs` frees of
/// a random one of 64 live buffers followed by a new allocation.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyRow {
    pub resource: String,
    pub pair_us: f64,
    pub with_live_us: f64,
}

pub fn latency_bench(ordinal: usize, pairs: usize, seed: u64) -> Result<Vec<LatencyRow>, GpuError> {
    use rand::{Rng, SeedableRng};
    preflight(ordinal)?;
    let ctx = CudaContext::new(ordinal).map_err(drv("cuDevicePrimaryCtxRetain"))?;
    ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
    let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
    let s = stream.cu_stream();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let sizes: Vec<usize> = (0..pairs * 2).map(|_| (2f64.powf(rng.gen_range(10.0..26.0))) as usize).collect();
    let picks: Vec<usize> = (0..pairs).map(|_| rng.gen_range(0..64)).collect();
    let sync = || unsafe { sys::cuStreamSynchronize(s).result() }.map_err(drv("cuStreamSynchronize"));

    type AllocFn<'a> = Box<dyn Fn(usize) -> Result<CUdeviceptr, DriverError> + 'a>;
    type FreeFn<'a> = Box<dyn Fn(CUdeviceptr) -> Result<(), DriverError> + 'a>;
    let time = |alloc: &AllocFn, free: &FreeFn| -> Result<(f64, f64), GpuError> {
        let d = drv("allocation");
        // warm-up
        for &b in sizes.iter().take(200) {
            let p = alloc(b).map_err(&d)?;
            free(p).map_err(&d)?;
        }
        sync()?;
        let t = std::time::Instant::now();
        for &b in &sizes[..pairs] {
            let p = alloc(b).map_err(&d)?;
            free(p).map_err(&d)?;
        }
        sync()?;
        let pair = t.elapsed().as_secs_f64() * 1e6 / pairs as f64;
        let mut live: Vec<CUdeviceptr> = sizes[pairs..pairs + 64].iter().map(|&b| alloc(b)).collect::<Result<_, _>>().map_err(&d)?;
        sync()?;
        let t = std::time::Instant::now();
        for (i, &k) in picks.iter().enumerate() {
            free(live[k]).map_err(&d)?;
            live[k] = alloc(sizes[pairs + (i % pairs)]).map_err(&d)?;
        }
        sync()?;
        let with_live = t.elapsed().as_secs_f64() * 1e6 / pairs as f64;
        for p in live {
            free(p).map_err(&d)?;
        }
        sync()?;
        Ok((pair, with_live))
    };
    let mut rows = Vec::new();
    // the raw driver pairs first: the figures the resources are compared against
    {
        let a: AllocFn = Box::new(|b| unsafe {
            let mut p = 0;
            sys::cuMemAllocAsync(&mut p, b, s).result().map(|_| p)
        });
        let f: FreeFn = Box::new(|p| unsafe { sys::cuMemFreeAsync(p, s).result() });
        let (pair, with_live) = time(&a, &f)?;
        rows.push(LatencyRow { resource: "raw cuMemAllocAsync/cuMemFreeAsync".into(), pair_us: pair, with_live_us: with_live });
        let a: AllocFn = Box::new(|b| unsafe {
            let mut p = 0;
            sys::cuMemAlloc_v2(&mut p, b).result().map(|_| p)
        });
        let f: FreeFn = Box::new(|p| unsafe { sys::cuMemFree_v2(p).result() });
        let (pair, with_live) = time(&a, &f)?;
        rows.push(LatencyRow { resource: "raw cuMemAlloc/cuMemFree".into(), pair_us: pair, with_live_us: with_live });
    }
    for kind in AllocatorKind::ALL {
        let opts = AllocatorOptions {
            kind,
            // pools sized for the benchmark's 64 live buffers of at most 64 MiB
            initial_pool_size: matches!(kind, AllocatorKind::Pool | AllocatorKind::ManagedPool).then_some(super::ByteSize(8 << 30)),
            maximum_pool_size: matches!(kind, AllocatorKind::Pool | AllocatorKind::ManagedPool).then_some(super::ByteSize(16 << 30)),
            ..Default::default()
        };
        let r = Resource::new(&opts, ordinal)?.without_sampling();
        let a: AllocFn = Box::new(|b| r.allocate(b, s));
        let f: FreeFn = Box::new(|p| r.deallocate(p, s).map(|_| ()));
        let (pair, with_live) = time(&a, &f)?;
        rows.push(LatencyRow { resource: format!("scfoundry {}", kind.name()), pair_us: pair, with_live_us: with_live });
    }
    Ok(rows)
}
