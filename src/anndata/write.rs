//! Writing results: a copy of the input plus new entries, built in a temporary file beside the
//! destination and renamed into place only when complete.

use std::path::{Path, PathBuf};

use hdf5::{Dataset, File};

use super::h5util::{require_dict, set_encoding};
use crate::error::{Error, Hdf5Context, Result};

/// An output file under construction. Dropping it without `commit` removes the temporary file.
pub struct PendingOutput {
    pub dest: PathBuf,
    temp: tempfile::TempPath,
    pub file: Option<File>,
}

impl PendingOutput {
    /// Copy `input` to a temporary file in `dest`'s folder and open the copy for writing.
    pub fn create(input: &Path, dest: &Path) -> Result<PendingOutput> {
        let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| Error::Io { path: dir.into(), source: e })?;
        let name = dest.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "out.h5ad".into());
        let temp = tempfile::Builder::new()
            .prefix(&format!(".{name}."))
            .suffix(".tmp")
            .tempfile_in(dir)
            .map_err(|e| Error::Io { path: dir.into(), source: e })?
            .into_temp_path();
        std::fs::copy(input, &temp).map_err(|e| Error::Io { path: temp.to_path_buf(), source: e })?;
        let file = File::open_rw(&temp).h5ctx(|| format!("opening the copy {} for writing", temp.display()))?;
        Ok(PendingOutput { dest: dest.into(), temp, file: Some(file) })
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

    /// Close the HDF5 handle and rename the finished file onto its destination.
    pub fn commit(mut self) -> Result<PathBuf> {
        if let Some(f) = self.file.take() {
            f.flush().h5ctx(|| "flushing the output".into())?;
            drop(f);
        }
        let dest = self.dest.clone();
        self.temp.persist(&dest).map_err(|e| Error::Io { path: dest.clone(), source: e.error })?;
        Ok(dest)
    }
}

/// Write one block of rows into a 2-D f32 dataset.
pub fn write_rows(ds: &Dataset, start: usize, values: &[f32], dim: usize) -> Result<()> {
    let rows = values.len() / dim;
    let arr = ndarray::ArrayView2::from_shape((rows, dim), values).expect("block shape");
    ds.write_slice(arr, (start..start + rows, ..)).h5ctx(|| format!("writing rows {start}..{}", start + rows))
}
