//! Method implementations, one file per method. The registry (`methods/*.toml`) declares
//! them; a method whose `implemented = false` fails plainly when asked to run.

pub mod bert;
pub mod packed_bert;
pub mod post_norm;
pub mod c2s;
pub mod cellama;
pub mod cls_encoder;
pub mod finetune;
pub mod geneformer;
pub mod harmony;
pub mod knn_transfer;
pub mod langcell;
pub mod pca;
pub mod sccello;
pub mod scgpt;
pub mod scvi;
pub mod scvi_pretrained;
pub mod seurat;
pub mod uce;
pub mod scimilarity;
pub mod genept;
pub mod scbert;
pub mod scfoundation;
pub mod cellplm;
pub mod novae;
pub mod scprint;
pub mod cellfm;
pub mod random_init;

/// Methods with a CUDA path (`--device cuda`): their models are candle modules that run on the
/// GPU runtime (`gpu/`). The others run on the CPU and warn when asked for a GPU.
pub const CUDA_METHODS: &[&str] = &["cellama", "geneformer", "scgpt", "uce", "c2s", "scvi", "scimilarity", "sccello", "langcell", "scbert", "scfoundation", "cellplm", "scprint", "cellfm", "novae"];

pub fn runs_on_cuda(method: &str) -> bool {
    CUDA_METHODS.contains(&method)
}
