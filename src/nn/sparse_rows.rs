//! Sparse cells made dense on the model's device: a batch's non-zero values (column, value)
//! travel to the device (through page-locked memory on a GPU, `gpu::upload`) and are scattered
//! into a zeroed dense matrix there, instead of the host building and copying dense rows. For
//! models whose input is every gene of a cell (SCimilarity's 28,231, scVI's): a cell with 5% of
//! its genes non-zero moves a tenth of the bytes.

use candle_core::{DType, Device, Tensor};

use crate::gpu::upload::{upload_f32, upload_u32};

/// A batch of cells laid out for a scatter: each cell's `n_cols` columns cut into `segments`
/// ranges of `width` columns (the last one padded); segment r of cell i is row
/// `i * segments + r` of `k` (column within the range, value) slots, unused slots holding
/// column `u32::MAX` (skipped by the scatter). Several segments per cell give the scatter (a
/// thread per row) enough threads on a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseRows {
    pub n: usize,
    pub n_cols: usize,
    pub segments: usize,
    pub width: usize,
    pub k: usize,
    pub cols: Vec<u32>,
    pub vals: Vec<f32>,
}

impl SparseRows {
    /// `cells`: each cell's (column, value) entries, columns below `n_cols`; a column given
    /// twice takes its last value (the scatter writes a row's slots in order).
    pub fn new(cells: &[Vec<(u32, f32)>], n_cols: usize, segments: usize) -> SparseRows {
        use rayon::prelude::*;
        let segments = segments.clamp(1, n_cols.max(1));
        let width = n_cols.div_ceil(segments).max(1);
        // the fullest segment sets k; each cell then fills its own rows, on all cores
        let k = cells
            .par_iter()
            .map(|c| {
                let mut fill = vec![0usize; segments];
                c.iter().for_each(|&(col, _)| fill[col as usize / width] += 1);
                fill.into_iter().max().unwrap_or(0)
            })
            .max()
            .unwrap_or(0)
            .max(1);
        let mut cols = vec![u32::MAX; cells.len() * segments * k];
        let mut vals = vec![0f32; cells.len() * segments * k];
        cols.par_chunks_mut(segments * k).zip(vals.par_chunks_mut(segments * k)).zip(cells.par_iter()).for_each(|((cs, vs), c)| {
            let mut fill = vec![0usize; segments];
            for &(col, v) in c {
                let r = col as usize / width;
                let at = r * k + fill[r];
                cs[at] = (col as usize % width) as u32;
                vs[at] = v;
                fill[r] += 1;
            }
        });
        SparseRows { n: cells.len(), n_cols, segments, width, k, cols, vals }
    }

    /// How many segments to cut a batch of `n` cells into on `device`: one on the CPU; on a
    /// GPU enough for some 16,000 scatter threads.
    pub fn segments_for(device: &Device, n: usize) -> usize {
        if device.is_cuda() {
            (16_384 / n.max(1)).clamp(1, 64)
        } else {
            1
        }
    }

    /// The dense `n x n_cols` f32 matrix on `device`: zeros with the values scattered in.
    pub fn to_dense(&self, device: &Device) -> candle_core::Result<Tensor> {
        let rows = self.n * self.segments;
        let cols = upload_u32(&self.cols, device)?.reshape((rows, self.k))?;
        let vals = upload_f32(&self.vals, device)?.reshape((rows, self.k))?;
        let dense = Tensor::zeros((rows, self.width), DType::F32, device)?;
        dense.scatter_set(&cols, &vals, 1)?;
        let x = dense.reshape((self.n, self.segments * self.width))?;
        if self.segments * self.width == self.n_cols {
            Ok(x)
        } else {
            x.narrow(1, 0, self.n_cols)?.contiguous()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scattered_rows_equal_the_dense_rows() {
        let cells = vec![vec![(0u32, 1.5f32), (2, -2.0)], vec![], vec![(4, 3.0), (1, 0.25), (3, 7.0)]];
        let mut want = vec![0f32; 3 * 5];
        for (i, c) in cells.iter().enumerate() {
            for &(j, v) in c {
                want[i * 5 + j as usize] = v;
            }
        }
        for segments in [1, 2, 3, 5, 9] {
            let b = SparseRows::new(&cells, 5, segments);
            let got = b.to_dense(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got, want, "{segments} segments");
        }
        // three segments of two columns: cell 0's columns 0 and 2 land in segments 0 and 1
        let b = SparseRows::new(&cells, 5, 3);
        assert_eq!((b.segments, b.width, b.k), (3, 2, 1));
        assert_eq!(&b.cols[..3], &[0, 0, u32::MAX]);
        assert_eq!(&b.cols[6..], &[1, 1, 0]);
        assert_eq!(SparseRows::segments_for(&Device::Cpu, 8), 1);
    }
}
