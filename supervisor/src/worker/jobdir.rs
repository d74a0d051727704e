//! Job directories: where an attempt's output_dir (and its input
//! artifacts, when it has any) live.
//!
//! A one-shot executor runs *in* its attempt's directory (named after the
//! step run: `durable-<step_run_id>-…`), with `out/` (and `in/`) inside it.
//! A persistent executor runs in its session's directory; each of its jobs
//! gets an output_dir of its own, `durable-job-<executor>-XXXXXX.<tag>`,
//! empty, made for the job and removed after it, and its inputs, if any,
//! go beside it in `durable-job-<executor>-XXXXXX-in.<tag>`. One directory
//! per job, not a directory holding an `out/`: on a filesystem that looks
//! past recently freed inodes when it makes one (ext4 without a journal,
//! as on this project's benchmark host), each directory made and removed
//! made every later `mkdir` slower, and two per job cost persistent no-op
//! jobs 10–25 % of their rate (see the issue 7 note).
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
//! no job directory is ever handed to a second job. A late writer in the
//! parent (the worker's `work_dir`) finds no `out/` there to write into.

use std::io;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use super::workdir::WorkDir;

/// A job's (or a one-shot attempt's) directory, removed with all it holds
/// when dropped.
#[derive(Debug)]
pub(crate) struct JobDir {
    path: PathBuf,
    /// The job's `output_dir`: `out/` in `path`, or `path` itself.
    out: PathBuf,
    /// Where its input artifacts go (made only when it has any).
    inputs: PathBuf,
    /// `inputs` is beside `path`, not in it: removed on its own.
    inputs_beside: bool,
}

impl JobDir {
    /// The directory itself: a one-shot process's working directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The job's `output_dir`.
    pub fn out(&self) -> &Path {
        &self.out
    }

    /// Where the job's input artifacts are written.
    pub fn inputs(&self) -> &Path {
        &self.inputs
    }

    /// A one-shot attempt's directory: `out/` and `in/` inside it.
    pub fn attempt(d: TempDir) -> JobDir {
        let path = d.keep();
        JobDir {
            out: path.join("out"),
            inputs: path.join("in"),
            inputs_beside: false,
            path,
        }
    }
}

impl Drop for JobDir {
    fn drop(&mut self) {
        if self.inputs_beside {
            remove(&self.inputs);
        }
        // most jobs leave an empty `out/` and nothing else: an rmdir or
        // two, not remove_dir_all's open, read and stat of each level
        if (self.out == self.path || std::fs::remove_dir(&self.out).is_ok())
            && std::fs::remove_dir(&self.path).is_ok()
        {
            return;
        }
        remove(&self.path);
    }
}

/// Removes `path` and all it holds; a path already gone is no error.
fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_dir_all(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::debug!(path = %path.display(), error = %e, "cannot remove a job directory");
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
        let path = work.tempdir(&self.prefix)?.keep();
        // `durable-job-<executor>-XXXXXX-in.<tag>`: the worker's tag last,
        // as the start-up sweep of a dead worker's entries expects
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let inputs = match name.as_deref().and_then(|n| n.rsplit_once('.')) {
            Some((stem, tag)) => path.with_file_name(format!("{stem}-in.{tag}")),
            None => path.join("in"),
        };
        Ok(JobDir {
            out: path.clone(),
            inputs_beside: inputs.parent() != Some(path.as_path()),
            inputs,
            path,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every job gets an output_dir of its own: nothing that holds an
    /// earlier job's directory (its working directory, a descriptor) or
    /// writes by its path reaches a later job's output_dir.
    #[test]
    fn no_job_directory_is_handed_to_a_second_job() {
        let base = tempfile::tempdir().expect("base");
        let work = WorkDir::open(base.path().to_path_buf(), uuid::Uuid::new_v4()).expect("work");
        let dirs = JobDirs::new("py demo");
        let a = dirs.take(&work).expect("take");
        let a_out = a.out().to_path_buf();
        assert!(a_out.is_dir() && !a.inputs().exists());
        assert_eq!(std::fs::read_dir(&a_out).expect("out").count(), 0);
        assert!(a_out
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("durable-job-py_demo-")));
        let held = rustix::fs::open(
            &a_out,
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .expect("hold the job directory");
        drop(a);
        assert!(!a_out.exists(), "the job directory outlived its job");
        let b = dirs.take(&work).expect("take");
        assert_ne!(b.out(), a_out);
        assert!(std::fs::write(a_out.join("late.txt"), b"x").is_err());
        let late = rustix::fs::openat(
            &held,
            "late.txt",
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
            rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
        );
        assert!(late.is_err(), "a file made through the old job directory");
        assert_eq!(std::fs::read_dir(b.out()).expect("out").count(), 0);
    }

    /// A persistent job's inputs go beside its output_dir (never in it:
    /// it starts empty), under a name the start-up sweep takes for this
    /// worker's, and go with the job, whatever they hold.
    #[test]
    fn a_jobs_inputs_are_beside_its_output_and_go_with_it() {
        let base = tempfile::tempdir().expect("base");
        let id = uuid::Uuid::new_v4();
        let work = WorkDir::open(base.path().to_path_buf(), id).expect("work");
        let d = JobDirs::new("go").take(&work).expect("take");
        let inputs = d.inputs().to_path_buf();
        assert_eq!(inputs.parent(), d.out().parent());
        let name = inputs
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let tag = &id.simple().to_string()[..12];
        assert!(name.starts_with("durable-job-go-"), "{name}");
        assert!(name.ends_with(&format!("-in.{tag}")), "{name}");
        std::fs::create_dir_all(inputs.join("a")).expect("inputs");
        std::fs::write(inputs.join("a/x.txt"), b"in").expect("input");
        std::fs::write(d.out().join("y.txt"), b"out").expect("output");
        let out = d.out().to_path_buf();
        drop(d);
        assert!(!inputs.exists() && !out.exists());
        assert_eq!(
            std::fs::read_dir(base.path()).expect("base").count(),
            1,
            "only the lock file is left"
        );
    }
}
