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
    /// the default on a GPU (`--device cuda`) where it differs: a method whose result does not
    /// depend on the batch (eval-mode models) and whose GPU pace does
    #[serde(default)]
    pub gpu_default: Option<u64>,
    /// what `gpu_default` stands on (a measurement)
    #[serde(default)]
    pub gpu_source: Option<String>,
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
    /// `[precision]`: what `--precision auto` (the default) runs on a GPU, and the measured
    /// distance of bf16 to f32 behind that choice. Required with a `--precision` knob.
    #[serde(default)]
    pub precision: Option<PrecisionDefault>,
}

/// A precision the GPU path computes in.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// A method's `[precision]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrecisionDefault {
    /// What `--precision auto` runs on a GPU that has bf16 (compute capability 8.0 and up).
    pub gpu_default: Dtype,
    /// bf16 against f32 on the same cells, as measured.
    pub fidelity: Fidelity,
}

/// The embeddings of one run in bf16 against one in f32: per cell, the lowest cosine and the
/// largest relative error (||a - b|| / ||a||), and the scIB totals of the two embeddings (absent
/// until measured), with where, when and on what they were measured.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fidelity {
    pub lowest_cosine: f64,
    pub largest_rel_error: f64,
    #[serde(default)]
    pub scib_total_f32: Option<f64>,
    #[serde(default)]
    pub scib_total_bf16: Option<f64>,
    /// The model and cells measured (e.g. "random full-size weights, 50 fixture cells").
    pub cells: String,
    /// The table or script the figures come from.
    pub source: String,
    pub machine: String,
    pub date: String,
    pub commit: String,
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
    if let Some(b) = &m.batch {
        match (b.gpu_default, &b.gpu_source) {
            (Some(_), None) | (None, Some(_)) => return Err("[batch] gpu_default and gpu_source go together".into()),
            (Some(g), Some(_)) if g == 0 || !m.cuda => return Err(format!("[batch] gpu_default {g} needs cuda = true and a size of at least 1")),
            _ => {}
        }
    }
    match (&m.precision, m.knob("--precision")) {
        (Some(_), None) => return Err("[precision] is given but the method has no --precision knob".into()),
        (None, Some(_)) => return Err("the --precision knob needs a [precision] table (gpu_default and its measured fidelity)".into()),
        (Some(p), Some(k)) => {
            if !m.cuda {
                return Err("[precision] is given but cuda = false".into());
            }
            if k.default.as_str() != Some("auto") {
                return Err(format!("the --precision knob's default is {}, not \"auto\" ([precision] gpu_default decides)", k.default));
            }
            let f = &p.fidelity;
            let cosine_ok = f.lowest_cosine > 0.0 && f.lowest_cosine <= 1.0;
            let error_ok = f.largest_rel_error >= 0.0;
            if !cosine_ok || !error_ok {
                return Err(format!("[precision.fidelity] lowest_cosine {} must be in (0, 1] and largest_rel_error {} at least 0", f.lowest_cosine, f.largest_rel_error));
            }
        }
        (None, None) => {}
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
        self.default_batch_on(m, false)
    }

    /// [`Self::default_batch`] for a run on a GPU (`on_gpu`): a workspace override, else the
    /// method's `[batch] gpu_default` where it has one, else its default.
    pub fn default_batch_on(&self, m: &Method, on_gpu: bool) -> Option<u64> {
        let own = m.batch.as_ref().map(|b| if on_gpu { b.gpu_default.unwrap_or(b.default) } else { b.default });
        self.overrides.get(&m.name).map(|(b, _)| *b).or(own)
    }

    /// Sorted cheapest first, then by name.
    pub fn by_cost(&self) -> Vec<&Method> {
        let mut v: Vec<&Method> = self.methods.values().collect();
        v.sort_by(|a, b| a.kind.eq(&Kind::Integration).cmp(&b.kind.eq(&Kind::Integration)).then(a.cost_tier.cmp(&b.cost_tier)).then(a.name.cmp(&b.name)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The built-in geneformer toml, with its `[precision]` table and `--precision` knob edited.
    fn geneformer(edit: impl Fn(&str) -> String) -> std::result::Result<Method, String> {
        let (_, text) = BUILTIN.iter().find(|(stem, _)| *stem == "geneformer").expect("geneformer.toml is built in");
        parse_method("geneformer", &edit(text))
    }

    #[test]
    fn the_precision_table_is_read() {
        let m = geneformer(|t| t.to_string()).unwrap();
        let p = m.precision.expect("geneformer declares its GPU default");
        assert_eq!(p.gpu_default, Dtype::Bf16);
        assert!(p.fidelity.lowest_cosine > 0.999 && p.fidelity.largest_rel_error < 0.05, "{:?}", p.fidelity);
    }

    #[test]
    fn the_precision_knob_and_table_come_together() {
        let cut_table = |t: &str| t[..t.find("\n[precision]").expect("a [precision] table")].to_string();
        let e = geneformer(cut_table).unwrap_err();
        assert!(e.contains("needs a [precision] table"), "{e}");
        let e = geneformer(|t| t.replacen("default = \"auto\"", "default = \"f32\"", 1)).unwrap_err();
        assert!(e.contains("not \"auto\""), "{e}");
        let e = geneformer(|t| t.replace("gpu_default = \"bf16\"", "gpu_default = \"fp16\"")).unwrap_err();
        assert!(e.contains("fp16"), "{e}");
        let e = geneformer(|t| t.replace("lowest_cosine = ", "lowest_cosine = 1.5 #")).unwrap_err();
        assert!(e.contains("lowest_cosine"), "{e}");
    }

    #[test]
    fn a_gpu_batch_default_comes_with_its_source() {
        let (_, text) = BUILTIN.iter().find(|(stem, _)| *stem == "scvi").expect("scvi.toml is built in");
        let m = parse_method("scvi", text).unwrap();
        let b = m.batch.as_ref().expect("scvi has a batch default");
        assert_eq!((b.default, b.gpu_default), (128, Some(8192)));
        let reg = Registry { methods: [("scvi".to_string(), m.clone())].into(), overrides: Default::default() };
        assert_eq!((reg.default_batch(&m), reg.default_batch_on(&m, true)), (Some(128), Some(8192)));
        let cut = text.lines().filter(|l| !l.starts_with("gpu_source")).collect::<Vec<_>>().join("\n");
        assert!(parse_method("scvi", &cut).unwrap_err().contains("go together"));
        let cpu_only = text.replace("cuda = true", "cuda = false");
        assert!(parse_method("scvi", &cpu_only).unwrap_err().contains("cuda = true"));
    }
}
