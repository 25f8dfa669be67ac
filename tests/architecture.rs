//! The shape of the source tree, checked: `src/` reads as the algorithm (at most 12 entries), no
//! library module imports one that imports it back (directly or through others), and no function
//! is longer than 80 lines (the kernels' register tiles included: none needs more).
//!
//! Imports are the `crate::…` paths in a module's code (comments, strings and `#[cfg(test)]`
//! modules left out), resolved to the longest module path they name. Run with
//! `LBBSP_PRINT_GRAPH=1 cargo test --test architecture -- --nocapture` to print the graph that
//! `docs/architecture.md` shows.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_TOP_ENTRIES: usize = 12;
const MAX_FN_LINES: usize = 80;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every library source file (not the binary) with its module path (`kernels::gemm`; `train` for
/// `train/mod.rs`; empty for `lib.rs`).
fn library_files() -> Vec<(String, PathBuf)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().unwrap() != "bin" {
                    walk(&p, out);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&src(), &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(src()).unwrap().with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            (parts.join("::"), p)
        })
        .collect()
}

/// The code of a file with comments, string and char literals blanked (line breaks kept).
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let keep_newlines =
        |s: &[char], out: &mut String| s.iter().for_each(|&c| out.push(if c == '\n' { '\n' } else { ' ' }));
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            let end = (i..b.len()).find(|&j| b[j] == '\n').unwrap_or(b.len());
            keep_newlines(&b[i..end], &mut out);
            i = end;
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            let mut j = i;
            while j < b.len() {
                if b[j] == '/' && b.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if b[j] == '*' && b.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            keep_newlines(&b[i..j.min(b.len())], &mut out);
            i = j;
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !b.get(i.wrapping_sub(1)).is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // Raw string r#"…"#.
            let hashes = b[i + 1..].iter().take_while(|&&h| h == '#').count();
            if b.get(i + 1 + hashes) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let mut j = i + 2 + hashes;
            while j < b.len()
                && !(b[j] == '"' && b[j + 1..].iter().take(hashes).filter(|&&h| h == '#').count() == hashes)
            {
                j += 1;
            }
            let end = (j + 1 + hashes).min(b.len());
            keep_newlines(&b[i..end], &mut out);
            i = end;
        } else if c == '"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != '"' {
                j += if b[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(b.len());
            keep_newlines(&b[i..end], &mut out);
            i = end;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), else a lifetime.
            let end = if next == Some('\\') {
                (i + 2..b.len()).find(|&j| b[j] == '\'').map(|j| j + 1)
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 3)
            } else {
                None
            };
            match end {
                Some(e) => {
                    keep_newlines(&b[i..e], &mut out);
                    i = e;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `code` without its `#[cfg(test)]` items (a test module, a test-only function).
fn without_tests(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = ["#[cfg(test)]", "#[cfg(all(test,"].iter().filter_map(|m| rest.find(m)).min() {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        // The item ends at the `;` or at the brace closing its first `{`, whichever comes first.
        let (mut depth, mut end) = (0i32, after.len());
        for (k, ch) in after.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        out.extend(after[..end].chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The `crate::` paths in `code`, `use crate::a::{b, c::d}` expanded to `a::b`, `a::c::d`.
fn crate_paths(code: &str) -> Vec<String> {
    fn expand(prefix: &str, s: &str, out: &mut Vec<String>) {
        let s = s.trim();
        if let Some(open) = s.find('{') {
            let head = s[..open].trim().trim_end_matches("::");
            let inner = &s[open + 1..s.rfind('}').unwrap_or(s.len())];
            let base = if head.is_empty() { prefix.to_string() } else { format!("{prefix}{head}::") };
            let (mut depth, mut start) = (0, 0);
            for (k, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&base, &inner[start..k], out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            expand(&base, &inner[start..], out);
        } else if !s.is_empty() {
            let s = s.split(" as ").next().unwrap().trim();
            out.push(format!("{prefix}{s}").trim_end_matches("::").to_string());
        }
    }
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        let tail = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            rest = tail;
            continue;
        }
        if tail.starts_with('{') {
            let end = tail.find(';').unwrap_or(tail.len());
            expand("", &tail[..end], &mut out);
            rest = &tail[end..];
        } else {
            let end = tail.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(tail.len());
            let path = tail[..end].trim_end_matches(':');
            if tail[end..].starts_with('{') {
                let close = tail.find(';').unwrap_or(tail.len());
                expand("", &tail[..close], &mut out);
                rest = &tail[close..];
            } else {
                out.push(path.to_string());
                rest = &tail[end..];
            }
        }
    }
    out
}

/// Module → the other modules it imports.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let files = library_files();
    let modules: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut graph = BTreeMap::new();
    for (module, path) in &files {
        let code = without_tests(&code_only(&std::fs::read_to_string(path).unwrap()));
        let mut deps = BTreeSet::new();
        for p in crate_paths(&code) {
            let parts: Vec<&str> = p.split("::").collect();
            let target = (1..=parts.len()).rev().map(|n| parts[..n].join("::")).find(|m| modules.contains(m));
            match target {
                Some(t) if &t == module => {}
                Some(t) => {
                    deps.insert(t);
                }
                None => panic!(
                    "{}: `crate::{p}` names no module; inside the library import items by their module's path \
                     (the crate root's re-exports are for users)",
                    path.display()
                ),
            }
        }
        graph.insert(module.clone(), deps);
    }
    graph
}

#[test]
fn src_has_at_most_twelve_entries() {
    let entries: Vec<String> =
        std::fs::read_dir(src()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(
        entries.len() <= MAX_TOP_ENTRIES,
        "src/ has {} entries (at most {MAX_TOP_ENTRIES}): {entries:?}",
        entries.len()
    );
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let graph = module_graph();
    if std::env::var_os("LBBSP_PRINT_GRAPH").is_some() {
        for (m, deps) in &graph {
            let name = if m.is_empty() { "(crate root)" } else { m };
            println!("{name} → {}", deps.iter().cloned().collect::<Vec<_>>().join(", "));
        }
    }
    // Depth-first search for a back edge, reporting the cycle it closes.
    fn visit<'a>(
        m: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        state.insert(m, 1);
        stack.push(m);
        for d in &graph[m] {
            match state.get(d.as_str()) {
                Some(1) => {
                    let from = stack.iter().position(|&s| s == d).unwrap();
                    let mut cycle: Vec<String> = stack[from..].iter().map(|s| s.to_string()).collect();
                    cycle.push(d.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(d, graph, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(m, 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in graph.keys().filter(|m| !m.is_empty()) {
        if !state.contains_key(m.as_str()) {
            if let Some(cycle) = visit(m, &graph, &mut state, &mut Vec::new()) {
                panic!("import cycle: {}", cycle.join(" → "));
            }
        }
    }
}

/// Functions, with their first line and length in lines, from a file's code.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let Some(at) = t.find("fn ") else { continue };
        let head = &t[..at];
        let is_fn = head.split_whitespace().all(|w| {
            matches!(w, "pub" | "pub(crate)" | "pub(super)" | "unsafe" | "const" | "async" | "extern" | "default")
        });
        if !is_fn || !t[at + 3..].starts_with(|c: char| c.is_alphabetic() || c == '_') {
            continue;
        }
        let name: String = t[at + 3..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        // The body: from the first `{` after the signature to its closing brace (none: a declaration).
        let (mut depth, mut opened, mut end) = (0i32, false, None);
        'scan: for (j, l) in lines.iter().enumerate().skip(i) {
            for ch in l.chars() {
                match ch {
                    ';' if !opened && depth == 0 => break 'scan,
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => {
                        depth -= 1;
                        if opened && depth == 0 {
                            end = Some(j);
                            break 'scan;
                        }
                    }
                    _ => {}
                }
            }
        }
        if let Some(e) = end {
            out.push((name, i + 1, e - i + 1));
        }
    }
    out
}

#[test]
fn no_function_is_longer_than_eighty_lines() {
    let mut long = Vec::new();
    let mut files = library_files();
    for e in std::fs::read_dir(src().join("bin").join("lbbsp")).unwrap() {
        files.push((String::new(), e.unwrap().path()));
    }
    for (_, path) in &files {
        let code = code_only(&std::fs::read_to_string(path).unwrap());
        for (name, line, len) in functions(&code) {
            if len > MAX_FN_LINES {
                long.push(format!("{}:{line} fn {name}: {len} lines", path.strip_prefix(src()).unwrap().display()));
            }
        }
    }
    assert!(long.is_empty(), "functions over {MAX_FN_LINES} lines:\n{}", long.join("\n"));
}

/// The checks see what they claim to: a cycle, a long function and a comment are recognised.
#[test]
fn the_checks_recognise_what_they_look_for() {
    let code = code_only("use crate::{a::b, c::{d, e::F}};\n// crate::g\nlet s = \"crate::h\"; crate::i::j(x);");
    assert_eq!(crate_paths(&without_tests(&code)), ["a::b", "c::d", "c::e::F", "i::j"]);
    let tests =
        without_tests(&code_only("fn a() {}\n#[cfg(test)]\nmod tests { use crate::x; }\nfn b() { crate::y(); }"));
    assert_eq!(crate_paths(&tests), ["y"]);
    let body: String = (0..90).map(|i| format!("    let x{i} = '{{';\n")).collect();
    let f = functions(&code_only(&format!("pub fn long() {{\n{body}}}\nfn short() {{ }}\n")));
    assert_eq!(f.iter().map(|(n, _, l)| (n.as_str(), *l)).collect::<Vec<_>>(), [("long", 92), ("short", 1)]);
}

/// The balancer's budget (issue 27): at most this many lines of code in `src/balance/`, tests,
/// comments and blank lines left out (cloc's "code"), and at most this many settings.
const MAX_BALANCER_LINES: usize = 800;
const MAX_BALANCER_SETTINGS: usize = 5;

/// Lines of code of a file: not blank, not only a comment, not in a `#[cfg(test)]` item. A line
/// that is only part of a string literal (a message's continuation) counts as code.
fn code_lines(text: &str) -> usize {
    let blanked = code_only(text);
    let kept = without_tests(&blanked);
    let mut in_code = false;
    let mut n = 0;
    for ((line, code), kept) in text.lines().zip(blanked.lines()).zip(kept.lines()) {
        if !kept.trim().is_empty() {
            in_code = true;
            n += 1;
        } else if !code.trim().is_empty() {
            in_code = false;
        } else if in_code && !line.trim().is_empty() && !line.trim_start().starts_with("//") {
            n += 1;
        }
    }
    n
}

/// The `pub` fields of the struct named `name` in `code` (comment-free).
fn pub_fields(code: &str, name: &str) -> Option<usize> {
    let at = code.find(&format!("struct {name} {{"))?;
    let body = &code[at..at + code[at..].find('}')?];
    Some(body.lines().filter(|l| l.trim_start().starts_with("pub ")).count())
}

#[test]
fn the_balancer_has_a_small_budget() {
    let dir = src().join("balance");
    let mut lines = Vec::new();
    let mut code = String::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let text = std::fs::read_to_string(&p).unwrap();
        lines.push((p.file_name().unwrap().to_string_lossy().into_owned(), code_lines(&text)));
        code.push_str(&without_tests(&code_only(&text)));
    }
    let total: usize = lines.iter().map(|l| l.1).sum();
    eprintln!("src/balance/: {total} lines of code {lines:?}");
    assert!(
        total <= MAX_BALANCER_LINES,
        "src/balance/ has {total} lines of code (at most {MAX_BALANCER_LINES}): {lines:?}"
    );
    let settings = pub_fields(&code, "BalanceConfig").expect("src/balance/ defines BalanceConfig");
    assert!(
        settings <= MAX_BALANCER_SETTINGS,
        "BalanceConfig has {settings} settings (at most {MAX_BALANCER_SETTINGS})"
    );
    for state in ["Balancer", "RankModel", "Shape", "Freezes"] {
        let public = pub_fields(&code, state).unwrap_or_else(|| panic!("src/balance/ defines {state}"));
        assert_eq!(public, 0, "{state} has {public} public fields: its state is private behind its methods");
    }
}

/// The budget's line count leaves out comments, blank lines and tests, and keeps a message's
/// continuation lines.
#[test]
fn the_line_count_counts_code_only() {
    let text = "// doc\nfn a() {\n\n    let s = \"x\\\n        y\";\n}\n#[cfg(test)]\nmod tests {\n    fn t() {}\n}\n";
    assert_eq!(code_lines(text), 4);
    assert_eq!(pub_fields("struct S {\n    pub a: u8,\n    b: u8,\n}", "S"), Some(1));
}
