//! Small helpers over the hdf5 crate for AnnData's encoding conventions.

use hdf5::types::{TypeDescriptor, VarLenAscii, VarLenUnicode};
use hdf5::{Attribute, Container, Dataset, Group, Location};

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

fn read_fixed_bytes(c: &Container, width: usize, n: usize) -> Option<Vec<u8>> {
    // Fixed-length strings: read through a byte-array memory type of the same width.
    macro_rules! try_width {
        ($($w:literal),*) => {
            match width {
                $($w => {
                    let v: Vec<hdf5::types::FixedAscii<$w>> = c.read_raw().ok()?;
                    let mut out = Vec::with_capacity(n * $w);
                    for s in v { let b = s.as_bytes(); out.extend_from_slice(b); out.extend(std::iter::repeat(0u8).take($w - b.len())); }
                    Some(out)
                })*
                _ => None,
            }
        };
    }
    try_width!(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 24, 25, 30, 32, 40, 48, 50, 64, 100, 128, 256)
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
            let n = c.size();
            let raw = read_fixed_bytes(c, w, n)?;
            Some(
                raw.chunks(w)
                    .map(|b| String::from_utf8_lossy(b).trim_end_matches('\0').to_string())
                    .collect(),
            )
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
