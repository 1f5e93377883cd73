//! Writing results: a copy of the input plus new entries, built in a temporary file beside the
//! destination and renamed into place only when complete.

use std::path::{Path, PathBuf};

use hdf5::{Dataset, File};

use hdf5::types::VarLenUnicode;

use super::h5util::{require_dict, set_encoding, str_array_attr};
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

    /// Add (or replace) a categorical obs column (anndata's `categorical` 0.2.0): `codes` index
    /// `categories`, -1 marks a missing value.
    pub fn add_obs_categorical(&self, name: &str, codes: &[i32], categories: &[String]) -> Result<()> {
        let obs = self.obs_for(name)?;
        let ctx = || format!("writing obs/{name}");
        let g = obs.create_group(name).h5ctx(ctx)?;
        set_encoding(&g, "categorical", "0.2.0").h5ctx(ctx)?;
        g.new_attr::<bool>().shape(()).create("ordered").h5ctx(ctx)?.write_scalar(&false).h5ctx(ctx)?;
        // the narrowest signed integer, as pandas stores codes
        let n = categories.len();
        if n < i8::MAX as usize {
            let c: Vec<i8> = codes.iter().map(|&v| v as i8).collect();
            g.new_dataset::<i8>().shape([c.len()]).create("codes").h5ctx(ctx)?.write_raw(&c).h5ctx(ctx)?;
        } else if n < i16::MAX as usize {
            let c: Vec<i16> = codes.iter().map(|&v| v as i16).collect();
            g.new_dataset::<i16>().shape([c.len()]).create("codes").h5ctx(ctx)?.write_raw(&c).h5ctx(ctx)?;
        } else {
            g.new_dataset::<i32>().shape([codes.len()]).create("codes").h5ctx(ctx)?.write_raw(codes).h5ctx(ctx)?;
        }
        let cats: Vec<VarLenUnicode> = categories.iter().map(|c| c.parse().map_err(|e| hdf5::Error::from(format!("{e}")))).collect::<hdf5::Result<_>>().h5ctx(ctx)?;
        let ds = g.new_dataset::<VarLenUnicode>().shape([cats.len()]).create("categories").h5ctx(ctx)?;
        ds.write_raw(&cats).h5ctx(ctx)?;
        set_encoding(&ds, "string-array", "0.2.0").h5ctx(ctx)?;
        Ok(())
    }

    /// Add (or replace) a float32 obs column (anndata's `array` 0.2.0).
    pub fn add_obs_f32(&self, name: &str, values: &[f32]) -> Result<()> {
        let obs = self.obs_for(name)?;
        let ctx = || format!("writing obs/{name}");
        let ds = obs.new_dataset::<f32>().shape([values.len()]).create(name).h5ctx(ctx)?;
        ds.write_raw(values).h5ctx(ctx)?;
        set_encoding(&ds, "array", "0.2.0").h5ctx(ctx)?;
        Ok(())
    }

    /// The obs group with `name` free and listed last in `column-order` (kept in place when it
    /// was already listed, so a replaced column keeps its position).
    fn obs_for(&self, name: &str) -> Result<hdf5::Group> {
        let obs = self.file().group("obs").h5ctx(|| "opening obs".into())?;
        if obs.link_exists(name) {
            obs.unlink(name).h5ctx(|| format!("replacing obs/{name}"))?;
        }
        let mut order = str_array_attr(&obs, "column-order").unwrap_or_default();
        if !order.iter().any(|c| c == name) {
            order.push(name.to_string());
        }
        if obs.attr("column-order").is_ok() {
            obs.delete_attr("column-order").h5ctx(|| "replacing obs column-order".into())?;
        }
        let v: Vec<VarLenUnicode> = order.iter().map(|c| c.parse().map_err(|e| hdf5::Error::from(format!("{e}")))).collect::<hdf5::Result<_>>().h5ctx(|| "obs column-order".into())?;
        obs.new_attr::<VarLenUnicode>().shape([v.len()]).create("column-order").and_then(|a| a.write_raw(&v)).h5ctx(|| "writing obs column-order".into())?;
        Ok(obs)
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
