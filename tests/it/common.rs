//! Shared helpers: a test context with a temp folder, running the binary, and a small
//! .h5ad writer (on the hdf5 crate) to build valid and broken files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hdf5::types::VarLenUnicode;

pub const BIN: &str = env!("CARGO_BIN_EXE_scfoundry");
/// The benchmark binary (`__bench-*` commands), apart from the product.
pub const BENCH_BIN: &str = env!("CARGO_BIN_EXE_scfoundry-bench");

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub struct TestContext {
    pub dir: tempfile::TempDir,
}

/// HDF5 locks files with flock(); a lock taken by one test thread leaks into processes that
/// other test threads spawn at that moment (fork copies descriptors), which then makes an
/// unrelated test's file look locked. Tests turn HDF5 file locking off, once, before any
/// HDF5 call; the product keeps HDF5's default.
pub fn no_hdf5_locking() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| std::env::set_var("HDF5_USE_FILE_LOCKING", "FALSE"));
}

impl TestContext {
    pub fn new() -> TestContext {
        no_hdf5_locking();
        TestContext { dir: tempfile::tempdir().unwrap() }
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    /// Run scfoundry in the temp folder with an isolated environment.
    pub fn run(&self, args: &[&str]) -> Run {
        self.run_env(args, &[])
    }
    /// As `run`, with extra environment variables (e.g. SCFOUNDRY_MANIFEST).
    pub fn run_env(&self, args: &[&str], env: &[(&str, &Path)]) -> Run {
        Run::from(self.command(args, env).output().unwrap())
    }
    /// As `run_env`, with the child's data segment capped at `bytes` (RLIMIT_DATA, which
    /// covers malloc's heap and mmaps; MALLOC_ARENA_MAX=2 so glibc's per-thread arenas do not
    /// eat the cap): a hostile input must fail cleanly under it, not be killed.
    pub fn run_capped(&self, args: &[&str], env: &[(&str, &Path)], bytes: u64) -> Run {
        use std::os::unix::process::CommandExt;
        let mut cmd = self.command(args, env);
        cmd.env("MALLOC_ARENA_MAX", "2");
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let lim = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: bytes as libc::rlim_t };
                if libc::setrlimit(libc::RLIMIT_DATA, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Run::from(cmd.output().unwrap())
    }
    /// The command for scfoundry in the temp folder, its environment isolated: no workspace,
    /// manifest, proxy or extra CA from the caller's environment.
    fn command(&self, args: &[&str], env: &[(&str, &Path)]) -> Command {
        let mut cmd = Command::new(if args.first().is_some_and(|a| a.starts_with("__bench")) { BENCH_BIN } else { BIN });
        cmd.args(args)
            .current_dir(self.dir.path())
            .env_remove("SCFOUNDRY_WORKSPACE")
            .env_remove("SCFOUNDRY_MANIFEST")
            .env("SCFOUNDRY_WEIGHTS_DIR", self.dir.path().join("weights-cache"))
            .env("SCFOUNDRY_CONVERTED_DIR", self.dir.path().join("converted"))
            .env_remove("SCFOUNDRY_GENOME")
            .env_remove("SCFOUNDRY_GPUS")
            .env_remove("SCFOUNDRY_FAKE_GPUS")
            .env("SCFOUNDRY_GPU_LOCKS", self.dir.path().join("gpu-locks"))
            .env("SCFOUNDRY_NO_PROGRESS", "1");
        for var in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR"] {
            cmd.env_remove(var);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    }
    /// A copy of a demo dataset in the temp folder.
    pub fn demo(&self, name: &str) -> PathBuf {
        let dst = self.path(name);
        std::fs::copy(repo().join("demo").join(name), &dst).unwrap();
        dst
    }
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Run {
    fn from(o: Output) -> Run {
        Run {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into(),
            stderr: String::from_utf8_lossy(&o.stderr).into(),
        }
    }
}

impl Run {
    #[track_caller]
    pub fn success(&self) -> &Run {
        assert_eq!(self.code, 0, "expected success\nstdout:\n{}\nstderr:\n{}", self.stdout, self.stderr);
        self
    }
    #[track_caller]
    pub fn user_error(&self) -> &Run {
        assert_eq!(self.code, 1, "expected exit 1\nstdout:\n{}\nstderr:\n{}", self.stdout, self.stderr);
        assert!(self.stderr.starts_with("error: "), "stderr should start with `error: `:\n{}", self.stderr);
        self
    }
    /// Exit 1 with an `error:` line (notes may come before it, as in `weights pull`).
    #[track_caller]
    pub fn failed(&self) -> &Run {
        assert_eq!(self.code, 1, "expected exit 1\nstdout:\n{}\nstderr:\n{}", self.stdout, self.stderr);
        assert!(self.stderr.starts_with("error: ") || self.stderr.contains("\nerror: "), "no `error: ` line:\n{}", self.stderr);
        self
    }
    #[track_caller]
    pub fn stderr_has(&self, needle: &str) -> &Run {
        assert!(self.stderr.contains(needle), "stderr lacks {needle:?}:\n{}", self.stderr);
        self
    }
    #[track_caller]
    pub fn has_hint(&self) -> &Run {
        assert!(self.stderr.contains("\nhint: "), "no hint in:\n{}", self.stderr);
        self
    }
}

/// The Python interpreter with anndata and scanpy, or None (allowed only outside CI).
pub fn python() -> Option<PathBuf> {
    match std::env::var_os("SCFOUNDRY_TEST_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            if std::env::var_os("CI").is_some() {
                panic!("CI=true but SCFOUNDRY_TEST_PYTHON is not set: .ci/run must provide the Python venv");
            }
            eprintln!("SCFOUNDRY_TEST_PYTHON not set: skipping the Python half of this test (CI runs it)");
            None
        }
    }
}

/// Run a Python script from tests/python with arguments; return its stdout parsed as JSON.
pub fn python_json(py: &Path, script: &str, args: &[&Path]) -> serde_json::Value {
    let out = Command::new(py).arg(repo().join("tests/python").join(script)).args(args).output().unwrap();
    assert!(out.status.success(), "{script} failed:\n{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{script}: bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

pub fn sha256(path: &Path) -> String {
    scfoundry::weights::sha256_file(path, |_| {}).unwrap()
}

/// A small valid AnnData in memory, written with anndata's encoding.
#[derive(Clone)]
pub struct Tiny {
    pub n_obs: usize,
    pub n_vars: usize,
    /// dense row-major values
    pub x: Vec<f32>,
    pub obs_names: Vec<String>,
    pub var_names: Vec<String>,
    pub write_x: bool,
    /// categorical obs columns (name, one value per cell)
    pub obs_cols: Vec<(String, Vec<String>)>,
    /// dense float32 obsm entries (name, row-major values, columns)
    pub obsm: Vec<(String, Vec<f32>, usize)>,
}

impl Tiny {
    /// Seeded negative-binomial-like integer counts with structure in a few genes.
    pub fn counts(n_obs: usize, n_vars: usize) -> Tiny {
        let mut x = vec![0f32; n_obs * n_vars];
        let mut state: u64 = 0x9E3779B97F4A7C15;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        for i in 0..n_obs {
            for j in 0..n_vars {
                let group = (i % 3) as f64;
                let rate = 0.3 + if j % 3 == i % 3 { 2.0 + group } else { 0.0 } + (j as f64 * 0.05);
                // Poisson by inversion
                let (mut k, mut p, u) = (0u32, (-rate).exp(), next());
                let mut cdf = p;
                while u > cdf && k < 60 {
                    k += 1;
                    p *= rate / k as f64;
                    cdf += p;
                }
                x[i * n_vars + j] = k as f32;
            }
        }
        Tiny {
            n_obs,
            n_vars,
            x,
            obs_names: (0..n_obs).map(|i| format!("cell_{i}")).collect(),
            var_names: (0..n_vars).map(|j| format!("gene_{j}")).collect(),
            write_x: true,
            obs_cols: Vec::new(),
            obsm: Vec::new(),
        }
    }

    /// Add a categorical obs column.
    pub fn with_obs(mut self, name: &str, values: Vec<String>) -> Tiny {
        self.obs_cols.push((name.into(), values));
        self
    }

    /// Add a dense obsm entry (n_obs x dim, row-major).
    pub fn with_obsm(mut self, name: &str, values: Vec<f32>, dim: usize) -> Tiny {
        self.obsm.push((name.into(), values, dim));
        self
    }

    pub fn write(&self, path: &Path) {
        let f = hdf5::File::create(path).unwrap();
        enc(&f, "anndata", "0.1.0");
        write_df(&f, "obs", &self.obs_names);
        if !self.obs_cols.is_empty() {
            let g = f.group("obs").unwrap();
            g.delete_attr("column-order").unwrap();
            let names: Vec<VarLenUnicode> = self.obs_cols.iter().map(|(n, _)| n.parse().unwrap()).collect();
            g.new_attr::<VarLenUnicode>().shape([names.len()]).create("column-order").unwrap().write_raw(&names).unwrap();
            for (name, vals) in &self.obs_cols {
                let mut cats: Vec<String> = vals.clone();
                cats.sort();
                cats.dedup();
                let codes: Vec<i16> = vals.iter().map(|v| cats.binary_search(v).unwrap() as i16).collect();
                let c = g.create_group(name).unwrap();
                enc(&c, "categorical", "0.2.0");
                c.new_attr::<bool>().shape(()).create("ordered").unwrap().write_scalar(&false).unwrap();
                c.new_dataset::<i16>().shape([codes.len()]).create("codes").unwrap().write_raw(&codes).unwrap();
                let cv: Vec<VarLenUnicode> = cats.iter().map(|s| s.parse().unwrap()).collect();
                let ds = c.new_dataset::<VarLenUnicode>().shape([cv.len()]).create("categories").unwrap();
                ds.write_raw(&cv).unwrap();
                enc(&ds, "string-array", "0.2.0");
            }
        }
        write_df(&f, "var", &self.var_names);
        if self.write_x {
            let g = f.create_group("X").unwrap();
            enc(&g, "csr_matrix", "0.1.0");
            let (mut data, mut indices, mut indptr) = (vec![], vec![], vec![0i32]);
            for i in 0..self.n_obs {
                for j in 0..self.n_vars {
                    let v = self.x[i * self.n_vars + j];
                    if v != 0.0 {
                        data.push(v);
                        indices.push(j as i32);
                    }
                }
                indptr.push(data.len() as i32);
            }
            g.new_attr::<i64>().shape([2]).create("shape").unwrap().write_raw(&[self.n_obs as i64, self.n_vars as i64]).unwrap();
            g.new_dataset::<f32>().shape([data.len()]).create("data").unwrap().write_raw(&data).unwrap();
            g.new_dataset::<i32>().shape([indices.len()]).create("indices").unwrap().write_raw(&indices).unwrap();
            g.new_dataset::<i32>().shape([indptr.len()]).create("indptr").unwrap().write_raw(&indptr).unwrap();
        }
        for name in ["obsm", "varm", "layers", "uns", "obsp", "varp"] {
            let g = f.create_group(name).unwrap();
            enc(&g, "dict", "0.1.0");
        }
        let obsm = f.group("obsm").unwrap();
        for (name, vals, dim) in &self.obsm {
            write_obsm(&obsm, name, vals, *dim);
        }
    }
}

/// A dense float32 obsm array in anndata's encoding (`array` 0.2.0).
pub fn write_obsm(obsm: &hdf5::Group, name: &str, vals: &[f32], dim: usize) {
    let ds = obsm.new_dataset::<f32>().shape([vals.len() / dim, dim]).create(name).unwrap();
    ds.write_raw(vals).unwrap();
    enc(&ds, "array", "0.2.0");
}

pub fn enc(loc: &hdf5::Location, t: &str, v: &str) {
    for (k, val) in [("encoding-type", t), ("encoding-version", v)] {
        let s: VarLenUnicode = val.parse().unwrap();
        loc.new_attr::<VarLenUnicode>().shape(()).create(k).unwrap().write_scalar(&s).unwrap();
    }
}

fn write_df(f: &hdf5::File, name: &str, index: &[String]) {
    let g = f.create_group(name).unwrap();
    enc(&g, "dataframe", "0.2.0");
    let s: VarLenUnicode = "_index".parse().unwrap();
    g.new_attr::<VarLenUnicode>().shape(()).create("_index").unwrap().write_scalar(&s).unwrap();
    g.new_attr::<f64>().shape([0]).create("column-order").unwrap();
    let vals: Vec<VarLenUnicode> = index.iter().map(|s| s.parse().unwrap()).collect();
    let ds = g.new_dataset::<VarLenUnicode>().shape([vals.len()]).create("_index").unwrap();
    ds.write_raw(&vals).unwrap();
    enc(&ds, "string-array", "0.2.0");
}

/// Largest per-cell relative L2 error, `|got - want| / |want|`, of `got` (cells x `dim`, row-major)
/// against `want`, a JSON array of cells (a reference fixture's embeddings); `got` must hold
/// exactly those cells.
pub fn max_rel_err(got: &[f32], want: &serde_json::Value, dim: usize) -> f64 {
    let want = want.as_array().unwrap();
    assert_eq!(got.len(), want.len() * dim);
    let mut worst = 0f64;
    for (i, w) in want.iter().enumerate() {
        let w: Vec<f64> = w.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let g = &got[i * dim..(i + 1) * dim];
        let d2: f64 = g.iter().zip(&w).map(|(a, b)| (*a as f64 - b).powi(2)).sum();
        let n2: f64 = w.iter().map(|b| b * b).sum();
        worst = worst.max((d2 / n2).sqrt());
    }
    worst
}

/// `obsm[key]` of an .h5ad we wrote, as (row-major values, width).
pub fn read_obsm(path: &Path, key: &str) -> (Vec<f32>, usize) {
    let f = hdf5::File::open(path).unwrap();
    let ds = f.dataset(&format!("obsm/{key}")).unwrap();
    (ds.read_raw::<f32>().unwrap(), ds.shape()[1])
}

/// `embed -m method` without its weights: a user error naming the missing `entry` with a hint,
/// and no output file.
pub fn assert_embed_needs_weights(method: &str, entry: &str) {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "--method", method, "--data", "t.h5ad"]);
    r.user_error().stderr_has(&format!("weights for {method} are not in")).stderr_has(entry).has_hint();
    assert!(!ctx.path(&format!("t.{method}.h5ad")).exists());
}

/// weights.toml less one entry's size and sha256 (a small fixture file cannot match the real
/// file's), written into the test folder for $SCFOUNDRY_MANIFEST.
pub fn manifest_without_checksum(ctx: &TestContext, entry: &str) -> PathBuf {
    let text = scfoundry::weights::MANIFEST_TEXT;
    let at = text.find(&format!("[weights.\"{entry}\"]")).unwrap();
    let end = at + text[at..].find("\n\n").unwrap();
    let kept: String = text[at..end].lines().filter(|l| !l.starts_with("size =") && !l.starts_with("sha256 =")).collect::<Vec<_>>().join("\n");
    let manifest = ctx.path("weights.toml");
    std::fs::write(&manifest, format!("{}{kept}{}", &text[..at], &text[end..])).unwrap();
    manifest
}

/// Rows of the blocks the shard tests use (`SCFOUNDRY_BLOCK_ROWS`): small enough to split the
/// test files, the same for the sharded and the unsharded run.
pub const SHARD_BLOCK_ROWS: &str = "8";

/// `embed` with `args` (which name no `-o`) once whole and once in `shards` shards, each with
/// `SCFOUNDRY_BLOCK_ROWS` = [`SHARD_BLOCK_ROWS`] and `env`: `obsm[key]` must be equal byte for
/// byte, every shard must have read only its own rows (plus `halo` more at most), and the
/// merged output must say in its provenance that it merged. Returns the sharded run's folder.
#[track_caller]
pub fn assert_shards_equal(ctx: &TestContext, args: &[&str], env: &[(&str, &Path)], key: &str, shards: usize, halo: u64) -> PathBuf {
    let block = Path::new(SHARD_BLOCK_ROWS);
    let mut env: Vec<(&str, &Path)> = env.to_vec();
    env.push(("SCFOUNDRY_BLOCK_ROWS", block));
    let whole = format!("whole-{key}.h5ad");
    let split = format!("sharded-{key}.h5ad");
    let runs = ctx.path(&format!("runs-{key}"));
    let mut a: Vec<&str> = args.to_vec();
    a.extend(["-o", &whole]);
    ctx.run_env(&a, &env).success();
    let shard_count = shards.to_string();
    let mut b: Vec<&str> = args.to_vec();
    b.extend(["-o", &split, "--shards", &shard_count, "--max-forks", "2", "--runs-dir", runs.to_str().unwrap()]);
    let r = ctx.run_env(&b, &env);
    r.success();
    let (x, dx) = read_obsm(&ctx.path(&whole), key);
    let (y, dy) = read_obsm(&ctx.path(&split), key);
    assert_eq!(dx, dy, "{key}: widths differ");
    let same = x.len() == y.len() && x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
    if !same {
        let first = x.iter().zip(&y).position(|(p, q)| p.to_bits() != q.to_bits());
        panic!("{key}: the sharded output differs from the whole run (first at value {first:?} of {})\n{}", x.len(), r.stderr);
    }
    let run = std::fs::read_dir(&runs).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).expect("a run folder");
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("plan.json")).unwrap()).unwrap();
    let mut seen = 0;
    for t in plan["tasks"].as_array().unwrap() {
        if t["step"]["kind"] != "project" {
            continue;
        }
        let (s, e) = (t["step"]["start"].as_u64().unwrap(), t["step"]["end"].as_u64().unwrap());
        let res: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("tasks").join(t["task_id"].to_string()).join("result.json")).unwrap()).unwrap();
        let read = res["rows_read"].as_u64().expect("a shard reports rows_read");
        let outside = res["rows_read_outside"].as_u64().expect("a shard reports rows_read_outside");
        assert!(read - outside == e - s && outside <= halo, "{key}: shard {s}..{e} read {read} rows of X, {outside} outside its own");
        seen += 1;
    }
    assert_eq!(seen, shards, "{key}: expected {shards} shards in {}", run.display());
    run
}

/// Copy each (source file, path inside the folder) into `dir`: a model folder as upstream lays
/// it out, for `--model-dir`. Returns `dir`.
pub fn model_folder(dir: &Path, files: &[(PathBuf, &str)]) -> PathBuf {
    for (from, to) in files {
        let to = dir.join(to);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, &to).unwrap();
    }
    dir.to_path_buf()
}

/// A Hugging Face cache entry `hub/<name>` (`models--ORG--NAME`) at revision `rev`, as
/// huggingface_hub writes one: each (source file, path in the snapshot) a blob named by its
/// sha256 under `blobs/`, linked from `snapshots/<rev>/`, and `refs/main` naming `rev`.
/// Returns the entry.
pub fn hf_cache_entry(hub: &Path, name: &str, rev: &str, files: &[(PathBuf, &str)]) -> PathBuf {
    let entry = hub.join(name);
    std::fs::create_dir_all(entry.join("blobs")).unwrap();
    std::fs::create_dir_all(entry.join("refs")).unwrap();
    std::fs::write(entry.join("refs/main"), rev).unwrap();
    for (from, to) in files {
        let sha = sha256(from);
        std::fs::copy(from, entry.join("blobs").join(&sha)).unwrap();
        let link = entry.join("snapshots").join(rev).join(to);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let up = "../".repeat(Path::new(to).components().count() + 1);
        std::os::unix::fs::symlink(format!("{up}blobs/{sha}"), &link).unwrap();
    }
    entry
}

/// An `embed --model-dir` output against the weights folder's output of the same model and
/// options: `obsm[key]` equal bit for bit, `parameters/model_dir` the folder as the command
/// resolved it (a cache entry's snapshot), and `weights/sha256/<entry id>` the sha256 of each
/// of `files` (entry id, its file) read from the folder.
#[track_caller]
pub fn assert_model_dir_run(from_dir: &Path, from_weights: &Path, key: &str, folder: &Path, files: &[(&str, PathBuf)]) {
    let (a, dim) = read_obsm(from_dir, key);
    let (b, dim_w) = read_obsm(from_weights, key);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!((a.len(), dim), (b.len(), dim_w));
    assert!(bits(&a) == bits(&b), "{key}: the --model-dir run differs from the weights folder's");
    let h = hdf5::File::open(from_dir).unwrap();
    let text = |name: &str| -> String { h.dataset(name).unwrap_or_else(|e| panic!("{name}: {e}")).read_scalar::<VarLenUnicode>().unwrap().to_string() };
    assert_eq!(text("uns/scfoundry/parameters/model_dir"), folder.display().to_string());
    for (id, file) in files {
        assert_eq!(text(&format!("uns/scfoundry/weights/sha256/{id}")), sha256(file), "sha256 of {id}");
    }
}

/// `embed` with `args` (naming `--model-dir folder` and `-o out`) from a folder that lacks
/// `file`: a user error naming the folder and the file, with a hint, before a run starts (no
/// run folder, no output).
#[track_caller]
pub fn assert_model_dir_lacks(ctx: &TestContext, args: &[&str], method: &str, folder: &Path, file: &str, out: &str) {
    let runs = || std::fs::read_dir(ctx.path("runs")).map(|d| d.count()).unwrap_or(0);
    let before = runs();
    let r = ctx.run(args);
    r.user_error().stderr_has(&format!("{}: --model-dir for {method} has no {file}", folder.display())).has_hint();
    assert_eq!(runs(), before, "no run folder for a run that cannot start");
    assert!(!ctx.path(out).exists());
}
