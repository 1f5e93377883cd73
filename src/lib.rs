//! scfoundry: single-cell foundation models and baselines on .h5ad data.
//!
//! A newcomer's map: `cli.rs` (flags) -> `commands/<command>.rs` (one file per command) ->
//! `methods/<method>.rs` (one file per method; declared in the top-level `methods/*.toml`);
//! `anndata/` reads and writes .h5ad; `formats/` reads shared formats (pickles) as data; `runner/` runs tasks and writes trace.txt; `gpu/` is the
//! GPU runtime (device choice, allocators, out-of-memory back-off).

pub mod anndata;
pub mod cli;
pub mod commands;
pub mod download;
pub mod env;
pub mod error;
pub mod executor;
pub mod formats;
pub mod gpu;
pub mod linalg;
pub mod methods;
pub mod metrics;
pub mod nn;
pub mod nfconfig;
pub mod plots;
pub mod progress;
pub mod registry;
pub mod runner;
pub mod host_memory;
pub mod lifecycle;
pub mod paths;
pub mod settings;
pub mod tasks;
pub mod weights;
