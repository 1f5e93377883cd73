//! Command-line definitions only; the logic lives in `commands/`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use crate::gpu::cards::GpuList;

/// `--gpu`'s help, the same on every command that takes it.
pub const GPU_HELP: &str = "The GPUs this command's tasks may take: `0`, `0,1,2,3`, `0-3` or `all` \
(every card of the machine where the task runs). Each task locks one free card of the list by its UUID \
(lock files in $SCFOUNDRY_GPU_LOCKS, default /tmp/scfoundry-gpu-locks-<uid>) and sees only that card; when all are \
held it waits. A card listed twice (`0,0`) may be shared by two tasks. Numbers are nvidia-smi's.";


#[derive(Debug, Parser)]
#[command(
    name = "scfoundry",
    version,
    long_version = crate::gpu::build::LONG_VERSION.as_str(),
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
    /// Cell Ranger .h5 input with several genomes: read this genome's genes. Needed for a v2
    /// file with several genomes; a v3 file keeps every genome's genes without it, as
    /// scanpy.read_10x_h5 does. Task processes get it as $SCFOUNDRY_GENOME.
    #[arg(long, global = true, value_name = "NAME", env = "SCFOUNDRY_GENOME")]
    pub genome: Option<String>,
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
    /// Transfer labels from a labelled reference to a query: embed both with one method, then a
    /// weighted kNN vote; writes a copy of the query with the predictions and a report.
    Transfer(TransferArgs),
    /// Fine-tune a classification head (and optionally the last encoder layers) on labelled
    /// cells; saves the weights with provenance and curves, and predicts labels for new data.
    Finetune(FinetuneArgs),
    /// Integrate batches: harmony (corrects an embedding), seurat (anchors on expression) or
    /// scvi_denovo (a scVI model trained on the data).
    Integrate(IntegrateArgs),
    /// Score embeddings with the scIB metrics (scib-metrics 0.6.1 definitions) and rank them.
    Benchmark(BenchmarkArgs),
    /// Describe the geometry of an embedding: distances, intrinsic dimension, kNN preservation.
    Geometry(GeometryArgs),
    /// Write the workspace's nextflow.config: GPU pinning, maxForks, trace, weights and work folders.
    Config(ConfigArgs),
    /// Read a Nextflow trace.txt (ours or Nextflow's): peak memory and wall time per task, with a sizing hint.
    Trace(TraceArgs),
    /// The GPU setup: driver and CUDA versions, cuBLAS, each device with its free memory, and the
    /// allocator in effect. With --bench-alloc, allocation latency of each allocator mode.
    Doctor(DoctorArgs),
    /// Internal: run one task of a run folder.
    #[command(name = "__task", hide = true)]
    Task { spec: PathBuf },
    /// Internal, for tests of the GPU card locks: take a card of GPUS as a task does, hold it
    /// for MS milliseconds, then append `ordinal uuid slot start_ms end_ms CUDA_VISIBLE_DEVICES`
    /// to RECORD.
    #[command(name = "__hold-gpu", hide = true)]
    HoldGpu { gpus: GpuList, record: PathBuf, ms: u64 },
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
    /// Every manifest entry, present or missing: its size, licence, who pins its sha256
    /// (weights.toml, this folder's local pins, or nobody), whether `weights pull` can fetch it
    /// or it comes by hand from a share page (then `weights import`), and its state here.
    List {
        /// Only entries of this method.
        #[arg(long)]
        method: Option<String>,
        /// Hash present files that have no current verification stamp (can be slow for large files).
        #[arg(long)]
        hash: bool,
        /// Print the manifest as the Markdown table of docs/weights.md (no folder state).
        #[arg(long)]
        markdown: bool,
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
        /// Refuse entries that weights.toml pins no sha256 for and that this weights folder has
        /// not pinned locally (at their first download): nothing unverifiable is downloaded.
        #[arg(long)]
        require_pinned: bool,
        /// Download again and accept a changed file for entries without a sha256 in weights.toml,
        /// replacing the local pin recorded at their first download.
        #[arg(long)]
        repin: bool,
    },
    /// Bring in weights you downloaded yourself (from a share page `weights pull` cannot
    /// fetch, a Hugging Face snapshot or cache entry, an upstream release folder): each file is
    /// checked against the manifest's sha256 (or, where none is pinned, its sha256 is pinned
    /// locally, as a first download does) and placed in the weights folder, where later runs
    /// and other workspaces find it.
    #[command(after_help = "Examples:\n  scfoundry weights import scgpt ~/Downloads/scGPT_human            # the Drive folder: best_model.pt, vocab.json, args.json\n  scfoundry weights import cellama ~/.cache/huggingface/hub/models--sentence-transformers--all-MiniLM-L6-v2\n  scfoundry weights import scfoundation-models-ckpt ~/Downloads/models.ckpt")]
    Import {
        /// A method (its entries are looked for in a folder, or matched by file name) or an
        /// entry id (`scfoundry weights list` shows them).
        name: String,
        /// The downloaded file or folder; a Hugging Face cache entry (`models--ORG--NAME`)
        /// resolves through refs/main to its snapshot.
        path: PathBuf,
        /// Replace a different file already in the weights folder.
        #[arg(long)]
        force: bool,
        /// Accept a file that differs from this weights folder's local pin, replacing the pin
        /// (and the file).
        #[arg(long)]
        repin: bool,
        /// Place a symbolic link to the file instead of a copy (a hard link where possible):
        /// the file must then stay where it is.
        #[arg(long)]
        link: bool,
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
    #[arg(long, short, required_unless_present = "resume")]
    pub method: Option<String>,
    /// Input file; never modified unless --in-place. AnnData .h5ad from anndata 0.7 to 0.13
    /// (tested: 0.8, 0.10, 0.11, 0.12, 0.13 with pandas 3), legacy AnnData (< 0.7), or a Cell
    /// Ranger / Space Ranger .h5 matrix (v2, v3; --genome picks a genome); the last two are read
    /// through a converted copy. Or an AnnData Zarr store (the folder `adata.write_zarr` makes:
    /// zarr format 2 or 3, sharded or not), read in blocks of rows as an .h5ad is. Formats,
    /// encodings and departures: docs/file-formats.md.
    ///
    /// Several files (`--data a.h5ad b.h5ad ...`, or a .txt file listing one path a line) are
    /// embedded as one run, each file its own task (or shards), for methods that embed each cell
    /// on its own; each gets its own output, or with --embedding-only one table (--out).
    #[arg(long, short, value_name = "H5AD", num_args = 1.., required_unless_present = "resume")]
    pub data: Vec<PathBuf>,
    /// Output .h5ad (default: <input stem>.<method>.h5ad beside the input); a name ending in
    /// .zarr writes an AnnData Zarr store (the input's zarr format, or 2 from an .h5ad). With
    /// several --data files: the folder for their outputs, or with --embedding-only the table.
    #[arg(long, short, value_name = "H5AD", conflicts_with = "in_place")]
    pub out: Option<PathBuf>,
    /// Replace the input file atomically (a temporary file is renamed over it when complete).
    #[arg(long)]
    pub in_place: bool,
    /// Write only the obs index, the embedding and its provenance: no copy of X, obs, var or
    /// layers (an atlas's output stays small). Join it back in Python:
    /// `adata.obsm[key] = anndata.read_h5ad(out)[adata.obs_names].obsm[key]`.
    #[arg(long, conflicts_with = "in_place")]
    pub embedding_only: bool,
    /// Finish an interrupted or failed sharded run: re-run only the shards that did not finish
    /// or whose rows fail their checksum, then the merge. Everything else comes from the run
    /// folder (method, data, options); the other options are not allowed with it.
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["method", "data", "out", "in_place", "embedding_only", "layer"])]
    pub resume: Option<PathBuf>,
    /// Read the matrix from layers[NAME] instead of X.
    #[arg(long, value_name = "NAME")]
    pub layer: Option<String>,
    /// Skip the counts check. Methods that need raw counts (`input_values = "raw_counts"` in
    /// methods/<name>.toml) read a sample of rows first and stop on negative or log-transformed
    /// values (docs/reliability.md); use this when the matrix does hold counts.
    #[arg(long)]
    pub skip_counts_check: bool,
    /// Seed for every random step (recorded in the output's provenance).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub batch: BatchArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub knobs: KnobArgs,
    #[command(flatten)]
    pub integration: EmbedIntegrationArgs,
    #[command(flatten)]
    pub exec: ExecArgs,
}

/// What `embed` passes on to an integration method that embeds by fine-tuning on the batches
/// (`embeds_by_integrating` in its table entry): the run is `integrate`'s task, with --batch-key,
/// --model-dir, --device, --precision and --seed taken from embed's options of those names.
#[derive(Debug, Args, Default, Clone)]
#[command(next_help_heading = "Fine-tuning for integration (--method scgpt_integrated; also `scfoundry integrate`)")]
pub struct EmbedIntegrationArgs {
    /// scgpt_integrated: cells per training minibatch (default 64, upstream's); halved on CUDA
    /// out-of-memory.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub integration_batch_size: Option<u64>,
    /// scgpt_integrated: fine-tuning epochs (default 30, upstream's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: Option<u64>,
}

/// Where the tasks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecutorKind {
    /// Task processes on this machine (the built-in runner).
    #[default]
    Local,
    /// `nextflow run` on the repository's main.nf with a generated config.
    Nextflow,
    /// Direct submission with sbatch, one job per task; `embed --shards` makes the shards a job
    /// array with a dependent merge job.
    Slurm,
}

/// The executor, its Slurm options and the run folder: what every task command takes.
#[derive(Debug, Args, Default, Clone, serde::Serialize, serde::Deserialize)]
#[command(next_help_heading = "Executor")]
pub struct ExecutorArgs {
    /// local (default), nextflow or slurm.
    #[arg(long, value_enum, default_value_t = ExecutorKind::Local)]
    pub executor: ExecutorKind,
    /// Folder for run folders (default: the workspace's runs/, else runs/ beside the output).
    #[arg(long, value_name = "DIR")]
    pub runs_dir: Option<PathBuf>,
    #[command(flatten)]
    pub slurm: SlurmArgs,
    /// Arguments after `--` go to the executor unchanged: `nextflow run` (e.g. `-- -with-report r.html`)
    /// or `sbatch` (e.g. `-- --qos=short`).
    #[arg(last = true, value_name = "ARGS", help_heading = "Executor")]
    pub passthrough: Vec<String>,
}

/// How and where an embedding's tasks run: the executor, and the options only embed has
/// (shards, GPU pinning, concurrency).
#[derive(Debug, Args, Default)]
#[command(next_help_heading = "Executor")]
pub struct ExecArgs {
    #[command(flatten)]
    pub base: ExecutorArgs,
    /// Split the embedding over N row shards, each a task (with a fit over the whole data
    /// first for the methods that need one), then a merge that writes one output. On the CPU
    /// the output equals an unsharded run's byte for byte. `auto`: one shard per card given
    /// with --gpu, and at least one per 200,000 cells. With slurm the shards are a job array.
    #[arg(long, help_heading = "Executor", value_name = "N|auto", value_parser = parse_shards)]
    pub shards: Option<Shards>,
    #[arg(long, help = GPU_HELP, help_heading = "Executor", value_name = "LIST", env = "SCFOUNDRY_GPUS")]
    pub gpu: Option<GpuList>,
    /// At most N tasks at once: shards in the local runner (default: the number of --gpu
    /// entries, else 1), running elements of the Slurm job array (`--array=0-K%N`), Nextflow's
    /// maxForks for GPU processes.
    #[arg(long, help_heading = "Executor", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_forks: Option<u64>,
}

/// `--shards`: a count, or `auto` (chosen from the cells and the cards).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shards {
    Count(u64),
    Auto,
}

impl Shards {
    /// Cells per shard that `auto` aims at, at most.
    pub const AUTO_CELLS: usize = 200_000;

    /// The shard count for `n_obs` cells and `cards` GPU slots (0 without --gpu).
    pub fn count(self, n_obs: usize, cards: usize) -> u64 {
        match self {
            Shards::Count(n) => n,
            Shards::Auto => cards.max(n_obs.div_ceil(Self::AUTO_CELLS)).max(1) as u64,
        }
    }
}

fn parse_shards(s: &str) -> Result<Shards, String> {
    if s == "auto" {
        return Ok(Shards::Auto);
    }
    match s.parse::<u64>() {
        Ok(n) if n >= 1 => Ok(Shards::Count(n)),
        _ => Err(format!("`{s}` is not a shard count: give a whole number from 1, or `auto`")),
    }
}

/// sbatch options for `--executor slurm`.
#[derive(Debug, Args, Default, Clone, serde::Serialize, serde::Deserialize)]
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
    /// The GPUs of the node the pipeline's GPU tasks share: `0`, `0,1,2,3`, `0-3` or `all`. Each
    /// task locks one free card of the list (by UUID, in the lock folder, which containers get
    /// bind-mounted); containers see every listed card. `--gpu-id` is the same option.
    #[arg(long, visible_alias = "gpu-id", value_name = "LIST")]
    pub gpu: Option<GpuList>,
    /// At most N GPU tasks at once (maxForks of GPU processes; default: the number of --gpu
    /// entries, else 1).
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
    /// Cells per batch for embedding (default: the method's, see `scfoundry methods`; on a GPU
    /// its GPU default where it has one, see `scfoundry methods show`). The
    /// transformers that run cells longest first (geneformer, scgpt, sccello, langcell) batch by
    /// tokens: N of the longest cells make a batch, and a batch of shorter cells holds as many
    /// tokens, up to 8 x N cells.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: Option<u64>,
}

/// Where a model runs and how GPU memory is allocated (GPU methods; see `scfoundry doctor`).
#[derive(Debug, Args, Default, Clone)]
#[command(next_help_heading = "Device and GPU memory")]
pub struct DeviceArgs {
    /// cpu (default) or cuda. cuda fails with a clear error when it is not usable (no CUDA build,
    /// no driver, no such device); it never falls back to the CPU.
    #[arg(long, value_enum, value_name = "DEVICE")]
    pub device: Option<crate::gpu::DeviceKind>,
    /// GPU memory resource, after RMM's: async (default; stream-ordered from the driver's pool),
    /// pool (reserved up front), managed (unified memory, may exceed the card), managed-pool, cuda
    /// (plain cuMemAlloc). Also `[allocator] kind` in scfoundry.toml.
    #[arg(long, value_enum, value_name = "KIND")]
    pub allocator: Option<crate::gpu::AllocatorKind>,
    /// async/pool/managed-pool: memory a pool keeps after frees before returning it (e.g. 4GiB;
    /// async default: the card's memory, as RMM; pool: everything it reserved).
    #[arg(long, value_name = "SIZE")]
    pub release_threshold: Option<crate::gpu::ByteSize>,
    /// pool/managed-pool: reserved at start (pool default: half the free memory, as RMM).
    #[arg(long, value_name = "SIZE")]
    pub initial_pool_size: Option<crate::gpu::ByteSize>,
    /// pool/managed-pool: the pool never grows past this (pool default: the free memory;
    /// managed-pool needs it and it may exceed the card).
    #[arg(long, value_name = "SIZE")]
    pub maximum_pool_size: Option<crate::gpu::ByteSize>,
    /// Any allocator: allocations past this many live bytes fail as out-of-memory (then the batch
    /// is halved and retried).
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory_limit: Option<crate::gpu::ByteSize>,
    /// managed/managed-pool: keep at most this much prefetched on the card; the rest stays in
    /// host memory and migrates when touched (simulates a card of this size).
    #[arg(long, value_name = "SIZE")]
    pub device_budget: Option<crate::gpu::ByteSize>,
    /// Write each GPU allocation and free to this CSV file (time, action, pointer, bytes).
    #[arg(long, value_name = "CSV")]
    pub allocation_log: Option<PathBuf>,
}

impl DeviceArgs {
    /// Whether any GPU memory option was given (they apply with --device cuda only).
    pub fn memory_options_given(&self) -> bool {
        self.allocator.is_some()
            || self.release_threshold.is_some()
            || self.initial_pool_size.is_some()
            || self.maximum_pool_size.is_some()
            || self.gpu_memory_limit.is_some()
            || self.device_budget.is_some()
            || self.allocation_log.is_some()
    }
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Measure allocation + free latency of every allocator mode against raw driver calls.
    #[arg(long)]
    pub bench_alloc: bool,
    /// Allocation pairs per mode for --bench-alloc.
    #[arg(long, value_name = "N", default_value_t = 20_000, requires = "bench_alloc")]
    pub pairs: usize,
    /// Device for --bench-alloc.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gpu: usize,
    /// Seed of the benchmark's sizes (log-uniform 1 KiB to 64 MiB).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
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
    /// novae: drop spatial (Delaunay) edges longer than N microns (default 0: keep all).
    #[arg(long, value_name = "N")]
    pub radius: Option<u64>,
    /// cellama: obs columns appended to each cell sentence, comma-separated (e.g. `cell_type`).
    #[arg(long, value_name = "COL[,COL]")]
    pub obs_features: Option<String>,
    /// Every method that reads gene ids (`input_genes` in `scfoundry methods show NAME`): the var
    /// column holding them, symbols or Ensembl ids (version suffixes are stripped); `index` for
    /// var_names. Default: var_names or the var column that matches the model's vocabulary
    /// best. Symbols and Ensembl ids are mapped to what the model reads through offline human
    /// (GENCODE 44) and mouse (Ensembl) tables (docs/genes.md).
    #[arg(long, alias = "gene-col", value_name = "COL")]
    pub gene_column: Option<String>,
    /// Every method that reads gene ids: the share of the counts (0 to 1) that must fall on
    /// genes of the model's vocabulary, or the run stops naming the column and the figures
    /// [default: 0.5]; 0 runs whatever matched.
    #[arg(long, value_name = "FRACTION", value_parser = parse_fraction)]
    pub min_gene_match: Option<f64>,
    /// geneformer: layer to read, -1 (second-to-last, upstream's default) or 0 (last).
    #[arg(long, value_name = "N", allow_hyphen_values = true, value_parser = clap::value_parser!(i64).range(-1..=0))]
    pub emb_layer: Option<i64>,
    /// geneformer: `cell` (mean of the gene states, default) or `cls` (the <cls> state, V2 models).
    #[arg(long, value_name = "MODE", value_parser = ["cell", "cls"])]
    pub emb_mode: Option<String>,
    // The methods that honour it are those whose toml lists it: see `precision_help`.
    #[arg(long, value_name = "DTYPE", value_parser = ["auto", "f32", "bf16"], help = precision_help())]
    pub precision: Option<String>,
    /// Every method that loads weights: the model's folder as upstream releases it, instead of
    /// the weights folder: a Hugging Face snapshot (`models--ORG--NAME/snapshots/<rev>/`) or cache
    /// entry (`models--ORG--NAME`, read at its refs/main), scGPT's folder (best_model.pt,
    /// vocab.json, args.json), a sentence-transformers folder for cellama, UCE's model_files/, ...
    /// (`scfoundry methods show NAME` says what it must hold). scvi: required (the folder
    /// scvi-tools' `model.save(dir)` wrote).
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<std::path::PathBuf>,
    /// scvi: obs column of the query's batches, for a model whose encoder reads the batch
    /// (default: the model's own batch_key).
    /// cellplm: obs column grouping the cells embedded together (default `batch`).
    /// scgpt_integrated: obs column of the batches it fine-tunes on (required; as `integrate
    /// --batch-key`).
    #[arg(long, value_name = "COL")]
    pub batch_key: Option<String>,
}

/// `--precision`'s help, naming the methods whose `methods/<name>.toml` lists it.
fn precision_help() -> String {
    let reg = crate::registry::Registry::builtin();
    let names: Vec<&str> = reg.methods.values().filter(|m| m.implemented && m.knob("--precision").is_some()).map(|m| m.name.as_str()).collect();
    format!(
        "{}: `auto` (default): each method's GPU default on a GPU (bf16 where its measured distance to \
         f32 allows: `scfoundry methods show NAME`), f32 on the CPU; `f32`: exact parity, on every \
         device; `bf16`: weights and activations in bfloat16 (attention through the fused \
         variable-length kernel where the method has one; each method's `--precision` help in \
         `methods show NAME` says what runs), on a GPU only (the CPU always runs f32).",
        names.join(", ")
    )
}

impl KnobArgs {
    /// (flag, value) for every knob given on the command line.
    pub fn given(&self) -> Vec<(&'static str, u64)> {
        [("--n-comps", self.n_comps), ("--n-top-genes", self.n_top_genes), ("--max-len", self.max_len), ("--nlayers", self.nlayers), ("--top-genes", self.top_genes), ("--radius", self.radius)]
            .into_iter()
            .filter_map(|(f, v)| v.map(|v| (f, v)))
            .collect()
    }

    /// (flag, value) for every non-integer knob given on the command line (obs-features aside).
    pub fn given_values(&self) -> Vec<(&'static str, serde_json::Value)> {
        use serde_json::json;
        let dir = self.model_dir.as_ref().map(|d| json!(std::path::absolute(d).unwrap_or_else(|_| d.clone()).display().to_string()));
        [
            ("--emb-layer", self.emb_layer.map(|v| json!(v))),
            ("--emb-mode", self.emb_mode.as_ref().map(|v| json!(v))),
            ("--precision", self.precision.as_ref().map(|v| json!(v))),
            ("--model-dir", dir),
            ("--batch-key", self.batch_key.as_ref().map(|v| json!(v))),
        ]
        .into_iter()
        .filter_map(|(f, v)| v.map(|v| (f, v)))
        .collect()
    }
}

/// What integrate, benchmark and geometry say about executors in --help.
pub const ONE_TASK_HELP: &str = "This command runs as one task, in a run folder (trace.txt, report.json): a process on this \
machine (--executor local, the default), one sbatch job (--executor slurm) or the pipeline's process \
(--executor nextflow). It is not split into shards: --shards is embed's, --max-forks embed's and transfer's, --gpu embed's, transfer's, finetune's and benchmark's.";

/// `benchmark --help`'s closing text: the one-task note, then what --device cuda moves.
pub const BENCHMARK_HELP: &str = "With --device cuda the O(n²) passes run on the GPU: the exact 90-NN (which --neighbors auto \
then takes at any size), the label silhouette's distances and kBET's kNN in each label's diffusion map, with the \
CPU's definitions (sums of squared differences in f32, ties to the smaller index); the rest stays on the CPU's \
cores. results.json lists each pass, where it ran and its time. --executor local or slurm.

This command runs as one task, in a run folder (trace.txt, report.json): a process on this \
machine (--executor local, the default), one sbatch job (--executor slurm) or the pipeline's process \
(--executor nextflow).";

#[derive(Debug, Args)]
#[command(after_help = "Example:\n  scfoundry transfer --method pca --reference ref.h5ad --query query.h5ad --label-key cell_type")]
pub struct TransferArgs {
    /// The embedding method (pca or cellama; see `scfoundry methods`). pca is fitted on the
    /// reference and the query is projected with that fit; cellama embeds each cell on its own.
    /// Optional with --embedding (then it only names the method in the provenance).
    #[arg(long, short, required_unless_present = "embedding")]
    pub method: Option<String>,
    /// Labelled reference .h5ad (never modified).
    #[arg(long, short, value_name = "H5AD")]
    pub reference: PathBuf,
    /// Query .h5ad to label (never modified; the result is a copy).
    #[arg(long, value_name = "H5AD")]
    pub query: PathBuf,
    /// obs column of the reference with the labels. When the query has it too, the transfer is
    /// scored against it (accuracy, macro-F1, per-label table, confusion matrix).
    #[arg(long, value_name = "COLUMN")]
    pub label_key: String,
    /// Reference neighbours in the vote.
    #[arg(long, short, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    pub k: u64,
    /// Output .h5ad (default: <query stem>.transfer.h5ad beside the query).
    #[arg(long, short, value_name = "H5AD")]
    pub out: Option<PathBuf>,
    /// Folder for the report: transfer.json, and with query labels per_label.tsv, confusion.tsv,
    /// confusion.svg/png (default: the output's path without .h5ad).
    #[arg(long, value_name = "DIR")]
    pub report_dir: Option<PathBuf>,
    /// obs column for the predicted labels (default: <label-key>_pred); the confidence goes to
    /// <that>_confidence.
    #[arg(long, value_name = "COLUMN")]
    pub pred_key: Option<String>,
    /// Read the matrix from layers[NAME] instead of X, in both files.
    #[arg(long, value_name = "NAME")]
    pub layer: Option<String>,
    /// Skip the counts check. Methods that need raw counts (`input_values = "raw_counts"` in
    /// methods/<name>.toml) read a sample of rows first and stop on negative or log-transformed
    /// values (docs/reliability.md); use this when the matrix does hold counts.
    #[arg(long)]
    pub skip_counts_check: bool,
    /// Vote in obsm[KEY], which both files already hold (from `scfoundry embed` or another
    /// tool, e.g. X_scVI), instead of embedding them: no embedding task runs.
    #[arg(long, value_name = "KEY")]
    pub embedding: Option<String>,
    /// pca: share of the reference's highly variable genes the query must have (by var name);
    /// missing ones count as zero, with a warning.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.5, value_parser = parse_fraction)]
    pub min_gene_overlap: f64,
    /// Seed for every random step (recorded in the output's provenance).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub batch: BatchArgs,
    #[command(flatten)]
    pub knobs: KnobArgs,
    /// At most N tasks at once in the local runner (default 2: the reference and the query are
    /// embedded at once, or the number of --gpu entries; 1 runs them one after the other).
    /// Slurm runs the two jobs as it schedules them; Nextflow as its executor does.
    #[arg(long, help_heading = "Executor", value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_forks: Option<u64>,
    #[arg(long, help = GPU_HELP, help_heading = "Executor", value_name = "LIST", env = "SCFOUNDRY_GPUS")]
    pub gpu: Option<GpuList>,
    #[command(flatten)]
    pub exec: ExecutorArgs,
}

/// A finite number: NaN and infinities are refused when the command line is read.
fn parse_finite<T: std::str::FromStr + Into<f64> + Copy>(s: &str) -> Result<T, String> {
    let v: T = s.trim().parse().map_err(|_| format!("`{s}` is not a number"))?;
    if v.into().is_finite() {
        Ok(v)
    } else {
        Err(format!("`{s}` is not a finite number"))
    }
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not between 0 and 1"))
    }
}

#[derive(Debug, Args)]
#[command(after_help = ONE_TASK_HELP)]
pub struct IntegrateArgs {
    /// The integration method (see `scfoundry methods`; harmony and seurat run today).
    #[arg(long, short)]
    pub method: String,
    /// Input .h5ad or AnnData Zarr store: harmony corrects an embedding in it (e.g. the output of
    /// `embed --method pca`); seurat reads its expression matrix (X or --layer).
    #[arg(long, short, value_name = "H5AD")]
    pub data: PathBuf,
    /// harmony: obsm key of the embedding to correct.
    #[arg(long, default_value = "X_pca", value_name = "KEY")]
    pub embedding: String,
    /// obs column(s) holding the batch; comma-separated for several keys.
    #[arg(long, value_delimiter = ',', required = true, value_name = "COL")]
    pub batch_key: Vec<String>,
    /// Output .h5ad (default: <input stem>.<method>.h5ad beside the input); a name ending in
    /// .zarr writes an AnnData Zarr store.
    #[arg(long, short, value_name = "H5AD", conflicts_with = "in_place")]
    pub out: Option<PathBuf>,
    /// Replace the input file atomically.
    #[arg(long)]
    pub in_place: bool,
    /// Seed for the clustering start and update order (recorded in the output).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// harmony: diversity penalty theta (default 2; larger mixes batches more).
    #[arg(long, value_name = "X", value_parser = parse_finite::<f32>)]
    pub theta: Option<f32>,
    /// seurat, scvi_denovo: read the expression (scvi_denovo: raw counts) from layers[NAME]
    /// instead of X.
    #[arg(long, value_name = "NAME")]
    pub layer: Option<String>,
    /// The matrix does not hold raw counts: skip the counts check (methods that need raw
    /// counts read a sample of rows first and stop on negative or log-transformed values).
    /// seurat then takes the matrix as log-normalised values (log1p of counts per 10,000) and
    /// does not normalise it again; without it the matrix must hold raw counts, which seurat
    /// log-normalises as Seurat's NormalizeData does. Also spelled --log-normalized.
    #[arg(long, alias = "log-normalized")]
    pub skip_counts_check: bool,
    /// seurat: CCA dimensions for the anchors and PCA dimensions for the weights (default 30).
    #[arg(long, value_name = "N")]
    pub dims: Option<usize>,
    /// seurat: nearest anchors that weigh each cell's correction (default 100).
    #[arg(long, value_name = "N")]
    pub k_weight: Option<usize>,
    #[command(flatten)]
    pub scvi: ScviArgs,
    #[command(flatten)]
    pub scgpt: ScgptIntegrationArgs,
    #[command(flatten)]
    pub batch: BatchArgs,
    #[command(flatten)]
    pub exec: ExecutorArgs,
}

/// scgpt_integrated's options (defaults: methods/scgpt_integrated.toml, upstream's
/// finetune_integration.py; see docs/scgpt_integrated.md).
#[derive(Debug, Args, Default, Clone, serde::Serialize, serde::Deserialize)]
#[command(next_help_heading = "Fine-tuning scGPT for integration (--method scgpt_integrated)")]
pub struct ScgptIntegrationArgs {
    /// scgpt_integrated: cells per training minibatch (default 64, upstream's); halved on CUDA
    /// out-of-memory.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub integration_batch_size: Option<u64>,
    /// scgpt_integrated: fine-tuning epochs (default 30, upstream's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: Option<u64>,
    /// scgpt_integrated: where it trains, cpu (default) or cuda.
    #[arg(long, value_enum, value_name = "DEVICE")]
    pub device: Option<crate::gpu::DeviceKind>,
    /// scgpt_integrated: auto (default): bf16 on a GPU with compute capability 8.0 or newer
    /// (its GPU default, as upstream trains in fp16 autocast; `methods show scgpt_integrated`
    /// gives its measured distance to f32), f32 elsewhere; f32 everywhere for parity; with
    /// --device cuda also tf32 (f32 values, products on TF32 tensor cores: 10-bit mantissa
    /// inputs, f32 sums) or bf16 (mixed precision as torch.autocast: bf16 products, f32 norms,
    /// softmax, losses, weights and optimiser).
    #[arg(long, value_name = "DTYPE", value_parser = ["auto", "f32", "tf32", "bf16"])]
    pub precision: Option<String>,
    /// scgpt_integrated: start from this checkpoint folder (best_model.pt, vocab.json,
    /// args.json in upstream's format) instead of the weights folder's whole-human model.
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<PathBuf>,
}

/// scvi_denovo's options (scvi-tools' SCVI defaults; see docs/scvi_denovo.md).
#[derive(Debug, Args, Default, Clone, serde::Serialize, serde::Deserialize)]
#[command(next_help_heading = "Training a scVI model (--method scvi_denovo)")]
pub struct ScviArgs {
    /// scvi_denovo: train on this many highly variable genes (scanpy's seurat flavour on
    /// normalised counts; default 2000; 0 keeps every gene).
    #[arg(long, value_name = "N")]
    pub n_top_genes: Option<usize>,
    /// scvi_denovo: latent dimension, the embedding width (default 10).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub n_latent: Option<u64>,
    /// scvi_denovo: units per hidden layer (default 128).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub n_hidden: Option<u64>,
    /// scvi_denovo: hidden layers of the encoder and of the decoder (default 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub n_layers: Option<u64>,
    /// scvi_denovo: training epochs (default scvi-tools': min(round(20000 / cells * 400), 400)).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_epochs: Option<u64>,
    /// scvi_denovo: folder for elbo.tsv and the ELBO curve figure (default: the output's path
    /// without .h5ad).
    #[arg(long, value_name = "DIR")]
    pub report_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
#[command(after_help = BENCHMARK_HELP)]
pub struct BenchmarkArgs {
    /// Input .h5ad (or AnnData Zarr store) holding the embeddings in obsm (never modified).
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
    /// The 90-NN search: `auto` (exact up to 150,000 cells, approx beyond: the faster one for
    /// the size, recorded in results.json; with --device cuda exact at any size), `exact`
    /// (blocked brute force, O(n²)) or `approx` (NN-descent from a random-projection forest, as
    /// pynndescent; seeded by --seed).
    #[arg(long, value_enum, value_name = "SEARCH", default_value_t = NeighborsSearch::Auto)]
    pub neighbors: NeighborsSearch,
    /// Metrics to run, comma-separated: metric names (isolated_labels, kmeans, leiden,
    /// silhouette_label, clisi, bras, silhouette_batch, ilisi, kbet, graph_connectivity, pcr,
    /// sbee)
    /// or groups (default, bio, batch, all). Default: scib-metrics' Benchmarker defaults.
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub metrics: Vec<String>,
    /// obsm key of the unintegrated embedding that PCR comparison measures the batch effect
    /// against (scib-metrics' `pre_integrated_embedding_obsm_key`). Without it, a PCA of X; X
    /// is then read only for PCR, and if X is absent or unusable PCR is left out with a warning.
    #[arg(long, value_name = "KEY")]
    pub pre_integrated: Option<String>,
    /// Also run KMeans with N seeds (--seed, --seed+1, ..., --seed+N-1) and report the mean and
    /// spread of its NMI/ARI beside the one-run value that scib-metrics reports and the totals
    /// use; rankings the spread could flip are marked. 1: off.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub kmeans_seeds: u64,
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
    // --device cuda: the O(n²) passes on the GPU (the after-help says which)
    #[command(flatten)]
    pub device: DeviceArgs,
    #[arg(long, help = GPU_HELP, help_heading = "Executor", value_name = "LIST", env = "SCFOUNDRY_GPUS")]
    pub gpu: Option<GpuList>,
    #[command(flatten)]
    pub exec: ExecutorArgs,
}

/// How `benchmark` finds the 90 nearest neighbours of every cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NeighborsSearch {
    /// Exact blocked brute force (every pair of cells).
    #[default]
    Exact,
    /// NN-descent (approximate; seeded; recall@90 >= 0.95 in the tests).
    Approx,
    /// Exact up to 150,000 cells, NN-descent beyond.
    Auto,
}

impl NeighborsSearch {
    /// Cells up to which `auto` searches exactly. Measured (the 90-NN alone, 50 dims, 2 cores):
    /// 9.8 s exact / 10.4 s NN-descent at 100,000 cells, 20.0 / 18.8 s at 150,000, 33.3 /
    /// 29.9 s at 200,000; the exact search grows as n², NN-descent about as n.
    pub const AUTO_EXACT_MAX_CELLS: usize = 150_000;

    /// The search `auto` stands for at `n` cells (others are themselves).
    pub fn resolve(self, n: usize) -> NeighborsSearch {
        match self {
            NeighborsSearch::Auto if n <= Self::AUTO_EXACT_MAX_CELLS => NeighborsSearch::Exact,
            NeighborsSearch::Auto => NeighborsSearch::Approx,
            s => s,
        }
    }
}

#[derive(Debug, Args)]
#[command(after_help = ONE_TASK_HELP)]
pub struct GeometryArgs {
    /// Input .h5ad (or AnnData Zarr store) holding the embedding in obsm (never modified).
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
    #[command(flatten)]
    pub exec: ExecutorArgs,
}

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  scfoundry finetune --method pca --data train.h5ad --label-key cell_type --out ft/\n  \
scfoundry finetune --model ft/ --predict new.h5ad\n\n\
Training runs as one task, in a run folder (trace.txt, report.json): a process on this machine \
(--executor local, the default), one sbatch job (--executor slurm) or the pipeline's FINETUNE \
process (--executor nextflow).")]
pub struct FinetuneArgs {
    /// The method whose embedding the head sits on (one that cannot be fine-tuned is refused
    /// with the list of those that can). Not needed with --model.
    #[arg(long, short, required_unless_present = "model")]
    pub method: Option<String>,
    /// Labelled training .h5ad (never modified). Not needed with --model.
    #[arg(long, short, value_name = "H5AD", required_unless_present = "model")]
    pub data: Option<PathBuf>,
    /// obs column with the labels to learn (default with --model: the trained model's).
    #[arg(long, value_name = "COLUMN", required_unless_present = "model")]
    pub label_key: Option<String>,
    /// Output folder: model.safetensors, finetune.json, curves.tsv, curves.svg/png
    /// (default: <data stem>.<method>.finetune/ beside the data).
    #[arg(long, short, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Passes over the training cells at most.
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: u64,
    /// Train the last N encoder layers too (transformer methods; pca has none and warns).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub unfreeze_layers: u64,
    /// AdamW learning rate.
    #[arg(long, value_name = "X", default_value_t = 1e-3, value_parser = parse_finite::<f64>)]
    pub lr: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, value_name = "X", default_value_t = 0.01, value_parser = parse_finite::<f64>)]
    pub weight_decay: f64,
    /// Stop after N epochs without a lower validation loss (0: never stop early); the best
    /// epoch's weights are saved.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub patience: u64,
    /// Share of each label's cells held out for validation (stratified, seeded).
    #[arg(long, value_name = "FRACTION", default_value_t = 0.1, value_parser = parse_fraction)]
    pub val_fraction: f64,
    /// Cells per prediction batch (validation and --predict; default: the training batch x 4).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub predict_batch_size: Option<u64>,
    /// Predict labels for this .h5ad with the trained head: writes a copy with
    /// obs['<label-key>_pred'] and obs['<label-key>_pred_confidence'].
    #[arg(long, value_name = "H5AD")]
    pub predict: Option<PathBuf>,
    /// A folder from an earlier `finetune` run to predict with (needs --predict; no training).
    #[arg(long, value_name = "DIR", requires = "predict", conflicts_with_all = ["data", "method"])]
    pub model: Option<PathBuf>,
    /// Where --predict writes (default: <predict stem>.finetune.h5ad beside it).
    #[arg(long, value_name = "H5AD", requires = "predict")]
    pub predict_out: Option<PathBuf>,
    /// Skip the counts check. Methods that need raw counts (`input_values = "raw_counts"` in
    /// methods/<name>.toml) read a sample of rows first and stop on negative or log-transformed
    /// values (docs/reliability.md); use this when the matrix does hold counts.
    #[arg(long)]
    pub skip_counts_check: bool,
    /// Seed for the split, the head's initial weights and the shuffling (recorded).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub batch: BatchArgs,
    #[command(flatten)]
    pub knobs: KnobArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[arg(long, help = GPU_HELP, help_heading = "Executor", value_name = "LIST", env = "SCFOUNDRY_GPUS")]
    pub gpu: Option<GpuList>,
    #[command(flatten)]
    pub exec: ExecutorArgs,
}
