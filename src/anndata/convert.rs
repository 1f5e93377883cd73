//! Files users have that are not current AnnData: legacy AnnData (written by anndata < 0.7) and
//! Cell Ranger's feature-barcode matrices (`filtered_feature_bc_matrix.h5`, v2 and v3 layouts,
//! Visium's too).
//!
//! Neither can be copied and extended into an output, so each is converted once, by our AnnData
//! writer ([`PendingOutput::create_new`]), into a current .h5ad in the conversion cache
//! (`~/.cache/scfoundry/converted-v1`, or `$SCFOUNDRY_CONVERTED_DIR`), keyed by the file's path,
//! size and modification time; every later read (a task process, the next run) reuses it.
//! Commands read the converted file and name the user's file in messages and provenance.
//!
//! What the conversion gives is what anndata and scanpy give:
//! - legacy AnnData as `anndata.read_h5ad` reads it: obs/var from their compound datasets (the
//!   first field is the index), categorical columns from their codes and `uns['<col>_categories']`,
//!   obsm from its compound dataset, `raw.X`/`raw.var` as raw, the rest of uns as data;
//! - Cell Ranger as `scanpy.read_10x_h5` reads it (gene expression features only; v2 needs
//!   `--genome` when it holds several genomes, v3 keeps every genome unless `--genome` picks one):
//!   barcodes as the obs index, gene symbols as var names and the ids in `var['gene_ids']`, counts
//!   as float32 CSR X. One departure: duplicated gene symbols are made unique as anndata's
//!   `var_names_make_unique` does (`TBCE`, `TBCE-1`), since every method needs unique var names.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use hdf5::types::{CompoundField, CompoundType, FloatSize, IntSize, TypeDescriptor};
use hdf5::{Dataset, File, Group};
use sha2::{Digest, Sha256};

use super::dataframe::{Column, DataFrame};
use super::h5util::{check_backed, is_string, read_bytes_as, read_strings, split_fixed};
use super::matrix::Matrix;
use super::write::PendingOutput;
use crate::error::{Error, Hdf5Context, Result};
use crate::env::EnvVars;

/// Bumped when a conversion's output changes, so older cached copies are not reused.
const CONVERTER_VERSION: &str = "1";

/// What an HDF5 file holds, as far as scfoundry reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum Layout {
    /// anndata >= 0.7: obs and var are groups.
    AnnData,
    /// anndata < 0.7: obs and var are compound datasets.
    LegacyAnnData,
    /// Cell Ranger >= 3: one `matrix` group with `features`.
    CellRangerV3,
    /// Cell Ranger 2: a group per genome with `genes` and `gene_names`.
    CellRangerV2 { genomes: Vec<String> },
    /// Something else (the AnnData checks name what is missing).
    Unknown,
}

impl Layout {
    pub fn of(file: &File) -> Layout {
        let kind = |name: &str| file.loc_type_by_name(name).ok();
        match (kind("obs"), kind("var")) {
            (Some(hdf5::LocationType::Group), Some(hdf5::LocationType::Group)) => return Layout::AnnData,
            (Some(hdf5::LocationType::Dataset), Some(hdf5::LocationType::Dataset)) => return Layout::LegacyAnnData,
            _ => {}
        }
        if let Ok(m) = file.group("matrix") {
            if m.link_exists("barcodes") && m.link_exists("features") {
                return Layout::CellRangerV3;
            }
        }
        let members = file.member_names().unwrap_or_default();
        let genomes: Vec<String> = members
            .iter()
            .filter(|n| file.group(n).map(|g| g.link_exists("barcodes") && g.link_exists("genes") && g.link_exists("gene_names")).unwrap_or(false))
            .cloned()
            .collect();
        if !genomes.is_empty() && genomes.len() == members.len() {
            return Layout::CellRangerV2 { genomes };
        }
        Layout::Unknown
    }

    /// How the format is named in messages.
    pub fn describe(&self) -> &'static str {
        match self {
            Layout::AnnData => "AnnData",
            Layout::LegacyAnnData => "legacy AnnData (written by anndata < 0.7)",
            Layout::CellRangerV3 => "a Cell Ranger v3+ feature-barcode matrix",
            Layout::CellRangerV2 { .. } => "a Cell Ranger v2 gene-barcode matrix",
            Layout::Unknown => "not an AnnData file",
        }
    }
}

/// The genome picked with `--genome` (passed to task processes through the environment).
pub fn genome() -> Option<String> {
    std::env::var(EnvVars::GENOME).ok().filter(|g| !g.is_empty())
}

/// The folder of converted copies.
pub fn converted_dir() -> PathBuf {
    match std::env::var_os(EnvVars::CONVERTED_DIR) {
        Some(d) => PathBuf::from(d),
        None => crate::weights::cache_base().join("converted-v1"),
    }
}

/// The current .h5ad to read for `path` and its layout: `path` itself when it is AnnData (or
/// not recognised), else its converted copy, made now when missing.
pub fn readable(path: &Path, file: &File) -> Result<(PathBuf, Layout)> {
    let layout = Layout::of(file);
    match layout {
        Layout::AnnData | Layout::Unknown => return Ok((path.into(), layout)),
        _ => {}
    }
    let genome = genome();
    let dest = converted_dir().join(cache_name(path, genome.as_deref())?);
    if dest.exists() {
        return Ok((dest, layout));
    }
    match &layout {
        Layout::LegacyAnnData => legacy_to_h5ad(path, file, &dest)?,
        Layout::CellRangerV3 => cellranger_v3_to_h5ad(path, file, genome.as_deref(), &dest)?,
        Layout::CellRangerV2 { genomes } => cellranger_v2_to_h5ad(path, file, genomes, genome.as_deref(), &dest)?,
        Layout::AnnData | Layout::Unknown => unreachable!(),
    }
    eprintln!("note: {} is {}; read through a converted copy, {} (kept for later runs)", path.display(), layout.describe(), dest.display());
    Ok((dest, layout))
}

/// `<stem>.<key>.h5ad`: the key covers the file's canonical path, size, modification time and
/// the genome asked for.
fn cache_name(path: &Path, genome: Option<&str>) -> Result<String> {
    let meta = std::fs::metadata(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
    let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.into());
    let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_nanos()).unwrap_or(0);
    let mut h = Sha256::new();
    h.update(format!("{CONVERTER_VERSION}\0{}\0{}\0{mtime}\0{}", canon.display(), meta.len(), genome.unwrap_or("")));
    let key = hex::encode(&h.finalize()[..8]);
    let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    Ok(format!("{stem}.{key}.h5ad"))
}

fn bad(path: &Path, field: &str, detail: impl Into<String>, hint: Option<String>) -> Error {
    Error::BadField { path: path.into(), field: field.into(), detail: detail.into(), hint }
}

/// Copy a matrix into the output as CSR, block by block, keeping the columns in `keep` (all
/// when `None`), renumbered in order.
fn copy_csr(out: &PendingOutput, at: &str, m: &Matrix, keep: Option<&[bool]>) -> Result<()> {
    let new_col: Option<Vec<Option<u32>>> = keep.map(|k| {
        let mut next = 0u32;
        k.iter()
            .map(|&kept| {
                if kept {
                    next += 1;
                    Some(next - 1)
                } else {
                    None
                }
            })
            .collect()
    });
    let n_cols = keep.map(|k| k.iter().filter(|&&b| b).count()).unwrap_or(m.n_cols);
    let mut w = out.csr_writer(at, m.n_rows, n_cols)?;
    for (s, e) in m.blocks(4_000_000) {
        let mut b = m.read_rows(s, e)?;
        if let Some(map) = &new_col {
            let mut kept = super::matrix::CsrBlock { start_row: b.start_row, indptr: vec![0], ..Default::default() };
            for i in 0..b.n_rows() {
                let (idx, val) = b.row(i);
                for (&j, &v) in idx.iter().zip(val) {
                    if let Some(nj) = map[j as usize] {
                        kept.indices.push(nj);
                        kept.data.push(v);
                    }
                }
                kept.indptr.push(kept.data.len());
            }
            b = kept;
        }
        w.push(&b)?;
    }
    w.finish()
}

/// Var names made unique as anndata's `make_index_unique` does: the second `A` becomes `A-1`,
/// the third `A-2`, skipping names already taken.
pub fn make_unique(names: &mut [String]) -> usize {
    let mut taken: HashSet<String> = names.iter().cloned().collect();
    let mut seen: HashSet<String> = HashSet::new();
    let mut counts: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut renamed = 0;
    for n in names.iter_mut() {
        if seen.insert(n.clone()) {
            continue;
        }
        let c = counts.entry(n.clone()).or_insert(0);
        loop {
            *c += 1;
            let cand = format!("{n}-{c}");
            if !taken.contains(&cand) {
                taken.insert(cand.clone());
                *n = cand;
                renamed += 1;
                break;
            }
        }
    }
    renamed
}

/// String columns with repeated values become categorical (categories sorted), as anndata's
/// `write_h5ad` does (`strings_to_categoricals`), so a converted file is what anndata would write.
pub fn strings_to_categoricals(df: &mut DataFrame) {
    for (_, col) in df.columns.iter_mut() {
        if let Column::Strings(v) = col {
            let mut cats = v.clone();
            cats.sort();
            cats.dedup();
            if cats.len() < v.len() {
                let codes = v.iter().map(|x| cats.binary_search(x).map(|i| i as i64).unwrap_or(-1)).collect();
                *col = Column::Categorical { codes, categories: cats, ordered: false };
            }
        }
    }
}

fn strings(path: &Path, g: &Group, name: &str, field: &str) -> Result<Vec<String>> {
    let ds = g.dataset(name).map_err(|_| bad(path, &format!("{field}/{name}"), "is missing", Some("the file is not a complete Cell Ranger matrix".into())))?;
    check_backed(path, &format!("{field}/{name}"), &ds)?;
    read_strings(&ds).ok_or_else(|| bad(path, &format!("{field}/{name}"), "cannot be read as strings", None))
}

/// Cell Ranger's counts: `data`/`indices`/`indptr` of genes x cells in CSC, which is cells x
/// genes in CSR; `shape` holds (genes, cells).
fn cellranger_matrix(path: &Path, file: &File, at: &str) -> Result<Matrix> {
    let g = file.group(at).h5ctx(|| format!("opening {at}"))?;
    let shape: Vec<i64> = g.dataset("shape").and_then(|d| d.read_raw()).map_err(|_| bad(path, &format!("{at}/shape"), "is missing or unreadable", None))?;
    if shape.len() != 2 || shape.iter().any(|&s| s < 0) {
        return Err(bad(path, &format!("{at}/shape"), format!("is {shape:?}, expected (genes, cells)"), None));
    }
    Matrix::from_csr_group(path, &g, at, shape[1] as usize, shape[0] as usize)
}

fn cellranger_v3_to_h5ad(path: &Path, file: &File, genome: Option<&str>, dest: &Path) -> Result<()> {
    let g = file.group("matrix").h5ctx(|| "opening matrix".into())?;
    let f = file.group("matrix/features").h5ctx(|| "opening matrix/features".into())?;
    let barcodes = strings(path, &g, "barcodes", "matrix")?;
    let m = cellranger_matrix(path, file, "matrix")?;
    let ids = strings(path, &f, "id", "matrix/features")?;
    let mut names = strings(path, &f, "name", "matrix/features")?;
    let types = strings(path, &f, "feature_type", "matrix/features")?;
    if barcodes.len() != m.n_rows || names.len() != m.n_cols || ids.len() != m.n_cols || types.len() != m.n_cols {
        return Err(bad(path, "matrix/shape", format!("is ({}, {}) but there are {} barcodes and {} features", m.n_cols, m.n_rows, barcodes.len(), names.len()), None));
    }
    // var columns in scanpy's order: gene_ids (probe_ids), feature_types, then the other
    // feature datasets in name order
    let mut columns: Vec<(String, Vec<String>)> = Vec::new();
    if f.link_exists("gene_id") {
        columns.push(("gene_ids".into(), strings(path, &f, "gene_id", "matrix/features")?));
        columns.push(("probe_ids".into(), ids));
    } else {
        columns.push(("gene_ids".into(), ids));
    }
    columns.push(("feature_types".into(), types.clone()));
    let mut others = f.member_names().unwrap_or_default();
    others.sort();
    let mut bool_columns: Vec<(String, Vec<bool>)> = Vec::new();
    for o in others {
        if ["name", "feature_type", "id", "gene_id", "_all_tag_keys"].contains(&o.as_str()) {
            continue;
        }
        let Ok(ds) = f.dataset(&o) else { continue };
        if ds.ndim() != 1 || ds.size() != m.n_cols {
            continue;
        }
        if super::h5util::is_bool(&ds) {
            bool_columns.push((o.clone(), super::h5util::read_bools(&ds).unwrap_or_default()));
        } else if is_string(&ds) {
            columns.push((o.clone(), strings(path, &f, &o, "matrix/features")?));
        }
    }
    let genomes_col = columns.iter().find(|(n, _)| n == "genome").map(|(_, v)| v.clone());
    let mut keep: Vec<bool> = types.iter().map(|t| t == "Gene Expression").collect();
    if let Some(want) = genome {
        let Some(gs) = &genomes_col else {
            return Err(bad(path, "matrix/features/genome", "is missing, so --genome cannot pick a genome", Some("drop --genome: this file has one genome".into())));
        };
        if !gs.iter().any(|g| g == want) {
            return Err(genome_error(path, want, &unique(gs)));
        }
        for (k, g) in keep.iter_mut().zip(gs) {
            *k &= g == want;
        }
    }
    if keep.iter().all(|k| !k) {
        return Err(bad(path, "matrix/features/feature_type", "has no `Gene Expression` features", Some("scfoundry reads gene expression, as scanpy.read_10x_h5 does by default".into())));
    }
    let subset = |v: &[String]| -> Vec<String> { v.iter().zip(&keep).filter(|(_, &k)| k).map(|(x, _)| x.clone()).collect() };
    names = subset(&names);
    make_unique(&mut names);
    let mut var = DataFrame { index_name: "_index".into(), index: names, columns: Vec::new() };
    for (n, v) in &columns {
        var.columns.push((n.clone(), Column::Strings(subset(v))));
    }
    for (n, v) in &bool_columns {
        var.columns.push((n.clone(), Column::Bool(v.iter().zip(&keep).filter(|(_, &k)| k).map(|(&x, _)| x).collect())));
    }
    let mut obs = DataFrame { index_name: "_index".into(), index: barcodes, columns: Vec::new() };
    if let Ok(ds) = g.dataset("filtered_barcodes") {
        obs.columns.push(("filtered_barcodes".into(), Column::Bool(super::h5util::read_bools(&ds).unwrap_or_default())));
    }
    strings_to_categoricals(&mut obs);
    strings_to_categoricals(&mut var);
    let out = PendingOutput::create_new(dest)?;
    out.write_dataframe("obs", &obs)?;
    out.write_dataframe("var", &var)?;
    copy_csr(&out, "X", &m, Some(&keep))?;
    out.commit()?;
    Ok(())
}

fn unique(v: &[String]) -> Vec<String> {
    let mut seen = HashSet::new();
    v.iter().filter(|x| seen.insert(x.as_str())).cloned().collect()
}

fn genome_error(path: &Path, want: &str, have: &[String]) -> Error {
    bad(path, "(genomes)", format!("has no genome `{want}`"), Some(format!("the genomes in this file: {}; pass one with --genome", have.join(", "))))
}

fn cellranger_v2_to_h5ad(path: &Path, file: &File, genomes: &[String], genome: Option<&str>, dest: &Path) -> Result<()> {
    let pick = match genome {
        Some(g) if genomes.iter().any(|x| x == g) => g.to_string(),
        Some(g) => return Err(genome_error(path, g, genomes)),
        None if genomes.len() == 1 => genomes[0].clone(),
        None => {
            return Err(bad(
                path,
                "(genomes)",
                format!("is a Cell Ranger v2 matrix with {} genomes ({})", genomes.len(), genomes.join(", ")),
                Some(format!("pick one with --genome, e.g. `--genome {}`", genomes[0])),
            ))
        }
    };
    let g = file.group(&pick).h5ctx(|| format!("opening {pick}"))?;
    let barcodes = strings(path, &g, "barcodes", &pick)?;
    let mut names = strings(path, &g, "gene_names", &pick)?;
    let ids = strings(path, &g, "genes", &pick)?;
    let m = cellranger_matrix(path, file, &pick)?;
    if barcodes.len() != m.n_rows || names.len() != m.n_cols || ids.len() != m.n_cols {
        return Err(bad(path, &format!("{pick}/shape"), format!("is ({}, {}) but there are {} barcodes and {} genes", m.n_cols, m.n_rows, barcodes.len(), names.len()), None));
    }
    make_unique(&mut names);
    let mut obs = DataFrame { index_name: "_index".into(), index: barcodes, columns: Vec::new() };
    let mut var = DataFrame { index_name: "_index".into(), index: names, columns: vec![("gene_ids".into(), Column::Strings(ids))] };
    strings_to_categoricals(&mut obs);
    strings_to_categoricals(&mut var);
    let out = PendingOutput::create_new(dest)?;
    out.write_dataframe("obs", &obs)?;
    out.write_dataframe("var", &var)?;
    copy_csr(&out, "X", &m, None)?;
    out.commit()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Legacy AnnData (< 0.7)

/// One member of a compound dataset, read through the memory type `ty` of `size` bytes.
fn member_bytes(ds: &Dataset, name: &str, ty: TypeDescriptor, size: usize) -> hdf5::Result<Vec<u8>> {
    let desc = TypeDescriptor::Compound(CompoundType { fields: vec![CompoundField { name: name.into(), ty, offset: 0, index: 0 }], size });
    read_bytes_as(ds, &desc, size).ok_or_else(|| hdf5::Error::from(format!("reading the member {name}")))
}

/// Numbers HDF5 converts a member to (native byte order).
trait Native: Sized {
    const SIZE: usize;
    fn from_ne(b: &[u8]) -> Self;
}
macro_rules! native {
    ($($t:ty),*) => {$(impl Native for $t {
        const SIZE: usize = std::mem::size_of::<$t>();
        fn from_ne(b: &[u8]) -> Self { <$t>::from_ne_bytes(b.try_into().expect("chunk of SIZE bytes")) }
    })*};
}
native!(i8, i64, f32, f64);

/// One member as numbers of type `T` (`ty` must describe `T`), `width` of them a row.
fn member<T: Native>(ds: &Dataset, name: &str, ty: TypeDescriptor, width: usize) -> hdf5::Result<Vec<T>> {
    let ty = if width == 1 { ty } else { TypeDescriptor::FixedArray(Box::new(ty), width) };
    let raw = member_bytes(ds, name, ty, T::SIZE * width)?;
    Ok(raw.chunks_exact(T::SIZE).map(T::from_ne).collect())
}

/// A legacy dataframe: a compound dataset whose first member is the index. Integer members
/// named in `categories` (from `uns['<col>_categories']`) become categorical.
fn legacy_dataframe(path: &Path, ds: &Dataset, field: &str, categories: &mut serde_json::Map<String, serde_json::Value>) -> Result<DataFrame> {
    check_backed(path, field, ds)?;
    let TypeDescriptor::Compound(ct) = ds.dtype().and_then(|t| t.to_descriptor()).map_err(|e| bad(path, field, format!("unreadable type: {e}"), None))? else {
        return Err(bad(path, field, "is a dataset but not a table (compound type)", None));
    };
    let read_err = |name: &str, e: hdf5::Error| bad(path, &format!("{field}.{name}"), format!("cannot be read: {e}"), None);
    let mut df = DataFrame::default();
    for (i, f) in ct.fields.iter().enumerate() {
        let col = match &f.ty {
            t @ (TypeDescriptor::FixedAscii(w) | TypeDescriptor::FixedUnicode(w)) => {
                Column::Strings(split_fixed(&member_bytes(ds, &f.name, t.clone(), *w).map_err(|e| read_err(&f.name, e))?, *w))
            }
            TypeDescriptor::Boolean | TypeDescriptor::Enum(_) => {
                let v: Vec<i8> = member(ds, &f.name, TypeDescriptor::Integer(IntSize::U1), 1).map_err(|e| read_err(&f.name, e))?;
                Column::Bool(v.into_iter().map(|x| x != 0).collect())
            }
            TypeDescriptor::Integer(_) | TypeDescriptor::Unsigned(_) => {
                let v: Vec<i64> = member(ds, &f.name, TypeDescriptor::Integer(IntSize::U8), 1).map_err(|e| read_err(&f.name, e))?;
                match categories.remove(&format!("{}_categories", f.name)) {
                    Some(serde_json::Value::Array(cats)) if i > 0 => Column::Categorical {
                        codes: v,
                        categories: cats.iter().map(|c| c.as_str().map(str::to_string).unwrap_or_else(|| c.to_string())).collect(),
                        ordered: false,
                    },
                    _ => Column::Numeric(v.into_iter().map(|x| x as f64).collect()),
                }
            }
            TypeDescriptor::Float(_) => Column::Numeric(member(ds, &f.name, TypeDescriptor::Float(FloatSize::U8), 1).map_err(|e| read_err(&f.name, e))?),
            other => return Err(bad(path, &format!("{field}.{}", f.name), format!("holds {other}, which legacy AnnData does not write"), None)),
        };
        if i == 0 {
            df.index_name = if f.name == "index" { "_index".into() } else { f.name.clone() };
            df.index = match col {
                Column::Strings(v) => v,
                Column::Numeric(v) => v.into_iter().map(|x| format!("{}", x as i64)).collect(),
                other => return Err(bad(path, &format!("{field}.{}", f.name), format!("is the index but holds {}", other.kind()), None)),
            };
        } else {
            df.columns.push((f.name.clone(), col));
        }
    }
    Ok(df)
}

/// Legacy obsm/varm: a compound dataset with a member per key, each a row of floats.
fn legacy_matrices(path: &Path, ds: &Dataset, field: &str) -> Result<Vec<(String, Vec<f32>, usize)>> {
    check_backed(path, field, ds)?;
    let TypeDescriptor::Compound(ct) = ds.dtype().and_then(|t| t.to_descriptor()).map_err(|e| bad(path, field, format!("unreadable type: {e}"), None))? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for f in &ct.fields {
        let (width, elem) = match &f.ty {
            TypeDescriptor::FixedArray(t, n) => (*n, t.as_ref().clone()),
            t @ (TypeDescriptor::Float(_) | TypeDescriptor::Integer(_)) => (1, t.clone()),
            _ => continue,
        };
        if !matches!(elem, TypeDescriptor::Float(_) | TypeDescriptor::Integer(_) | TypeDescriptor::Unsigned(_)) {
            continue;
        }
        let flat: Vec<f32> = member(ds, &f.name, TypeDescriptor::Float(FloatSize::U4), width).map_err(|e| bad(path, &format!("{field}.{}", f.name), format!("cannot be read: {e}"), None))?;
        out.push((f.name.clone(), flat, width));
    }
    Ok(out)
}

fn legacy_to_h5ad(path: &Path, file: &File, dest: &Path) -> Result<()> {
    let mut uns = match file.group("uns") {
        Ok(g) => super::uns::read_group(&g),
        Err(_) => serde_json::json!({}),
    };
    let uns_map = uns.as_object_mut().expect("uns is an object");
    // categories of raw.var live in raw.cat
    let mut raw_cats = match file.group("raw.cat") {
        Ok(g) => super::uns::read_group(&g).as_object().cloned().unwrap_or_default(),
        Err(_) => serde_json::Map::new(),
    };
    let mut obs = legacy_dataframe(path, &file.dataset("obs").h5ctx(|| "opening obs".into())?, "obs", uns_map)?;
    let mut var = legacy_dataframe(path, &file.dataset("var").h5ctx(|| "opening var".into())?, "var", uns_map)?;
    let x = Matrix::open(path, file, "X")?;
    if x.n_rows != obs.index.len() || x.n_cols != var.index.len() {
        return Err(bad(path, "X", format!("is {} x {} but obs has {} rows and var {}", x.n_rows, x.n_cols, obs.index.len(), var.index.len()), None));
    }
    strings_to_categoricals(&mut obs);
    strings_to_categoricals(&mut var);
    let out = PendingOutput::create_new(dest)?;
    out.write_dataframe("obs", &obs)?;
    out.write_dataframe("var", &var)?;
    copy_csr(&out, "X", &x, None)?;
    for (group, n) in [("obsm", obs.index.len()), ("varm", var.index.len())] {
        match file.loc_type_by_name(group) {
            Ok(hdf5::LocationType::Dataset) => {
                let ds = file.dataset(group).h5ctx(|| format!("opening {group}"))?;
                for (key, values, width) in legacy_matrices(path, &ds, group)? {
                    out.write_dense(&format!("{group}/{key}"), &values, n, width)?;
                }
            }
            Ok(hdf5::LocationType::Group) => {
                let g = file.group(group).h5ctx(|| format!("opening {group}"))?;
                for key in g.member_names().unwrap_or_default() {
                    if let Ok(ds) = g.dataset(&key) {
                        if ds.ndim() == 2 {
                            check_backed(path, &format!("{group}/{key}"), &ds)?;
                            let v: Vec<f32> = ds.read_raw().map_err(|e| bad(path, &format!("{group}/{key}"), format!("cannot be read: {e}"), None))?;
                            out.write_dense(&format!("{group}/{key}"), &v, ds.shape()[0], ds.shape()[1])?;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    if file.link_exists("raw.X") {
        let rx = Matrix::open(path, file, "raw.X")?;
        let rvar = match file.dataset("raw.var") {
            Ok(ds) => {
                let mut df = legacy_dataframe(path, &ds, "raw.var", &mut raw_cats)?;
                strings_to_categoricals(&mut df);
                df
            }
            Err(_) => DataFrame { index_name: "_index".into(), index: (0..rx.n_cols).map(|i| i.to_string()).collect(), columns: Vec::new() },
        };
        let g = out.file().create_group("raw").h5ctx(|| "creating raw".into())?;
        super::h5util::set_encoding(&g, "raw", "0.1.0").h5ctx(|| "tagging raw".into())?;
        super::h5util::require_dict(&g, "varm").h5ctx(|| "creating raw/varm".into())?;
        out.write_dataframe("raw/var", &rvar)?;
        copy_csr(&out, "raw/X", &rx, None)?;
    }
    out.write_uns(&uns)?;
    out.commit()?;
    Ok(())
}
