//! The worker's open-file limit, and how its allocator gives large blocks
//! back.
//!
//! Each child costs the worker three pipe ends for as long as it runs (six
//! descriptors for a moment at its start), beside its database connections,
//! job directories and the listener: a worker at concurrency 500 needs
//! some 1,600 descriptors. Service managers start a process with a soft
//! `RLIMIT_NOFILE` of 1,024 (systemd's default since v240, below a hard
//! limit of 524,288), which a few hundred concurrent one-shot steps exceed:
//! every spawn then failed `EMFILE` and the spawn breaker paused the worker
//! while its hard limit allowed hundreds of times more. As Go's runtime
//! (1.19+), nginx and most servers do, the worker raises its soft limit to
//! its hard limit at start, and gives its children the limit it was started
//! with: a program that still uses `select(2)` breaks on a descriptor above
//! 1,023, so a raised limit is the child's own choice to make.

use std::sync::OnceLock;

/// The limit this process was started with, once it was raised (`None`:
/// not raised, children inherit the process's own).
static STARTED_WITH: OnceLock<Option<libc::rlimit>> = OnceLock::new();

/// The kernel's ceiling for any process (`fs.nr_open`'s default): a hard
/// limit of "unlimited" cannot be a soft one.
const NR_OPEN_DEFAULT: libc::rlim_t = 1 << 20;

/// What [`raise_open_file_limit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenFileLimit {
    /// The soft limit was raised from `from` to `to`.
    Raised { from: u64, to: u64 },
    /// It already was the hard limit (or as high as the kernel takes).
    AlreadyAtMost(u64),
    /// The kernel refused to raise it: the limit stays `at`.
    Refused { at: u64, errno: i32 },
}

fn get() -> Option<libc::rlimit> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the rlimit we own.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0).then_some(r)
}

fn set(r: &libc::rlimit) -> Result<(), i32> {
    // SAFETY: setrlimit reads the rlimit we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, r) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit (at most
/// 2^20 for an unlimited one, where `fs.nr_open` refuses more), once per
/// process; children started afterwards get the limit it had before.
pub fn raise_open_file_limit() -> OpenFileLimit {
    let Some(now) = get() else {
        return OpenFileLimit::Refused { at: 0, errno: 0 };
    };
    let mut target = now.rlim_max;
    if target == libc::RLIM_INFINITY {
        target = NR_OPEN_DEFAULT;
    }
    if now.rlim_cur == libc::RLIM_INFINITY || now.rlim_cur >= target {
        return OpenFileLimit::AlreadyAtMost(now.rlim_cur);
    }
    let raised = libc::rlimit {
        rlim_cur: target,
        rlim_max: now.rlim_max,
    };
    match set(&raised) {
        Ok(()) => {
            // the first raise remembers what the process started with; a
            // second worker in the same process finds it raised already
            let _ = STARTED_WITH.set(Some(now));
            OpenFileLimit::Raised {
                from: now.rlim_cur,
                to: target,
            }
        }
        Err(errno) => OpenFileLimit::Refused {
            at: now.rlim_cur,
            errno,
        },
    }
}

/// The limit a child is to be started with, where it differs from this
/// process's own (read before the clone: the child may not allocate).
pub(crate) fn for_children() -> Option<libc::rlimit> {
    STARTED_WITH.get().copied().flatten()
}

/// Allocations at least this large are mapped on their own and unmapped when
/// freed (glibc's initial `M_MMAP_THRESHOLD`, pinned).
pub const MMAP_THRESHOLD: usize = 128 * 1024;

/// Pins glibc's mmap threshold at [`MMAP_THRESHOLD`], so that a large block
/// (an output near `max_frame_bytes`, the buffers that carried it) goes back
/// to the system when freed. By default glibc raises the threshold to the
/// size of each mapped block freed (up to 32 MiB), after which blocks that
/// large are taken from and kept in its heaps: a worker that wrote outputs
/// near the frame limit at concurrency 4 stayed at ~270 MB for the rest of
/// its life (persistent-pool audit; ~14 MB, a fresh worker's, with this and
/// the buffers given back).
/// A `MALLOC_MMAP_THRESHOLD_` in the environment is the operator's choice and
/// is left as it is. Returns whether the threshold was set.
pub fn return_large_frees_to_the_system() -> bool {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return false;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let Ok(threshold) = libc::c_int::try_from(MMAP_THRESHOLD) else {
            return false;
        };
        // SAFETY: mallopt only sets a tunable of glibc's allocator, under
        // the allocator's own lock; no memory is handed over.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, threshold) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibcs_mmap_threshold_is_pinned_unless_the_environment_sets_it() {
        let operator_set = std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some();
        assert_eq!(return_large_frees_to_the_system(), !operator_set);
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one_and_remembered_for_children() {
        let Some(before) = get() else { return };
        match raise_open_file_limit() {
            OpenFileLimit::Raised { from, to } => {
                assert_eq!(from, before.rlim_cur);
                let after = get().expect("getrlimit");
                assert_eq!(after.rlim_cur, to);
                assert_eq!(after.rlim_max, before.rlim_max);
                let child = for_children().expect("the limit for children");
                assert_eq!(child.rlim_cur, from);
            }
            OpenFileLimit::AlreadyAtMost(at) => assert_eq!(at, before.rlim_cur),
            OpenFileLimit::Refused { .. } => {}
        }
        // a second call finds it raised
        assert!(matches!(
            raise_open_file_limit(),
            OpenFileLimit::AlreadyAtMost(_) | OpenFileLimit::Refused { .. }
        ));
    }
}
