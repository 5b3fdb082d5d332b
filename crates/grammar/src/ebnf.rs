//! SGLang's EBNF dialect (XGrammar / llama.cpp GBNF style) translated to
//! llguidance's Lark dialect.
//!
//! Accepted input: rules `name ::= alternatives` with names of
//! `[A-Za-z0-9_.-]`, start rule `root`; string literals `"..."`; character
//! classes `[a-z]`, `[^"\\]`; `.` (any character); grouping `( )`; `|`;
//! postfix `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`, `{,n}`; `#` comments;
//! escapes `\n \r \t \\ \" \' \[ \] \- \xHH \uHHHH \UHHHHHHHH`. Newlines are
//! plain whitespace: a rule ends where the next `name ::=` begins (XGrammar's
//! reading; llama.cpp's stricter one is a subset). Lookahead assertions
//! `(= ...)` are refused with [`GrammarError::Unsupported`].
//!
//! Invariant: the output has GBNF's character-level meaning. llguidance lexes
//! greedily (longest match) over the terminals of a Lark grammar, which is not
//! the meaning of a character-level grammar when a multi-character literal
//! competes with a shorter split (`root ::= "ab" "c" | "a" "b"` must accept
//! `ab`). So every literal becomes a sequence of one-character terminals and
//! every class a one-character regex: all terminals have length one, greedy
//! lexing never chooses a different split, and the Earley parser sees exactly
//! the GBNF grammar. [`lexemes`] then merges runs of terminals into single
//! regex lexemes where that provably keeps the language (prefix-free runs
//! whose first characters no other lexeme shares), which keeps masks fast for
//! the usual quoted strings and keyword sets. Rule names are mapped
//! injectively to Lark rule names.

mod lexemes;

use arbor_engine_core::grammar::{GrammarError, GrammarKind, GrammarResult};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

#[derive(Debug, Clone)]
enum Atom {
    Str(String),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
    Ref(String),
    Group(Vec<Vec<Item>>),
    /// Consecutive terminal-only items that may become one regex lexeme
    /// (see [`lexemes`]); `id` indexes the merge decisions.
    Run {
        id: usize,
        regex: String,
        items: Vec<Item>,
    },
}

#[derive(Debug, Clone, Copy)]
enum Rep {
    Star,
    Plus,
    Opt,
    Range(u32, Option<u32>),
}

#[derive(Debug, Clone)]
struct Item {
    atom: Atom,
    reps: Vec<Rep>,
}

struct Parser<'a> {
    src: &'a str,
    chars: Vec<(usize, char)>,
    pos: usize,
}

fn invalid(message: String) -> GrammarError {
    GrammarError::Invalid {
        kind: GrammarKind::Ebnf,
        message,
    }
}

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Self {
        Self {
            src,
            chars: src.char_indices().collect(),
            pos: 0,
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).map(|c| c.1)
    }

    fn peek_at(&self, k: usize) -> Option<char> {
        self.chars.get(self.pos + k).map(|c| c.1)
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek();
        if c.is_some() {
            self.pos += 1;
        }
        c
    }

    fn err(&self, msg: impl std::fmt::Display) -> GrammarError {
        let byte = self.chars.get(self.pos).map_or(self.src.len(), |c| c.0);
        let before = &self.src[..byte];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        invalid(format!("at line {line}, column {col}: {msg}"))
    }

    fn skip_ws(&mut self) {
        while let Some(c) = self.peek() {
            if c.is_whitespace() {
                self.pos += 1;
            } else if c == '#' {
                while let Some(c) = self.bump() {
                    if c == '\n' {
                        break;
                    }
                }
            } else {
                break;
            }
        }
    }

    fn is_name_char(c: char) -> bool {
        c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.'
    }

    /// A name starts here (not the `.` wildcard alone).
    fn at_name(&self) -> bool {
        self.peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    }

    fn name(&mut self) -> String {
        let mut s = String::new();
        while let Some(c) = self.peek().filter(|&c| Self::is_name_char(c)) {
            s.push(c);
            self.pos += 1;
        }
        s
    }

    /// Whether `name ::=` starts at the current position.
    fn at_rule_start(&self) -> bool {
        if !self.at_name() {
            return false;
        }
        let mut k = 0;
        while self.peek_at(k).is_some_and(Self::is_name_char) {
            k += 1;
        }
        while self.peek_at(k).is_some_and(char::is_whitespace) {
            k += 1;
        }
        self.peek_at(k) == Some(':')
            && self.peek_at(k + 1) == Some(':')
            && self.peek_at(k + 2) == Some('=')
    }

    fn grammar(&mut self) -> GrammarResult<Vec<(String, Vec<Vec<Item>>)>> {
        let mut rules = Vec::new();
        loop {
            self.skip_ws();
            if self.peek().is_none() {
                return Ok(rules);
            }
            if !self.at_rule_start() {
                return Err(self.err("expected a rule `name ::= ...`"));
            }
            let name = self.name();
            self.skip_ws();
            self.pos += 3; // ::=
            let alts = self.alternatives(false)?;
            rules.push((name, alts));
        }
    }

    fn alternatives(&mut self, nested: bool) -> GrammarResult<Vec<Vec<Item>>> {
        let mut alts = vec![self.sequence(nested)?];
        loop {
            self.skip_ws();
            if self.peek() == Some('|') {
                self.pos += 1;
                alts.push(self.sequence(nested)?);
            } else {
                return Ok(alts);
            }
        }
    }

    fn sequence(&mut self, nested: bool) -> GrammarResult<Vec<Item>> {
        let mut items = Vec::new();
        loop {
            self.skip_ws();
            match self.peek() {
                None | Some('|') => return Ok(items),
                Some(')') if nested => return Ok(items),
                _ if !nested && self.at_rule_start() => return Ok(items),
                _ => {}
            }
            let atom = self.atom()?;
            let mut reps = Vec::new();
            loop {
                match self.peek() {
                    Some('*') => reps.push(Rep::Star),
                    Some('+') => reps.push(Rep::Plus),
                    Some('?') => reps.push(Rep::Opt),
                    Some('{') => {
                        reps.push(self.range()?);
                        continue;
                    }
                    _ => break,
                }
                self.pos += 1;
            }
            items.push(Item { atom, reps });
        }
    }

    fn number(&mut self) -> GrammarResult<Option<u32>> {
        self.skip_ws();
        let mut s = String::new();
        while let Some(c) = self.peek().filter(char::is_ascii_digit) {
            s.push(c);
            self.pos += 1;
        }
        if s.is_empty() {
            return Ok(None);
        }
        s.parse()
            .map(Some)
            .map_err(|_| self.err(format!("repetition count {s} is too large")))
    }

    fn range(&mut self) -> GrammarResult<Rep> {
        self.pos += 1; // {
        let lo = self.number()?;
        self.skip_ws();
        let hi = if self.peek() == Some(',') {
            self.pos += 1;
            self.number()?
        } else {
            Some(lo.ok_or_else(|| self.err("expected a number in `{...}`"))?)
        };
        self.skip_ws();
        if self.bump() != Some('}') {
            return Err(self.err("expected `}`"));
        }
        let lo = lo.unwrap_or(0);
        if hi.is_some_and(|h| h < lo) {
            return Err(self.err(format!(
                "repetition {{{lo},{}}} has max < min",
                hi.unwrap_or(0)
            )));
        }
        Ok(Rep::Range(lo, hi))
    }

    fn escape(&mut self) -> GrammarResult<char> {
        let c = self.bump().ok_or_else(|| self.err("unfinished escape"))?;
        let hex = |p: &mut Self, n: usize| -> GrammarResult<char> {
            let mut v = 0u32;
            for _ in 0..n {
                let d = p
                    .bump()
                    .and_then(|c| c.to_digit(16))
                    .ok_or_else(|| p.err(format!("expected {n} hex digits")))?;
                v = v * 16 + d;
            }
            char::from_u32(v).ok_or_else(|| p.err(format!("U+{v:X} is not a character")))
        };
        Ok(match c {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            '0' => '\0',
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            c if c.is_ascii_alphanumeric() => {
                return Err(self.err(format!("unknown escape `\\{c}`")));
            }
            c => c,
        })
    }

    fn atom(&mut self) -> GrammarResult<Atom> {
        match self.peek() {
            Some('"') | Some('\'') => {
                let quote = self.bump().unwrap_or('"');
                let mut s = String::new();
                loop {
                    match self.bump() {
                        None => return Err(self.err("unterminated string")),
                        Some(c) if c == quote => return Ok(Atom::Str(s)),
                        Some('\\') => s.push(self.escape()?),
                        Some(c) => s.push(c),
                    }
                }
            }
            Some('[') => {
                self.pos += 1;
                let negated = self.peek() == Some('^');
                if negated {
                    self.pos += 1;
                }
                let mut ranges = Vec::new();
                loop {
                    let lo = match self.bump() {
                        None => return Err(self.err("unterminated character class")),
                        Some(']') => break,
                        Some('\\') => self.escape()?,
                        Some(c) => c,
                    };
                    let hi =
                        if self.peek() == Some('-') && self.peek_at(1).is_some_and(|c| c != ']') {
                            self.pos += 1;
                            match self.bump() {
                                Some('\\') => self.escape()?,
                                Some(c) => c,
                                None => return Err(self.err("unterminated character class")),
                            }
                        } else {
                            lo
                        };
                    if hi < lo {
                        return Err(self.err(format!("character range {lo:?}-{hi:?} is reversed")));
                    }
                    ranges.push((lo, hi));
                }
                if ranges.is_empty() && !negated {
                    return Err(self.err("empty character class"));
                }
                Ok(Atom::Class { negated, ranges })
            }
            Some('(') => {
                self.pos += 1;
                self.skip_ws();
                if self.peek() == Some('=') {
                    return Err(GrammarError::Unsupported(
                        "EBNF lookahead assertions `(= ...)` are not supported by the llguidance backend".into(),
                    ));
                }
                let alts = self.alternatives(true)?;
                self.skip_ws();
                if self.bump() != Some(')') {
                    return Err(self.err("expected `)`"));
                }
                Ok(Atom::Group(alts))
            }
            Some('.') if !self.peek_at(1).is_some_and(Self::is_name_char) => {
                self.pos += 1;
                Ok(Atom::Any)
            }
            _ if self.at_name() => Ok(Atom::Ref(self.name())),
            Some(c) => Err(self.err(format!("unexpected `{c}`"))),
            None => Err(self.err("unexpected end of grammar")),
        }
    }
}

/// A Lark string literal (JSON syntax, control characters escaped).
fn lark_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn class_char(out: &mut String, c: char) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:x}}}", c as u32);
    }
}

/// `Root-rule.x` → `r_root-rule_0x`: lowercase letters, digits and `-` stay,
/// `_` → `__`, an uppercase letter → `_` + lowercase, `.` → `_0`.
fn lark_name(name: &str) -> String {
    let mut out = String::from("r_");
    for c in name.chars() {
        match c {
            'a'..='z' | '0'..='9' | '-' => out.push(c),
            '_' => out.push_str("__"),
            'A'..='Z' => {
                out.push('_');
                out.push(c.to_ascii_lowercase());
            }
            _ => out.push_str("_0"),
        }
    }
    out
}

struct Emitter<'a> {
    rules: &'a BTreeMap<String, Vec<Vec<Item>>>,
    merged: &'a [bool],
}

impl Emitter<'_> {
    /// Emits an atom; returns whether the text is a single Lark atom.
    fn atom(&self, a: &Atom, out: &mut String) -> GrammarResult<bool> {
        match a {
            Atom::Str(s) => {
                let chars: Vec<char> = s.chars().collect();
                match chars.len() {
                    0 => out.push_str("\"\""),
                    _ => {
                        for (i, c) in chars.iter().enumerate() {
                            if i > 0 {
                                out.push(' ');
                            }
                            out.push_str(&lark_string(&c.to_string()));
                        }
                    }
                }
                Ok(chars.len() <= 1)
            }
            Atom::Class { negated, ranges } => {
                out.push_str("/[");
                if *negated {
                    out.push('^');
                }
                if ranges.is_empty() {
                    // `[^]`: any character.
                    out.push_str("\\x{0}-\\x{10ffff}");
                }
                for &(lo, hi) in ranges {
                    class_char(out, lo);
                    if hi != lo {
                        out.push('-');
                        class_char(out, hi);
                    }
                }
                out.push_str("]/");
                Ok(true)
            }
            Atom::Any => {
                out.push_str("/(?s:.)/");
                Ok(true)
            }
            Atom::Ref(name) => {
                if !self.rules.contains_key(name) {
                    return Err(invalid(format!("rule `{name}` is used but not defined")));
                }
                out.push_str(&lark_name(name));
                Ok(true)
            }
            Atom::Group(alts) => {
                out.push('(');
                self.alternatives(alts, out)?;
                out.push(')');
                Ok(true)
            }
            Atom::Run { id, regex, items } => {
                if self.merged.get(*id).copied().unwrap_or(false) {
                    out.push('/');
                    out.push_str(regex);
                    out.push('/');
                    return Ok(true);
                }
                for (j, item) in items.iter().enumerate() {
                    if j > 0 {
                        out.push(' ');
                    }
                    self.item(item, out)?;
                }
                Ok(false)
            }
        }
    }

    fn item(&self, item: &Item, out: &mut String) -> GrammarResult<()> {
        let mut text = String::new();
        let mut single = self.atom(&item.atom, &mut text)?;
        for rep in &item.reps {
            if !single {
                text = format!("({text})");
            }
            match *rep {
                Rep::Star => text.push('*'),
                Rep::Plus => text.push('+'),
                Rep::Opt => text.push('?'),
                Rep::Range(_, Some(0)) => text = "\"\"".to_string(),
                Rep::Range(lo, Some(hi)) if lo == hi => {
                    let _ = write!(text, "{{{lo}}}");
                }
                Rep::Range(lo, Some(hi)) => {
                    let _ = write!(text, "{{{lo},{hi}}}");
                }
                Rep::Range(lo, None) => {
                    let _ = write!(text, "{{{lo},}}");
                }
            }
            single = false;
        }
        out.push_str(&text);
        Ok(())
    }

    fn alternatives(&self, alts: &[Vec<Item>], out: &mut String) -> GrammarResult<()> {
        for (i, seq) in alts.iter().enumerate() {
            if i > 0 {
                out.push_str(" | ");
            }
            if seq.is_empty() {
                out.push_str("\"\"");
            }
            for (j, item) in seq.iter().enumerate() {
                if j > 0 {
                    out.push(' ');
                }
                self.item(item, out)?;
            }
        }
        Ok(())
    }
}

/// Translates an SGLang EBNF grammar into an llguidance Lark grammar.
pub fn ebnf_to_lark(src: &str) -> GrammarResult<String> {
    let parsed = Parser::new(src).grammar()?;
    let mut rules: BTreeMap<String, Vec<Vec<Item>>> = BTreeMap::new();
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for (name, alts) in parsed {
        if !seen.insert(name.clone()) {
            return Err(invalid(format!("rule `{name}` is defined twice")));
        }
        order.push(name.clone());
        rules.insert(name, alts);
    }
    if !rules.contains_key("root") {
        return Err(invalid("the grammar has no `root` rule".into()));
    }
    // References are checked before merging (runs hide nothing but terminals).
    let check = Emitter {
        rules: &rules,
        merged: &[],
    };
    for alts in rules.values() {
        check.alternatives(alts, &mut String::new())?;
    }
    let merged = lexemes::merge_runs(&mut rules);
    let em = Emitter {
        rules: &rules,
        merged: &merged,
    };
    let mut out = format!("start: {}\n", lark_name("root"));
    for name in &order {
        out.push_str(&lark_name(name));
        out.push_str(": ");
        if let Some(alts) = rules.get(name) {
            em.alternatives(alts, &mut out)?;
        }
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_rules_literals_and_classes() {
        let g = r#"
            # a comment
            root ::= "yes" | "no" ws
              | Item{2,3} [^"\\] .
            Item ::= [a-z_] ("x" | "")* "\n"?
            ws ::= [ \t]{0,4}
        "#;
        let lark = ebnf_to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: r_root\n\
             r_root: \"y\" \"e\" \"s\" | \"n\" \"o\" r_ws | r__item{2,3} /[^\\x{22}\\x{5c}]/ /(?s:.)/\n\
             r__item: /[a-z\\x{5f}]/ (\"x\" | \"\")* \"\\u000a\"?\n\
             r_ws: /[\\x{20}\\x{9}]/{0,4}\n"
        );
    }

    #[test]
    fn merges_only_safe_runs() {
        // The quoted string is prefix-free and owns `"`: one lexeme. `("a" | "ab") "b"`
        // is not prefix-free ("ab" vs "abb"): one-character terminals.
        let g = concat!(
            r#"root ::= "{" str ":" str "}" | ("a" | "ab") "b""#,
            "\n",
            r#"str ::= "\"" [^"\\]* "\"""#
        );
        let lark = ebnf_to_lark(g).unwrap();
        assert_eq!(
            lark,
            concat!(
                "start: r_root\n",
                r#"r_root: "{" r_str ":" r_str "}" | ("a" | "a" "b") "b""#,
                "\n",
                r#"r_str: /\x{22}(?:[^\x{22}\x{5c}])*\x{22}/"#,
                "\n"
            )
        );
        // A competing lexeme that starts with `"` keeps the string unmerged.
        let g = concat!(
            r#"root ::= str | "\"" "x""#,
            "\n",
            r#"str ::= "\"" [a-z]* "\"""#
        );
        let lark = ebnf_to_lark(g).unwrap();
        assert!(!lark.contains("/\\x{22}"), "{lark}");
    }

    #[test]
    fn names_map_injectively() {
        let names = ["a_b", "aB", "a.b", "a-b", "ab", "A"];
        let mapped: BTreeSet<String> = names.iter().map(|n| lark_name(n)).collect();
        assert_eq!(mapped.len(), names.len());
    }

    #[test]
    fn errors_are_clear() {
        let e = ebnf_to_lark("root ::= foo").unwrap_err().to_string();
        assert!(e.contains("`foo` is used but not defined"), "{e}");
        let e = ebnf_to_lark("x ::= \"a\"").unwrap_err().to_string();
        assert!(e.contains("no `root` rule"), "{e}");
        let e = ebnf_to_lark("root ::= \"a\n").unwrap_err().to_string();
        assert!(e.contains("unterminated string"), "{e}");
        let e = ebnf_to_lark("root ::= \"a\" (= \"b\")").unwrap_err();
        assert!(matches!(e, GrammarError::Unsupported(_)));
        let e = ebnf_to_lark("root ::= [z-a]").unwrap_err().to_string();
        assert!(e.contains("line 1, column"), "{e}");
    }
}
