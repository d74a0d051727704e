//! What may not reach an operator's terminal as it is. Pure functions.

/// A character that would drive a terminal or reorder what it shows rather
/// than be shown: a control character (C0, DEL, C1), a line or paragraph
/// separator, or a bidirectional mark, embedding, override or isolate
/// (U+202E shows the rest of a line right to left).
pub fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}'
                | '\u{2029}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{061c}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// `s` with each unsafe character replaced by a space: safe to print on one
/// line of a table or a listing.
pub fn shown(s: &str) -> String {
    s.chars()
        .map(|c| if is_unsafe(c) { ' ' } else { c })
        .collect()
}

/// `s` as a table cell: [`shown`], trimmed, and cut to `max` characters
/// (the last of them `…` when cut).
pub fn cell(s: &str, max: usize) -> String {
    let shown = shown(s);
    let shown = shown.trim();
    if shown.chars().count() > max {
        let mut cut: String = shown.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    } else {
        shown.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_separators_and_bidi_marks_are_unsafe() {
        for c in [
            '\n', '\u{1b}', '\u{7f}', '\u{85}', '\u{2028}', '\u{202e}', '\u{2067}', '\u{200e}',
        ] {
            assert!(is_unsafe(c), "{c:?}");
        }
        for c in ['a', 'é', '…', '\u{2030}', '中'] {
            assert!(!is_unsafe(c), "{c:?}");
        }
    }

    #[test]
    fn a_cell_is_one_trimmed_line_cut_to_its_width() {
        assert_eq!(shown(" a\u{1b}[2J\nb "), " a [2J b ");
        assert_eq!(cell(" a\u{1b}[2J\nb ", 10), "a [2J b");
        assert_eq!(cell("abcdef", 4), "abc…");
        assert_eq!(cell("abcd", 4), "abcd");
        assert_eq!(cell("中文字符", 3), "中文…");
    }
}
