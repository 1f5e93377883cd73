//! BERT's input embedding in one kernel for packed cells: row t is
//! `LayerNorm(word[ids[t]] + position[positions[t]] + token_type)` (Hugging Face's
//! `BertEmbeddings` with token type 0), in bf16 on a GPU (`kernels/encoder_ops.cu`
//! `embed_layer_norm_bf16_*`, the layer-norm kernel summing the three rows as it loads them, in
//! f32). candle's ops take five kernels for it (two gathers, two adds, one with a broadcast, and a
//! layer norm); on Geneformer V1's batches they took longer than a whole encoder layer (an Nsight
//! Compute pass, BENCHMARKS.md). `PackedBert::embed` uses it when `applies` says so and keeps
//! candle's ops elsewhere (the CPU, f32).

use candle_core::{DType, Result, Tensor};

/// Whether [`embed_norm`] takes these tables: a CUDA build, `word` (`vocab x d`) in bf16 on a GPU,
/// d a multiple of 8 (16-byte rows) and at most 2,048 (the layer-norm kernel's rows).
pub fn applies(word: &Tensor) -> bool {
    let Ok((_, d)) = word.dims2() else { return false };
    cfg!(feature = "cuda") && word.device().is_cuda() && word.dtype() == DType::BF16 && d % 8 == 0 && d > 0 && d <= 2048
}

/// The tables and the norm of one embedding layer (each `d` wide; `token_type` is one row).
pub struct Tables<'a> {
    pub word: &'a Tensor,
    pub position: &'a Tensor,
    pub token_type: &'a Tensor,
    pub norm_weight: &'a Tensor,
    pub norm_bias: &'a Tensor,
    pub eps: f64,
}

/// `tokens x d` bf16: the normalised sum of each token's word row, its position row and the
/// token-type row. Every id must be below the word table's rows and every position below the
/// position table's (checked here: the kernel reads rows by index).
pub fn embed_norm(t: &Tables, ids: &[u32], positions: &[u32]) -> Result<Tensor> {
    if !applies(t.word) {
        candle_core::bail!("embedding kernel: takes a bf16 table on a GPU, rows a multiple of 8 wide (PackedBert::embed runs candle's ops elsewhere)");
    }
    let (vocab, d) = t.word.dims2()?;
    let (max_pos, dp) = t.position.dims2()?;
    let shapes = [t.token_type.elem_count(), t.norm_weight.elem_count(), t.norm_bias.elem_count()];
    if dp != d || shapes.iter().any(|&n| n != d) {
        candle_core::bail!("embedding kernel: the position table, token-type row and norm must be {d} wide like the word table (got {dp}, {shapes:?})");
    }
    if ids.len() != positions.len() {
        candle_core::bail!("embedding kernel: {} ids but {} positions", ids.len(), positions.len());
    }
    if let Some(&id) = ids.iter().find(|&&i| i as usize >= vocab) {
        candle_core::bail!("token id {id} is past the {vocab}-row word embedding (a token dictionary that does not belong to this model?)");
    }
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= max_pos) {
        candle_core::bail!("position {p} is past the model's {max_pos} positions");
    }
    // ids then positions in one upload (from page-locked memory: the host does not wait)
    let idx: Vec<u32> = ids.iter().chain(positions).copied().collect();
    let idx = crate::gpu::upload::upload_u32(&idx, t.word.device())?;
    #[cfg(feature = "cuda")]
    {
        idx.apply_op1_no_bwd(&cuda::EmbedNorm { t, tokens: ids.len(), d })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (idx, d);
        unreachable!("applies() is false without the cuda feature")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CpuStorage, CudaStorage, Layout, Result, Shape};
    use half::bf16;

    use crate::gpu::fused_encoder::{norm_launch, Held, MODULE, PTX};

    pub struct EmbedNorm<'a, 'b> {
        pub t: &'a super::Tables<'b>,
        pub tokens: usize,
        pub d: usize,
    }

    impl candle_core::CustomOp1 for EmbedNorm<'_, '_> {
        fn name(&self) -> &'static str {
            "embed-layer-norm"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("embed-layer-norm is for CUDA; the CPU runs PackedBert's candle ops")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            const NAMES: [&str; 8] = ["embed_layer_norm_bf16_p1", "embed_layer_norm_bf16_p2", "embed_layer_norm_bf16_p3", "embed_layer_norm_bf16_p4", "embed_layer_norm_bf16_p5", "embed_layer_norm_bf16_p6", "embed_layer_norm_bf16_p7", "embed_layer_norm_bf16_p8"];
            let dev = s.device().clone();
            let (rows, d) = (self.tokens, self.d);
            let Some((i0, i1)) = l.contiguous_offsets() else { candle_core::bail!("embed-layer-norm: the indices must be contiguous") };
            let mut out = unsafe { dev.alloc::<bf16>(rows * d)? };
            if rows > 0 {
                let idx = s.as_cuda_slice::<u32>()?.slice(i0..i1);
                let (word, position, token_type) = (Held::new(self.t.word)?, Held::new(self.t.position)?, Held::new(self.t.token_type)?);
                let (w, b) = (Held::new(self.t.norm_weight)?, Held::new(self.t.norm_bias)?);
                let (instance, cfg) = norm_launch(rows, d);
                let func = dev.get_or_load_custom_func(NAMES[instance], MODULE, PTX)?;
                let (rows32, d32, eps) = (rows as i32, d as i32, self.t.eps as f32);
                let (word, position, token_type, w, b) = (word.view()?, position.view()?, token_type.view()?, w.view()?, b.view()?);
                let mut l = func.builder();
                l.arg(&mut out);
                l.arg(&idx);
                l.arg(&word);
                l.arg(&position);
                l.arg(&token_type);
                l.arg(&w);
                l.arg(&b);
                l.arg(&rows32);
                l.arg(&d32);
                l.arg(&eps);
                unsafe { l.launch(cfg) }.w()?;
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((rows, d))))
        }
    }
}
