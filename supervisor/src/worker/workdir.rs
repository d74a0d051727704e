//! The worker's share of `work_dir`, and the sweep of what dead workers left
//! in it.
//!
//! Every directory a worker makes there (an attempt's, a persistent
//! session's, a persistent job's) ends in `.<tag>`, the worker
//! instance's tag (12 hex digits of its id). While the worker lives it holds
//! an exclusive `flock` on `.durable-<tag>.lock` in the same place; the
//! kernel lets go of it when the process dies, however it dies (the file is
//! locked before it appears under that name). At start a
//! worker tries that lock of every tag it finds: one it gets belongs to a
//! dead worker, so everything of that tag is removed, then the lock file.
//! One it cannot get belongs to a live worker (of any name, on this host or
//! sharing the directory) and is left alone, and so is every name that does
//! not carry a tag with a lock file: nothing is removed on a guess.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use tempfile::TempDir;
use tracing::{debug, warn};
use uuid::Uuid;

const LOCK_PREFIX: &str = ".durable-";
const LOCK_SUFFIX: &str = ".lock";
const TAG_LEN: usize = 12;

/// What the start-up sweep removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Swept {
    /// Dead workers whose leftovers were removed.
    pub workers: usize,
    /// Directories (and files) of theirs removed.
    pub entries: usize,
}

/// This worker's place in `work_dir`: its tag and the lock that says it lives.
#[derive(Debug)]
pub(crate) struct WorkDir {
    base: PathBuf,
    tag: String,
    lock_path: PathBuf,
    /// Held for the worker's life; `None` once released.
    lock: std::sync::Mutex<Option<Flock<File>>>,
}

impl WorkDir {
    /// Takes this worker's lock in `base` (the worker with id `instance`).
    pub fn open(base: PathBuf, instance: Uuid) -> io::Result<WorkDir> {
        let tag = instance.simple().to_string()[..TAG_LEN].to_string();
        let lock_path = base.join(format!("{LOCK_PREFIX}{tag}{LOCK_SUFFIX}"));
        // locked under another name first, then renamed (atomically): a
        // sweep never sees this worker's lock file unlocked, so it can
        // never take a starting worker for a dead one
        let staging = base.join(format!("{LOCK_PREFIX}{tag}.new"));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&staging)?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
            let _ = std::fs::remove_file(&staging);
            io::Error::other(format!(
                "cannot lock {} ({e}); work_dir must support flock",
                staging.display()
            ))
        })?;
        if let Err(e) = std::fs::rename(&staging, &lock_path) {
            let _ = std::fs::remove_file(&staging);
            return Err(e);
        }
        Ok(WorkDir {
            base,
            tag,
            lock_path,
            lock: std::sync::Mutex::new(Some(lock)),
        })
    }

    pub fn base(&self) -> &Path {
        &self.base
    }

    /// A new directory `<prefix>XXXXXX.<tag>` in `work_dir`, for this
    /// worker's user alone (0700): a job's inputs and outputs are nobody
    /// else's to read, and `work_dir` is the shared temporary directory
    /// unless configured.
    pub fn tempdir(&self, prefix: &str) -> io::Result<TempDir> {
        tempfile::Builder::new()
            .prefix(prefix)
            .suffix(&format!(".{}", self.tag))
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(&self.base)
    }

    /// Whether an attempt could work here now: a directory is made and a
    /// page written into it, then both removed. A directory alone is not
    /// enough: a filesystem full of data still makes directories (re-check
    /// audit: the pause after WORK_DIR_UNAVAILABLE ended at once on a full
    /// tmpfs).
    pub fn probe(&self) -> io::Result<()> {
        let dir = self.tempdir("durable-probe-")?;
        std::fs::write(dir.path().join("probe"), [0u8; 4096])?;
        dir.close()
    }

    /// Removes what dead workers left in `work_dir` (see the module doc).
    /// Errors on single entries are logged and skipped.
    pub fn sweep(&self) -> Swept {
        let mut swept = Swept::default();
        // one listing: a dead worker makes no new entries
        let Ok(entries) = std::fs::read_dir(&self.base) else {
            return swept;
        };
        let names: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let tags = names
            .iter()
            .filter_map(|n| lock_tag(n))
            .filter(|t| *t != self.tag);
        for tag in tags {
            let path = self.base.join(format!("{LOCK_PREFIX}{tag}{LOCK_SUFFIX}"));
            // a lock file only: never follow a link someone put in its place
            if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_file()) {
                continue;
            }
            let Ok(file) = OpenOptions::new().write(true).open(&path) else {
                continue;
            };
            let Ok(lock) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
                debug!(tag = %tag, "a live worker's directories in work_dir are left alone");
                continue;
            };
            let n = remove_tagged(&self.base, &names, tag);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    warn!(error = %e, path = %path.display(), "cannot remove a dead worker's lock file")
                }
            }
            drop(lock);
            swept.workers += 1;
            swept.entries += n;
        }
        swept
    }

    /// The worker is done with `work_dir`: its lock file goes (the
    /// directories are already gone with their attempts and sessions).
    pub fn release(&self) {
        let lock = self.lock.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(lock) = lock {
            if let Err(e) = std::fs::remove_file(&self.lock_path) {
                if e.kind() != io::ErrorKind::NotFound {
                    warn!(error = %e, path = %self.lock_path.display(), "cannot remove this worker's lock file in work_dir");
                }
            }
            // unlinked while still locked: no sweep takes it for a dead
            // worker's in between
            drop(lock);
        }
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        self.release();
    }
}

/// The tag of a lock file's name, if it is one (`.durable-<12 hex>.lock`).
fn lock_tag(name: &str) -> Option<&str> {
    let tag = name.strip_prefix(LOCK_PREFIX)?.strip_suffix(LOCK_SUFFIX)?;
    (tag.len() == TAG_LEN
        && tag
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
    .then_some(tag)
}

/// Whether `name` is a worker's entry of `tag` (`durable-….<tag>`).
fn is_tagged(name: &str, tag: &str) -> bool {
    name.starts_with("durable-") && name.ends_with(&format!(".{tag}"))
}

/// Removes every entry of `tag` among `names` in `base`; a link is
/// removed, never followed.
fn remove_tagged(base: &Path, names: &[String], tag: &str) -> usize {
    let mut n = 0;
    for name in names.iter().filter(|n| is_tagged(n, tag)) {
        let path = base.join(name);
        let res = match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_dir() => std::fs::remove_dir_all(&path),
            Ok(_) => std::fs::remove_file(&path),
            Err(e) => Err(e),
        };
        match res {
            Ok(()) => n += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                warn!(error = %e, path = %path.display(), "cannot remove a dead worker's directory from work_dir")
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_a_tag() {
        let tag = "0123456789ab";
        for (name, want) in [
            ("durable-6f1c-XyZ123.0123456789ab", true),
            ("durable-session-go-AbC.0123456789ab", true),
            ("durable-job-go-AbC.0123456789ab", true),
            ("durable-.0123456789ab", true),
            ("durable-6f1c-XyZ123.1123456789ab", false),
            ("durable-6f1c-XyZ1230123456789ab", false),
            ("other-6f1c.0123456789ab", false),
            (".durable-0123456789ab.lock", false),
            ("durable-old-without-tag", false),
        ] {
            assert_eq!(is_tagged(name, tag), want, "{name}");
        }
        for (name, want) in [
            (".durable-0123456789ab.lock", Some("0123456789ab")),
            (".durable-0123456789AB.lock", None),
            (".durable-0123456789a.lock", None),
            (".durable-0123456789abc.lock", None),
            (".durable-../../etc.lock", None),
            ("durable-0123456789ab.lock", None),
        ] {
            assert_eq!(lock_tag(name), want, "{name}");
        }
    }

    /// A job's directory and the worker's lock file are its user's alone:
    /// they were 0755 and 0644, so any local user could read every step's
    /// inputs and outputs in /tmp (security audit).
    #[test]
    fn a_workers_directories_and_lock_are_private() {
        let base = tempfile::tempdir().expect("base");
        let me = WorkDir::open(base.path().to_path_buf(), Uuid::new_v4()).expect("open");
        let d = me.tempdir("durable-x-").expect("tempdir");
        let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(d.path()), 0o700);
        assert_eq!(mode(&me.lock_path), 0o600);
    }

    fn touch_dir(p: &Path) {
        std::fs::create_dir_all(p.join("out")).expect("dir");
        std::fs::write(p.join("out/result.bin"), b"x").expect("file");
    }

    /// A dead worker's entries go, a live one's stay, and so does every
    /// name without a lock file of its tag; a link is removed, not followed.
    #[test]
    fn the_sweep_removes_only_what_dead_workers_left() {
        let base = tempfile::tempdir().expect("base");
        let b = base.path();
        let outside = tempfile::tempdir().expect("outside");
        std::fs::write(outside.path().join("keep"), b"k").expect("outside file");

        // a dead worker: its lock file, nobody holds it
        let dead = "aaaaaaaaaaaa";
        std::fs::write(b.join(format!(".durable-{dead}.lock")), b"").expect("dead lock");
        touch_dir(&b.join(format!("durable-1234-abc.{dead}")));
        touch_dir(&b.join(format!("durable-session-go-xyz.{dead}")));
        std::os::unix::fs::symlink(outside.path(), b.join(format!("durable-job-go-l.{dead}")))
            .expect("link");
        // a live worker: this one's own
        let me = WorkDir::open(b.to_path_buf(), Uuid::new_v4()).expect("open");
        let mine = me.tempdir("durable-session-go-").expect("mine");
        touch_dir(mine.path());
        // another live worker
        let other = WorkDir::open(b.to_path_buf(), Uuid::new_v4()).expect("other");
        let theirs = other.tempdir("durable-job-go-").expect("theirs");
        // entries nobody can vouch for
        touch_dir(&b.join("durable-old-without-tag"));
        touch_dir(&b.join("durable-1234-abc.bbbbbbbbbbbb"));
        std::fs::write(b.join("notes.txt"), b"n").expect("notes");

        let swept = me.sweep();
        assert_eq!(
            swept,
            Swept {
                workers: 1,
                entries: 3
            }
        );
        let mut left: Vec<String> = std::fs::read_dir(b)
            .expect("read")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut want = vec![
            "durable-1234-abc.bbbbbbbbbbbb".to_string(),
            "durable-old-without-tag".into(),
            "notes.txt".into(),
            format!(".durable-{}.lock", me.tag),
            format!(".durable-{}.lock", other.tag),
            mine.path()
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned(),
            theirs
                .path()
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned(),
        ];
        want.sort();
        assert_eq!(left, want);
        assert!(
            outside.path().join("keep").exists(),
            "the link was followed"
        );

        // a released worker leaves no lock file; a second sweep finds nothing
        drop(theirs);
        other.release();
        assert!(!b.join(format!(".durable-{}.lock", other.tag)).exists());
        assert_eq!(me.sweep(), Swept::default());
    }
}
