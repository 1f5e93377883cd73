//! The methods, one line each, by the name in `methods/<name>.toml`. A toml marked
//! `implemented = true` has an entry here and an entry has such a toml (a test checks both).
//! Adding a method: its model file (`methods/`), its adapter (`tasks/embed/`), its toml, its
//! docs page, its tests and one line here.

use crate::tasks::embed::*;
use crate::tasks::integrate::{harmony::Harmony, scgpt_integrated::ScgptIntegrated, scvi_denovo::ScviDenovo, seurat::Seurat};
use crate::tasks::method::Method;

/// Every implemented method, by name.
pub static METHODS: &[(&str, &dyn Method)] = &[
    ("c2s", &c2s::C2s),
    ("cellama", &cellama::Cellama),
    ("cellfm", &cellfm::CellFmMethod),
    ("cellplm", &cellplm::CellPlmMethod),
    ("geneformer", &geneformer::GeneformerMethod),
    ("genept", &genept::GenePt),
    ("harmony", &Harmony),
    ("langcell", &cls_encoder::ClsEncoderMethod(crate::nn::cls_encoder::Arch::Langcell)),
    ("novae", &novae::NovaeMethod),
    ("pca", &pca::Pca),
    ("scbert", &scbert::ScBertMethod),
    ("sccello", &cls_encoder::ClsEncoderMethod(crate::nn::cls_encoder::Arch::Sccello)),
    ("scfoundation", &scfoundation::ScFoundationMethod),
    ("scgpt", &scgpt::ScgptMethod),
    ("scgpt_integrated", &ScgptIntegrated),
    ("scimilarity", &scimilarity::Scimilarity),
    ("scprint", &scprint::ScPrintMethod),
    ("scvi", &scvi::ScviMethod),
    ("scvi_denovo", &ScviDenovo),
    ("seurat", &Seurat),
    ("uce", &uce::UceMethod),
];

/// The method named `name`, if one is implemented.
pub fn get(name: &str) -> Option<&'static dyn Method> {
    METHODS.iter().find(|(n, _)| *n == name).map(|(_, m)| *m)
}

/// The names of the methods for which `pred` holds, in table order.
pub fn names(pred: impl Fn(&dyn Method) -> bool) -> Vec<&'static str> {
    METHODS.iter().filter(|(_, m)| pred(*m)).map(|(n, _)| *n).collect()
}
