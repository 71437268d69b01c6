//! Inlines a Lua library's marked functions at their call sites, so that a decision step is written
//! once and still costs its callers no call.
//!
//! In Redis's Lua a function call costs about as much as the arithmetic of a rule's whole decision
//! (600 to 1,100 instructions measured in `decide.lua`), so the library's fast paths used to spell
//! each algorithm's step out where they needed it. Now each step is one function marked with a line
//! `--@inline` right above its `local function`, and [`expand`] copies its body into every
//! statement that calls it:
//!
//! ```lua
//! local held, wait_ms = fixed_window_step(spec, now, first, second)
//! ```
//!
//! becomes
//!
//! ```lua
//! local held, wait_ms
//! do
//!   local spec_1, now_1, stored_start_1, stored_count_1 = spec, now, first, second
//!   -- the body, its parameters and locals renamed, without its comments and final `return`
//!   held, wait_ms = <what it returned>
//! end
//! ```
//!
//! The body's parameters and locals take a suffix of their own per call site, so nothing the call
//! site names is captured by them. Only what keeps the meaning is inlined; anything else is left a
//! call, which means the same (the definition stays in the library), so the text is a valid
//! library before and after:
//! - a marked function's body returns once, as its last statement (or not at all), defines no
//!   function and holds no string with a quote, backslash or `--` in it;
//! - a call site is a whole statement on one line: `name(args)`, or `targets = name(args)` with
//!   `local` or without;
//! - a marked function's body may call marked functions defined before it: it is expanded first.
//!
//! [`Expanded::calls_left`] names the call statements left as calls, so that a test can require
//! none. The library's tests load both texts into Redis and require the same replies and states.

use std::collections::HashMap;

/// The line that marks the function defined on the next line for inlining.
const MARK: &str = "--@inline";

/// A library with its marked functions inlined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expanded {
    /// The library's text.
    pub text: String,
    /// Call statements inlined.
    pub inlined: usize,
    /// Statements that call a marked function but were left calls: the line and its number
    /// (1-based), outside the marked functions' own definitions.
    pub calls_left: Vec<(usize, String)>,
    /// Marked functions whose bodies cannot be inlined (module documentation): every call of
    /// theirs stays a call.
    pub refused: Vec<String>,
}

/// A marked function: its parameters, the body's statements but for the final `return` (without
/// comments, calls of earlier marked functions expanded), what that returns (empty when nothing),
/// every name the body binds (its parameters and locals), which a call site renames, and the names
/// it assigns.
#[derive(Debug, Clone)]
struct Inlined {
    params: Vec<String>,
    body: Vec<String>,
    returns: String,
    bound: Vec<String>,
    /// The names the body assigns or declares: a parameter among them is copied at a call site,
    /// and so is a name passed that the body assigns as a variable of its own outside.
    assigned: Vec<String>,
    /// The names the body reads or writes from outside it (not its parameters or locals, nor
    /// fields): a call site may not assign a target of the same name.
    free: Vec<String>,
    /// The body's outputs: the index of the statement at its top level that declares exactly the
    /// names it returns, in their order (`local held, wait_ms = 0, -1` before `return held,
    /// wait_ms`). A call site that assigns them to names of its own has the body work on those
    /// names directly, with no copy at the end.
    outputs: Option<usize>,
}

/// The marked functions seen so far, and the serial that makes each call site's names its own.
#[derive(Debug, Default)]
struct Inliner {
    functions: HashMap<String, Inlined>,
    /// Marked functions that could not be inlined.
    refused: Vec<String>,
    serial: usize,
}

/// `source` with every marked function inlined at every call site that can take it (module
/// documentation). Lines are otherwise copied as they are.
pub fn expand(source: &str) -> Expanded {
    let lines: Vec<&str> = source.lines().collect();
    let mut inliner = Inliner::default();
    let mut expanded = Expanded {
        text: String::with_capacity(source.len() * 2),
        inlined: 0,
        calls_left: Vec::new(),
        refused: Vec::new(),
    };
    let mut index = 0;
    while index < lines.len() {
        let line = lines[index];
        if line.trim_end() == MARK {
            match inliner.marked_function(&lines, index + 1) {
                Some((name, function, end)) => {
                    // The definition stays, for call sites that cannot take the body.
                    for kept in &lines[index..=end] {
                        expanded.text.push_str(kept);
                        expanded.text.push('\n');
                    }
                    inliner.functions.insert(name, function);
                    index = end + 1;
                    continue;
                }
                None => {
                    let refused = lines.get(index + 1).and_then(|header| defined_name(header));
                    expanded.refused.extend(refused.clone());
                    inliner.refused.extend(refused);
                }
            }
        }
        match inliner.inline_call(line) {
            Some(body) => {
                expanded.text.push_str(&body);
                expanded.inlined += 1;
            }
            None => {
                if inliner.calls_marked(line) {
                    expanded.calls_left.push((index + 1, line.to_owned()));
                }
                expanded.text.push_str(line);
                expanded.text.push('\n');
            }
        }
        index += 1;
    }
    expanded
}

impl Inliner {
    /// The marked function defined at `lines[start]`, its body's calls of earlier marked functions
    /// expanded, and the index of its `end`; None when it is not one [`expand`] can inline.
    ///
    /// Long by design: the refusals at its top (no early return, nested function, loop or table
    /// constructor) are what make the scans at its bottom sound: the bound, assigned and free names
    /// found are complete only because such lines were refused; split, the scans would be read
    /// without the guarantee they rely on.
    fn marked_function(
        &mut self,
        lines: &[&str],
        start: usize,
    ) -> Option<(String, Inlined, usize)> {
        let header = lines.get(start)?.strip_prefix("local function ")?;
        let (name, rest) = header.split_once('(')?;
        let params = split_list(rest.strip_suffix(')')?);
        if !is_name(name) || params.iter().any(|param| !is_name(param)) {
            return None;
        }
        let end = start + lines[start..].iter().position(|line| *line == "end")?;
        let mut statements: Vec<&str> = lines[start + 1..end].to_vec();
        let returns = match statements.last().map(|line| line.trim_start()) {
            Some(last) if last.starts_with("return ") => {
                let returned = code_of(&last["return ".len()..]).trim().to_owned();
                statements.pop();
                returned
            }
            _ => String::new(),
        };
        // What the renaming and the scans below do not read as Lua reads it: an early return, a
        // nested function, a loop's own variables, a table constructor's keys, a statement that
        // assigns twice on one line, a local declared after other code on its line.
        let unsafe_word = |word: &String| {
            ["return", "function", "for", "while", "repeat", "goto"].contains(&word.as_str())
        };
        let unsafe_line = |line: &&str| {
            let code = code_of(line);
            !plain_code(line)
                || words(code).iter().any(unsafe_word)
                || code.contains('{')
                || code.matches(" = ").count() > 1
                || (code.contains("local ") && !code.trim_start().starts_with("local "))
        };
        if statements
            .iter()
            .chain(std::iter::once(&returns.as_str()))
            .any(unsafe_line)
        {
            return None;
        }
        let mut body = Vec::new();
        for line in statements {
            let code = code_of(line).trim_end();
            if code.trim().is_empty() {
                continue;
            }
            // Bodies are indented two spaces in the definition; call sites add their own indent.
            let code = code.strip_prefix("  ").unwrap_or(code);
            match self.inline_call(code) {
                Some(expanded) => body.extend(expanded.lines().map(str::to_owned)),
                None => body.push(code.to_owned()),
            }
        }
        let mut bound = params.clone();
        bound.extend(body.iter().flat_map(|line| declared_locals(line)));
        let assigned = body.iter().flat_map(|line| assigned_names(line)).collect();
        let outputs = outputs_statement(&body, &returns, &bound);
        let mut free: Vec<String> = body
            .iter()
            .chain(std::iter::once(&returns))
            .flat_map(|line| names_in(line))
            .filter(|name| !bound.contains(name))
            .collect();
        free.sort();
        free.dedup();
        let function = Inlined {
            params,
            body,
            returns,
            bound,
            assigned,
            free,
            outputs,
        };
        Some((name.to_owned(), function, end))
    }

    /// `line` expanded when it is a call statement of a marked function.
    ///
    /// Long by design: the checks that refuse a call site and the renaming that writes its block
    /// work from the same sets (the names passed through, the outputs worked on under the call
    /// site's names, the body's free names); split, why a name may be passed through or assigned in
    /// place would be read apart from where the text does it.
    fn inline_call(&mut self, line: &str) -> Option<String> {
        let indent = &line[..line.len() - line.trim_start().len()];
        let statement = code_of(line).trim();
        let (declare, targets, call) = match statement.split_once(" = ") {
            Some((targets, call)) => match targets.strip_prefix("local ") {
                Some(names) => (true, names.trim(), call),
                None => (false, targets.trim(), call),
            },
            None => (false, "", statement),
        };
        let (name, args) = call.split_once('(')?;
        let function = self.functions.get(name)?;
        let args = args.strip_suffix(')')?;
        if !balanced(args) || !plain_code(args) || !plain_code(targets) {
            return None;
        }
        let args = split_arguments(args);
        let target_list = split_list(targets);
        let arg_words: Vec<String> = args.iter().flat_map(|arg| names_in(arg)).collect();
        let refused = args.len() != function.params.len()
            // A value the call drops: the body's result is what the call is for.
            || (target_list.is_empty() && !function.returns.is_empty())
            // A target the body reads from outside (the assignment would change what it reads),
            // or, declared here, one the arguments read (they would read the new local).
            || target_list.iter().any(|target| {
                function.free.contains(target) || (declare && arg_words.contains(target))
            });
        if refused {
            return None;
        }
        self.serial += 1;
        let suffix = format!("_{}", self.serial);
        let returned = split_list(&function.returns);
        // A parameter the body never assigns, passed a name, is that name: no copy of it.
        let passed: HashMap<&str, &str> = function
            .params
            .iter()
            .zip(&args)
            .filter(|(param, arg)| {
                // A variable of its own outside the body that the body assigns.
                let outer_assigned = function.free.contains(arg) && function.assigned.contains(arg);
                is_name(arg)
                    && !KEYWORDS.contains(&arg.as_str())
                    && !function.assigned.contains(param)
                    && !outer_assigned
            })
            .map(|(param, arg)| (param.as_str(), arg.as_str()))
            .collect();
        // Outputs worked on under the call site's names: plain names, none of them passed in.
        let outputs = function.outputs.filter(|_| {
            target_list.len() == returned.len()
                && target_list.iter().all(|target| is_name(target))
                && target_list.iter().all(|target| !arg_words.contains(target))
        });
        let output_names: HashMap<&str, &str> = match outputs {
            Some(_) => returned
                .iter()
                .map(String::as_str)
                .zip(target_list.iter().map(String::as_str))
                .collect(),
            None => HashMap::new(),
        };
        let rename = |code: &str| {
            renamed(code, |word| {
                if let Some(target) = output_names.get(word) {
                    Some((*target).to_owned())
                } else if let Some(arg) = passed.get(word) {
                    Some((*arg).to_owned())
                } else {
                    function
                        .bound
                        .iter()
                        .any(|b| b == word)
                        .then(|| format!("{word}{suffix}"))
                }
            })
        };
        let copied: Vec<(&String, &String)> = function
            .params
            .iter()
            .zip(&args)
            .filter(|(param, _)| !passed.contains_key(param.as_str()))
            .collect();
        // A body that is one returned expression of names passed in, assigned to names the call
        // site declares: one statement, no block.
        if declare && function.body.is_empty() && copied.is_empty() && !returned.is_empty() {
            return Some(format!(
                "{indent}local {targets} = {}\n",
                rename(&function.returns)
            ));
        }
        let mut out = String::new();
        if declare {
            out.push_str(&format!("{indent}local {targets}\n"));
        }
        out.push_str(&format!("{indent}do\n"));
        if !copied.is_empty() {
            let params: Vec<String> = copied.iter().map(|(param, _)| rename(param)).collect();
            let values: Vec<&str> = copied.iter().map(|(_, arg)| arg.as_str()).collect();
            out.push_str(&format!(
                "{indent}  local {} = {}\n",
                params.join(", "),
                values.join(", ")
            ));
        }
        for (index, body_line) in function.body.iter().enumerate() {
            if outputs == Some(index) {
                // The outputs' declaration, now assignments to the call site's names (which a
                // declaring call site has just made nil).
                let values = body_line
                    .split_once(" = ")
                    .map(|(_, values)| split_arguments(values))
                    .unwrap_or_default();
                let values: Vec<String> = if values.is_empty() {
                    if declare {
                        Vec::new()
                    } else {
                        vec!["nil".to_owned(); target_list.len()]
                    }
                } else {
                    values.iter().map(|value| rename(value)).collect()
                };
                assign(&mut out, indent, &target_list, &values);
                continue;
            }
            out.push_str(&format!("{indent}  {}\n", rename(body_line)));
        }
        if outputs.is_none() && !targets.is_empty() && !returned.is_empty() {
            let values: Vec<String> = returned.iter().map(|value| rename(value)).collect();
            assign(&mut out, indent, &target_list, &values);
        }
        out.push_str(&format!("{indent}end\n"));
        Some(out)
    }

    /// Whether `line`'s code calls a marked function.
    fn calls_marked(&self, line: &str) -> bool {
        let code = code_of(line);
        if code.starts_with("local function ") {
            return false;
        }
        self.functions
            .keys()
            .chain(&self.refused)
            .any(|name| words(code).contains(name) && code.contains(&format!("{name}(")))
    }
}

/// Appends `targets = values` inside a block at `indent`: one assignment a value where there are
/// as many and no value names a target (a multiple assignment copies every value twice), else one
/// multiple assignment. Nothing for no values.
fn assign(out: &mut String, indent: &str, targets: &[String], values: &[String]) {
    if values.is_empty() {
        return;
    }
    let separable = values.len() == targets.len()
        && values.iter().all(|value| {
            let named = words(value);
            targets
                .iter()
                .all(|target| words(target).iter().all(|word| !named.contains(word)))
        });
    if separable {
        for (target, value) in targets.iter().zip(values) {
            out.push_str(&format!("{indent}  {target} = {value}\n"));
        }
    } else {
        out.push_str(&format!(
            "{indent}  {} = {}\n",
            targets.join(", "),
            values.join(", ")
        ));
    }
}

/// The index of `body`'s outputs statement (see [`Inlined::outputs`]): at the body's top level,
/// `local` and exactly the returned names, in order, each declared nowhere else in the body, with
/// values (if any) one per name and naming none of them.
fn outputs_statement(body: &[String], returns: &str, bound: &[String]) -> Option<usize> {
    let returned = split_list(returns);
    if returned.is_empty() || returned.iter().any(|name| !is_name(name)) {
        return None;
    }
    let index = body.iter().position(|line| {
        !line.starts_with(' ') && {
            let code = code_of(line).trim();
            code.strip_prefix("local ").is_some_and(|rest| {
                let names = rest.split_once(" = ").map_or(rest, |(names, _)| names);
                split_list(names) == returned
            })
        }
    })?;
    let declared_once = returned
        .iter()
        .all(|name| bound.iter().filter(|bound| *bound == name).count() == 1);
    let values = code_of(&body[index])
        .split_once(" = ")
        .map(|(_, values)| split_arguments(values))
        .unwrap_or_default();
    let values_fit = values.is_empty()
        || (values.len() == returned.len()
            && values
                .iter()
                .all(|value| words(value).iter().all(|word| !returned.contains(word))));
    (declared_once && values_fit).then_some(index)
}

/// The names `code` holds outside quoted strings, as (start, end, whether it is a field: after a
/// single `.` or a `:`); numbers and keywords left out.
fn name_spans(code: &str) -> Vec<(usize, usize, bool)> {
    let bytes = code.as_bytes();
    let mut spans = Vec::new();
    let mut quoted = false;
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        if byte == b'\'' {
            quoted = !quoted;
            index += 1;
        } else if !quoted && (byte.is_ascii_alphabetic() || byte == b'_') {
            let start = index;
            while index < bytes.len()
                && (bytes[index].is_ascii_alphanumeric() || bytes[index] == b'_')
            {
                index += 1;
            }
            let before = code[..start].trim_end_matches(' ');
            let field = before.ends_with(':') || (before.ends_with('.') && !before.ends_with(".."));
            if !KEYWORDS.contains(&&code[start..index]) {
                spans.push((start, index, field));
            }
        } else if !quoted && byte.is_ascii_digit() {
            // A number, its fraction, exponent or hex digits included.
            while index < bytes.len()
                && (bytes[index].is_ascii_alphanumeric() || bytes[index] == b'.')
            {
                index += 1;
            }
        } else {
            index += 1;
        }
    }
    spans
}

/// The names (not fields) `code` reads or writes, its comment left out.
fn names_in(code: &str) -> Vec<String> {
    let code = code_of(code);
    name_spans(code)
        .into_iter()
        .filter(|&(_, _, field)| !field)
        .map(|(start, end, _)| code[start..end].to_owned())
        .collect()
}

/// `code` with every name that is not a field replaced as `rename` says; quoted strings as they
/// are.
fn renamed(code: &str, rename: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(code.len() + 16);
    let mut copied = 0;
    for (start, end, field) in name_spans(code) {
        if field {
            continue;
        }
        if let Some(name) = rename(&code[start..end]) {
            out.push_str(&code[copied..start]);
            out.push_str(&name);
            copied = end;
        }
    }
    out.push_str(&code[copied..]);
    out
}

/// Lua's keywords: never a name passed for a parameter.
const KEYWORDS: [&str; 21] = [
    "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in", "local",
    "nil", "not", "or", "repeat", "return", "then", "true", "until", "while",
];

/// The names a statement assigns or declares: those before its ` = ` (a body has one a line).
fn assigned_names(line: &str) -> Vec<String> {
    code_of(line)
        .split_once(" = ")
        .map(|(left, _)| names_in(left))
        .unwrap_or_default()
}

/// The name a `local function` line defines.
fn defined_name(line: &str) -> Option<String> {
    let header = line.strip_prefix("local function ")?;
    header.split_once('(').map(|(name, _)| name.to_owned())
}

/// A line without its comment (`--` to the end).
fn code_of(line: &str) -> &str {
    line.split_once("--").map_or(line, |(code, _)| code)
}

/// Whether `code` holds no string that renaming or [`code_of`] could misread: no double quote or
/// backslash, and no `--` inside single quotes.
fn plain_code(code: &str) -> bool {
    !code.contains('"') && !code.contains('\\') && {
        let mut quoted = false;
        let mut previous = ' ';
        code.chars().all(|c| {
            let fine = !(quoted && c == '-' && previous == '-');
            if c == '\'' {
                quoted = !quoted;
            }
            previous = c;
            fine
        })
    }
}

/// The names `line` declares local (`local a, b = ...`).
fn declared_locals(line: &str) -> Vec<String> {
    let code = code_of(line).trim();
    let Some(names) = code.strip_prefix("local ") else {
        return Vec::new();
    };
    let names = names.split_once('=').map_or(names, |(names, _)| names);
    split_list(names)
}

/// A comma-separated list, each item trimmed; empty for an empty text.
fn split_list(text: &str) -> Vec<String> {
    if text.trim().is_empty() {
        return Vec::new();
    }
    text.split(',').map(|item| item.trim().to_owned()).collect()
}

/// An argument list split at its commas outside brackets and quotes, each argument trimmed.
fn split_arguments(args: &str) -> Vec<String> {
    let mut list = Vec::new();
    let mut current = String::new();
    let (mut depth, mut quoted) = (0i32, false);
    for c in args.chars() {
        match c {
            '\'' => quoted = !quoted,
            '(' | '[' | '{' if !quoted => depth += 1,
            ')' | ']' | '}' if !quoted => depth -= 1,
            ',' if !quoted && depth == 0 => {
                list.push(current.trim().to_owned());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    if !current.trim().is_empty() || !list.is_empty() {
        list.push(current.trim().to_owned());
    }
    list
}

/// The identifiers and keywords of `text`.
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| !word.is_empty())
        .map(str::to_owned)
        .collect()
}

fn is_name(text: &str) -> bool {
    let mut chars = text.chars();
    chars
        .next()
        .is_some_and(|first| first.is_ascii_alphabetic() || first == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Whether every bracket of an argument list closes within it, in order, and every quoted string
/// ends within it.
fn balanced(args: &str) -> bool {
    let mut depth = 0i32;
    let mut quoted = false;
    for c in args.chars() {
        match c {
            '\'' => quoted = !quoted,
            _ if quoted => {}
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            _ => {}
        }
    }
    depth == 0 && !quoted
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEP: &str = "\
--@inline
local function step(limit, used)
  -- What is left.
  local left = limit - used
  return left, left > 0
end
";

    #[test]
    fn a_call_statement_takes_the_body_under_names_of_its_own() {
        let source = format!(
            "{STEP}local function f(left)\n  local used, fits = step(left, 1) -- two\n  return used\nend\n"
        );
        let expanded = expand(&source);
        assert!(
            expanded.text.contains(
                "  local used, fits\n  do\n    local used_1 = 1\n    local left_1 = left - used_1\n    used = left_1\n    fits = left_1 > 0\n  end\n"
            ),
            "{}",
            expanded.text
        );
        // The definition stays.
        assert!(expanded.text.starts_with(STEP), "{}", expanded.text);
        assert_eq!((expanded.inlined, expanded.calls_left.len()), (1, 0));
    }

    #[test]
    fn fields_keep_their_names() {
        let source = "--@inline\nlocal function get(spec, limit)\n  local x = spec.limit + limit + t:limit()\n  return x\nend\nlocal y = get(s, 2)\n";
        let expanded = expand(source);
        assert!(
            expanded.text.contains(
                "local y\ndo\n  local limit_1 = 2\n  y = s.limit + limit_1 + t:limit()\nend\n"
            ),
            "{}",
            expanded.text
        );
    }

    #[test]
    fn a_body_with_an_early_return_is_not_inlined() {
        let source = "--@inline\nlocal function g(a)\n  if a then return 1 end\n  return 2\nend\nlocal b = g(1)\n";
        assert_eq!(expand(source).text, source);
    }

    #[test]
    fn calls_inside_expressions_are_left_and_named() {
        let source =
            format!("{STEP}local a = 1 + step(3, 1)\nlocal b = step(3, 1) + 1\nf(step(3, 1))\n");
        let expanded = expand(&source);
        assert_eq!(expanded.text, source);
        let lines: Vec<usize> = expanded.calls_left.iter().map(|(line, _)| *line).collect();
        assert_eq!(lines, vec![7, 8, 9]);
    }

    #[test]
    fn a_marked_body_may_call_an_earlier_marked_function() {
        let source = format!(
            "{STEP}--@inline\nlocal function twice(limit)\n  local once = step(limit, 1)\n  return once * 2\nend\nlocal r = twice(5)\n"
        );
        let expanded = expand(&source);
        assert!(
            expanded.text.ends_with(
                "local r\ndo\n  local limit_2 = 5\n  local once_2\n  do\n    local used_1_2 = 1\n    local left_1_2 = limit_2 - used_1_2\n    once_2 = left_1_2, left_1_2 > 0\n  end\n  r = once_2 * 2\nend\n"
            ),
            "{}",
            expanded.text
        );
    }

    #[test]
    fn a_statement_without_targets_takes_the_body() {
        let source = "--@inline\nlocal function put(key, value)\n  redis.call('SET', key, value)\nend\nput(k, format('%d', 1))\n";
        let expanded = expand(source);
        assert!(
            expanded.text.ends_with(
                "do\n  local value_1 = format('%d', 1)\n  redis.call('SET', k, value_1)\nend\n"
            ),
            "{}",
            expanded.text
        );
    }

    /// A parameter the body assigns is copied, so the name passed for it keeps its value; a value
    /// that names a target keeps the multiple assignment, which reads every value first.
    #[test]
    fn assigned_parameters_are_copied_and_crossed_values_assigned_together() {
        let source = "--@inline\nlocal function clamp(value, top)\n  if value > top then\n    value = top\n  end\n  return value, top\nend\nlocal a, b = clamp(x, y)\ny, x = clamp(x, y)\n";
        let expanded = expand(source);
        assert!(
            expanded.text.contains(
                "local a, b\ndo\n  local value_1 = x\n  if value_1 > y then\n    value_1 = y\n  end\n  a = value_1\n  b = y\nend\n"
            ),
            "{}",
            expanded.text
        );
        assert!(
            expanded.text.ends_with(
                "do\n  local value_2 = x\n  if value_2 > y then\n    value_2 = y\n  end\n  y, x = value_2, y\nend\n"
            ),
            "{}",
            expanded.text
        );
    }

    /// What would change meaning if inlined stays a call: a declared target the arguments read, a
    /// target the body reads from outside, a dropped result; bodies the scans cannot read are
    /// refused whole, and their calls named.
    #[test]
    fn calls_that_would_change_meaning_stay_calls() {
        let source = format!("{STEP}local limit = step(limit, 1)\n");
        assert_eq!(expand(&source).text, source);
        let cached = "--@inline\nlocal function bump(by)\n  local next = last + by\n  last = next\n  return next\nend\nlast = bump(1)\nlocal n = bump(last)\n";
        let expanded = expand(cached);
        assert!(
            expanded.text.contains("\nlast = bump(1)\n"),
            "{}",
            expanded.text
        );
        // Passed a name the body assigns outside itself: copied, not substituted.
        assert!(
            expanded.text.contains("local by_1 = last\n"),
            "{}",
            expanded.text
        );
        let dropped = format!("{STEP}step(3, 1)\n");
        let expanded = expand(&dropped);
        assert_eq!(expanded.text, dropped);
        assert_eq!(expanded.calls_left.len(), 1);
        let table = "--@inline\nlocal function pair(n)\n  local t = { n = n }\n  return t\nend\nlocal p = pair(1)\n";
        let expanded = expand(table);
        assert_eq!(expanded.text, table);
        assert_eq!(expanded.refused, vec!["pair".to_owned()]);
        assert_eq!(expanded.calls_left.len(), 1);
    }

    /// Quoted strings keep their text; a name after `..` is a name, not a field.
    #[test]
    fn renaming_reads_strings_and_concatenation() {
        let source = "--@inline\nlocal function put(key, n)\n  local text = 'n'..n\n  redis.call('HSET', key, 'n', text)\nend\nput(k, m)\n";
        let expanded = expand(source);
        assert!(
            expanded.text.ends_with(
                "do\n  local text_1 = 'n'..m\n  redis.call('HSET', k, 'n', text_1)\nend\n"
            ),
            "{}",
            expanded.text
        );
    }

    #[test]
    fn strings_that_renaming_could_misread_keep_the_call() {
        let source =
            "--@inline\nlocal function put(key)\n  redis.call(\"SET\", key)\nend\nput(k)\n";
        assert_eq!(expand(source).text, source);
        let source = format!("{STEP}local a = step('--', 1)\n");
        assert_eq!(expand(&source).text, source);
    }
}
