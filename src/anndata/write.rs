//! Writing results: a copy of the input plus new entries, built in a temporary file beside the
//! destination and renamed into place only when complete.

use std::path::{Path, PathBuf};

use hdf5::{Dataset, File};

use hdf5::types::VarLenUnicode;

use super::dataframe::{Column, DataFrame};
use super::h5util::{require_dict, set_encoding, set_str_attr, str_array_attr};
use super::matrix::CsrBlock;
use crate::error::{Error, Hdf5Context, Result};

/// An output file under construction. Dropping it without `commit` removes the temporary file.
pub struct PendingOutput {
    pub dest: PathBuf,
    temp: tempfile::TempPath,
    pub file: Option<File>,
    /// The zarr format (2 or 3) when `dest` is a Zarr store (`.zarr`): the .h5ad built in `temp`
    /// is copied into one at `commit`.
    zarr_format: Option<u8>,
}

/// The zarr format of an output at `dest`: none for an .h5ad; for a `.zarr`, the input's format
/// when the input is a store, else 2 (read by anndata 0.8 and later, with zarr 2 or 3).
fn zarr_format_of(dest: &Path, input: Option<&super::zarr::Store>) -> Option<u8> {
    super::zarr::is_store_name(dest).then(|| input.map(|s| s.format).unwrap_or(2))
}

impl PendingOutput {
    /// Copy `input` to a temporary file in `dest`'s folder and open the copy for writing. A
    /// legacy AnnData or Cell Ranger input is represented by its converted copy.
    /// An input Zarr store is copied whole into the temporary .h5ad.
    pub fn create(input: &Path, dest: &Path) -> Result<PendingOutput> {
        let temp = temp_beside(dest)?;
        let store = if super::zarr::is_store(input) { Some(super::zarr::Store::open(input)?) } else { None };
        match &store {
            Some(z) => super::zarr::to_hdf5(z, &temp)?,
            None => {
                let (source, _) = super::source_of(input)?;
                std::fs::copy(&source, &temp).map_err(|e| Error::Io { path: temp.to_path_buf(), source: e })?;
            }
        }
        let file = File::open_rw(&temp).h5ctx(|| format!("opening the copy {} for writing", temp.display()))?;
        Ok(PendingOutput { dest: dest.into(), temp, file: Some(file), zarr_format: zarr_format_of(dest, store.as_ref()) })
    }

    /// Start a new AnnData file from nothing, in anndata's current encodings (readable by anndata
    /// 0.8 through 0.13): for inputs that cannot be copied and extended (legacy AnnData, Cell
    /// Ranger's HDF5). Fill it with [`write_dataframe`](Self::write_dataframe),
    /// [`csr_writer`](Self::csr_writer), [`write_dense`](Self::write_dense) and
    /// [`write_uns`](Self::write_uns), then `commit`.
    pub fn create_new(dest: &Path) -> Result<PendingOutput> {
        let temp = temp_beside(dest)?;
        // a temporary file is private (0600); the output gets the mode a new file gets here
        {
            use std::os::unix::fs::PermissionsExt;
            // SAFETY: umask is read by setting it and setting it back at once
            let mask = unsafe {
                let m = libc::umask(0o022);
                libc::umask(m);
                m
            };
            let _ = std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o666 & !(mask as u32)));
        }
        let file = File::create(&temp).h5ctx(|| format!("creating {}", temp.display()))?;
        set_encoding(&file, "anndata", "0.1.0").h5ctx(|| "tagging the file".into())?;
        for g in ["layers", "obsm", "obsp", "uns", "varm", "varp"] {
            require_dict(&file, g).h5ctx(|| format!("creating {g}"))?;
        }
        Ok(PendingOutput { dest: dest.into(), temp, file: Some(file), zarr_format: zarr_format_of(dest, None) })
    }

    /// A new AnnData file holding only the obs index (`obs_names`), an empty var and what the
    /// caller adds (an embedding in obsm, uns): `embed --embedding-only`. anndata reads it as
    /// n_obs x 0 with no X; the embedding joins the full data by the obs index.
    pub fn create_embedding_only(dest: &Path, obs_names: &[String]) -> Result<PendingOutput> {
        let out = Self::create_new(dest)?;
        out.write_dataframe("obs", &DataFrame { index_name: String::new(), index: obs_names.to_vec(), columns: vec![] })?;
        out.write_dataframe("var", &DataFrame::default())?;
        Ok(out)
    }

    /// Write a whole dataframe (anndata's `dataframe` 0.2.0) at `at` ("obs", "var", "raw/var").
    pub fn write_dataframe(&self, at: &str, df: &DataFrame) -> Result<()> {
        let ctx = || format!("writing {at}");
        let g = self.file().create_group(at).h5ctx(ctx)?;
        set_encoding(&g, "dataframe", "0.2.0").h5ctx(ctx)?;
        let index_name = if df.index_name.is_empty() { "_index" } else { df.index_name.as_str() };
        set_str_attr(&g, "_index", index_name).h5ctx(ctx)?;
        write_string_array(&g, index_name, &df.index).h5ctx(ctx)?;
        let order: Vec<String> = df.columns.iter().map(|(n, _)| n.clone()).collect();
        set_column_order(&g, &order).h5ctx(ctx)?;
        for (name, col) in &df.columns {
            write_column(&g, name, col).h5ctx(|| format!("writing {at}/{name}"))?;
        }
        Ok(())
    }

    /// A CSR matrix at `at` ("X", "raw/X", "layers/NAME") filled block by block.
    pub fn csr_writer(&self, at: &str, n_rows: usize, n_cols: usize) -> Result<CsrWriter> {
        let ctx = || format!("creating {at}");
        let g = self.file().create_group(at).h5ctx(ctx)?;
        set_encoding(&g, "csr_matrix", "0.1.0").h5ctx(ctx)?;
        g.new_attr::<i64>().shape([2]).create("shape").and_then(|a| a.write_raw(&[n_rows as i64, n_cols as i64])).h5ctx(ctx)?;
        let data = g.new_dataset::<f32>().chunk(CSR_CHUNK).shape(hdf5::Extents::resizable([0usize].into())).create("data").h5ctx(ctx)?;
        let indices = g.new_dataset::<i32>().chunk(CSR_CHUNK).shape(hdf5::Extents::resizable([0usize].into())).create("indices").h5ctx(ctx)?;
        Ok(CsrWriter { field: at.into(), group: g, data, indices, indptr: vec![0], n_rows })
    }

    /// A dense float32 2-D array (anndata's `array` 0.2.0) at `at`.
    pub fn write_dense(&self, at: &str, values: &[f32], rows: usize, cols: usize) -> Result<()> {
        let ctx = || format!("writing {at}");
        let ds = self.file().new_dataset::<f32>().shape([rows, cols]).create(at).h5ctx(ctx)?;
        ds.write_raw(values).h5ctx(ctx)?;
        set_encoding(&ds, "array", "0.2.0").h5ctx(ctx)
    }

    /// Write the members of a JSON object into `uns` (strings, numbers, booleans, arrays of one
    /// kind, nested objects as dicts; nulls are left out, as anndata cannot store them).
    pub fn write_uns(&self, value: &serde_json::Value) -> Result<()> {
        let uns = require_dict(self.file(), "uns").h5ctx(|| "creating uns".into())?;
        if let serde_json::Value::Object(map) = value {
            for (k, v) in map {
                write_json(&uns, k, v).h5ctx(|| format!("writing uns/{k}"))?;
            }
        }
        Ok(())
    }

    pub fn file(&self) -> &File {
        self.file.as_ref().expect("output is open")
    }

    /// Create (or replace) a dense float32 `obsm[key]` of shape n_obs x dim, to be filled in blocks.
    pub fn create_obsm(&self, key: &str, n_obs: usize, dim: usize) -> Result<Dataset> {
        let f = self.file();
        let obsm = require_dict(f, "obsm").h5ctx(|| "creating obsm".into())?;
        if obsm.link_exists(key) {
            obsm.unlink(key).h5ctx(|| format!("replacing obsm/{key}"))?;
        }
        let ds = obsm
            .new_dataset::<f32>()
            .shape([n_obs, dim])
            .create(key)
            .h5ctx(|| format!("creating obsm/{key}"))?;
        set_encoding(&ds, "array", "0.2.0").h5ctx(|| format!("tagging obsm/{key}"))?;
        Ok(ds)
    }

    /// Add (or replace) a categorical obs column (anndata's `categorical` 0.2.0): `codes` index
    /// `categories`, -1 marks a missing value.
    pub fn add_obs_categorical(&self, name: &str, codes: &[i32], categories: &[String]) -> Result<()> {
        let obs = self.obs_for(name)?;
        let col = Column::Categorical { codes: codes.iter().map(|&c| i64::from(c)).collect(), categories: categories.to_vec(), ordered: false };
        write_column(&obs, name, &col).h5ctx(|| format!("writing obs/{name}"))
    }

    /// Add (or replace) a float32 obs column (anndata's `array` 0.2.0).
    pub fn add_obs_f32(&self, name: &str, values: &[f32]) -> Result<()> {
        let obs = self.obs_for(name)?;
        let ctx = || format!("writing obs/{name}");
        let ds = obs.new_dataset::<f32>().shape([values.len()]).create(name).h5ctx(ctx)?;
        ds.write_raw(values).h5ctx(ctx)?;
        set_encoding(&ds, "array", "0.2.0").h5ctx(ctx)?;
        Ok(())
    }

    /// The obs group with `name` free and listed last in `column-order` (kept in place when it
    /// was already listed, so a replaced column keeps its position).
    fn obs_for(&self, name: &str) -> Result<hdf5::Group> {
        let obs = self.file().group("obs").h5ctx(|| "opening obs".into())?;
        if obs.link_exists(name) {
            obs.unlink(name).h5ctx(|| format!("replacing obs/{name}"))?;
        }
        let mut order = str_array_attr(&obs, "column-order").unwrap_or_default();
        if !order.iter().any(|c| c == name) {
            order.push(name.to_string());
        }
        set_column_order(&obs, &order).h5ctx(|| "writing obs column-order".into())?;
        Ok(obs)
    }

    /// Close the HDF5 handle and rename the finished file onto its destination.
    pub fn commit(mut self) -> Result<PathBuf> {
        if let Some(f) = self.file.take() {
            f.flush().h5ctx(|| "flushing the output".into())?;
            drop(f);
        }
        let dest = self.dest.clone();
        let temp_path = self.temp.to_path_buf();
        if let Some(format) = self.zarr_format {
            commit_store(&temp_path, &dest, format)?;
            drop(self.temp);
            crate::lifecycle::unregister(&temp_path);
            return Ok(dest);
        }
        self.temp.persist(&dest).map_err(|e| Error::Io { path: dest.clone(), source: e.error })?;
        crate::lifecycle::unregister(&temp_path);
        Ok(dest)
    }
}

/// Copy the finished .h5ad `h5ad` into a Zarr store staged in a temporary folder beside `dest`,
/// then rename it into place (an earlier store at `dest` is moved aside first and removed after).
fn commit_store(h5ad: &Path, dest: &Path, format: u8) -> Result<()> {
    let stage = temp_beside(dest)?;
    let stage_path = stage.to_path_buf();
    // the temporary name is taken by an empty file: the store is a folder of that name
    std::fs::remove_file(&stage_path).map_err(|e| Error::Io { path: stage_path.clone(), source: e })?;
    let staged = super::zarr::write_store(h5ad, &stage_path, format).and_then(|()| {
        let old = if dest.exists() {
            let old = stage_path.with_extension("old");
            crate::lifecycle::register(&old);
            std::fs::rename(dest, &old).map_err(|e| Error::Io { path: dest.into(), source: e })?;
            Some(old)
        } else {
            None
        };
        std::fs::rename(&stage_path, dest).map_err(|e| Error::Io { path: dest.into(), source: e })?;
        if let Some(old) = old {
            let _ = std::fs::remove_dir_all(&old);
            crate::lifecycle::unregister(&old);
        }
        Ok(())
    });
    if staged.is_err() {
        let _ = std::fs::remove_dir_all(&stage_path);
    }
    crate::lifecycle::unregister(&stage_path);
    // the TempPath would remove a file of that name: the folder is gone or renamed by now
    let _ = stage.keep();
    staged
}

impl PendingOutput {
    /// Whether the output is a Zarr store.
    pub fn is_zarr(&self) -> bool {
        self.zarr_format.is_some()
    }
}

/// Write one block of rows into a 2-D f32 dataset.
pub fn write_rows(ds: &Dataset, start: usize, values: &[f32], dim: usize) -> Result<()> {
    let rows = values.len() / dim;
    let arr = ndarray::ArrayView2::from_shape((rows, dim), values).expect("block shape");
    ds.write_slice(arr, (start..start + rows, ..)).h5ctx(|| format!("writing rows {start}..{}", start + rows))
}

/// A temporary file in `dest`'s folder (created if missing), removed unless persisted, and
/// removed too if the process is interrupted (`lifecycle`). Its name, `.{name}.{host}.{boot}.{pid}.XXXXXX.tmp`,
/// says who owns it; leftovers of killed runs on this host are swept first, with a note.
fn temp_beside(dest: &Path) -> Result<tempfile::TempPath> {
    let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::Io { path: dir.into(), source: e })?;
    let name = dest.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "out.h5ad".into());
    let prefix = format!(".{name}.");
    for p in crate::lifecycle::sweep(dir, &prefix) {
        eprintln!("note: removed {}, the unfinished output of a run that was killed", p.display());
    }
    let temp = tempfile::Builder::new()
        .prefix(&format!("{prefix}{}.", crate::lifecycle::owner_tag()))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| Error::Io { path: dir.into(), source: e })?
        .into_temp_path();
    crate::lifecycle::register(&temp);
    Ok(temp)
}

/// Stored values a chunk of a CSR matrix written by [`CsrWriter`].
const CSR_CHUNK: usize = 1 << 16;

/// A CSR matrix being written block by block (rows in order).
pub struct CsrWriter {
    field: String,
    group: hdf5::Group,
    data: Dataset,
    indices: Dataset,
    indptr: Vec<i64>,
    n_rows: usize,
}

impl CsrWriter {
    /// Append a block of rows.
    pub fn push(&mut self, block: &CsrBlock) -> Result<()> {
        let start = *self.indptr.last().unwrap_or(&0) as usize;
        let end = start + block.nnz();
        let ctx = || format!("writing {} rows {}..{}", self.field, block.start_row, block.start_row + block.n_rows());
        if end > start {
            self.data.resize([end]).h5ctx(ctx)?;
            self.indices.resize([end]).h5ctx(ctx)?;
            self.data.write_slice(&block.data, start..end).h5ctx(ctx)?;
            let idx: Vec<i32> = block.indices.iter().map(|&j| j as i32).collect();
            self.indices.write_slice(&idx, start..end).h5ctx(ctx)?;
        }
        self.indptr.extend(block.indptr[1..].iter().map(|&p| (start + p) as i64));
        Ok(())
    }

    /// Write the row offsets; every row must have been pushed.
    pub fn finish(self) -> Result<()> {
        let ctx = || format!("writing {}/indptr", self.field);
        if self.indptr.len() != self.n_rows + 1 {
            return Err(Error::BadField { path: self.group.filename().into(), field: self.field.clone(), detail: format!("{} rows written of {}", self.indptr.len() - 1, self.n_rows), hint: None });
        }
        let ds = self.group.new_dataset::<i64>().shape([self.indptr.len()]).create("indptr").h5ctx(ctx)?;
        ds.write_raw(&self.indptr).h5ctx(ctx)
    }
}

/// `column-order` as an array of strings (anndata writes an empty one too).
fn set_column_order(g: &hdf5::Group, order: &[String]) -> hdf5::Result<()> {
    if g.attr("column-order").is_ok() {
        g.delete_attr("column-order")?;
    }
    let v: Vec<VarLenUnicode> = order.iter().map(|c| c.parse().map_err(|e| hdf5::Error::from(format!("{e}")))).collect::<hdf5::Result<_>>()?;
    g.new_attr::<VarLenUnicode>().shape([v.len()]).create("column-order")?.write_raw(&v)
}

fn vlen(values: &[String]) -> hdf5::Result<Vec<VarLenUnicode>> {
    values.iter().map(|c| c.parse().map_err(|e| hdf5::Error::from(format!("{e}")))).collect()
}

/// A 1-D `string-array` 0.2.0 (variable-length UTF-8, as h5py writes).
fn write_string_array(g: &hdf5::Group, name: &str, values: &[String]) -> hdf5::Result<()> {
    let v = vlen(values)?;
    let ds = g.new_dataset::<VarLenUnicode>().shape([v.len()]).create(name)?;
    ds.write_raw(&v)?;
    set_encoding(&ds, "string-array", "0.2.0")
}

fn write_array<T: hdf5::H5Type>(g: &hdf5::Group, name: &str, values: &[T]) -> hdf5::Result<()> {
    let ds = g.new_dataset::<T>().shape([values.len()]).create(name)?;
    ds.write_raw(values)?;
    set_encoding(&ds, "array", "0.2.0")
}

/// One dataframe column in anndata's encoding for its kind.
fn write_column(g: &hdf5::Group, name: &str, col: &Column) -> hdf5::Result<()> {
    match col {
        Column::Numeric(v) => write_array(g, name, v),
        Column::Bool(v) => write_array(g, name, v),
        Column::Strings(v) => write_string_array(g, name, v),
        Column::Categorical { codes, categories, ordered } => {
            let cg = g.create_group(name)?;
            set_encoding(&cg, "categorical", "0.2.0")?;
            cg.new_attr::<bool>().shape(()).create("ordered")?.write_scalar(ordered)?;
            // the narrowest signed integer, as pandas stores codes
            let n = categories.len();
            if n < i8::MAX as usize {
                write_array(&cg, "codes", &codes.iter().map(|&v| v as i8).collect::<Vec<_>>())?;
            } else if n < i16::MAX as usize {
                write_array(&cg, "codes", &codes.iter().map(|&v| v as i16).collect::<Vec<_>>())?;
            } else {
                write_array(&cg, "codes", &codes.iter().map(|&v| v as i32).collect::<Vec<_>>())?;
            }
            write_string_array(&cg, "categories", categories)
        }
        Column::NullableInt { values, mask } => write_nullable(g, name, "nullable-integer", |cg| write_array(cg, "values", values), mask),
        Column::NullableBool { values, mask } => write_nullable(g, name, "nullable-boolean", |cg| write_array(cg, "values", values), mask),
        Column::NullableString { values, mask } => write_nullable(g, name, "nullable-string-array", |cg| write_string_array(cg, "values", values), mask),
    }
}

fn write_nullable(g: &hdf5::Group, name: &str, kind: &str, values: impl FnOnce(&hdf5::Group) -> hdf5::Result<()>, mask: &[bool]) -> hdf5::Result<()> {
    let cg = g.create_group(name)?;
    set_encoding(&cg, kind, "0.1.0")?;
    values(&cg)?;
    write_array(&cg, "mask", mask)
}

/// One JSON value as an uns element.
fn write_json(g: &hdf5::Group, name: &str, v: &serde_json::Value) -> hdf5::Result<()> {
    use serde_json::Value as V;
    match v {
        V::Null => Ok(()),
        V::Bool(b) => {
            let ds = g.new_dataset::<bool>().shape(()).create(name)?;
            ds.write_scalar(b)?;
            set_encoding(&ds, "numeric-scalar", "0.2.0")
        }
        V::Number(n) => match n.as_i64() {
            Some(i) => super::h5util::write_i64(g, name, i),
            None => super::h5util::write_f64(g, name, n.as_f64().unwrap_or(f64::NAN)),
        },
        V::String(s) => super::h5util::write_string(g, name, s),
        V::Array(items) => {
            if items.iter().all(|x| x.is_string()) && !items.is_empty() {
                let s: Vec<String> = items.iter().map(|x| x.as_str().unwrap_or_default().to_string()).collect();
                write_string_array(g, name, &s)
            } else if items.iter().all(|x| x.is_boolean()) && !items.is_empty() {
                write_array(g, name, &items.iter().map(|x| x.as_bool().unwrap_or(false)).collect::<Vec<_>>())
            } else if items.iter().all(|x| x.is_i64()) {
                write_array(g, name, &items.iter().map(|x| x.as_i64().unwrap_or(0)).collect::<Vec<_>>())
            } else if items.iter().all(|x| x.is_number()) {
                write_array(g, name, &items.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect::<Vec<_>>())
            } else {
                // mixed arrays have no anndata encoding: kept as their JSON text
                super::h5util::write_string(g, name, &v.to_string())
            }
        }
        V::Object(map) => {
            let sub = require_dict(g, name)?;
            for (k, x) in map {
                write_json(&sub, k, x)?;
            }
            Ok(())
        }
    }
}
