//! Seeded random weights for the benchmarks and tests of models whose real weights cannot be had
//! here: splitmix64 uniforms and Box-Muller normals, generated on the host, so a seed gives the
//! same weights on every device (candle's own generators differ between CPU and CUDA).

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::formats::splitmix::SplitMix64;

/// How one tensor is filled.
pub enum Fill {
    /// Every element this value (norm weights 1, norm biases 0); draws nothing from the stream.
    Const(f32),
    /// Normal(0, std) draws, two uniforms per element, in the tensor's row-major order.
    Normal(f64),
}

/// `1 / sqrt(fan_in)`, with the fan-in the last dimension (the scale the models' inits use).
pub fn inverse_sqrt_last(shape: &[usize]) -> f64 {
    1.0 / (*shape.last().unwrap_or(&1) as f64).sqrt()
}

/// The tensors of `shapes`, in that order from one stream seeded by `seed`, each filled as `fill`
/// says for its name and shape.
pub fn seeded_tensors(
    shapes: Vec<(String, Vec<usize>)>,
    seed: u64,
    device: &Device,
    fill: impl Fn(&str, &[usize]) -> Fill,
) -> candle_core::Result<HashMap<String, Tensor>> {
    let mut stream = SplitMix64(seed);
    let mut uniform = move || stream.uniform();
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let count: usize = shape.iter().product();
            let data: Vec<f32> = match fill(&name, &shape) {
                Fill::Const(v) => vec![v; count],
                Fill::Normal(std) => (0..count)
                    .map(|_| ((-2.0 * (1.0 - uniform()).ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos() * std) as f32)
                    .collect(),
            };
            Ok((name, Tensor::from_vec(data, shape, device)?))
        })
        .collect()
}
