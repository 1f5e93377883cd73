//! Small helpers over the hdf5 crate for AnnData's encoding conventions.

use hdf5::types::{TypeDescriptor, VarLenAscii, VarLenUnicode};
use std::path::Path;

use hdf5::{Attribute, Container, Dataset, Group, Location};

use crate::error::{Error, Result};

/// Read a string attribute whatever its string flavour (vlen/fixed, ASCII/UTF-8).
pub fn str_attr(loc: &Location, name: &str) -> Option<String> {
    let attr = loc.attr(name).ok()?;
    scalar_string(&attr)
}

fn scalar_string(c: &Container) -> Option<String> {
    let desc = c.dtype().ok()?.to_descriptor().ok()?;
    match desc {
        TypeDescriptor::VarLenUnicode => c.read_scalar::<VarLenUnicode>().ok().map(|s| s.as_str().to_string()),
        TypeDescriptor::VarLenAscii => c.read_scalar::<VarLenAscii>().ok().map(|s| s.as_str().to_string()),
        TypeDescriptor::FixedAscii(_) | TypeDescriptor::FixedUnicode(_) => {
            // Read as raw bytes of the fixed width.
            let size = c.dtype().ok()?.size();
            let raw: Vec<u8> = read_fixed_bytes(c, size, 1)?;
            Some(String::from_utf8_lossy(&raw).trim_end_matches('\0').to_string())
        }
        _ => None,
    }
}

/// The `encoding-type` attribute of a group or dataset.
pub fn encoding_type(loc: &Location) -> Option<String> {
    str_attr(loc, "encoding-type")
}

/// Read a string attribute that holds an array of strings (e.g. `column-order`).
/// An empty array may be stored as float64: that reads as an empty list.
pub fn str_array_attr(loc: &Location, name: &str) -> Option<Vec<String>> {
    let attr: Attribute = loc.attr(name).ok()?;
    if attr.size() == 0 {
        return Some(Vec::new());
    }
    read_strings_container(&attr)
}

/// Read every element of a dataset or attribute through the memory type `desc` of
/// `elem_size` bytes, as raw bytes: fixed-width strings of any width, one member of a compound.
pub fn read_bytes_as(c: &Container, desc: &TypeDescriptor, elem_size: usize) -> Option<Vec<u8>> {
    let mem = hdf5::Datatype::from_descriptor(desc).ok()?;
    let mut buf = vec![0u8; c.size().max(1) * elem_size];
    let rc = hdf5::sync::sync(|| unsafe {
        if c.id_type() == hdf5_sys::h5i::H5I_type_t::H5I_ATTR {
            hdf5_sys::h5a::H5Aread(c.id(), mem.id(), buf.as_mut_ptr().cast())
        } else {
            hdf5_sys::h5d::H5Dread(c.id(), mem.id(), hdf5_sys::h5s::H5S_ALL, hdf5_sys::h5s::H5S_ALL, hdf5_sys::h5p::H5P_DEFAULT, buf.as_mut_ptr().cast())
        }
    });
    (rc >= 0).then_some(buf)
}

/// Fixed-width strings: `width` bytes each, NUL-padded.
fn read_fixed_bytes(c: &Container, width: usize, _n: usize) -> Option<Vec<u8>> {
    let desc = c.dtype().ok()?.to_descriptor().ok()?;
    read_bytes_as(c, &desc, width)
}

/// Split fixed-width string bytes into strings.
pub fn split_fixed(raw: &[u8], width: usize) -> Vec<String> {
    raw.chunks(width.max(1)).map(|b| String::from_utf8_lossy(b).trim_end_matches('\0').to_string()).collect()
}

fn read_strings_container(c: &Container) -> Option<Vec<String>> {
    let desc = c.dtype().ok()?.to_descriptor().ok()?;
    match desc {
        TypeDescriptor::VarLenUnicode => {
            c.read_raw::<VarLenUnicode>().ok().map(|v| v.iter().map(|s| s.as_str().to_string()).collect())
        }
        TypeDescriptor::VarLenAscii => {
            c.read_raw::<VarLenAscii>().ok().map(|v| v.iter().map(|s| s.as_str().to_string()).collect())
        }
        TypeDescriptor::FixedAscii(w) | TypeDescriptor::FixedUnicode(w) => {
            let raw = read_fixed_bytes(c, w, c.size())?;
            Some(split_fixed(&raw, w))
        }
        _ => None,
    }
}

/// Read a 1-D string dataset of any string flavour.
pub fn read_strings(ds: &Dataset) -> Option<Vec<String>> {
    read_strings_container(ds)
}

/// Read a scalar string dataset.
pub fn read_scalar_string(ds: &Dataset) -> Option<String> {
    scalar_string(ds)
}

/// Whether the dataset holds strings.
pub fn is_string(ds: &Dataset) -> bool {
    matches!(
        ds.dtype().and_then(|t| t.to_descriptor()),
        Ok(TypeDescriptor::VarLenUnicode | TypeDescriptor::VarLenAscii | TypeDescriptor::FixedAscii(_) | TypeDescriptor::FixedUnicode(_))
    )
}

/// Whether the dataset holds booleans (h5py stores numpy bool as an int8 enum FALSE/TRUE).
pub fn is_bool(ds: &Dataset) -> bool {
    match ds.dtype().and_then(|t| t.to_descriptor()) {
        Ok(TypeDescriptor::Boolean) => true,
        Ok(TypeDescriptor::Enum(e)) => {
            e.members.len() == 2 && e.members.iter().any(|m| m.name.eq_ignore_ascii_case("false"))
        }
        _ => false,
    }
}

/// Read a 1-D boolean dataset (numpy bool enum or integers).
pub fn read_bools(ds: &Dataset) -> Option<Vec<bool>> {
    if let Ok(v) = ds.read_raw::<bool>() {
        return Some(v);
    }
    ds.read_raw::<i8>().ok().map(|v| v.into_iter().map(|x| x != 0).collect())
}

/// Write a scalar UTF-8 string attribute, replacing any attribute of that name.
pub fn set_str_attr(loc: &Location, name: &str, value: &str) -> hdf5::Result<()> {
    if loc.attr(name).is_ok() {
        loc.delete_attr(name)?;
    }
    let v: VarLenUnicode = value.parse().map_err(|e| hdf5::Error::from(format!("{e}")))?;
    loc.new_attr::<VarLenUnicode>().shape(()).create(name)?.write_scalar(&v)
}

/// Set AnnData's `encoding-type` and `encoding-version` attributes.
pub fn set_encoding(loc: &Location, kind: &str, version: &str) -> hdf5::Result<()> {
    set_str_attr(loc, "encoding-type", kind)?;
    set_str_attr(loc, "encoding-version", version)
}

/// Open a group, creating it (as an AnnData dict) when missing.
pub fn require_dict(parent: &Group, name: &str) -> hdf5::Result<Group> {
    if parent.link_exists(name) {
        parent.group(name)
    } else {
        let g = parent.create_group(name)?;
        set_encoding(&g, "dict", "0.1.0")?;
        Ok(g)
    }
}

/// Write a scalar string as AnnData's `string` encoding.
pub fn write_string(parent: &Group, name: &str, value: &str) -> hdf5::Result<()> {
    if parent.link_exists(name) {
        parent.unlink(name)?;
    }
    let v: VarLenUnicode = value.parse().map_err(|e| hdf5::Error::from(format!("{e}")))?;
    let ds = parent.new_dataset::<VarLenUnicode>().shape(()).create(name)?;
    ds.write_scalar(&v)?;
    set_encoding(&ds, "string", "0.2.0")
}

/// Write a numeric scalar as AnnData's `numeric-scalar` encoding.
pub fn write_f64(parent: &Group, name: &str, value: f64) -> hdf5::Result<()> {
    if parent.link_exists(name) {
        parent.unlink(name)?;
    }
    let ds = parent.new_dataset::<f64>().shape(()).create(name)?;
    ds.write_scalar(&value)?;
    set_encoding(&ds, "numeric-scalar", "0.2.0")
}

/// Write an integer scalar as AnnData's `numeric-scalar` encoding.
pub fn write_i64(parent: &Group, name: &str, value: i64) -> hdf5::Result<()> {
    if parent.link_exists(name) {
        parent.unlink(name)?;
    }
    let ds = parent.new_dataset::<i64>().shape(()).create(name)?;
    ds.write_scalar(&value)?;
    set_encoding(&ds, "numeric-scalar", "0.2.0")
}

/// Write a 1-D float array as AnnData's `array` encoding.
pub fn write_array_f64(parent: &Group, name: &str, values: &[f64]) -> hdf5::Result<()> {
    if parent.link_exists(name) {
        parent.unlink(name)?;
    }
    let ds = parent.new_dataset::<f64>().shape([values.len()]).create(name)?;
    ds.write_raw(values)?;
    set_encoding(&ds, "array", "0.2.0")
}

/// How far compression may shrink a dataset: a claimed size beyond its stored bytes times this
/// (plus [`BACKING_SLACK`]) is not believed. gzip's best ratio is about 1,032:1.
pub const MAX_COMPRESSION_RATIO: u64 = 4096;
/// Bytes any dataset may claim whatever its storage (small unwritten or fill-value datasets).
pub const BACKING_SLACK: u64 = 1 << 20;

/// Refuse a dataset whose claimed size (elements x element size) is not backed by the bytes it
/// stores, before anything is allocated for it: a chunked dataset may claim 10^9 rows with
/// nothing written, and reading it would allocate the claim. The stored size counts at most the
/// file's length (a truncated file may report space that is not there).
pub fn check_backed(path: &Path, field: &str, ds: &Dataset) -> Result<()> {
    let elem = ds.dtype().map(|t| t.size() as u64).unwrap_or(8).max(1);
    let claimed = (ds.size() as u64).saturating_mul(elem);
    let file_len = std::fs::metadata(ds.filename()).map(|m| m.len()).unwrap_or(u64::MAX);
    let stored = ds.storage_size().min(file_len);
    let allowed = stored.saturating_mul(MAX_COMPRESSION_RATIO).saturating_add(BACKING_SLACK);
    if claimed > allowed {
        return Err(Error::BadField {
            path: path.into(),
            field: field.into(),
            detail: format!(
                "claims {} values ({claimed} bytes) but stores only {stored} bytes: more than any compression explains",
                ds.size()
            ),
            hint: Some("the file is truncated, corrupt or made to exhaust memory; copy it again or rewrite it with anndata".into()),
        });
    }
    Ok(())
}
