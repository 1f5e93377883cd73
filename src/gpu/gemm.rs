//! The fused encoder's matrix products through cuBLASLt, each shape's algorithm chosen once by
//! timing the heuristic's best few on the real operands.
//!
//! cuBLASLt's heuristic names one algorithm for a shape without running anything; for the
//! encoders' tall, narrow products (tens of thousands of token rows, 256 to 3,072 columns, a bias
//! and maybe ReLU or a residual in the epilogue) its first choice is not always the fastest.
//! [`Lt::linear`] asks for up to [`CANDIDATES`] algorithms the first time it
//! meets a shape (the token count rounded up to a power of two), times each on the call's own
//! operands, and keeps the fastest; later calls reuse it (checked with `cublasLtMatmulAlgoCheck`
//! when their token count differs). Timing writes only to memory the step is about to overwrite
//! anyway: the output itself, or, for products that add into their output (the residual steps),
//! a work buffer the caller names as free.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublaslt::{result, sys};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut};
use candle_core::Result;
use half::bf16;

/// How many of the heuristic's best algorithms are timed for a new shape (its first choice
/// was up to 15% slower at scGPT's and UCE's shapes; docs/gpu.md).
pub(crate) const CANDIDATES: usize = 8;

/// cuBLASLt's workspace, as NVIDIA recommends for Hopper.
const WORKSPACE: usize = 32 << 20;
/// Most (shape, token count) pairs `Lt::checked` remembers before it starts over.
const MAX_CHECKED: usize = 4096;

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"))
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    n: usize,
    k: usize,
    bucket: usize,
    accumulate: bool,
    relu: bool,
}

#[derive(Clone, Copy)]
struct Choice {
    algo: sys::cublasLtMatmulAlgo_t,
    tokens: usize,
}

/// One cuBLASLt handle with its workspace and the algorithms chosen so far, per stream.
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    chosen: Mutex<HashMap<Key, Choice>>,
    /// Token counts whose product a shape's chosen algorithm was checked to serve, so that
    /// `cublasLtMatmulAlgoCheck` (host time) runs once per shape and token count, not for every
    /// product whose token count differs from the timed one (batches by tokens differ by a few
    /// tokens). It was measured together with the page-locked buffers' growth (+5.0% on
    /// Geneformer V1), not apart. Cleared when it passes MAX_CHECKED entries.
    checked: Mutex<std::collections::HashSet<(Key, usize)>>,
}

// the handle is used from one stream's thread at a time (cuBLASLt handles are thread-safe)
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

/// The descriptors of one product (destroyed on drop).
struct Descs {
    op: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        unsafe {
            let _ = result::destroy_matrix_layout(self.a);
            let _ = result::destroy_matrix_layout(self.b);
            let _ = result::destroy_matrix_layout(self.c);
            let _ = result::destroy_matmul_desc(self.op);
        }
    }
}

impl Lt {
    /// The stream's handle, made on first use.
    pub(crate) fn for_stream(stream: &Arc<CudaStream>) -> Result<Arc<Lt>> {
        static HANDLES: OnceLock<Mutex<Vec<(usize, Arc<Lt>)>>> = OnceLock::new();
        let key = stream.cu_stream() as usize;
        let mut list = HANDLES.get_or_init(Default::default).lock().expect("not poisoned");
        if let Some((_, h)) = list.iter().find(|(k, _)| *k == key) {
            return Ok(h.clone());
        }
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE) }.map_err(|e| err("workspace", e))?;
        let handle = result::create_handle().map_err(|e| err("handle", e))?;
        let h = Arc::new(Lt { handle, workspace, stream: stream.clone(), chosen: Mutex::new(HashMap::new()), checked: Mutex::new(Default::default()) });
        list.push((key, h.clone()));
        Ok(h)
    }

    /// Column-major to cuBLASLt: out^T (n x tokens) = W (stored k x n, transposed) x^T (k x tokens).
    fn descs(&self, tokens: usize, k: usize, n: usize, bias: u64, relu: bool) -> Result<Descs> {
        let bf = sys::cudaDataType_t::CUDA_R_16BF;
        let op = result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F).map_err(|e| err("descriptor", e))?;
        let a = result::create_matrix_layout(bf, k as u64, n as u64, k as i64);
        let b = result::create_matrix_layout(bf, k as u64, tokens as u64, k as i64);
        let c = result::create_matrix_layout(bf, n as u64, tokens as u64, n as i64);
        let (a, b, c) = match (a, b, c) {
            (Ok(a), Ok(b), Ok(c)) => (a, b, c),
            (a, b, c) => {
                unsafe {
                    let _ = result::destroy_matmul_desc(op);
                    for l in [a, b, c].into_iter().flatten() {
                        let _ = result::destroy_matrix_layout(l);
                    }
                }
                return Err(err("layout", "could not be made"));
            }
        };
        let d = Descs { op, a, b, c };
        let transa: i32 = 1;
        let epilogue = if relu { sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS } else { sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS };
        use sys::cublasLtMatmulDescAttributes_t as A;
        unsafe {
            result::set_matmul_desc_attribute(d.op, A::CUBLASLT_MATMUL_DESC_TRANSA, (&transa) as *const i32 as *const c_void, 4).map_err(|e| err("transpose", e))?;
            result::set_matmul_desc_attribute(d.op, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, (&bias) as *const u64 as *const c_void, 8).map_err(|e| err("bias", e))?;
            result::set_matmul_desc_attribute(d.op, A::CUBLASLT_MATMUL_DESC_EPILOGUE, (&epilogue) as *const _ as *const c_void, std::mem::size_of_val(&epilogue)).map_err(|e| err("epilogue", e))?;
        }
        Ok(d)
    }

    /// Up to `count` algorithms for the product, the heuristic's best first.
    fn heuristics(&self, d: &Descs, count: usize) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
        let pref = result::create_matmul_pref().map_err(|e| err("preference", e))?;
        let size = WORKSPACE as u64;
        let mut out: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; count];
        let mut found = 0i32;
        let status = unsafe {
            let s = result::set_matmul_pref_attribute(pref, sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, (&size) as *const u64 as *const c_void, 8);
            let h = s.and_then(|_| sys::cublasLtMatmulAlgoGetHeuristic(self.handle, d.op, d.a, d.b, d.c, d.c, pref, count as i32, out.as_mut_ptr(), &mut found).result());
            let _ = result::destroy_matmul_pref(pref);
            h
        };
        status.map_err(|e| err("heuristic", e))?;
        out.truncate(found.max(0) as usize);
        out.retain(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= WORKSPACE);
        if out.is_empty() {
            return Err(err("heuristic", "no algorithm for this product"));
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(&self, d: &Descs, algo: &sys::cublasLtMatmulAlgo_t, w: u64, x: u64, out: u64, beta: f32) -> Result<()> {
        let alpha = 1f32;
        let (ws, _ws_guard) = self.workspace.device_ptr(&self.stream);
        unsafe {
            sys::cublasLtMatmul(
                self.handle,
                d.op,
                (&alpha) as *const f32 as *const c_void,
                w as *const c_void,
                d.a,
                x as *const c_void,
                d.b,
                (&beta) as *const f32 as *const c_void,
                out as *const c_void,
                d.c,
                out as *mut c_void,
                d.c,
                algo,
                ws as *mut c_void,
                WORKSPACE,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
            .result()
        }
        .map_err(|e| err("matmul", e))
    }

    /// `out = x W^T + b (+ out when accumulate)`, row-major `x` (`tokens x k`), `W` (`n x k`),
    /// `out` (`tokens x n`); with `relu`, ReLU after the bias. `scratch`: a buffer of at least
    /// `tokens x n` values the caller does not need, where a residual product's candidates are
    /// timed (without one such a shape keeps the heuristic's first choice).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear(&self, x: &CudaView<bf16>, tokens: usize, k: usize, w: &CudaView<bf16>, b: &CudaView<bf16>, n: usize, out: &mut CudaSlice<bf16>, accumulate: bool, relu: bool, scratch: Option<&mut CudaSlice<bf16>>) -> Result<()> {
        let s = &self.stream;
        let (xp, _xg) = x.device_ptr(s);
        let (wp, _wg) = w.device_ptr(s);
        let (bp, _bg) = b.device_ptr(s);
        let d = self.descs(tokens, k, n, bp, relu)?;
        let beta = if accumulate { 1f32 } else { 0f32 };
        let key = Key { n, k, bucket: tokens.next_power_of_two(), accumulate, relu };
        let known = self.chosen.lock().expect("not poisoned").get(&key).copied();
        let algo = match known {
            Some(c) if c.tokens == tokens || self.checked.lock().expect("not poisoned").contains(&(key, tokens)) => c.algo,
            Some(c) if self.fits(&d, &c.algo) => {
                let mut checked = self.checked.lock().expect("not poisoned");
                if checked.len() >= MAX_CHECKED {
                    checked.clear();
                }
                checked.insert((key, tokens));
                c.algo
            }
            Some(_) => self.heuristics(&d, 1)?[0].algo,
            None => {
                let scratch = scratch.filter(|sc| sc.len() >= tokens * n);
                if accumulate && scratch.is_none() {
                    // nowhere to time a residual product without changing its output
                    let algo = self.heuristics(&d, 1)?[0].algo;
                    self.chosen.lock().expect("not poisoned").insert(key, Choice { algo, tokens });
                    algo
                } else {
                    let target: &mut CudaSlice<bf16> = match scratch {
                        Some(sc) if accumulate => sc,
                        _ => &mut *out,
                    };
                    let (tp, _tg) = target.device_ptr_mut(s);
                    self.choose_timed(&d, key, tokens, wp, xp, tp, beta)?
                }
            }
        };
        let (op, _og) = out.device_ptr_mut(s);
        self.launch(&d, &algo, wp, xp, op, beta).map_err(|e| candle_core::Error::Msg(format!("{e} ({tokens} x {k} by {n} x {k})")))
    }

    /// Whether a chosen algorithm serves this product too (another token count).
    fn fits(&self, d: &Descs, algo: &sys::cublasLtMatmulAlgo_t) -> bool {
        let mut r: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        let ok = unsafe { sys::cublasLtMatmulAlgoCheck(self.handle, d.op, d.a, d.b, d.c, d.c, algo, &mut r) };
        ok == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= WORKSPACE
    }

    /// Times the heuristic's candidates into `target` (the output, or a free buffer of its size)
    /// and keeps the fastest for the shape.
    #[allow(clippy::too_many_arguments)]
    fn choose_timed(&self, d: &Descs, key: Key, tokens: usize, w: u64, x: u64, target: u64, beta: f32) -> Result<sys::cublasLtMatmulAlgo_t> {
        let candidates = self.heuristics(d, CANDIDATES)?;
        let mut best = (f32::INFINITY, candidates[0].algo);
        if candidates.len() > 1 {
            let ctx = self.stream.context();
            let (start, end) = (ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("event", e))?, ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| err("event", e))?);
            for c in &candidates {
                // a candidate cuBLASLt turns down at launch is left out, not the product
                if self.launch(d, &c.algo, w, x, target, beta).is_err() {
                    continue;
                }
                start.record(&self.stream).map_err(|e| err("event", e))?;
                for _ in 0..3 {
                    self.launch(d, &c.algo, w, x, target, beta)?;
                }
                end.record(&self.stream).map_err(|e| err("event", e))?;
                let ms = start.elapsed_ms(&end).map_err(|e| err("event", e))? / 3.0;
                if ms < best.0 {
                    best = (ms, c.algo);
                }
            }
        }
        self.chosen.lock().expect("not poisoned").insert(key, Choice { algo: best.1, tokens });
        Ok(best.1)
    }
}
