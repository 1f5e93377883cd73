//! The expression matrix (X, a layer, or raw/X), read in blocks of rows.
//!
//! CSR streams: each block reads only its slice of `data` and `indices`. Dense X reads a
//! hyperslab of rows. CSC cannot be sliced by rows cheaply, so it is converted to CSR in
//! memory once (with a warning from the caller).

use std::path::{Path, PathBuf};

use hdf5::{Dataset, Group};

use super::h5util::{check_backed, encoding_type, str_attr};
use crate::error::{Error, Hdf5Context, Result};

/// A block of rows in CSR form: `indptr` starts at 0 for the block's first row.
#[derive(Debug, Clone, Default)]
pub struct CsrBlock {
    pub start_row: usize,
    pub indptr: Vec<usize>,
    pub indices: Vec<u32>,
    pub data: Vec<f32>,
}

impl CsrBlock {
    pub fn n_rows(&self) -> usize {
        self.indptr.len().saturating_sub(1)
    }
    pub fn row(&self, i: usize) -> (&[u32], &[f32]) {
        let (a, b) = (self.indptr[i], self.indptr[i + 1]);
        (&self.indices[a..b], &self.data[a..b])
    }
    pub fn nnz(&self) -> usize {
        self.data.len()
    }

    /// The non-zero values of `rows` dense rows of `n_cols` values each (row-major), as a block
    /// starting at row `start_row`.
    pub fn from_dense_rows(start_row: usize, values: &[f32], n_cols: usize, rows: usize) -> CsrBlock {
        let mut block = CsrBlock { start_row, indptr: Vec::with_capacity(rows + 1), ..Default::default() };
        block.indptr.push(0);
        for r in 0..rows {
            for (j, &v) in values[r * n_cols..(r + 1) * n_cols].iter().enumerate() {
                if v != 0.0 {
                    block.indices.push(j as u32);
                    block.data.push(v);
                }
            }
            block.indptr.push(block.data.len());
        }
        block
    }

    /// Columns in increasing order within each row, duplicates summed, as scipy's
    /// `sum_duplicates()`: a CSR matrix may legally hold either (anndata writes what scipy had),
    /// and every reader downstream expects neither. Rows already canonical are left as they are.
    pub fn canonical(mut self) -> CsrBlock {
        let ok = (0..self.n_rows()).all(|i| self.row(i).0.windows(2).all(|w| w[0] < w[1]));
        if ok {
            return self;
        }
        let mut indptr = vec![0usize];
        let (mut indices, mut data) = (Vec::with_capacity(self.indices.len()), Vec::with_capacity(self.data.len()));
        let mut pairs: Vec<(u32, f32)> = Vec::new();
        for i in 0..self.n_rows() {
            let (idx, val) = self.row(i);
            pairs.clear();
            pairs.extend(idx.iter().copied().zip(val.iter().copied()));
            pairs.sort_by_key(|p| p.0);
            for &(j, v) in &pairs {
                if indices.len() > *indptr.last().unwrap() && *indices.last().unwrap() == j {
                    *data.last_mut().unwrap() += v;
                } else {
                    indices.push(j);
                    data.push(v);
                }
            }
            indptr.push(indices.len());
        }
        self.indptr = indptr;
        self.indices = indices;
        self.data = data;
        self
    }
}

/// How the matrix is stored.
pub enum Storage {
    Dense(Dataset),
    Csr { data: Dataset, indices: Dataset, indptr: Vec<u64> },
    /// CSC converted to CSR in memory.
    InMemory { indptr: Vec<u64>, indices: Vec<u32>, data: Vec<f32> },
    /// A dense array of a Zarr store, read by rows.
    ZarrDense(super::zarr::ZArray),
    /// A CSR matrix of a Zarr store: `data` and `indices` read by `indptr` ranges.
    ZarrCsr { data: super::zarr::ZArray, indices: super::zarr::ZArray, indptr: Vec<u64> },
}

/// A matrix inside an .h5ad file.
/// The row ranges [`Matrix::read_rows`] read in this process, in order: a task reports what it
/// read, so that a test can check that a shard reads only its own rows.
static ROWS_READ: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

/// Note rows `start..end` as read: [`Matrix::read_rows`] does, and so does a method that reads
/// rows of a matrix derived from X (a shard reading its rows of a fit's normalised matrix).
pub fn note_rows_read(start: usize, end: usize) {
    if let Ok(mut v) = ROWS_READ.lock() {
        match v.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => v.push((start, end)),
        }
    }
}

/// The row ranges read so far by this process (`start..end` each), in order.
pub fn rows_read() -> Vec<(usize, usize)> {
    ROWS_READ.lock().map(|v| v.clone()).unwrap_or_default()
}

pub struct Matrix {
    pub path: PathBuf,
    /// Where in the file: `X`, `layers/counts`, `raw/X`.
    pub field: String,
    pub n_rows: usize,
    pub n_cols: usize,
    pub storage: Storage,
    /// The on-disk element type, for messages and provenance.
    pub dtype: String,
    /// The stored format, `dense`, `csr` or `csc`.
    pub format: &'static str,
}

fn bad(path: &Path, field: &str, detail: impl Into<String>, hint: Option<&str>) -> Error {
    Error::BadField { path: path.to_path_buf(), field: field.into(), detail: detail.into(), hint: hint.map(str::to_string) }
}

fn dtype_name(ds: &Dataset) -> String {
    use hdf5::types::TypeDescriptor as T;
    match ds.dtype().and_then(|t| t.to_descriptor()) {
        Ok(T::Float(s)) => format!("float{}", s as usize * 8),
        Ok(T::Integer(s)) => format!("int{}", s as usize * 8),
        Ok(T::Unsigned(s)) => format!("uint{}", s as usize * 8),
        Ok(T::Boolean) => "bool".into(),
        Ok(other) => format!("{other}"),
        Err(_) => "unknown".into(),
    }
}

fn ensure_numeric(path: &Path, field: &str, ds: &Dataset) -> Result<()> {
    use hdf5::types::TypeDescriptor as T;
    match ds.dtype().and_then(|t| t.to_descriptor()) {
        Ok(T::Float(_) | T::Integer(_) | T::Unsigned(_) | T::Boolean) => Ok(()),
        Ok(other) => Err(bad(path, field, format!("holds {other}, not numbers"), None)),
        Err(e) => Err(bad(path, field, format!("unreadable type: {e}"), None)),
    }
}

fn read_index_vec(path: &Path, field: &str, ds: &Dataset) -> Result<Vec<u64>> {
    check_backed(path, field, ds)?;
    let v: Vec<i64> = ds.read_raw::<i64>().map_err(|e| bad(path, field, format!("cannot be read: {e}"), Some(CORRUPT_HINT)))?;
    v.into_iter()
        .map(|x| u64::try_from(x).map_err(|_| bad(path, field, format!("holds a negative offset ({x})"), None)))
        .collect()
}

const CORRUPT_HINT: &str = "the file may be truncated or corrupt: copy it again, or rewrite it with anndata";

impl Matrix {
    /// Open the matrix stored at `field` (a dataset for dense, a group for sparse).
    pub fn open(path: &Path, file: &Group, field: &str) -> Result<Matrix> {
        let loc_type = file.loc_type_by_name(field).map_err(|_| {
            bad(path, field, "is missing", Some("an AnnData file stores its matrix in `X`; a layer is named with `--layer NAME`"))
        })?;
        match loc_type {
            hdf5::LocationType::Dataset => {
                let ds = file.dataset(field).h5ctx(|| format!("opening {field}"))?;
                ensure_numeric(path, field, &ds)?;
                check_backed(path, field, &ds)?;
                let shape = ds.shape();
                if shape.len() != 2 {
                    return Err(bad(path, field, format!("is a {}-dimensional array, expected 2 (cells x genes)", shape.len()), None));
                }
                Ok(Matrix {
                    path: path.to_path_buf(),
                    field: field.into(),
                    n_rows: shape[0],
                    n_cols: shape[1],
                    dtype: dtype_name(&ds),
                    storage: Storage::Dense(ds),
                    format: "dense",
                })
            }
            hdf5::LocationType::Group => {
                let g = file.group(field).h5ctx(|| format!("opening {field}"))?;
                let enc = encoding_type(&g).or_else(|| str_attr(&g, "h5sparse_format").map(|f| format!("{f}_matrix")));
                let enc = enc.ok_or_else(|| {
                    bad(path, field, "is a group without an `encoding-type` attribute, so not a matrix anndata wrote", Some("the formats read are listed in docs/file-formats.md; rewrite the file with a current anndata"))
                })?;
                // anndata writes the shape as an attribute `shape`; anndata < 0.7 (h5sparse) as `h5sparse_shape`
                let shape: Vec<i64> = g
                    .attr("shape")
                    .or_else(|_| g.attr("h5sparse_shape"))
                    .and_then(|a| a.read_raw::<i64>())
                    .map_err(|_| bad(path, &format!("{field}.attrs['shape']"), "is missing or unreadable", Some(CORRUPT_HINT)))?;
                if shape.len() != 2 || shape.iter().any(|&s| s < 0) {
                    return Err(bad(path, &format!("{field}.attrs['shape']"), format!("is {shape:?}, expected two sizes"), None));
                }
                let (n_rows, n_cols) = (shape[0] as usize, shape[1] as usize);
                match enc.as_str() {
                    "csr_matrix" => Matrix::from_csr_group(path, &g, field, n_rows, n_cols),
                    "csc_matrix" => {
                        let (data, indices, indptr, dtype) = compressed_parts(path, &g, field, n_cols)?;
                        let storage = csc_to_csr(path, field, &data, &indices, &indptr, n_rows, n_cols)?;
                        Ok(Matrix { path: path.into(), field: field.into(), n_rows, n_cols, dtype, format: "csc", storage })
                    }
                    other => Err(bad(path, field, format!("has encoding `{other}`, expected csr_matrix, csc_matrix or a dense array"), None)),
                }
            }
            _ => Err(bad(path, field, "is neither a dataset nor a group", None)),
        }
    }

    /// Open the matrix at `field` of a Zarr store (a dense array, or a csr_matrix or csc_matrix
    /// group), checked as [`Matrix::open`] checks an .h5ad's.
    pub fn open_zarr(path: &Path, store: &super::zarr::Store, field: &str) -> Result<Matrix> {
        use super::zarr::Kind;
        match store.kind(field) {
            None => Err(bad(path, field, "is missing", Some("an AnnData store keeps its matrix in `X`; a layer is named with `--layer NAME`"))),
            Some(Kind::Array) => {
                let a = store.array(field)?;
                let elem = a.elem()?;
                if !elem.is_numeric() {
                    return Err(bad(path, field, format!("holds {}, not numbers", elem.name()), None));
                }
                let shape = a.shape();
                if shape.len() != 2 {
                    return Err(bad(path, field, format!("is a {}-dimensional array, expected 2 (cells x genes)", shape.len()), None));
                }
                Ok(Matrix { path: path.into(), field: field.into(), n_rows: shape[0], n_cols: shape[1], dtype: elem.name().into(), storage: Storage::ZarrDense(a), format: "dense" })
            }
            Some(Kind::Group) => {
                let attrs = store.attributes(field);
                let enc = attrs.get("encoding-type").and_then(|v| v.as_str()).map(str::to_string).ok_or_else(|| {
                    bad(path, field, "is a group without an `encoding-type` attribute, so not a matrix anndata wrote", Some("the formats read are listed in docs/file-formats.md; rewrite the store with a current anndata"))
                })?;
                let shape: Vec<i64> = attrs
                    .get("shape")
                    .and_then(|v| v.as_array())
                    .map(|v| v.iter().filter_map(|x| x.as_i64()).collect())
                    .ok_or_else(|| bad(path, &format!("{field}.attrs['shape']"), "is missing or unreadable", Some(CORRUPT_HINT)))?;
                if shape.len() != 2 || shape.iter().any(|&s| s < 0) {
                    return Err(bad(path, &format!("{field}.attrs['shape']"), format!("is {shape:?}, expected two sizes"), None));
                }
                let (n_rows, n_cols) = (shape[0] as usize, shape[1] as usize);
                let n_major = if enc == "csc_matrix" { n_cols } else { n_rows };
                if enc != "csr_matrix" && enc != "csc_matrix" {
                    return Err(bad(path, field, format!("has encoding `{enc}`, expected csr_matrix, csc_matrix or a dense array"), None));
                }
                for part in ["data", "indices", "indptr"] {
                    if store.kind(&format!("{field}/{part}")) != Some(Kind::Array) {
                        return Err(bad(path, &format!("{field}/{part}"), "is missing", Some(CORRUPT_HINT)));
                    }
                }
                let data = store.array(&format!("{field}/data"))?;
                let elem = data.elem()?;
                if !elem.is_numeric() {
                    return Err(bad(path, &format!("{field}/data"), format!("holds {}, not numbers", elem.name()), None));
                }
                let indices = store.array(&format!("{field}/indices"))?;
                let indptr_a = store.array(&format!("{field}/indptr"))?;
                let indptr: Vec<u64> = indptr_a
                    .read_i64(0, indptr_a.len())?
                    .into_iter()
                    .map(|x| u64::try_from(x).map_err(|_| bad(path, &format!("{field}/indptr"), format!("holds a negative offset ({x})"), None)))
                    .collect::<Result<_>>()?;
                let nnz = data.len() as u64;
                if indices.len() as u64 != nnz {
                    return Err(bad(path, &format!("{field}/indices"), format!("has {} entries but data has {nnz}", indices.len()), Some(CORRUPT_HINT)));
                }
                check_indptr(path, field, &indptr, n_major, nnz)?;
                let dtype = elem.name().to_string();
                if enc == "csr_matrix" {
                    return Ok(Matrix { path: path.into(), field: field.into(), n_rows, n_cols, dtype, format: "csr", storage: Storage::ZarrCsr { data, indices, indptr } });
                }
                // CSC: read whole and turned into CSR, as for an .h5ad
                let vals = data.read_f32(0, data.len())?;
                let rows = indices.read_i64(0, indices.len())?;
                let storage = csc_parts_to_csr(path, field, vals, rows, &indptr, n_rows, n_cols)?;
                Ok(Matrix { path: path.into(), field: field.into(), n_rows, n_cols, dtype, format: "csc", storage })
            }
        }
    }

    /// A CSR matrix from the `data`, `indices` and `indptr` datasets of `g` (anndata's csr_matrix,
    /// or Cell Ranger's genes x cells CSC read as cells x genes).
    pub fn from_csr_group(path: &Path, g: &Group, field: &str, n_rows: usize, n_cols: usize) -> Result<Matrix> {
        let (data, indices, indptr, dtype) = compressed_parts(path, g, field, n_rows)?;
        Ok(Matrix { path: path.into(), field: field.into(), n_rows, n_cols, dtype, format: "csr", storage: Storage::Csr { data, indices, indptr } })
    }

    pub fn nnz_estimate(&self) -> u64 {
        match &self.storage {
            Storage::Dense(_) | Storage::ZarrDense(_) => (self.n_rows * self.n_cols) as u64,
            Storage::Csr { indptr, .. } | Storage::InMemory { indptr, .. } | Storage::ZarrCsr { indptr, .. } => *indptr.last().unwrap_or(&0),
        }
    }

    /// Suggested block boundaries: about `target_nnz` stored values a block, at least one row.
    pub fn blocks(&self, target_nnz: u64) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        match &self.storage {
            Storage::Dense(_) | Storage::ZarrDense(_) => {
                let rows = ((target_nnz as usize) / self.n_cols.max(1)).max(1);
                let mut s = 0;
                while s < self.n_rows {
                    let e = (s + rows).min(self.n_rows);
                    out.push((s, e));
                    s = e;
                }
            }
            Storage::Csr { indptr, .. } | Storage::InMemory { indptr, .. } | Storage::ZarrCsr { indptr, .. } => {
                let mut s = 0;
                while s < self.n_rows {
                    let mut e = s + 1;
                    // grow by doubling-free scan; cheap since indptr is in memory
                    while e < self.n_rows && indptr[e + 1] - indptr[s] <= target_nnz && e - s < 65536 {
                        e += 1;
                    }
                    out.push((s, e));
                    s = e;
                }
            }
        }
        out
    }

    /// The rows `rows` (increasing, distinct) as runs of consecutive rows `start..end`, each
    /// of about `target_nnz` stored values at most (and at most 65,536 rows, at least one
    /// row): reading each run with [`Matrix::read_rows`] reads these rows and no other.
    pub fn row_runs(&self, rows: &[usize], target_nnz: u64) -> Vec<(usize, usize)> {
        let nnz = |s: usize, e: usize| -> u64 {
            match &self.storage {
                Storage::Dense(_) | Storage::ZarrDense(_) => ((e - s) * self.n_cols) as u64,
                Storage::Csr { indptr, .. } | Storage::InMemory { indptr, .. } | Storage::ZarrCsr { indptr, .. } => indptr[e] - indptr[s],
            }
        };
        let mut out: Vec<(usize, usize)> = Vec::new();
        for &r in rows {
            match out.last_mut() {
                Some(last) if last.1 == r && r - last.0 < 65_536 && nnz(last.0, r + 1) <= target_nnz => last.1 = r + 1,
                _ => out.push((r, r + 1)),
            }
        }
        out
    }

    /// Read rows `start..end` as a CSR block of f32 values.
    /// Column indices of a sparse slice as u32, each checked to lie inside the matrix.
    fn checked_columns(&self, idx: &[i64]) -> Result<Vec<u32>> {
        idx.iter()
            .map(|&j| {
                if j < 0 || j as usize >= self.n_cols {
                    Err(bad(&self.path, &format!("{}/indices", self.field), format!("holds column {j}, outside 0..{}", self.n_cols), Some(CORRUPT_HINT)))
                } else {
                    Ok(j as u32)
                }
            })
            .collect()
    }

    pub fn read_rows(&self, start: usize, end: usize) -> Result<CsrBlock> {
        note_rows_read(start, end);
        self.read_rows_unnoted(start, end)
    }

    /// [`Matrix::read_rows`] without noting the rows as read: for a bounded sample of the whole
    /// matrix that every task of a run reads alike (the gene match's share of the counts,
    /// `tasks::genes`), which is no part of a shard's own work.
    pub fn read_rows_unnoted(&self, start: usize, end: usize) -> Result<CsrBlock> {
        let field = &self.field;
        match &self.storage {
            Storage::Dense(ds) => {
                let arr: ndarray::Array2<f32> = ds
                    .read_slice_2d((start..end, ..))
                    .map_err(|e| bad(&self.path, field, format!("rows {start}..{end} cannot be read: {e}"), Some(CORRUPT_HINT)))?;
                let (vals, _) = arr.into_raw_vec_and_offset();
                Ok(CsrBlock::from_dense_rows(start, &vals, self.n_cols, end - start))
            }
            Storage::Csr { data, indices, indptr } => {
                let (a, b) = (indptr[start] as usize, indptr[end] as usize);
                let vals = read_values(data, a..b)
                    .map_err(|e| bad(&self.path, &format!("{field}/data"), format!("entries {a}..{b} cannot be read: {e}"), Some(CORRUPT_HINT)))?;
                let idx = read_indices(indices, a..b)
                    .map_err(|e| bad(&self.path, &format!("{field}/indices"), format!("entries {a}..{b} cannot be read: {e}"), Some(CORRUPT_HINT)))?;
                let out_idx = self.checked_columns(&idx)?;
                let ip = indptr[start..=end].iter().map(|&p| (p - a as u64) as usize).collect();
                Ok(CsrBlock { start_row: start, indptr: ip, indices: out_idx, data: vals }.canonical())
            }
            Storage::ZarrDense(arr) => {
                let vals = arr.read_f32(start, end)?;
                Ok(CsrBlock::from_dense_rows(start, &vals, self.n_cols, end - start))
            }
            Storage::ZarrCsr { data, indices, indptr } => {
                let (a, b) = (indptr[start] as usize, indptr[end] as usize);
                let vals = if b > a { data.read_f32(a, b)? } else { Vec::new() };
                let idx = if b > a { indices.read_i64(a, b)? } else { Vec::new() };
                let out_idx = self.checked_columns(&idx)?;
                let ip = indptr[start..=end].iter().map(|&p| (p - a as u64) as usize).collect();
                Ok(CsrBlock { start_row: start, indptr: ip, indices: out_idx, data: vals }.canonical())
            }
            Storage::InMemory { indptr, indices, data } => {
                let (a, b) = (indptr[start] as usize, indptr[end] as usize);
                let ip = indptr[start..=end].iter().map(|&p| (p as usize) - a).collect();
                Ok(CsrBlock { start_row: start, indptr: ip, indices: indices[a..b].to_vec(), data: data[a..b].to_vec() }.canonical())
            }
        }
    }
}

/// Read a slice in the stored type (HDF5's own type conversion is slow) and convert here.
fn read_native<T: hdf5::H5Type + Copy>(ds: &Dataset, r: std::ops::Range<usize>) -> hdf5::Result<Vec<T>> {
    Ok(ds.read_slice_1d::<T, _>(r)?.into_raw_vec_and_offset().0)
}

/// Values of a sparse `data` slice as f32, whatever the stored numeric type.
fn read_values(ds: &Dataset, r: std::ops::Range<usize>) -> hdf5::Result<Vec<f32>> {
    use hdf5::types::{FloatSize, IntSize, TypeDescriptor as T};
    Ok(match ds.dtype()?.to_descriptor()? {
        T::Float(FloatSize::U4) => read_native::<f32>(ds, r)?,
        T::Float(FloatSize::U8) => read_native::<f64>(ds, r)?.into_iter().map(|v| v as f32).collect(),
        T::Integer(IntSize::U4) => read_native::<i32>(ds, r)?.into_iter().map(|v| v as f32).collect(),
        T::Integer(IntSize::U8) => read_native::<i64>(ds, r)?.into_iter().map(|v| v as f32).collect(),
        T::Unsigned(IntSize::U4) => read_native::<u32>(ds, r)?.into_iter().map(|v| v as f32).collect(),
        T::Unsigned(IntSize::U2) => read_native::<u16>(ds, r)?.into_iter().map(|v| v as f32).collect(),
        T::Integer(IntSize::U2) => read_native::<i16>(ds, r)?.into_iter().map(|v| v as f32).collect(),
        _ => read_native::<f32>(ds, r)?,
    })
}

/// Column indices as i64 (int32 or int64 on disk, signed or not).
fn read_indices(ds: &Dataset, r: std::ops::Range<usize>) -> hdf5::Result<Vec<i64>> {
    use hdf5::types::{IntSize, TypeDescriptor as T};
    Ok(match ds.dtype()?.to_descriptor()? {
        T::Integer(IntSize::U4) => read_native::<i32>(ds, r)?.into_iter().map(i64::from).collect(),
        T::Unsigned(IntSize::U4) => read_native::<u32>(ds, r)?.into_iter().map(i64::from).collect(),
        T::Integer(IntSize::U8) => read_native::<i64>(ds, r)?,
        T::Unsigned(IntSize::U8) => read_native::<u64>(ds, r)?.into_iter().map(|v| v as i64).collect(),
        _ => read_native::<i64>(ds, r)?,
    })
}

/// The three datasets of a compressed sparse matrix, checked: `indptr` has `n_major + 1` valid
/// offsets and `indices` as many entries as `data`.
fn compressed_parts(path: &Path, g: &Group, field: &str, n_major: usize) -> Result<(Dataset, Dataset, Vec<u64>, String)> {
    for part in ["data", "indices", "indptr"] {
        if !g.link_exists(part) {
            return Err(bad(path, &format!("{field}/{part}"), "is missing", Some(CORRUPT_HINT)));
        }
    }
    let data = g.dataset("data").h5ctx(|| format!("opening {field}/data"))?;
    ensure_numeric(path, &format!("{field}/data"), &data)?;
    let indices = g.dataset("indices").h5ctx(|| format!("opening {field}/indices"))?;
    let indptr_ds = g.dataset("indptr").h5ctx(|| format!("opening {field}/indptr"))?;
    let indptr = read_index_vec(path, &format!("{field}/indptr"), &indptr_ds)?;
    let nnz = data.size() as u64;
    if indices.size() as u64 != nnz {
        return Err(bad(path, &format!("{field}/indices"), format!("has {} entries but data has {nnz}", indices.size()), Some(CORRUPT_HINT)));
    }
    check_indptr(path, field, &indptr, n_major, nnz)?;
    let dtype = dtype_name(&data);
    Ok((data, indices, indptr, dtype))
}

fn check_indptr(path: &Path, field: &str, indptr: &[u64], n: usize, nnz: u64) -> Result<()> {
    let f = format!("{field}/indptr");
    if indptr.len() != n + 1 {
        return Err(bad(path, &f, format!("has {} entries, expected {} (one more than the number of rows or columns)", indptr.len(), n + 1), Some(CORRUPT_HINT)));
    }
    if indptr[0] != 0 || *indptr.last().unwrap() != nnz || indptr.windows(2).any(|w| w[0] > w[1]) {
        return Err(bad(path, &f, format!("is not a valid offset array (first {}, last {}, {nnz} stored values)", indptr[0], indptr.last().unwrap()), Some(CORRUPT_HINT)));
    }
    Ok(())
}

fn csc_to_csr(path: &Path, field: &str, data: &Dataset, indices: &Dataset, indptr: &[u64], n_rows: usize, n_cols: usize) -> Result<Storage> {
    check_backed(path, &format!("{field}/data"), data)?;
    check_backed(path, &format!("{field}/indices"), indices)?;
    let vals: Vec<f32> = data.read_raw().map_err(|e| bad(path, &format!("{field}/data"), format!("cannot be read: {e}"), Some(CORRUPT_HINT)))?;
    let rows: Vec<i64> = indices.read_raw().map_err(|e| bad(path, &format!("{field}/indices"), format!("cannot be read: {e}"), Some(CORRUPT_HINT)))?;
    csc_parts_to_csr(path, field, vals, rows, indptr, n_rows, n_cols)
}

/// A CSC matrix's values, row indices and column offsets as an in-memory CSR matrix.
fn csc_parts_to_csr(path: &Path, field: &str, vals: Vec<f32>, rows: Vec<i64>, indptr: &[u64], n_rows: usize, n_cols: usize) -> Result<Storage> {
    let mut counts = vec![0u64; n_rows + 1];
    for &r in &rows {
        if r < 0 || r as usize >= n_rows {
            return Err(bad(path, &format!("{field}/indices"), format!("holds row {r}, outside 0..{n_rows}"), Some(CORRUPT_HINT)));
        }
        counts[r as usize + 1] += 1;
    }
    for i in 0..n_rows {
        counts[i + 1] += counts[i];
    }
    let mut next: Vec<u64> = counts[..n_rows].to_vec();
    let mut out_idx = vec![0u32; vals.len()];
    let mut out_val = vec![0f32; vals.len()];
    for c in 0..n_cols {
        for p in indptr[c] as usize..indptr[c + 1] as usize {
            let r = rows[p] as usize;
            let dst = next[r] as usize;
            out_idx[dst] = c as u32;
            out_val[dst] = vals[p];
            next[r] += 1;
        }
    }
    Ok(Storage::InMemory { indptr: counts, indices: out_idx, data: out_val })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_memory(row_nnz: &[u64]) -> Matrix {
        let mut indptr = vec![0u64];
        for n in row_nnz {
            indptr.push(indptr.last().unwrap() + n);
        }
        let nnz = *indptr.last().unwrap() as usize;
        Matrix {
            path: "m.h5ad".into(),
            field: "X".into(),
            n_rows: row_nnz.len(),
            n_cols: 10,
            storage: Storage::InMemory { indptr, indices: vec![0; nnz], data: vec![1.0; nnz] },
            dtype: "float32".into(),
            format: "csr",
        }
    }

    #[test]
    fn row_runs_join_consecutive_rows_and_stop_at_the_values_budget() {
        let m = in_memory(&[2, 2, 2, 2, 2, 2, 2, 2]);
        assert_eq!(m.row_runs(&[0, 1, 2, 5, 7], 100), vec![(0, 3), (5, 6), (7, 8)]);
        // at most 4 stored values a run (a row larger than the budget is a run alone)
        assert_eq!(m.row_runs(&[0, 1, 2, 3, 4], 4), vec![(0, 2), (2, 4), (4, 5)]);
        assert_eq!(m.row_runs(&[3], 1), vec![(3, 4)]);
        assert!(m.row_runs(&[], 4).is_empty());
    }
}
