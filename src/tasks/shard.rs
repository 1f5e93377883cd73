//! Sharded embeddings, shared by every method that embeds cells one by one.
//!
//! A task embeds its rows ([`TaskRows`]): all of them, or one shard's. Rows go through the
//! model in blocks of a fixed number of rows laid over the whole file, the same grid for every
//! task of a run, and shards start and end on that grid: so the cells of a batch, and the
//! padding and sums they share, are the same whether the run is sharded or not, and on the CPU
//! the merged output equals the unsharded one byte for byte.
//!
//! A method whose cells see each other within a forward pass (CellPLM) is cut by those passes
//! instead ([`GroupOrder`]): the passes laid one after another, a shard being whole passes;
//! its rows are then positions in that order, not rows of the file, and the merge puts each
//! row back at its row of the file.
//!
//! The embedding goes to [`EmbeddingOut`]: the output file for a whole run, a raw f32 file in
//! the run's work folder (plus a small JSON record with the shard's parameters, notes and the
//! file's sha256) for a shard. [`merge`] writes the output from the shard files; a resumed run
//! keeps the shards whose record and checksum hold ([`shard_done`]).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use hdf5::Dataset;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::anndata::write::{write_rows, PendingOutput};
use crate::anndata::{AnnData, Matrix};
use crate::error::{Error, Result};
use crate::runner::{Step, TaskResult, TaskSpec};
use crate::tasks::runtime::commit_embedding;

/// Rows of a block for about `target_nnz` stored values a block, a multiple of `align` (a
/// method's batch, or the group it sorts cells in), from the file's mean stored values per
/// row: the same number for every task that reads the same file with the same parameters.
/// `$SCFOUNDRY_BLOCK_ROWS` sets the rows instead (still a multiple of `align`).
pub fn block_rows(x: &Matrix, target_nnz: u64, align: usize) -> usize {
    let align = align.max(1);
    let mean = x.nnz_estimate().div_ceil(x.n_rows.max(1) as u64).max(1);
    let rows = match std::env::var(crate::env::EnvVars::BLOCK_ROWS).ok().and_then(|v| v.parse::<usize>().ok()) {
        Some(r) => r.max(1),
        None => (target_nnz / mean).clamp(1, 65_536) as usize,
    };
    rows.div_ceil(align) * align
}

/// The rows one task embeds and the grid of blocks it reads them in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRows {
    pub start: usize,
    pub end: usize,
    /// Rows per block of the grid laid over the whole file.
    pub block: usize,
    /// For a method cut by groups ([`GroupOrder`]): `start..end` are positions in the order,
    /// and these are the task's rows of the file, in that order.
    pub groups: Option<GroupRows>,
}

/// The rows of a task of a method cut by groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRows {
    /// The rows of the file at positions `start..end` of the order.
    pub rows: Vec<usize>,
    /// The order's sha256 ([`GroupOrder::sha256`]): the shards and the merge check they cut
    /// the same order.
    pub order_sha256: String,
}

impl TaskRows {
    /// The rows of `spec`'s step among the file's `n_obs`: all of them, or a shard's, which
    /// must start on the grid of `block` rows (the planner aligns shards to it).
    pub fn new(spec: &TaskSpec, n_obs: usize, block: usize) -> Result<TaskRows> {
        let block = block.max(1);
        let (start, end) = match &spec.step {
            Step::Project { start, end, .. } => (*start, *end),
            _ => (0, n_obs),
        };
        if end > n_obs || start > end || (start % block != 0) || (end != n_obs && end % block != 0) {
            return Err(Error::BadOption {
                option: "task spec".into(),
                detail: format!("the shard's rows {start}..{end} are not whole blocks of {block} rows of the {n_obs} cells"),
                hint: Some("the run was planned for other data or other parameters: start the run again".into()),
            });
        }
        Ok(TaskRows { start, end, block, groups: None })
    }

    /// The rows of `spec`'s step for a method cut by the groups of `order`: all of them, or a
    /// shard's whole groups (positions `start..end` of the order, on group boundaries).
    pub fn of_groups(spec: &TaskSpec, order: &GroupOrder) -> Result<TaskRows> {
        let n = order.rows.len();
        let (start, end) = match &spec.step {
            Step::Project { start, end, .. } => (*start, *end),
            _ => (0, n),
        };
        TaskRows::group_range(start, end, order)
    }

    /// Positions `start..end` of `order`, which must be whole groups.
    pub fn group_range(start: usize, end: usize, order: &GroupOrder) -> Result<TaskRows> {
        let n = order.rows.len();
        let on_bound = |p: usize| order.bounds.binary_search(&p).is_ok();
        if end > n || start > end || !on_bound(start) || !on_bound(end) {
            return Err(Error::BadOption {
                option: "task spec".into(),
                detail: format!("the shard's cells {start}..{end} of the group order are not whole groups of the {} groups of {n} cells", order.groups()),
                hint: Some("the run was planned for other data or other parameters: start the run again".into()),
            });
        }
        let groups = GroupRows { rows: order.rows[start..end].to_vec(), order_sha256: order.sha256() };
        Ok(TaskRows { start, end, block: 1, groups: Some(groups) })
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The blocks of this task's rows, on the grid of the whole file.
    pub fn blocks(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut s = self.start;
        while s < self.end {
            let e = ((s / self.block + 1) * self.block).min(self.end);
            out.push((s, e));
            s = e;
        }
        out
    }

    /// The task's rows of the file as increasing, disjoint ranges.
    pub fn file_ranges(&self) -> Vec<(usize, usize)> {
        match &self.groups {
            None => vec![(self.start, self.end)],
            Some(g) => {
                let mut rows = g.rows.clone();
                rows.sort_unstable();
                let mut out: Vec<(usize, usize)> = Vec::new();
                for r in rows {
                    match out.last_mut() {
                        Some(last) if last.1 == r => last.1 = r + 1,
                        _ => out.push((r, r + 1)),
                    }
                }
                out
            }
        }
    }
}

/// The groups of cells a method embeds together (CellPLM's forward passes), laid one after
/// another: a sharded run of such a method cuts this order between groups, so every cell
/// shares its pass with the same cells whether the run is sharded or not. The planner, each
/// shard and the merge compute it from the data alike (it is a function of the data and the
/// parameters); its sha256 in each shard's record proves they agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupOrder {
    /// Rows of the file, group after group.
    pub rows: Vec<usize>,
    /// Where each group starts in `rows`, then `rows.len()`.
    pub bounds: Vec<usize>,
}

impl GroupOrder {
    /// The order of `groups` (each a list of rows of the file; together every row once).
    pub fn new(groups: &[Vec<usize>]) -> GroupOrder {
        let mut rows = Vec::with_capacity(groups.iter().map(Vec::len).sum());
        let mut bounds = vec![0];
        for g in groups.iter().filter(|g| !g.is_empty()) {
            rows.extend_from_slice(g);
            bounds.push(rows.len());
        }
        GroupOrder { rows, bounds }
    }

    /// How many groups.
    pub fn groups(&self) -> usize {
        self.bounds.len() - 1
    }

    /// At most `parts` shards of whole groups, consecutive in the order and balanced by cell
    /// count: shard `j` ends at the group boundary nearest to `(j + 1) / parts` of the cells
    /// (no empty shard; fewer shards when there are fewer groups).
    pub fn ranges(&self, parts: usize) -> Vec<(usize, usize)> {
        let n = self.rows.len();
        let parts = parts.max(1).min(self.groups().max(1));
        let mut out = Vec::new();
        let mut start = 0;
        for j in 1..parts {
            let target = (j * n).div_ceil(parts);
            // the nearest boundary to the target, after `start`, leaving a group for each later shard
            let last = self.bounds.len() - 1 - (parts - j);
            let i = self.bounds.partition_point(|&b| b < target).clamp(1, last);
            let i = if i > 1 && target - self.bounds[i - 1] < self.bounds[i] - target { i - 1 } else { i };
            let cut = self.bounds[i];
            if cut > start {
                out.push((start, cut));
                start = cut;
            }
        }
        out.push((start, n));
        out
    }

    /// sha256 of the order (its rows and bounds as little-endian u64).
    pub fn sha256(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for v in [self.rows.len(), self.bounds.len()].iter().chain(&self.rows).chain(&self.bounds) {
            h.update((*v as u64).to_le_bytes());
        }
        format!("{:x}", h.finalize())
    }
}

pub use crate::runner::shard_ranges;

/// What a finished shard leaves beside its rows: enough for the merge to write the output's
/// provenance, and for a resumed run to trust the rows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardRecord {
    pub shard: usize,
    pub start: usize,
    pub end: usize,
    pub n_obs: usize,
    pub key: String,
    pub dim: usize,
    pub matrix: String,
    pub params: Map<String, Value>,
    pub weights: Map<String, Value>,
    pub sha256: Value,
    pub notes: Vec<String>,
    /// sha256 of the shard's rows file.
    pub rows_sha256: String,
    /// Rows of X the shard read (distinct rows; its own, plus any neighbours its method needs).
    pub rows_read: u64,
    /// Of those, rows outside the shard's own.
    pub rows_read_outside: u64,
    /// For a method cut by groups: the sha256 of the group order whose positions
    /// `start..end` are ([`GroupOrder`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_sha256: Option<String>,
}

impl ShardRecord {
    /// The shard's cells, for messages: `cells 0..40`, or `40 cells (0..40 of the group order)`.
    fn cells(&self) -> String {
        match self.order_sha256 {
            None => format!("cells {}..{}", self.start, self.end),
            Some(_) => format!("{} cells ({}..{} of the group order)", self.end - self.start, self.start, self.end),
        }
    }
}

/// The folder the steps of a sharded run share.
pub fn work_dir(spec: &TaskSpec) -> Result<PathBuf> {
    let w = spec.work.clone().ok_or_else(|| Error::BadOption { option: "task spec".into(), detail: "a sharded step needs a `work` folder".into(), hint: None })?;
    std::fs::create_dir_all(&w).map_err(|e| Error::Io { path: w.clone(), source: e })?;
    Ok(w)
}

/// Shard `i`'s rows: little-endian f32, rows x dim.
pub fn rows_path(work: &Path, shard: usize) -> PathBuf {
    work.join(format!("shard{shard}.f32"))
}

/// Shard `i`'s record ([`ShardRecord`]).
pub fn record_path(work: &Path, shard: usize) -> PathBuf {
    work.join(format!("shard{shard}.json"))
}

fn sha256_of(path: &Path) -> Result<String> {
    crate::weights::sha256_file(path, |_| {})
}

/// The record of shard `i` covering `start..end` when it finished and its rows are intact
/// (size and sha256), else `None`: what a resumed run keeps.
pub fn shard_done(work: &Path, shard: usize, start: usize, end: usize) -> Option<ShardRecord> {
    let text = std::fs::read_to_string(record_path(work, shard)).ok()?;
    let r: ShardRecord = serde_json::from_str(&text).ok()?;
    if r.shard != shard || r.start != start || r.end != end {
        return None;
    }
    let rows = rows_path(work, shard);
    let len = std::fs::metadata(&rows).ok()?.len();
    if len != ((end - start) * r.dim * 4) as u64 {
        return None;
    }
    (sha256_of(&rows).ok()? == r.rows_sha256).then_some(r)
}

/// Where an embedding task writes its rows: the output file, or a shard's rows file.
pub struct EmbeddingOut {
    key: String,
    dim: usize,
    n_obs: usize,
    rows: TaskRows,
    target: Target,
}

/// Distinct rows in the ranges `reads`, and how many of them lie outside the task's own rows
/// `own` (increasing, disjoint ranges).
fn count_rows(reads: &[(usize, usize)], own: &[(usize, usize)]) -> (u64, u64) {
    let mut r: Vec<(usize, usize)> = reads.iter().copied().filter(|(a, b)| a < b).collect();
    r.sort();
    let (mut total, mut inside) = (0u64, 0u64);
    let mut cur: Option<(usize, usize)> = None;
    let mut flush = |(a, b): (usize, usize)| {
        total += (b - a) as u64;
        // own ranges overlapping a..b
        let first = own.partition_point(|o| o.1 <= a);
        inside += own[first..].iter().take_while(|o| o.0 < b).map(|o| b.min(o.1).saturating_sub(a.max(o.0)) as u64).sum::<u64>();
    };
    for (a, b) in r {
        cur = match cur {
            Some((ca, cb)) if a <= cb => Some((ca, cb.max(b))),
            Some(c) => {
                flush(c);
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    if let Some(c) = cur {
        flush(c);
    }
    (total, total - inside)
}

enum Target {
    Output { out: PendingOutput, ds: Dataset },
    Shard { shard: usize, work: PathBuf, tmp: PathBuf, file: File },
}

/// A new output for `spec`: a copy of the input with `obsm[key]` added, or with
/// `--embedding-only` a new file holding the obs index, the embedding and its provenance.
pub fn create_output(spec: &TaskSpec, key: &str, n_obs: usize, dim: usize) -> Result<(PendingOutput, Dataset)> {
    let out = if spec.embedding_only {
        let ad = AnnData::open(&spec.data)?;
        PendingOutput::create_embedding_only(&spec.out, &ad.obs_names)?
    } else {
        PendingOutput::create(&spec.data, &spec.out)?
    };
    let ds = out.create_obsm(key, n_obs, dim)?;
    Ok((out, ds))
}

impl EmbeddingOut {
    /// The output of `spec`'s step: rows `rows` of the embedding `key`, `n_obs x dim` in all.
    pub fn create(spec: &TaskSpec, rows: &TaskRows, key: &str, n_obs: usize, dim: usize) -> Result<EmbeddingOut> {
        let target = match &spec.step {
            Step::Project { shard, .. } => {
                let work = work_dir(spec)?;
                let path = rows_path(&work, *shard);
                let tmp = path.with_extension(format!("f32.{}.tmp", std::process::id()));
                let file = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&tmp).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
                file.set_len((rows.len() * dim * 4) as u64).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
                crate::lifecycle::register(&tmp);
                Target::Shard { shard: *shard, work, tmp, file }
            }
            _ => {
                let (out, ds) = create_output(spec, key, n_obs, dim)?;
                Target::Output { out, ds }
            }
        };
        Ok(EmbeddingOut { key: key.into(), dim, n_obs, rows: rows.clone(), target })
    }

    /// Rows `start..` of the embedding: global row numbers within this task's rows, or for a
    /// method cut by groups positions in the group order (the output puts each at its row).
    pub fn write(&self, start: usize, values: &[f32]) -> Result<()> {
        let n = values.len() / self.dim.max(1);
        if start < self.rows.start || start + n > self.rows.end {
            return Err(Error::Model { context: "writing the embedding".into(), detail: format!("rows {start}..{} are outside this task's rows {}..{}", start + n, self.rows.start, self.rows.end) });
        }
        match &self.target {
            Target::Output { ds, .. } => match &self.rows.groups {
                None => write_rows(ds, start, values, self.dim),
                Some(g) => {
                    // rows of the file, in increasing order, written run by run
                    let mut at: Vec<(usize, usize)> = (0..n).map(|k| (g.rows[start - self.rows.start + k], k)).collect();
                    at.sort_unstable();
                    let mut i = 0;
                    while i < at.len() {
                        let mut j = i + 1;
                        while j < at.len() && at[j].0 == at[j - 1].0 + 1 {
                            j += 1;
                        }
                        let run: Vec<f32> = at[i..j].iter().flat_map(|&(_, k)| values[k * self.dim..(k + 1) * self.dim].iter().copied()).collect();
                        write_rows(ds, at[i].0, &run, self.dim)?;
                        i = j;
                    }
                    Ok(())
                }
            },
            Target::Shard { tmp, file, shard, .. } => {
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                let at = ((start - self.rows.start) * self.dim * 4) as u64;
                file.write_all_at(&bytes, at).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
                if std::env::var(crate::env::EnvVars::KILL_SHARD).ok().and_then(|v| v.parse::<usize>().ok()) == Some(*shard) {
                    // SAFETY: a test hook; the process ends here as a killed job would
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                Ok(())
            }
        }
    }

    /// Finish: the output's provenance and rename into place, or the shard's rows and record.
    #[allow(clippy::too_many_arguments)]
    pub fn commit(self, spec: &TaskSpec, matrix: &str, params: Map<String, Value>, weights: Map<String, Value>, sha256: Value, notes: Vec<String>) -> Result<TaskResult> {
        // every read of this process (a task process runs one task), before the output too
        let reads = crate::anndata::matrix::rows_read();
        let (rows_read, rows_read_outside) = count_rows(&reads, &self.rows.file_ranges());
        match self.target {
            Target::Output { out, ds } => {
                drop(ds);
                let mut r = commit_embedding(spec, out, &self.key, matrix, params, weights, sha256, self.n_obs, self.dim, notes)?;
                r.rows_read = Some(rows_read);
                Ok(r)
            }
            Target::Shard { shard, work, tmp, file } => {
                file.sync_all().map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
                drop(file);
                let path = rows_path(&work, shard);
                std::fs::rename(&tmp, &path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
                crate::lifecycle::unregister(&tmp);
                let record = ShardRecord {
                    shard,
                    start: self.rows.start,
                    end: self.rows.end,
                    n_obs: self.n_obs,
                    key: self.key.clone(),
                    dim: self.dim,
                    matrix: matrix.into(),
                    params,
                    weights,
                    sha256,
                    notes: notes.clone(),
                    rows_sha256: sha256_of(&path)?,
                    rows_read,
                    rows_read_outside,
                    order_sha256: self.rows.groups.as_ref().map(|g| g.order_sha256.clone()),
                };
                write_atomic(&record_path(&work, shard), serde_json::to_string_pretty(&record).unwrap_or_default().as_bytes())?;
                Ok(TaskResult { output: Some(path), obsm_key: Some(self.key), n_obs: self.rows.len(), dim: self.dim, notes, rows_read: Some(rows_read), rows_read_outside: Some(rows_read_outside), ..Default::default() })
            }
        }
    }
}

/// The parameters of the merged output: shard 0's, where every shard agrees; a `mean_*` value
/// that differs is the mean over all cells; any other value that differs is listed by shard.
fn merge_params(records: &[ShardRecord]) -> Map<String, Value> {
    let mut out = records[0].params.clone();
    let total: usize = records.iter().map(|r| r.end - r.start).sum();
    for (k, v0) in &records[0].params {
        if records.iter().all(|r| r.params.get(k) == Some(v0)) {
            continue;
        }
        let nums: Option<Vec<f64>> = records.iter().map(|r| r.params.get(k).and_then(Value::as_f64)).collect();
        let merged = match nums {
            Some(n) if k.starts_with("mean_") => json!(n.iter().zip(records).map(|(v, r)| v * (r.end - r.start) as f64).sum::<f64>() / total.max(1) as f64),
            _ => json!(records.iter().map(|r| format!("shard {} ({}): {}", r.shard, r.cells(), r.params.get(k).map(Value::to_string).unwrap_or_else(|| "-".into()))).collect::<Vec<_>>().join("; ")),
        };
        out.insert(k.clone(), merged);
    }
    out
}

/// The notes of the merged output: those every shard made once, the others prefixed with their
/// shard.
fn merge_notes(records: &[ShardRecord]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in records {
        for n in &r.notes {
            if records.iter().all(|o| o.notes.contains(n)) {
                if !out.contains(n) {
                    out.push(n.clone());
                }
            } else {
                out.push(format!("shard {} ({}): {n}", r.shard, r.cells()));
            }
        }
    }
    out
}

/// The last step of a sharded embedding: the output written from the shard files, exactly as
/// an unsharded run writes it (the same rows, the same provenance but for what the shards
/// report apart). The shard files stay in the work folder until the output is in place.
pub fn merge(spec: &TaskSpec, shards: &[(usize, usize)]) -> Result<TaskResult> {
    merge_ordered(spec, shards, None)
}

/// [`merge`] for a method cut by groups: the shards' positions are those of `order`, and each
/// row goes back to its row of the file.
pub fn merge_ordered(spec: &TaskSpec, shards: &[(usize, usize)], order: Option<&GroupOrder>) -> Result<TaskResult> {
    let work = work_dir(spec)?;
    let mut records = Vec::new();
    for (i, &(start, end)) in shards.iter().enumerate() {
        let r = shard_done(&work, i, start, end).ok_or_else(|| Error::BadField {
            path: rows_path(&work, i),
            field: format!("shard {i}"),
            detail: format!("rows {start}..{end} are missing, incomplete or fail their checksum"),
            hint: Some("run the shard again: `scfoundry embed --resume RUN_DIR` re-runs only such shards".into()),
        })?;
        records.push(r);
    }
    let first = records.first().ok_or_else(|| Error::BadOption { option: "task spec".into(), detail: "a merge needs at least one shard".into(), hint: None })?.clone();
    let n_obs = first.n_obs;
    let covered = shards.first().map(|s| s.0) == Some(0) && shards.last().map(|s| s.1) == Some(n_obs) && shards.windows(2).all(|w| w[0].1 == w[1].0);
    if !covered || records.iter().any(|r| r.key != first.key || r.dim != first.dim || r.n_obs != n_obs || r.matrix != first.matrix) {
        return Err(Error::BadOption { option: "shards".into(), detail: format!("the shards {shards:?} do not cover the {n_obs} cells in order with one embedding"), hint: Some("start the run again".into()) });
    }
    let want = order.map(GroupOrder::sha256);
    if let Some(r) = records.iter().find(|r| r.order_sha256 != want) {
        return Err(Error::BadField {
            path: record_path(&work, r.shard),
            field: "order_sha256".into(),
            detail: format!("shard {} was cut from another order of the cells (sha256 {}) than the data gives now ({})", r.shard, r.order_sha256.as_deref().unwrap_or("none"), want.as_deref().unwrap_or("none: rows of the file")),
            hint: Some("the data or the parameters changed since the shards ran: start the run again".into()),
        });
    }
    if order.is_some_and(|o| o.rows.len() != n_obs) {
        return Err(Error::BadOption { option: "shards".into(), detail: format!("the group order holds {} cells, the shards {n_obs}", order.map_or(0, |o| o.rows.len())), hint: Some("start the run again".into()) });
    }
    let (out, ds) = create_output(spec, &first.key, n_obs, first.dim)?;
    let dim = first.dim;
    let open = |i: usize| {
        let path = rows_path(&work, i);
        File::open(&path).map_err(|e| Error::Io { path: path.clone(), source: e })
    };
    match order {
        // copied in blocks of at most 64k rows: memory does not grow with the cell count
        None => {
            for (i, r) in records.iter().enumerate() {
                let path = rows_path(&work, i);
                let mut f = open(i)?;
                let mut s = r.start;
                while s < r.end {
                    let e = (s + 65_536).min(r.end);
                    let mut bytes = vec![0u8; (e - s) * dim * 4];
                    f.read_exact(&mut bytes).map_err(|e| Error::Io { path: path.clone(), source: e })?;
                    write_rows(&ds, s, &le_f32(&bytes), dim)?;
                    s = e;
                }
            }
        }
        // rows of the file 64k at a time, each gathered from its shard's position; a run of
        // rows at consecutive positions of one shard is one read
        Some(o) => {
            let files: Vec<File> = (0..records.len()).map(open).collect::<Result<_>>()?;
            let mut pos = vec![0usize; n_obs];
            for (p, &r) in o.rows.iter().enumerate() {
                pos[r] = p;
            }
            let shard_of = |p: usize| shards.partition_point(|s| s.1 <= p);
            let mut s = 0;
            while s < n_obs {
                let e = (s + 65_536).min(n_obs);
                let mut bytes = vec![0u8; (e - s) * dim * 4];
                let mut r = s;
                while r < e {
                    let (i, p0) = (shard_of(pos[r]), pos[r]);
                    let mut q = r + 1;
                    while q < e && pos[q] == p0 + (q - r) && pos[q] < shards[i].1 {
                        q += 1;
                    }
                    let at = ((p0 - shards[i].0) * dim * 4) as u64;
                    files[i].read_exact_at(&mut bytes[(r - s) * dim * 4..(q - s) * dim * 4], at).map_err(|e| Error::Io { path: rows_path(&work, i), source: e })?;
                    r = q;
                }
                write_rows(&ds, s, &le_f32(&bytes), dim)?;
                s = e;
            }
        }
    }
    drop(ds);
    let params = merge_params(&records);
    let notes = merge_notes(&records);
    let mut result = commit_embedding(spec, out, &first.key, &first.matrix, params, first.weights.clone(), first.sha256.clone(), n_obs, dim, notes)?;
    result.rows_read = Some(0);
    let mut summary = Vec::new();
    for r in &records {
        summary.push(format!("shard {}: {}, read {} rows of X ({} outside its cells)", r.shard, r.cells(), r.rows_read, r.rows_read_outside));
    }
    result.summary = summary;
    Ok(result)
}

/// Little-endian f32 values.
fn le_f32(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// What a fit step leaves for shards that resume a stream drawn cell after cell (a random
/// generator's state): the state at the start of every block of the grid, for the data and
/// grid it was made on.
#[derive(Serialize, Deserialize)]
pub struct BlockStates<T> {
    pub n_obs: usize,
    pub block: usize,
    /// `states[i]`: the state before row `i * block`.
    pub states: Vec<T>,
}

/// Save a fit's [`BlockStates`] as `file` in the run's work folder.
pub fn save_block_states<T: Serialize>(spec: &TaskSpec, file: &str, states: &BlockStates<T>) -> Result<PathBuf> {
    let path = work_dir(spec)?.join(file);
    let text = serde_json::to_vec(states).map_err(|e| Error::Model { context: format!("saving {}", path.display()), detail: e.to_string() })?;
    write_atomic(&path, &text)?;
    Ok(path)
}

/// The state a shard of `rows` starts from, out of the fit's `file` in the run's work folder.
pub fn load_block_state<T: serde::de::DeserializeOwned>(spec: &TaskSpec, file: &str, rows: &TaskRows, n_obs: usize) -> Result<T> {
    let path = work_dir(spec)?.join(file);
    let bad = |detail: String| Error::BadField { path: path.clone(), field: "states".into(), detail, hint: Some("the fit step of this run did not finish, or was made for other data: start the run again".into()) };
    let text = std::fs::read(&path).map_err(|e| bad(format!("cannot be read ({e})")))?;
    let mut saved: BlockStates<T> = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    if saved.n_obs != n_obs || saved.block != rows.block || rows.start % rows.block != 0 {
        return Err(bad(format!("made for {} cells in blocks of {}; this shard has {n_obs} cells in blocks of {}", saved.n_obs, saved.block, rows.block)));
    }
    let i = rows.start / rows.block;
    if i >= saved.states.len() {
        return Err(bad(format!("holds {} block states; row {} needs the {}th", saved.states.len(), rows.start, i + 1)));
    }
    Ok(saved.states.swap_remove(i))
}

/// Write `bytes` to `path` through a temporary file beside it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(|e| Error::Io { path: tmp.clone(), source: e })?;
    std::fs::rename(&tmp, path).map_err(|e| Error::Io { path: path.into(), source: e })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_whole_blocks_covering_all_rows() {
        assert_eq!(shard_ranges(10, 3, 1), vec![(0, 3), (3, 6), (6, 10)]);
        assert_eq!(shard_ranges(100, 3, 16), vec![(0, 32), (32, 64), (64, 100)]);
        // more shards than blocks: one shard a block
        assert_eq!(shard_ranges(40, 8, 16), vec![(0, 16), (16, 32), (32, 40)]);
        assert_eq!(shard_ranges(0, 4, 16), vec![(0, 0)]);
    }

    #[test]
    fn task_rows_follow_the_grid_of_the_whole_file() {
        let r = TaskRows { start: 32, end: 100, block: 16, groups: None };
        assert_eq!(r.blocks(), vec![(32, 48), (48, 64), (64, 80), (80, 96), (96, 100)]);
        assert_eq!(r.len(), 68);
    }

    #[test]
    fn rows_read_are_counted_once_and_split_inside_outside() {
        assert_eq!(count_rows(&[(0, 10), (5, 15), (40, 42)], &[(0, 16)]), (17, 2));
        assert_eq!(count_rows(&[(8, 16), (8, 16)], &[(8, 16)]), (8, 0));
        assert_eq!(count_rows(&[], &[(0, 4)]), (0, 0));
        // own rows in pieces (a shard of groups): rows 3, 5..7 and 9 are its own
        assert_eq!(count_rows(&[(3, 4), (5, 7), (9, 10)], &[(3, 4), (5, 7), (9, 10)]), (4, 0));
        assert_eq!(count_rows(&[(0, 10)], &[(3, 4), (5, 7), (9, 10)]), (10, 6));
    }

    #[test]
    fn group_shards_are_whole_groups_balanced_by_cells() {
        // groups of 4, 1, 3, 2 cells (rows interleaved in the file)
        let o = GroupOrder::new(&[vec![0, 2, 4, 6], vec![9], vec![1, 3, 5], vec![7, 8]]);
        assert_eq!(o.bounds, vec![0, 4, 5, 8, 10]);
        assert_eq!(o.ranges(2), vec![(0, 5), (5, 10)]);
        assert_eq!(o.ranges(3), vec![(0, 4), (4, 8), (8, 10)]);
        // more shards than groups: one a group
        assert_eq!(o.ranges(9), vec![(0, 4), (4, 5), (5, 8), (8, 10)]);
        assert_eq!(o.ranges(1), vec![(0, 10)]);
        // every split covers all cells in order with no empty shard
        for k in 1..6 {
            let r = o.ranges(k);
            assert_eq!((r[0].0, r.last().unwrap().1), (0, 10));
            assert!(r.windows(2).all(|w| w[0].1 == w[1].0) && r.iter().all(|x| x.0 < x.1 && o.bounds.contains(&x.1)), "{k}: {r:?}");
        }
        assert_ne!(o.sha256(), GroupOrder::new(&[vec![0, 2, 4, 6, 9], vec![1, 3, 5], vec![7, 8]]).sha256());
    }

    #[test]
    fn a_task_of_groups_holds_its_rows_of_the_file() {
        let o = GroupOrder::new(&[vec![0, 2, 4, 6], vec![9], vec![1, 3, 5], vec![7, 8]]);
        let t = TaskRows::group_range(4, 8, &o).unwrap();
        assert_eq!(t.groups.as_ref().unwrap().rows, vec![9, 1, 3, 5]);
        assert_eq!(t.file_ranges(), vec![(1, 2), (3, 4), (5, 6), (9, 10)]);
        assert_eq!(TaskRows::group_range(0, 10, &o).unwrap().file_ranges(), vec![(0, 10)]);
        // a cut inside a group, or past the end, is refused
        assert!(TaskRows::group_range(4, 7, &o).is_err());
        assert!(TaskRows::group_range(8, 11, &o).is_err());
    }
}
