//! Marker search shared by the parsers: the earliest of several markers in
//! a text, and how much of a text's end could be the start of a marker (held
//! back while streaming). Lengths are in bytes and always on char boundaries.

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`.
pub(crate) fn partial_tag_len(text: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for tag in tags {
        for k in (1..tag.len()).rev() {
            if k <= best {
                break;
            }
            if text.len() >= k && tag.is_char_boundary(k) && text.ends_with(&tag[..k]) {
                best = k;
                break;
            }
        }
    }
    best
}

/// The earliest occurrence of one of `tags` in `text`: (position, tag).
/// At equal positions the longer tag wins.
pub(crate) fn first_tag<'t>(text: &str, tags: &[&'t str]) -> Option<(usize, &'t str)> {
    tags.iter()
        .filter_map(|t| text.find(t).map(|i| (i, *t)))
        .min_by_key(|&(i, t)| (i, usize::MAX - t.len()))
}

/// Whether `text` is a proper prefix of one of `tags` (more text could complete it).
pub(crate) fn is_tag_prefix(text: &str, tags: &[&str]) -> bool {
    tags.iter()
        .any(|t| t.len() > text.len() && t.starts_with(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_and_first() {
        assert_eq!(partial_tag_len("ab<thi", &["<think>"]), 4);
        assert_eq!(partial_tag_len("ab<think>", &["<think>"]), 0);
        assert_eq!(
            partial_tag_len("x<｜to", &["<｜tool▁calls▁begin｜>"]),
            "<｜to".len()
        );
        assert_eq!(first_tag("a<b<c", &["<c", "<b"]), Some((1, "<b")));
        assert_eq!(first_tag("<ab", &["<a", "<ab"]), Some((0, "<ab")));
        assert!(is_tag_prefix("<to", &["<tool_call>"]));
        assert!(!is_tag_prefix("<tool_call>", &["<tool_call>"]));
    }
}
