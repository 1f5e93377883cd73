//! AnnData Zarr stores (anndata's `write_zarr`): format v2 and v3, sharded or not, consolidated
//! metadata or not, through the zarrs crate (Blosc, Zstandard, gzip, vlen-utf8 strings).
//!
//! The encoding is the one of .h5ad (`encoding-type` and `encoding-version` in `.zattrs` for v2,
//! in `attributes` of zarr.json for v3). How it is read:
//! - the matrices (X, `layers/*`, `raw/X`) stay in the store and are read in blocks of rows
//!   ([`ZArray`], behind `matrix::Storage`): a CSR matrix by `indptr` ranges of `data` and
//!   `indices`, a dense one by rows, so a task reads only the chunks holding its rows;
//! - everything else (obs, var, obsm, varm, uns; the structure and attributes of the matrices
//!   and of obsp/varp, without their values) is copied once into an HDF5 image in memory ([`mirror`]), which the
//!   .h5ad readers read as they read a file: one reader of the encoding for both formats.
//!
//! Writing goes through an .h5ad: an output is built as today in a temporary .h5ad, then
//! [`write_store`] copies it into a Zarr store staged in a temporary folder beside the
//! destination and renamed into place. An input store is copied into that temporary .h5ad whole
//! ([`to_hdf5`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hdf5::types::{TypeDescriptor, VarLenUnicode};
use serde_json::{json, Value};
use zarrs::array::{Array, ArraySubset};
use zarrs::filesystem::FilesystemStore;
use zarrs::group::Group as ZGroup;

use crate::error::{Error, Result};

/// Values of a 1-D array copied at a time, and rows of a 2-D one at most this many values.
const COPY_BLOCK: usize = 1 << 20;

/// Whether `path` is a Zarr store: a folder with `.zgroup`/`.zattrs` (v2) or `zarr.json` (v3).
pub fn is_store(path: &Path) -> bool {
    path.is_dir() && [".zgroup", ".zattrs", "zarr.json"].iter().any(|f| path.join(f).is_file())
}

/// Whether an output path names a Zarr store (ends in `.zarr`).
pub fn is_store_name(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("zarr"))
}

/// What a node of the store is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Group,
    Array,
}

/// An open Zarr store.
#[derive(Clone)]
pub struct Store {
    /// The store's folder (for messages).
    pub path: PathBuf,
    storage: Arc<FilesystemStore>,
    /// 2 or 3: the zarr format of the root group.
    pub format: u8,
}

fn bad(path: &Path, field: &str, detail: impl Into<String>) -> Error {
    Error::BadField { path: path.into(), field: field.into(), detail: detail.into(), hint: None }
}

const CORRUPT_HINT: &str = "the store may be incomplete or corrupt: copy it again, or rewrite it with anndata (`adata.write_zarr(...)`)";

/// The zarrs path of `at` ("" is the root).
fn node_path(at: &str) -> String {
    format!("/{}", at.trim_matches('/'))
}

impl Store {
    pub fn open(path: &Path) -> Result<Store> {
        let storage = FilesystemStore::new(path).map_err(|e| bad(path, "(store)", format!("cannot be opened as a Zarr store: {e}")))?;
        let format = if path.join("zarr.json").is_file() { 3 } else { 2 };
        let s = Store { path: path.into(), storage: Arc::new(storage), format };
        s.group("")?;
        Ok(s)
    }

    /// Whether `at` is a group, an array, or nothing.
    pub fn kind(&self, at: &str) -> Option<Kind> {
        let dir = self.path.join(at);
        if dir.join(".zarray").is_file() {
            return Some(Kind::Array);
        }
        if dir.join(".zgroup").is_file() {
            return Some(Kind::Group);
        }
        let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("zarr.json")).ok()?).ok()?;
        match meta.get("node_type").and_then(Value::as_str) {
            Some("array") => Some(Kind::Array),
            Some("group") => Some(Kind::Group),
            _ => None,
        }
    }

    /// The members of group `at`, sorted by name.
    pub fn members(&self, at: &str) -> Vec<(String, Kind)> {
        let mut out: Vec<(String, Kind)> = std::fs::read_dir(self.path.join(at))
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| {
                        let name = e.file_name().to_string_lossy().to_string();
                        let child = if at.is_empty() { name.clone() } else { format!("{at}/{name}") };
                        self.kind(&child).map(|k| (name, k))
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }

    fn group(&self, at: &str) -> Result<ZGroup<FilesystemStore>> {
        ZGroup::open(self.storage.clone(), &node_path(at)).map_err(|e| bad(&self.path, if at.is_empty() { "(root)" } else { at }, format!("is not a readable Zarr group: {e}")))
    }

    /// Open the array at `at`.
    pub fn array(&self, at: &str) -> Result<ZArray> {
        let a = Array::open(self.storage.clone(), &node_path(at)).map_err(|e| Error::BadField {
            path: self.path.clone(),
            field: at.into(),
            detail: format!("is not a readable Zarr array: {e}"),
            hint: Some("the codecs read are those zarr-python writes by default (Blosc, Zstandard, gzip, vlen-utf8); docs/file-formats.md lists them".into()),
        })?;
        Ok(ZArray { path: self.path.clone(), field: at.into(), array: a })
    }

    /// The attributes of the node at `at`.
    pub fn attributes(&self, at: &str) -> serde_json::Map<String, Value> {
        match self.kind(at) {
            Some(Kind::Array) => self.array(at).map(|a| a.array.attributes().clone()).unwrap_or_default(),
            Some(Kind::Group) => self.group(at).map(|g| g.attributes().clone()).unwrap_or_default(),
            None => Default::default(),
        }
    }
}

/// One array of a store.
pub struct ZArray {
    path: PathBuf,
    pub field: String,
    array: Array<FilesystemStore>,
}

/// The element types read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    Bool,
    Str,
}

impl Elem {
    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "float32",
            Elem::F64 => "float64",
            Elem::I8 => "int8",
            Elem::I16 => "int16",
            Elem::I32 => "int32",
            Elem::I64 => "int64",
            Elem::U8 => "uint8",
            Elem::U16 => "uint16",
            Elem::U32 => "uint32",
            Elem::U64 => "uint64",
            Elem::Bool => "bool",
            Elem::Str => "string",
        }
    }
    pub fn is_numeric(self) -> bool {
        !matches!(self, Elem::Str)
    }
}

impl ZArray {
    pub fn shape(&self) -> Vec<usize> {
        self.array.shape().iter().map(|&s| s as usize).collect()
    }

    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type, or an error naming the stored one.
    pub fn elem(&self) -> Result<Elem> {
        use zarrs::array::data_type as dt;
        let t = self.array.data_type();
        Ok(if t.is::<dt::Float32DataType>() {
            Elem::F32
        } else if t.is::<dt::Float64DataType>() {
            Elem::F64
        } else if t.is::<dt::Int8DataType>() {
            Elem::I8
        } else if t.is::<dt::Int16DataType>() {
            Elem::I16
        } else if t.is::<dt::Int32DataType>() {
            Elem::I32
        } else if t.is::<dt::Int64DataType>() {
            Elem::I64
        } else if t.is::<dt::UInt8DataType>() {
            Elem::U8
        } else if t.is::<dt::UInt16DataType>() {
            Elem::U16
        } else if t.is::<dt::UInt32DataType>() {
            Elem::U32
        } else if t.is::<dt::UInt64DataType>() {
            Elem::U64
        } else if t.is::<dt::BoolDataType>() {
            Elem::Bool
        } else if t.is::<dt::StringDataType>() || t.is::<dt::FixedLengthUTF32DataType>() {
            // numpy's `<U` strings (anndata 0.10 writes scalar strings so) read as strings too
            Elem::Str
        } else {
            let meta = serde_json::to_value(self.array.metadata()).unwrap_or_default();
            let name = meta.get("data_type").or_else(|| meta.get("dtype")).cloned().unwrap_or_default();
            return Err(bad(&self.path, &self.field, format!("holds the Zarr data type {name}, which scfoundry does not read")));
        })
    }

    fn subset(&self, start: usize, end: usize) -> ArraySubset {
        let shape = self.array.shape();
        let mut ranges = vec![start as u64..end as u64];
        ranges.extend(shape.iter().skip(1).map(|&s| 0..s));
        ArraySubset::new_with_ranges(&ranges)
    }

    /// Elements `start..end` along the first dimension (whole rows of a 2-D array), in the stored
    /// type.
    pub fn read<T: zarrs::array::ElementOwned>(&self, start: usize, end: usize) -> Result<Vec<T>> {
        let sub = if self.array.shape().is_empty() { ArraySubset::new_with_ranges(&[]) } else { self.subset(start, end) };
        self.array
            .retrieve_array_subset::<Vec<T>>(&sub)
            .map_err(|e| Error::BadField { path: self.path.clone(), field: self.field.clone(), detail: format!("entries {start}..{end} cannot be read: {e}"), hint: Some(CORRUPT_HINT.into()) })
    }

    /// Strings `start..end`: variable-length (vlen-utf8) or numpy's fixed-width UTF-32.
    pub fn read_strings(&self, start: usize, end: usize) -> Result<Vec<String>> {
        let Some(width) = self.array.data_type().downcast_ref::<zarrs::array::data_type::FixedLengthUTF32DataType>().and(self.array.data_type().fixed_size()) else {
            return self.read::<String>(start, end);
        };
        let sub = if self.array.shape().is_empty() { ArraySubset::new_with_ranges(&[]) } else { self.subset(start, end) };
        let bytes = self
            .array
            .retrieve_array_subset::<zarrs::array::ArrayBytes>(&sub)
            .and_then(|b| b.into_fixed().map_err(|e| zarrs::array::ArrayError::Other(e.to_string())))
            .map_err(|e| Error::BadField { path: self.path.clone(), field: self.field.clone(), detail: format!("entries {start}..{end} cannot be read: {e}"), hint: Some(CORRUPT_HINT.into()) })?;
        Ok(bytes
            .chunks(width.max(4))
            .map(|c| c.chunks_exact(4).map(|u| u32::from_le_bytes([u[0], u[1], u[2], u[3]])).take_while(|&u| u != 0).filter_map(char::from_u32).collect())
            .collect())
    }

    /// Elements `start..end` (rows of a 2-D array) as f32, whatever the numeric type.
    pub fn read_f32(&self, start: usize, end: usize) -> Result<Vec<f32>> {
        Ok(match self.elem()? {
            Elem::F32 => self.read::<f32>(start, end)?,
            Elem::F64 => self.read::<f64>(start, end)?.into_iter().map(|v| v as f32).collect(),
            Elem::I8 => self.read::<i8>(start, end)?.into_iter().map(f32::from).collect(),
            Elem::I16 => self.read::<i16>(start, end)?.into_iter().map(f32::from).collect(),
            Elem::I32 => self.read::<i32>(start, end)?.into_iter().map(|v| v as f32).collect(),
            Elem::I64 => self.read::<i64>(start, end)?.into_iter().map(|v| v as f32).collect(),
            Elem::U8 => self.read::<u8>(start, end)?.into_iter().map(f32::from).collect(),
            Elem::U16 => self.read::<u16>(start, end)?.into_iter().map(f32::from).collect(),
            Elem::U32 => self.read::<u32>(start, end)?.into_iter().map(|v| v as f32).collect(),
            Elem::U64 => self.read::<u64>(start, end)?.into_iter().map(|v| v as f32).collect(),
            Elem::Bool => self.read::<bool>(start, end)?.into_iter().map(|v| if v { 1.0 } else { 0.0 }).collect(),
            Elem::Str => return Err(bad(&self.path, &self.field, "holds strings, not numbers")),
        })
    }

    /// Elements `start..end` as i64 (offsets and indices of any integer type).
    pub fn read_i64(&self, start: usize, end: usize) -> Result<Vec<i64>> {
        Ok(match self.elem()? {
            Elem::I8 => self.read::<i8>(start, end)?.into_iter().map(i64::from).collect(),
            Elem::I16 => self.read::<i16>(start, end)?.into_iter().map(i64::from).collect(),
            Elem::I32 => self.read::<i32>(start, end)?.into_iter().map(i64::from).collect(),
            Elem::I64 => self.read::<i64>(start, end)?,
            Elem::U8 => self.read::<u8>(start, end)?.into_iter().map(i64::from).collect(),
            Elem::U16 => self.read::<u16>(start, end)?.into_iter().map(i64::from).collect(),
            Elem::U32 => self.read::<u32>(start, end)?.into_iter().map(i64::from).collect(),
            Elem::U64 => self.read::<u64>(start, end)?.into_iter().map(|v| v as i64).collect(),
            other => return Err(bad(&self.path, &self.field, format!("holds {}, not integers", other.name()))),
        })
    }
}

/// Copy the store into the HDF5 group `dst` (a file's root). With `values_of_matrices` false,
/// the matrices ([`is_matrix`]) are copied as their structure and attributes only:
/// what [`AnnData::open`](super::AnnData::open) needs beside the rows it reads from the store.
pub fn copy_into_hdf5(store: &Store, dst: &hdf5::Group, values_of_matrices: bool) -> Result<()> {
    copy_group(store, "", dst, values_of_matrices)
}

/// Whether `at` stays in the store when it is mirrored: a matrix read in blocks of rows (X,
/// `layers/*`, `raw/X`), or a pairwise matrix (`obsp/*`, `varp/*`, which nothing reads but an
/// output copies).
pub fn is_matrix(at: &str) -> bool {
    at == "X" || at == "raw/X" || ["layers/", "obsp/", "varp/"].iter().any(|p| at.strip_prefix(p).is_some_and(|r| !r.contains('/')))
}

fn h5err(store: &Store, at: &str) -> impl Fn(hdf5::Error) -> Error {
    let (path, at) = (store.path.clone(), at.to_string());
    move |e| bad(&path, &at, format!("cannot be copied: {e}"))
}

fn copy_group(store: &Store, at: &str, dst: &hdf5::Group, values_of_matrices: bool) -> Result<()> {
    set_attrs(dst, &store.attributes(at)).map_err(h5err(store, at))?;
    let skip_values = !values_of_matrices && is_matrix(at);
    for (name, kind) in store.members(at) {
        let child = if at.is_empty() { name.clone() } else { format!("{at}/{name}") };
        match kind {
            Kind::Group => {
                let g = dst.create_group(&name).map_err(h5err(store, &child))?;
                copy_group(store, &child, &g, values_of_matrices)?;
            }
            Kind::Array if skip_values || (!values_of_matrices && is_matrix(&child)) => {
                // a placeholder with the array's attributes: the values are read from the store
                let g = dst.create_group(&name).map_err(h5err(store, &child))?;
                set_attrs(&g, &store.attributes(&child)).map_err(h5err(store, &child))?;
            }
            Kind::Array => match copy_array(store, &child, dst, &name) {
                // uns may hold anything: an entry of a type not read is left out, not fatal
                Err(err) if child.starts_with("uns/") => eprintln!("warning: {err}; left out"),
                other => other?,
            },
        }
    }
    Ok(())
}

fn copy_array(store: &Store, at: &str, dst: &hdf5::Group, name: &str) -> Result<()> {
    let a = store.array(at)?;
    let shape = a.shape();
    let e = h5err(store, at);
    let n = shape.first().copied().unwrap_or(1);
    let row = shape.iter().skip(1).product::<usize>().max(1);
    let step = (COPY_BLOCK / row).max(1);
    macro_rules! copy {
        (str) => {{
            let ds = dst.new_dataset::<VarLenUnicode>().shape(shape.clone()).create(name).map_err(&e)?;
            let conv = |x: String| x.replace('\0', "").parse::<VarLenUnicode>().unwrap_or_default();
            if shape.is_empty() {
                let x = a.read_strings(0, 1)?.into_iter().next().ok_or_else(|| bad(&store.path, at, "is an empty scalar"))?;
                ds.write_scalar(&conv(x)).map_err(&e)?;
            } else {
                let mut s = 0;
                while s < n {
                    let end = (s + step).min(n);
                    let v: Vec<VarLenUnicode> = a.read_strings(s, end)?.into_iter().map(conv).collect();
                    let flat = ndarray::ArrayD::from_shape_vec([&[end - s][..], &shape[1..]].concat(), v).map_err(|x| bad(&store.path, at, x.to_string()))?;
                    let sel: Vec<hdf5::SliceOrIndex> = std::iter::once(hdf5::SliceOrIndex::from(s..end)).chain(shape[1..].iter().map(|_| hdf5::SliceOrIndex::from(..))).collect();
                    ds.write_slice(&flat, hdf5::Selection::from(hdf5::Hyperslab::from(sel))).map_err(&e)?;
                    s = end;
                }
            }
            ds
        }};
        ($t:ty, $conv:expr) => {{
            let ds = dst.new_dataset::<$t>().shape(shape.clone()).create(name).map_err(&e)?;
            if shape.is_empty() {
                let v: Vec<_> = a.read(0, 1)?;
                let conv = $conv;
                let x: $t = conv(v.into_iter().next().ok_or_else(|| bad(&store.path, at, "is an empty scalar"))?);
                ds.write_scalar(&x).map_err(&e)?;
            } else {
                let mut s = 0;
                while s < n {
                    let end = (s + step).min(n);
                    let v: Vec<_> = a.read(s, end)?;
                    let conv = $conv;
                    let v: Vec<$t> = v.into_iter().map(conv).collect();
                    let flat = ndarray::ArrayD::from_shape_vec([&[end - s][..], &shape[1..]].concat(), v).map_err(|x| bad(&store.path, at, x.to_string()))?;
                    let sel: Vec<hdf5::SliceOrIndex> = std::iter::once(hdf5::SliceOrIndex::from(s..end)).chain(shape[1..].iter().map(|_| hdf5::SliceOrIndex::from(..))).collect();
                    ds.write_slice(&flat, hdf5::Selection::from(hdf5::Hyperslab::from(sel))).map_err(&e)?;
                    s = end;
                }
            }
            ds
        }};
    }
    let ds = match a.elem()? {
        Elem::F32 => copy!(f32, |x: f32| x),
        Elem::F64 => copy!(f64, |x: f64| x),
        Elem::I8 => copy!(i8, |x: i8| x),
        Elem::I16 => copy!(i16, |x: i16| x),
        Elem::I32 => copy!(i32, |x: i32| x),
        Elem::I64 => copy!(i64, |x: i64| x),
        Elem::U8 => copy!(u8, |x: u8| x),
        Elem::U16 => copy!(u16, |x: u16| x),
        Elem::U32 => copy!(u32, |x: u32| x),
        Elem::U64 => copy!(u64, |x: u64| x),
        Elem::Bool => copy!(bool, |x: bool| x),
        Elem::Str => copy!(str),
    };
    set_attrs(&ds, &a.array.attributes().clone()).map_err(e)
}

/// JSON attributes as HDF5 attributes, as h5py stores them (strings as variable-length UTF-8,
/// lists of one kind as arrays; empty lists and nested objects are left out).
fn set_attrs(loc: &hdf5::Location, attrs: &serde_json::Map<String, Value>) -> hdf5::Result<()> {
    for (k, v) in attrs {
        match v {
            Value::String(s) => super::h5util::set_str_attr(loc, k, s)?,
            Value::Bool(b) => loc.new_attr::<bool>().shape(()).create(k.as_str())?.write_scalar(b)?,
            Value::Number(n) => match n.as_i64() {
                Some(i) => loc.new_attr::<i64>().shape(()).create(k.as_str())?.write_scalar(&i)?,
                None => loc.new_attr::<f64>().shape(()).create(k.as_str())?.write_scalar(&n.as_f64().unwrap_or(f64::NAN))?,
            },
            Value::Array(items) if !items.is_empty() => {
                if items.iter().all(Value::is_string) {
                    let v: Vec<VarLenUnicode> = items.iter().map(|x| x.as_str().unwrap_or_default().parse().unwrap_or_default()).collect();
                    loc.new_attr::<VarLenUnicode>().shape([v.len()]).create(k.as_str())?.write_raw(&v)?;
                } else if items.iter().all(Value::is_i64) {
                    let v: Vec<i64> = items.iter().map(|x| x.as_i64().unwrap_or(0)).collect();
                    loc.new_attr::<i64>().shape([v.len()]).create(k.as_str())?.write_raw(&v)?;
                } else if items.iter().all(Value::is_number) {
                    let v: Vec<f64> = items.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect();
                    loc.new_attr::<f64>().shape([v.len()]).create(k.as_str())?.write_raw(&v)?;
                } else if items.iter().all(Value::is_boolean) {
                    let v: Vec<bool> = items.iter().map(|x| x.as_bool().unwrap_or(false)).collect();
                    loc.new_attr::<bool>().shape([v.len()]).create(k.as_str())?.write_raw(&v)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// An HDF5 image in memory of `store` less its matrices' values (see the module's comment).
pub fn mirror(store: &Store) -> Result<hdf5::File> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let name = format!("scfoundry-zarr-mirror-{}-{}.h5", std::process::id(), NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let file = hdf5::File::with_options()
        .with_fapl(|p| p.core_filebacked(false))
        .create(&name)
        .map_err(|e| bad(&store.path, "(store)", format!("cannot be mirrored in memory: {e}")))?;
    copy_into_hdf5(store, &file, false)?;
    Ok(file)
}

/// Copy the store whole into a new .h5ad at `dest` (an output is built from it).
pub fn to_hdf5(store: &Store, dest: &Path) -> Result<()> {
    let file = hdf5::File::create(dest).map_err(|e| bad(dest, "(file)", format!("cannot be created: {e}")))?;
    copy_into_hdf5(store, &file, true)?;
    file.flush().map_err(|e| bad(dest, "(file)", format!("cannot be written: {e}")))
}

// ---------------------------------------------------------------------------------------------
// Writing: an .h5ad copied into a Zarr store.

/// How the written arrays are encoded, by zarr format: v2 as anndata with zarr 2 writes (Blosc
/// LZ4, vlen-utf8 strings), v3 as zarr-python 3 does (Zstandard).
fn array_metadata(format: u8, shape: &[usize], chunks: &[usize], elem: Elem) -> Value {
    if format == 2 {
        let dtype = match elem {
            Elem::F32 => "<f4",
            Elem::F64 => "<f8",
            Elem::I8 => "|i1",
            Elem::I16 => "<i2",
            Elem::I32 => "<i4",
            Elem::I64 => "<i8",
            Elem::U8 => "|u1",
            Elem::U16 => "<u2",
            Elem::U32 => "<u4",
            Elem::U64 => "<u8",
            Elem::Bool => "|b1",
            Elem::Str => "|O",
        };
        let fill = match elem {
            Elem::Str => json!(""),
            Elem::Bool => json!(false),
            _ => json!(0),
        };
        let filters = if elem == Elem::Str { json!([{"id": "vlen-utf8"}]) } else { Value::Null };
        json!({
            "zarr_format": 2, "shape": shape, "chunks": chunks, "dtype": dtype, "fill_value": fill, "order": "C",
            "compressor": {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0},
            "filters": filters,
        })
    } else {
        let (dtype, fill) = match elem {
            Elem::Str => ("string", json!("")),
            Elem::Bool => ("bool", json!(false)),
            other => (other.name(), json!(0)),
        };
        let codecs = if elem == Elem::Str {
            json!([{"name": "vlen-utf8"}, {"name": "zstd", "configuration": {"level": 0, "checksum": false}}])
        } else {
            json!([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 0, "checksum": false}}])
        };
        json!({
            "zarr_format": 3, "node_type": "array", "shape": shape, "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill, "codecs": codecs,
        })
    }
}

/// A writable Zarr store of format `format` at `dir` (created).
struct Writer {
    dir: PathBuf,
    storage: Arc<FilesystemStore>,
    format: u8,
}

impl Writer {
    fn err(&self, at: &str, e: impl std::fmt::Display) -> Error {
        bad(&self.dir, if at.is_empty() { "(root)" } else { at }, format!("cannot be written: {e}"))
    }

    fn group(&self, at: &str, attrs: serde_json::Map<String, Value>) -> Result<()> {
        let meta = if self.format == 2 { json!({"zarr_format": 2}) } else { json!({"zarr_format": 3, "node_type": "group", "attributes": {}}) };
        let meta: zarrs::metadata::GroupMetadata = if self.format == 2 {
            zarrs::metadata::GroupMetadata::V2(serde_json::from_value(meta).map_err(|e| self.err(at, e))?)
        } else {
            zarrs::metadata::GroupMetadata::V3(serde_json::from_value(meta).map_err(|e| self.err(at, e))?)
        };
        let mut g = ZGroup::new_with_metadata(self.storage.clone(), &node_path(at), meta).map_err(|e| self.err(at, e))?;
        *g.attributes_mut() = attrs;
        g.store_metadata().map_err(|e| self.err(at, e))?;
        self.tidy(at)
    }

    /// The metadata as zarr-python writes it: zarrs adds a `_zarrs` attribute and writes a codec
    /// without configuration as its bare name ("vlen-utf8"), which zarr-python 3.1 refuses; each
    /// codec is written as an object here, and the attribute is left out.
    fn tidy(&self, at: &str) -> Result<()> {
        let dir = self.dir.join(at);
        for f in ["zarr.json", ".zattrs"] {
            let p = dir.join(f);
            let Ok(text) = std::fs::read_to_string(&p) else { continue };
            let mut m: Value = serde_json::from_str(&text).map_err(|e| self.err(at, e))?;
            let attrs = if f == "zarr.json" { m.get_mut("attributes") } else { Some(&mut m) };
            if let Some(Value::Object(a)) = attrs {
                a.remove("_zarrs");
            }
            if let Some(Value::Array(codecs)) = m.get_mut("codecs") {
                for c in codecs.iter_mut() {
                    if let Value::String(name) = c {
                        *c = json!({"name": name.clone()});
                    }
                }
            }
            std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap_or_default()).map_err(|e| Error::Io { path: p.clone(), source: e })?;
        }
        Ok(())
    }

    fn array(&self, at: &str, shape: &[usize], elem: Elem, attrs: serde_json::Map<String, Value>) -> Result<Array<FilesystemStore>> {
        // chunks of whole rows, about COPY_BLOCK values (anndata chunks by rows too)
        let row = shape.iter().skip(1).product::<usize>().max(1);
        let mut chunks: Vec<usize> = shape.iter().map(|&s| s.max(1)).collect();
        if let Some(first) = chunks.first_mut() {
            *first = (COPY_BLOCK / row).clamp(1, (*first).max(1));
        }
        let meta = array_metadata(self.format, shape, &chunks, elem);
        let meta: zarrs::metadata::ArrayMetadata = if self.format == 2 {
            zarrs::metadata::ArrayMetadata::V2(serde_json::from_value(meta).map_err(|e| self.err(at, e))?)
        } else {
            zarrs::metadata::ArrayMetadata::V3(serde_json::from_value(meta).map_err(|e| self.err(at, e))?)
        };
        let mut a = Array::new_with_metadata(self.storage.clone(), &node_path(at), meta).map_err(|e| self.err(at, e))?;
        *a.attributes_mut() = attrs;
        a.store_metadata().map_err(|e| self.err(at, e))?;
        self.tidy(at)?;
        Ok(a)
    }
}

/// HDF5 attributes as JSON (strings, numbers, booleans and arrays of them).
fn attrs_json(loc: &hdf5::Location) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    for name in loc.attr_names().unwrap_or_default() {
        let Ok(a) = loc.attr(&name) else { continue };
        let Ok(desc) = a.dtype().and_then(|t| t.to_descriptor()) else { continue };
        let scalar = a.ndim() == 0;
        let v = match desc {
            TypeDescriptor::VarLenUnicode | TypeDescriptor::VarLenAscii | TypeDescriptor::FixedAscii(_) | TypeDescriptor::FixedUnicode(_) => {
                if scalar {
                    super::h5util::str_attr(loc, &name).map(Value::String)
                } else {
                    super::h5util::str_array_attr(loc, &name).map(|v| json!(v))
                }
            }
            // h5py stores numpy bools as an int8 enum FALSE/TRUE
            TypeDescriptor::Boolean | TypeDescriptor::Enum(_) => a
                .read_raw::<bool>()
                .ok()
                .or_else(|| a.read_raw::<i8>().ok().map(|v| v.into_iter().map(|x| x != 0).collect()))
                .map(|v| if scalar { json!(v.first().copied().unwrap_or(false)) } else { json!(v) }),
            TypeDescriptor::Integer(_) | TypeDescriptor::Unsigned(_) => a.read_raw::<i64>().ok().map(|v| if scalar { json!(v.first().copied().unwrap_or(0)) } else { json!(v) }),
            // an empty list is stored by h5py as an empty float64 array
            TypeDescriptor::Float(_) => a.read_raw::<f64>().ok().map(|v| if scalar { json!(v.first().copied().unwrap_or(f64::NAN)) } else { json!(v) }),
            _ => None,
        };
        if let Some(v) = v {
            out.insert(name, v);
        }
    }
    out
}

fn elem_of(ds: &hdf5::Dataset) -> Option<Elem> {
    use hdf5::types::{FloatSize, IntSize};
    Some(match ds.dtype().ok()?.to_descriptor().ok()? {
        TypeDescriptor::Float(FloatSize::U4) => Elem::F32,
        TypeDescriptor::Float(FloatSize::U8) => Elem::F64,
        TypeDescriptor::Integer(IntSize::U1) => Elem::I8,
        TypeDescriptor::Integer(IntSize::U2) => Elem::I16,
        TypeDescriptor::Integer(IntSize::U4) => Elem::I32,
        TypeDescriptor::Integer(IntSize::U8) => Elem::I64,
        TypeDescriptor::Unsigned(IntSize::U1) => Elem::U8,
        TypeDescriptor::Unsigned(IntSize::U2) => Elem::U16,
        TypeDescriptor::Unsigned(IntSize::U4) => Elem::U32,
        TypeDescriptor::Unsigned(IntSize::U8) => Elem::U64,
        TypeDescriptor::Boolean => Elem::Bool,
        TypeDescriptor::Enum(_) if super::h5util::is_bool(ds) => Elem::Bool,
        TypeDescriptor::VarLenUnicode | TypeDescriptor::VarLenAscii | TypeDescriptor::FixedAscii(_) | TypeDescriptor::FixedUnicode(_) => Elem::Str,
        _ => return None,
    })
}

fn write_h5_group(w: &Writer, g: &hdf5::Group, at: &str) -> Result<()> {
    w.group(at, attrs_json(g))?;
    for name in g.member_names().map_err(|e| w.err(at, e))? {
        let child = if at.is_empty() { name.clone() } else { format!("{at}/{name}") };
        match g.loc_type_by_name(&name) {
            Ok(hdf5::LocationType::Group) => write_h5_group(w, &g.group(&name).map_err(|e| w.err(&child, e))?, &child)?,
            Ok(hdf5::LocationType::Dataset) => write_h5_dataset(w, &g.dataset(&name).map_err(|e| w.err(&child, e))?, &child)?,
            _ => {}
        }
    }
    Ok(())
}

fn write_h5_dataset(w: &Writer, ds: &hdf5::Dataset, at: &str) -> Result<()> {
    let Some(elem) = elem_of(ds) else {
        eprintln!("warning: {at} has a type that Zarr output does not carry; left out of {}", w.dir.display());
        return Ok(());
    };
    let shape = ds.shape();
    let attrs = attrs_json(ds);
    let a = w.array(at, &shape, elem, attrs)?;
    let n = shape.first().copied().unwrap_or(1);
    let row = shape.iter().skip(1).product::<usize>().max(1);
    let step = (COPY_BLOCK / row).max(1);
    let e = |x: hdf5::Error| w.err(at, x);
    macro_rules! put {
        ($t:ty, $conv:expr) => {{
            let mut s = 0;
            while s < n {
                let end = (s + step).min(n);
                let v: Vec<$t> = if shape.is_empty() {
                    vec![ds.read_scalar::<$t>().map_err(e)?]
                } else {
                    let sel: Vec<hdf5::SliceOrIndex> = std::iter::once(hdf5::SliceOrIndex::from(s..end)).chain(shape[1..].iter().map(|_| hdf5::SliceOrIndex::from(..))).collect();
                    ds.read_slice::<$t, _, ndarray::IxDyn>(hdf5::Selection::from(hdf5::Hyperslab::from(sel))).map_err(e)?.into_raw_vec_and_offset().0
                };
                let conv = $conv;
                let v: Vec<_> = v.into_iter().map(conv).collect();
                let mut ranges = vec![s as u64..end as u64];
                ranges.extend(shape.iter().skip(1).map(|&x| 0..x as u64));
                let sub = if shape.is_empty() { ArraySubset::new_with_ranges(&[]) } else { ArraySubset::new_with_ranges(&ranges) };
                a.store_array_subset(&sub, v).map_err(|x| w.err(at, x))?;
                s = end;
            }
        }};
    }
    match elem {
        Elem::F32 => put!(f32, |x: f32| x),
        Elem::F64 => put!(f64, |x: f64| x),
        Elem::I8 => put!(i8, |x: i8| x),
        Elem::I16 => put!(i16, |x: i16| x),
        Elem::I32 => put!(i32, |x: i32| x),
        Elem::I64 => put!(i64, |x: i64| x),
        Elem::U8 => put!(u8, |x: u8| x),
        Elem::U16 => put!(u16, |x: u16| x),
        Elem::U32 => put!(u32, |x: u32| x),
        Elem::U64 => put!(u64, |x: u64| x),
        Elem::Bool => {
            // bool or h5py's int8 enum
            let v: Vec<bool> = super::h5util::read_bools(ds).ok_or_else(|| bad(&w.dir, at, "cannot be read as booleans"))?;
            a.store_array_subset(&whole(&shape), v).map_err(|x| w.err(at, x))?;
        }
        Elem::Str => {
            let v: Vec<String> = if shape.is_empty() { super::h5util::read_scalar_string(ds).into_iter().collect() } else { super::h5util::read_strings(ds).ok_or_else(|| bad(&w.dir, at, "cannot be read as strings"))? };
            a.store_array_subset(&whole(&shape), v).map_err(|x| w.err(at, x))?;
        }
    }
    Ok(())
}

/// The whole of an array of `shape` (a scalar's empty subset too).
fn whole(shape: &[usize]) -> ArraySubset {
    ArraySubset::new_with_ranges(&shape.iter().map(|&x| 0..x as u64).collect::<Vec<_>>())
}

/// Copy the finished .h5ad `h5ad` into a new Zarr store of format `format` (2 or 3) at `dir`
/// (a folder that does not exist yet).
pub fn write_store(h5ad: &Path, dir: &Path, format: u8) -> Result<()> {
    let file = hdf5::File::open(h5ad).map_err(|e| bad(h5ad, "(file)", format!("cannot be opened: {e}")))?;
    std::fs::create_dir_all(dir).map_err(|e| Error::Io { path: dir.into(), source: e })?;
    let storage = FilesystemStore::new(dir).map_err(|e| bad(dir, "(store)", format!("cannot be created: {e}")))?;
    let w = Writer { dir: dir.into(), storage: Arc::new(storage), format };
    write_h5_group(&w, &file, "")
}
