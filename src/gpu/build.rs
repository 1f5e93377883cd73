//! What this binary carries for GPUs, as build.rs recorded it: the CUDA version it was compiled
//! with, the architectures it has machine code (SASS) for and those it has PTX for; and the check
//! of a driver and a card against them (the preflight of `doctor` and of every GPU command).
//! Plain data: no GPU needed, in the CPU build too (where all three are empty).

/// The CUDA version the kernels were compiled with ("12.8", "13.0"); empty in the CPU build.
pub const CUDA_VERSION: &str = env!("SCFOUNDRY_BUILD_CUDA");
const SASS: &str = env!("SCFOUNDRY_BUILD_SASS");
const PTX: &str = env!("SCFOUNDRY_BUILD_PTX");

/// One architecture as nvcc names it: `90` (sm_90 / compute_90) or `90a` (sm_90a: that
/// capability alone, for its architecture-specific instructions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
    pub specific: bool,
}

impl Arch {
    fn parse(s: &str) -> Option<Arch> {
        let s = s.trim();
        let (digits, specific) = match s.strip_suffix('a') {
            Some(d) => (d, true),
            None => (s, false),
        };
        let n: u32 = digits.parse().ok()?;
        Some(Arch { major: n / 10, minor: n % 10, specific })
    }
    fn name(&self) -> String {
        format!("{}{}{}", self.major, self.minor, if self.specific { "a" } else { "" })
    }
}

/// The GPU contents of a build.
#[derive(Debug, Clone)]
pub struct Targets {
    /// "12.8"; empty: no CUDA
    pub cuda: String,
    pub sass: Vec<Arch>,
    pub ptx: Vec<Arch>,
}

/// How a card runs this binary's kernels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fit {
    /// machine code for this architecture (sm_XY with X the card's major, Y at most its minor)
    Sass(String),
    /// the driver compiles the PTX for compute_XY when it loads a module
    Ptx(String),
}

impl Targets {
    /// What this binary carries.
    pub fn this_binary() -> Targets {
        Targets::parse(CUDA_VERSION, SASS, PTX)
    }

    pub fn parse(cuda: &str, sass: &str, ptx: &str) -> Targets {
        let list = |s: &str| s.split(',').filter_map(Arch::parse).collect();
        Targets { cuda: cuda.to_string(), sass: list(sass), ptx: list(ptx) }
    }

    /// "cpu", or e.g. "CUDA 12.8; machine code sm_80, sm_90, sm_90a; PTX compute_90".
    pub fn describe(&self) -> String {
        if self.cuda.is_empty() {
            return "cpu".into();
        }
        let mut parts = vec![format!("CUDA {}", self.cuda)];
        if !self.sass.is_empty() {
            parts.push(format!("machine code {}", self.sass.iter().map(|a| format!("sm_{}", a.name())).collect::<Vec<_>>().join(", ")));
        }
        if !self.ptx.is_empty() {
            parts.push(format!("PTX {}", self.ptx.iter().map(|a| format!("compute_{}", a.name())).collect::<Vec<_>>().join(", ")));
        }
        parts.join("; ")
    }

    /// (major, minor) of the CUDA version, e.g. (12, 8).
    fn version(&self) -> (u32, u32) {
        let mut it = self.cuda.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0))
    }

    /// The oldest driver this binary runs on, in cuDriverGetVersion's form (12000 for CUDA 12.0):
    /// any driver of the compiler's major version (NVIDIA's minor-version compatibility).
    pub fn min_driver(&self) -> i32 {
        self.version().0 as i32 * 1000
    }

    /// The oldest driver that compiles this binary's PTX (PTX from a newer compiler fails to load).
    pub fn min_driver_for_ptx(&self) -> i32 {
        let (ma, mi) = self.version();
        (ma * 1000 + mi * 10) as i32
    }

    /// Whether a card of capability `cap` under a driver of version `driver` (cuDriverGetVersion)
    /// runs this binary's kernels, and how; the error is the problem and what to do.
    pub fn check(&self, driver: i32, cap: (u32, u32)) -> Result<Fit, Unsupported> {
        let show = |v: i32| format!("{}.{}", v / 1000, (v % 1000) / 10);
        if self.cuda.is_empty() {
            return Err(Unsupported { detail: "this scfoundry was built without CUDA".into(), hint: "use --device cpu, or the GPU build (scripts/build-cuda.sh)".into() });
        }
        if driver < self.min_driver() {
            let other = if self.version().0 >= 13 { "; the CUDA 12 build (scripts/build-cuda.sh --cuda 12) runs on drivers for CUDA 12" } else { "" };
            return Err(Unsupported {
                detail: format!("the NVIDIA driver supports CUDA {}, and this scfoundry (built with CUDA {}) needs a driver for CUDA {}.0 or newer", show(driver), self.cuda, self.version().0),
                hint: format!("install a newer NVIDIA driver{other}, or pass --device cpu"),
            });
        }
        let (major, minor) = cap;
        let carried = self.describe();
        if major < 8 {
            return Err(Unsupported {
                detail: format!("the card has compute capability {major}.{minor}; scfoundry's GPU models compute in bf16, which needs compute capability 8.0 (Ampere) or newer"),
                hint: "pass --device cpu, or run on an Ampere (A100, A10, RTX 30xx) or newer card".into(),
            });
        }
        if let Some(a) = self.sass.iter().filter(|a| !a.specific && a.major == major && a.minor <= minor).max_by_key(|a| a.minor) {
            return Ok(Fit::Sass(format!("sm_{}", a.name())));
        }
        if let Some(a) = self.ptx.iter().filter(|a| !a.specific && (a.major, a.minor) <= (major, minor)).max_by_key(|a| (a.major, a.minor)) {
            if driver < self.min_driver_for_ptx() {
                return Err(Unsupported {
                    detail: format!(
                        "the card (compute capability {major}.{minor}) has no machine code in this scfoundry ({carried}); the driver would compile the PTX for compute_{} when loading, which needs a driver for CUDA {} or newer, and this one supports CUDA {}",
                        a.name(), self.cuda, show(driver)
                    ),
                    hint: format!("install a driver for CUDA {} or newer, or pass --device cpu", self.cuda),
                });
            }
            return Ok(Fit::Ptx(format!("compute_{}", a.name())));
        }
        let other = if self.version().0 >= 13 { " (scripts/build-cuda.sh --cuda 12 builds one for compute capability 8.0 and newer)" } else { "" };
        Err(Unsupported {
            detail: format!("the card has compute capability {major}.{minor}, and this scfoundry carries kernels only for newer ones ({carried})"),
            hint: format!("use a build for this card{other}, or pass --device cpu"),
        })
    }
}

/// Why a card or a driver cannot run this binary's kernels, and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    pub detail: String,
    pub hint: String,
}

/// `--version`'s long form: the version, the commit (build.rs asks git), the GPU contents.
pub static LONG_VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let commit = option_env!("SCFOUNDRY_GIT_COMMIT").filter(|c| !c.is_empty()).unwrap_or("unknown");
    format!("{}\ncommit: {commit}\ngpu: {}", env!("CARGO_PKG_VERSION"), Targets::this_binary().describe())
});

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda12() -> Targets {
        Targets::parse("12.8", "80,90,90a", "90")
    }
    fn cuda13() -> Targets {
        Targets::parse("13.0", "", "90,90a")
    }

    #[test]
    fn describes_the_contents() {
        assert_eq!(cuda12().describe(), "CUDA 12.8; machine code sm_80, sm_90, sm_90a; PTX compute_90");
        assert_eq!(cuda13().describe(), "CUDA 13.0; PTX compute_90, compute_90a");
        assert_eq!(Targets::parse("", "", "").describe(), "cpu");
    }

    #[test]
    fn ampere_and_hopper_take_machine_code_on_any_cuda_12_driver() {
        assert_eq!(cuda12().check(12000, (8, 0)), Ok(Fit::Sass("sm_80".into())));
        assert_eq!(cuda12().check(12020, (8, 6)), Ok(Fit::Sass("sm_80".into())));
        assert_eq!(cuda12().check(12020, (8, 9)), Ok(Fit::Sass("sm_80".into())));
        assert_eq!(cuda12().check(12040, (9, 0)), Ok(Fit::Sass("sm_90".into())));
        assert_eq!(cuda12().check(13000, (9, 0)), Ok(Fit::Sass("sm_90".into())));
    }

    #[test]
    fn newer_cards_need_a_driver_that_compiles_the_ptx() {
        assert_eq!(cuda12().check(12080, (10, 0)), Ok(Fit::Ptx("compute_90".into())));
        assert_eq!(cuda12().check(13000, (12, 0)), Ok(Fit::Ptx("compute_90".into())));
        let e = cuda12().check(12040, (10, 0)).unwrap_err();
        assert!(e.detail.contains("CUDA 12.8") && e.detail.contains("supports CUDA 12.4"), "{}", e.detail);
    }

    #[test]
    fn old_drivers_and_old_cards_are_refused_with_what_to_do() {
        let e = cuda12().check(11080, (9, 0)).unwrap_err();
        assert!(e.detail.contains("supports CUDA 11.8") && e.hint.contains("--device cpu"), "{e:?}");
        let e = cuda13().check(12080, (9, 0)).unwrap_err();
        assert!(e.hint.contains("--cuda 12"), "{e:?}");
        let e = cuda12().check(12080, (7, 5)).unwrap_err();
        assert!(e.detail.contains("bf16") && e.detail.contains("7.5"), "{e:?}");
        // the CUDA 13 build carries PTX for compute_90 only: an Ampere card cannot load it
        let e = cuda13().check(13000, (8, 0)).unwrap_err();
        assert!(e.hint.contains("--cuda 12"), "{e:?}");
        assert_eq!(cuda13().check(13000, (9, 0)), Ok(Fit::Ptx("compute_90".into())));
    }
}
