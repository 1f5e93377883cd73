//! `--precision`: what a task's model computes in. `auto`, the default, is the method's declared
//! GPU default (`[precision] gpu_default` in `methods/<name>.toml`, chosen from bf16's measured
//! distance to f32) on a GPU that has bf16 (compute capability 8.0 and up), and float32 on the
//! CPU; `f32` is the exact-parity path everywhere, `bf16` asks for bfloat16 on a GPU.

use crate::registry::Dtype;

/// The value of `--precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requested {
    Auto,
    Exactly(Dtype),
}

impl Requested {
    /// `auto`, `f32` or `bf16`; anything else is `None`.
    pub fn parse(s: &str) -> Option<Requested> {
        match s {
            "auto" => Some(Requested::Auto),
            "f32" => Some(Requested::Exactly(Dtype::F32)),
            "bf16" => Some(Requested::Exactly(Dtype::Bf16)),
            _ => None,
        }
    }
}

/// The precision a task runs in, and the note that says why when it is not plainly what was
/// asked (an `auto` on a GPU, or a request this device cannot honour).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub dtype: Dtype,
    pub note: Option<String>,
}

/// The smallest compute capability with bf16 products (Ampere).
const BF16_CAPABILITY: (u32, u32) = (8, 0);

/// Decide the precision from the method's GPU default (`None`: it declares none, so f32), the
/// flag, whether the task runs on a GPU, and the card's compute capability (`None`: unknown).
/// Pure: no device is touched.
pub fn decide(gpu_default: Option<Dtype>, requested: Requested, on_gpu: bool, capability: Option<(u32, u32)>) -> Decision {
    if !on_gpu {
        let note = (requested == Requested::Exactly(Dtype::Bf16)).then(|| "--precision bf16 applies on a GPU; this CPU run used float32".to_string());
        return Decision { dtype: Dtype::F32, note };
    }
    let has_bf16 = capability.is_some_and(|c| c >= BF16_CAPABILITY);
    let card = match capability {
        Some((major, minor)) => format!("this card has compute capability {major}.{minor}"),
        None => "this card's compute capability could not be read".to_string(),
    };
    match requested {
        Requested::Exactly(Dtype::F32) => Decision { dtype: Dtype::F32, note: None },
        Requested::Exactly(Dtype::Bf16) if has_bf16 => Decision { dtype: Dtype::Bf16, note: None },
        Requested::Exactly(Dtype::Bf16) => Decision { dtype: Dtype::F32, note: Some(format!("--precision bf16 needs compute capability 8.0 or newer and {card}: this run used float32")) },
        Requested::Auto => match gpu_default.unwrap_or(Dtype::F32) {
            Dtype::Bf16 if has_bf16 => Decision { dtype: Dtype::Bf16, note: Some("precision bf16: this method's GPU default (--precision f32 for exact parity)".into()) },
            Dtype::Bf16 => Decision { dtype: Dtype::F32, note: Some(format!("precision f32: this method's GPU default, bf16, needs compute capability 8.0 or newer and {card}")) },
            Dtype::F32 => Decision { dtype: Dtype::F32, note: Some("precision f32: this method's GPU default".into()) },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOPPER: Option<(u32, u32)> = Some((9, 0));
    const TURING: Option<(u32, u32)> = Some((7, 5));

    #[test]
    fn parses_the_three_values_only() {
        assert_eq!(Requested::parse("auto"), Some(Requested::Auto));
        assert_eq!(Requested::parse("f32"), Some(Requested::Exactly(Dtype::F32)));
        assert_eq!(Requested::parse("bf16"), Some(Requested::Exactly(Dtype::Bf16)));
        assert_eq!(Requested::parse("fp16"), None);
    }

    #[test]
    fn auto_on_a_gpu_runs_the_methods_default_and_says_so() {
        let d = decide(Some(Dtype::Bf16), Requested::Auto, true, HOPPER);
        assert_eq!(d.dtype, Dtype::Bf16);
        assert!(d.note.as_deref().unwrap().contains("--precision f32 for exact parity"), "{d:?}");
        let d = decide(Some(Dtype::F32), Requested::Auto, true, HOPPER);
        assert_eq!(d.dtype, Dtype::F32);
        assert_eq!(decide(None, Requested::Auto, true, HOPPER).dtype, Dtype::F32, "no declared default is f32");
        assert_eq!(decide(Some(Dtype::Bf16), Requested::Auto, true, Some((8, 0))).dtype, Dtype::Bf16, "Ampere has bf16");
    }

    #[test]
    fn below_capability_8_auto_and_bf16_fall_back_to_f32() {
        for req in [Requested::Auto, Requested::Exactly(Dtype::Bf16)] {
            let d = decide(Some(Dtype::Bf16), req, true, TURING);
            assert_eq!(d.dtype, Dtype::F32, "{req:?}");
            assert!(d.note.as_deref().unwrap().contains("compute capability 7.5"), "{d:?}");
            let d = decide(Some(Dtype::Bf16), req, true, None);
            assert_eq!(d.dtype, Dtype::F32, "unknown capability, {req:?}");
        }
    }

    #[test]
    fn the_cpu_runs_f32_with_a_note_only_for_an_explicit_bf16() {
        for (req, noted) in [(Requested::Auto, false), (Requested::Exactly(Dtype::F32), false), (Requested::Exactly(Dtype::Bf16), true)] {
            let d = decide(Some(Dtype::Bf16), req, false, None);
            assert_eq!((d.dtype, d.note.is_some()), (Dtype::F32, noted), "{req:?}: {d:?}");
        }
    }

    #[test]
    fn explicit_requests_on_a_capable_gpu_are_honoured_quietly() {
        assert_eq!(decide(Some(Dtype::Bf16), Requested::Exactly(Dtype::F32), true, HOPPER), Decision { dtype: Dtype::F32, note: None });
        assert_eq!(decide(Some(Dtype::F32), Requested::Exactly(Dtype::Bf16), true, HOPPER), Decision { dtype: Dtype::Bf16, note: None });
    }
}
