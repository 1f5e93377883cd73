//! File formats shared by several methods, read as data (nothing in them is run).

pub mod pickle;
pub mod splitmix;
pub mod numpy_rng;
pub mod torch_zip;
