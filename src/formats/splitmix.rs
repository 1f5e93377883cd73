//! SplitMix64 (Steele, Lea and Flood 2014; the constants of Vigna's `splitmix64.c`): the
//! integer stream several parts draw from where the draw must be cheap, stateless or the same
//! in a Python script (dropout masks, random test weights, approximate neighbours' hashing,
//! KMeans' spread set). The CUDA dropout kernel (`gpu/kernels/encoder_ops.cu`) repeats
//! [`mix`]'s constants.

/// The stream's increment (2^64 / golden ratio).
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective mix of one 64-bit word.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The stream from a seed: `next` adds [`GOLDEN`] to the state and mixes it.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// A uniform double in [0, 1) from the top 53 bits (as Python's `(x >> 11) / 2**53`).
    #[inline]
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_stream() {
        // Vigna's splitmix64.c from seed 1234567: 6457827717110365317, 3203168211198807973
        let mut s = SplitMix64(1234567);
        assert_eq!(s.next_u64(), 6457827717110365317);
        assert_eq!(s.next_u64(), 3203168211198807973);
    }
}
