//! One adapter per method: the task that embeds with it (input checks, the model in batches on
//! the task's device, provenance) and its entry's [`crate::tasks::method::Method`].

pub mod c2s;
pub mod cellama;
pub mod cellfm;
pub mod cellplm;
pub mod cls_encoder;
pub mod geneformer;
pub mod genept;
pub mod novae;
pub mod pca;
pub mod scbert;
pub mod scfoundation;
pub mod scgpt;
pub mod scimilarity;
pub mod scprint;
pub mod scvi;
pub mod uce;
