//! GenePT-w: Chen Y, Zou J, "GenePT: a simple but effective foundation model for genes and cells
//! built from ChatGPT", bioRxiv 2023, doi:10.1101/2023.10.16.562533; upstream code
//! https://github.com/yiqunchen/GenePT (notebooks; GenePT-w is computed in
//! `aorta_data_analysis.ipynb`, read at commit 45a36bc).
//!
//! The table: a pickled dict {gene symbol: vector}, the text-embedding-ada-002 embedding (1536-d)
//! of each gene's NCBI summary (`GenePT_gene_embedding_ada_text.pickle` in the pinned Zenodo zip
//! GenePT_emebdding_v2.zip). It is read as data by `formats::pickle::read_pickle` (nothing in it is
//! executed); a vector may be a numpy array (pickled by `_reconstruct` or, protocol 5,
//! `_frombuffer`; float64 or float32) or a list of numbers.
//!
//! A cell (upstream's notebook, word for word in numbers): `lookup[i]` is the table's vector of
//! the data's i-th gene (`var_names`, matched exactly) or zeros when the table has none;
//! `cell = X[cell] . lookup / n_genes`, where n_genes counts every gene of the data, matched or
//! not. There is no further normalisation (no L2, no division by the cell's total): that is
//! what upstream's code computes, so that is what we compute. X is used as given (upstream runs
//! it on the log-normalised matrix of its data). Sums are in float64, as upstream's
//! float64 lookup table; rows are written as float32.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::formats::pickle::{read_pickle, Py};

/// The weights entry (the pinned zip, extracted beside itself by `weights pull`).
pub const ARCHIVE_ENTRY: &str = "genept-embeddings-v2";
/// The table's file name in the zip.
pub const TABLE_FILE: &str = "GenePT_gene_embedding_ada_text.pickle";
/// The table's shape, for error messages.
pub const TABLE_FIELDS: &str = "a pickled dict {gene symbol: vector of floats}, as GenePT's GenePT_gene_embedding_ada_text.pickle";

/// The gene text-embedding table.
#[derive(Debug, Clone)]
pub struct Table {
    pub dim: usize,
    pub index: HashMap<String, usize>,
    /// `index.len() x dim`, row-major.
    pub vectors: Vec<f64>,
}

fn bad(path: &Path, detail: String) -> Error {
    Error::BadWeights { path: path.to_path_buf(), detail: format!("{detail}; expected {TABLE_FIELDS}") }
}

/// A numeric vector from a pickled value: a numpy array of floats or integers, or a list/tuple
/// of numbers.
pub fn vector(v: &Py) -> std::result::Result<Vec<f64>, String> {
    match v {
        Py::List(xs) | Py::Tuple(xs) => xs
            .iter()
            .map(|x| match x {
                Py::Float(f) => Ok(*f),
                Py::Int(i) => Ok(*i as f64),
                Py::Bool(b) => Ok(*b as u8 as f64),
                other => Err(format!("a list holding {}", kind(other))),
            })
            .collect(),
        Py::Array { dtype, shape, items } => {
            let n: usize = shape.iter().product();
            if items.len() != n {
                return Err(format!("a numpy array of shape {shape:?} holding {} values", items.len()));
            }
            items
                .iter()
                .map(|x| match x {
                    Py::Float(f) => Ok(*f),
                    Py::Int(i) => Ok(*i as f64),
                    Py::Bool(b) => Ok(*b as u8 as f64),
                    other => Err(format!("a numpy array of dtype {dtype} holding {}", kind(other))),
                })
                .collect()
        }
        other => Err(kind(other).to_string()),
    }
}

fn kind(v: &Py) -> &'static str {
    match v {
        Py::None => "None",
        Py::Bool(_) => "a bool",
        Py::Int(_) => "an int",
        Py::Float(_) => "a float",
        Py::Str(_) => "a string",
        Py::Bytes(_) => "bytes",
        Py::List(_) => "a list",
        Py::Tuple(_) => "a tuple",
        Py::Dict(_) => "a dict",
        Py::Global(_) => "a global",
        Py::Dtype(..) => "a dtype",
        Py::Array { .. } => "a numpy array",
        Py::Object { .. } => "an object",
    }
}

impl Table {
    /// Read the pickled table. All vectors must have one length.
    pub fn load(path: &Path) -> Result<Table> {
        let bytes = std::fs::read(path).map_err(|e| Error::BadWeights {
            path: path.to_path_buf(),
            detail: if e.kind() == std::io::ErrorKind::NotFound { "no such file".into() } else { e.to_string() },
        })?;
        Table::from_pickle(&bytes).map_err(|d| bad(path, d))
    }

    pub fn from_pickle(bytes: &[u8]) -> std::result::Result<Table, String> {
        let v = read_pickle(bytes).map_err(|e| format!("not readable as a data pickle: {e}"))?;
        let items = v.into_dict().map_err(|other| format!("holds {}, not a dict", kind(&other)))?;
        if items.is_empty() {
            return Err("is an empty dict".into());
        }
        let mut index = HashMap::with_capacity(items.len());
        let mut vectors = Vec::new();
        let mut dim = None;
        for (k, v) in items {
            let gene = k.into_string().map_err(|other| format!("has a key that is {}, not a gene symbol", kind(&other)))?;
            let x = vector(&v).map_err(|e| format!("the value of `{gene}` is {e}, not a vector of numbers"))?;
            match dim {
                None => dim = Some(x.len()),
                Some(d) if d != x.len() => return Err(format!("`{gene}` has a {}-d vector, the genes before it {d}-d", x.len())),
                _ => {}
            }
            // a key repeated in the pickle: the last value wins, as in the dict Python builds
            match index.get(&gene) {
                Some(&row) => {
                    let d = x.len();
                    vectors[row * d..(row + 1) * d].copy_from_slice(&x);
                }
                None => {
                    index.insert(gene, index.len());
                    vectors.extend(x);
                }
            }
        }
        let dim = dim.unwrap_or(0);
        if dim == 0 {
            return Err("has zero-length vectors".into());
        }
        Ok(Table { dim, index, vectors })
    }

    pub fn get(&self, gene: &str) -> Option<&[f64]> {
        self.index.get(gene).map(|&r| &self.vectors[r * self.dim..(r + 1) * self.dim])
    }
}

/// The lookup of the data's genes: each var name's table row, or None.
pub struct Lookup {
    pub rows: Vec<Option<usize>>,
    pub missing: usize,
}

impl Lookup {
    pub fn new(var_names: &[String], table: &Table) -> Lookup {
        let rows: Vec<Option<usize>> = var_names.iter().map(|g| table.index.get(g).copied()).collect();
        let missing = rows.iter().filter(|r| r.is_none()).count();
        Lookup { rows, missing }
    }

    pub fn matched(&self) -> usize {
        self.rows.len() - self.missing
    }
}

/// One cell's GenePT-w embedding from its sparse row (`indices`, `values` over the data's genes):
/// sum of value x gene vector over matched genes, divided by the number of data genes.
pub fn embed_cell(indices: &[u32], values: &[f32], lookup: &Lookup, table: &Table, out: &mut [f64]) {
    out.iter_mut().for_each(|o| *o = 0.0);
    let d = table.dim;
    for (&j, &v) in indices.iter().zip(values) {
        if v == 0.0 {
            continue;
        }
        if let Some(r) = lookup.rows[j as usize] {
            let row = &table.vectors[r * d..(r + 1) * d];
            let v = v as f64;
            for (o, &g) in out.iter_mut().zip(row) {
                *o += v * g;
            }
        }
    }
    let n = lookup.rows.len() as f64;
    out.iter_mut().for_each(|o| *o /= n);
}

/// Where the table is: `model_dir` (a folder holding the pickle, e.g. the extracted
/// GenePT_emebdding_v2/) when given, else the pinned zip's folder in the weights folder,
/// searched for the pickle (the zip's own folder name inside it is not assumed).
pub fn table_path(weights_dir: &Path, manifest: &crate::weights::Manifest, model_dir: Option<&Path>) -> Result<PathBuf> {
    let candidates: Vec<PathBuf> = match model_dir {
        Some(d) => vec![d.join(TABLE_FILE)],
        None => {
            let file = manifest.weights.get(ARCHIVE_ENTRY).map(|e| e.file.clone()).unwrap_or_else(|| "genept/GenePT_emebdding_v2.zip".into());
            let base = weights_dir.join(&file).parent().map(Path::to_path_buf).unwrap_or_else(|| weights_dir.to_path_buf());
            vec![base.join(TABLE_FILE), base.join("GenePT_emebdding_v2").join(TABLE_FILE), base.join("GenePT_embedding_v2").join(TABLE_FILE)]
        }
    };
    if let Some(p) = candidates.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    Err(Error::BadWeights {
        path: candidates[0].clone(),
        detail: format!(
            "no such file (looked for {}); the GenePT table is {TABLE_FILE}, from GenePT_emebdding_v2.zip",
            candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table {
        let mut index = HashMap::new();
        index.insert("A".to_string(), 0);
        index.insert("B".to_string(), 1);
        Table { dim: 2, index, vectors: vec![1.0, 2.0, -3.0, 0.5] }
    }

    #[test]
    fn weighted_sum_over_all_data_genes() {
        let t = table();
        let names: Vec<String> = ["B", "X", "A", "Y"].iter().map(|s| s.to_string()).collect();
        let l = Lookup::new(&names, &t);
        assert_eq!((l.matched(), l.missing), (2, 2));
        let mut out = vec![0.0; 2];
        // 2 x B + 1 x X(missing) + 4 x A, divided by 4 data genes
        embed_cell(&[0, 1, 2], &[2.0, 1.0, 4.0], &l, &t, &mut out);
        assert_eq!(out, vec![(2.0 * -3.0 + 4.0 * 1.0) / 4.0, (2.0 * 0.5 + 4.0 * 2.0) / 4.0]);
        // a cell without counts is the zero vector, as upstream's dot product
        embed_cell(&[], &[], &l, &t, &mut out);
        assert_eq!(out, vec![0.0, 0.0]);
    }

    #[test]
    fn vectors_from_arrays_and_lists() {
        let a = Py::Array { dtype: "<f4".into(), shape: vec![1, 2], items: vec![Py::Float(1.5), Py::Float(-2.0)] };
        assert_eq!(vector(&a).unwrap(), vec![1.5, -2.0]);
        let b = Py::Array { dtype: ">f8".into(), shape: vec![1], items: vec![Py::Float(0.25)] };
        assert_eq!(vector(&b).unwrap(), vec![0.25]);
        assert_eq!(vector(&Py::List(vec![Py::Float(1.0), Py::Int(2)])).unwrap(), vec![1.0, 2.0]);
        assert!(vector(&Py::Str("x".into())).is_err());
        let short = Py::Array { dtype: "f8".into(), shape: vec![2], items: vec![Py::Float(0.0)] };
        assert!(vector(&short).unwrap_err().contains("holding 1 values"));
        assert_eq!(crate::formats::pickle::f16_to_f64(0x3c00), 1.0);
        assert_eq!(crate::formats::pickle::f16_to_f64(0xc000), -2.0);
    }

    #[test]
    fn tables_must_be_dicts_of_equal_vectors() {
        // {"A": [1.0, 2.0], "B": [3.0]} at protocol 2
        let p = b"\x80\x02}q\x00(X\x01\x00\x00\x00Aq\x01]q\x02(G?\xf0\x00\x00\x00\x00\x00\x00G@\x00\x00\x00\x00\x00\x00\x00eX\x01\x00\x00\x00Bq\x03]q\x04G@\x08\x00\x00\x00\x00\x00\x00au.";
        let e = Table::from_pickle(p).unwrap_err();
        assert!(e.contains("`B` has a 1-d vector"), "{e}");
        let e = Table::from_pickle(b"\x80\x02]q\x00.").unwrap_err();
        assert!(e.contains("not a dict"), "{e}");
    }
}
