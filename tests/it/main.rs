//! scfoundry's integration tests: one binary, a module per area.
//!
//! Tests that need Python (anndata, scanpy) use the interpreter in $SCFOUNDRY_TEST_PYTHON,
//! which `.ci/run` provides from ci/requirements.txt. Under CI=true a missing interpreter is
//! a failure, never a silent skip.

mod anndata_compat;
mod bad_input;
mod benchmark;
mod file_formats;
mod cellama;
mod common;
mod docs;
mod finetune;
mod geneformer;
mod genes;
mod gpu;
mod gpu_cards;
mod harmony;
mod integrate;
mod http_server;
mod knn_transfer;
mod pca;
mod orchestration;
mod registry;
mod release;
mod runner;
mod sccello;
mod langcell;
mod lifecycle;
mod scgpt;
mod scgpt_integrated;
mod scvi_denovo;
mod scvi_pretrained;
mod seurat;
mod uce;
mod scbert;
mod novae;
mod scimilarity;
mod genept;
mod transfer;
mod weights_import;
mod weights_pull;
mod workspace;
mod c2s;
mod scfoundation;
mod scprint;
mod cellplm;
mod cellfm;
mod shards;
mod wheel;
mod zarr;
