//! The method registry: one `methods/<name>.toml` per method, compiled into the binary.
//!
//! A workspace may override a method's default batch size (`[methods.<name>] batch_size`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

use crate::error::{suggest, Error, Result};

include!(concat!(env!("OUT_DIR"), "/methods_builtin.rs"));

/// The batch options a command may be given.
pub const BATCH_OPTIONS: &[&str] = &["--batch-size", "--predict-batch-size", "--integration-batch-size"];

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Embedding,
    Integration,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Batch {
    pub default: u64,
    pub source: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Honours {
    #[serde(default)]
    pub embed: Vec<String>,
    #[serde(default)]
    pub transfer: Vec<String>,
    #[serde(default)]
    pub finetune: Vec<String>,
    #[serde(default)]
    pub integrate: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Knob {
    pub flag: String,
    pub default: toml::Value,
    pub help: String,
}

/// One method, as declared in `methods/<name>.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Method {
    pub name: String,
    pub display_name: String,
    pub kind: Kind,
    pub family: String,
    pub description: String,
    pub paper: String,
    pub repository: String,
    /// Whether the method has a CUDA path (`--device cuda`); the others run on the CPU and
    /// warn when asked for a GPU.
    pub cuda: bool,
    pub parameters: u64,
    #[serde(default)]
    pub parameters_note: Option<String>,
    pub cost_tier: u8,
    pub embedding_dim: u64,
    pub input_values: String,
    pub input_genes: String,
    #[serde(default)]
    pub weights: Vec<String>,
    pub implemented: bool,
    pub advice: String,
    #[serde(default)]
    pub batch: Option<Batch>,
    #[serde(default)]
    pub honours: Honours,
    #[serde(default)]
    pub knobs: Vec<Knob>,
}

impl Method {
    /// The batch options `command` honours for this method.
    pub fn honoured(&self, command: &str) -> &[String] {
        match command {
            "embed" => &self.honours.embed,
            "transfer" => &self.honours.transfer,
            "finetune" => &self.honours.finetune,
            "integrate" => &self.honours.integrate,
            _ => &[],
        }
    }

    pub fn knob(&self, flag: &str) -> Option<&Knob> {
        self.knobs.iter().find(|k| k.flag == flag)
    }

    pub fn needs_raw_counts(&self) -> bool {
        self.input_values == "raw_counts"
    }
}

/// All methods, with any workspace overrides applied.
#[derive(Debug, Clone)]
pub struct Registry {
    pub methods: BTreeMap<String, Method>,
    /// Default batch sizes overridden by the workspace: method -> (size, config file).
    pub overrides: BTreeMap<String, (u64, PathBuf)>,
}

const FAMILIES: &[&str] = &["baseline", "transformer", "mlp", "vae", "text-embedding", "language-model", "graph", "integration"];

/// Parse and check one method file.
pub fn parse_method(stem: &str, text: &str) -> std::result::Result<Method, String> {
    let m: Method = toml::from_str(text).map_err(|e| e.to_string())?;
    if m.name != stem {
        return Err(format!("name = {:?} but the file is {stem}.toml", m.name));
    }
    if !FAMILIES.contains(&m.family.as_str()) {
        return Err(format!("family {:?} is not one of {}", m.family, FAMILIES.join(", ")));
    }
    if !(1..=5).contains(&m.cost_tier) {
        return Err(format!("cost_tier {} is outside 1..5", m.cost_tier));
    }
    if !["raw_counts", "log_normalized"].contains(&m.input_values.as_str()) {
        return Err(format!("input_values {:?} is not raw_counts or log_normalized", m.input_values));
    }
    if !["symbols", "ensembl", "any"].contains(&m.input_genes.as_str()) {
        return Err(format!("input_genes {:?} is not symbols, ensembl or any", m.input_genes));
    }
    for cmd in ["embed", "transfer", "finetune", "integrate"] {
        for opt in m.honoured(cmd) {
            if !BATCH_OPTIONS.contains(&opt.as_str()) {
                return Err(format!("honours.{cmd} lists {opt:?}, not one of {}", BATCH_OPTIONS.join(", ")));
            }
        }
    }
    Ok(m)
}

impl Registry {
    /// The registry compiled into the binary. Panics only if a built-in file is invalid,
    /// which the test suite rules out.
    pub fn builtin() -> Registry {
        let mut methods = BTreeMap::new();
        for (stem, text) in BUILTIN {
            let m = parse_method(stem, text).unwrap_or_else(|e| panic!("methods/{stem}.toml: {e}"));
            methods.insert(m.name.clone(), m);
        }
        Registry { methods, overrides: BTreeMap::new() }
    }

    pub fn get(&self, name: &str) -> Result<&Method> {
        self.methods.get(name).ok_or_else(|| Error::UnknownMethod {
            name: name.into(),
            suggestion: suggest(name, self.methods.keys().map(String::as_str)),
            known: self.methods.keys().cloned().collect(),
        })
    }

    /// The default batch size in effect: a workspace override, else the method's own.
    pub fn default_batch(&self, m: &Method) -> Option<u64> {
        self.overrides.get(&m.name).map(|(b, _)| *b).or(m.batch.as_ref().map(|b| b.default))
    }

    /// Sorted cheapest first, then by name.
    pub fn by_cost(&self) -> Vec<&Method> {
        let mut v: Vec<&Method> = self.methods.values().collect();
        v.sort_by(|a, b| a.kind.eq(&Kind::Integration).cmp(&b.kind.eq(&Kind::Integration)).then(a.cost_tier.cmp(&b.cost_tier)).then(a.name.cmp(&b.name)));
        v
    }
}
