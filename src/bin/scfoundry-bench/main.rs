//! `scfoundry-bench`: throughput benchmarks of the encoders at full size with random weights,
//! apart from the product binary (release artifacts carry `scfoundry` alone). The commands keep
//! the names, flags and JSON output they had inside `scfoundry`; scripts/build-cuda.sh builds
//! this binary beside it, so GPU measurements stay reproducible.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use scfoundry::error::Error;

mod args;
mod cellplm;
mod encoder;
mod pairwise;
mod scimilarity;
mod scvi;
mod train_attention;

use args::{BenchCellplmArgs, BenchEncoderArgs, BenchPairwiseArgs, BenchScimilarityArgs, BenchScviArgs, BenchTrainAttentionArgs};

#[derive(Debug, Parser)]
#[command(name = "scfoundry-bench", version, about = "Throughput benchmarks of scfoundry's encoders (random weights)")]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Debug, Subcommand)]
enum Commands {
    /// Internal (benchmarks): cells per second of the transformer encoder at a full-size shape
    /// with random weights, over a file of real token lengths (bench/encoder_throughput.sh).
    #[command(name = "__bench-encoder")]
    BenchEncoder(BenchEncoderArgs),
    /// Throughput of the pretrained-scVI encoder at a full-size shape, random weights.
    #[command(name = "__bench-scvi")]
    BenchScvi(BenchScviArgs),
    /// Internal (benchmarks): cells per second of the SCimilarity encoder at full size with
    /// random weights on synthetic cells (bench/scimilarity_torch.py is the PyTorch side).
    #[command(name = "__bench-scimilarity")]
    BenchScimilarity(BenchScimilarityArgs),
    /// Internal (benchmarks): cells per second of CellPLM at its released size with random
    /// weights on synthetic cells (bench/cellplm_torch.py is the PyTorch side).
    #[command(name = "__bench-cellplm")]
    BenchCellplm(BenchCellplmArgs),
    /// Internal (benchmarks): the benchmark's dense passes (exact kNN, the label silhouette's
    /// distances) on the GPU against the CPU, agreement and seconds (bench/pairwise_gpu.sh).
    #[command(name = "__bench-pairwise")]
    BenchPairwise(BenchPairwiseArgs),
    /// Internal (benchmarks): training attention in bf16 on a GPU, the fused kernels against the
    /// materialised scores, each against f32, and their seconds at scgpt_integrated's shape.
    #[command(name = "__bench-train-attention")]
    BenchTrainAttention(BenchTrainAttentionArgs),
}

fn main() -> ExitCode {
    scfoundry::host_memory::keep_freed_memory();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 1 } else { 0 });
        }
    };
    let outcome = match &cli.command {
        Commands::BenchEncoder(a) => encoder::run(a),
        Commands::BenchScvi(a) => scvi::run(a),
        Commands::BenchScimilarity(a) => scimilarity::run(a),
        Commands::BenchCellplm(a) => cellplm::run(a),
        Commands::BenchPairwise(a) => pairwise::run(a),
        Commands::BenchTrainAttention(a) => train_attention::run(a),
    };
    match outcome {
        Ok(status) => ExitCode::from(status.code().clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            if let Some(hint) = err.chain().find_map(|c| c.downcast_ref::<Error>().and_then(Error::hint).or_else(|| c.downcast_ref::<scfoundry::gpu::GpuError>().and_then(scfoundry::gpu::GpuError::hint))) {
                eprintln!("hint: {hint}");
            }
            let internal = err.downcast_ref::<Error>().is_some_and(|e| !e.is_user_error());
            ExitCode::from(if internal { 2 } else { 1 })
        }
    }
}
