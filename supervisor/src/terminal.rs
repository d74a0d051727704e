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
}
