//! Method implementations, one file per method. The registry (`methods/*.toml`) declares
//! them; a method whose `implemented = false` fails plainly when asked to run.

pub mod c2s;
pub mod cellama;
pub mod geneformer;
pub mod harmony;
pub mod langcell;
pub mod pca;
pub mod sccello;
pub mod scgpt;
pub mod scgpt_integrated;
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
