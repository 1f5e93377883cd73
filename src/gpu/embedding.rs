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
    gathered(Kernel::Bert, &[t.word, t.position, t.token_type], t.norm_weight, t.norm_bias, t.eps, ids, positions, d)
}

/// scGPT's transformer input in one kernel: row t is `LayerNorm(genes[ids[t]]) + values[which[t]]`
/// (the gene embedding through `encoder.enc_norm`, plus the value encoder's row for the token's
/// value), `tokens x d` bf16, the norm in f32. `genes` and `values` are bf16 tables on a GPU
/// (`applies`); every id and every `which` must be below their tables' rows (checked here).
pub fn norm_add(genes: &Tensor, norm_weight: &Tensor, norm_bias: &Tensor, eps: f64, values: &Tensor, ids: &[u32], which: &[u32]) -> Result<Tensor> {
    if !applies(genes) || values.dtype() != DType::BF16 {
        candle_core::bail!("norm-add kernel: takes bf16 tables on a GPU, rows a multiple of 8 wide");
    }
    let (rows, d) = genes.dims2()?;
    let (distinct, dv) = values.dims2()?;
    if dv != d || norm_weight.elem_count() != d || norm_bias.elem_count() != d {
        candle_core::bail!("norm-add kernel: the value table and the norm must be {d} wide like the gene table (got {dv}, {}, {})", norm_weight.elem_count(), norm_bias.elem_count());
    }
    if ids.len() != which.len() {
        candle_core::bail!("norm-add kernel: {} ids but {} values", ids.len(), which.len());
    }
    if let Some(&id) = ids.iter().find(|&&i| i as usize >= rows) {
        candle_core::bail!("gene id {id} is past the {rows}-row gene embedding");
    }
    if let Some(&w) = which.iter().find(|&&w| w as usize >= distinct) {
        candle_core::bail!("value row {w} is past the {distinct}-row value table");
    }
    gathered(Kernel::NormAdd, &[genes, values], norm_weight, norm_bias, eps, ids, which, d)
}

/// Which kernel of `kernels/encoder_ops.cu` a gathered layer norm takes.
#[derive(Clone, Copy)]
enum Kernel {
    /// embed_layer_norm_bf16: LayerNorm(word[i] + position[j] + token_type)
    Bert,
    /// norm_add_bf16: LayerNorm(a[i]) + b[j]
    NormAdd,
}

/// The two index lists in one upload (from page-locked memory: the host does not wait), then the
/// kernel over `tables` (its gathered operands in argument order).
#[allow(clippy::too_many_arguments)]
fn gathered(kernel: Kernel, tables: &[&Tensor], norm_weight: &Tensor, norm_bias: &Tensor, eps: f64, first: &[u32], second: &[u32], d: usize) -> Result<Tensor> {
    let idx: Vec<u32> = first.iter().chain(second).copied().collect();
    let idx = crate::gpu::upload::upload_u32(&idx, tables[0].device())?;
    #[cfg(feature = "cuda")]
    {
        idx.apply_op1_no_bwd(&cuda::GatherNorm { kernel, tables, norm_weight, norm_bias, eps, tokens: first.len(), d })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (idx, kernel, norm_weight, norm_bias, eps, d);
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

    use crate::gpu::fused_encoder::{norm_launch, MODULE, PTX};
    use crate::gpu::kernel_io::Held;

    pub struct GatherNorm<'a> {
        pub kernel: super::Kernel,
        pub tables: &'a [&'a candle_core::Tensor],
        pub norm_weight: &'a candle_core::Tensor,
        pub norm_bias: &'a candle_core::Tensor,
        pub eps: f64,
        pub tokens: usize,
        pub d: usize,
    }

    impl candle_core::CustomOp1 for GatherNorm<'_> {
        fn name(&self) -> &'static str {
            "gather-layer-norm"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("gather-layer-norm is for CUDA; the CPU runs candle's ops")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            const BERT: [&str; 8] = ["embed_layer_norm_bf16_p1", "embed_layer_norm_bf16_p2", "embed_layer_norm_bf16_p3", "embed_layer_norm_bf16_p4", "embed_layer_norm_bf16_p5", "embed_layer_norm_bf16_p6", "embed_layer_norm_bf16_p7", "embed_layer_norm_bf16_p8"];
            const NORM_ADD: [&str; 8] = ["norm_add_bf16_p1", "norm_add_bf16_p2", "norm_add_bf16_p3", "norm_add_bf16_p4", "norm_add_bf16_p5", "norm_add_bf16_p6", "norm_add_bf16_p7", "norm_add_bf16_p8"];
            let dev = s.device().clone();
            let (rows, d) = (self.tokens, self.d);
            let Some((i0, i1)) = l.contiguous_offsets() else { candle_core::bail!("gather-layer-norm: the indices must be contiguous") };
            let mut out = unsafe { dev.alloc::<bf16>(rows * d)? };
            if rows > 0 {
                let idx = s.as_cuda_slice::<u32>()?.slice(i0..i1);
                let held = self.tables.iter().map(|t| Held::new(t)).collect::<Result<Vec<_>>>()?;
                let (w, b) = (Held::new(self.norm_weight)?, Held::new(self.norm_bias)?);
                let (instance, cfg) = norm_launch(rows, d);
                let names = match self.kernel {
                    super::Kernel::Bert => &BERT,
                    super::Kernel::NormAdd => &NORM_ADD,
                };
                let func = load_kernel!(dev, names[instance], MODULE, PTX)?;
                let (rows32, d32, eps) = (rows as i32, d as i32, self.eps as f32);
                let views = held.iter().map(|h| h.view()).collect::<Result<Vec<_>>>()?;
                let (w, b) = (w.view()?, b.view()?);
                let mut l = func.builder();
                l.arg(&mut out);
                l.arg(&idx);
                for v in &views {
                    l.arg(v);
                }
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
