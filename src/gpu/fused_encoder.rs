//! A stack of transformer encoder layers (`nn::transformer`) in bf16 on a GPU in as few passes
//! over memory as we know how to write, for packed cells. Post-norm layers:
//!
//! | step | how | kernels |
//! |---|---|---|
//! | `qkv = x Wqkv^T + b` | cuBLASLt, bias in the epilogue | 1 |
//! | attention | `kernels/varlen_attention.cu` | 1 |
//! | `x = x + a Wo^T + b` | cuBLASLt, bias in the epilogue, `x` as C with beta 1, in place | 1 |
//! | `x = norm1(x)` | `kernels/encoder_ops.cu` `layer_norm_bf16`, in place | 1 |
//! | `h = act(x W1^T + b)` | cuBLASLt with the bias (and ReLU) epilogue; GELU in place | 1-2 |
//! | `x = norm2(x + h W2^T + b)` | as the output projection and norm1 | 2 |
//!
//! At d = 256 on Hopper each residual product and the norm after it are one kernel
//! (`gpu/gemm_layer_norm.rs`): 5 kernels a layer.
//!
//! candle's ops on the same stack take 14 kernels a layer and allocate a new tensor for each; here
//! three work buffers (QKV, attention output, feed-forward) are allocated once per call and reused
//! by every layer. The input is not copied into the hidden state first: the first layer's QKV
//! product reads it where it is, and at d = 256 the fused output projection + norm1 reads it as
//! the residual and writes the hidden state beside it (a copy of the batch's activations saved a
//! batch: +0.9% on Geneformer V1, BENCHMARKS.md; the two-kernel path copies first).
//! Pre-norm layers (scPRINT) take the same kernels in their order: norm1 into a buffer beside the
//! hidden state (`layer_norm_to_bf16`), the QKV product from it, attention, the output
//! projection added onto the hidden state in the epilogue, norm2 into the buffer, the
//! feed-forward's first product and activation, its second product added onto the hidden state.
//! Parallel layers (GPT-NeoX) take the same steps with norm2 taken from the layer's input before
//! the output projection adds onto it; causal stacks run the causal attention kernel, and a
//! rotary embedding rotates the queries and keys in place between the QKV product and attention
//! (`rotary_qk_bf16`, one thread a token, head and pair: `nn/rotary.rs` has the rule).
//!
//! Heads narrower than the attention kernel's 64 (all-MiniLM-L6-v2's 32) come widened with zero
//! columns (`TransformerStack::pad_heads`, done where the stack is built in bf16 on a GPU): the
//! QKV product is then `3 x heads x 64` wide, the output projection reads `heads x 64` columns,
//! and the scores keep the real width's scale.
//!
//! Same answer as `TransformerStack::forward_unfused` within bf16 rounding.

use candle_core::{DType, Result, Tensor};

use crate::nn::transformer::TransformerStack;

impl TransformerStack {
    /// The last layer's output for packed cells `x` (`tokens x d`): the fused path where it
    /// applies (bf16 on a GPU, see [`applies`]), else [`TransformerStack::forward_unfused`].
    pub fn forward(&self, x: &Tensor, cu: &[u32]) -> Result<Tensor> {
        if self.fused && applies(self, x) {
            return forward(self, x, cu);
        }
        self.forward_unfused(x, cu)
    }
}

/// Whether `forward` takes this input: a CUDA build, `x` (`tokens x d`) in bf16 on a GPU, heads
/// 64 wide (the attention kernel's; narrower heads are widened with zero columns first,
/// [`TransformerStack::pad_heads`]), d and the feed-forward width multiples of 8 (16-byte rows)
/// and d at most 2048 (the layer-norm kernel's rows); causal and rotary stacks in pre-norm or
/// parallel order only, at most 64 rotated values a head.
pub fn applies(stack: &TransformerStack, x: &Tensor) -> bool {
    let Ok((_, d)) = x.dims2() else { return false };
    let ffn = stack.layers.first().and_then(|l| l.ff1.weight().dims2().ok()).map(|s| s.0).unwrap_or(0);
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && x.dtype() == DType::BF16
        && stack.heads > 0
        && stack.head_width() == 64
        && stack.layers.iter().all(|l| l.out.weight().dims2().is_ok_and(|(rows, _)| rows == d))
        && d % 8 == 0
        && d <= 2048
        && ffn % 8 == 0
        && ffn > 0
        && stack.layers.iter().all(|l| l.ff1.weight().dtype() == DType::BF16)
        && (stack.order != crate::nn::transformer::Order::PostNorm || (!stack.causal && stack.rotary.is_none()))
        && stack.rotary.as_ref().is_none_or(|r| r.dims <= 64 && r.dims % 2 == 0 && r.inv_freq.len() == r.dims / 2)
}

/// The stack over packed cells `x` (`tokens x d`, bf16, on a GPU; `applies` says when).
pub fn forward(stack: &TransformerStack, x: &Tensor, cu: &[u32]) -> Result<Tensor> {
    if !applies(stack, x) {
        candle_core::bail!("the fused encoder takes bf16 on a GPU with 64-wide heads (use TransformerStack::forward, or TransformerStack::pad_heads for narrower heads)");
    }
    #[cfg(feature = "cuda")]
    {
        let offsets = crate::gpu::upload::upload_u32(cu, x.device())?;
        let longest = crate::gpu::varlen_attention::longest(cu);
        x.contiguous()?.apply_op2_no_bwd(&offsets, &cuda::Fused { stack, longest, profile: None })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = cu;
        unreachable!("applies() is false without the cuda feature")
    }
}

/// Seconds each step of the first layer takes on `x` (each step run `repeat` times between device
/// synchronisations, the median kept): what a layer's time divides into. For `__bench-encoder
/// --profile`.
pub fn profile(stack: &TransformerStack, x: &Tensor, cu: &[u32], repeat: usize) -> Result<Vec<(&'static str, f64)>> {
    if !applies(stack, x) {
        candle_core::bail!("profiling needs the fused path (bf16 on a GPU with 64-wide heads)");
    }
    #[cfg(feature = "cuda")]
    {
        let offsets = crate::gpu::upload::upload_u32(cu, x.device())?;
        let longest = crate::gpu::varlen_attention::longest(cu);
        let times = std::sync::Mutex::new(Vec::new());
        x.contiguous()?.apply_op2_no_bwd(&offsets, &cuda::Fused { stack, longest, profile: Some((repeat.max(1), &times)) })?;
        Ok(times.into_inner().expect("not poisoned"))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (cu, repeat);
        unreachable!("applies() is false without the cuda feature")
    }
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::{norm_launch, MODULE, PTX};

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Mutex;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CpuStorage, CudaDevice, CudaStorage, Layout, Result, Shape, Tensor};
    use half::bf16;

    use crate::gpu::gemm_layer_norm;
    use crate::gpu::kernel_io::Held;
    use crate::gpu::KernelImage;
    use crate::nn::transformer::{Act, Order, TransformerLayer, TransformerStack};

    /// kernels/encoder_ops.cu (also holds gpu/segment_pool.rs's kernels)
    pub(crate) static PTX: KernelImage = kernel_image!("encoder_ops");
    pub(crate) const MODULE: &str = "scfoundry_encoder_ops";

    pub struct Fused<'a> {
        pub stack: &'a TransformerStack,
        pub longest: usize,
        /// (repeat, where to put the step times): time layer 0's steps instead of running
        pub profile: Option<(usize, &'a Mutex<Vec<(&'static str, f64)>>)>,
    }

    /// One layer's weights and biases, held on the GPU while its kernels read them.
    struct LayerWeights<'t> {
        wq: Held<'t>,
        bq: Held<'t>,
        wo: Held<'t>,
        bo: Held<'t>,
        w1: Held<'t>,
        b1: Held<'t>,
        w2: Held<'t>,
        b2: Held<'t>,
        n1w: Held<'t>,
        n1b: Held<'t>,
        n2w: Held<'t>,
        n2b: Held<'t>,
    }

    impl<'t> LayerWeights<'t> {
        fn new(l: &'t TransformerLayer) -> Result<LayerWeights<'t>> {
            fn bias(lin: &candle_nn::Linear) -> Result<&Tensor> {
                lin.bias().ok_or_else(|| candle_core::Error::Msg("fused encoder: a linear layer without bias".into()))
            }
            fn norm_bias(n: &candle_nn::LayerNorm) -> Result<&Tensor> {
                n.bias().ok_or_else(|| candle_core::Error::Msg("fused encoder: a layer norm without bias".into()))
            }
            Ok(LayerWeights {
                wq: Held::new(l.qkv.weight())?,
                bq: Held::new(bias(&l.qkv)?)?,
                wo: Held::new(l.out.weight())?,
                bo: Held::new(bias(&l.out)?)?,
                w1: Held::new(l.ff1.weight())?,
                b1: Held::new(bias(&l.ff1)?)?,
                w2: Held::new(l.ff2.weight())?,
                b2: Held::new(bias(&l.ff2)?)?,
                n1w: Held::new(l.norm1.weight())?,
                n1b: Held::new(norm_bias(&l.norm1)?)?,
                n2w: Held::new(l.norm2.weight())?,
                n2b: Held::new(norm_bias(&l.norm2)?)?,
            })
        }
    }

    /// `x = LayerNorm(x)` in place (`rows x d`).
    fn layer_norm(dev: &CudaDevice, x: &mut CudaSlice<bf16>, w: &CudaView<bf16>, b: &CudaView<bf16>, rows: usize, d: usize, eps: f32) -> Result<()> {
        norm_into(dev, None, x, w, b, rows, d, eps)
    }

    /// `out = LayerNorm(x)` (`rows x d`), `x` unchanged.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_to(dev: &CudaDevice, x: &CudaSlice<bf16>, out: &mut CudaSlice<bf16>, w: &CudaView<bf16>, b: &CudaView<bf16>, rows: usize, d: usize, eps: f32) -> Result<()> {
        norm_into(dev, Some(x), out, w, b, rows, d, eps)
    }

    /// The layer-norm kernel over `rows x d`: from `src` into `out` (`layer_norm_to_bf16`), or
    /// `out` in place without a `src` (`layer_norm_bf16`).
    #[allow(clippy::too_many_arguments)]
    fn norm_into(dev: &CudaDevice, src: Option<&CudaSlice<bf16>>, out: &mut CudaSlice<bf16>, w: &CudaView<bf16>, b: &CudaView<bf16>, rows: usize, d: usize, eps: f32) -> Result<()> {
        const IN_PLACE: [&str; 8] = ["layer_norm_bf16_p1", "layer_norm_bf16_p2", "layer_norm_bf16_p3", "layer_norm_bf16_p4", "layer_norm_bf16_p5", "layer_norm_bf16_p6", "layer_norm_bf16_p7", "layer_norm_bf16_p8"];
        const INTO: [&str; 8] = ["layer_norm_to_bf16_p1", "layer_norm_to_bf16_p2", "layer_norm_to_bf16_p3", "layer_norm_to_bf16_p4", "layer_norm_to_bf16_p5", "layer_norm_to_bf16_p6", "layer_norm_to_bf16_p7", "layer_norm_to_bf16_p8"];
        let (instance, cfg) = norm_launch(rows, d);
        let func = load_kernel!(dev, if src.is_some() { INTO[instance] } else { IN_PLACE[instance] }, MODULE, PTX)?;
        let (rows, d) = (rows as i32, d as i32);
        let mut l = func.builder();
        if let Some(src) = src {
            l.arg(src);
        }
        l.arg(out);
        l.arg(w);
        l.arg(b);
        l.arg(&rows);
        l.arg(&d);
        l.arg(&eps);
        unsafe { l.launch(cfg) }.w()?;
        Ok(())
    }

    /// The layer-norm kernels' instance (0-based: packs of 8 values a lane that hold a row, just
    /// enough of them) and launch shape for `rows` rows of `d` values: blocks of 8 warps, each warp
    /// taking `rows_a_warp` rows (kernels/encoder_ops.cu: 4 rows at d <= 256, 2 at d <= 512).
    pub(crate) fn norm_launch(rows: usize, d: usize) -> (usize, LaunchConfig) {
        let packs = d.div_ceil(256).clamp(1, 8);
        let rows_a_warp = match packs {
            1 => 4,
            2 => 2,
            _ => 1,
        };
        (packs - 1, LaunchConfig { grid_dim: (rows.div_ceil(8 * rows_a_warp) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
    }

    /// The feed-forward activation over `x`'s first `n` values in place, after the first product:
    /// ReLU rode in that product's epilogue, GELU is one pass.
    fn activation(dev: &CudaDevice, x: &mut CudaSlice<bf16>, n: usize, act: Act) -> Result<()> {
        match act {
            Act::Relu => Ok(()),
            Act::GeluErf => gelu(dev, x, n, true),
            Act::GeluTanh => gelu(dev, x, n, false),
        }
    }

    fn gelu(dev: &CudaDevice, x: &mut CudaSlice<bf16>, n: usize, erf: bool) -> Result<()> {
        let func = load_kernel!(dev, if erf { "gelu_erf_bf16" } else { "gelu_tanh_bf16" }, MODULE, PTX)?;
        let packs = (n / 8) as u64;
        let cfg = LaunchConfig { grid_dim: ((packs as usize).div_ceil(256).clamp(1, 132 * 16) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = func.builder();
        l.arg(x);
        l.arg(&packs);
        unsafe { l.launch(cfg) }.w()?;
        Ok(())
    }

    /// Rotate `qkv` (`tokens x 3 heads 64`, bf16) in place (`nn::rotary`'s rule): `offsets` the
    /// cells' token offsets on the device (`cells + 1`), `inv_freq` the `rot / 2` frequencies,
    /// `longest` the longest cell.
    #[allow(clippy::too_many_arguments)]
    fn rotary(dev: &CudaDevice, qkv: &mut CudaSlice<bf16>, offsets: &CudaView<u32>, inv_freq: &CudaView<f32>, heads: usize, rot: usize, longest: usize, cells: usize) -> Result<()> {
        if rot == 0 || cells == 0 || longest == 0 {
            return Ok(());
        }
        if rot % 2 != 0 || rot > 64 || inv_freq.len() < rot / 2 {
            candle_core::bail!("rotary: {rot} rotated values of 64-wide heads with {} frequencies", inv_freq.len());
        }
        let func = load_kernel!(dev, "rotary_qk_bf16", MODULE, PTX)?;
        let work = longest * heads * (rot / 2);
        let cfg = LaunchConfig { grid_dim: (work.div_ceil(256) as u32, cells as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (heads, rot) = (heads as i32, rot as i32);
        let mut b = func.builder();
        b.arg(qkv);
        b.arg(offsets);
        b.arg(inv_freq);
        b.arg(&heads);
        b.arg(&rot);
        // SAFETY: the arguments match the kernel's signature; qkv holds offsets' last token's rows.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    impl Fused<'_> {
        /// The pre-norm or parallel layers over the hidden state `h` (`t x d`, updated in place).
        #[allow(clippy::too_many_arguments)]
        fn pre_norm(&self, dev: &CudaDevice, lt: &crate::gpu::gemm::Lt, h: &mut CudaSlice<bf16>, offsets: &CudaView<u32>, cells: usize, t: usize, d: usize, f: usize) -> Result<()> {
            let s = self.stack;
            let eps = s.eps as f32;
            // the attention's width: d, or more where the heads are padded to 64
            let (da, scale) = (s.heads * 64, s.attention_scale() as f32);
            let parallel = s.order == Order::Parallel;
            let rotation = match &s.rotary {
                Some(r) if r.dims > 0 => Some((r.dims, crate::gpu::upload::upload_slice(&r.inv_freq, dev)?)),
                _ => None,
            };
            let mut normed = unsafe { dev.alloc::<bf16>(t * d)? };
            let mut qkv = unsafe { dev.alloc::<bf16>(t * 3 * da)? };
            let mut att = dev.alloc_zeros::<bf16>(t * da)?;
            let mut ff = unsafe { dev.alloc::<bf16>(t * f)? };
            for l in &s.layers {
                let lw = LayerWeights::new(l)?;
                layer_norm_to(dev, h, &mut normed, &lw.n1w.view()?, &lw.n1b.view()?, t, d, eps)?;
                lt.linear(&normed.as_view(), t, d, &lw.wq.view()?, &lw.bq.view()?, 3 * da, &mut qkv, false, false, None)?;
                if let Some((rot, inv_freq)) = &rotation {
                    rotary(dev, &mut qkv, offsets, &inv_freq.as_view(), s.heads, *rot, self.longest, cells)?;
                }
                if cells > 0 && self.longest > 0 {
                    crate::gpu::varlen_attention::launch_fused(dev, &qkv.as_view(), &mut att, offsets, s.heads, self.longest, cells, s.causal, scale)?;
                }
                if parallel {
                    // the feed-forward reads norm2 of the layer's input: before attention adds onto it
                    layer_norm_to(dev, h, &mut normed, &lw.n2w.view()?, &lw.n2b.view()?, t, d, eps)?;
                }
                // qkv is free once attention has read it: the residual products time their candidates there
                lt.linear(&att.as_view(), t, da, &lw.wo.view()?, &lw.bo.view()?, d, h, true, false, Some(&mut qkv))?;
                if !parallel {
                    layer_norm_to(dev, h, &mut normed, &lw.n2w.view()?, &lw.n2b.view()?, t, d, eps)?;
                }
                lt.linear(&normed.as_view(), t, d, &lw.w1.view()?, &lw.b1.view()?, f, &mut ff, false, s.act == Act::Relu, None)?;
                activation(dev, &mut ff, t * f, s.act)?;
                lt.linear(&ff.as_view(), t, f, &lw.w2.view()?, &lw.b2.view()?, d, h, true, false, Some(&mut qkv))?;
            }
            Ok(())
        }
    }

    impl candle_core::CustomOp2 for Fused<'_> {
        fn name(&self) -> &'static str {
            "fused-post-norm-encoder"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("fused-post-norm-encoder is for CUDA; the CPU runs TransformerStack::forward_unfused")
        }

        fn cuda_fwd(&self, xs: &CudaStorage, xl: &Layout, cs: &CudaStorage, cl: &Layout) -> Result<(CudaStorage, Shape)> {
            let dev = xs.device().clone();
            let stream = dev.cuda_stream();
            let lt = crate::gpu::gemm::Lt::for_stream(&stream)?;
            let (t, d) = xl.shape().dims2()?;
            let (Some((x0, x1)), Some((c0, c1))) = (xl.contiguous_offsets(), cl.contiguous_offsets()) else {
                candle_core::bail!("fused encoder: inputs must be contiguous");
            };
            let cells = (c1 - c0).saturating_sub(1);
            let offsets = cs.as_cuda_slice::<u32>()?.slice(c0..c1);
            let s = self.stack;
            let f = s.layers.first().map(|l| l.ff1.weight().dims2()).transpose()?.map(|x| x.0).unwrap_or(0);
            let eps = s.eps as f32;
            // the attention's width: d, or more where the heads are padded to 64
            let (da, scale) = (s.heads * 64, s.attention_scale() as f32);
            if s.order != Order::PostNorm {
                let mut h = unsafe { dev.alloc::<bf16>(t * d)? };
                dev.memcpy_dtod(&xs.as_cuda_slice::<bf16>()?.slice(x0..x1), &mut h)?;
                self.pre_norm(&dev, &lt, &mut h, &offsets, cells, t, d, f)?;
                return Ok((CudaStorage::wrap_cuda_slice(h, dev), Shape::from((t, d))));
            }
            // the hidden state, updated in place layer after layer, and the three work buffers.
            // h takes the input only when a step needs it there: the first layer's QKV product
            // reads the input itself, and its fused output projection + norm1 reads it as the
            // residual and writes h (no copy of the input; the two-kernel path copies first)
            let input = || -> Result<CudaView<'_, bf16>> { Ok(xs.as_cuda_slice::<bf16>()?.slice(x0..x1)) };
            let mut h = unsafe { dev.alloc::<bf16>(t * d)? };
            let h_ready = std::cell::Cell::new(false);
            let ready = |h: &mut CudaSlice<bf16>| -> Result<()> {
                if !h_ready.get() {
                    dev.memcpy_dtod(&input()?, h)?;
                    h_ready.set(true);
                }
                Ok(())
            };
            let (h_ready, input, ready) = (&h_ready, &input, &ready);
            let mut qkv = unsafe { dev.alloc::<bf16>(t * 3 * da)? };
            let mut att = dev.alloc_zeros::<bf16>(t * da)?;
            let mut ff = unsafe { dev.alloc::<bf16>(t * f)? };
            let mut times: Vec<(&'static str, f64)> = Vec::new();
            // 256-wide layers on Hopper: each residual product and the norm after it in one kernel
            let norm_fused = (gemm_layer_norm::applies(&dev, d, da)?, gemm_layer_norm::applies(&dev, d, f)?);
            for l in &s.layers {
                let lw = LayerWeights::new(l)?;
                // references, so that the steps' closures can take copies of them
                let (dev, lw) = (&dev, &lw);
                type Step<'s> = Box<dyn FnMut(&mut CudaSlice<bf16>, &mut CudaSlice<bf16>, &mut CudaSlice<bf16>, &mut CudaSlice<bf16>) -> Result<()> + 's>;
                let mut steps: Vec<(&'static str, Step)> = vec![
                    (
                        "qkv_gemm",
                        Box::new(|h, qkv, _, _| {
                            let src = if h_ready.get() { h.as_view() } else { input()? };
                            lt.linear(&src, t, d, &lw.wq.view()?, &lw.bq.view()?, 3 * da, qkv, false, false, None)
                        }),
                    ),
                    (
                        "attention",
                        Box::new(|_, qkv, att, _| {
                            if cells > 0 && self.longest > 0 {
                                crate::gpu::varlen_attention::launch_fused(dev, &qkv.as_view(), att, &offsets, s.heads, self.longest, cells, false, scale)?;
                            }
                            Ok(())
                        }),
                    ),
                ];
                // qkv is free once attention has read it: the residual products time their candidates there
                let out_proj = |h: &mut CudaSlice<bf16>, qkv: &mut CudaSlice<bf16>, att: &CudaSlice<bf16>| {
                    ready(h)?;
                    lt.linear(&att.as_view(), t, da, &lw.wo.view()?, &lw.bo.view()?, d, h, true, false, Some(qkv))
                };
                let norm1 = |h: &mut CudaSlice<bf16>| layer_norm(dev, h, &lw.n1w.view()?, &lw.n1b.view()?, t, d, eps);
                if norm_fused.0 {
                    steps.push((
                        "out_gemm_residual_norm",
                        Box::new(move |h, qkv, att, _| {
                            let residual = if h_ready.get() { None } else { Some(input()?) };
                            if gemm_layer_norm::launch(dev, &att.as_view(), &lw.wo.view()?, &lw.bo.view()?, &lw.n1w.view()?, &lw.n1b.view()?, h, residual.as_ref(), t, da, eps)? {
                                h_ready.set(true);
                            } else {
                                out_proj(h, qkv, att)?;
                                norm1(h)?;
                            }
                            Ok(())
                        }),
                    ));
                } else {
                    steps.push(("out_gemm_residual", Box::new(move |h, qkv, att, _| out_proj(h, qkv, att))));
                    steps.push(("layer_norm", Box::new(move |h, _, _, _| norm1(h))));
                }
                steps.push(("ffn1_gemm", Box::new(|h, _, _, ff| lt.linear(&h.as_view(), t, d, &lw.w1.view()?, &lw.b1.view()?, f, ff, false, s.act == Act::Relu, None))));
                steps.push((
                    "activation",
                    Box::new(|_, _, _, ff| activation(dev, ff, t * f, s.act)),
                ));
                let ffn2 = |h: &mut CudaSlice<bf16>, qkv: &mut CudaSlice<bf16>, ff: &CudaSlice<bf16>| lt.linear(&ff.as_view(), t, f, &lw.w2.view()?, &lw.b2.view()?, d, h, true, false, Some(qkv));
                let norm2 = |h: &mut CudaSlice<bf16>| layer_norm(dev, h, &lw.n2w.view()?, &lw.n2b.view()?, t, d, eps);
                if norm_fused.1 {
                    steps.push((
                        "ffn2_gemm_residual_norm",
                        Box::new(move |h, qkv, _, ff| {
                            if !gemm_layer_norm::launch(dev, &ff.as_view(), &lw.w2.view()?, &lw.b2.view()?, &lw.n2w.view()?, &lw.n2b.view()?, h, None, t, f, eps)? {
                                ffn2(h, qkv, ff)?;
                                norm2(h)?;
                            }
                            Ok(())
                        }),
                    ));
                } else {
                    steps.push(("ffn2_gemm_residual", Box::new(move |h, qkv, _, ff| ffn2(h, qkv, ff))));
                    steps.push(("layer_norm", Box::new(move |h, _, _, _| norm2(h))));
                }
                match self.profile {
                    None => {
                        for (_, step) in steps.iter_mut() {
                            step(&mut h, &mut qkv, &mut att, &mut ff)?;
                        }
                    }
                    Some((repeat, _)) => {
                        // each step alone, repeated on the same buffers (the residual steps
                        // accumulate into h, which changes values but not the work)
                        for (name, step) in steps.iter_mut() {
                            step(&mut h, &mut qkv, &mut att, &mut ff)?;
                            let mut runs = Vec::with_capacity(repeat);
                            for _ in 0..repeat {
                                stream.synchronize().w()?;
                                let start = std::time::Instant::now();
                                step(&mut h, &mut qkv, &mut att, &mut ff)?;
                                stream.synchronize().w()?;
                                runs.push(start.elapsed().as_secs_f64());
                            }
                            runs.sort_by(f64::total_cmp);
                            times.push((name, runs[runs.len() / 2]));
                        }
                        break;
                    }
                }
            }
            ready(&mut h)?; // (a stack of no layers)
            if let Some((_, out)) = self.profile {
                *out.lock().expect("not poisoned") = times;
            }
            Ok((CudaStorage::wrap_cuda_slice(h, dev), Shape::from((t, d))))
        }
    }
}
