//! Secrets: which ones a step may receive, where their values come from, and
//! redaction of every value handed out (and of credentials in connection
//! strings) from whatever the supervisor persists or logs.
//!
//! - A step names secrets; it receives only those its executor's
//!   `[[executors]]` entry lists in `secrets = [...]`. Anything else fails the
//!   step before spawn, non-retryably ([`SecretError::NotAllowed`],
//!   `SECRET_NOT_ALLOWED`). An allowed secret this worker cannot produce is
//!   [`SecretError::Unavailable`] (`SECRET_UNAVAILABLE`): a refusal, so that
//!   another worker may run the step.
//! - Values come from the worker's environment or, when the worker config sets
//!   `secrets_dir`, from the file `<secrets_dir>/<NAME>` (one trailing newline
//!   stripped, as Docker and Kubernetes mount secrets). Never both.
//! - A [`Redactor`] built from the values handed out to one attempt replaces
//!   each of them with `[REDACTED:<NAME>]`, and independently redacts
//!   credentials in URLs (`scheme://user:PASSWORD@host`, `?password=…`) and in
//!   `key=value` DSNs (`host=h password=pw`). See [`Redactor`] for the rules.
//!
//! Everything here is pure apart from reading the environment and the secret
//! files in [`resolve`].

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::path::Path;

/// The longest secret name (the same rule as `durable.submit_run`).
pub const NAME_MAX_LEN: usize = 128;

/// What marks a text cut short: evidence's first bytes, a stderr line over
/// its length (`…` at the end), the last bytes of a stream (`…` first).
const CUT: &str = "…";

/// Values shorter than this (in bytes) are not redacted as substrings: a
/// secret `"1"` would turn every `1` in every message into a marker and make
/// the text unreadable while protecting nothing (a 3-byte value can be guessed
/// anyway). Such a value is still redacted where a whole string (a JSON
/// string, a message, a key) equals it. [`Redactor::short_names`] lists them so
/// the worker can warn.
pub const MIN_REDACT_LEN: usize = 4;

/// A secret file larger than this is refused (`SECRET_UNAVAILABLE`).
pub const MAX_SECRET_FILE_BYTES: u64 = 1024 * 1024;

/// What a credential in a connection string is replaced with.
pub const REDACTED: &str = "[REDACTED]";

/// `^[A-Za-z_][A-Za-z0-9_]{0,127}$`: the names a step, a spec's
/// `{"$secret": NAME}` and a worker config may use.
pub fn is_valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    match b.first() {
        Some(&c) if c.is_ascii_alphabetic() || c == b'_' => {
            b.len() <= NAME_MAX_LEN && b.iter().all(|&c| c.is_ascii_alphanumeric() || c == b'_')
        }
        _ => false,
    }
}

/// Why a step cannot have the secrets it names on this worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The executor's config does not list the name: the step fails before
    /// spawn, non-retryably (`SECRET_NOT_ALLOWED`).
    #[error(
        "secret {name:?} is not allowed for {}: to allow it, add {name:?} to `secrets = [...]` of {} in the worker config",
        executor_phrase(.executor),
        entry_phrase(.executor)
    )]
    NotAllowed {
        name: String,
        /// The `[[executors]]` entry's name; filled by [`resolve_for`] and
        /// [`SecretError::for_executor`].
        executor: Option<String>,
    },
    /// Allowed, but this worker cannot produce it (not set, no file, not
    /// readable): a refusal, another worker may run the step
    /// (`SECRET_UNAVAILABLE`). Never carries the value.
    #[error("secret {name:?} is allowed but unavailable on this worker: {location} {reason}")]
    Unavailable {
        name: String,
        /// `environment variable NAME` or `file <secrets_dir>/NAME`.
        location: String,
        /// e.g. `is not set`, `does not exist`.
        reason: String,
    },
}

fn executor_phrase(executor: &Option<String>) -> String {
    match executor {
        Some(e) => format!("executor {e:?}"),
        None => "this executor".to_owned(),
    }
}

fn entry_phrase(executor: &Option<String>) -> String {
    match executor {
        Some(e) => format!("the [[executors]] entry named {e:?}"),
        None => "its [[executors]] entry".to_owned(),
    }
}

impl SecretError {
    /// The stable error code the step fails (or is refused) with.
    pub fn code(&self) -> &'static str {
        match self {
            SecretError::NotAllowed { .. } => "SECRET_NOT_ALLOWED",
            SecretError::Unavailable { .. } => "SECRET_UNAVAILABLE",
        }
    }

    /// True when the step should go back to the queue with its attempt given
    /// back (another worker may have the secret); false when it must fail,
    /// non-retryably.
    pub fn is_refusal(&self) -> bool {
        matches!(self, SecretError::Unavailable { .. })
    }

    /// The secret's name.
    pub fn name(&self) -> &str {
        match self {
            SecretError::NotAllowed { name, .. } | SecretError::Unavailable { name, .. } => name,
        }
    }

    /// Names the executor in a `NotAllowed` message.
    pub fn for_executor(self, executor_name: &str) -> SecretError {
        match self {
            SecretError::NotAllowed { name, .. } => SecretError::NotAllowed {
                name,
                executor: Some(executor_name.to_owned()),
            },
            other => other,
        }
    }
}

/// Resolves the secrets a step names, allowing only `allowed` (the
/// executor's `secrets = [...]`). Every name is checked against the allowlist
/// before any value is read; duplicates are resolved once.
///
/// With `secrets_dir`, a value is the content of `<secrets_dir>/<NAME>` (a
/// regular file or a link to one, UTF-8, at most [`MAX_SECRET_FILE_BYTES`],
/// one trailing `\n` or `\r\n` stripped); without it, the worker's environment
/// variable of that name.
pub fn resolve(
    step_secrets: &[String],
    allowed: &[String],
    secrets_dir: Option<&Path>,
) -> Result<BTreeMap<String, String>, SecretError> {
    resolve_with(step_secrets, allowed, secrets_dir, &|name| {
        std::env::var(name)
    })
}

/// [`resolve`] for one `[[executors]]` entry: its allowlist, and its name in
/// the error.
pub fn resolve_for(
    executor: &crate::config::ExecutorConfig,
    step_secrets: &[String],
    secrets_dir: Option<&Path>,
) -> Result<BTreeMap<String, String>, SecretError> {
    resolve(step_secrets, &executor.secrets, secrets_dir)
        .map_err(|e| e.for_executor(&executor.name))
}

type GetEnv<'a> = &'a dyn Fn(&str) -> Result<String, std::env::VarError>;

fn resolve_with(
    step_secrets: &[String],
    allowed: &[String],
    secrets_dir: Option<&Path>,
    getenv: GetEnv<'_>,
) -> Result<BTreeMap<String, String>, SecretError> {
    // a name that is not a valid name is never allowed: it could not be in a
    // validated config, and it must not become a path under secrets_dir
    if let Some(name) = step_secrets
        .iter()
        .find(|n| !is_valid_name(n) || !allowed.iter().any(|a| a == *n))
    {
        return Err(SecretError::NotAllowed {
            name: name.clone(),
            executor: None,
        });
    }
    let mut out = BTreeMap::new();
    for name in step_secrets {
        if out.contains_key(name) {
            continue;
        }
        let value = match secrets_dir {
            Some(dir) => read_secret_file(name, &dir.join(name))?,
            None => {
                let unavailable = |reason: &str| SecretError::Unavailable {
                    name: name.clone(),
                    location: format!("environment variable {name}"),
                    reason: reason.to_owned(),
                };
                match getenv(name) {
                    Ok(v) => v,
                    Err(std::env::VarError::NotPresent) => {
                        return Err(unavailable("is not set in the worker's environment"))
                    }
                    // the value itself is never put in the message
                    Err(std::env::VarError::NotUnicode(_)) => {
                        return Err(unavailable("is not valid UTF-8"))
                    }
                }
            }
        };
        out.insert(name.clone(), value);
    }
    Ok(out)
}

fn read_secret_file(name: &str, path: &Path) -> Result<String, SecretError> {
    let unavailable = |reason: String| SecretError::Unavailable {
        name: name.to_owned(),
        location: format!("file {}", path.display()),
        reason,
    };
    let io_reason = |e: &std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => "does not exist".to_owned(),
        std::io::ErrorKind::PermissionDenied => {
            "cannot be read by this worker (permission denied)".to_owned()
        }
        _ => format!("cannot be read: {e}"),
    };
    // follows links: Kubernetes mounts secrets as links into ..data/
    let meta = std::fs::metadata(path).map_err(|e| unavailable(io_reason(&e)))?;
    if !meta.is_file() {
        // a directory, a FIFO (which would block), a device
        return Err(unavailable("is not a regular file".into()));
    }
    let too_large = || unavailable(format!("is larger than {MAX_SECRET_FILE_BYTES} bytes"));
    if meta.len() > MAX_SECRET_FILE_BYTES {
        return Err(too_large());
    }
    let file = std::fs::File::open(path).map_err(|e| unavailable(io_reason(&e)))?;
    let mut buf = Vec::new();
    file.take(MAX_SECRET_FILE_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| unavailable(io_reason(&e)))?;
    if buf.len() as u64 > MAX_SECRET_FILE_BYTES {
        return Err(too_large());
    }
    let mut value = String::from_utf8(buf).map_err(|_| unavailable("is not valid UTF-8".into()))?;
    if value.ends_with('\n') {
        value.pop();
        if value.ends_with('\r') {
            value.pop();
        }
    }
    Ok(value)
}

/// One string to find and what replaces it.
#[derive(Clone)]
struct Needle {
    text: String,
    marker: String,
}

/// Redacts the secret values handed out to one attempt, and credentials in
/// connection strings, from text and JSON.
///
/// Rules, in order:
/// 1. Every handed-out value of at least [`MIN_REDACT_LEN`] bytes, and its
///    JSON-escaped and percent-encoded forms, is replaced wherever it occurs
///    by `[REDACTED:<NAME>]`, scanning left to right and taking the longest
///    value at each position. A shorter non-empty value is replaced only where
///    it is the whole string. An empty value is never redacted.
/// 2. Credentials in connection strings, whatever their value (also with
///    [`Redactor::none`]), become `[REDACTED]`:
///    - URL userinfo passwords: `postgres://u:pw@h/db` → `postgres://u:[REDACTED]@h/db`
///      (the last `@` before a space, a quote, `<`, `>` or a backtick);
///    - query parameters after `?` or `&` whose key is sensitive
///      (`password`, `pwd`, `pass`, `secret`, `token`, `api_key`, `apikey`,
///      `access_token`, … case-insensitive; see `is_sensitive_key`), up to
///      `&`, `#`, a space or a quote;
///    - `key = value` pairs (libpq conninfo, `--password=…`, `PGPASSWORD=…`)
///      with a sensitive key: a quoted value (`'a b'`, `"a b"`, with `\`
///      escapes) or an unquoted one up to the next whitespace. Values that
///      are already a marker are kept.
/// 3. If the result still contains a value (a value that overlaps the text
///    of a marker, say), the whole string is replaced by `[REDACTED]` (or
///    `***`, or nothing, whichever contains no value). The output never
///    contains a handed-out value of at least [`MIN_REDACT_LEN`] bytes.
///
/// Cut points are ASCII bytes or the ends of valid UTF-8 values, so the
/// output is always valid UTF-8. `Debug` prints secret names only.
#[derive(Clone)]
pub struct Redactor {
    /// Longest first.
    needles: Vec<Needle>,
    /// Which bytes start a needle.
    first: [bool; 256],
    /// Non-empty values shorter than MIN_REDACT_LEN: whole strings only.
    short: Vec<Needle>,
    names: Vec<String>,
    short_names: Vec<String>,
}

impl fmt::Debug for Redactor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redactor")
            .field("names", &self.names)
            .field("short_names", &self.short_names)
            .finish()
    }
}

impl Default for Redactor {
    fn default() -> Self {
        Redactor::none()
    }
}

impl Redactor {
    /// No handed-out values: only connection-string credentials are redacted.
    pub fn none() -> Redactor {
        Redactor {
            needles: Vec::new(),
            first: [false; 256],
            short: Vec::new(),
            names: Vec::new(),
            short_names: Vec::new(),
        }
    }

    /// From the secrets handed out to one attempt (name → value), as
    /// returned by [`resolve`].
    pub fn new(secrets: &BTreeMap<String, String>) -> Redactor {
        Redactor::from_pairs(secrets.iter().map(|(n, v)| (n.as_str(), v.as_str())))
    }

    /// From (name, value) pairs, where a name may come more than once with
    /// different values: what one persistent process was handed over all
    /// its jobs (a secret rotated between two of them is both values).
    pub fn from_pairs<'a>(secrets: impl IntoIterator<Item = (&'a str, &'a str)>) -> Redactor {
        let mut r = Redactor::none();
        for (name, value) in secrets {
            if !r.names.iter().any(|n| n == name) {
                r.names.push(name.to_owned());
            }
            if value.is_empty() {
                continue;
            }
            let marker = if is_valid_name(name) {
                format!("[REDACTED:{name}]")
            } else {
                REDACTED.to_owned()
            };
            if value.len() < MIN_REDACT_LEN {
                if !r.short_names.iter().any(|n| n == name) {
                    r.short_names.push(name.to_owned());
                }
                if !r.short.iter().any(|n| n.text == value) {
                    r.short.push(Needle {
                        text: value.to_owned(),
                        marker,
                    });
                }
                continue;
            }
            for text in variants(value) {
                if !r.needles.iter().any(|n| n.text == text) {
                    r.first[usize::from(text.as_bytes()[0])] = true;
                    r.needles.push(Needle {
                        text,
                        marker: marker.clone(),
                    });
                }
            }
        }
        r.needles.sort_by(|a, b| {
            b.text
                .len()
                .cmp(&a.text.len())
                .then_with(|| a.text.cmp(&b.text))
        });
        r
    }

    /// The names of the secrets this redactor was built from.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Names whose values are shorter than [`MIN_REDACT_LEN`] and so are
    /// redacted only as whole strings (worth a warning).
    pub fn short_names(&self) -> &[String] {
        &self.short_names
    }

    /// Redacts one string (rules in the type's documentation).
    pub fn redact_str<'a>(&self, s: &'a str) -> Cow<'a, str> {
        let values = self.replace_values(s);
        let values = match self.replace_cut_values(values.as_deref().unwrap_or(s)) {
            Some(c) => Some(c),
            None => values,
        };
        let text = values.as_deref().unwrap_or(s);
        let out = match redact_credentials(text) {
            Some(c) => Some(c),
            None => values,
        };
        let leaks = self.leaks(out.as_deref().unwrap_or(s));
        match (leaks, out) {
            (true, _) => Cow::Owned(self.fallback().to_owned()),
            (false, Some(o)) => Cow::Owned(o),
            (false, None) => Cow::Borrowed(s),
        }
    }

    /// [`Redactor::redact_str`] in place.
    pub fn redact_in_place(&self, s: &mut String) {
        if let Cow::Owned(o) = self.redact_str(s) {
            *s = o;
        }
    }

    /// [`Redactor::redact_str`] for an owned string.
    pub fn redact_string(&self, mut s: String) -> String {
        self.redact_in_place(&mut s);
        s
    }

    /// Redacts every string in a JSON value, object keys included. A number
    /// whose text contains a value becomes a redacted string. Two keys that
    /// become equal are kept apart with a `#2`, `#3`, … suffix.
    pub fn redact_json(&self, v: &mut serde_json::Value) {
        use serde_json::Value;
        match v {
            Value::String(s) => self.redact_in_place(s),
            Value::Number(n) => {
                let text = n.to_string();
                if let Cow::Owned(o) = self.redact_str(&text) {
                    *v = Value::String(o);
                } else if let Some(stored) = crate::json::stored_spelling(&text) {
                    // `jsonb` stores the number in its own spelling: a value
                    // spelled out there is a value stored (security audit:
                    // 1.2345678e7 was stored as the secret 12345678)
                    if let Cow::Owned(o) = self.redact_str(&stored) {
                        *v = Value::String(o);
                    }
                }
            }
            Value::Array(items) => {
                for item in items {
                    self.redact_json(item);
                }
            }
            Value::Object(map) => {
                if map
                    .keys()
                    .any(|k| matches!(self.redact_str(k), Cow::Owned(_)))
                {
                    let old = std::mem::take(map);
                    let len = old.len();
                    for (k, val) in old {
                        let key = self.redact_string(k);
                        if !map.contains_key(&key) {
                            map.insert(key, val);
                            continue;
                        }
                        // bounded: len + 1 distinct suffixes cannot all be taken;
                        // an entry that still finds no key is dropped, never leaked
                        for i in 2..len + 3 {
                            let candidate = self.redact_string(format!("{key}#{i}"));
                            if !map.contains_key(&candidate) {
                                map.insert(candidate, val);
                                break;
                            }
                        }
                    }
                }
                for val in map.values_mut() {
                    self.redact_json(val);
                }
            }
            Value::Null | Value::Bool(_) => {}
        }
    }

    /// Replaces handed-out values in bytes that may not be text (a
    /// checkpoint, a stderr tail): rule 1 only, since the connection-string
    /// rules could break a binary or JSON payload; a short value only when it
    /// is all of `b`.
    pub fn redact_bytes<'a>(&self, b: &'a [u8]) -> Cow<'a, [u8]> {
        if let Some(n) = self.short.iter().find(|n| n.text.as_bytes() == b) {
            return Cow::Owned(n.marker.as_bytes().to_vec());
        }
        let mut out: Option<Vec<u8>> = None;
        let (mut last, mut i) = (0, 0);
        while let Some((at, n)) = self.find(b, i) {
            let o = out.get_or_insert_with(|| Vec::with_capacity(b.len()));
            o.extend_from_slice(&b[last..at]);
            o.extend_from_slice(n.marker.as_bytes());
            i = at + n.text.len();
            last = i;
        }
        let Some(mut o) = out else {
            return Cow::Borrowed(b);
        };
        o.extend_from_slice(&b[last..]);
        if self.find(&o, 0).is_some() {
            return Cow::Owned(self.fallback().as_bytes().to_vec());
        }
        Cow::Owned(o)
    }

    /// The first needle at or after `from`, longest at its position.
    fn find(&self, b: &[u8], from: usize) -> Option<(usize, &Needle)> {
        if self.needles.is_empty() {
            return None;
        }
        let mut i = from;
        while i < b.len() {
            if self.first[usize::from(b[i])] {
                let rest = &b[i..];
                if let Some(n) = self
                    .needles
                    .iter()
                    .find(|n| rest.starts_with(n.text.as_bytes()))
                {
                    return Some((i, n));
                }
            }
            i += 1;
        }
        None
    }

    /// Rule 1. `None`: nothing to replace.
    fn replace_values(&self, s: &str) -> Option<String> {
        if let Some(n) = self.short.iter().find(|n| n.text == s) {
            return Some(n.marker.clone());
        }
        let b = s.as_bytes();
        let mut out: Option<String> = None;
        let (mut last, mut i) = (0, 0);
        // a match starts at a char boundary (a needle is valid UTF-8, so its
        // first byte is not a continuation byte) and ends at one
        while let Some((at, n)) = self.find(b, i) {
            let o = out.get_or_insert_with(|| String::with_capacity(s.len()));
            o.push_str(s.get(last..at).unwrap_or_default());
            o.push_str(&n.marker);
            i = at + n.text.len();
            last = i;
        }
        let mut o = out?;
        o.push_str(s.get(last..).unwrap_or_default());
        Some(o)
    }

    /// Rule 1, for evidence cut short (`…` after the first bytes of a frame,
    /// `wire::first_bytes`): the start of a value, at least
    /// [`MIN_REDACT_LEN`] bytes of it, right before a `…` is replaced too. A
    /// value that straddled the cut was logged in part.
    fn replace_cut_values(&self, s: &str) -> Option<String> {
        if !s.contains(CUT) || self.needles.is_empty() {
            return None;
        }
        let mut out = String::with_capacity(s.len());
        let mut changed = false;
        // a text whose start was cut (the last bytes of a stream: `…` first)
        // may begin with the end of a value
        let mut rest = match s.strip_prefix(CUT) {
            Some(after) => {
                out.push_str(CUT);
                let tail = self.needles.iter().find_map(|n| {
                    (1..=n.text.len().saturating_sub(MIN_REDACT_LEN))
                        .filter(|&k| n.text.is_char_boundary(k))
                        .find(|&k| after.starts_with(&n.text[k..]))
                        .map(|k| (n.text.len() - k, &n.marker))
                });
                match tail {
                    Some((len, marker)) => {
                        out.push_str(marker);
                        changed = true;
                        &after[len..]
                    }
                    None => after,
                }
            }
            None => s,
        };
        while let Some(at) = rest.find(CUT) {
            let before = &rest[..at];
            let cut = self.needles.iter().find_map(|n| {
                (MIN_REDACT_LEN..n.text.len())
                    .rev()
                    .filter(|&k| n.text.is_char_boundary(k))
                    .find(|&k| before.ends_with(&n.text[..k]))
                    .map(|k| (k, &n.marker))
            });
            match cut {
                Some((k, marker)) => {
                    out.push_str(&before[..before.len() - k]);
                    out.push_str(marker);
                    changed = true;
                }
                None => out.push_str(before),
            }
            out.push_str(CUT);
            rest = &rest[at + CUT.len()..];
        }
        out.push_str(rest);
        changed.then_some(out)
    }

    fn leaks(&self, s: &str) -> bool {
        self.needles.iter().any(|n| s.contains(n.text.as_str()))
            || self.short.iter().any(|n| n.text == s)
    }

    fn fallback(&self) -> &'static str {
        [REDACTED, "***"]
            .into_iter()
            .find(|f| !self.leaks(f))
            .unwrap_or("")
    }
}

/// The forms a value is looked for in: as is, JSON-escaped (a value inside
/// JSON text that was logged), percent-encoded (a value in a URL), with its
/// bytes outside printable ASCII as `\xNN` (the evidence of an executor's
/// bytes, `wire::first_bytes`: a non-ASCII value was logged in that form,
/// unredacted), and with its backslashes doubled (a language's repr of a
/// string, such as a Python traceback's).
///
/// A value of several lines (a PEM key, a credentials file) is looked for
/// line by line too: a log line of an executor's stderr holds one of its
/// lines at a time, so only the lines could match there.
fn variants(value: &str) -> Vec<String> {
    let mut out = forms(value);
    if value.contains(['\n', '\r']) {
        for line in value.split(['\n', '\r']) {
            out.extend(forms(line));
        }
    }
    out.retain(|v| v.len() >= MIN_REDACT_LEN);
    out.sort();
    out.dedup();
    out
}

/// One string's forms for [`variants`].
fn forms(value: &str) -> Vec<String> {
    let mut out = vec![value.to_owned()];
    out.push(crate::wire::escape_bytes(value.as_bytes()));
    out.push(value.replace('\\', "\\\\"));
    if let Ok(quoted) = serde_json::to_string(value) {
        let inner = quoted
            .strip_prefix('"')
            .and_then(|q| q.strip_suffix('"'))
            .unwrap_or(&quoted);
        out.push(inner.to_owned());
    }
    let mut pct = String::with_capacity(value.len());
    for &c in value.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
            pct.push(char::from(c));
        } else {
            pct.push_str(&format!("%{c:02X}"));
        }
    }
    out.push(pct);
    out
}

/// `[REDACTED]` or `[REDACTED:NAME]`.
fn is_marker(s: &str) -> bool {
    s == REDACTED
        || s.strip_prefix("[REDACTED:")
            .and_then(|r| r.strip_suffix(']'))
            .is_some_and(is_valid_name)
}

/// Keys whose values are credentials (lowercase, leading `-` ignored).
fn is_sensitive_key(key: &str) -> bool {
    let k = key.trim_start_matches('-').to_ascii_lowercase();
    const SUFFIXES: [&str; 11] = [
        "password",
        "passwd",
        "secret",
        "token",
        "api_key",
        "apikey",
        "api-key",
        "private_key",
        "access_key",
        "secret_key",
        "_pwd",
    ];
    k == "pwd" || k == "pass" || SUFFIXES.iter().any(|s| k.ends_with(s))
}

fn is_key_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')
}

fn is_quote_or_angle(c: u8) -> bool {
    matches!(c, b'"' | b'\'' | b'<' | b'>' | b'`')
}

/// Rule 2. `None`: nothing to redact.
fn redact_credentials(s: &str) -> Option<String> {
    if !s.contains("://") && !s.contains('=') {
        return None;
    }
    let mut spans = Vec::new();
    url_password_spans(s, &mut spans);
    key_value_spans(s, &mut spans);
    if spans.is_empty() {
        return None;
    }
    Some(replace_spans(s, spans))
}

/// Keeps `start..end` of `s` as a span to redact, unless it is empty or
/// (quotes aside) already a redaction marker.
fn keep_span(s: &str, start: usize, end: usize, spans: &mut Vec<(usize, usize)>) {
    let inner = s.get(start..end).unwrap_or_default();
    let unquoted = inner
        .strip_prefix(['\'', '"'])
        .map(|i| i.strip_suffix(['\'', '"']).unwrap_or(i))
        .unwrap_or(inner);
    if start < end && !is_marker(unquoted) {
        spans.push((start, end));
    }
}

/// URL userinfo: the PASSWORD of scheme://user:PASSWORD@host.
fn url_password_spans(s: &str, spans: &mut Vec<(usize, usize)>) {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(p) = s.get(from..).and_then(|r| r.find("://")) {
        let auth = from + p + 3;
        from = auth;
        let mut end = auth;
        while end < b.len() && !b[end].is_ascii_whitespace() && !is_quote_or_angle(b[end]) {
            if b[end..].starts_with(b"://") {
                break;
            }
            end += 1;
        }
        let at = match b[auth..end].iter().rposition(|&c| c == b'@') {
            Some(at) => at,
            // a URL cut short (`…`) before its `@`: what follows the
            // user's `:` up to the cut may be the start of the password
            None => match s.get(auth..end).and_then(|seg| seg.find(CUT)) {
                Some(cut) => cut,
                None => continue,
            },
        };
        let userinfo = &b[auth..auth + at];
        let Some(colon) = userinfo.iter().position(|&c| c == b':') else {
            continue;
        };
        if userinfo[..colon].iter().any(|c| b"/?#".contains(c)) {
            continue; // the ':' is in a path, not in userinfo
        }
        keep_span(s, auth + colon + 1, auth + at, spans);
    }
}

/// key=value with a sensitive key: query parameters and DSN pairs.
fn key_value_spans(s: &str, spans: &mut Vec<(usize, usize)>) {
    let b = s.as_bytes();
    for (eq, _) in s.match_indices('=') {
        let mut key_end = eq;
        while key_end > 0 && matches!(b[key_end - 1], b' ' | b'\t') {
            key_end -= 1;
        }
        let mut key_start = key_end;
        while key_start > 0 && is_key_char(b[key_start - 1]) {
            key_start -= 1;
        }
        if key_start == key_end || !is_sensitive_key(s.get(key_start..key_end).unwrap_or_default())
        {
            continue;
        }
        let in_query = key_start > 0 && matches!(b[key_start - 1], b'?' | b'&');
        if in_query {
            if key_end != eq {
                continue; // no spaces in a query string
            }
            keep_span(s, eq + 1, query_value_end(b, eq + 1), spans);
            continue;
        }
        // libpq skips whitespace after '='
        let mut start = eq + 1;
        while start < b.len() && matches!(b[start], b' ' | b'\t') {
            start += 1;
        }
        if start >= b.len() {
            continue;
        }
        keep_span(s, start, dsn_value_end(b, start), spans);
    }
}

/// Where a query parameter's value that starts at `start` ends.
fn query_value_end(b: &[u8], start: usize) -> usize {
    let mut end = start;
    while end < b.len()
        && !matches!(b[end], b'&' | b'#')
        && !b[end].is_ascii_whitespace()
        && !is_quote_or_angle(b[end])
    {
        end += 1;
    }
    end
}

/// Where a DSN value that starts at `start` ends: after its closing quote
/// (an unterminated quote runs to the end), or at the next whitespace.
fn dsn_value_end(b: &[u8], start: usize) -> usize {
    if matches!(b[start], b'\'' | b'"') {
        let quote = b[start];
        let mut j = start + 1;
        while j < b.len() && b[j] != quote {
            j += if b[j] == b'\\' { 2 } else { 1 };
        }
        (j + 1).min(b.len())
    } else {
        let mut j = start;
        while j < b.len() && !b[j].is_ascii_whitespace() {
            j += 1;
        }
        j
    }
}

/// `s` with each of `spans` (overlapping ones merged) replaced by the marker.
fn replace_spans(s: &str, mut spans: Vec<(usize, usize)>) -> String {
    spans.sort_unstable();
    let mut out = String::with_capacity(s.len());
    let mut last = 0;
    let mut i = 0;
    while i < spans.len() {
        let (start, mut end) = spans[i];
        i += 1;
        while i < spans.len() && spans[i].0 <= end {
            end = end.max(spans[i].1);
            i += 1;
        }
        if start < last {
            continue;
        }
        out.push_str(s.get(last..start).unwrap_or_default());
        out.push_str(REDACTED);
        last = end;
    }
    out.push_str(s.get(last..).unwrap_or_default());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A number is checked as `jsonb` will spell it, too
    /// (`json::stored_spelling`).
    #[test]
    fn a_number_is_checked_as_it_will_be_stored() {
        let r = Redactor::new(&BTreeMap::from([("NUM".to_owned(), "12345678".to_owned())]));
        let mut v: serde_json::Value =
            serde_json::from_str(r#"{"e": 1.2345678e7, "n": 12345678, "x": 1.5e3}"#).expect("json");
        r.redact_json(&mut v);
        assert_eq!(v["e"], "[REDACTED:NUM]");
        assert_eq!(v["n"], "[REDACTED:NUM]");
        assert!(v["x"].is_number(), "{v}");
    }
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Result<String, std::env::VarError> {
        let vars: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            vars.get(name)
                .cloned()
                .ok_or(std::env::VarError::NotPresent)
        }
    }

    fn redactor(pairs: &[(&str, &str)]) -> Redactor {
        Redactor::new(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    /// A text cut short is marked `…`: the first bytes of a value right
    /// before the mark, its last bytes right after a leading mark, and the
    /// start of a URL's password cut before its `@` are redacted.
    #[test]
    fn values_cut_by_a_limit_are_redacted_against_the_mark() {
        let r = redactor(&[("TOKEN", "tok-SUPERSECRET-123")]);
        assert_eq!(r.redact_str("AAAtok-SUPERSECRE…"), "AAA[REDACTED:TOKEN]…");
        assert_eq!(r.redact_str("…UPERSECRET-123YYYY"), "…[REDACTED:TOKEN]YYYY");
        assert_eq!(r.redact_str("…YYYY"), "…YYYY");
        assert_eq!(
            Redactor::none().redact_str("AAA postgres://bob:HunterPW…"),
            "AAA postgres://bob:[REDACTED]…"
        );
        assert_eq!(
            Redactor::none().redact_str("see https://example.com/a…"),
            "see https://example.com/a…"
        );
    }

    /// What a persistent process was handed over its jobs: a name may come
    /// with two values (rotated between jobs); both are redacted.
    #[test]
    fn pairs_with_a_rotated_value_redact_both() {
        let r = Redactor::from_pairs([
            ("TOKEN", "first-value-0123"),
            ("TOKEN", "second-value-4567"),
            ("PIN", "12"),
            ("PIN", "12"),
        ]);
        assert_eq!(r.names(), ["TOKEN", "PIN"]);
        assert_eq!(r.short_names(), ["PIN"]);
        assert_eq!(
            r.redact_str("a first-value-0123 b second-value-4567"),
            "a [REDACTED:TOKEN] b [REDACTED:TOKEN]"
        );
        assert_eq!(r.redact_str("12"), "[REDACTED:PIN]");
    }

    #[test]
    fn secret_names() {
        let long = format!("A{}", "b".repeat(127));
        let too_long = format!("A{}", "b".repeat(128));
        for (name, ok) in [
            ("REPORT_API_TOKEN", true),
            ("_x", true),
            ("a1", true),
            (long.as_str(), true),
            ("", false),
            ("1A", false),
            ("A-B", false),
            ("A.B", false),
            ("../etc/passwd", false),
            ("A B", false),
            ("Ä", false),
            (too_long.as_str(), false),
        ] {
            assert_eq!(is_valid_name(name), ok, "{name:?}");
        }
    }

    #[test]
    fn resolve_from_the_environment() {
        let getenv = env(&[
            ("A", "alpha"),
            ("B", "beta\n"),
            ("DATABASE_URL", "postgres://x"),
        ]);
        struct Case {
            step: &'static [&'static str],
            allowed: &'static [&'static str],
            want: Result<&'static [(&'static str, &'static str)], &'static str>,
        }
        let cases = [
            Case {
                step: &[],
                allowed: &[],
                want: Ok(&[]),
            },
            Case {
                step: &["A"],
                allowed: &["A", "B"],
                want: Ok(&[("A", "alpha")]),
            },
            // the environment's value as is: no newline stripping there
            Case {
                step: &["B", "A", "B"],
                allowed: &["A", "B"],
                want: Ok(&[("A", "alpha"), ("B", "beta\n")]),
            },
            // the issue: a submitter naming the worker's own database URL
            Case {
                step: &["DATABASE_URL"],
                allowed: &["A"],
                want: Err("SECRET_NOT_ALLOWED"),
            },
            Case {
                step: &["A"],
                allowed: &[],
                want: Err("SECRET_NOT_ALLOWED"),
            },
            Case {
                step: &["a"],
                allowed: &["A"],
                want: Err("SECRET_NOT_ALLOWED"),
            },
            Case {
                step: &["../A"],
                allowed: &["../A"],
                want: Err("SECRET_NOT_ALLOWED"),
            },
            Case {
                step: &["C"],
                allowed: &["C"],
                want: Err("SECRET_UNAVAILABLE"),
            },
            // the allowlist is checked for every name before anything is read
            Case {
                step: &["C", "DATABASE_URL"],
                allowed: &["C"],
                want: Err("SECRET_NOT_ALLOWED"),
            },
        ];
        for c in cases {
            let got = resolve_with(&names(c.step), &names(c.allowed), None, &getenv);
            match (got, c.want) {
                (Ok(got), Ok(want)) => {
                    let want: BTreeMap<String, String> = want
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect();
                    assert_eq!(got, want, "{:?}", c.step);
                }
                (Err(e), Err(code)) => assert_eq!(e.code(), code, "{:?}: {e}", c.step),
                (got, want) => panic!("{:?}: got {got:?}, want {want:?}", c.step),
            }
        }
    }

    #[test]
    fn resolve_uses_the_real_environment() {
        let path = std::env::var("PATH").unwrap_or_default();
        let got = resolve(&names(&["PATH"]), &names(&["PATH"]), None).expect("PATH is set");
        assert_eq!(got["PATH"], path);
        let err = resolve(
            &names(&["DURABLE_TEST_SURELY_UNSET_7F3A"]),
            &names(&["DURABLE_TEST_SURELY_UNSET_7F3A"]),
            None,
        )
        .expect_err("unset");
        assert_eq!(err.code(), "SECRET_UNAVAILABLE");
    }

    #[test]
    fn resolve_from_secrets_dir() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        std::fs::write(d.join("NL"), "value\n").expect("write");
        std::fs::write(d.join("CRLF"), "value\r\n").expect("write");
        std::fs::write(d.join("TWO_NL"), "value\n\n").expect("write");
        std::fs::write(d.join("RAW"), "  spaced value ").expect("write");
        std::fs::write(d.join("EMPTY"), "").expect("write");
        std::fs::write(d.join("BINARY"), [0xff, 0xfe, 0x00]).expect("write");
        std::fs::create_dir(d.join("ADIR")).expect("mkdir");
        std::os::unix::fs::symlink(d.join("NL"), d.join("LINKED")).expect("symlink");
        std::fs::write(
            d.join("HUGE"),
            vec![b'x'; MAX_SECRET_FILE_BYTES as usize + 1],
        )
        .expect("write");
        // the environment is not consulted when secrets_dir is set
        let getenv = env(&[("ONLY_ENV", "from-env")]);
        let all = [
            "NL", "CRLF", "TWO_NL", "RAW", "EMPTY", "BINARY", "ADIR", "LINKED", "HUGE", "ONLY_ENV",
            "MISSING",
        ];
        for (name, want) in [
            ("NL", Ok("value")),
            ("CRLF", Ok("value")),
            ("TWO_NL", Ok("value\n")),
            ("RAW", Ok("  spaced value ")),
            ("EMPTY", Ok("")),
            ("LINKED", Ok("value")),
            ("BINARY", Err("is not valid UTF-8")),
            ("ADIR", Err("is not a regular file")),
            ("HUGE", Err("is larger than")),
            ("ONLY_ENV", Err("does not exist")),
            ("MISSING", Err("does not exist")),
        ] {
            let got = resolve_with(&names(&[name]), &names(&all), Some(d), &getenv);
            match (got, want) {
                (Ok(m), Ok(v)) => assert_eq!(m[name], v, "{name}"),
                (Err(e), Err(why)) => {
                    assert_eq!(e.code(), "SECRET_UNAVAILABLE", "{name}");
                    assert!(e.is_refusal());
                    let msg = e.to_string();
                    assert!(msg.contains(why), "{name}: {msg}");
                    assert!(msg.contains(&d.join(name).display().to_string()), "{msg}");
                }
                (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn error_messages_say_what_to_do() {
        let getenv = env(&[("SET", "hunter2-value")]);
        let e = resolve_with(&names(&["DATABASE_URL"]), &names(&["SET"]), None, &getenv)
            .expect_err("not allowed")
            .for_executor("go-demo");
        assert_eq!(e.code(), "SECRET_NOT_ALLOWED");
        assert!(!e.is_refusal());
        assert_eq!(e.name(), "DATABASE_URL");
        assert_eq!(
            e.to_string(),
            "secret \"DATABASE_URL\" is not allowed for executor \"go-demo\": to allow it, add \"DATABASE_URL\" to `secrets = [...]` of the [[executors]] entry named \"go-demo\" in the worker config"
        );
        let anon = SecretError::NotAllowed {
            name: "X".into(),
            executor: None,
        };
        assert!(
            anon.to_string().contains("of its [[executors]] entry"),
            "{anon}"
        );
        let e =
            resolve_with(&names(&["NOPE"]), &names(&["NOPE"]), None, &getenv).expect_err("unset");
        assert_eq!(
            e.to_string(),
            "secret \"NOPE\" is allowed but unavailable on this worker: environment variable NOPE is not set in the worker's environment"
        );
        let cfg = crate::config::ExecutorConfig {
            name: "py".into(),
            secrets: names(&["SET"]),
            ..Default::default()
        };
        let e = resolve_for(&cfg, &names(&["OTHER"]), None).expect_err("not allowed");
        assert!(e.to_string().contains("executor \"py\""), "{e}");
    }

    #[test]
    fn redacts_handed_out_values() {
        let r = redactor(&[
            ("TOKEN", "tok-123456"),
            ("LONGER", "tok-123456-and-more"),
            ("UNI", "pässwörd✓"),
            ("QUOTED", "a\"b\\c/d e"),
            ("SHORT", "abc"),
            ("EMPTY", ""),
        ]);
        for (input, want) in [
            ("nothing here", "nothing here"),
            ("t=tok-123456.", "t=[REDACTED:TOKEN]."),
            ("tok-123456tok-123456", "[REDACTED:TOKEN][REDACTED:TOKEN]"),
            // the longest value wins at a position
            ("x tok-123456-and-more y", "x [REDACTED:LONGER] y"),
            ("»pässwörd✓«", "»[REDACTED:UNI]«"),
            // JSON-escaped and percent-encoded forms
            (r#"{"v":"a\"b\\c/d e"}"#, r#"{"v":"[REDACTED:QUOTED]"}"#),
            ("a%22b%5Cc%2Fd%20e", "[REDACTED:QUOTED]"),
            // as a frame's evidence escapes bytes (a non-ASCII value was
            // logged this way in full), and with backslashes doubled (a
            // Python repr in a traceback)
            (
                r"first bytes: \x0a\x05p\xc3\xa4ssw\xc3\xb6rd\xe2\x9c\x93!",
                r"first bytes: \x0a\x05[REDACTED:UNI]!",
            ),
            (r#"'a"b\\c/d e'"#, "'[REDACTED:QUOTED]'"),
            // evidence cut in the middle of a value: its start is redacted
            // (named as the longest value it may be the start of)
            ("bytes: \\x05tok-1234…", "bytes: \\x05[REDACTED:LONGER]…"),
            (r"bytes: p\xc3\xa4ss…", r"bytes: [REDACTED:UNI]…"),
            // … but not fewer than MIN_REDACT_LEN bytes of it, nor a start
            // that is not right before the cut
            ("bytes: tok…", "bytes: tok…"),
            ("tok-1234 …", "tok-1234 …"),
            // a short value only as the whole string
            ("abc", "[REDACTED:SHORT]"),
            ("abcdef abc", "abcdef abc"),
            ("", ""),
        ] {
            assert_eq!(r.redact_str(input), want, "{input:?}");
        }
        assert_eq!(r.short_names(), ["SHORT".to_string()]);
        assert!(matches!(r.redact_str("nothing"), Cow::Borrowed(_)));
        let dbg = format!("{r:?}");
        assert!(
            dbg.contains("TOKEN") && !dbg.contains("tok-123456"),
            "{dbg}"
        );
    }

    #[test]
    fn redacts_connection_strings() {
        let r = Redactor::none();
        for (input, want) in [
            ("postgres://u:pw@h/db", "postgres://u:[REDACTED]@h/db"),
            ("postgresql://u:pw@h:5432/db?sslmode=require", "postgresql://u:[REDACTED]@h:5432/db?sslmode=require"),
            ("connect to postgres://u:p@ss@h/db failed", "connect to postgres://u:[REDACTED]@h/db failed"),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("postgres://u:@h/db", "postgres://u:@h/db"),
            ("https://h:8080/path", "https://h:8080/path"),
            ("https://h/a:b?e=x@y", "https://h/a:b?e=x@y"),
            (r#"{"url":"redis://:pw@h:6379","n":1}"#, r#"{"url":"redis://:[REDACTED]@h:6379","n":1}"#),
            ("a://u:p1@h b://v:p2@k", "a://u:[REDACTED]@h b://v:[REDACTED]@k"),
            ("postgres://h/db?user=u&password=pw&sslmode=x", "postgres://h/db?user=u&password=[REDACTED]&sslmode=x"),
            ("https://api/x?API_KEY=k1#frag", "https://api/x?API_KEY=[REDACTED]#frag"),
            ("?pwd=a&pass=b&secret=c&token=d&apikey=e&access_token=f&Password=g", "?pwd=[REDACTED]&pass=[REDACTED]&secret=[REDACTED]&token=[REDACTED]&apikey=[REDACTED]&access_token=[REDACTED]&Password=[REDACTED]"),
            ("?page=2&sort=name", "?page=2&sort=name"),
            ("host=h password=pw user=u", "host=h password=[REDACTED] user=u"),
            ("host=h password='a b' user=u", "host=h password=[REDACTED] user=u"),
            (r"password='it\'s x' user=u", "password=[REDACTED] user=u"),
            ("password = pw dbname=d", "password = [REDACTED] dbname=d"),
            ("password='never closed", "password=[REDACTED]"),
            ("PGPASSWORD=pw psql", "PGPASSWORD=[REDACTED] psql"),
            ("run --password=pw --db-token=t2 --port=5", "run --password=[REDACTED] --db-token=[REDACTED] --port=5"),
            ("sslpassword=x", "sslpassword=[REDACTED]"),
            ("password=", "password="),
            ("x == y, a=b", "x == y, a=b"),
            ("password=[REDACTED:PG]", "password=[REDACTED:PG]"),
            ("postgres://u:[REDACTED:PG]@h", "postgres://u:[REDACTED:PG]@h"),
            ("Ünïcödé password=pässwörd ✓", "Ünïcödé password=[REDACTED] ✓"),
        ] {
            assert_eq!(r.redact_str(input), want, "{input:?}");
        }
    }

    #[test]
    fn a_value_in_a_dsn_keeps_its_name() {
        let r = redactor(&[("PG_PASSWORD", "s3cr3t-pw")]);
        assert_eq!(
            r.redact_str("postgres://u:s3cr3t-pw@h/db host=h password=s3cr3t-pw"),
            "postgres://u:[REDACTED:PG_PASSWORD]@h/db host=h password=[REDACTED:PG_PASSWORD]"
        );
    }

    #[test]
    fn a_value_that_overlaps_a_marker_is_still_gone() {
        // "ACTED" is inside "[REDACTED:X]" and "[REDACTED]"
        let r = redactor(&[("X", "ACTED")]);
        for input in ["ACTED", "xACTEDx", "a ACTED b"] {
            let out = r.redact_str(input);
            assert!(!out.contains("ACTED"), "{input:?} -> {out:?}");
        }
        let out = r.redact_bytes(b"xACTEDx");
        assert!(!out.windows(5).any(|w| w == b"ACTED"), "{out:?}");
    }

    #[test]
    fn redacts_json_everywhere() {
        let r = redactor(&[
            ("TOKEN", "tok-123456"),
            ("NUM", "98765432"),
            ("SHORT", "ab"),
        ]);
        let mut v = json!({
            "out": "got tok-123456",
            "tok-123456": {"nested": ["postgres://u:pw@h/db", "ab", "abc", 98765432, 1.5, true, null]},
            "n": 1198765432
        });
        r.redact_json(&mut v);
        assert_eq!(
            v,
            json!({
                "out": "got [REDACTED:TOKEN]",
                "[REDACTED:TOKEN]": {"nested": ["postgres://u:[REDACTED]@h/db", "[REDACTED:SHORT]", "abc", "[REDACTED:NUM]", 1.5, true, null]},
                "n": "11[REDACTED:NUM]"
            })
        );
    }

    #[test]
    fn keys_that_become_equal_are_kept_apart() {
        let r = redactor(&[("TOKEN", "tok-123456")]);
        let mut v = json!({"k tok-123456": 1, "k [REDACTED:TOKEN]": 2, "other": 4});
        r.redact_json(&mut v);
        let map = v.as_object().expect("object");
        let mut keys: Vec<&str> = map.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["k [REDACTED:TOKEN]", "k [REDACTED:TOKEN]#2", "other"]
        );
        let sum: i64 = map.values().filter_map(|x| x.as_i64()).sum();
        assert_eq!(sum, 7, "no value lost: {v}");
    }

    #[test]
    fn redacts_bytes() {
        let r = redactor(&[("TOKEN", "tok-123456")]);
        let input = [b"\xff\x00tok-123456\xfe".as_slice(), b"tok-123456"].concat();
        assert_eq!(
            r.redact_bytes(&input).as_ref(),
            b"\xff\x00[REDACTED:TOKEN]\xfe[REDACTED:TOKEN]".as_slice()
        );
        // connection strings are left to the text rules
        assert!(matches!(r.redact_bytes(b"password=x"), Cow::Borrowed(_)));
    }

    /// Random text with the secrets at random positions: never a panic, never a value.
    #[test]
    fn random_text_never_keeps_a_value() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5ec7e7);
        const PIECES: [&str; 24] = [
            "a",
            "Z",
            "0",
            " ",
            "\n",
            "=",
            "@",
            ":",
            "//",
            "://",
            "?",
            "&",
            "#",
            "'",
            "\"",
            "\\",
            "password",
            "token=",
            "é",
            "✓",
            "😀",
            "[REDACTED:",
            "]",
            "%",
        ];
        let random_text = |rng: &mut rand::rngs::StdRng, max: usize| -> String {
            (0..rng.random_range(0..max))
                .map(|_| PIECES[rng.random_range(0..PIECES.len())])
                .collect()
        };
        for round in 0..3_000 {
            let mut secrets = BTreeMap::new();
            for i in 0..rng.random_range(1..4) {
                let mut v = random_text(&mut rng, 6);
                if v.len() < MIN_REDACT_LEN || round % 3 == 0 {
                    v.push_str(&format!("s{round}x{i}"));
                }
                secrets.insert(format!("S{i}"), v);
            }
            let r = Redactor::new(&secrets);
            let mut text = random_text(&mut rng, 40);
            for _ in 0..rng.random_range(0..4) {
                let v = &secrets[&format!("S{}", rng.random_range(0..secrets.len()))];
                let at = rng.random_range(0..=text.chars().count());
                let at = text
                    .char_indices()
                    .nth(at)
                    .map(|(i, _)| i)
                    .unwrap_or(text.len());
                text.insert_str(at, v);
            }
            let out = r.redact_str(&text);
            let mut json = json!({ text.clone(): [text.clone(), {"k": text.clone()}] });
            r.redact_json(&mut json);
            let bytes = r.redact_bytes(text.as_bytes());
            let _ = Redactor::none().redact_str(&text);
            for v in secrets.values().filter(|v| v.len() >= MIN_REDACT_LEN) {
                assert!(
                    !out.contains(v.as_str()),
                    "{v:?} in {out:?} (from {text:?})"
                );
                assert!(
                    !bytes.windows(v.len()).any(|w| w == v.as_bytes()),
                    "{v:?} in bytes of {text:?}"
                );
                let mut strings = Vec::new();
                collect_strings(&json, &mut strings);
                for s in strings {
                    assert!(!s.contains(v.as_str()), "{v:?} in json {s:?}");
                }
            }
        }
    }

    fn collect_strings(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::String(s) => out.push(s.clone()),
            serde_json::Value::Array(a) => a.iter().for_each(|x| collect_strings(x, out)),
            serde_json::Value::Object(m) => m.iter().for_each(|(k, x)| {
                out.push(k.clone());
                collect_strings(x, out)
            }),
            _ => {}
        }
    }
}
