//! Errors of the library, each with an optional hint that tells the user what to do next.
//!
//! The binary walks the chain and prints `error:`, `caused by:` and `hint:` lines
//! (see `main.rs`). User errors exit 1, internal errors 2.

use std::path::PathBuf;

/// Everything that can go wrong in library code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: no such file")]
    MissingFile { path: PathBuf },

    #[error("{path}: not an HDF5 file (an .h5ad file is HDF5; this one starts with {magic})")]
    NotHdf5 { path: PathBuf, magic: String },

    #[error("{path}: cannot be read as HDF5: {detail}")]
    CorruptFile { path: PathBuf, detail: String },

    #[error("{path}: the file is locked by another process ({detail})")]
    Locked { path: PathBuf, detail: String },

    #[error("{path}: {field}: {detail}")]
    BadField { path: PathBuf, field: String, detail: String, hint: Option<String> },

    #[error("{path}: X has {n_obs} rows but `obs` has {obs_len} cells")]
    ShapeObs { path: PathBuf, n_obs: usize, obs_len: usize },

    #[error("{path}: X has {n_vars} columns but `var` has {var_len} genes")]
    ShapeVar { path: PathBuf, n_vars: usize, var_len: usize },

    #[error("{path}: X holds a non-finite value ({value}) at cell {row} ({cell}), gene {col} ({gene})")]
    NonFinite { path: PathBuf, value: f32, row: usize, col: usize, cell: String, gene: String },

    #[error("{path}: {method} needs raw counts, but X holds {what} ({value}) at cell {row} ({cell}), gene {col} ({gene})")]
    NotRawCounts {
        path: PathBuf,
        method: String,
        what: &'static str,
        value: f32,
        row: usize,
        col: usize,
        cell: String,
        gene: String,
        hint: String,
    },

    #[error("{path}: counts check: {method} needs raw counts, but {field} {detail}")]
    CountsCheck { path: PathBuf, method: String, field: String, detail: String, hint: String },

    #[error("{path}: var names are not unique: {name:?} appears {count} times ({n_dup} duplicated names in all)")]
    DuplicateVarNames { path: PathBuf, name: String, count: usize, n_dup: usize },

    #[error("{path}: the data has no cells (X is 0 x {n_vars})")]
    ZeroCells { path: PathBuf, n_vars: usize },

    #[error("{path}: the data has no genes (X is {n_obs} x 0)")]
    ZeroGenes { path: PathBuf, n_obs: usize },

    #[error("unknown method `{name}`")]
    UnknownMethod { name: String, suggestion: Option<String>, known: Vec<String> },

    #[error("method `{name}` is registered but not implemented in scfoundry {version} yet")]
    NotImplemented { name: String, version: &'static str },

    #[error("invalid value for {option}: {detail}")]
    BadOption { option: String, detail: String, hint: Option<String> },

    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),

    #[error("{path}: {detail}")]
    Config { path: PathBuf, detail: String, hint: Option<String> },

    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    #[error("`{tool}` is not on PATH")]
    ToolMissing { tool: String, hint: String },

    #[error("{what} failed: {detail}")]
    Executor { what: String, detail: String, hint: Option<String> },

    #[error("{path}:{line}: {detail}")]
    Parse { path: PathBuf, line: usize, detail: String, hint: Option<String> },

    #[error("HDF5 error while {context}: {source}")]
    Hdf5 { context: String, source: hdf5::Error },

    #[error("weights for {method} are not in {dir}{}", missing_list(missing))]
    WeightsMissing { method: String, dir: PathBuf, missing: Vec<String> },

    #[error("{url}: HTTP {status}{}", if reason.is_empty() { String::new() } else { format!(" {reason}") })]
    HttpStatus { id: String, url: String, status: u16, reason: String },

    #[error("downloading {id} from {url} failed: {detail}")]
    Network { id: String, url: String, detail: String, hint: String },

    #[error("{id}: the downloaded file's sha256 is {found}, but weights.toml pins {expected}")]
    Checksum { id: String, url: String, expected: String, found: String, hint: String },

    #[error("{id}: {detail}")]
    Download { id: String, detail: String, hint: Option<String> },

    #[error("{path}: cannot be loaded: {detail}")]
    BadWeights { path: PathBuf, detail: String },

    /// A `--model-dir` (or a folder given to `weights import`) that lacks a file the method
    /// reads, or that is not a model folder at all.
    #[error("{dir}: {detail}")]
    ModelDir { dir: PathBuf, detail: String, hint: String },

    #[error("{id}: {detail}")]
    Import { id: String, detail: String, hint: String },

    /// A file brought in with `weights import` whose sha256 is not the pinned one.
    #[error("{id}: {path} has sha256 {found}, but {pinned_by} pins {expected}")]
    ImportChecksum { id: String, path: PathBuf, expected: String, found: String, pinned_by: String, hint: String },

    #[error("model error while {context}: {detail}")]
    Model { context: String, detail: String },

    #[error(
        "{query} has {present} of the {total} highly variable genes of the reference {reference} by var name ({:.1}%), fewer than the {:.0}% needed to project it",
        100.0 * *present as f64 / (*total).max(1) as f64,
        100.0 * min_fraction
    )]
    GeneOverlap { reference: PathBuf, query: PathBuf, present: usize, total: usize, min_fraction: f64, example: String },

    #[error("{archive}: unsafe archive member {member:?}: {detail}")]
    UnsafeArchive { archive: PathBuf, member: String, detail: String },
}

fn missing_list(missing: &[String]) -> String {
    match missing.len() {
        0 => String::new(),
        1..=3 => format!(" (missing: {})", missing.join(", ")),
        n => format!(" (missing: {}, and {} more)", missing[..3].join(", "), n - 3),
    }
}

impl Error {
    /// What the user can do about it, if we know.
    pub fn hint(&self) -> Option<String> {
        match self {
            Error::MissingFile { .. } => Some("check the path; relative paths are taken from the current folder".into()),
            Error::NotHdf5 { .. } => Some(
                "pass an AnnData .h5ad or a Cell Ranger .h5 file (docs/file-formats.md); a .loom, .mtx or .csv must be converted first, e.g. with scanpy: `sc.read_loom(f).write_h5ad('x.h5ad')`".into(),
            ),
            Error::CorruptFile { .. } => Some("the file may be truncated (an interrupted copy or download): copy it again and compare its size with the original".into()),
            Error::Locked { .. } => Some(
                "another program has the file open for writing: wait for it to finish; on file systems without locking (some NFS or Lustre mounts) set HDF5_USE_FILE_LOCKING=FALSE".into(),
            ),
            Error::BadField { hint, .. } => hint.clone(),
            Error::ShapeObs { .. } | Error::ShapeVar { .. } => {
                Some("the file is inconsistent; rewrite it with anndata (`adata = ad.read_h5ad(f); adata.write_h5ad(g)`) or check how it was made".into())
            }
            Error::NonFinite { .. } => Some("remove or fix cells with NaN or infinite values before embedding".into()),
            Error::NotRawCounts { hint, .. } => Some(hint.clone()),
            Error::CountsCheck { hint, .. } => Some(hint.clone()),
            Error::DuplicateVarNames { .. } => Some(
                "make gene names unique first, e.g. in Python `adata.var_names_make_unique()`, and write the file again".into(),
            ),
            Error::ZeroCells { .. } => Some("the file holds no cells: check the filter that produced it".into()),
            Error::ZeroGenes { .. } => Some("the file holds no genes: check the filter that produced it".into()),
            Error::UnknownMethod { suggestion, known, .. } => Some(match suggestion {
                Some(s) => format!("did you mean `{s}`? `scfoundry methods` lists all methods"),
                None => format!("known methods: {}", known.join(", ")),
            }),
            Error::NotImplemented { name, .. } => Some(format!(
                "`scfoundry methods show {name}` says what it needs; `scfoundry methods` marks the methods that run today (status `ready`)"
            )),
            Error::BadOption { hint, .. } => hint.clone(),
            Error::Config { hint, .. } => hint.clone(),
            Error::Gpu(e) => e.hint(),
            Error::Io { .. } => None,
            Error::ToolMissing { hint, .. } => Some(hint.clone()),
            Error::Executor { hint, .. } => hint.clone(),
            Error::Parse { hint, .. } => hint.clone(),
            Error::Hdf5 { .. } => None,
            Error::WeightsMissing { method, .. } => Some(format!("run `scfoundry weights pull {method}` (or pass --weights-dir to the folder that holds them)")),
            Error::HttpStatus { id, status, .. } => Some(match status {
                404 | 410 => format!("the file is gone from that address: check {id}'s url in weights.toml (or the manifest in $SCFOUNDRY_MANIFEST); nothing was deleted"),
                401 | 403 => format!("the server refused access: the file may need a login; download it by hand and put it where `scfoundry weights path {id}` says"),
                _ => "the server failed: try again later; nothing was deleted, and a partial download resumes".into(),
            }),
            Error::Network { hint, .. } => Some(hint.clone()),
            Error::Checksum { hint, .. } => Some(hint.clone()),
            Error::Download { hint, .. } => hint.clone(),
            Error::ModelDir { hint, .. } => Some(hint.clone()),
            Error::ImportChecksum { hint, .. } => Some(hint.clone()),
            Error::Import { hint, .. } => Some(hint.clone()),
            Error::BadWeights { .. } => Some("`scfoundry weights verify` checks the files against their pins; pull again with `scfoundry weights pull --force`".into()),
            Error::Model { .. } => None,
            Error::GeneOverlap { example, .. } => Some(format!(
                "both files must name genes the same way (symbols or Ensembl IDs, same case; the reference has e.g. `{example}`, which the query lacks): map the query's var_names first, or lower the bar with --min-gene-overlap"
            )),
            Error::UnsafeArchive { .. } => Some("the archive tries to write outside its folder; nothing was extracted. Report it to the archive's publisher".into()),
        }
    }

    /// Whether the error is the user's to fix (exit 1) rather than ours (exit 2).
    pub fn is_user_error(&self) -> bool {
        !matches!(self, Error::Hdf5 { .. } | Error::Model { .. } | Error::Gpu(crate::gpu::GpuError::Driver { .. }))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach a context string to HDF5 errors.
pub trait Hdf5Context<T> {
    fn h5ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Hdf5Context<T> for hdf5::Result<T> {
    fn h5ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Hdf5 { context: context(), source })
    }
}

/// Levenshtein distance, for "did you mean" suggestions.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut cur = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            cur[j] = (prev[j] + 1).min(cur[j - 1] + 1).min(prev[j - 1] + cost);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The closest candidate within a small edit distance.
pub fn suggest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<String> {
    candidates
        .into_iter()
        .map(|c| (edit_distance(&name.to_lowercase(), c), c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c.to_string())
}
