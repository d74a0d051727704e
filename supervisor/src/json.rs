//! JSON the runtime takes in from outside (specs, results' outputs, details)
//! and must store as `jsonb`: parsed to a depth the caller names, not
//! serde_json's fixed 127, and checked for numbers PostgreSQL's `numeric`
//! cannot hold. Pure functions, no I/O.

use serde::Deserialize;
use serde_json::Value;

/// How deep an input (and a result's output) may nest: README "input nests at
/// at most 128 levels"; `durable.check_secret_keys` refuses the 129th.
pub const MAX_VALUE_DEPTH: usize = 128;

/// PostgreSQL's `numeric` holds at most this many digits before the decimal
/// point (NUMERIC_WEIGHT_MAX) …
const NUMERIC_MAX_INT_DIGITS: i64 = 131_072;
/// … and this many after it (NUMERIC_DSCALE_MAX).
const NUMERIC_MAX_FRAC_DIGITS: i64 = 16_383;

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error(
        "it is nested {depth} levels deep, more than the {max} allowed; flatten it, or pass \
         deeply structured data as an artifact"
    )]
    TooDeep { depth: usize, max: usize },
    #[error("{0}{hint}", hint = surrogate_hint(.0))]
    Json(#[from] serde_json::Error),
}

/// serde_json's words for a lone UTF-16 surrogate escape (`"\ud800"`:
/// "unexpected end of hex escape") say nothing of a surrogate (audit 94).
fn surrogate_hint(e: &serde_json::Error) -> &'static str {
    let text = e.to_string();
    if text.contains("hex escape")
        && (text.contains("surrogate") || text.contains("unexpected end"))
    {
        " (a \\uD800–\\uDBFF escape must be followed by a \\uDC00–\\uDFFF one: JSON text holds no lone UTF-16 surrogate)"
    } else {
        ""
    }
}

/// Parses `bytes` as one JSON value nested at most `max_depth` levels (an
/// array or object is one level; scalars none; `max_depth` is at least
/// serde_json's own 127). Text within serde_json's limit is parsed as any
/// JSON is; only what it refuses for depth is scanned, then parsed without
/// the limit when the scan allows it, so the stack stays bounded.
pub fn parse_bounded(bytes: &[u8], max_depth: usize) -> Result<Value, ParseError> {
    match serde_json::from_slice(bytes) {
        Ok(v) => return Ok(v),
        Err(e) if !e.to_string().starts_with("recursion limit exceeded") => return Err(e.into()),
        Err(_) => {}
    }
    let d = depth(bytes);
    if d > max_depth {
        return Err(ParseError::TooDeep {
            depth: d,
            max: max_depth,
        });
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    de.disable_recursion_limit();
    let v = Value::deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// A timestamp as the CLI's JSON writes it: RFC 3339 in UTC, always six
/// digits after the second (`2026-12-05T11:44:06.432000Z`). chrono's own
/// form drops trailing zeros (`.432Z` beside `.432100Z`), so strings of one
/// output neither lined up nor sorted as their times do (operator audit).
pub fn utc_micros<S: serde::Serializer>(
    t: &chrono::DateTime<chrono::Utc>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_str(&t.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string())
}

/// [`utc_micros`] for an optional timestamp (`null` when none).
pub fn utc_micros_opt<S: serde::Serializer>(
    t: &Option<chrono::DateTime<chrono::Utc>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => utc_micros(t, s),
        None => s.serialize_none(),
    }
}

/// `text` for a message: as it is when short, else its first 24
/// characters and its length (a 140,000-digit number, or a key of 5,000
/// characters, made a message as long).
pub fn short(text: &str) -> String {
    const KEEP: usize = 24;
    match text.char_indices().nth(KEEP) {
        Some((i, _)) if text.chars().count() > KEEP + 16 => {
            format!("{}… ({} characters)", &text[..i], text.chars().count())
        }
        _ => text.to_owned(),
    }
}

/// The first key that comes twice in one object of `bytes` (JSON that
/// [`parse_bounded`] took), as `duplicate key "name" at line 1 column 40`:
/// a JSON parser and `jsonb` keep the last value of such a key without a
/// word, so `{"name": "a", …, "name": "b"}` became step `b`.
pub fn duplicate_key(bytes: &[u8]) -> Option<String> {
    use serde::de::{Error, MapAccess, SeqAccess, Visitor};
    struct NoDup;
    struct Walk;
    impl<'de> Deserialize<'de> for NoDup {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<NoDup, D::Error> {
            d.deserialize_any(Walk)
        }
    }
    impl<'de> Visitor<'de> for Walk {
        type Value = NoDup;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<NoDup, E> {
            Ok(NoDup)
        }
        fn visit_i64<E>(self, _: i64) -> Result<NoDup, E> {
            Ok(NoDup)
        }
        fn visit_u64<E>(self, _: u64) -> Result<NoDup, E> {
            Ok(NoDup)
        }
        fn visit_f64<E>(self, _: f64) -> Result<NoDup, E> {
            Ok(NoDup)
        }
        fn visit_str<E>(self, _: &str) -> Result<NoDup, E> {
            Ok(NoDup)
        }
        fn visit_unit<E>(self) -> Result<NoDup, E> {
            Ok(NoDup)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<NoDup, A::Error> {
            while a.next_element::<NoDup>()?.is_some() {}
            Ok(NoDup)
        }
        // (a number, with arbitrary_precision, is a map of one entry)
        fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<NoDup, A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(k) = a.next_key::<String>()? {
                if seen.contains(&k) {
                    return Err(A::Error::custom(format!("duplicate key {:?}", short(&k))));
                }
                a.next_value::<NoDup>()?;
                seen.insert(k);
            }
            Ok(NoDup)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    de.disable_recursion_limit();
    match NoDup::deserialize(&mut de) {
        Err(e) if e.to_string().starts_with("duplicate key") => Some(e.to_string()),
        _ => None,
    }
}

/// How deeply arrays and objects nest in JSON text (brackets inside strings
/// do not count).
pub fn depth(bytes: &[u8]) -> usize {
    let (mut depth, mut max, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in bytes {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// What `jsonb` cannot hold: a NUL character (`\u0000` is valid JSON), or a
/// number beyond `numeric` (`1e999999` has too many digits before the
/// point, `1e-99999` too many after it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unstorable {
    Nul,
    /// The number's text.
    Number(String),
}

/// The first place in `v` whose value (or key, for a NUL) PostgreSQL cannot
/// store, with its path below `path` (`path.key`, `path[i]`, as the spec's
/// messages name fields; the root's keys bare when `path` is empty). One walk
/// for both checks.
pub fn unstorable(v: &Value, path: &str) -> Option<(String, Unstorable)> {
    match v {
        Value::String(s) if s.contains('\0') => Some((path.to_owned(), Unstorable::Nul)),
        Value::Number(n) => {
            let text = n.to_string();
            (!numeric_can_hold(&text)).then(|| (path.to_owned(), Unstorable::Number(text)))
        }
        Value::Array(a) => a
            .iter()
            .enumerate()
            .find_map(|(i, x)| unstorable(x, &format!("{path}[{i}]"))),
        Value::Object(m) => m.iter().find_map(|(k, x)| {
            let at = match path {
                "" => k.clone(),
                _ => format!("{path}.{k}"),
            };
            if k.contains('\0') {
                Some((at, Unstorable::Nul))
            } else {
                unstorable(x, &at)
            }
        }),
        _ => None,
    }
}

/// `v` with what PostgreSQL cannot store made storable, for evidence such as
/// an error's details, which is kept rather than refused: a NUL (in a string
/// or a key) becomes U+FFFD, a number beyond `numeric` its text.
pub fn storable(v: Value) -> Value {
    match v {
        Value::String(s) => Value::String(s.replace('\0', "\u{fffd}")),
        Value::Number(n) if !numeric_can_hold(&n.to_string()) => Value::String(n.to_string()),
        Value::Array(a) => Value::Array(a.into_iter().map(storable).collect()),
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, x)| (k.replace('\0', "\u{fffd}"), storable(x)))
                .collect(),
        ),
        other => other,
    }
}

/// Whether a JSON number's text fits `numeric`: its significant digits before
/// the point (the exponent moves the point) and its scale (the literal's
/// digits after the point minus the exponent), each within PostgreSQL's limits.
fn numeric_can_hold(text: &str) -> bool {
    // an exponent beyond i64 is beyond numeric either way
    let Some(NumberParts { int, frac, exp, .. }) = number_parts(text) else {
        return false;
    };
    let scale = (frac.len() as i64).saturating_sub(exp);
    if scale > NUMERIC_MAX_FRAC_DIGITS {
        return false;
    }
    let first_nonzero = int.bytes().chain(frac.bytes()).position(|b| b != b'0');
    match first_nonzero {
        // zero has no weight
        None => true,
        Some(f) => {
            (int.len() as i64)
                .saturating_add(exp)
                .saturating_sub(f as i64)
                <= NUMERIC_MAX_INT_DIGITS
        }
    }
}

/// A JSON number's text taken apart: its sign, the digits before and after
/// the point, and its exponent (0 when it has none).
struct NumberParts<'a> {
    negative: bool,
    int: &'a str,
    frac: &'a str,
    exp: i64,
    has_exponent: bool,
}

/// `None` when the exponent is beyond `i64`.
fn number_parts(text: &str) -> Option<NumberParts<'_>> {
    let (negative, t) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exp, has_exponent) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], t[i + 1..].parse::<i64>().ok()?, true),
        None => (t, 0, false),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    Some(NumberParts {
        negative,
        int,
        frac,
        exp,
        has_exponent,
    })
}

/// How PostgreSQL's `numeric` (and so `jsonb`) writes the JSON number
/// `text`, when that differs from `text`: an exponent written out
/// (`1.2345678e7` → `12345678`, `1.5E-7` → `0.00000015`, keeping as many
/// digits after the point as the text meant) and no sign on zero. `None`
/// when it is spelled as written, or for an exponent beyond a few thousand
/// (what the redactor looks for in it is never that long).
pub fn stored_spelling(text: &str) -> Option<String> {
    let NumberParts {
        negative,
        int,
        frac,
        exp,
        has_exponent,
    } = number_parts(text)?;
    let zero = int.bytes().chain(frac.bytes()).all(|b| b == b'0');
    if !(has_exponent || negative && zero) {
        return None;
    }
    if exp.abs() > 4096 || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = format!("{int}{frac}");
    let point = int.len() as i64 + exp;
    let scale = (frac.len() as i64 - exp).max(0) as usize;
    let (whole, mut fraction) = if point <= 0 {
        (
            "0".to_owned(),
            format!("{}{digits}", "0".repeat((-point) as usize)),
        )
    } else if point as usize >= digits.len() {
        (
            format!("{digits}{}", "0".repeat(point as usize - digits.len())),
            String::new(),
        )
    } else {
        (
            digits[..point as usize].to_owned(),
            digits[point as usize..].to_owned(),
        )
    };
    let whole = whole.trim_start_matches('0');
    let whole = if whole.is_empty() { "0" } else { whole };
    fraction.truncate(scale);
    while fraction.len() < scale {
        fraction.push('0');
    }
    let sign = if negative && !zero { "-" } else { "" };
    Some(if scale > 0 {
        format!("{sign}{whole}.{fraction}")
    } else {
        format!("{sign}{whole}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A number as `jsonb` spells it, when that is not as written.
    /// A lone surrogate escape is said to be one; serde_json's own words
    /// ("unexpected end of hex escape") stay beside the hint.
    #[test]
    fn a_lone_surrogate_escape_is_named() {
        for text in [r#""\ud800""#, r#""\ud800x""#, r#"{"a": "\udbff\u0041"}"#] {
            let e = parse_bounded(text.as_bytes(), MAX_VALUE_DEPTH).expect_err(text);
            let said = e.to_string();
            assert!(said.contains("hex escape"), "{text}: {said}");
            assert!(said.contains("no lone UTF-16 surrogate"), "{text}: {said}");
        }
        let e = parse_bounded(b"{nope", MAX_VALUE_DEPTH).expect_err("invalid");
        assert!(!e.to_string().contains("surrogate"), "{e}");
        // a pair is text
        assert_eq!(
            parse_bounded(r#""\ud83d\ude00""#.as_bytes(), MAX_VALUE_DEPTH).expect("pair"),
            Value::String("\u{1f600}".into())
        );
    }

    #[test]
    fn a_numbers_stored_spelling() {
        for (text, stored) in [
            ("1.2345678e7", Some("12345678")),
            ("1.5E-7", Some("0.00000015")),
            ("1.50e1", Some("15.0")),
            ("15e3", Some("15000")),
            ("-0", Some("0")),
            ("-0.0e0", Some("0.0")),
            ("-2.5e-1", Some("-0.25")),
            ("12345678", None),
            ("-1.5", None),
        ] {
            assert_eq!(stored_spelling(text).as_deref(), stored, "{text}");
        }
    }

    /// Timestamps in the CLI's JSON have six digits after the second, so
    /// that they line up and sort as their times do.
    #[test]
    fn timestamps_have_a_fixed_precision() {
        #[derive(serde::Serialize)]
        struct T {
            #[serde(serialize_with = "utc_micros")]
            at: chrono::DateTime<chrono::Utc>,
            #[serde(serialize_with = "utc_micros_opt")]
            maybe: Option<chrono::DateTime<chrono::Utc>>,
        }
        let at = |ms: i64| chrono::DateTime::from_timestamp_millis(ms).expect("time");
        let v = serde_json::to_value(T {
            at: at(1_796_471_046_432),
            maybe: None,
        })
        .expect("json");
        assert_eq!(v["at"], "2026-12-05T11:44:06.432000Z");
        assert!(v["maybe"].is_null());
        let whole = serde_json::to_value(T {
            at: at(1_796_471_046_000),
            maybe: Some(at(1_796_471_046_000)),
        })
        .expect("json");
        assert_eq!(whole["maybe"], "2026-12-05T11:44:06.000000Z");
    }

    fn nested(n: usize) -> String {
        format!("{}{}", "[".repeat(n), "]".repeat(n))
    }

    #[test]
    fn depth_counts_brackets_outside_strings() {
        let table = [
            ("1", 0),
            ("[]", 1),
            (r#"{"a": [1, {"b": []}]}"#, 4),
            (r#"["[[[", "\"[[", {"k]": "}}}"}]"#, 2),
            (r#"["\\", [[]]]"#, 3),
        ];
        for (text, want) in table {
            assert_eq!(depth(text.as_bytes()), want, "{text}");
        }
    }

    #[test]
    fn parses_as_deep_as_asked_and_refuses_deeper_without_recursing() {
        // serde_json alone stops at 127
        assert!(serde_json::from_str::<Value>(&nested(128)).is_err());
        assert!(parse_bounded(nested(128).as_bytes(), 128).is_ok());
        match parse_bounded(nested(129).as_bytes(), 128) {
            Err(
                e @ ParseError::TooDeep {
                    depth: 129,
                    max: 128,
                },
            ) => {
                assert!(e.to_string().contains("nested 129 levels deep"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        // a million levels: refused by the scan, no stack overflow
        assert!(matches!(
            parse_bounded(nested(1_000_000).as_bytes(), 256),
            Err(ParseError::TooDeep { .. })
        ));
        // the usual errors stay serde_json's, also past its depth limit
        assert!(matches!(parse_bounded(b"[1,", 8), Err(ParseError::Json(_))));
        // a key twice in one object is named where it comes again; the same
        // key in two objects, or in a string, is not a duplicate
        assert_eq!(
            duplicate_key(br#"{"a": {"x": 1, "y": 1.5e400}, "b": [{"x": 2}, {"x": 3, "x": 4}]}"#)
                .as_deref(),
            Some("duplicate key \"x\" at line 1 column 58")
        );
        assert_eq!(
            duplicate_key(br#"{"a": {"a": "a,\"a\": 1"}, "b": [1, 2]}"#),
            None
        );
        let long = "k".repeat(5000);
        let twice = format!(r#"{{"{long}": 1, "{long}": 2}}"#);
        assert_eq!(
            duplicate_key(twice.as_bytes()),
            Some(format!(
                "duplicate key \"{}… (5000 characters)\" at line 1 column 10010",
                "k".repeat(24)
            ))
        );
        assert_eq!(short("12345"), "12345");
        assert!(matches!(
            parse_bounded(b"{\"a\": 1} x", 8),
            Err(ParseError::Json(_))
        ));
        let trailing = format!("{} x", nested(200));
        assert!(matches!(
            parse_bounded(trailing.as_bytes(), 256),
            Err(ParseError::Json(_))
        ));
        assert_eq!(
            parse_bounded(br#"{"a": [1, 2]}"#, 128).expect("plain"),
            serde_json::json!({"a": [1, 2]})
        );
    }

    #[test]
    fn what_postgres_cannot_hold_is_found_with_its_path_and_cleaned() {
        let table = [
            ("1", true),
            ("-1.5e3", true),
            ("0.000001", true),
            ("1e131071", true),
            ("1e131072", false),
            ("1e999999", false),
            ("1e-16383", true),
            ("1e-16384", false),
            ("1.5e-16383", false),
            ("1e-1000000", false),
            ("0e-1000000", false),
            ("0.0", true),
            ("12e131070", true),
            ("12e131071", false),
            ("0.00012e131073", true),
            ("-0.5e-16382", true),
            ("0e-16384", false),
            ("1e99999999999999999999", false),
        ];
        for (text, ok) in table {
            assert_eq!(numeric_can_hold(text), ok, "{text}");
        }
        let v = parse_bounded(br#"{"a": [1, {"n": 1e999999}], "b": 2}"#, 8).expect("parse");
        let (path, what) = unstorable(&v, "steps[0].input").expect("found");
        assert_eq!(path, "steps[0].input.a[1].n");
        // serde_json keeps the digits, and writes the exponent with its sign
        let Unstorable::Number(text) = what else {
            panic!("{what:?}")
        };
        assert_eq!(text.replace('+', ""), "1e999999");
        assert_eq!(unstorable(&serde_json::json!({"a": 1.5}), "x"), None);
        // a NUL in a string or a key; the root's keys bare
        assert_eq!(
            unstorable(&serde_json::json!({"a": ["x\0"]}), ""),
            Some(("a[0]".into(), Unstorable::Nul))
        );
        assert_eq!(
            unstorable(&serde_json::json!({"b": {"k\0": 1}}), "spec"),
            Some(("spec.b.k\u{0}".into(), Unstorable::Nul))
        );
        assert_eq!(
            storable(v),
            serde_json::json!({"a": [1, {"n": text}], "b": 2})
        );
        assert_eq!(
            storable(serde_json::json!({"k\0": "a\0b"})),
            serde_json::json!({"k\u{fffd}": "a\u{fffd}b"})
        );
    }
}
