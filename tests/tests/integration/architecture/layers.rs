//! The agent service's layering, read from the source's syntax rather than its text.
//!
//! Every reference from one service file to another is an edge: a path through a sibling module
//! (`super::pools::PoolKey`, a `use` of one, a free function, a constant), a call of one of
//! `Agent`'s methods (spread over the files, unique by name) on `self`, on a name bound to it
//! (`let agent = self.clone()`) or as `Self::name`, and a field of `Agent` reached
//! through `self` whose type another file defines (`self.settlements` is the settlements file).
//! Macro bodies are read too. The one file exempt in part is `mod.rs`: declaring the parts, the
//! struct holding them, building them in `Agent::new` and re-exporting their names is
//! composition, not a call.
//!
//! Methods of the parts' own types need no edge of their own: a file reaches such a value only
//! by naming its type (a path), through a field of `Agent` or from a method of a file it may
//! call. With every one of those edges going down, so does every call on what they give.

use std::collections::{BTreeMap, BTreeSet};

use proc_macro2::{Delimiter, TokenStream, TokenTree};
use quote::ToTokens;

/// One service file: its module name (`admission`, `mod`) and its source.
pub struct SourceFile {
    pub module: String,
    pub source: String,
}

/// What the files define, by name.
#[derive(Default)]
struct Definitions {
    modules: BTreeSet<String>,
    /// `Agent`'s methods: one file each (inherent methods of one type are unique by name).
    agent_methods: BTreeMap<String, String>,
    /// `Agent`'s fields: the files their types come from (`mod` when none names a sibling).
    agent_fields: BTreeMap<String, BTreeSet<String>>,
}

/// A reference from one file to a name of another.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub from: String,
    pub to: String,
    pub name: String,
}

impl std::fmt::Display for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} -> {} ({})", self.from, self.to, self.name)
    }
}

fn parse(file: &SourceFile) -> syn::File {
    syn::parse_file(&file.source)
        .unwrap_or_else(|error| panic!("{}.rs does not parse: {error}", file.module))
}

/// The last identifier of a type's path: `Agent` for `Agent`, `super::Agent` or `Arc<Agent>`'s
/// inner path is not looked into (impls are of plain paths here).
fn type_name(ty: &syn::Type) -> Option<String> {
    match ty {
        syn::Type::Path(path) => path.path.segments.last().map(|s| s.ident.to_string()),
        _ => None,
    }
}

/// Every identifier in `tokens`, macro bodies and nested groups included.
fn idents(tokens: TokenStream, found: &mut Vec<String>) {
    for token in tokens {
        match token {
            TokenTree::Ident(ident) => found.push(ident.to_string()),
            TokenTree::Group(group) => idents(group.stream(), found),
            _ => {}
        }
    }
}

fn define(files: &[SourceFile]) -> Definitions {
    let mut defs = Definitions {
        modules: files.iter().map(|f| f.module.clone()).collect(),
        ..Definitions::default()
    };
    for file in files {
        for item in parse(file).items {
            match item {
                syn::Item::Impl(block) if block.trait_.is_none() => {
                    let agent = type_name(&block.self_ty).as_deref() == Some("Agent");
                    for member in block.items {
                        if let syn::ImplItem::Fn(method) = member {
                            let name = method.sig.ident.to_string();
                            if agent {
                                defs.agent_methods.insert(name, file.module.clone());
                            }
                        }
                    }
                }
                syn::Item::Struct(item) if item.ident == "Agent" => {
                    for field in item.fields.iter() {
                        let Some(name) = field.ident.as_ref().map(ToString::to_string) else {
                            continue;
                        };
                        let mut named = Vec::new();
                        idents(field.ty.to_token_stream(), &mut named);
                        let mut from: BTreeSet<String> = named
                            .into_iter()
                            .filter(|ident| defs.modules.contains(ident))
                            .collect();
                        if from.is_empty() {
                            from.insert(file.module.clone());
                        }
                        defs.agent_fields.insert(name, from);
                    }
                }
                _ => {}
            }
        }
    }
    defs
}

/// The parts of `file` whose references count: all of it but, in `mod.rs`, the composition
/// (module declarations, re-exports, the `Agent` struct and `Agent::new`).
fn checked_tokens(file: &SourceFile) -> Vec<(Option<String>, TokenStream)> {
    let composition_root = file.module == "mod";
    let mut parts = Vec::new();
    for item in parse(file).items {
        match item {
            syn::Item::Mod(_) | syn::Item::Use(_) if composition_root => {}
            syn::Item::Struct(item) if composition_root && item.ident == "Agent" => {}
            syn::Item::Impl(mut block) => {
                let self_type = type_name(&block.self_ty);
                if composition_root && self_type.as_deref() == Some("Agent") {
                    block.items.retain(
                        |member| !matches!(member, syn::ImplItem::Fn(f) if f.sig.ident == "new"),
                    );
                }
                parts.push((self_type, block.to_token_stream()));
            }
            other => parts.push((None, other.to_token_stream())),
        }
    }
    parts
}

/// The flat token list of `stream`: groups opened and closed by punctuation of their own, so
/// that patterns can be read across them (`self . settlements . begin (`).
#[derive(Debug, Clone, PartialEq)]
enum Flat {
    Ident(String),
    Punct(char),
    Open(Delimiter),
    Close,
    Literal,
}

fn flatten(stream: TokenStream, out: &mut Vec<Flat>) {
    for token in stream {
        match token {
            TokenTree::Ident(ident) => out.push(Flat::Ident(ident.to_string())),
            TokenTree::Punct(punct) => out.push(Flat::Punct(punct.as_char())),
            TokenTree::Literal(_) => out.push(Flat::Literal),
            TokenTree::Group(group) => {
                out.push(Flat::Open(group.delimiter()));
                flatten(group.stream(), out);
                out.push(Flat::Close);
            }
        }
    }
}

fn ident_at(tokens: &[Flat], at: usize) -> Option<&str> {
    match tokens.get(at) {
        Some(Flat::Ident(ident)) => Some(ident),
        _ => None,
    }
}

fn punct_at(tokens: &[Flat], at: usize, expected: char) -> bool {
    tokens.get(at) == Some(&Flat::Punct(expected))
}

/// `::` at `at`.
fn path_separator_at(tokens: &[Flat], at: usize) -> bool {
    punct_at(tokens, at, ':') && punct_at(tokens, at + 1, ':')
}

/// The files `file` refers to, each with the name that makes the edge.
fn references(file: &SourceFile, defs: &Definitions) -> Vec<(BTreeSet<String>, String)> {
    let mut found = Vec::new();
    for (self_type, stream) in checked_tokens(file) {
        let in_agent = self_type.as_deref() == Some("Agent");
        let mut tokens = Vec::new();
        flatten(stream, &mut tokens);
        let aliases = agent_aliases(&tokens);
        for at in 0..tokens.len() {
            let Some(ident) = ident_at(&tokens, at) else {
                continue;
            };
            // A path through a sibling module: `super::x::…`, `x::…` after `use super::x`, or
            // `super::{x::…}`; not `crate::global::x::…`, a module of the same name elsewhere.
            if defs.modules.contains(ident)
                && ident != file.module
                && path_separator_at(&tokens, at + 1)
            {
                let after_separator = at >= 2 && path_separator_at(&tokens, at - 2);
                let after_super =
                    after_separator && ident_at(&tokens, at.wrapping_sub(3)) == Some("super");
                let in_super_group = within_super_group(&tokens, at);
                if !after_separator || after_super || in_super_group {
                    found.push((BTreeSet::from([ident.to_owned()]), format!("{ident}::")));
                }
                continue;
            }
            // `Self::name(` or `Agent::name(`: an associated function of the agent.
            if at >= 3
                && path_separator_at(&tokens, at - 2)
                && (ident_at(&tokens, at - 3) == Some("Agent")
                    || (in_agent && ident_at(&tokens, at - 3) == Some("Self")))
                && let Some(to) = defs.agent_methods.get(ident)
            {
                found.push((BTreeSet::from([to.clone()]), ident.to_owned()));
                continue;
            }
            if at == 0
                || !punct_at(&tokens, at - 1, '.')
                || punct_at(&tokens, at.wrapping_sub(2), '.')
            {
                continue;
            }
            // `.name`: a method call (`(` or a turbofish next) or a field.
            let call = matches!(tokens.get(at + 1), Some(Flat::Open(Delimiter::Parenthesis)))
                || path_separator_at(&tokens, at + 1);
            let through_self = ident_at(&tokens, at - 2) == Some("self");
            let receiver = ident_at(&tokens, at - 2);
            let on_the_agent = (through_self && in_agent)
                || receiver.is_some_and(|receiver| aliases.iter().any(|a| a == receiver));
            if call
                && on_the_agent
                && let Some(to) = defs.agent_methods.get(ident)
            {
                found.push((BTreeSet::from([to.clone()]), ident.to_owned()));
            } else if !call
                && through_self
                && in_agent
                && let Some(to) = defs.agent_fields.get(ident)
            {
                found.push((to.clone(), format!("self.{ident}")));
            }
        }
    }
    found
}

/// The names bound to the agent itself: `let name = self.clone()` or `Arc::clone(self)` (how a
/// task of its own takes the agent along).
fn agent_aliases(tokens: &[Flat]) -> Vec<String> {
    let is = |at: usize, expected: &[&str]| {
        expected
            .iter()
            .enumerate()
            .all(|(offset, word)| match tokens.get(at + offset) {
                Some(Flat::Ident(ident)) => ident == word,
                Some(Flat::Punct(punct)) => word.len() == 1 && word.starts_with(*punct),
                Some(Flat::Open(Delimiter::Parenthesis)) => *word == "(",
                Some(Flat::Close) => *word == ")",
                _ => false,
            })
    };
    let mut aliases = Vec::new();
    for at in 0..tokens.len() {
        if ident_at(tokens, at) != Some("let") || !punct_at(tokens, at + 2, '=') {
            continue;
        }
        let Some(name) = ident_at(tokens, at + 1) else {
            continue;
        };
        let value = at + 3;
        if is(value, &["self", ".", "clone", "(", ")"])
            || is(value, &["Arc", ":", ":", "clone", "(", "self", ")"])
            || is(value, &["Arc", ":", ":", "clone", "(", "&", "self", ")"])
        {
            aliases.push(name.to_owned());
        }
    }
    aliases
}

/// Whether the identifier at `at` sits in a `{…}` group opened right after `super::`.
fn within_super_group(tokens: &[Flat], at: usize) -> bool {
    let mut depth = 0usize;
    for back in (0..at).rev() {
        match tokens[back] {
            Flat::Close => depth += 1,
            Flat::Open(delimiter) if depth == 0 => {
                return delimiter == Delimiter::Brace
                    && back >= 3
                    && path_separator_at(tokens, back - 2)
                    && ident_at(tokens, back - 3) == Some("super");
            }
            Flat::Open(_) => depth -= 1,
            _ => {}
        }
    }
    false
}

/// The references between `files` that go against `layers` (groups of modules, the top first):
/// to a file above the caller or in its own group, or touching a file no layer places.
pub fn against_the_layers(files: &[SourceFile], layers: &[Vec<String>]) -> Vec<Edge> {
    let layer_of = |module: &str| {
        layers
            .iter()
            .position(|group| group.iter().any(|m| m == module))
    };
    let defs = define(files);
    let mut found = BTreeSet::new();
    for file in files {
        let Some(from) = layer_of(&file.module) else {
            found.insert(Edge {
                from: file.module.clone(),
                to: "(no layer)".to_owned(),
                name: String::new(),
            });
            continue;
        };
        for (targets, name) in references(file, &defs) {
            let allowed =
                |to: &String| *to == file.module || layer_of(to).is_some_and(|to| to > from);
            for to in targets.into_iter().filter(|to| !allowed(to)) {
                found.insert(Edge {
                    from: file.module.clone(),
                    to,
                    name: name.clone(),
                });
            }
        }
    }
    found.into_iter().collect()
}

/// Every edge between `files`, for reading the structure: `from -> to`.
pub fn edges(files: &[SourceFile]) -> BTreeSet<(String, String)> {
    let defs = define(files);
    files
        .iter()
        .flat_map(|file| {
            references(file, &defs)
                .into_iter()
                .flat_map(|(targets, _)| targets)
                .filter(|to| *to != file.module)
                .map(|to| (file.module.clone(), to))
        })
        .collect()
}
