//! Job directories: where an attempt's output_dir (and its input
//! artifacts, when it has any) live.
//!
//! A one-shot executor runs *in* its attempt's directory (named after the
//! step run: `durable-<step_run_id>-…`), with `out/` (and `in/`) inside it.
//! A persistent executor runs in its session's directory; each of its jobs
//! gets an output_dir of its own, `durable-job-<executor>-XXXXXX.<tag>`,
//! empty, made for the job and removed after it, and its inputs, if any,
//! go beside it in a directory made for them (0700, under a random name of
//! its own, `durable-job-<executor>-in-XXXXXX.<tag>`: a name derived from
//! the output_dir's could be made first by another user of a shared
//! `work_dir`, audit 82). One directory
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
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use tempfile::TempDir;

use super::workdir::WorkDir;

/// A job's (or a one-shot attempt's) directory, removed with all it holds
/// when dropped, and its inputs' directory, made when it has inputs.
#[derive(Debug)]
pub(crate) struct JobDir {
    path: PathBuf,
    /// The job's `output_dir`: `out/` in `path`, or `path` itself.
    out: PathBuf,
    inputs: Inputs,
}

/// Where a job's input artifacts go.
#[derive(Debug)]
enum Inputs {
    /// `in/` in the attempt's own (0700) directory, removed with it.
    Inside { path: PathBuf, made: bool },
    /// A directory of its own in `work_dir`, beside the job's output_dir,
    /// under a name of its own (`<prefix>XXXXXX.<tag>`), made when the job
    /// has inputs: not one derived from the output_dir's name, which
    /// another user of a shared `work_dir` could make first (audit 82).
    Beside {
        prefix: String,
        made: Option<PathBuf>,
    },
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

    /// A one-shot attempt's directory: `out/` (and, when it has inputs,
    /// `in/`) inside it.
    pub fn attempt(d: TempDir) -> JobDir {
        let path = d.keep();
        JobDir {
            out: path.join("out"),
            inputs: Inputs::Inside {
                path: path.join("in"),
                made: false,
            },
            path,
        }
    }

    /// The directory the job's input artifacts are written to, made now
    /// (once; 0700, by this call and no one else: a directory already
    /// there under that name is an error, never taken as it is).
    pub fn make_inputs(&mut self, work: &WorkDir) -> io::Result<PathBuf> {
        match &mut self.inputs {
            Inputs::Inside { path, made } => {
                if !*made {
                    std::fs::DirBuilder::new().mode(0o700).create(&*path)?;
                    *made = true;
                }
                Ok(path.clone())
            }
            Inputs::Beside { prefix, made } => {
                if let Some(p) = made {
                    return Ok(p.clone());
                }
                let p = work.tempdir(prefix)?.keep();
                *made = Some(p.clone());
                Ok(p)
            }
        }
    }
}

impl Drop for JobDir {
    fn drop(&mut self) {
        if let Inputs::Beside { made: Some(p), .. } = &self.inputs {
            remove(p);
        }
        // most jobs leave an empty output_dir and nothing else: an rmdir or
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

    /// A new, empty output_dir in `work_dir`, this job's alone; its inputs'
    /// directory is made beside it when it has inputs.
    pub fn take(&self, work: &WorkDir) -> io::Result<JobDir> {
        let path = work.tempdir(&self.prefix)?.keep();
        Ok(JobDir {
            out: path.clone(),
            inputs: Inputs::Beside {
                prefix: format!("{}in-", self.prefix),
                made: None,
            },
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
        assert!(a_out.is_dir());
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
    /// it starts empty), in a directory made for them alone (0700) under a
    /// name of its own that the start-up sweep takes for this worker's, and
    /// go with the job, whatever they hold.
    #[test]
    fn a_jobs_inputs_are_beside_its_output_and_go_with_it() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().expect("base");
        let id = uuid::Uuid::new_v4();
        let work = WorkDir::open(base.path().to_path_buf(), id).expect("work");
        let mut d = JobDirs::new("go").take(&work).expect("take");
        assert_eq!(
            std::fs::read_dir(base.path()).expect("base").count(),
            2,
            "no inputs yet"
        );
        let inputs = d.make_inputs(&work).expect("inputs");
        assert_eq!(d.make_inputs(&work).expect("again"), inputs, "made once");
        assert_eq!(inputs.parent(), d.out().parent());
        let name = inputs
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let tag = &id.simple().to_string()[..12];
        assert!(name.starts_with("durable-job-go-in-"), "{name}");
        assert!(name.ends_with(&format!(".{tag}")), "{name}");
        let mode = std::fs::metadata(&inputs)
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
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

    /// An inputs directory is never one someone else made first: its name
    /// is not derived from the output_dir's (audit 82: another user of a
    /// shared work_dir made `<output_dir>-in` first, 0777, and read and
    /// could change the inputs), and a one-shot attempt's `in/` is made
    /// exclusively in its own 0700 directory.
    #[test]
    fn an_inputs_directory_made_first_by_someone_else_is_not_taken() {
        let base = tempfile::tempdir().expect("base");
        let work = WorkDir::open(base.path().to_path_buf(), uuid::Uuid::new_v4()).expect("work");
        let mut d = JobDirs::new("go").take(&work).expect("take");
        // whatever name a squatter derives from the output_dir's
        let out_name = d
            .out()
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let (stem, tag) = out_name.rsplit_once('.').expect("tag");
        let squats = [
            base.path().join(format!("{stem}-in.{tag}")),
            base.path().join(format!("{out_name}.in")),
            base.path().join(format!("{out_name}-in")),
        ];
        for s in &squats {
            std::fs::create_dir(s).expect("squat");
        }
        let inputs = d.make_inputs(&work).expect("inputs");
        assert!(!squats.contains(&inputs), "{}", inputs.display());
        drop(d);
        let mut a = JobDir::attempt(work.tempdir("durable-x-").expect("attempt"));
        std::fs::create_dir(a.path().join("in")).expect("in/ made first");
        assert!(
            a.make_inputs(&work).is_err(),
            "an in/ already there is taken"
        );
    }
}
