//! Building blocks shared by several models: encoder layers (BERT, packed BERT, post-norm
//! stacks), the CLS encoder of scCello and LangCell, seeded random initialisation, the
//! fine-tuning heads; for training, counter-based dropout (and the residual and feed-forward
//! steps that apply it in one pass), attention that recomputes in the
//! backward pass (and its fused bf16 form on a GPU), layer norm and linear layers that keep only their input, and the time of a
//! step by region; the kNN label transfer and sparse cells made dense on the device. Model files
//! (`methods/`) build on these.

pub mod bert;
pub mod cls_encoder;
pub mod dropout;
pub mod finetune;
pub mod flash_attention;
pub mod layer_norm;
pub mod lean_linear;
pub mod knn_transfer;
pub mod packed_bert;
pub mod transformer;
pub mod optim;
pub mod outside_graph;
pub mod rotary;
pub mod random_init;
pub mod recompute_attention;
pub mod sparse_rows;
pub mod step_profile;
pub mod train_ops;

/// FLOPs of one cell of `s` tokens through `layers` encoder layers of width `d` and
/// feed-forward width `f`: the dense products and the attention scores.
pub fn cell_flops(layers: usize, d: usize, f: usize, s: usize) -> f64 {
    let (l, d, f, s) = (layers as f64, d as f64, f as f64, s as f64);
    l * (2.0 * s * (4.0 * d * d + 2.0 * d * f) + 4.0 * s * s * d)
}
