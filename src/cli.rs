//! Command-line definitions only; the logic lives in `commands/`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "scfoundry",
    version,
    about = "Run single-cell foundation models and classic baselines on .h5ad data",
    long_about = "Run single-cell foundation models (scFMs) and classic baselines on AnnData .h5ad files: \
embed cells, score embeddings, transfer labels and fine-tune, on a laptop, a GPU workstation or a cluster.\n\n\
Every result is a new .h5ad (your input is never modified unless you pass --in-place) plus a run folder \
with a Nextflow-format trace.txt and a cost report.",
    after_help = "Start with `scfoundry methods` to see what can run, then e.g.\n  scfoundry embed --method pca --data demo/pbmc68k_counts.h5ad"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Commands,
}

#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Use this workspace (a folder with scfoundry.toml) instead of $SCFOUNDRY_WORKSPACE or searching
    /// upwards from the current folder.
    #[arg(long, global = true, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// Weights folder, shared between workspaces. Default: $SCFOUNDRY_WEIGHTS_DIR, else the workspace's,
    /// else ~/.cache/scfoundry/weights-v1. With `init`, the workspace points at this folder.
    #[arg(long, global = true, value_name = "DIR")]
    pub weights_dir: Option<PathBuf>,
    /// No progress bars and no summary lines; warnings and errors are still printed.
    #[arg(long, short, global = true)]
    pub quiet: bool,
}

#[derive(Debug, Subcommand)]
pub enum Commands {
    /// Create a workspace: scfoundry.toml, runs/ and a weights folder (or a pointer to a shared one).
    Init(InitArgs),
    /// List the methods with their defaults, or show one method in full.
    Methods(MethodsArgs),
    /// The pinned weights manifest: list entries and check them in the weights folder.
    Weights(WeightsArgs),
    /// Embed cells with a method; writes a new .h5ad with obsm['X_<method>'] and a run folder.
    Embed(EmbedArgs),
    /// Transfer labels from a reference to a query (not in this version yet).
    Transfer(NotYetArgs),
    /// Fine-tune a model on labelled cells (not in this version yet).
    Finetune(NotYetArgs),
    /// Integrate batches in an embedding: harmony (seurat and scvi_denovo are planned).
    Integrate(IntegrateArgs),
    /// Score embeddings with the scIB metrics (scib-metrics 0.5.10 definitions) and rank them.
    Benchmark(BenchmarkArgs),
    /// Describe the geometry of an embedding: distances, intrinsic dimension, kNN preservation.
    Geometry(GeometryArgs),
    /// Write the workspace's nextflow.config: GPU pinning, maxForks, trace, weights and work folders.
    Config(ConfigArgs),
    /// Read a Nextflow trace.txt (ours or Nextflow's): peak memory and wall time per task, with a sizing hint.
    Trace(TraceArgs),
    /// Internal: run one task of a run folder.
    #[command(name = "__task", hide = true)]
    Task { spec: PathBuf },
}

#[derive(Debug, Args)]
pub struct InitArgs {
    /// The workspace folder to create (may exist; an existing scfoundry.toml is kept).
    /// Pass the global `--weights-dir DIR` to share one weights folder between workspaces.
    pub dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct MethodsArgs {
    #[command(subcommand)]
    pub command: Option<MethodsCommand>,
}

#[derive(Debug, Subcommand)]
pub enum MethodsCommand {
    /// The table of all methods (the default).
    List,
    /// One method: description, paper, defaults, honoured options, weights and advice.
    Show { name: String },
}

#[derive(Debug, Args)]
pub struct WeightsArgs {
    #[command(subcommand)]
    pub command: WeightsCommand,
}

#[derive(Debug, Subcommand)]
pub enum WeightsCommand {
    /// Each manifest entry, its size, and whether it is present and verified in the weights folder.
    List {
        /// Only entries of this method.
        #[arg(long)]
        method: Option<String>,
        /// Hash present files that have no current verification stamp (can be slow for large files).
        #[arg(long)]
        hash: bool,
    },
    /// Check sha256 of present files against the manifest (offline). Exit 1 if any is wrong.
    Verify {
        /// Methods or entry ids; all when none.
        names: Vec<String>,
    },
    /// Download entries into the weights folder: resumes partial downloads, verifies size and
    /// sha256, extracts archives safely. A failed download never deletes an existing file.
    Pull {
        /// Methods or entry ids (e.g. `geneformer`, `cellama-minilm-model`).
        #[arg(required = true)]
        names: Vec<String>,
        /// Download again even when a verified file is present (it is replaced only by a
        /// verified download).
        #[arg(long)]
        force: bool,
        /// Seconds to wait for a connection, or for more data, before giving up.
        #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
        timeout: u64,
    },
    /// Print where each entry's file lives in the weights folder (present or not).
    Path {
        /// Methods or entry ids.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Debug, Args)]
pub struct EmbedArgs {
    /// The method (see `scfoundry methods`).
    #[arg(long, short)]
    pub method: String,
    /// Input .h5ad file; never modified unless --in-place.
    #[arg(long, short, value_name = "H5AD")]
    pub data: PathBuf,
    /// Output .h5ad (default: <input stem>.<method>.h5ad beside the input).
    #[arg(long, short, value_name = "H5AD", conflicts_with = "in_place")]
    pub out: Option<PathBuf>,
    /// Replace the input file atomically (a temporary file is renamed over it when complete).
    #[arg(long)]
    pub in_place: bool,
    /// Read the matrix from layers[NAME] instead of X.
    #[arg(long, value_name = "NAME")]
    pub layer: Option<String>,
    /// Seed for every random step (recorded in the output's provenance).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub batch: BatchArgs,
    #[command(flatten)]
    pub knobs: KnobArgs,
    /// Folder for run folders (default: the workspace's runs/, else runs/ beside the output).
    #[arg(long, value_name = "DIR")]
    pub runs_dir: Option<PathBuf>,
    #[command(flatten)]
    pub exec: ExecArgs,
    /// Arguments after `--` go to the executor unchanged: `nextflow run` (e.g. `-- -with-report r.html`)
    /// or `sbatch` (e.g. `-- --qos=short`).
    #[arg(last = true, value_name = "ARGS", help_heading = "Executor")]
    pub passthrough: Vec<String>,
}

/// Where the tasks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum ExecutorKind {
    /// Task processes on this machine (the built-in runner).
    #[default]
    Local,
    /// `nextflow run` on the repository's main.nf with a generated config.
    Nextflow,
    /// Direct submission with sbatch; with --shards, a job array and a dependent merge job.
    Slurm,
}

/// How and where tasks run.
#[derive(Debug, Args, Default)]
#[command(next_help_heading = "Executor")]
pub struct ExecArgs {
    /// local (default), nextflow or slurm.
    #[arg(long, value_enum, default_value_t = ExecutorKind::Local)]
    pub executor: ExecutorKind,
    /// Split the projection over N row shards (fit once, project shards, merge); the result is
    /// identical to an unsharded run. With slurm the shards are a job array.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub shards: Option<u64>,
    /// Pin GPU tasks to this device (CUDA_VISIBLE_DEVICES); the local runner holds the workspace's
    /// lock for it, so one task uses a GPU at a time across all runs of the workspace.
    #[arg(long, value_name = "N")]
    pub gpu: Option<u32>,
    /// At most N tasks at once: shards in the local runner, running elements of the Slurm job
    /// array (`--array=0-K%N`), Nextflow's maxForks for GPU processes.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_forks: Option<u64>,
    #[command(flatten)]
    pub slurm: SlurmArgs,
}

/// sbatch options for `--executor slurm`.
#[derive(Debug, Args, Default, Clone)]
#[command(next_help_heading = "Slurm (--executor slurm)")]
pub struct SlurmArgs {
    /// Slurm partition (sbatch --partition).
    #[arg(long, value_name = "NAME")]
    pub partition: Option<String>,
    /// Slurm account to charge (sbatch --account).
    #[arg(long, value_name = "NAME")]
    pub account: Option<String>,
    /// Time limit per job, in sbatch's format (e.g. 30, 1:00:00, 1-00:00:00).
    #[arg(long, value_name = "TIME")]
    pub time: Option<String>,
    /// Memory per job, in sbatch's format (e.g. 8G).
    #[arg(long, value_name = "SIZE")]
    pub mem: Option<String>,
    /// GPUs per job (sbatch --gpus).
    #[arg(long, value_name = "N", conflicts_with = "gres")]
    pub gpus: Option<String>,
    /// Generic resources per job (sbatch --gres, e.g. gpu:a100:1).
    #[arg(long, value_name = "SPEC")]
    pub gres: Option<String>,
    /// CPUs per task (sbatch --cpus-per-task).
    #[arg(long, value_name = "N")]
    pub cpus: Option<u32>,
}

#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// Pin every GPU task to this device.
    #[arg(long, value_name = "N")]
    pub gpu_id: Option<u32>,
    /// At most N GPU tasks at once (maxForks of GPU processes; default 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_forks: Option<u64>,
    /// Container engine or scheduler the pinning is written for (repeatable); all when none.
    #[arg(long, value_enum, value_name = "PROFILE")]
    pub profile: Vec<ConfigProfile>,
    /// Where to write (default: nextflow.config in the workspace, else the current folder); `-` for stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// Profiles `scfoundry config` writes pinning for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, PartialOrd, Ord)]
pub enum ConfigProfile {
    Local,
    Docker,
    Apptainer,
    Singularity,
    Slurm,
}

#[derive(Debug, Args)]
pub struct TraceArgs {
    /// A trace.txt (tab-separated, Nextflow's formatted or raw units), or a run folder.
    pub file: PathBuf,
    /// GPU memory to size batches for (e.g. 80GB, 24GB, 40 GB).
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory: Option<String>,
}

/// Batch options. Each method declares which it honours; others are accepted with a warning.
#[derive(Debug, Args, Default)]
pub struct BatchArgs {
    /// Cells per batch for embedding (default: the method's, see `scfoundry methods`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: Option<u64>,
}

/// Method-specific options; a method that does not declare one ignores it with a warning.
#[derive(Debug, Args, Default)]
pub struct KnobArgs {
    /// pca: number of principal components (default 50).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub n_comps: Option<u64>,
    /// pca: number of highly variable genes (default 2000).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub n_top_genes: Option<u64>,
    /// scprint: maximum genes per cell (default 4000; memory roughly linear in it).
    /// scgpt: maximum tokens per cell with <cls> (default 1200); longer cells are sampled.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_len: Option<u64>,
    /// uce: transformer layers to run (default 33; changes the model computed).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub nlayers: Option<u64>,
    /// cellama, c2s: genes per cell sentence.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub top_genes: Option<u64>,
    /// cellama: obs columns appended to each cell sentence, comma-separated (e.g. `cell_type`).
    #[arg(long, value_name = "COL[,COL]")]
    pub obs_features: Option<String>,
    /// scgpt: var column holding the gene symbols matched to the vocabulary (default: var_names).
    #[arg(long, value_name = "COL")]
    pub gene_col: Option<String>,
}

impl KnobArgs {
    /// (flag, value) for every knob given on the command line.
    pub fn given(&self) -> Vec<(&'static str, u64)> {
        [("--n-comps", self.n_comps), ("--n-top-genes", self.n_top_genes), ("--max-len", self.max_len), ("--nlayers", self.nlayers), ("--top-genes", self.top_genes)]
            .into_iter()
            .filter_map(|(f, v)| v.map(|v| (f, v)))
            .collect()
    }
}

#[derive(Debug, Args)]
pub struct IntegrateArgs {
    /// The integration method (see `scfoundry methods`; harmony runs today).
    #[arg(long, short)]
    pub method: String,
    /// Input .h5ad holding the embedding to correct (e.g. the output of `embed --method pca`).
    #[arg(long, short, value_name = "H5AD")]
    pub data: PathBuf,
    /// obsm key of the embedding to correct.
    #[arg(long, default_value = "X_pca", value_name = "KEY")]
    pub embedding: String,
    /// obs column(s) holding the batch; comma-separated for several keys.
    #[arg(long, value_delimiter = ',', required = true, value_name = "COL")]
    pub batch_key: Vec<String>,
    /// Output .h5ad (default: <input stem>.<method>.h5ad beside the input).
    #[arg(long, short, value_name = "H5AD", conflicts_with = "in_place")]
    pub out: Option<PathBuf>,
    /// Replace the input file atomically.
    #[arg(long)]
    pub in_place: bool,
    /// Seed for the clustering start and update order (recorded in the output).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// harmony: diversity penalty theta (default 2; larger mixes batches more).
    #[arg(long, value_name = "X")]
    pub theta: Option<f32>,
    #[command(flatten)]
    pub batch: BatchArgs,
}

#[derive(Debug, Args)]
pub struct BenchmarkArgs {
    /// Input .h5ad holding the embeddings in obsm (never modified).
    #[arg(long, short, value_name = "H5AD")]
    pub data: PathBuf,
    /// obsm keys of the embeddings to score, comma-separated (e.g. X_pca,X_scvi).
    #[arg(long, short, value_name = "KEYS", value_delimiter = ',', required = true)]
    pub embedding: Vec<String>,
    /// obs column with the cell-type labels.
    #[arg(long, value_name = "COLUMN")]
    pub label_key: String,
    /// obs column with the batches.
    #[arg(long, value_name = "COLUMN")]
    pub batch_key: String,
    /// Score the batch-correction metrics on a seeded random subset of N cells (recorded in the
    /// results); the bio-conservation metrics always use every cell.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_max_cells: Option<u64>,
    /// Metrics to run, comma-separated: metric names (isolated_labels, kmeans, leiden,
    /// silhouette_label, clisi, bras, silhouette_batch, ilisi, kbet, graph_connectivity, pcr)
    /// or groups (default, bio, batch, all). Default: scib-metrics' Benchmarker defaults.
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub metrics: Vec<String>,
    /// Seed for KMeans, Leiden and the subsample (recorded).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output folder (default: <data stem>.benchmark/ beside the input).
    #[arg(long, short, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Also write lisi_per_cell.tsv (per-cell iLISI and cLISI at 90 neighbours).
    #[arg(long)]
    pub per_cell: bool,
    /// Min-max scale every metric across embeddings before aggregating (as
    /// `Benchmarker.get_results(min_max_scale=True)`).
    #[arg(long)]
    pub min_max_scale: bool,
}

#[derive(Debug, Args)]
pub struct GeometryArgs {
    /// Input .h5ad holding the embedding in obsm (never modified).
    #[arg(long, short, value_name = "H5AD")]
    pub data: PathBuf,
    /// obsm key of the embedding.
    #[arg(long, short, value_name = "KEY")]
    pub embedding: String,
    /// Work on a seeded random subset of at most N cells.
    #[arg(long, value_name = "N", default_value_t = 20000, value_parser = clap::value_parser!(u64).range(2..))]
    pub max_cells: u64,
    /// Seed for the subsample and the sampled pairs (recorded).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output folder (default: <data stem>.geometry/ beside the input).
    #[arg(long, short, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct NotYetArgs {
    /// Arguments for a later version.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    pub rest: Vec<String>,
}
