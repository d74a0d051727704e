//! Job directories: where an attempt's `out/` (and `in/`, when it has input
//! artifacts) live.
//!
//! A one-shot executor runs *in* its attempt's directory (named after the
//! step run: `durable-<step_run_id>-…`). A persistent executor runs in its
//! session's directory; each of its jobs gets a directory of its own,
//! `durable-job-<executor>-….<tag>`, with an empty `out/`, made for the job
//! and removed after it.
//!
//! They were reused once (a clean one handed to the next job: making and
//! removing two directories per job was ~14 % of the worker's own CPU in a
//! profile of no-op persistent jobs). Outside audits 77, 79 and 80 showed
//! what that costs: whatever an earlier job left running that writes into
//! its `output_dir` — by its path, from inside it, or from its parent (a
//! child started in `dirname(output_dir)`, a descriptor held on it) — wrote
//! into a later job's results, whose artifact then failed for good on its
//! digest. Renaming the reused directory and renewing its `out/` closed the
//! first two ways, not the third: only a new directory closes them all. So
//! no job directory is ever handed to a second job.

use std::io;
use std::path::{Path, PathBuf};

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
        // most jobs leave an empty `out/` and nothing else: two rmdirs, not
        // remove_dir_all's open, read and stat of each level
        if std::fs::remove_dir(self.path.join("out")).is_ok()
            && std::fs::remove_dir(&self.path).is_ok()
        {
            return;
        }
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::debug!(path = %self.path.display(), error = %e, "cannot remove a job directory");
            }
        }
    }
}

/// The job directories of one persistent executor: their name prefix.
#[derive(Debug)]
pub(crate) struct JobDirs {
    prefix: String,
}

impl JobDirs {
    /// The job directories of the executor named `executor`.
    pub fn new(executor: &str) -> JobDirs {
        JobDirs {
            prefix: format!("durable-job-{}-", super::attempt::sanitize(executor)),
        }
    }

    /// A new directory in `work_dir` with an empty `out/`, this job's alone.
    pub fn take(&self, work: &WorkDir) -> io::Result<JobDir> {
        let d = JobDir::from(work.tempdir(&self.prefix)?);
        std::fs::create_dir(d.path().join("out"))?;
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every job gets a directory and an `out/` of its own: nothing that
    /// holds an earlier job's directory (its working directory, a
    /// descriptor) or writes by its path reaches a later job's `out/`.
    #[test]
    fn no_job_directory_is_handed_to_a_second_job() {
        let base = tempfile::tempdir().expect("base");
        let work = WorkDir::open(base.path().to_path_buf(), uuid::Uuid::new_v4()).expect("work");
        let dirs = JobDirs::new("py demo");
        let a = dirs.take(&work).expect("take");
        let a_path = a.path().to_path_buf();
        assert!(a_path.join("out").is_dir() && !a_path.join("in").exists());
        assert!(a_path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("durable-job-py_demo-")));
        let held = rustix::fs::open(
            &a_path,
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .expect("hold the job directory");
        drop(a);
        assert!(!a_path.exists(), "the job directory outlived its job");
        let b = dirs.take(&work).expect("take");
        assert_ne!(b.path(), a_path);
        assert!(std::fs::write(a_path.join("out/late.txt"), b"x").is_err());
        let late = rustix::fs::openat(
            &held,
            "out/late.txt",
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
        );
        assert!(late.is_err(), "a file made through the old job directory");
        assert_eq!(
            std::fs::read_dir(b.path().join("out"))
                .expect("out")
                .count(),
            0
        );
    }
}
