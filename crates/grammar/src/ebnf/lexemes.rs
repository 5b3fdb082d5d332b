//! Exact lexeme merging for the EBNF → Lark translation.
//!
//! One-character terminals keep GBNF's meaning but make llguidance run its
//! Earley parser at every byte of every token while computing a mask (about
//! 1.5 ms per mask for a JSON grammar and a 49k vocabulary). This pass turns
//! a run of consecutive terminal-only items (no rule references) into one
//! regex lexeme when greedy lexing provably cannot pick a different split:
//! - the run is not nullable and its language is prefix-free (no word is a
//!   proper prefix of another, checked with derivre: `R·.+ ∩ R = ∅`), so a
//!   match can end at one place only, whatever follows;
//! - its first characters are disjoint from those of every other lexeme of
//!   the grammar (other merged runs with a different regex, and all remaining
//!   one-character terminals), so no other lexeme competes where it starts.
//!
//! Together these make the lexer's longest match the only match, so the
//! grammar's language is unchanged. Conflicts are resolved by a fixpoint that
//! un-merges runs until no merged run conflicts. A quoted-string rule such as
//! `"\"" ([^"\\] | "\\" ["\\nt])* "\""` merges; `"a" | "ab"` does not.

use super::{Atom, Item, Rep};
use llguidance::derivre::{RegexAst, RegexBuilder};
use std::collections::BTreeMap;
use std::fmt::Write;

const MAX_CHAR: u32 = 0x10FFFF;
/// derivre fuel for one prefix-freeness check; running out means "don't merge".
const FUEL: u64 = 200_000;

/// A set of characters as sorted, disjoint, non-adjacent inclusive ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct CharSet(Vec<(u32, u32)>);

impl CharSet {
    fn all() -> Self {
        CharSet(vec![(0, MAX_CHAR)])
    }
    fn add(&mut self, lo: u32, hi: u32) {
        self.0.push((lo, hi));
        self.0.sort_unstable();
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(self.0.len());
        for &(l, h) in &self.0 {
            match out.last_mut() {
                Some(last) if l <= last.1.saturating_add(1) => last.1 = last.1.max(h),
                _ => out.push((l, h)),
            }
        }
        self.0 = out;
    }
    fn union(&mut self, o: &CharSet) {
        for &(l, h) in &o.0 {
            self.add(l, h);
        }
    }
    fn complement(&self) -> CharSet {
        let mut out = Vec::new();
        let mut next = 0u32;
        for &(l, h) in &self.0 {
            if l > next {
                out.push((next, l - 1));
            }
            next = h.saturating_add(1);
        }
        if next <= MAX_CHAR {
            out.push((next, MAX_CHAR));
        }
        CharSet(out)
    }
    fn intersects(&self, o: &CharSet) -> bool {
        let (mut i, mut j) = (0, 0);
        while i < self.0.len() && j < o.0.len() {
            let (a, b) = (self.0[i], o.0[j]);
            if a.1 < b.0 {
                i += 1;
            } else if b.1 < a.0 {
                j += 1;
            } else {
                return true;
            }
        }
        false
    }
}

fn class_set(negated: bool, ranges: &[(char, char)]) -> CharSet {
    let mut s = CharSet::default();
    for &(l, h) in ranges {
        s.add(l as u32, h as u32);
    }
    if negated { s.complement() } else { s }
}

fn terminal_only(item: &Item) -> bool {
    fn atom(a: &Atom) -> bool {
        match a {
            Atom::Str(_) | Atom::Class { .. } | Atom::Any => true,
            Atom::Ref(_) | Atom::Run { .. } => false,
            Atom::Group(alts) => alts.iter().all(|s| s.iter().all(terminal_only)),
        }
    }
    atom(&item.atom)
}

fn atom_nullable(a: &Atom) -> bool {
    match a {
        Atom::Str(s) => s.is_empty(),
        Atom::Class { .. } | Atom::Any | Atom::Ref(_) => false,
        Atom::Group(alts) => alts.iter().any(|s| seq_nullable(s)),
        Atom::Run { items, .. } => seq_nullable(items),
    }
}

fn item_nullable(i: &Item) -> bool {
    atom_nullable(&i.atom)
        || i.reps
            .iter()
            .any(|r| matches!(r, Rep::Star | Rep::Opt | Rep::Range(0, _)))
}

fn seq_nullable(items: &[Item]) -> bool {
    items.iter().all(item_nullable)
}

fn atom_first(a: &Atom) -> CharSet {
    match a {
        Atom::Str(s) => {
            let mut c = CharSet::default();
            if let Some(ch) = s.chars().next() {
                c.add(ch as u32, ch as u32);
            }
            c
        }
        Atom::Class { negated, ranges } => class_set(*negated, ranges),
        Atom::Any => CharSet::all(),
        Atom::Group(alts) => {
            let mut c = CharSet::default();
            for s in alts {
                c.union(&seq_first(s));
            }
            c
        }
        Atom::Ref(_) => CharSet::default(),
        Atom::Run { items, .. } => seq_first(items),
    }
}

fn seq_first(items: &[Item]) -> CharSet {
    let mut c = CharSet::default();
    for i in items {
        if !matches!(i.reps.last(), Some(Rep::Range(_, Some(0)))) {
            c.union(&atom_first(&i.atom));
        }
        if !item_nullable(i) {
            break;
        }
    }
    c
}

fn rx_char(out: &mut String, c: char) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:x}}}", c as u32);
    }
}

fn atom_regex(a: &Atom, out: &mut String) {
    match a {
        Atom::Str(s) => s.chars().for_each(|c| rx_char(out, c)),
        Atom::Class { negated, ranges } => {
            out.push('[');
            if *negated {
                out.push('^');
            }
            if ranges.is_empty() {
                out.push_str("\\x{0}-\\x{10ffff}");
            }
            for &(l, h) in ranges {
                rx_char(out, l);
                if h != l {
                    out.push('-');
                    rx_char(out, h);
                }
            }
            out.push(']');
        }
        Atom::Any => out.push_str("(?s:.)"),
        Atom::Group(alts) => {
            out.push_str("(?:");
            for (i, s) in alts.iter().enumerate() {
                if i > 0 {
                    out.push('|');
                }
                seq_regex(s, out);
            }
            out.push(')');
        }
        Atom::Ref(_) | Atom::Run { .. } => {}
    }
}

fn seq_regex(items: &[Item], out: &mut String) {
    for i in items {
        let mut a = String::new();
        atom_regex(&i.atom, &mut a);
        for r in &i.reps {
            a = format!("(?:{a})");
            match *r {
                Rep::Star => a.push('*'),
                Rep::Plus => a.push('+'),
                Rep::Opt => a.push('?'),
                Rep::Range(_, Some(0)) => a.clear(),
                Rep::Range(lo, Some(hi)) => {
                    let _ = write!(a, "{{{lo},{hi}}}");
                }
                Rep::Range(lo, None) => {
                    let _ = write!(a, "{{{lo},}}");
                }
            }
        }
        out.push_str(&a);
    }
}

/// `R·.+ ∩ R = ∅`: no word of the regex is a proper prefix of another.
fn prefix_free(rx: &str) -> bool {
    let check = || -> Option<bool> {
        let mut b = RegexBuilder::new();
        let r = b.mk(&RegexAst::Regex(rx.to_string())).ok()?;
        let more = b
            .mk(&RegexAst::Concat(vec![
                RegexAst::ExprRef(r),
                RegexAst::Repeat(Box::new(RegexAst::Regex("(?s:.)".into())), 1, u32::MAX),
            ]))
            .ok()?;
        let both = b
            .mk(&RegexAst::And(vec![
                RegexAst::ExprRef(more),
                RegexAst::ExprRef(r),
            ]))
            .ok()?;
        Some(b.to_regex_limited(both, FUEL).ok()?.always_empty())
    };
    std::panic::catch_unwind(check)
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Whether a run can match more than one character (else merging gains nothing).
fn worth_merging(run: &[Item]) -> bool {
    match run {
        [one] => {
            !one.reps.is_empty()
                || matches!(&one.atom, Atom::Str(s) if s.chars().count() > 1)
                || matches!(one.atom, Atom::Group(_))
        }
        _ => true,
    }
}

struct Runs {
    regex: Vec<String>,
    first: Vec<CharSet>,
}

impl Runs {
    fn flush(&mut self, run: &mut Vec<Item>, out: &mut Vec<Item>) {
        if run.is_empty() {
            return;
        }
        let items = std::mem::take(run);
        let mut rx = String::new();
        seq_regex(&items, &mut rx);
        if seq_nullable(&items) || !worth_merging(&items) || !prefix_free(&rx) {
            out.extend(items);
            return;
        }
        let id = self.regex.len();
        self.first.push(seq_first(&items));
        self.regex.push(rx.clone());
        out.push(Item {
            atom: Atom::Run {
                id,
                regex: rx,
                items,
            },
            reps: Vec::new(),
        });
    }

    fn seq(&mut self, items: Vec<Item>) -> Vec<Item> {
        let mut out = Vec::with_capacity(items.len());
        let mut run = Vec::new();
        for mut item in items {
            if terminal_only(&item) {
                run.push(item);
                continue;
            }
            self.flush(&mut run, &mut out);
            if let Atom::Group(alts) = &mut item.atom {
                *alts = std::mem::take(alts)
                    .into_iter()
                    .map(|s| self.seq(s))
                    .collect();
            }
            out.push(item);
        }
        self.flush(&mut run, &mut out);
        out
    }
}

/// Characters that start a one-character lexeme (terminals outside merged runs).
fn singles(items: &[Item], merged: &[bool], acc: &mut CharSet, runs: &mut Vec<usize>) {
    for i in items {
        match &i.atom {
            Atom::Str(s) => s.chars().for_each(|c| acc.add(c as u32, c as u32)),
            Atom::Class { negated, ranges } => acc.union(&class_set(*negated, ranges)),
            Atom::Any => acc.union(&CharSet::all()),
            Atom::Ref(_) => {}
            Atom::Group(alts) => alts.iter().for_each(|s| singles(s, merged, acc, runs)),
            Atom::Run { id, items, .. } => {
                if merged[*id] {
                    runs.push(*id);
                } else {
                    singles(items, merged, acc, runs);
                }
            }
        }
    }
}

/// Marks mergeable runs in place; returns, per run id, whether it is merged.
pub(super) fn merge_runs(rules: &mut BTreeMap<String, Vec<Vec<Item>>>) -> Vec<bool> {
    let mut runs = Runs {
        regex: Vec::new(),
        first: Vec::new(),
    };
    for alts in rules.values_mut() {
        *alts = std::mem::take(alts)
            .into_iter()
            .map(|s| runs.seq(s))
            .collect();
    }
    let mut merged = vec![true; runs.regex.len()];
    loop {
        let mut acc = CharSet::default();
        let mut live = Vec::new();
        for alts in rules.values() {
            for s in alts {
                singles(s, &merged, &mut acc, &mut live);
            }
        }
        live.sort_unstable();
        live.dedup();
        let mut changed = false;
        for &r in &live {
            let clash = runs.first[r].intersects(&acc)
                || live.iter().any(|&o| {
                    o != r
                        && merged[o]
                        && runs.regex[o] != runs.regex[r]
                        && runs.first[o].intersects(&runs.first[r])
                });
            if clash {
                merged[r] = false;
                changed = true;
            }
        }
        if !changed {
            return merged;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charsets() {
        let mut a = CharSet::default();
        a.add(10, 20);
        a.add(21, 30);
        a.add(5, 6);
        assert_eq!(a.0, vec![(5, 6), (10, 30)]);
        let c = a.complement();
        assert_eq!(c.0, vec![(0, 4), (7, 9), (31, MAX_CHAR)]);
        assert!(!a.intersects(&c));
        assert!(a.intersects(&CharSet(vec![(30, 40)])));
    }

    #[test]
    fn prefix_freeness() {
        assert!(prefix_free(
            r#"\x{22}(?:[^\x{22}\x{5c}]|\x{5c}[nt])*\x{22}"#
        ));
        assert!(prefix_free("(?:true|false|null)"));
        assert!(!prefix_free("(?:a|ab)"));
        assert!(!prefix_free("[0-9]+"));
    }
}
