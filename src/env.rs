//! Every environment variable scfoundry reads, declared once (re-exported as
//! `settings::EnvVars`).

/// Every environment variable scfoundry reads, declared once.
pub struct EnvVars;
impl EnvVars {
    /// The workspace folder (instead of searching upwards from the current folder).
    pub const WORKSPACE: &'static str = "SCFOUNDRY_WORKSPACE";
    /// The weights folder, shared between workspaces.
    pub const WEIGHTS_DIR: &'static str = "SCFOUNDRY_WEIGHTS_DIR";
    /// Set to any value to turn progress bars off (as `--quiet` does for bars).
    pub const NO_PROGRESS: &'static str = "SCFOUNDRY_NO_PROGRESS";
    /// A weights manifest file used instead of the compiled-in weights.toml: for tests (a
    /// loopback server) and for mirrors (the same entries with other urls).
    pub const MANIFEST: &'static str = "SCFOUNDRY_MANIFEST";
    /// The folder with scfoundry's Nextflow pipeline (main.nf), for `--executor nextflow`.
    pub const PIPELINE: &'static str = "SCFOUNDRY_PIPELINE";
    /// The genome to read from a Cell Ranger matrix with several (set by `--genome`, and passed
    /// on to task processes).
    pub const GENOME: &'static str = "SCFOUNDRY_GENOME";
    /// Where converted copies of legacy AnnData and Cell Ranger files are kept (default
    /// `~/.cache/scfoundry/converted-v1`).
    pub const CONVERTED_DIR: &'static str = "SCFOUNDRY_CONVERTED_DIR";
    /// Fault injection for tests of failure handling: the project step of this shard exits 1.
    pub const FAIL_SHARD: &'static str = "SCFOUNDRY_FAIL_SHARD";
    /// Fault injection for tests of resuming: the project step of this shard kills itself
    /// (SIGKILL, as a scheduler does) after writing its first block of rows.
    pub const KILL_SHARD: &'static str = "SCFOUNDRY_KILL_SHARD";
    /// Rows of the blocks embeddings read X in (default: the method's, about a million stored
    /// values a block; rounded up to the method's batch). Shards are whole blocks, so smaller
    /// blocks let a small file be split; sharded and unsharded runs must use the same value.
    pub const BLOCK_ROWS: &'static str = "SCFOUNDRY_BLOCK_ROWS";
    /// Blocks of rows an `embed` task of a transformer reads and tokenises ahead of the block on
    /// the device (default 2; 0: each block read, tokenised, run and written in turn). The
    /// tokenising threads follow `RAYON_NUM_THREADS`, else the cores less one.
    pub const BLOCKS_AHEAD: &'static str = "SCFOUNDRY_BLOCKS_AHEAD";
    /// Set by the local runner on a shard's task process: the file the task counts its cells
    /// into, for the run's one progress bar (`progress::ShardBar`).
    pub const PROGRESS_FILE: &'static str = "SCFOUNDRY_PROGRESS_FILE";
    /// Set by the local runner on the task processes it starts, whose stdin is then a pipe from
    /// the runner: when it closes (the runner died), the task removes its unfinished output and
    /// exits (see `lifecycle`).
    pub const PARENT_PIPE: &'static str = "SCFOUNDRY_PARENT_PIPE";
    /// A PEM file of CA certificates `weights pull` trusts besides its bundled and the system's
    /// roots (as curl and pip; behind a TLS-inspecting proxy, the proxy's CA).
    pub const SSL_CERT_FILE: &'static str = "SSL_CERT_FILE";
    /// Folders (`:`-separated) of PEM files of CA certificates, trusted as SSL_CERT_FILE.
    pub const SSL_CERT_DIR: &'static str = "SSL_CERT_DIR";
    /// The proxy for https urls (`http://host:port`), chosen again on every redirect hop;
    /// the lowercase form wins, as in curl.
    pub const HTTPS_PROXY: &'static str = "HTTPS_PROXY";
    pub const HTTPS_PROXY_LOWER: &'static str = "https_proxy";
    /// The proxy for http urls.
    pub const HTTP_PROXY: &'static str = "HTTP_PROXY";
    pub const HTTP_PROXY_LOWER: &'static str = "http_proxy";
    /// The proxy for either scheme when the scheme's own variable is not set.
    pub const ALL_PROXY: &'static str = "ALL_PROXY";
    pub const ALL_PROXY_LOWER: &'static str = "all_proxy";
    /// Hosts reached without a proxy: comma-separated names (with their subdomains), IPs,
    /// networks (`10.0.0.0/8`), each with an optional `:port`, or `*`.
    pub const NO_PROXY: &'static str = "NO_PROXY";
    pub const NO_PROXY_LOWER: &'static str = "no_proxy";
    /// A TrueType font for the figures' PNGs when DejaVu Sans is not in the usual folders.
    pub const FONT: &'static str = "SCFOUNDRY_FONT";
    /// Set to any value to print the seconds of each phase of PCA and of the linear algebra.
    pub const PROFILE: &'static str = "SCFOUNDRY_PROFILE";
    /// `portable`: the portable attention kernel even on a Hopper GPU (the path other GPUs take).
    pub const ATTENTION: &'static str = "SCFOUNDRY_ATTENTION";
    /// `materialized`: training attention in bf16 on a GPU through the (l x l) score tensor
    /// (`nn::recompute_attention`) instead of the fused kernels (`nn::flash_attention`).
    pub const TRAIN_ATTENTION: &'static str = "SCFOUNDRY_TRAIN_ATTENTION";
    /// `0`: the matrix product and the layer norm as two kernels instead of the fused Hopper one.
    pub const FUSED_NORM: &'static str = "SCFOUNDRY_FUSED_NORM";
    /// The GPUs a task may take, as `--gpu` takes them (`0,1,2,3`, `0-3`, `all`): read by
    /// embed, transfer, finetune and benchmark when --gpu is not given (the generated Nextflow config sets
    /// it for the pipeline's processes).
    pub const GPUS: &'static str = "SCFOUNDRY_GPUS";
    /// The node-local folder of the GPU card locks (default `/tmp/scfoundry-gpu-locks-<uid>`);
    /// every task of a node that shares cards must see the same folder (bind it into containers).
    pub const GPU_LOCKS: &'static str = "SCFOUNDRY_GPU_LOCKS";
    /// Test hook: the node's GPUs as `ORDINAL:UUID,...` (e.g. `0:GPU-aaaa,1:GPU-bbbb`) instead
    /// of asking the driver, so that tests of the card locks run without a GPU.
    pub const FAKE_GPUS: &'static str = "SCFOUNDRY_FAKE_GPUS";
}
