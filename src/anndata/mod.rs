//! AnnData (`.h5ad`) reading and writing on HDF5.
//!
//! Reading follows anndata's on-disk encoding (`encoding-type` attributes, see
//! ../shared/GPU.md and anndata's docs): X dense, CSR or CSC of any numeric dtype with
//! int32 or int64 offsets; dataframes with categorical, string, numeric, bool and nullable
//! columns; obsm, varm, layers, raw and uns. The matrix is read in blocks of rows.
//!
//! Legacy AnnData (anndata < 0.7) and Cell Ranger's HDF5 matrices are read through a current
//! .h5ad made from them once by [`convert`]; `AnnData::source` names the file actually read.
//! docs/file-formats.md has the table of every encoding and what scfoundry does with it.
//!
//! Writing never touches the input: the output is a copy of the input (all of its content,
//! whatever anndata version wrote it) to which we add entries, built in a temporary file
//! next to the destination and renamed into place.

pub mod convert;
pub mod dataframe;
pub mod h5util;
pub mod matrix;
pub mod uns;
pub mod write;
pub mod zarr;

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use hdf5::File;

pub use dataframe::{Column, DataFrame};
pub use matrix::{CsrBlock, Matrix};

use crate::error::{Error, Hdf5Context, Result};

const HDF5_MAGIC: &[u8; 8] = b"\x89HDF\r\n\x1a\n";

/// An open .h5ad file with its validated shape and names.
pub struct AnnData {
    /// The file the user named (for messages and provenance).
    pub path: PathBuf,
    /// The .h5ad read: `path`, or its converted copy (legacy AnnData, Cell Ranger).
    pub source: PathBuf,
    /// What `path` holds.
    pub layout: convert::Layout,
    /// The HDF5 file read; for a Zarr store, an image of it in memory less its matrices' values
    /// (anndata::zarr), which are read from `zarr`.
    pub file: File,
    /// The Zarr store, when `path` is one.
    pub zarr: Option<zarr::Store>,
    pub n_obs: usize,
    pub n_vars: usize,
    pub obs_names: Vec<String>,
    pub var_names: Vec<String>,
    /// Whether X is stored (anndata writes none when X is None; the counts are then in a layer).
    pub has_x: bool,
}

/// Check that `path` exists and starts with the HDF5 signature (at 0, 512, 1024, ...).
pub fn check_hdf5_signature(path: &Path) -> Result<()> {
    let mut f = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile { path: path.into() },
        _ => Error::Io { path: path.into(), source: e },
    })?;
    if f.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(Error::BadField { path: path.into(), field: "(path)".into(), detail: "is a folder, but not a Zarr store (no .zgroup, .zattrs or zarr.json in it)".into(), hint: Some("pass an .h5ad file, or the folder of an AnnData Zarr store (`adata.write_zarr(...)`)".into()) });
    }
    let mut buf = vec![0u8; 8];
    let mut offset = 0usize;
    let mut head = Vec::new();
    // The superblock may sit after a user block of 512, 1024, 2048... bytes.
    loop {
        f.read_exact(&mut buf).ok();
        if offset == 0 {
            head = buf.clone();
        }
        if &buf[..] == HDF5_MAGIC {
            return Ok(());
        }
        let next = if offset == 0 { 512 } else { offset * 2 };
        use std::io::Seek;
        if next > 1 << 20 || f.seek(std::io::SeekFrom::Start(next as u64)).is_err() {
            break;
        }
        buf.iter_mut().for_each(|b| *b = 0);
        offset = next;
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if next as u64 >= len {
            break;
        }
    }
    let magic = if head.iter().all(|&b| b == 0) {
        "nothing readable (an empty file?)".to_string()
    } else {
        format!("{:?}", String::from_utf8_lossy(&head).chars().take(8).collect::<String>())
    };
    Err(Error::NotHdf5 { path: path.into(), magic })
}

impl AnnData {
    /// Open and validate: the file exists, is HDF5, has X, and X's shape agrees with obs and var.
    pub fn open(path: &Path) -> Result<AnnData> {
        let (source, layout, file, store) = if zarr::is_store(path) {
            let store = zarr::Store::open(path)?;
            (path.to_path_buf(), convert::Layout::AnnData, zarr::mirror(&store)?, Some(store))
        } else {
            let (source, layout) = source_of(path)?;
            let file = open_hdf5(&source)?;
            (source, layout, file, None)
        };
        for group in ["obs", "var"] {
            if !file.link_exists(group) {
                return Err(Error::BadField {
                    path: path.into(),
                    field: group.into(),
                    detail: "is missing".into(),
                    hint: Some("this HDF5 file is neither an AnnData file (no obs/var dataframes) nor a Cell Ranger matrix; the formats read are listed in docs/file-formats.md".into()),
                });
            }
        }
        let obs = file.group("obs").h5ctx(|| "opening obs".into())?;
        let var = file.group("var").h5ctx(|| "opening var".into())?;
        let obs_names = dataframe::read_index(path, &obs, "obs")?;
        let var_names = dataframe::read_index(path, &var, "var")?;
        let has_x = file.link_exists("X");
        let (n_obs, n_vars) = if has_x {
            let x = match &store {
                Some(z) => Matrix::open_zarr(path, z, "X")?,
                None => Matrix::open(path, &file, "X")?,
            };
            if x.n_rows != obs_names.len() {
                return Err(Error::ShapeObs { path: path.into(), n_obs: x.n_rows, obs_len: obs_names.len() });
            }
            if x.n_cols != var_names.len() {
                return Err(Error::ShapeVar { path: path.into(), n_vars: x.n_cols, var_len: var_names.len() });
            }
            (x.n_rows, x.n_cols)
        } else {
            // X may be None when the counts live in a layer (read with --layer) or when only
            // obsm matters (`benchmark` with --pre-integrated); without any layer or obsm there
            // is nothing to read at all. Reading X from such a file is an error (`matrix`).
            let layers = file.group("layers").and_then(|g| g.member_names()).unwrap_or_default();
            let obsm = file.group("obsm").and_then(|g| g.member_names()).unwrap_or_default();
            if layers.is_empty() && obsm.is_empty() {
                return Err(missing_x(path, &layers));
            }
            (obs_names.len(), var_names.len())
        };
        Ok(AnnData { path: path.into(), source, layout, file, zarr: store, n_obs, n_vars, obs_names, var_names, has_x })
    }

    /// Fail on zero cells, zero genes or duplicated gene names.
    pub fn check_usable(&self) -> Result<()> {
        if self.n_obs == 0 {
            return Err(Error::ZeroCells { path: self.path.clone(), n_vars: self.n_vars });
        }
        if self.n_vars == 0 {
            return Err(Error::ZeroGenes { path: self.path.clone(), n_obs: self.n_obs });
        }
        let mut seen: HashMap<&str, usize> = HashMap::with_capacity(self.var_names.len());
        for n in &self.var_names {
            *seen.entry(n.as_str()).or_default() += 1;
        }
        let mut dups: Vec<(&str, usize)> = seen.into_iter().filter(|&(_, c)| c > 1).collect();
        if !dups.is_empty() {
            dups.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
            let (name, count) = dups[0];
            return Err(Error::DuplicateVarNames { path: self.path.clone(), name: name.into(), count, n_dup: dups.len() });
        }
        Ok(())
    }

    /// The expression matrix: X, or `layers/NAME` when a layer is named.
    pub fn matrix(&self, layer: Option<&str>) -> Result<Matrix> {
        let field = match layer {
            None if !self.has_x => return Err(missing_x(&self.path, &self.group_keys("layers"))),
            None => "X".to_string(),
            Some(name) => {
                let field = format!("layers/{name}");
                if !self.file.link_exists("layers") || !self.file.group("layers").map(|g| g.link_exists(name)).unwrap_or(false) {
                    let have = self.group_keys("layers");
                    return Err(Error::BadField {
                        path: self.path.clone(),
                        field,
                        detail: "is missing".into(),
                        hint: Some(if have.is_empty() { "the file has no layers; drop `--layer` to use X".into() } else { format!("layers in this file: {}", have.join(", ")) }),
                    });
                }
                field
            }
        };
        let m = self.open_matrix(&field)?;
        if m.n_rows != self.n_obs || m.n_cols != self.n_vars {
            return Err(Error::BadField {
                path: self.path.clone(),
                field,
                detail: format!("is {} x {} but the data is {} x {}", m.n_rows, m.n_cols, self.n_obs, self.n_vars),
                hint: None,
            });
        }
        Ok(m)
    }

    /// The matrix at `field`, from the store or the file.
    fn open_matrix(&self, field: &str) -> Result<Matrix> {
        match &self.zarr {
            Some(z) => Matrix::open_zarr(&self.path, z, field),
            None => Matrix::open(&self.path, &self.file, field),
        }
    }

    /// Member names of a top-level group (obsm, varm, layers, uns), sorted.
    pub fn group_keys(&self, group: &str) -> Vec<String> {
        let mut v = self.file.group(group).and_then(|g| g.member_names()).unwrap_or_default();
        v.sort();
        v
    }

    pub fn obs(&self) -> Result<DataFrame> {
        let g = self.file.group("obs").h5ctx(|| "opening obs".into())?;
        dataframe::read_dataframe(&self.path, &g, "obs")
    }

    /// obs with only the columns named in `only` read (those it has): what `benchmark` and
    /// `transfer` need of a file whose other columns may be many, large or unreadable.
    pub fn obs_columns(&self, only: &[&str]) -> Result<DataFrame> {
        let g = self.file.group("obs").h5ctx(|| "opening obs".into())?;
        dataframe::read_dataframe_columns(&self.path, &g, "obs", Some(only))
    }

    /// The names of obs's columns, none of them read (for messages that list them).
    pub fn obs_column_names(&self) -> Result<Vec<String>> {
        let g = self.file.group("obs").h5ctx(|| "opening obs".into())?;
        Ok(dataframe::column_names(&g))
    }

    pub fn var(&self) -> Result<DataFrame> {
        let g = self.file.group("var").h5ctx(|| "opening var".into())?;
        dataframe::read_dataframe(&self.path, &g, "var")
    }

    /// `raw`, when present: its var dataframe and its matrix.
    pub fn raw(&self) -> Result<Option<(DataFrame, Matrix)>> {
        if !self.file.link_exists("raw") {
            return Ok(None);
        }
        let g = self.file.group("raw").h5ctx(|| "opening raw".into())?;
        let var_g = g.group("var").map_err(|_| Error::BadField { path: self.path.clone(), field: "raw/var".into(), detail: "is missing".into(), hint: None })?;
        let var = dataframe::read_dataframe(&self.path, &var_g, "raw/var")?;
        let m = self.open_matrix("raw/X")?;
        Ok(Some((var, m)))
    }

    /// A dense 2-D entry of obsm or varm (`group` is "obsm" or "varm") as row-major f32.
    pub fn dense_entry(&self, group: &str, key: &str) -> Result<(Vec<f32>, usize, usize)> {
        let field = format!("{group}/{key}");
        let ds = self.file.dataset(&field).map_err(|_| {
            let have = self.group_keys(group);
            Error::BadField {
                path: self.path.clone(),
                field: field.clone(),
                detail: "is missing or not a dense array".into(),
                hint: Some(if have.is_empty() { format!("the file has no {group} entries") } else { format!("{group} entries in this file: {}", have.join(", ")) }),
            }
        })?;
        let shape = ds.shape();
        let (r, c) = match shape.as_slice() {
            [r] => (*r, 1),
            [r, c] => (*r, *c),
            _ => return Err(Error::BadField { path: self.path.clone(), field, detail: format!("has shape {shape:?}, expected 2 dimensions"), hint: None }),
        };
        h5util::check_backed(&self.path, &field, &ds)?;
        let v: Vec<f32> = ds.read_raw().map_err(|e| Error::BadField { path: self.path.clone(), field: field.clone(), detail: format!("cannot be read: {e}"), hint: None })?;
        Ok((v, r, c))
    }

    /// `uns` as JSON (scalars, strings, small arrays, nested dicts).
    pub fn uns(&self) -> serde_json::Value {
        match self.file.group("uns") {
            Ok(g) => uns::read_group(&g),
            Err(_) => serde_json::json!({}),
        }
    }
}

fn missing_x(path: &Path, layers: &[String]) -> Error {
    Error::BadField {
        path: path.into(),
        field: "X".into(),
        detail: "is missing: the file holds no expression matrix".into(),
        hint: Some(if layers.is_empty() {
            "anndata writes X unless it is None, and this file has no layers either; write the counts to X or to a layer".into()
        } else {
            format!("X is None in this file; read a layer with `--layer NAME` (layers: {})", layers.join(", "))
        }),
    }
}

/// Open an HDF5 file for reading, with errors that say whether it is locked or corrupt.
fn open_hdf5(path: &Path) -> Result<File> {
    let _silence = hdf5::silence_errors(true);
    File::open(path).map_err(|e| {
        let detail = first_line(&e.to_string());
        // HDF5's own words for a lock held elsewhere ("unable to lock the file", "flock");
        // not a bare "lock", which a truncated file's "sblock->base_addr" also holds
        if !detail.contains("truncated file") && (detail.contains("lock the file") || detail.contains("flock") || detail.contains("file locking")) {
            Error::Locked { path: path.into(), detail }
        } else {
            Error::CorruptFile { path: path.into(), detail }
        }
    })
}

/// The .h5ad to read for the file the user named, and what that file is: itself when it is
/// AnnData, else its converted copy (made now when missing).
pub fn source_of(path: &Path) -> Result<(PathBuf, convert::Layout)> {
    check_hdf5_signature(path)?;
    let file = open_hdf5(path)?;
    convert::readable(path, &file)
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).to_string()
}
