//! `scfoundry weights list|verify`: the pinned manifest against the weights folder.

use crate::commands::ExitStatus;
use crate::error::{suggest, Error};
use crate::settings::Settings;
use crate::weights::{check, Manifest, Status};

fn size(n: Option<u64>) -> String {
    match n {
        None => "?".into(),
        Some(b) => crate::runner::trace::fmt_memory(b),
    }
}

pub fn list(s: &Settings, method: Option<&str>, hash: bool) -> anyhow::Result<ExitStatus> {
    if let Some(m) = method {
        s.registry.get(m)?;
    }
    let manifest = Manifest::builtin();
    println!("weights folder: {} (from {})", s.weights_dir.display(), s.weights_dir_source);
    let mut rows = vec![["ID", "METHOD", "SIZE", "LICENCE", "STATUS"].map(String::from).to_vec()];
    for (id, e) in &manifest.weights {
        if method.is_some_and(|m| m != e.method) {
            continue;
        }
        let st = check(&s.weights_dir, id, e, hash, |_| {})?;
        rows.push(vec![id.clone(), e.method.clone(), size(e.size), e.licence.clone(), st.to_string()]);
    }
    if rows.len() == 1 {
        println!("(no entries{})", method.map(|m| format!(" for {m}")).unwrap_or_default());
        return Ok(ExitStatus::Success);
    }
    let widths: Vec<usize> = (0..5).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap()).collect();
    for r in &rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(s, w)| format!("{s:<w$}")).collect();
        println!("{}", line.join("  ").trim_end());
    }
    Ok(ExitStatus::Success)
}

pub fn verify(s: &Settings, names: &[String]) -> anyhow::Result<ExitStatus> {
    let manifest = Manifest::builtin();
    let mut ids: Vec<&String> = Vec::new();
    for n in names {
        let matched: Vec<&String> = manifest.weights.iter().filter(|(id, e)| *id == n || e.method == *n).map(|(id, _)| id).collect();
        if matched.is_empty() {
            let cands = manifest.weights.keys().map(String::as_str).chain(s.registry.methods.keys().map(String::as_str));
            return Err(Error::BadOption {
                option: "weights verify".into(),
                detail: format!("`{n}` is neither a method with weights nor a weights entry"),
                hint: suggest(n, cands).map(|x| format!("did you mean `{x}`?")).or(Some("`scfoundry weights list` shows the entries".into())),
            }
            .into());
        }
        ids.extend(matched);
    }
    if names.is_empty() {
        ids = manifest.weights.keys().collect();
    }
    let mut bad = 0;
    for id in ids {
        let e = &manifest.weights[id];
        let st = check(&s.weights_dir, id, e, true, |_| {})?;
        if matches!(st, Status::WrongHash { .. } | Status::WrongSize { .. }) {
            bad += 1;
        }
        println!("{id}: {st}");
    }
    if bad > 0 {
        eprintln!("error: {bad} file(s) do not match weights.toml");
        eprintln!("hint: nothing was deleted; move the bad file(s) aside and fetch them again");
        return Ok(ExitStatus::Failure);
    }
    Ok(ExitStatus::Success)
}
