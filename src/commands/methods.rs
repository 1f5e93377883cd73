//! `scfoundry methods` and `scfoundry methods show NAME`.

use std::fmt::Write;

use crate::commands::ExitStatus;
use crate::registry::{Dtype, Kind, Method, PrecisionDefault, Registry};
use crate::weights::Manifest;

fn params(n: u64) -> String {
    match n {
        0 => "-".into(),
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.0}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.0}k", n as f64 / 1e3),
        n => n.to_string(),
    }
}

fn device(cuda: bool) -> &'static str {
    if cuda {
        "gpu"
    } else {
        "cpu"
    }
}

/// The table of all methods, cheapest first.
pub fn table(reg: &Registry) -> String {
    let mut rows = vec![["METHOD", "KIND", "FAMILY", "DEVICE", "BATCH", "TIER", "DIM", "PARAMS", "STATUS"].map(String::from).to_vec()];
    for m in reg.by_cost() {
        let batch = match reg.default_batch(m) {
            Some(b) if reg.overrides.contains_key(&m.name) => format!("{b}*"),
            Some(b) => b.to_string(),
            None => "-".into(),
        };
        rows.push(vec![
            m.name.clone(),
            if m.kind == Kind::Integration { "integration".into() } else { "embedding".into() },
            m.family.clone(),
            device(m.cuda).into(),
            batch,
            m.cost_tier.to_string(),
            m.embedding_dim.to_string(),
            params(m.parameters),
            if m.implemented { "ready".into() } else { "planned".into() },
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap()).collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(s, w)| format!("{s:<w$}")).collect();
        writeln!(out, "{}", line.join("  ").trim_end()).unwrap();
    }
    writeln!(out, "\nTIER: relative cost, 1 cheapest to 5 most expensive. BATCH: default --batch-size ('-': no batch option{}).", if reg.overrides.is_empty() { "" } else { "; '*': set by the workspace" }).unwrap();
    let bf16: Vec<&str> = reg.by_cost().into_iter().filter(|m| m.precision.as_ref().is_some_and(|p| p.gpu_default == Dtype::Bf16)).map(|m| m.name.as_str()).collect();
    if !bf16.is_empty() {
        writeln!(out, "--precision auto (the default) runs bf16 on a GPU for {} (their measured distance to f32: `methods show NAME`), f32 elsewhere; --precision f32 for exact parity.", bf16.join(", ")).unwrap();
    }
    writeln!(out, "`scfoundry methods show NAME` gives the options a method honours, its weights and advice.").unwrap();
    out
}

/// The `GPU default precision` lines of `show`: what `--precision auto` runs on a GPU and the
/// measured distance of bf16 to f32 behind it.
fn gpu_precision(p: &PrecisionDefault) -> String {
    let f = &p.fidelity;
    let scib = match (f.scib_total_f32, f.scib_total_bf16) {
        (Some(a), Some(b)) => format!("scIB total f32 {a:.4} / bf16 {b:.4}"),
        _ => "scIB totals not measured yet".to_string(),
    };
    let mut o = String::new();
    writeln!(o, "  GPU default precision: {} (bf16 vs f32: lowest cosine {}, largest rel. error {:.1e}; {scib})", p.gpu_default.name(), f.lowest_cosine, f.largest_rel_error).unwrap();
    writeln!(o, "    measured on {}; {}; {}, {}, commit {}", f.cells, f.source, f.machine, f.date, f.commit).unwrap();
    match p.gpu_default {
        Dtype::Bf16 => writeln!(o, "    --precision auto (the default) runs it on a GPU of compute capability 8.0 or newer, f32 on the CPU; --precision f32 for exact parity").unwrap(),
        Dtype::F32 => writeln!(o, "    --precision auto (the default) runs f32 everywhere; --precision bf16 runs bf16 on a GPU of compute capability 8.0 or newer, at the distance above").unwrap(),
    }
    o
}

/// One method in full.
pub fn show(reg: &Registry, m: &Method) -> String {
    let mut o = String::new();
    writeln!(o, "{} ({}): {}", m.display_name, m.name, m.description).unwrap();
    writeln!(o, "  paper:       {}", m.paper).unwrap();
    writeln!(o, "  code:        {}", m.repository).unwrap();
    writeln!(o, "  family:      {} {}", m.family, if m.kind == Kind::Integration { "(integration)" } else { "" }).unwrap();
    writeln!(o, "  device:      {}", device(m.cuda)).unwrap();
    if let Some(p) = &m.precision {
        o.push_str(&gpu_precision(p));
    } else if m.cuda {
        writeln!(o, "  GPU default precision: f32, its only precision in embed (no --precision: the GPU computes what the CPU does)").unwrap();
    }
    writeln!(o, "  parameters:  {}{}", params(m.parameters), m.parameters_note.as_ref().map(|n| format!(" ({n})")).unwrap_or_default()).unwrap();
    writeln!(o, "  cost tier:   {} of 5", m.cost_tier).unwrap();
    writeln!(o, "  embedding:   {} dimensions", m.embedding_dim).unwrap();
    writeln!(o, "  input:       {} , genes as {}", m.input_values.replace('_', " "), m.input_genes).unwrap();
    if crate::tasks::genes::Kind::parse(&m.input_genes).is_some() {
        writeln!(o, "  gene ids:    found in var_names or a var column (--gene-column), symbols and Ensembl ids mapped offline; stops below --min-gene-match (default {}; docs/genes.md)", crate::tasks::genes::DEFAULT_MIN_GENE_MATCH).unwrap();
    }
    match (&m.batch, reg.overrides.get(&m.name)) {
        (_, Some((b, path))) => writeln!(o, "  batch size:  {b} (set by {}; the method's own default is {})", path.display(), m.batch.as_ref().map(|b| b.default.to_string()).unwrap_or("none".into())).unwrap(),
        (Some(b), None) => {
            writeln!(o, "  batch size:  {} (source: {})", b.default, b.source).unwrap();
            if let (Some(g), Some(src)) = (b.gpu_default, &b.gpu_source) {
                writeln!(o, "  on a GPU:    {g} (source: {src})").unwrap();
            }
        }
        (None, None) => writeln!(o, "  batch size:  none (the method has no batch option)").unwrap(),
    }
    writeln!(o, "  honours:").unwrap();
    for cmd in ["embed", "transfer", "finetune", "integrate"] {
        let h = m.honoured(cmd);
        writeln!(o, "    {cmd:<10} {}", if h.is_empty() { "no batch options".to_string() } else { h.join(", ") }).unwrap();
    }
    if !m.knobs.is_empty() {
        writeln!(o, "  options:").unwrap();
        for k in &m.knobs {
            writeln!(o, "    {:<16} default {}: {}", k.flag, k.default, k.help).unwrap();
        }
    }
    let manifest = Manifest::builtin();
    if m.weights.is_empty() {
        writeln!(o, "  weights:     none").unwrap();
    } else {
        writeln!(o, "  weights:").unwrap();
        for id in &m.weights {
            match manifest.weights.get(id) {
                Some(e) => writeln!(o, "    {id:<36} {} ({})", e.file, e.licence).unwrap(),
                None => writeln!(o, "    {id:<36} (not in weights.toml)").unwrap(),
            }
        }
    }
    writeln!(o, "  status:      {}", if m.implemented { "ready" } else { "planned: registered, not runnable in this version" }).unwrap();
    writeln!(o, "  advice:      {}", m.advice).unwrap();
    o
}

pub fn run(reg: &Registry, name: Option<&str>) -> anyhow::Result<ExitStatus> {
    match name {
        None => print!("{}", table(reg)),
        Some(n) => print!("{}", show(reg, reg.get(n)?)),
    }
    Ok(ExitStatus::Success)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn show_names_every_gpu_methods_default_precision() {
        let reg = Registry::builtin();
        let line = |name: &str| show(&reg, &reg.methods[name]).lines().find(|l| l.contains("GPU default precision")).map(str::to_string);
        // a bf16 default with its measured distance; an f32-only GPU method; a CPU-only method
        assert!(line("geneformer").is_some_and(|l| l.contains("bf16 (bf16 vs f32: lowest cosine")), "{:?}", line("geneformer"));
        assert!(line("scbert").is_some_and(|l| l.contains(": f32, its only precision")), "{:?}", line("scbert"));
        // an f32 default that offers bf16, with bf16's distance
        assert!(line("cellfm").is_some_and(|l| l.contains("precision: f32 (bf16 vs f32: lowest cosine")), "{:?}", line("cellfm"));
        assert!(show(&reg, &reg.methods["cellfm"]).contains("--precision bf16 runs bf16 on a GPU"));
        assert_eq!(line("pca"), None);
        for m in reg.methods.values().filter(|m| m.cuda) {
            assert!(line(&m.name).is_some(), "{} has no GPU default precision line", m.name);
        }
    }
}
