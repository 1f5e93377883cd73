//! Sparse cells made dense on the model's device: a batch's non-zero values travel to the device
//! as CSR (row offsets, columns, values; through page-locked memory on a GPU, `gpu::upload`) and
//! are written into a zeroed dense matrix there (`gpu::csr_dense`: a block a row, its threads
//! over the row's values), instead of the host building and copying dense rows. For models whose
//! input is every gene of a cell (SCimilarity's 28,231, scVI's): a cell with 5% of its genes
//! non-zero moves a tenth of the bytes, and the host's work is a pass over the non-zero values.

use candle_core::{Device, Tensor};

/// A batch of `n` cells as CSR over `n_cols` columns, each column at most once in a cell (the
/// device writes a row's values in parallel; a repeated column would race). The columns and
/// values are held as built, a chunk of [`CHUNK`] cells a part (joined, the parts are the CSR
/// arrays: the upload copies them into page-locked memory on all cores, never joined on the
/// host); cell i's values are `offsets[i]..offsets[i + 1]` of the joined arrays ([`Self::row`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SparseRows {
    pub n: usize,
    pub n_cols: usize,
    pub offsets: Vec<u32>,
    pub parts: Vec<(Vec<u32>, Vec<f32>)>,
    /// the number of values (more than `offsets` can count past 2^32 - 1)
    pub values: u64,
}

/// Cells built a chunk at a time on each core (a chunk's pairs in its own buffers).
pub const CHUNK: usize = 64;

impl SparseRows {
    /// `n` cells, cell i's pairs written by `row(i, out)` into an emptied `out` (columns below
    /// `n_cols`, each at most once), built on all cores. `Err((i, e))`: the lowest cell `i` whose
    /// `row` failed, with its error (what a serial pass would report first).
    pub fn build<E: Send>(n: usize, n_cols: usize, row: impl Fn(usize, &mut Vec<(u32, f32)>) -> Result<(), E> + Sync) -> Result<SparseRows, (usize, E)> {
        use rayon::prelude::*;
        type Part = (Vec<u32>, Vec<u32>, Vec<f32>);
        let parts: Vec<Result<Part, (usize, E)>> = (0..n.div_ceil(CHUNK))
            .into_par_iter()
            .map(|c| {
                let (lo, hi) = (c * CHUNK, ((c + 1) * CHUNK).min(n));
                let (mut lens, mut cols, mut vals) = (Vec::with_capacity(hi - lo), Vec::new(), Vec::new());
                let mut e = Vec::new();
                for i in lo..hi {
                    e.clear();
                    row(i, &mut e).map_err(|x| (i, x))?;
                    lens.push(e.len() as u32);
                    cols.extend(e.iter().map(|p| p.0));
                    vals.extend(e.iter().map(|p| p.1));
                }
                Ok((lens, cols, vals))
            })
            .collect();
        let mut out = SparseRows { n, n_cols, offsets: Vec::with_capacity(n + 1), parts: Vec::with_capacity(parts.len()), values: 0 };
        out.offsets.push(0);
        let mut at = 0u64;
        for p in parts {
            let (lens, cols, vals) = p?;
            for l in lens {
                at += l as u64;
                out.offsets.push(at.min(u32::MAX as u64) as u32);
            }
            out.parts.push((cols, vals));
        }
        out.values = at;
        Ok(out)
    }

    /// The number of values (non-zero entries) of the batch.
    pub fn nnz(&self) -> usize {
        self.values as usize
    }

    /// Cell `i`'s columns and values.
    pub fn row(&self, i: usize) -> (&[u32], &[f32]) {
        let c = i / CHUNK;
        let base = self.offsets[c * CHUNK];
        let (a, b) = ((self.offsets[i] - base) as usize, (self.offsets[i + 1] - base) as usize);
        (&self.parts[c].0[a..b], &self.parts[c].1[a..b])
    }

    /// `cells`' (column, value) pairs as a batch (see [`Self::build`]).
    pub fn new(cells: &[Vec<(u32, f32)>], n_cols: usize) -> SparseRows {
        let built: Result<SparseRows, (usize, ())> = SparseRows::build(cells.len(), n_cols, |i, out| {
            out.extend_from_slice(&cells[i]);
            Ok(())
        });
        built.unwrap_or_else(|_| unreachable!("the rows are given"))
    }

    /// The dense `n x n_cols` f32 matrix on `device`: zeros with the values written in (one
    /// kernel on a GPU, after three uploads from page-locked memory).
    pub fn to_dense(&self, device: &Device) -> candle_core::Result<Tensor> {
        if self.values > u32::MAX as u64 {
            candle_core::bail!("sparse rows: {} values in one batch of {} cells, more than 2^32 - 1: use a smaller --batch-size", self.values, self.n);
        }
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            let cols: Vec<&[u32]> = self.parts.iter().map(|p| p.0.as_slice()).collect();
            let vals: Vec<&[f32]> = self.parts.iter().map(|p| p.1.as_slice()).collect();
            return crate::gpu::csr_dense::to_dense(&self.offsets, &cols, &vals, self.n, self.n_cols, dev);
        }
        let mut dense = vec![0f32; self.n * self.n_cols];
        for i in 0..self.n {
            let row = &mut dense[i * self.n_cols..(i + 1) * self.n_cols];
            let (cols, vals) = self.row(i);
            for (&c, &v) in cols.iter().zip(vals) {
                row[c as usize] = v;
            }
        }
        Tensor::from_vec(dense, (self.n, self.n_cols), device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scattered_rows_equal_the_dense_rows() {
        let cells: Vec<Vec<(u32, f32)>> = (0..150).map(|i| if i % 7 == 3 { vec![] } else { vec![(0u32, 1.5 + i as f32), (((i * 3) % 4 + 1) as u32, -2.0)] }).collect();
        let mut want = vec![0f32; cells.len() * 5];
        for (i, c) in cells.iter().enumerate() {
            for &(j, v) in c {
                want[i * 5 + j as usize] = v;
            }
        }
        let b = SparseRows::new(&cells, 5);
        assert_eq!(b.offsets.len(), 151);
        assert_eq!(b.nnz(), b.parts.iter().map(|p| p.0.len()).sum::<usize>());
        assert_eq!(b.parts.len(), 3);
        assert_eq!(b.row(100), (&[0u32, 1][..], &[101.5f32, -2.0][..]));
        assert_eq!(&b.offsets[..5], &[0, 2, 4, 6, 6]);
        let got = b.to_dense(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, want);
        assert_eq!(SparseRows::new(&[], 5).to_dense(&Device::Cpu).unwrap().dims(), &[0, 5]);
    }

    #[test]
    fn a_failed_row_is_the_lowest_one() {
        // rows 70 and 130 fail, in different chunks: the lowest is reported, as a serial pass would
        let r = SparseRows::build(200, 3, |i, out| if i == 70 || i == 130 { Err(i * 10) } else { out.push((1, 1.0)); Ok(()) });
        assert_eq!(r.unwrap_err(), (70, 700));
    }
}
