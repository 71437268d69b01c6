//! Compiles every drill in `scenarios/` (not its subfolders, which hold long runs given with
//! `--file`) into the binary as the built-in suite: a new file there is a new built-in drill,
//! named by its file stem, in file-name order.

use std::error::Error;
use std::fmt::Write as _;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn Error>> {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("scenarios");
    // A directory: Cargo looks at every file below it.
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "toml") && path.is_file() {
            let stem = path
                .file_stem()
                .and_then(|stem| stem.to_str())
                .ok_or_else(|| format!("{} has no UTF-8 name", path.display()))?
                .to_owned();
            files.push((stem, path));
        }
    }
    files.sort();
    let mut code = String::from(
        "/// The built-in suite: every file of `simulations/scenarios/`, by name, compiled in.\n\
         pub const BUILTIN: &[(&str, &str)] = &[\n",
    );
    for (name, path) in &files {
        writeln!(
            code,
            "    ({name:?}, include_str!({:?})),",
            path.display().to_string()
        )?;
    }
    code.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("builtin_scenarios.rs");
    std::fs::write(out, code)?;
    Ok(())
}
