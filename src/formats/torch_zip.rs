//! PyTorch's `torch.save` files (the zip format of torch >= 1.6), read as data.
//!
//! Such a file is a zip of `<name>/data.pkl` (the saved object, pickled), `<name>/data/<key>`
//! (one record per tensor storage, raw little-endian values) and a few small records
//! (`version`, `byteorder`). `data.pkl` is read by `formats::pickle` with persistent ids on and
//! the caller's opaque prefixes (always `torch.`), so each tensor stays an inert
//! `torch._utils._rebuild_tensor_v2(persistent_id(('storage', <type>, <key>, ...)), offset,
//! size, stride, ...)` description until [`TorchZip::tensor`] rebuilds it from its record.
//! Nothing in the file is run. Used by the scfoundation, scprint and scvi checkpoints.
//!
//! A damaged or hostile file gives an error, never a panic or an allocation it does not back
//! with bytes: a record is read only up to its declared size, which may not exceed what deflate
//! can make of its compressed bytes; a tensor's extent (offset + elements, each product checked
//! for overflow) must fit in its storage's declared size before anything is read, and the bytes
//! read must then be there. Callers name the file and give their own hints (each maps
//! [`TorchZipError`] into its `Error::BadWeights`).

use std::io::{Read, Seek};
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::formats::pickle::{read_pickle_with, PickleOptions, Py};

/// Why a torch.save file could not be opened or its `data.pkl` read. Callers word the first
/// (what file they expected) themselves; the others display as callers have always said them.
#[derive(Debug, thiserror::Error)]
pub enum TorchZipError {
    /// The file could not be opened or read at all.
    #[error("{0}")]
    Io(#[source] std::io::Error),
    /// Not a zip archive (the zip reader's reason).
    #[error("{0}")]
    NotZip(String),
    #[error("has no data.pkl: not written by torch.save")]
    NoDataPkl,
    /// The data.pkl record is damaged (bad CRC, truncated, too large for its compressed size).
    #[error("{0}")]
    Record(String),
    /// The pickle reader refused data.pkl (its reason).
    #[error("cannot be read as data: {0}")]
    Pickle(String),
}

/// Deflate makes at most 1032 bytes of 1 (258-byte matches in 2-bit codes); a record declaring
/// more than this many bytes per compressed byte (plus a little) is lying about its size.
const MAX_RATIO: u64 = 1032;
/// Dimensions a tensor may have (torch's own limit is 64).
const MAX_RANK: usize = 64;

/// An opened torch.save zip: the archive and the prefix of its records (`archive/`).
pub struct TorchZip<R: Read + Seek> {
    zip: zip::ZipArchive<R>,
    prefix: String,
    /// The archive's length in bytes: no record holds more compressed bytes.
    len: u64,
}

impl TorchZip<std::io::BufReader<std::fs::File>> {
    /// Open a file. The caller checks that it exists (to give its own "missing file" error).
    pub fn open(path: &Path) -> Result<Self, TorchZipError> {
        let f = std::fs::File::open(path).map_err(TorchZipError::Io)?;
        Self::new(std::io::BufReader::new(f))
    }
}

impl<R: Read + Seek> TorchZip<R> {
    /// Open any reader of a torch.save zip and find its data.pkl.
    pub fn new(mut reader: R) -> Result<Self, TorchZipError> {
        let len = reader.seek(std::io::SeekFrom::End(0)).and_then(|n| reader.rewind().map(|_| n)).map_err(TorchZipError::Io)?;
        let zip = zip::ZipArchive::new(reader).map_err(|e| TorchZipError::NotZip(e.to_string()))?;
        let pkl = zip.file_names().find(|n| *n == "data.pkl" || n.ends_with("/data.pkl")).ok_or(TorchZipError::NoDataPkl)?;
        let prefix = pkl[..pkl.len() - "data.pkl".len()].to_string();
        Ok(TorchZip { zip, prefix, len })
    }

    /// The prefix of the archive's records (`archive/`, or empty).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The raw bytes of `data.pkl`.
    pub fn data_pkl(&mut self) -> Result<Vec<u8>, TorchZipError> {
        let name = format!("{}data.pkl", self.prefix);
        read_record(&mut self.zip, self.len, &name, None).map_err(TorchZipError::Record)
    }

    /// `data.pkl` unpickled as data: tensors stay opaque `_rebuild_tensor_v2` objects, globals
    /// under `opaque` (which should hold `torch.`) are kept as opaque objects, others refused.
    pub fn read_pickle(&mut self, opaque: &[&str]) -> Result<Py, TorchZipError> {
        let bytes = self.data_pkl()?;
        read_pickle_with(&bytes, PickleOptions { opaque, persistent_ids: true, ..Default::default() }).map_err(TorchZipError::Pickle)
    }

    /// A tensor from torch's `_rebuild_tensor_v2(storage, offset, size, stride, ...)` (or the
    /// older `_rebuild_tensor`), its storage read from the `data/<key>` record, as f32 on the
    /// CPU. Contiguous (C order) tensors only, as saved state_dicts are.
    pub fn tensor(&mut self, v: &Py) -> Result<Tensor, String> {
        let d = describe(v)?;
        let name = format!("{}data/{}", self.prefix, d.key);
        let raw = read_record(&mut self.zip, self.len, &name, Some((d.start, d.end))).map_err(|e| format!("storage {}: {e}", d.key))?;
        let t = Tensor::from_raw_buffer(&raw, d.dtype, &d.size, &Device::Cpu).map_err(|e| e.to_string())?;
        t.to_dtype(DType::F32).map_err(|e| e.to_string())
    }
}

/// What a `_rebuild_tensor_v2` call says: its storage's record and the bytes it takes there.
#[derive(Debug, Clone, PartialEq)]
struct Described {
    key: String,
    dtype: DType,
    size: Vec<usize>,
    /// Byte range in the storage record.
    start: usize,
    end: usize,
}

/// Check a tensor description without reading anything: storage type, sizes and strides
/// (contiguous), and the byte range it needs, every product checked.
fn describe(v: &Py) -> Result<Described, String> {
    let Py::Object { global, args, .. } = v else { return Err("is not a tensor".into()) };
    if global != "torch._utils._rebuild_tensor_v2" && global != "torch._utils._rebuild_tensor" {
        return Err(format!("is built by {global}, not a plain tensor"));
    }
    let ints = |p: &Py| -> Result<Vec<usize>, String> {
        match p {
            Py::Tuple(v) | Py::List(v) => {
                if v.len() > MAX_RANK {
                    return Err(format!("{} dimensions (at most {MAX_RANK})", v.len()));
                }
                v.iter().map(|d| if let Py::Int(i) = d { usize::try_from(*i).map_err(|_| "negative size".to_string()) } else { Err("size that is not integers".into()) }).collect()
            }
            _ => Err("size that is not a tuple".into()),
        }
    };
    let (Some(Py::Object { global: pg, args: pargs, .. }), Some(Py::Int(offset)), Some(size), Some(stride)) = (args.first(), args.get(1), args.get(2), args.get(3)) else {
        return Err("unexpected _rebuild_tensor arguments".into());
    };
    if pg != "persistent_id" {
        return Err("storage without a persistent id".into());
    }
    let Some(Py::Tuple(pid)) = pargs.first() else { return Err("storage id that is not a tuple".into()) };
    let (Some(Py::Global(stype)), Some(Py::Str(key))) = (pid.get(1), pid.get(2)) else {
        return Err("storage id without a type and key".into());
    };
    let (dtype, width) = match stype.as_str() {
        "torch.FloatStorage" => (DType::F32, 4usize),
        "torch.DoubleStorage" => (DType::F64, 8),
        "torch.HalfStorage" => (DType::F16, 2),
        "torch.BFloat16Storage" => (DType::BF16, 2),
        "torch.LongStorage" => (DType::I64, 8),
        other => return Err(format!("storage type {other} is not read")),
    };
    let size = ints(size)?;
    let stride = ints(stride)?;
    if stride.len() != size.len() {
        return Err(format!("{} sizes but {} strides", size.len(), stride.len()));
    }
    let too_big = || format!("a size of {size:?} elements of {width} bytes, more than memory can address");
    // every partial product is checked, also when a later dimension is 0
    let mut n = 1usize;
    for d in &size {
        n = n.checked_mul((*d).max(1)).ok_or_else(too_big)?;
    }
    let n = if size.contains(&0) { 0 } else { n };
    let mut expect = 1usize;
    for (d, s) in size.iter().zip(&stride).rev() {
        if *d > 1 && *s != expect {
            return Err("a non-contiguous tensor".into());
        }
        expect = expect.saturating_mul(*d);
    }
    let offset = usize::try_from(*offset).map_err(|_| format!("negative storage offset {offset}"))?;
    let start = offset.checked_mul(width).ok_or_else(|| format!("storage offset {offset} is past anything a file holds"))?;
    let end = n.checked_mul(width).and_then(|b| b.checked_add(start)).filter(|e| *e <= isize::MAX as usize).ok_or_else(too_big)?;
    Ok(Described { key: key.clone(), dtype, size, start, end })
}

/// Read record `name`, whole (`range` None) or only `start..end`: refused before anything is
/// read when the record declares fewer bytes, or more than its compressed bytes can hold (and
/// those more than the archive's `len`), and checked after (a record shorter than it declared).
/// Memory grows with the bytes actually read, never ahead of them by more than 64 MiB.
fn read_record<R: Read + Seek>(zip: &mut zip::ZipArchive<R>, len: u64, name: &str, range: Option<(usize, usize)>) -> Result<Vec<u8>, String> {
    let rec = zip.by_name(name).map_err(|e| e.to_string())?;
    let declared = rec.size();
    let packed = rec.compressed_size();
    if packed > len {
        return Err(format!("declares {packed} compressed bytes in an archive of {len}"));
    }
    let most = match rec.compression() {
        zip::CompressionMethod::Stored => packed,
        _ => packed.saturating_mul(MAX_RATIO).saturating_add(64),
    };
    if declared > most {
        return Err(format!("declares {declared} bytes but holds {packed} (compressed), which cannot give that many"));
    }
    let (start, end) = range.unwrap_or((0, declared as usize));
    if end as u64 > declared {
        return Err(format!("holds {declared} bytes, fewer than the tensor needs ({end})"));
    }
    let mut out = Vec::with_capacity((end - start).min(64 << 20));
    let mut r = rec.take(end as u64);
    if start > 0 {
        let skipped = std::io::copy(&mut (&mut r).take(start as u64), &mut std::io::sink()).map_err(|e| e.to_string())?;
        if skipped < start as u64 {
            return Err(format!("holds {skipped} bytes, fewer than it declares ({declared})"));
        }
    }
    r.read_to_end(&mut out).map_err(|e| e.to_string())?;
    if out.len() < end - start {
        return Err(format!("holds {} bytes, fewer than it declares ({declared})", start + out.len()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Cursor, Write};

    /// `torch.save` of a dict {"w": tensor} in miniature: the tensor's description pickled by
    /// hand as the file holds it, and a storage record of `storage` bytes.
    fn saved(size: &[i64], offset: i64, storage: &[u8]) -> Vec<u8> {
        // protocol 2: {'w': _rebuild_tensor_v2(persistent_id(('storage', FloatStorage, '0', 'cpu', n)), offset, size, stride, False, OrderedDict())}
        let mut p = vec![0x80, 2, b'}', b'X', 1, 0, 0, 0, b'w'];
        p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n");
        p.extend(b"((X\x07\0\0\0storage");
        p.extend(b"ctorch\nFloatStorage\n");
        p.extend(b"X\x01\0\0\0" as &[u8]);
        p.push(b'0');
        p.extend(b"X\x03\0\0\0cpu");
        p.extend(int(storage.len() as i64 / 4));
        p.extend(b"tQ");
        p.extend(int(offset));
        let tuple = |p: &mut Vec<u8>, v: &[i64]| {
            p.push(b'(');
            for x in v {
                p.extend(int(*x));
            }
            p.push(b't');
        };
        tuple(&mut p, size);
        let mut stride = vec![1i64; size.len()];
        for i in (0..size.len().saturating_sub(1)).rev() {
            stride[i] = stride[i + 1].wrapping_mul(size[i + 1]);
        }
        tuple(&mut p, &stride);
        p.extend(b"\x89ccollections\nOrderedDict\n)R");
        p.extend(b"tRs.");
        let mut z = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let o = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
        z.start_file("archive/data.pkl", o).unwrap();
        z.write_all(&p).unwrap();
        z.start_file("archive/data/0", o).unwrap();
        z.write_all(storage).unwrap();
        z.finish().unwrap().into_inner()
    }

    /// A pickle integer (LONG1, any i64).
    fn int(x: i64) -> Vec<u8> {
        let mut v = vec![0x8a, 8];
        v.extend(x.to_le_bytes());
        v
    }

    fn read_w(file: Vec<u8>) -> Result<Tensor, String> {
        let mut tz = TorchZip::new(Cursor::new(file)).map_err(|e| e.to_string())?;
        assert_eq!(tz.prefix(), "archive/");
        let root = tz.read_pickle(&["torch."]).map_err(|e| e.to_string())?;
        let w = root.get("w").ok_or("no w")?.clone();
        tz.tensor(&w)
    }

    fn floats(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn a_saved_tensor_is_rebuilt_at_its_offset() {
        let t = read_w(saved(&[2, 3], 1, &floats(&[9., 1., 2., 3., 4., 5., 6.]))).unwrap();
        assert_eq!(t.dims(), &[2, 3]);
        assert_eq!(t.to_vec2::<f32>().unwrap(), vec![vec![1., 2., 3.], vec![4., 5., 6.]]);
    }

    #[test]
    fn a_truncated_storage_record_is_an_error() {
        // 2 x 3 floats at offset 1 need 28 bytes; the record holds 24
        let e = read_w(saved(&[2, 3], 1, &floats(&[1., 2., 3., 4., 5., 6.]))).unwrap_err();
        assert!(e.contains("storage 0") && e.contains("holds 24 bytes, fewer than the tensor needs (28)"), "{e}");
        // a record cut short after its declared size (the zip's sizes lie): an error too
        let mut file = saved(&[2, 3], 0, &floats(&[1., 2., 3., 4., 5., 6.]));
        let at = file.windows(4).position(|w| w == 1f32.to_le_bytes()).unwrap();
        file.drain(at + 8..at + 24);
        assert!(read_w(file).is_err());
    }

    #[test]
    fn size_products_that_overflow_are_errors() {
        let data = floats(&[1., 2., 3., 4.]);
        let e = read_w(saved(&[1 << 40, 1 << 40], 0, &data)).unwrap_err();
        assert!(e.contains("more than memory can address"), "{e}");
        // a product that fits in usize but not once times the width
        let e = read_w(saved(&[1 << 62], 0, &data)).unwrap_err();
        assert!(e.contains("more than memory can address"), "{e}");
        // a zero dimension after huge ones: still checked, and refused
        let e = read_w(saved(&[1 << 40, 1 << 40, 0], 0, &data)).unwrap_err();
        assert!(e.contains("more than memory can address"), "{e}");
        // a huge offset, a negative size, and a large claim the record does not back
        assert!(read_w(saved(&[2], i64::MAX, &data)).unwrap_err().contains("offset"));
        assert!(read_w(saved(&[-2], 0, &data)).unwrap_err().contains("negative size"));
        let e = read_w(saved(&[1 << 20, 1 << 20], 0, &data)).unwrap_err();
        assert!(e.contains("fewer than the tensor needs"), "{e}");
    }

    #[test]
    fn not_a_torch_zip_is_an_error() {
        assert!(matches!(TorchZip::new(Cursor::new(b"not a zip".to_vec())), Err(TorchZipError::NotZip(_))));
        let mut z = zip::ZipWriter::new(Cursor::new(Vec::new()));
        z.start_file("archive/other", zip::write::SimpleFileOptions::default()).unwrap();
        let file = z.finish().unwrap().into_inner();
        assert!(matches!(TorchZip::new(Cursor::new(file)), Err(TorchZipError::NoDataPkl)));
    }
}
