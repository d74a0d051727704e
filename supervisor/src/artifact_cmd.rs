//! `supervisor artifact get ID --out FILE` and `supervisor artifact lineage ID`.
//!
//! `get` streams the bytes from the artifact store in chunks (the workers'
//! reader, [`crate::artifacts::BlobReader`]: chunk rows, a `substring` of an
//! older single-value blob, or a shared directory's file), hashing as it
//! writes to a temporary file beside the target; only when size and sha256
//! match what the artifact row says is the file moved into place, so a
//! failed or interrupted `get` leaves no half-written FILE, and an existing
//! FILE is never overwritten without `--force`.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;

use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::artifacts::{ArtifactStore, StoreError};
use crate::cli::CliError;
use crate::db::{ArtifactInfo, Db, DbError, Lineage};

/// What a failed `get` left behind, said after its error.
/// Where the bytes went while they were checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sink {
    /// A temporary file beside --out, removed on any error.
    File,
    Stdout,
    /// What is not a regular file (a device, a FIFO), written in place.
    Through,
}

fn left_behind(sink: Sink) -> &'static str {
    match sink {
        Sink::Stdout => {
            "(what was already written to standard output is not the artifact: discard it)"
        }
        Sink::Through => "(what was already written to --out is not the artifact: discard it)",
        Sink::File => "(nothing was written to the file)",
    }
}

/// A read that failed on missing bytes: an artifact removed meanwhile
/// (retention) is said to be so, as an unknown artifact (exit 4), not called
/// damaged (retention audit: "chunk 168 of 245 is missing; the stored bytes
/// are damaged" of a run `gc` removed during the read).
async fn read_failure(db: &Db, id: Uuid, e: StoreError, sink: Sink) -> CliError {
    if matches!(e, StoreError::Corrupt { .. })
        && matches!(db.artifact_blob(id).await, Err(DbError::NotFound(_)))
    {
        return CliError::Db(DbError::NotFound(format!(
            "artifact {id} was removed while it was being read (its run was removed: by a worker's retention or by `gc`) {}",
            left_behind(sink)
        )));
    }
    store_error(e, sink)
}

fn store_error(e: StoreError, sink: Sink) -> CliError {
    match e {
        StoreError::Db(e) => CliError::Db(e),
        StoreError::NoDirectory { .. } | StoreError::DirectoryMissing { .. } => {
            CliError::Usage(e.to_string())
        }
        e => CliError::Other(format!("{e} {}", left_behind(sink))),
    }
}

/// Resolves on SIGINT or SIGTERM (never, if the handlers cannot be set).
async fn interrupted() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
}

/// An artifact id, or exit 4 (like an unknown one).
pub fn parse_artifact_id(s: &str) -> Result<Uuid, CliError> {
    Uuid::parse_str(s.trim()).map_err(|_| {
        CliError::Db(DbError::NotFound(format!(
            "unknown artifact {s:?}: not an artifact id (a UUID)"
        )))
    })
}

/// Where `artifact get` writes.
enum Target {
    Stdout,
    /// Something that is not a regular file (a device, a FIFO, a socket,
    /// `/dev/stdout`): written through, in place, as stdout is. Nothing is
    /// replaced, so no --force is needed.
    Through(std::path::PathBuf),
    /// A regular file (a symlink's target, when `out` is one): written
    /// beside it, verified, then renamed over it.
    File(std::path::PathBuf),
}

/// Resolves `--out`: refused when it names a directory, a dangling symlink,
/// or (without `force`) a regular file that exists.
fn target(out: &Path, force: bool) -> Result<Target, CliError> {
    if out.as_os_str() == "-" {
        return Ok(Target::Stdout);
    }
    let directory = || {
        CliError::Usage(format!(
            "--out {} names a directory: give the path of the file to write",
            out.display()
        ))
    };
    if out.as_os_str().to_string_lossy().ends_with('/') {
        return Err(directory());
    }
    let is_link = out
        .symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink());
    // (stat follows symlinks, /proc's magic links among them)
    match std::fs::metadata(out) {
        Ok(m) if m.is_dir() => Err(directory()),
        Ok(m) if !m.is_file() => Ok(Target::Through(out.to_path_buf())),
        Ok(_) if !force => Err(CliError::Usage(format!(
            "{} exists: pass --force to overwrite it, or choose another --out",
            out.display()
        ))),
        // the file a symlink names is replaced, not the link
        Ok(_) if is_link => std::fs::canonicalize(out)
            .map(Target::File)
            .map_err(|e| io_error(out, "resolve", e)),
        Ok(_) => Ok(Target::File(out.to_path_buf())),
        Err(_) if is_link => Err(CliError::Usage(format!(
            "--out {} is a symlink to a path that does not exist: give the path of the file to write",
            out.display()
        ))),
        Err(_) => Ok(Target::File(out.to_path_buf())),
    }
}

/// Writes artifact `id`'s bytes to `out` (`-`: stdout), checked against its
/// size and sha256. Refuses an existing regular file `out` unless `force`;
/// writes through what is not a regular file (`/dev/null`, a FIFO).
pub async fn get(
    db: &Db,
    store: &ArtifactStore,
    id: Uuid,
    out: &Path,
    force: bool,
) -> Result<ArtifactInfo, CliError> {
    let target = target(out, force)?;
    let (info, blob) = db.artifact_blob(id).await?;
    if blob.size != info.size {
        return Err(CliError::Other(format!(
            "artifact {id}: the stored blob has {} bytes, the artifact says {}; nothing written",
            blob.size, info.size
        )));
    }
    let sink = match target {
        Target::Stdout => Sink::Stdout,
        Target::Through(_) => Sink::Through,
        Target::File(_) => Sink::File,
    };
    let mut reader = match store.open(&blob).await {
        Ok(r) => r,
        Err(e) => return Err(read_failure(db, id, e, sink).await),
    };
    let file = match target {
        Target::Stdout => {
            let stdout = std::io::stdout();
            copy_checked(db, &mut reader, &mut stdout.lock(), &info, out, sink).await?;
            return Ok(info);
        }
        Target::Through(path) => {
            let mut w = std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| io_error(out, "open", e))?;
            copy_checked(db, &mut reader, &mut w, &info, out, sink).await?;
            return Ok(info);
        }
        Target::File(path) => path,
    };
    let dir = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".artifact-")
        .suffix(".part")
        .tempfile_in(&dir)
        .map_err(|e| io_error(out, "create a file beside", e))?;
    // a signal, a read error or a mismatch drops `tmp`, which removes it:
    // no partial or wrong bytes are left beside FILE or under its name
    tokio::select! {
        r = copy_checked(db, &mut reader, &mut tmp, &info, out, sink) => r,
        _ = interrupted() => Err(CliError::Other(format!(
            "interrupted by a signal: nothing was written to {}",
            out.display()
        ))),
    }?;
    place(tmp, &file, force)?;
    Ok(info)
}

fn io_error(out: &Path, what: &str, e: std::io::Error) -> CliError {
    CliError::Other(format!("cannot {what} {}: {e}", out.display()))
}

/// Streams the blob into `w` chunk by chunk, hashing as it goes, then
/// checks size and sha256 against the artifact row.
async fn copy_checked(
    db: &Db,
    reader: &mut crate::artifacts::BlobReader,
    w: &mut impl Write,
    info: &ArtifactInfo,
    out: &Path,
    sink: Sink,
) -> Result<(), CliError> {
    let mut hasher = Sha256::new();
    let mut written: i64 = 0;
    loop {
        let chunk = match reader.next_chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(e) => return Err(read_failure(db, info.id, e, sink).await),
        };
        hasher.update(&chunk);
        written += chunk.len() as i64;
        w.write_all(&chunk).map_err(|e| io_error(out, "write", e))?;
    }
    w.flush().map_err(|e| io_error(out, "write", e))?;
    check(info, written, &hex::encode(hasher.finalize()), sink)
}

/// Moves the verified temporary file to `out`: durable, with the mode a
/// file the user creates gets (0666 less the umask), or the mode, owner and
/// group of the file it replaces (`force`; the owner where this process may
/// give it), and never over an existing file without `force`.
/// It was 0644 whatever the umask, and `--force` widened a 0600 file to it
/// (security audit).
fn place(tmp: tempfile::NamedTempFile, out: &Path, force: bool) -> Result<(), CliError> {
    use std::os::unix::fs::PermissionsExt;
    tmp.as_file()
        .sync_all()
        .map_err(|e| io_error(out, "write", e))?;
    let replaced = std::fs::metadata(out).ok().filter(|m| force && m.is_file());
    let mode = match &replaced {
        // its permission bits, not setuid/setgid/sticky (re-check audit)
        Some(m) => m.permissions().mode() & 0o777,
        None => 0o666 & !umask(),
    };
    // and its owner and group, where this process may give them (root
    // replacing a user's file left it root's); otherwise ours, as for a
    // new file
    if let Some(m) = &replaced {
        use std::os::unix::fs::MetadataExt;
        let _ = std::os::unix::fs::fchown(tmp.as_file(), Some(m.uid()), Some(m.gid()));
    }
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(|e| io_error(out, "write", e))?;
    let placed = if force {
        tmp.persist(out).map(|_| ())
    } else {
        // the check before the download raced with another writer: still
        // never clobber
        tmp.persist_noclobber(out).map(|_| ())
    };
    placed.map_err(|e| {
        if e.error.kind() == std::io::ErrorKind::AlreadyExists {
            CliError::Usage(format!(
                "{} exists: pass --force to overwrite it, or choose another --out",
                out.display()
            ))
        } else {
            io_error(out, "write", e.error)
        }
    })
}

/// This process's umask, read where it does not change it
/// (`/proc/self/status`, Linux 4.7+); 022 where that says nothing.
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

fn check(info: &ArtifactInfo, size: i64, sha256: &str, sink: Sink) -> Result<(), CliError> {
    if size != info.size || sha256 != info.sha256 {
        return Err(CliError::Other(format!(
            "artifact {}: read {size} bytes with sha256 {sha256}, but it is {} bytes with sha256 {}; the stored bytes are damaged {}",
            info.id,
            info.size,
            info.sha256,
            left_behind(sink)
        )));
    }
    Ok(())
}

/// `artifact lineage --json`: the artifact as a node, each node with its
/// inputs under `derived_from`, down to the first inputs (an empty list). A
/// node reached again (a shared ancestor: two inputs derived from one
/// artifact) is written in full once, where it is first reached in document
/// order; later it comes with `"shown_above": true` and an empty
/// `derived_from`, as the text view draws it once and names it after. Written
/// out under every path, a diamond-shaped workflow doubled the document per
/// layer: 41 artifacts of 20 layers were 3 GB.
pub fn lineage_json(l: &Lineage) -> serde_json::Value {
    let mut shown = BTreeSet::new();
    node_json(l, l.root, &mut shown)
}

fn node_json(l: &Lineage, id: Uuid, shown: &mut BTreeSet<Uuid>) -> serde_json::Value {
    let mut v = match l.nodes.get(&id) {
        Some(n) => serde_json::to_value(n).unwrap_or_default(),
        None => serde_json::json!({ "id": id }),
    };
    let mut from = Vec::new();
    let first = shown.insert(id);
    if first {
        for d in l.derived_from.get(&id).into_iter().flatten() {
            from.push(node_json(l, *d, shown));
        }
    }
    if let Some(o) = v.as_object_mut() {
        if !first {
            o.insert("shown_above".into(), serde_json::Value::Bool(true));
        }
        o.insert("derived_from".into(), serde_json::Value::Array(from));
    }
    v
}

/// `artifact lineage` without `--json`: a tree, the artifact first, each
/// input indented under what was derived from it. A node reached twice (two
/// inputs of one ancestor) is drawn once and named the second time.
pub fn lineage_text(l: &Lineage) -> String {
    let mut out = String::new();
    let mut shown = BTreeSet::new();
    tree_line(l, l.root, "", "", &mut shown, &mut out);
    let mut firsts = Vec::new();
    first_inputs(l, l.root, &mut BTreeSet::new(), &mut firsts);
    let steps: BTreeSet<&str> = l.nodes.values().map(|n| n.step.as_str()).collect();
    out.push_str(&format!(
        "\n{} artifacts from {} steps; first inputs: {}\n",
        l.nodes.len(),
        steps.len(),
        firsts
            .iter()
            .filter_map(|id| l.nodes.get(id))
            .map(|n| crate::terminal::shown(&n.name))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    out
}

/// The first inputs (artifacts derived from nothing) under `id`, each once,
/// in the order the tree draws them.
fn first_inputs(l: &Lineage, id: Uuid, seen: &mut BTreeSet<Uuid>, out: &mut Vec<Uuid>) {
    if !seen.insert(id) {
        return;
    }
    match l.derived_from.get(&id) {
        Some(from) if !from.is_empty() => {
            for d in from {
                first_inputs(l, *d, seen, out);
            }
        }
        _ => out.push(id),
    }
}

fn tree_line(
    l: &Lineage,
    id: Uuid,
    lead: &str,
    child_lead: &str,
    shown: &mut BTreeSet<Uuid>,
    out: &mut String,
) {
    let Some(n) = l.nodes.get(&id) else {
        out.push_str(&format!("{lead}{id} (gone)\n"));
        return;
    };
    let again = !shown.insert(id);
    out.push_str(&format!(
        "{lead}{}  {}  {} B  sha256 {}  step {} attempt {}  run {}{}\n",
        crate::terminal::shown(&n.name),
        n.id,
        n.size,
        n.sha256.get(..16).unwrap_or(&n.sha256),
        crate::terminal::shown(&n.step),
        n.attempt,
        n.run_id,
        if again { "  (shown above)" } else { "" }
    ));
    if again {
        return;
    }
    let inputs = l.derived_from.get(&id).cloned().unwrap_or_default();
    for (i, d) in inputs.iter().enumerate() {
        let last = i + 1 == inputs.len();
        let (branch, cont) = if last {
            ("└── ", "    ")
        } else {
            ("├── ", "│   ")
        };
        tree_line(
            l,
            *d,
            &format!("{child_lead}{branch}"),
            &format!("{child_lead}{cont}"),
            shown,
            out,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn node(n: u128, name: &str, step: &str) -> ArtifactInfo {
        ArtifactInfo {
            id: Uuid::from_u128(n),
            name: name.into(),
            sha256: "ab".repeat(32),
            size: 3,
            media_type: "text/plain".into(),
            step: step.into(),
            step_run_id: Uuid::from_u128(100 + n),
            attempt: 1,
            run_id: Uuid::nil(),
            created_at: chrono::DateTime::<chrono::Utc>::MIN_UTC,
        }
    }

    #[test]
    fn a_diamond_is_a_tree_with_the_shared_input_named_twice() {
        // d <- b, c; b <- a; c <- a
        let nodes: BTreeMap<Uuid, ArtifactInfo> = [
            node(1, "a", "s1"),
            node(2, "b", "s2"),
            node(3, "c", "s3"),
            node(4, "d", "s4"),
        ]
        .into_iter()
        .map(|n| (n.id, n))
        .collect();
        let id = Uuid::from_u128;
        let derived_from = BTreeMap::from([
            (id(4), vec![id(2), id(3)]),
            (id(2), vec![id(1)]),
            (id(3), vec![id(1)]),
        ]);
        let l = Lineage {
            root: id(4),
            nodes,
            derived_from,
        };
        let t = lineage_text(&l);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("d  "), "{t}");
        assert!(lines[1].starts_with("├── b  "), "{t}");
        assert!(lines[2].starts_with("│   └── a  "), "{t}");
        assert!(lines[3].starts_with("└── c  "), "{t}");
        assert!(
            lines[4].starts_with("    └── a  ") && lines[4].ends_with("(shown above)"),
            "{t}"
        );
        assert!(
            t.contains("4 artifacts from 4 steps; first inputs: a"),
            "{t}"
        );
        let j = lineage_json(&l);
        assert_eq!(j["name"], "d");
        assert_eq!(j["derived_from"][0]["derived_from"][0]["name"], "a");
        assert_eq!(j["derived_from"][1]["derived_from"][0]["name"], "a");
        assert_eq!(
            j["derived_from"][1]["derived_from"][0]["derived_from"],
            serde_json::json!([])
        );
        assert_eq!(
            j["derived_from"][0]["derived_from"][0].get("shown_above"),
            None
        );
        assert_eq!(j["derived_from"][1]["derived_from"][0]["shown_above"], true);
    }

    /// The first inputs are named in the order the tree draws them (they
    /// came in id order, matching neither the tree nor the names: artifacts
    /// audit).
    #[test]
    fn first_inputs_are_named_in_tree_order() {
        let id = Uuid::from_u128;
        let nodes: BTreeMap<Uuid, ArtifactInfo> =
            [node(4, "d", "s4"), node(9, "x", "s9"), node(2, "y", "s2")]
                .into_iter()
                .map(|n| (n.id, n))
                .collect();
        let l = Lineage {
            root: id(4),
            nodes,
            derived_from: BTreeMap::from([(id(4), vec![id(9), id(2)])]),
        };
        let t = lineage_text(&l);
        assert!(t.contains("first inputs: x, y\n"), "{t}");
    }

    /// A diamond-shaped workflow (each layer's two artifacts derived from
    /// both of the layer before): every artifact is written in full once,
    /// and the document grows with the artifacts, not with the paths (2^n).
    #[test]
    fn lineage_json_of_stacked_diamonds_holds_each_artifact_once() {
        let layers = 12u128;
        let id = |layer: u128, k: u128| Uuid::from_u128(layer * 2 + k + 1);
        let mut nodes = BTreeMap::new();
        let mut derived_from = BTreeMap::new();
        for layer in 0..layers {
            for k in 0..2 {
                let n = node(layer * 2 + k + 1, &format!("l{layer}{k}"), "s");
                nodes.insert(n.id, n);
                if layer > 0 {
                    derived_from.insert(id(layer, k), vec![id(layer - 1, 0), id(layer - 1, 1)]);
                }
            }
        }
        let l = Lineage {
            root: id(layers - 1, 0),
            nodes,
            derived_from,
        };
        let text = lineage_json(&l).to_string();
        let nodes = text.matches("\"derived_from\"").count();
        let again = text.matches("\"shown_above\":true").count();
        // the root and both artifacts of every layer below it, once each
        assert_eq!(
            nodes - again,
            2 * (layers as usize - 1) + 1,
            "{}",
            text.len()
        );
        // each layer's second artifact names the two below it as shown
        assert_eq!(again, 2 * (layers as usize - 2));
    }
}
