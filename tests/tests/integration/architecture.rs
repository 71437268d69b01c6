//! ARCHITECTURE.md stays true: its code map names every module of every crate and only paths that
//! exist, every top-level folder and script has its place in it, its invariants are numbered in
//! order, no document speaks of issue numbers, the agent service calls only downward, and files
//! and functions stay a size a reader can hold.

use std::path::{Path, PathBuf};

mod layers;
mod sizes;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the repository")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The text of `## heading` up to the next `## `.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let start = text
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("ARCHITECTURE.md has no section '{heading}'"));
    let body = &text[start + heading.len() + 5..];
    body.find("\n## ").map_or(body, |end| &body[..end])
}

/// A code map row: the paths of its first cell (later names relative to the first one's folder) and
/// the whole row's text.
struct Row {
    paths: Vec<String>,
    text: String,
}

fn code_map(architecture: &str) -> Vec<Row> {
    section(architecture, "Code map")
        .lines()
        .filter(|line| line.starts_with("| `"))
        .map(|line| {
            let first_cell = line.split('|').nth(1).unwrap_or_default();
            let names: Vec<&str> = first_cell
                .split('`')
                .skip(1)
                .step_by(2)
                .filter(|name| !name.is_empty())
                .collect();
            let folder = names.first().map_or(String::new(), |first| {
                if first.ends_with('/') {
                    (*first).to_owned()
                } else {
                    first
                        .rsplit_once('/')
                        .map_or(String::new(), |(folder, _)| format!("{folder}/"))
                }
            });
            let paths = names
                .iter()
                .enumerate()
                .map(|(index, name)| {
                    if index == 0 || name.contains('/') {
                        (*name).to_owned()
                    } else {
                        format!("{folder}{name}")
                    }
                })
                .collect();
            Row {
                paths,
                text: line.to_owned(),
            }
        })
        .collect()
}

fn workspace_members(root: &Path) -> Vec<String> {
    let manifest = read(&root.join("Cargo.toml"));
    let start = manifest
        .find("members = [")
        .expect("the workspace lists its members");
    let list = &manifest[start + "members = [".len()..];
    let end = list.find(']').expect("the member list ends");
    list[..end]
        .split(',')
        .map(|member| member.trim().trim_matches('"').to_owned())
        .filter(|member| !member.is_empty())
        .collect()
}

/// Every `.rs` file under `folder`, as paths relative to `root` with `/` separators.
fn rust_files(root: &Path, folder: &Path, found: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(root, &path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let relative = path.strip_prefix(root).expect("under the root");
            found.push(relative.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// Whether `text` holds `word` not glued to a longer name before it.
fn mentions(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        text[..at]
            .chars()
            .next_back()
            .is_none_or(|before| !(before.is_alphanumeric() || "_-.".contains(before)))
    })
}

/// Whether the code map names `module`: a row of its own path, or a row of a folder above it that
/// names it or a folder between the two (a crate's `src/` alone names nothing).
fn documented(rows: &[Row], module: &str) -> bool {
    rows.iter().any(|row| {
        row.paths.iter().any(|path| {
            path == module
                || (path.ends_with('/')
                    && module.starts_with(path.as_str())
                    && names(&row.text, &module[path.len()..]))
        })
    })
}

/// Whether `text` names `relative` (a module's path below a row's folder).
fn names(text: &str, relative: &str) -> bool {
    let parts: Vec<&str> = relative.trim_end_matches('/').split('/').collect();
    let mut candidates: Vec<String> = (1..parts.len())
        .map(|depth| format!("{}/", parts[..depth].join("/")))
        .filter(|folder| folder != "src/")
        .collect();
    let last = parts.last().copied().unwrap_or_default();
    if relative.ends_with('/') {
        candidates.push(format!("{last}/"));
        candidates.push(format!("`{last}`"));
    } else {
        candidates.push(last.to_owned());
        candidates.push(format!("`{}`", last.trim_end_matches(".rs")));
    }
    candidates.iter().any(|candidate| mentions(text, candidate))
}

/// The modules of a crate: every file but the roots, and every folder module (as `folder/`).
fn modules_of(root: &Path, member: &str) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(root, &root.join(member).join("src"), &mut files);
    files
        .into_iter()
        .filter_map(|file| {
            if file.ends_with("/mod.rs") {
                Some(file.trim_end_matches("mod.rs").to_owned())
            } else if file.ends_with("src/lib.rs") || file.ends_with("src/main.rs") {
                None
            } else {
                Some(file)
            }
        })
        .collect()
}

#[test]
fn the_code_map_names_every_module_of_every_crate() {
    let root = repo_root();
    let rows = code_map(&read(&root.join("ARCHITECTURE.md")));
    assert!(rows.len() > 10, "the code map has too few rows to parse");
    let mut missing = Vec::new();
    let mut modules = 0;
    for member in workspace_members(&root) {
        assert!(
            rows.iter().any(|row| row.paths[0] == format!("{member}/")),
            "the crate {member}/ has no row of its own"
        );
        for module in modules_of(&root, &member) {
            modules += 1;
            if !documented(&rows, &module) {
                missing.push(module);
            }
        }
    }
    assert!(
        modules > 50,
        "found only {modules} modules: the walk is broken"
    );
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's code map does not name these modules: {missing:?}"
    );
}

#[test]
fn the_code_map_names_only_paths_that_exist() {
    let root = repo_root();
    let rows = code_map(&read(&root.join("ARCHITECTURE.md")));
    let absent: Vec<&String> = rows
        .iter()
        .flat_map(|row| &row.paths)
        .filter(|path| !root.join(path).exists())
        .collect();
    assert!(
        absent.is_empty(),
        "the code map names paths that do not exist: {absent:?}"
    );
}

#[test]
fn every_top_level_folder_and_script_has_its_place() {
    let root = repo_root();
    let rows = code_map(&read(&root.join("ARCHITECTURE.md")));
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&root).expect("the root").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !entry.path().is_dir() || name.starts_with('.') || name == "target" {
            continue;
        }
        let folder = format!("{name}/");
        if !rows
            .iter()
            .any(|row| row.paths.iter().any(|path| path.starts_with(&folder)))
        {
            missing.push(folder);
        }
    }
    let scripts_row = rows
        .iter()
        .find(|row| row.paths[0] == "scripts/")
        .expect("scripts/ has a row");
    for entry in std::fs::read_dir(root.join("scripts"))
        .expect("scripts/")
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !mentions(&scripts_row.text, &format!("`{name}`")) {
            missing.push(format!("scripts/{name}"));
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's code map leaves out: {missing:?}"
    );
}

#[test]
fn the_architecture_invariants_are_numbered_in_order() {
    let root = repo_root();
    let architecture = read(&root.join("ARCHITECTURE.md"));
    let numbers: Vec<u32> = section(&architecture, "Architecture invariants")
        .lines()
        .filter_map(|line| line.split_once(". **"))
        .filter_map(|(number, _)| number.parse().ok())
        .collect();
    let expected: Vec<u32> = (1..=u32::try_from(numbers.len()).expect("few")).collect();
    assert!(numbers.len() >= 5, "found {numbers:?}");
    assert_eq!(numbers, expected, "invariants numbered out of order");
}

#[test]
fn documents_speak_of_the_product_not_of_issue_numbers() {
    let root = repo_root();
    let mut found = Vec::new();
    for document in documents(&root) {
        let text = read(&document).to_lowercase();
        for (at, _) in text.match_indices("issue") {
            let after = text[at + "issue".len()..].trim_start_matches([' ', '#']);
            if after.starts_with(|c: char| c.is_ascii_digit()) {
                let line = text[..at].lines().count();
                found.push(format!("{}:{line}", document.display()));
            }
        }
        if text.contains("\"planned\"") {
            found.push(format!("{}: a \"Planned\" marker", document.display()));
        }
    }
    assert!(found.is_empty(), "issue numbers in the docs: {found:?}");
}

/// README.md, ARCHITECTURE.md and every Markdown page under docs/ (not the pictures beside them).
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut documents = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    for entry in std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .flatten()
    {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "md") {
            documents.push(path);
        }
    }
    documents
}

#[test]
fn every_repository_path_the_docs_name_exists() {
    let root = repo_root();
    let mut absent = Vec::new();
    let mut checked = 0;
    for document in documents(&root) {
        let text = read(&document);
        for quoted in text.split('`').skip(1).step_by(2) {
            let Some((top, _)) = quoted.split_once('/') else {
                continue;
            };
            if quoted.contains(' ')
                || top.is_empty()
                || top.starts_with('.')
                || !root.join(top).is_dir()
            {
                continue;
            }
            // A glob names its folder.
            let path = quoted.split_once('*').map_or(quoted, |(before, _)| {
                before.rsplit_once('/').map_or(before, |(folder, _)| folder)
            });
            checked += 1;
            if !root.join(path).exists() {
                absent.push(format!("{}: {quoted}", document.display()));
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} paths found: the scan is broken"
    );
    assert!(
        absent.is_empty(),
        "the docs name paths that do not exist: {absent:?}"
    );
}

#[test]
fn the_checks_catch_what_they_look_for() {
    let rows = code_map(
        "\n## Code map\n\n| path | crate | what |\n| --- | --- | --- |\n\
         | `a/` | `a` | binaries `tool` (`src/bin/`) |\n\
         | `a/src/` | | `one.rs` does one thing; `two` another; the `inner/` folder |\n\
         | `a/src/x.rs`, `y.rs` | | two files |\n",
    );
    assert_eq!(rows[2].paths, ["a/src/x.rs", "a/src/y.rs"]);
    assert!(documented(&rows, "a/src/one.rs"));
    assert!(documented(&rows, "a/src/two.rs"));
    assert!(documented(&rows, "a/src/y.rs"));
    assert!(documented(&rows, "a/src/inner/"));
    assert!(documented(&rows, "a/src/inner/deep.rs"));
    assert!(documented(&rows, "a/src/bin/tool.rs"));
    assert!(!documented(&rows, "a/src/three.rs"), "not named");
    assert!(!documented(&rows, "a/src/ne.rs"), "a name inside another");
    assert!(!documented(&rows, "b/src/one.rs"), "another crate");
}

/// Every alert names a runbook that exists: `runbook_url: "docs/operations.md#<anchor>"`, and
/// operations.md has the `### <Alert>` heading whose anchor that is, under the alert's own name.
#[test]
fn every_alert_has_its_runbook() {
    let root = repo_root();
    let alerts = read(&root.join("deploy/prometheus/allot-alerts.yml"));
    let operations = read(&root.join("docs/operations.md"));
    let anchors: Vec<String> = operations
        .lines()
        .filter_map(|line| line.strip_prefix("### "))
        .map(|heading| heading.trim().to_lowercase())
        .collect();
    let mut alert = None;
    let mut checked = 0;
    for line in alerts.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            alert = Some(name.trim().to_owned());
        }
        if let Some(url) = line.strip_prefix("runbook_url: ") {
            let name = alert.take().expect("a runbook_url belongs to an alert");
            let anchor = url
                .trim_matches('"')
                .strip_prefix("docs/operations.md#")
                .unwrap_or_else(|| {
                    panic!("{name}: runbook_url {url} is not in docs/operations.md")
                });
            assert_eq!(anchor, name.to_lowercase(), "{name}'s runbook is its own");
            assert!(
                anchors.iter().any(|a| a == anchor),
                "docs/operations.md has no runbook heading for {name}"
            );
            checked += 1;
        }
    }
    assert!(alert.is_none(), "{alert:?} has no runbook_url");
    assert!(checked >= 10, "only {checked} alerts were read");
}

/// Every Allot metric the alerts and their runbooks name is one a service declares: an alert on a
/// metric nobody exports never fires, and a runbook that points at one sends the operator nowhere.
#[test]
fn every_metric_the_alerts_and_runbooks_name_is_exported() {
    let root = repo_root();
    let declared: String = [
        "allocator/src/metrics.rs",
        "region-agent/src/metrics.rs",
        "region-agent/src/decision_log.rs",
    ]
    .iter()
    .map(|path| read(&root.join(path)))
    .collect();
    let named = |text: &str| -> Vec<String> {
        let mut names: Vec<String> = text
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|word| word.starts_with("allot_") && word.len() > "allot_".len())
            .map(str::to_owned)
            .collect();
        names.sort();
        names.dedup();
        names
    };
    let alerts = read(&root.join("deploy/prometheus/allot-alerts.yml"));
    let operations = read(&root.join("docs/operations.md"));
    let runbooks = section(&operations, "Runbooks");
    let mut checked = 0;
    for name in named(&alerts).into_iter().chain(named(runbooks)) {
        // Histograms are exported as series of their name with a suffix.
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(&name);
        assert!(
            declared.contains(&format!("\"{base}\"")),
            "{name} is named by an alert or runbook but no service declares it"
        );
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} metric names were read");
}

/// The agent service's layers as ARCHITECTURE.md states them: the line starting `Layers:` in the
/// service's code map row up to the sentence's end, groups of files separated by `→`, the top
/// first.
fn service_layers(architecture: &str) -> Vec<Vec<String>> {
    let line = section(architecture, "Code map")
        .lines()
        .find(|line| line.starts_with("| `region-agent/src/service/`"))
        .expect("the code map has a row for the agent service");
    let layers = line
        .split("Layers")
        .nth(1)
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, rest)| rest.split(". ").next().unwrap_or_default())
        .expect("the agent service's row states its layers (`Layers ...: a → b, c → d.`)");
    layers
        .split('→')
        .map(|group| {
            group
                .split('`')
                .skip(1)
                .step_by(2)
                .map(|name| name.trim_end_matches(".rs").to_owned())
                .collect()
        })
        .collect()
}

/// The agent service's files call one another only downward, in the layers ARCHITECTURE.md
/// states (admission is a pipeline over the parts below it, never called back by them), and every
/// file has its layer.
#[test]
fn the_agent_service_calls_only_downward() {
    let root = repo_root();
    let layers = service_layers(&read(&root.join("ARCHITECTURE.md")));
    let folder = root.join("region-agent/src/service");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&folder).expect("the service folder") {
        let path = entry.expect("a service file").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let module = path
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("a file name")
                .to_owned();
            files.push(layers::SourceFile {
                module,
                source: read(&path),
            });
        }
    }
    assert!(
        files.len() >= 20,
        "only {} service files were read",
        files.len()
    );
    let against: Vec<String> = layers::against_the_layers(&files, &layers)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(
        against.is_empty(),
        "references against the layers in ARCHITECTURE.md: {against:#?}"
    );
    // The check reads edges at all: admission reaches the parts below it.
    let edges = layers::edges(&files);
    for part in ["regional", "global_holds", "pools", "settlement"] {
        assert!(
            edges.contains(&("admission".to_owned(), part.to_owned())),
            "no edge admission -> {part} was found: {edges:?}"
        );
    }
}

#[test]
fn the_layer_check_catches_every_kind_of_reference_back_up() {
    let layers = service_layers(
        "\n## Code map\n\n| `region-agent/src/service/` | | files. Layers, each calling only those \
         below: `top.rs` → `mid.rs`, `side.rs` → `low.rs` → `mod.rs`. More. |\n",
    );
    assert_eq!(
        layers,
        [vec!["top"], vec!["mid", "side"], vec!["low"], vec!["mod"]]
    );
    let file = |module: &str, source: &str| layers::SourceFile {
        module: module.to_owned(),
        source: source.to_owned(),
    };
    let root = file(
        "mod",
        "mod top; mod mid; mod low; pub use top::Thing; \
         pub struct Agent { part: Mutex<top::Part>, own: u64 } \
         impl Agent { fn new() -> Self { Self { part: top::Part::default(), own: 0 } } \
         fn now(&self) -> u64 { self.own } } fn lock() {}",
    );
    let top = "pub struct Part { open: u64 } impl Part { fn begin(&mut self) {} } \
               pub const LIMIT: u64 = 1; pub fn helper() {} \
               impl Agent { fn run(&self) { self.step(); self.part.lock().begin(); } }";
    let low = "pub struct Low { depth: u64 } \
               impl Low { fn dig(&self) -> u64 { self.depth } } \
               impl Agent { fn base(&self) { lock(); self.now(); let low = Low { depth: 1 }; low.dig(); } }";
    let downward = [
        root,
        file("top", top),
        file(
            "mid",
            "use super::low::Low; impl Agent { fn step(&self) { self.base(); } }",
        ),
        file("side", "impl Agent { fn other(&self) {} }"),
        file("low", low),
    ];
    let against = |files: &[layers::SourceFile]| -> Vec<String> {
        layers::against_the_layers(files, &layers)
            .iter()
            .map(ToString::to_string)
            .collect()
    };
    assert_eq!(against(&downward), Vec::<String>::new());
    let mut back_up = downward;
    back_up[2] = file(
        "mid",
        "use super::{low::Low, top::LIMIT}; \
         impl Agent { fn step(&self) { \
             super::top::helper(); \
             tracing::info!(\"{}\", self.other()); \
             let agent = self.clone(); tokio::spawn(async move { agent.run() }); \
             self.part.lock().begin(); \
             Self::run(self); \
         } }",
    );
    assert_eq!(
        against(&back_up),
        [
            "mid -> side (other)",
            "mid -> top (run)",
            "mid -> top (self.part)",
            "mid -> top (top::)",
        ]
    );
    // A module of the same name elsewhere is not the sibling.
    back_up[2] = file(
        "mid",
        "impl Agent { fn step(&self) { crate::global::top::helper(); self.base(); client.run(); } }",
    );
    assert_eq!(against(&back_up), Vec::<String>::new());
}

/// A heading's anchor as GitHub makes it: lower case, spaces to `-`, punctuation but `-` and `_`
/// dropped.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown page's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut in_code = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            found.push(anchor_of(line.trim_start_matches('#')));
        }
    }
    found
}

#[test]
fn every_anchor_the_docs_link_to_exists() {
    assert_eq!(
        anchor_of(" Unauthenticated callers (the gateway's contract)"),
        "unauthenticated-callers-the-gateways-contract"
    );
    assert_eq!(
        anchor_of("Charging: `metered` and `POST /v1/settle`"),
        "charging-metered-and-post-v1settle"
    );
    let root = repo_root();
    let mut broken = Vec::new();
    let mut checked = 0;
    for document in documents(&root) {
        let text = read(&document);
        for link in text.split("](").skip(1) {
            let Some((target, _)) = link.split_once(')') else {
                continue;
            };
            let Some((file, anchor)) = target.split_once('#') else {
                continue;
            };
            if file.contains("://") {
                continue;
            }
            let page = if file.is_empty() {
                document.clone()
            } else {
                document.parent().expect("in a folder").join(file)
            };
            if page.extension().is_none_or(|e| e != "md") {
                continue;
            }
            checked += 1;
            if !page.exists() || !anchors(&read(&page)).iter().any(|a| a == anchor) {
                broken.push(format!("{}: {target}", document.display()));
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: the scan is broken"
    );
    assert!(
        broken.is_empty(),
        "links to headings that do not exist: {broken:?}"
    );
}

/// Every production source file: each crate's `src/`, without the test crates and the files of
/// test modules (a `tests` folder or a `tests.rs`).
fn production_files(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    for member in workspace_members(root) {
        if member == "tests" || member.starts_with("tests/") {
            continue;
        }
        rust_files(root, &root.join(&member).join("src"), &mut files);
    }
    files.retain(|file| !file.contains("/tests/") && !file.ends_with("/tests.rs"));
    files.sort();
    files
}

#[test]
fn no_production_file_is_longer_than_its_limit() {
    let root = repo_root();
    let files = production_files(&root);
    assert!(files.len() > 100, "found only {} files", files.len());
    let too_long: Vec<String> = files
        .iter()
        .filter_map(|file| {
            let lines = read(&root.join(file)).lines().count();
            let limit = if file.starts_with("region-agent/src/service/") {
                sizes::MAX_SERVICE_FILE_LINES
            } else {
                sizes::MAX_FILE_LINES
            };
            (lines > limit).then(|| format!("{file}: {lines} lines, the limit {limit}"))
        })
        .collect();
    assert!(too_long.is_empty(), "files over their limit: {too_long:#?}");
}

#[test]
fn every_long_function_states_why() {
    let root = repo_root();
    let mut unexplained = Vec::new();
    for file in production_files(&root) {
        let found = sizes::unexplained_long_functions(&read(&root.join(&file)))
            .unwrap_or_else(|e| panic!("{file} does not parse: {e}"));
        unexplained.extend(found.into_iter().map(|function| {
            format!(
                "{file}:{} {} ({} lines)",
                function.line, function.name, function.body_lines
            )
        }));
    }
    assert!(
        unexplained.is_empty(),
        "functions over {} lines whose doc comment does not say \"{}\" and why: {unexplained:#?}",
        sizes::MAX_FUNCTION_LINES,
        sizes::REASON_MARKER
    );
}

/// A function of `name` whose body is `body_lines` long (braces included), after `doc`.
fn function_of(doc: &str, name: &str, body_lines: usize) -> String {
    let statements = "    let _ = 1;\n".repeat(body_lines - 2);
    format!("{doc}fn {name}() {{\n{statements}}}\n")
}

#[test]
fn the_size_check_catches_a_long_function_without_a_reason() {
    let limit = sizes::MAX_FUNCTION_LINES;
    let names = |source: &str| -> Vec<String> {
        sizes::unexplained_long_functions(source)
            .expect("parses")
            .into_iter()
            .map(|function| function.name)
            .collect()
    };
    assert_eq!(
        names(&function_of("", "at_the_limit", limit)),
        Vec::<String>::new()
    );
    assert_eq!(names(&function_of("", "over", limit + 1)), ["over"]);
    let explained = function_of(
        "/// Reads as one story.\n/// Long by\n/// design: one match keeps every case in view.\n",
        "explained",
        limit + 1,
    );
    assert_eq!(names(&explained), Vec::<String>::new());
    let method = format!(
        "struct S;\nimpl S {{\n{}}}\n",
        function_of("", "method", limit + 5)
    );
    assert_eq!(names(&method), ["method"]);
    let nested = format!("fn outer() {{\n{}}}\n", function_of("", "inner", limit + 1));
    assert_eq!(names(&nested), ["outer", "inner"]);
    let in_a_test_module = format!(
        "#[cfg(test)]\nmod tests {{\n{}}}\n",
        function_of("", "long_test_helper", limit + 1)
    );
    assert_eq!(names(&in_a_test_module), Vec::<String>::new());
    let a_test = function_of("#[tokio::test]\n", "long_test", limit + 1);
    assert_eq!(names(&a_test), Vec::<String>::new());
}
