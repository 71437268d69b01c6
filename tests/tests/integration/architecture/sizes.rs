//! Sizes a reader can hold in their head, read from the source's syntax: a function whose body
//! runs over [`MAX_FUNCTION_LINES`] lines says why in its doc comment, in a sentence that starts
//! with [`REASON_MARKER`]. Tests (`#[test]` functions and `#[cfg(test)]` items) are exempt.

use proc_macro2::Span;
use syn::visit::{self, Visit};

/// Most lines of production code in one file.
pub const MAX_FILE_LINES: usize = 1_000;
/// Most lines of one file of the agent service, the part every gateway request runs through.
pub const MAX_SERVICE_FILE_LINES: usize = 600;
/// Most lines of a function's body (braces included) without a stated reason.
pub const MAX_FUNCTION_LINES: usize = 70;
/// How a long function's doc comment states its reason.
pub const REASON_MARKER: &str = "Long by design";

/// A function over the limit whose doc comment gives no reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnexplainedFunction {
    pub name: String,
    pub line: usize,
    pub body_lines: usize,
}

/// The functions of `source` (methods and nested functions included) whose bodies run over
/// [`MAX_FUNCTION_LINES`] without a reason.
pub fn unexplained_long_functions(source: &str) -> Result<Vec<UnexplainedFunction>, syn::Error> {
    let file = syn::parse_file(source)?;
    let mut finder = Finder::default();
    finder.visit_file(&file);
    Ok(finder.found)
}

#[derive(Default)]
struct Finder {
    found: Vec<UnexplainedFunction>,
}

impl Finder {
    fn judge(&mut self, attrs: &[syn::Attribute], name: &syn::Ident, body: &syn::Block) {
        let (first, last) = lines_of(body.brace_token.span.join());
        let body_lines = last - first + 1;
        if body_lines > MAX_FUNCTION_LINES && !doc_text(attrs).contains(REASON_MARKER) {
            self.found.push(UnexplainedFunction {
                name: name.to_string(),
                line: first,
                body_lines,
            });
        }
    }
}

impl<'ast> Visit<'ast> for Finder {
    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if is_test(&item.attrs) {
            return;
        }
        self.judge(&item.attrs, &item.sig.ident, &item.block);
        visit::visit_item_fn(self, item);
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if is_test(&item.attrs) {
            return;
        }
        self.judge(&item.attrs, &item.sig.ident, &item.block);
        visit::visit_impl_item_fn(self, item);
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if let Some(body) = &item.default {
            self.judge(&item.attrs, &item.sig.ident, body);
        }
        visit::visit_trait_item_fn(self, item);
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !is_test(&item.attrs) {
            visit::visit_item_mod(self, item);
        }
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        if !is_test(&item.attrs) {
            visit::visit_item_impl(self, item);
        }
    }
}

/// The first and last line a span covers (1-based).
fn lines_of(span: Span) -> (usize, usize) {
    (span.start().line, span.end().line)
}

/// `#[test]`, `#[tokio::test]`, or `#[cfg(test)]`.
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        let path = attr.path();
        path.segments
            .last()
            .is_some_and(|last| last.ident == "test")
            || (path.is_ident("cfg")
                && attr
                    .parse_args::<syn::Meta>()
                    .is_ok_and(|meta| meta.path().is_ident("test")))
    })
}

/// A doc comment's text, its lines joined by spaces.
fn doc_text(attrs: &[syn::Attribute]) -> String {
    let mut text = String::new();
    for attr in attrs.iter().filter(|attr| attr.path().is_ident("doc")) {
        if let syn::Meta::NameValue(syn::MetaNameValue {
            value:
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(line),
                    ..
                }),
            ..
        }) = &attr.meta
        {
            text.push_str(line.value().trim());
            text.push(' ');
        }
    }
    text
}
