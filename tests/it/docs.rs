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
