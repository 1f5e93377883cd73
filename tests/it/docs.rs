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
