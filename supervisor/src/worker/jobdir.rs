//! Job directories: where an attempt's `out/` (and `in/`, when it has input
//! artifacts) live.
//!
//! A one-shot executor runs *in* its attempt's directory, so that one is
//! always fresh (and named after the step run: `durable-<step_run_id>-…`). A
//! persistent executor runs in its session's directory; its jobs only need
//! `out/` (and `in/`) somewhere. Making and removing two directories per job
//! was ~14 % of the worker's own CPU in a profile of no-op persistent jobs
//! (ext4 allocating and freeing directory inodes), so a persistent
//! executor's job directories are reused: one given back *clean* — it holds
//! `out/` and nothing else, and `out/` is empty — is kept (at most twice the
//! executor's concurrency: an attempt keeps its directory until its outcome
//! is committed, after its slot went to the next job) and handed to the next
//! job, after the same check again. Any other is removed, as before. So
//! every job still starts with an empty `out/` and no `in/`.
//!
//! A spare is renamed when it is handed out, and its `out/` made anew, so no
//! two jobs share a path or an `out/`: a process an earlier job left running
//! that writes into that job's `output_dir`, by its path or from inside it
//! (its working directory, a descriptor held open), finds it gone, instead
//! of writing into the next job's results (outside audits 77, 79: a file
//! written there after the earlier job ended replaced the next job's
//! artifact, which then failed for good on its digest). One directory is
//! still reused, the job directory itself: half the inodes a fresh pair
//! costs.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tempfile::TempDir;

use super::workdir::WorkDir;

/// A job's (or a one-shot attempt's) directory, removed with all it holds
/// when dropped.
#[derive(Debug)]
pub(crate) struct JobDir {
    path: PathBuf,
}

impl JobDir {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl From<TempDir> for JobDir {
    fn from(d: TempDir) -> JobDir {
        JobDir { path: d.keep() }
    }
}

impl Drop for JobDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::debug!(path = %self.path.display(), error = %e, "cannot remove a job directory");
            }
        }
    }
}

/// The spare job directories of one persistent executor.
#[derive(Debug)]
pub(crate) struct JobDirs {
    prefix: String,
    cap: usize,
    spare: Mutex<Vec<JobDir>>,
}

impl JobDirs {
    /// Spares of the executor named `executor`, at most `cap` kept.
    pub fn new(executor: &str, cap: usize) -> JobDirs {
        JobDirs {
            prefix: format!("durable-job-{}-", super::attempt::sanitize(executor)),
            cap,
            spare: Mutex::new(Vec::new()),
        }
    }

    /// A clean spare, or a new directory in `work_dir` with an empty `out/`.
    /// A spare that is no longer clean is removed on the way.
    pub fn take(&self, work: &WorkDir) -> io::Result<JobDir> {
        loop {
            let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
            match spare {
                Some(mut d) if is_clean(d.path()) => {
                    // a path of its own for this job (never one that exists)
                    let to = work.fresh_name(&self.prefix);
                    let moved = rustix::fs::renameat_with(
                        rustix::fs::CWD,
                        d.path(),
                        rustix::fs::CWD,
                        &to,
                        rustix::fs::RenameFlags::NOREPLACE,
                    );
                    if moved.is_ok() {
                        d.path = to;
                        // and an `out/` of its own: the old one removed (it
                        // is empty; something written there since makes
                        // this fail, and the spare goes), so a process
                        // that runs in it or holds it open writes nowhere
                        if renew_out(d.path()).is_ok() {
                            return Ok(d);
                        }
                    }
                }
                Some(d) => drop(d),
                None => break,
            }
        }
        let d = JobDir::from(work.tempdir(&self.prefix)?);
        make_out(d.path())?;
        Ok(d)
    }

    /// Keeps `d` for a later job if it is clean and fewer than `cap` are
    /// kept; removes it otherwise.
    pub fn give_back(&self, d: JobDir) {
        if !is_clean(d.path()) {
            return;
        }
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < self.cap {
            spare.push(d);
        }
    }

    #[cfg(test)]
    fn spares(&self) -> usize {
        self.spare.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// Makes `dir`'s empty `out/`, with the mode a clean one has (the umask's
/// would be lost on reuse).
fn make_out(dir: &Path) -> io::Result<()> {
    let out = dir.join("out");
    std::fs::create_dir(&out)?;
    std::fs::set_permissions(
        &out,
        std::os::unix::fs::PermissionsExt::from_mode(CLEAN_MODE),
    )
}

/// Replaces `dir`'s empty `out/` by a new one. The old one goes only while
/// empty (`rmdir`): a process of an earlier job that runs in it (its working
/// directory) or holds it open can create nothing in a removed directory,
/// where the new one would have been its to write (outside audit 79: a child
/// started with `cwd=output_dir` replaced the next job's artifact).
fn renew_out(dir: &Path) -> io::Result<()> {
    std::fs::remove_dir(dir.join("out"))?;
    make_out(dir)
}

/// The mode of a clean job directory and of its `out/`.
const CLEAN_MODE: u32 = 0o700;

/// `dir` holds an empty `out/` directory (not a link to one) and nothing else,
/// both this process's with mode 0700 (persistent-pool audit: a job that
/// made its `out/` read-only handed it on, and every attempt of a later step
/// failed on it with "Permission denied").
///
/// Checked twice per job (given back, taken again), so it reads each of the
/// two directories with `getdents64` into a buffer on the stack:
/// `std::fs::read_dir` goes through glibc's `opendir`, which allocates
/// 32 KiB per directory, and the four of them per job were ~12 % of the
/// worker's CPU in a profile of no-op persistent jobs. `out` is opened with
/// `O_DIRECTORY | O_NOFOLLOW`: a file or a link in its place is not clean.
fn is_clean(dir: &Path) -> bool {
    use rustix::fs::{openat, Mode, OFlags, CWD};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    let Ok(job) = openat(CWD, dir, flags, Mode::empty()) else {
        return false;
    };
    if !as_made(&job) || !holds_only(&job, Some(c"out")) {
        return false;
    }
    openat(&job, c"out", flags, Mode::empty())
        .is_ok_and(|out| as_made(&out) && holds_only(&out, None))
}

/// The open directory is this process's, with [`CLEAN_MODE`] and no more,
/// and carries no attribute a job may have set on it that a later job would
/// inherit (a `user.` extended attribute, a POSIX ACL; re-check audit: an
/// xattr set on `out/` was there for the next three jobs). The filesystem's
/// own (`security.selinux`) do not count.
fn as_made(dir: &rustix::fd::OwnedFd) -> bool {
    let owned = rustix::fs::fstat(dir).is_ok_and(|st| {
        st.st_uid == nix::unistd::geteuid().as_raw() && st.st_mode & 0o7777 == CLEAN_MODE
    });
    owned && !has_job_attributes(dir)
}

/// Whether `dir` has a `user.*` or `system.posix_acl_*` extended attribute
/// (a filesystem without extended attributes has none).
fn has_job_attributes(dir: &rustix::fd::OwnedFd) -> bool {
    let mut names = [0u8; 1024];
    match rustix::fs::flistxattr(dir, &mut names[..]) {
        Ok(n) => names[..n]
            .split(|b| *b == 0)
            .any(|name| name.starts_with(b"user.") || name.starts_with(b"system.posix_acl_")),
        // names longer than the buffer: more than a clean one has
        Err(rustix::io::Errno::RANGE) => true,
        Err(_) => false,
    }
}

/// The open directory `dir` holds exactly the entry `name` (`None`: no
/// entry at all) besides `.` and `..`.
fn holds_only(dir: &rustix::fd::OwnedFd, name: Option<&std::ffi::CStr>) -> bool {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 1024];
    let mut entries = rustix::fs::RawDir::new(dir, &mut buf);
    let mut seen = false;
    while let Some(entry) = entries.next() {
        let Ok(entry) = entry else {
            return false;
        };
        let got = entry.file_name();
        if got == c"." || got == c".." {
            continue;
        }
        if seen || name != Some(got) {
            return false;
        }
        seen = true;
    }
    seen == name.is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_with_a_users_extended_attribute_is_not_clean() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("out");
        std::fs::create_dir(&out).expect("out");
        for d in [dir.path(), out.as_path()] {
            std::fs::set_permissions(d, PermissionsExt::from_mode(CLEAN_MODE)).expect("chmod");
        }
        assert!(is_clean(dir.path()));
        let set = rustix::fs::setxattr(&out, "user.job", b"1", rustix::fs::XattrFlags::empty());
        if let Err(rustix::io::Errno::NOTSUP) = set {
            // a filesystem without user xattrs: no job can set one either
            eprintln!("skipped: {} takes no user xattr", dir.path().display());
            return;
        }
        set.expect("setxattr");
        assert!(!is_clean(dir.path()), "an xattr on out/ is handed on");
    }

    #[test]
    fn a_clean_directory_is_reused_and_any_other_removed() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().expect("base");
        let work = WorkDir::open(base.path().to_path_buf(), uuid::Uuid::new_v4()).expect("work");
        let dirs = JobDirs::new("py demo", 2);

        // new: an empty out/, named after the executor
        let a = dirs.take(&work).expect("take");
        let a_path = a.path().to_path_buf();
        assert!(a_path.join("out").is_dir() && !a_path.join("in").exists());
        assert!(a_path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("durable-job-py_demo-")));

        // clean: kept and handed out again, under a path of its own: what
        // the earlier job's leftovers write by its old path goes nowhere,
        // and a process still inside the old out/ (its working directory,
        // a descriptor) creates nothing in the new one
        let held = rustix::fs::open(
            a_path.join("out"),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .expect("hold out/");
        dirs.give_back(a);
        assert_eq!(dirs.spares(), 1);
        let a = dirs.take(&work).expect("take");
        assert_ne!(a.path(), a_path);
        assert!(!a_path.exists(), "the old path is still there");
        assert!(std::fs::write(a_path.join("out/late.txt"), b"x").is_err());
        let late = rustix::fs::openat(
            &held,
            "late.txt",
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
        );
        assert!(late.is_err(), "a file made through the old out/");
        assert!(is_clean(a.path()));
        assert!(a
            .path()
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("durable-job-py_demo-")));

        // for each way of not being clean: not kept, removed, the next is new
        type Dirty = fn(&Path);
        let dirty: [(&str, Dirty); 8] = [
            ("out/ made read-only", |d| {
                std::fs::set_permissions(d.join("out"), PermissionsExt::from_mode(0o555))
                    .expect("chmod")
            }),
            ("the job directory opened to others", |d| {
                std::fs::set_permissions(d, PermissionsExt::from_mode(0o755)).expect("chmod")
            }),
            ("a file in out/", |d| {
                std::fs::write(d.join("out/result.txt"), b"x").expect("write")
            }),
            ("no out/", |d| {
                std::fs::remove_dir(d.join("out")).expect("rmdir")
            }),
            ("an in/", |d| {
                std::fs::create_dir_all(d.join("in/prev")).expect("in")
            }),
            ("a file beside out/", |d| {
                std::fs::write(d.join("stray"), b"x").expect("write")
            }),
            ("out/ replaced by a file", |d| {
                std::fs::remove_dir(d.join("out")).expect("rmdir");
                std::fs::write(d.join("out"), b"x").expect("write");
            }),
            ("out/ replaced by a link to an empty directory", |d| {
                std::fs::remove_dir(d.join("out")).expect("rmdir");
                std::fs::create_dir(d.with_extension("elsewhere")).expect("mkdir");
                std::os::unix::fs::symlink(d.with_extension("elsewhere"), d.join("out"))
                    .expect("symlink");
            }),
        ];
        let mut d = a;
        for (what, make_dirty) in dirty {
            let path = d.path().to_path_buf();
            make_dirty(&path);
            dirs.give_back(d);
            assert_eq!(dirs.spares(), 0, "{what}: kept");
            assert!(!path.exists(), "{what}: not removed");
            d = dirs.take(&work).expect("take");
            assert_ne!(d.path(), path, "{what}: handed out again");
            assert!(is_clean(d.path()), "{what}: the new one is not clean");
        }

        // dirtied while spare: checked again when taken
        let path = d.path().to_path_buf();
        dirs.give_back(d);
        std::fs::write(path.join("out/late.txt"), b"x").expect("write");
        let e = dirs.take(&work).expect("take");
        assert_ne!(e.path(), path);
        assert!(!path.exists(), "the dirtied spare was not removed");

        // at most `cap` kept
        let (x, y) = (dirs.take(&work).expect("x"), dirs.take(&work).expect("y"));
        let y_path = y.path().to_path_buf();
        dirs.give_back(e);
        dirs.give_back(x);
        dirs.give_back(y);
        assert_eq!(dirs.spares(), 2);
        assert!(!y_path.exists(), "the one over the cap was not removed");
    }
}
