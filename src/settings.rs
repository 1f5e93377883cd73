//! Resolved settings: flag > environment variable > workspace config > built-in default.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::registry::Registry;

pub use crate::env::EnvVars;

pub const CONFIG_FILE: &str = "scfoundry.toml";

/// `scfoundry.toml` of a workspace.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkspaceConfig {
    #[serde(default)]
    pub workspace: WorkspaceSection,
    #[serde(default)]
    pub weights: WeightsSection,
    #[serde(default)]
    pub methods: BTreeMap<String, MethodOverride>,
    /// GPU memory resource for this workspace's runs (`[allocator] kind = "pool"` ...); flags win.
    #[serde(default)]
    pub allocator: Option<crate::gpu::AllocatorOptions>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkspaceSection {
    #[serde(default)]
    pub version: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WeightsSection {
    /// Relative to the workspace, or absolute.
    #[serde(default)]
    pub dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MethodOverride {
    #[serde(default)]
    pub batch_size: Option<u64>,
}

/// A workspace found on disk.
#[derive(Debug, Clone)]
pub struct Workspace {
    pub root: PathBuf,
    pub config: WorkspaceConfig,
}

impl Workspace {
    pub fn config_path(&self) -> PathBuf {
        self.root.join(CONFIG_FILE)
    }

    pub fn load(root: &Path) -> Result<Workspace> {
        let path = root.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::Config {
                path: path.clone(),
                detail: "no workspace here".into(),
                hint: Some(format!("create one with `scfoundry init {}`", root.display())),
            },
            _ => Error::Io { path: path.clone(), source: e },
        })?;
        let config: WorkspaceConfig = toml::from_str(&text).map_err(|e| Error::Config {
            path: path.clone(),
            detail: e.message().to_string() + &e.span().map(|s| format!(" (at byte {})", s.start)).unwrap_or_default(),
            hint: Some("valid keys: [weights] dir, [methods.<name>] batch_size, [allocator] kind/release_threshold/initial_pool_size/maximum_pool_size/limit/device_budget/log; see `scfoundry init --help`".into()),
        })?;
        Ok(Workspace { root: root.to_path_buf(), config })
    }

    /// The workspace named by `explicit`, by $SCFOUNDRY_WORKSPACE, or found upwards from `cwd`.
    pub fn discover(explicit: Option<&Path>, cwd: &Path) -> Result<Option<Workspace>> {
        if let Some(p) = explicit {
            return Workspace::load(p).map(Some);
        }
        let mut dir = Some(cwd);
        while let Some(d) = dir {
            if d.join(CONFIG_FILE).is_file() {
                return Workspace::load(d).map(Some);
            }
            dir = d.parent();
        }
        Ok(None)
    }

    pub fn runs_dir(&self) -> PathBuf {
        self.root.join("runs")
    }

    /// Apply this workspace's overrides to the registry; unknown methods are an error.
    pub fn apply(&self, reg: &mut Registry) -> Result<()> {
        for (name, o) in &self.config.methods {
            if !reg.methods.contains_key(name) {
                return Err(Error::Config {
                    path: self.config_path(),
                    detail: format!("[methods.{name}]: unknown method"),
                    hint: crate::error::suggest(name, reg.methods.keys().map(String::as_str))
                        .map(|s| format!("did you mean [methods.{s}]?")),
                });
            }
            if let Some(b) = o.batch_size {
                if b == 0 {
                    return Err(Error::Config { path: self.config_path(), detail: format!("[methods.{name}] batch_size must be at least 1"), hint: None });
                }
                reg.overrides.insert(name.clone(), (b, self.config_path()));
            }
        }
        Ok(())
    }
}

impl Settings {
    /// The device and allocator a run uses: flags, then the workspace's `[allocator]`, then the
    /// defaults (cpu; async). Checked here, before any run folder exists.
    pub fn device_spec(&self, args: &crate::cli::DeviceArgs) -> Result<crate::gpu::DeviceSpec> {
        use crate::gpu::{AllocatorOptions, DeviceSpec};
        let ws = self.workspace.as_ref().and_then(|w| w.config.allocator.clone().map(|a| (a, w.config_path())));
        let mut a: AllocatorOptions = ws.as_ref().map(|(a, _)| a.clone()).unwrap_or_default();
        if let Some(k) = args.allocator {
            if k != a.kind {
                // pool sizes in the workspace belong to the workspace's kind
                a = AllocatorOptions { kind: k, limit: a.limit, log: a.log.clone(), ..Default::default() };
            }
        }
        a.release_threshold = args.release_threshold.or(a.release_threshold);
        a.initial_pool_size = args.initial_pool_size.or(a.initial_pool_size);
        a.maximum_pool_size = args.maximum_pool_size.or(a.maximum_pool_size);
        a.limit = args.gpu_memory_limit.or(a.limit);
        a.device_budget = args.device_budget.or(a.device_budget);
        if let Some(l) = &args.allocation_log {
            a.log = Some(std::path::absolute(l).map_err(|e| Error::Io { path: l.clone(), source: e })?);
        }
        a.validate().map_err(|e| match (&ws, args.allocator.is_none()) {
            (Some((_, path)), true) => Error::Config { path: path.clone(), detail: format!("[allocator]: {e}"), hint: None },
            _ => Error::Gpu(e),
        })?;
        Ok(DeviceSpec { kind: args.device.unwrap_or_default(), ordinal: 0, allocator: a })
    }
}

/// Global settings every command gets.
#[derive(Debug, Clone)]
pub struct Settings {
    pub workspace: Option<Workspace>,
    pub weights_dir: PathBuf,
    /// Where the weights folder came from, for `weights list`.
    pub weights_dir_source: &'static str,
    pub quiet: bool,
    /// Draw progress bars (off with --quiet or $SCFOUNDRY_NO_PROGRESS).
    pub progress: bool,
    pub registry: Registry,
}

impl Settings {
    pub fn resolve(workspace_flag: Option<&Path>, weights_flag: Option<&Path>, quiet: bool) -> Result<Settings> {
        let cwd = std::env::current_dir().map_err(|e| Error::Io { path: ".".into(), source: e })?;
        let env_ws = std::env::var_os(EnvVars::WORKSPACE).map(PathBuf::from);
        let workspace = Workspace::discover(workspace_flag.or(env_ws.as_deref()), &cwd)?;
        let mut registry = Registry::builtin();
        if let Some(ws) = &workspace {
            ws.apply(&mut registry)?;
        }
        let (weights_dir, weights_dir_source) = if let Some(p) = weights_flag {
            (p.to_path_buf(), "--weights-dir")
        } else if let Some(p) = std::env::var_os(EnvVars::WEIGHTS_DIR) {
            (PathBuf::from(p), "$SCFOUNDRY_WEIGHTS_DIR")
        } else if let Some(dir) = workspace.as_ref().and_then(|w| w.config.weights.dir.as_ref().map(|d| w.root.join(d))) {
            (dir, "workspace scfoundry.toml")
        } else {
            (default_dir(), "default")
        };
        let progress = !quiet && std::env::var_os(EnvVars::NO_PROGRESS).is_none();
        Ok(Settings { workspace, weights_dir, weights_dir_source, quiet, progress, registry })
    }
}

/// The default weights folder when neither flag, environment nor workspace names one.
pub fn default_dir() -> PathBuf {
    cache_base().join("weights-v1")
}

/// scfoundry's folder in the user's cache: `$XDG_CACHE_HOME/scfoundry`, else `~/.cache/scfoundry`.
pub fn cache_base() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("scfoundry")
}
