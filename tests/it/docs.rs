//! Docs that name tests name real ones: every `file.rs::test` on the reliability and file-format
//! pages is a test function in tests/it/file.rs.

use crate::common::repo;

fn named_tests(page: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join(page)).unwrap();
    let mut out = Vec::new();
    for (i, _) in text.match_indices(".rs::") {
        let file: String = text[..i].chars().rev().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<Vec<_>>().into_iter().rev().collect();
        let name: String = text[i + 5..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !file.is_empty() && !name.is_empty() {
            out.push((file, name));
        }
    }
    out
}

#[test]
fn reliability_page_names_real_tests() {
    for page in ["docs/reliability.md", "docs/file-formats.md"] {
        let named = named_tests(page);
        assert!(!named.is_empty(), "{page} names no test");
        for (file, name) in named {
            let src = std::fs::read_to_string(repo().join("tests/it").join(format!("{file}.rs"))).unwrap_or_else(|_| panic!("{page}: tests/it/{file}.rs does not exist"));
            assert!(src.contains(&format!("fn {name}(")), "{page}: tests/it/{file}.rs has no test `{name}`");
        }
    }
}

/// A table generated from a test's own cases: the page must hold it between
/// `<!-- generated: NAME -->` and `<!-- end: NAME -->`. With SCFOUNDRY_UPDATE_DOCS=1 the page is
/// rewritten instead (then review and commit it).
pub fn check_generated(page: &str, name: &str, table: &str) {
    let path = repo().join(page);
    let text = std::fs::read_to_string(&path).unwrap();
    let (open, close) = (format!("<!-- generated: {name} -->\n"), format!("<!-- end: {name} -->"));
    let start = text.find(&open).unwrap_or_else(|| panic!("{page} has no `{}` marker", open.trim())) + open.len();
    let end = text[start..].find(&close).unwrap_or_else(|| panic!("{page} has no `{close}` marker")) + start;
    if text[start..end] == *table {
        return;
    }
    if std::env::var_os("SCFOUNDRY_UPDATE_DOCS").is_some() {
        std::fs::write(&path, format!("{}{table}{}", &text[..start], &text[end..])).unwrap();
        return;
    }
    panic!("{page}: the `{name}` table is not the one its test generates (SCFOUNDRY_UPDATE_DOCS=1 rewrites it):\n{table}");
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading.trim().to_lowercase().chars().filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_').map(|c| if c == ' ' { '-' } else { c }).collect()
}

/// The headings of a markdown file (outside code blocks).
fn headings(path: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(line.trim_start_matches('#').trim().to_string());
        }
    }
    out
}

/// The repository's files with one of `exts`, outside build folders and fixtures.
fn files(exts: &[&str]) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![repo()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                if !name.starts_with('.') && !["target", "fixtures", "dist", "demo", "snapshots", "node_modules", "work"].contains(&name.as_str()) {
                    stack.push(p);
                }
            } else if exts.iter().any(|x| name.ends_with(x)) {
                out.push(p);
            }
        }
    }
    out
}

/// What follows each `marker` in `text`, as far as `keep` holds.
fn after<'a>(text: &'a str, marker: &str, keep: impl Fn(char) -> bool + Copy) -> Vec<&'a str> {
    text.match_indices(marker)
        .map(|(i, _)| {
            let rest = &text[i + marker.len()..];
            let end = rest.char_indices().find(|(_, c)| !keep(*c)).map_or(rest.len(), |(j, _)| j);
            &rest[..end]
        })
        .collect()
}

/// Every relative link of the repository's markdown files reaches a file, and its `#anchor` a
/// heading of that file.
#[test]
fn markdown_links_resolve() {
    let mut broken = Vec::new();
    let pages = files(&[".md"]);
    assert!(pages.len() > 20, "found only {} markdown files", pages.len());
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        let rel = page.strip_prefix(repo()).unwrap().display().to_string();
        for target in after(&text, "](", |c| c != ')' && !c.is_whitespace()) {
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let dest = if file.is_empty() { page.clone() } else { page.parent().unwrap().join(file) };
            if !dest.exists() {
                broken.push(format!("{rel}: {target}: no such file"));
            } else if !anchor.is_empty() && !headings(&dest).iter().any(|h| slug(h) == anchor) {
                broken.push(format!("{rel}: {target}: no such heading"));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// What the code, the scripts and the docs cite by name exists: `docs/<page>.md`, an upper-case
/// `NAME.md` (at the root or beside the file), `BENCHMARKS.md#anchor` and
/// `BENCHMARKS.md, "Heading"` (the start of a heading).
#[test]
fn cited_pages_and_sections_exist() {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    let benchmarks = headings(&repo().join("BENCHMARKS.md"));
    assert!(!benchmarks.is_empty());
    let mut missing = Vec::new();
    let cited = files(&[".rs", ".md", ".sh", ".py", ".cu", ".toml"]);
    for file in &cited {
        let rel = file.strip_prefix(repo()).unwrap().display().to_string();
        // this file names the forms it checks
        if rel == "tests/it/docs.rs" {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for name in after(&text, "docs/", word) {
            // CONTRIBUTING.md's example method is `foo`
            if !name.is_empty() && name != "foo" && text.contains(&format!("docs/{name}.md")) && !repo().join(format!("docs/{name}.md")).is_file() {
                missing.push(format!("{rel}: docs/{name}.md"));
            }
        }
        for (i, _) in text.match_indices(".md") {
            let before = &text[..i];
            let start = before.char_indices().rev().find(|(_, c)| !(c.is_ascii_uppercase() || *c == '_')).map_or(0, |(j, c)| j + c.len_utf8());
            let name = &before[start..];
            let prev = before[..start].chars().last();
            if name.len() < 2 || !name.starts_with(|c: char| c.is_ascii_uppercase()) || prev.is_some_and(|c| c == '/' || c.is_ascii_alphanumeric() || c == '<') {
                continue;
            }
            let name = format!("{name}.md");
            if !repo().join(&name).is_file() && !file.parent().unwrap().join(&name).is_file() {
                missing.push(format!("{rel}: {name}"));
            }
        }
        for anchor in after(&text, "BENCHMARKS.md#", word) {
            if !benchmarks.iter().any(|h| slug(h) == anchor) {
                missing.push(format!("{rel}: BENCHMARKS.md#{anchor}"));
            }
        }
        // a citation may wrap onto the next comment line
        let joined = text.lines().map(|l| l.trim_start().trim_start_matches('/').trim_start_matches('!').trim_start_matches('#').trim()).collect::<Vec<_>>().join(" ");
        for quoted in after(&joined, "BENCHMARKS.md, \"", |c| c != '"') {
            if !benchmarks.iter().any(|h| h.starts_with(quoted)) {
                missing.push(format!("{rel}: BENCHMARKS.md, \"{quoted}\""));
            }
        }
    }
    assert!(cited.len() > 100, "found only {} files", cited.len());
    assert!(missing.is_empty(), "cited but missing:\n{}", missing.join("\n"));
}
