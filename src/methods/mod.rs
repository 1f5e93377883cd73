//! Method implementations, one file per method. The registry (`methods/*.toml`) declares
//! them; a method whose `implemented = false` fails plainly when asked to run.

pub mod cellama;
pub mod harmony;
pub mod knn_transfer;
pub mod pca;
pub mod scgpt;
