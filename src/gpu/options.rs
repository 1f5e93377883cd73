//! What the user chose: the device and the allocator, with their sizes. Plain data, parsed and
//! checked here without a GPU, carried to the task process in its spec.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::GpuError;

/// Where a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// The device memory resource, after RMM's resources of the same names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum AllocatorKind {
    /// Stream-ordered allocation from the device's memory pool (cuMemAllocAsync): RMM's advice
    /// for the default. Freed memory stays in the pool up to --release-threshold.
    #[default]
    Async,
    /// A pool reserved up front (--initial-pool-size) that never grows past --maximum-pool-size.
    Pool,
    /// Unified memory (cuMemAllocManaged), prefetched to the device on allocation: data may be
    /// larger than the card's memory.
    Managed,
    /// A pool of unified memory with explicit initial and maximum sizes (the maximum may exceed
    /// the card's memory).
    ManagedPool,
    /// Plain cuMemAlloc/cuMemFree on every tensor, kept for comparison.
    Cuda,
}

impl AllocatorKind {
    pub const ALL: [AllocatorKind; 5] = [AllocatorKind::Async, AllocatorKind::Pool, AllocatorKind::Managed, AllocatorKind::ManagedPool, AllocatorKind::Cuda];

    pub fn name(self) -> &'static str {
        match self {
            AllocatorKind::Async => "async",
            AllocatorKind::Pool => "pool",
            AllocatorKind::Managed => "managed",
            AllocatorKind::ManagedPool => "managed-pool",
            AllocatorKind::Cuda => "cuda",
        }
    }

    /// Memory that may live outside the card (unified memory).
    pub fn is_managed(self) -> bool {
        matches!(self, AllocatorKind::Managed | AllocatorKind::ManagedPool)
    }
}

impl fmt::Display for AllocatorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AllocatorKind {
    type Err = GpuError;
    fn from_str(s: &str) -> Result<Self, GpuError> {
        AllocatorKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| GpuError::BadOption {
            option: "allocator".into(),
            value: s.into(),
            hint: "one of async (the default), pool, managed, managed-pool, cuda".into(),
        })
    }
}

/// A byte size given as `1073741824`, `512MiB`, `8GiB`, `2GB`, `1.5GiB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = GpuError;
    fn from_str(s: &str) -> Result<Self, GpuError> {
        let t = s.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let bad = || GpuError::BadOption {
            option: "size".into(),
            value: format!("{s} (expected a byte count with an optional unit: 1073741824, 512MiB, 8GiB, 2GB, 1.5GiB)"),
            hint: "a byte count with an optional unit: 1073741824, 512MiB, 8GiB, 2GB, 1.5GiB".into(),
        };
        let x: f64 = num.parse().map_err(|_| bad())?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "kb" => 1_000,
            "m" | "mib" => 1 << 20,
            "mb" => 1_000_000,
            "g" | "gib" => 1 << 30,
            "gb" => 1_000_000_000,
            "t" | "tib" => 1 << 40,
            "tb" => 1_000_000_000_000,
            _ => return Err(bad()),
        };
        if !x.is_finite() || x < 0.0 {
            return Err(bad());
        }
        Ok(ByteSize((x * mult as f64).round() as u64))
    }
}

impl TryFrom<String> for ByteSize {
    type Error = GpuError;
    fn try_from(s: String) -> Result<Self, GpuError> {
        s.parse()
    }
}

impl From<ByteSize> for String {
    fn from(b: ByteSize) -> String {
        b.to_string()
    }
}

impl fmt::Display for ByteSize {
    /// Exact when a whole number of GiB/MiB/KiB, else bytes: the string parses back to the value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (unit, m) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
            if b >= m && b % m == 0 {
                return write!(f, "{}{unit}", b / m);
            }
        }
        write!(f, "{b}")
    }
}

/// Human-readable size for messages (not exact).
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

/// The allocator and its options, as the task process applies them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocatorOptions {
    #[serde(default)]
    pub kind: AllocatorKind,
    /// async, pool, managed-pool: bytes a pool keeps reserved after frees before it returns
    /// memory to the system (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD). async's default: the card's
    /// total memory, as RMM's cuda_async_memory_resource (the driver's own is 0); pool's:
    /// everything (a pool keeps what it reserved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_threshold: Option<ByteSize>,
    /// pool, managed-pool: reserved when the run starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_pool_size: Option<ByteSize>,
    /// pool, managed-pool: the pool never grows past this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maximum_pool_size: Option<ByteSize>,
    /// Any mode: allocations that would take the live total past this fail with out-of-memory
    /// (RMM's limiting adaptor). Also how tests simulate a small card.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<ByteSize>,
    /// managed, managed-pool: prefetch to the device only while this many bytes are there; the
    /// rest stays in host memory and migrates on touch (simulates a card of this size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_budget: Option<ByteSize>,
    /// Write every allocation and free as a CSV row (RMM's logging adaptor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
}

impl AllocatorOptions {
    /// Check the combination before any GPU work. `Err` names the option and how to fix it.
    pub fn validate(&self) -> Result<(), GpuError> {
        let pool_only = |name: &str, set: bool| -> Result<(), GpuError> {
            if set && !matches!(self.kind, AllocatorKind::Pool | AllocatorKind::ManagedPool) {
                return Err(GpuError::BadOption {
                    option: name.into(),
                    value: format!("given with --allocator {}", self.kind),
                    hint: "pool sizes apply to --allocator pool or managed-pool".into(),
                });
            }
            Ok(())
        };
        pool_only("initial-pool-size", self.initial_pool_size.is_some())?;
        pool_only("maximum-pool-size", self.maximum_pool_size.is_some())?;
        if self.release_threshold.is_some() && matches!(self.kind, AllocatorKind::Managed | AllocatorKind::Cuda) {
            return Err(GpuError::BadOption {
                option: "release-threshold".into(),
                value: format!("given with --allocator {}", self.kind),
                hint: "a release threshold applies to pools: --allocator async, pool or managed-pool".into(),
            });
        }
        if self.device_budget.is_some() && !self.kind.is_managed() {
            return Err(GpuError::BadOption {
                option: "device-budget".into(),
                value: format!("given with --allocator {}", self.kind),
                hint: "only unified memory can be larger than the card: --allocator managed or managed-pool (use --gpu-memory-limit to cap the others)".into(),
            });
        }
        if let (Some(i), Some(m)) = (self.initial_pool_size, self.maximum_pool_size) {
            if i > m {
                return Err(GpuError::BadOption {
                    option: "initial-pool-size".into(),
                    value: format!("{i} > --maximum-pool-size {m}"),
                    hint: "the initial pool must fit in the maximum".into(),
                });
            }
        }
        if self.kind == AllocatorKind::ManagedPool && self.maximum_pool_size.is_none() {
            return Err(GpuError::BadOption {
                option: "maximum-pool-size".into(),
                value: "missing".into(),
                hint: "--allocator managed-pool needs an explicit --maximum-pool-size (it may exceed the card's memory)".into(),
            });
        }
        Ok(())
    }

    /// One line for reports: `pool (initial 8GiB, maximum 40GiB, limit 20GiB)`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(v) = self.initial_pool_size {
            parts.push(format!("initial {v}"));
        }
        if let Some(v) = self.maximum_pool_size {
            parts.push(format!("maximum {v}"));
        }
        if let Some(v) = self.release_threshold {
            parts.push(format!("release threshold {v}"));
        }
        if let Some(v) = self.limit {
            parts.push(format!("limit {v}"));
        }
        if let Some(v) = self.device_budget {
            parts.push(format!("device budget {v}"));
        }
        if parts.is_empty() {
            self.kind.to_string()
        } else {
            format!("{} ({})", self.kind, parts.join(", "))
        }
    }
}

/// The device a task runs on, with its allocator.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSpec {
    #[serde(default)]
    pub kind: DeviceKind,
    /// CUDA device ordinal as the task process sees it (after CUDA_VISIBLE_DEVICES).
    #[serde(default)]
    pub ordinal: usize,
    #[serde(default)]
    pub allocator: AllocatorOptions,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print_back() {
        assert_eq!("1073741824".parse::<ByteSize>().unwrap().0, 1 << 30);
        assert_eq!("8GiB".parse::<ByteSize>().unwrap().0, 8 << 30);
        assert_eq!("8g".parse::<ByteSize>().unwrap().0, 8 << 30);
        assert_eq!("2GB".parse::<ByteSize>().unwrap().0, 2_000_000_000);
        assert_eq!("1.5GiB".parse::<ByteSize>().unwrap().0, 3 << 29);
        assert_eq!("512 MiB".parse::<ByteSize>().unwrap().0, 512 << 20);
        for bad in ["", "GiB", "-1GiB", "8 parsecs", "1.2.3"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad:?} parsed");
        }
        for v in [1u64, 1023, 1024, 3 << 29, 8 << 30, 123_456_789] {
            let s = ByteSize(v).to_string();
            assert_eq!(s.parse::<ByteSize>().unwrap().0, v, "{s}");
        }
        assert_eq!(ByteSize(3 << 29).to_string(), "1536MiB");
    }

    #[test]
    fn allocator_names_round_trip() {
        for k in AllocatorKind::ALL {
            assert_eq!(k.name().parse::<AllocatorKind>().unwrap(), k);
            let j = serde_json::to_string(&k).unwrap();
            assert_eq!(j, format!("\"{}\"", k.name()));
        }
        let e = "arena".parse::<AllocatorKind>().unwrap_err();
        let e = format!("{e} {}", e.hint().unwrap_or_default());
        assert!(e.contains("arena") && e.contains("managed-pool"), "{e}");
    }

    #[test]
    fn option_combinations_are_checked() {
        let o = |kind, f: &dyn Fn(&mut AllocatorOptions)| {
            let mut x = AllocatorOptions { kind, ..Default::default() };
            f(&mut x);
            x.validate().map_err(|e| format!("{e} {}", e.hint().unwrap_or_default()))
        };
        assert!(o(AllocatorKind::Async, &|_| {}).is_ok());
        assert!(o(AllocatorKind::Async, &|x| x.release_threshold = Some(ByteSize(1 << 30))).is_ok());
        let e = o(AllocatorKind::Async, &|x| x.initial_pool_size = Some(ByteSize(1 << 30))).unwrap_err();
        assert!(e.contains("initial-pool-size") && e.contains("pool"), "{e}");
        let e = o(AllocatorKind::Pool, &|x| {
            x.initial_pool_size = Some(ByteSize(2 << 30));
            x.maximum_pool_size = Some(ByteSize(1 << 30));
        })
        .unwrap_err();
        assert!(e.contains("2GiB > --maximum-pool-size 1GiB"), "{e}");
        let e = o(AllocatorKind::ManagedPool, &|_| {}).unwrap_err();
        assert!(e.contains("maximum-pool-size"), "{e}");
        assert!(o(AllocatorKind::ManagedPool, &|x| x.maximum_pool_size = Some(ByteSize(1 << 40))).is_ok());
        let e = o(AllocatorKind::Pool, &|x| x.device_budget = Some(ByteSize(1 << 30))).unwrap_err();
        assert!(e.contains("device-budget") && e.contains("managed"), "{e}");
        assert!(o(AllocatorKind::Managed, &|x| x.release_threshold = Some(ByteSize(0))).is_err());
    }

    #[test]
    fn options_serialise_for_the_task_spec() {
        let o = AllocatorOptions {
            kind: AllocatorKind::Pool,
            initial_pool_size: Some(ByteSize(8 << 30)),
            maximum_pool_size: Some(ByteSize(40 << 30)),
            limit: Some(ByteSize(20 << 30)),
            ..Default::default()
        };
        let j = serde_json::to_string(&o).unwrap();
        assert_eq!(j, r#"{"kind":"pool","initial_pool_size":"8GiB","maximum_pool_size":"40GiB","limit":"20GiB"}"#);
        assert_eq!(serde_json::from_str::<AllocatorOptions>(&j).unwrap(), o);
        assert_eq!(o.describe(), "pool (initial 8GiB, maximum 40GiB, limit 20GiB)");
        // the workspace config uses the same field names
        let t: AllocatorOptions = toml::from_str("kind = \"managed-pool\"\nmaximum_pool_size = \"200GiB\"").unwrap();
        assert_eq!(t.kind, AllocatorKind::ManagedPool);
        assert_eq!(t.maximum_pool_size, Some(ByteSize(200 << 30)));
    }
}
