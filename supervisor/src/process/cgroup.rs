//! Optional cgroup v2 containment: each child in a cgroup of its own.
//!
//! A process group does not hold a child that calls `setsid` (or `setpgid`)
//! — such an escapee survives the group SIGKILL. A cgroup does: a process
//! cannot leave it without write access to the hierarchy. So where the host
//! allows it, every child runs in its own cgroup
//! `<our own cgroup>/durable-<slot tag>-<supervisor>-<seq>`; it starts in
//! it (`clone3` with `CLONE_INTO_CGROUP`), or, where `clone3` is refused,
//! joins it itself between clone and exec (writing `0` to `cgroup.procs`):
//! either way before exec, so nothing it forks can be outside (see
//! `vfork.rs`, also for why the write is only the fallback), and the stop
//! sequence is: SIGKILL to the process group (as always), then `1` to
//! `cgroup.kill` (escapees), reap the leader, then remove the cgroup once it
//! is empty.
//!
//! **Detection, once per process**, on the first spawn ([`cgroup_mode`]),
//! logged once at info. The mode is [`CgroupMode::PerChild`] when all of:
//! this process is on a cgroup v2 hierarchy (`0::<path>` in
//! `/proc/self/cgroup`) that is mounted and visible (`/proc/self/mountinfo`
//! — `/sys/fs/cgroup` on unified hosts, `/sys/fs/cgroup/unified` on hybrid
//! ones); our cgroup is the root or a plain `domain` cgroup without
//! controllers enabled for its children; we may write its `cgroup.procs`; a
//! probe sub-cgroup can be created and has `cgroup.kill` (Linux ≥ 5.14).
//! Otherwise — cgroup v1 only, the hierarchy mounted read-only (the default
//! in unprivileged containers), no permission, an old kernel, or
//! `DURABLE_CGROUPS=off` in the environment — it is
//! [`CgroupMode::ProcessGroupsOnly`] and everything works as before with
//! process groups alone: the only difference is that a `setsid` escapee of
//! a running worker is not ended when its attempt stops (the next
//! incarnation's sweep ends it if it still carries the marker).
//!
//! About the "no internal processes" rule: it forbids a non-root cgroup to
//! hold processes *and* distribute controllers to children. We never enable
//! controllers, so a child cgroup of ours may hold the executor while our own
//! cgroup holds us; the root cgroup is exempt anyway. Only a non-root own
//! cgroup that already has controllers in `cgroup.subtree_control` (which
//! cannot hold processes, i.e. a threaded or otherwise odd setup) makes us
//! fall back.
//!
//! Cgroups named for a supervisor that is dead (pid + start time) are
//! garbage once empty: detection removes them (any slot), and so does every
//! sweep; a populated one is only killed by the sweep of its own slot.
//!
//! If moving a child in fails at runtime even though detection succeeded,
//! the child runs without a cgroup, and cgroups are switched off for the
//! rest of the process (logged once at warn).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use super::marker::{self, ProcessIdentity};

/// Set to `off` to never use cgroups.
pub const CGROUPS_ENV: &str = "DURABLE_CGROUPS";

/// Prefix of the cgroups this module creates.
const PREFIX: &str = "durable-";

/// How long removal waits for a killed cgroup to become empty.
pub(crate) const EMPTY_GRACE: Duration = Duration::from_secs(1);

const REMOVE_POLL: Duration = Duration::from_millis(5);

/// How children are contained, detected once per process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupMode {
    /// Each child in its own cgroup under `parent` (this process's cgroup);
    /// stopping a child also writes its `cgroup.kill`.
    PerChild { parent: PathBuf },
    /// Process groups only.
    ProcessGroupsOnly { reason: String },
}

impl std::fmt::Display for CgroupMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CgroupMode::PerChild { parent } => write!(
                f,
                "a cgroup v2 per child under {} (cgroup.kill on stop)",
                parent.display()
            ),
            CgroupMode::ProcessGroupsOnly { reason } => {
                write!(f, "process groups only, no cgroups ({reason})")
            }
        }
    }
}

/// Where the cgroup v2 hierarchy is and where we are in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hierarchy {
    /// Mount point of the cgroup2 filesystem.
    mount_point: PathBuf,
    /// Path (in `/proc/self/cgroup` terms) of the mount's root.
    mount_root: String,
    /// Our cgroup, as in `/proc/self/cgroup`.
    own_rel: String,
    /// Our cgroup's directory.
    own_dir: PathBuf,
}

impl Hierarchy {
    /// The directory of a cgroup given as in `/proc/<pid>/cgroup`, if it is
    /// inside the part of the hierarchy we can see.
    pub(crate) fn dir_of(&self, rel: &str) -> Option<PathBuf> {
        let inside = strip_path_prefix(rel, &self.mount_root)?;
        Some(join_rel(&self.mount_point, &inside))
    }

    pub(crate) fn own_dir(&self) -> &Path {
        &self.own_dir
    }
}

struct State {
    /// What detection found (fixed).
    detected: CgroupMode,
    /// What is in use now (cgroups may be switched off after a failure).
    mode: CgroupMode,
    hierarchy: Option<Hierarchy>,
}

static STATE: OnceLock<Mutex<State>> = OnceLock::new();

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE
        .get_or_init(|| {
            let (mode, hierarchy) = match detect() {
                Ok(h) => (
                    CgroupMode::PerChild {
                        parent: h.own_dir.clone(),
                    },
                    Some(h),
                ),
                Err(reason) => (CgroupMode::ProcessGroupsOnly { reason }, None),
            };
            tracing::info!(mode = %mode, "child process containment");
            if let Some(h) = &hierarchy {
                let removed = collect_garbage(h);
                if removed > 0 {
                    tracing::info!(removed, "removed empty cgroups of dead supervisors");
                }
            }
            Mutex::new(State {
                detected: mode.clone(),
                mode,
                hierarchy,
            })
        })
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// How this process contains its children (detected on first use, then fixed
/// — except that a runtime failure to move a child switches cgroups off).
pub fn cgroup_mode() -> CgroupMode {
    state().mode.clone()
}

/// What detection found at first use (before any runtime switch-off).
#[cfg(test)]
pub(crate) fn detected_mode() -> CgroupMode {
    state().detected.clone()
}

/// The hierarchy, when children get cgroups.
pub(crate) fn hierarchy() -> Option<Hierarchy> {
    state().hierarchy.clone()
}

/// Switches cgroups off for the rest of the process (logged once).
pub(crate) fn disable(reason: String) {
    let mut st = state();
    if st.hierarchy.take().is_some() {
        tracing::warn!(%reason, detected = %st.detected, "cgroups switched off: children get process groups only");
        st.mode = CgroupMode::ProcessGroupsOnly { reason };
    }
}

fn detect() -> Result<Hierarchy, String> {
    if std::env::var(CGROUPS_ENV).is_ok_and(|v| v.eq_ignore_ascii_case("off")) {
        return Err(format!("{CGROUPS_ENV}=off"));
    }
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    let h = locate(&cgroup, &mountinfo)?;
    probe(&h)?;
    Ok(h)
}

/// Our place in the cgroup v2 hierarchy, from `/proc/self/cgroup` and
/// `/proc/self/mountinfo` (pure, for tests).
pub(crate) fn locate(proc_cgroup: &str, mountinfo: &str) -> Result<Hierarchy, String> {
    let own_rel = v2_path(proc_cgroup)
        .ok_or("this process is not on a cgroup v2 hierarchy (cgroup v1 only)")?;
    let mut best: Option<(String, PathBuf)> = None;
    for (root, point) in cgroup2_mounts(mountinfo) {
        if strip_path_prefix(&own_rel, &root).is_some()
            && best.as_ref().is_none_or(|(r, _)| root.len() > r.len())
        {
            best = Some((root, point));
        }
    }
    let (mount_root, mount_point) = best.ok_or_else(|| {
        format!(
            "no mounted cgroup2 filesystem shows our cgroup {own_rel} (is /sys/fs/cgroup mounted?)"
        )
    })?;
    let own_dir = join_rel(
        &mount_point,
        &strip_path_prefix(&own_rel, &mount_root).unwrap_or_default(),
    );
    Ok(Hierarchy {
        mount_point,
        mount_root,
        own_rel,
        own_dir,
    })
}

fn probe(h: &Hierarchy) -> Result<(), String> {
    let own = &h.own_dir;
    // The root cgroup has no cgroup.type; it is exempt from the
    // no-internal-processes rule.
    let is_root = !own.join("cgroup.type").exists();
    if !is_root {
        let kind = std::fs::read_to_string(own.join("cgroup.type"))
            .map_err(|e| format!("cannot read {}/cgroup.type: {e}", own.display()))?;
        if kind.trim() != "domain" {
            return Err(format!(
                "our cgroup {} is of type {:?}, not a plain domain",
                own.display(),
                kind.trim()
            ));
        }
        let subtree = std::fs::read_to_string(own.join("cgroup.subtree_control"))
            .map_err(|e| format!("cannot read {}/cgroup.subtree_control: {e}", own.display()))?;
        if !subtree.trim().is_empty() {
            return Err(format!(
                "our cgroup {} distributes controllers ({}) to its children: the no-internal-processes rule",
                own.display(),
                subtree.trim()
            ));
        }
    }
    let procs = own.join("cgroup.procs");
    if !writable(&procs) {
        return Err(format!(
            "no write permission on {} (cannot move children out of our cgroup)",
            procs.display()
        ));
    }
    let probe = own.join(format!("{PREFIX}probe-{}", std::process::id()));
    match std::fs::create_dir(&probe) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(format!(
                "cannot create a sub-cgroup in {}: {e}",
                own.display()
            ))
        }
    }
    let has_kill = probe.join("cgroup.kill").exists();
    let child_procs_writable = writable(&probe.join("cgroup.procs"));
    if let Err(e) = std::fs::remove_dir(&probe) {
        tracing::warn!(cgroup = %probe.display(), error = %e, "cannot remove the probe cgroup");
    }
    if !has_kill {
        return Err("the kernel has no cgroup.kill (needs Linux 5.14)".into());
    }
    if !child_procs_writable {
        return Err(format!(
            "no write permission on the cgroup.procs of a new sub-cgroup of {}",
            own.display()
        ));
    }
    Ok(())
}

fn writable(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: valid NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

/// The `0::<path>` entry of a `/proc/<pid>/cgroup` file.
pub(crate) fn v2_path(proc_cgroup: &str) -> Option<String> {
    proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_end().to_string())
        .filter(|p| p.starts_with('/'))
}

/// `(root, mount point)` of every cgroup2 mount in a mountinfo file.
fn cgroup2_mounts(mountinfo: &str) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.get(sep + 1) != Some(&"cgroup2") {
            continue;
        }
        if let (Some(root), Some(point)) = (fields.get(3), fields.get(4)) {
            out.push((unescape(root), PathBuf::from(unescape(point))));
        }
    }
    out
}

/// Undoes mountinfo's octal escapes (`\040` is a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `base/rel`, or `base` itself for an empty `rel` (no trailing slash).
fn join_rel(base: &Path, rel: &str) -> PathBuf {
    if rel.is_empty() {
        base.to_path_buf()
    } else {
        base.join(rel)
    }
}

/// `path` below `prefix`, component-wise, as a relative path ("" for equal).
fn strip_path_prefix(path: &str, prefix: &str) -> Option<String> {
    let p = prefix.trim_end_matches('/');
    let rest = path.strip_prefix(p)?;
    if rest.is_empty() {
        return Some(String::new());
    }
    rest.strip_prefix('/').map(str::to_string)
}

/// The name of the cgroup for the `seq`-th child of `supervisor` with `tag`.
pub(crate) fn child_name(tag: &str, supervisor: &ProcessIdentity, seq: u64) -> String {
    format!("{PREFIX}{tag}-{supervisor}-{seq}")
}

/// The slot tag and supervisor of a cgroup name made by [`child_name`].
pub(crate) fn parse_child_name(name: &str) -> Option<(&str, ProcessIdentity)> {
    let rest = name.strip_prefix(PREFIX)?;
    let mut it = rest.split('-');
    let tag = it.next()?;
    let supervisor = it.next()?.parse().ok()?;
    let _seq: u64 = it.next()?.parse().ok()?;
    if it.next().is_some() {
        return None;
    }
    Some((tag, supervisor))
}

/// One child's cgroup. Only this module creates and removes them.
#[derive(Debug)]
pub(crate) struct ChildCgroup {
    dir: PathBuf,
    /// As in `/proc/<pid>/cgroup`, to verify a child really is inside.
    rel: String,
}

impl ChildCgroup {
    /// Creates `<own cgroup>/<name>`.
    pub(crate) fn create(h: &Hierarchy, name: &str) -> io::Result<ChildCgroup> {
        let dir = h.own_dir.join(name);
        std::fs::create_dir(&dir)?;
        let rel = if h.own_rel.ends_with('/') {
            format!("{}{name}", h.own_rel)
        } else {
            format!("{}/{name}", h.own_rel)
        };
        Ok(ChildCgroup { dir, rel })
    }

    /// An existing cgroup directory (a previous incarnation's).
    pub(crate) fn existing(dir: PathBuf) -> ChildCgroup {
        ChildCgroup {
            dir,
            rel: String::new(),
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<dir>/cgroup.procs` as a C string, for the child's join before exec.
    pub(crate) fn procs_path(&self) -> io::Result<CString> {
        CString::new(self.dir.join("cgroup.procs").as_os_str().as_bytes())
            .map_err(|_| io::Error::other("cgroup path contains a NUL byte"))
    }

    /// Whether process `pid` is in this cgroup now.
    pub(crate) fn contains(&self, pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|s| v2_path(&s))
            .is_some_and(|p| p == self.rel)
    }

    /// Writes `1` to `cgroup.kill`: SIGKILL to every process in it. A cgroup
    /// that is already gone is success.
    pub(crate) fn kill(&self) -> io::Result<()> {
        match std::fs::write(self.dir.join("cgroup.kill"), b"1") {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    pub(crate) fn kill_logged(&self) {
        if let Err(e) = self.kill() {
            tracing::warn!(cgroup = %self.dir.display(), error = %e, "cannot write cgroup.kill");
        }
    }

    /// One `rmdir`: `Ok(true)` if removed (or already gone), `Ok(false)` if
    /// it still has processes.
    pub(crate) fn try_remove(&self) -> io::Result<bool> {
        match std::fs::remove_dir(&self.dir) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Removes it once empty, waiting (asynchronously) up to `within`.
    pub(crate) async fn remove_when_empty(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            match self.try_remove() {
                Ok(true) => return true,
                Ok(false) if Instant::now() < deadline => tokio::time::sleep(REMOVE_POLL).await,
                result => return self.removal_failed(result),
            }
        }
    }

    /// [`remove_when_empty`](Self::remove_when_empty) for plain threads.
    pub(crate) fn remove_blocking_logged(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            match self.try_remove() {
                Ok(true) => return true,
                Ok(false) if Instant::now() < deadline => std::thread::sleep(REMOVE_POLL),
                result => return self.removal_failed(result),
            }
        }
    }

    pub(crate) fn remove_now_logged(&self) {
        if let Ok(false) | Err(_) = self.try_remove() {
            tracing::debug!(cgroup = %self.dir.display(), "cgroup not removed yet; left for a later sweep");
        }
    }

    fn removal_failed(&self, result: io::Result<bool>) -> bool {
        match result {
            Ok(true) => true,
            Ok(false) => {
                tracing::warn!(cgroup = %self.dir.display(), "cgroup still has processes after cgroup.kill; left in place");
                false
            }
            Err(e) => {
                tracing::warn!(cgroup = %self.dir.display(), error = %e, "cannot remove cgroup");
                false
            }
        }
    }
}

/// Child cgroups of our own cgroup that belong to slot `tag` and whose
/// supervisor is dead (a previous incarnation's leftovers).
pub(crate) fn stale_children(h: &Hierarchy, tag: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(&h.own_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name();
            let (t, sup) = parse_child_name(name.to_str()?)?;
            (t == tag && sup.liveness() == marker::Liveness::Dead).then(|| e.path())
        })
        .collect()
}

/// Removes every *empty* child cgroup of our own cgroup that one of these
/// supervisors made (by name) and whose supervisor is dead, whatever its
/// slot: leftovers of a supervisor killed before it could remove them.
/// Never kills anything (`rmdir` refuses a cgroup with processes; those are
/// for the slot's next sweep). Returns how many were removed.
pub(crate) fn collect_garbage(h: &Hierarchy) -> usize {
    let Ok(entries) = std::fs::read_dir(&h.own_dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some((_, sup)) = name.to_str().and_then(parse_child_name) else {
            continue;
        };
        if sup.liveness() != marker::Liveness::Dead {
            continue;
        }
        if let Ok(true) = ChildCgroup::existing(e.path()).try_remove() {
            removed += 1;
        }
    }
    removed
}

/// The cgroup directory of process `pid`, if it is one of ours (by name)
/// for slot `tag` whose supervisor is dead.
pub(crate) fn stale_cgroup_of(h: &Hierarchy, pid: i32, tag: &str) -> Option<PathBuf> {
    let rel = v2_path(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)?;
    let name = rel.rsplit('/').next()?;
    let (t, sup) = parse_child_name(name)?;
    if t != tag || sup.liveness() != marker::Liveness::Dead {
        return None;
    }
    h.dir_of(&rel)
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    const HYBRID: &str = "\
25 31 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:39 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
";
    const UNIFIED_NS: &str = "\
30 25 0:26 /../.. /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw
31 25 0:27 / /mnt/my\\040cg rw - cgroup2 cgroup2 rw
";

    #[test]
    fn locates_the_hierarchy() {
        let h = locate("4:memory:/x\n0::/\n", HYBRID).unwrap();
        assert_eq!(h.own_dir, PathBuf::from("/sys/fs/cgroup/unified"));
        assert_eq!(
            h.dir_of("/a/b"),
            Some(PathBuf::from("/sys/fs/cgroup/unified/a/b"))
        );

        let h = locate("0::/system.slice/w.service\n", UNIFIED_NS).unwrap();
        assert_eq!(
            h.own_dir,
            PathBuf::from("/mnt/my cg/system.slice/w.service")
        );

        let err = locate("4:memory:/x\n", HYBRID).unwrap_err();
        assert!(err.contains("v1"), "{err}");
        let err = locate("0::/x\n", "1 2 0:1 / /proc rw - proc proc rw\n").unwrap_err();
        assert!(err.contains("no mounted cgroup2"), "{err}");
    }

    #[test]
    fn prefixes_are_component_wise() {
        assert_eq!(strip_path_prefix("/a/b", "/"), Some("a/b".into()));
        assert_eq!(strip_path_prefix("/a/b", "/a"), Some("b".into()));
        assert_eq!(strip_path_prefix("/a", "/a"), Some(String::new()));
        assert_eq!(strip_path_prefix("/ab", "/a"), None);
    }

    #[test]
    fn child_names_round_trip() {
        let sup = ProcessIdentity {
            pid: 42,
            starttime: 7,
            pidns: 9,
        };
        let name = child_name("0123456789ab", &sup, 3);
        assert_eq!(name, "durable-0123456789ab-42.7.9-3");
        assert_eq!(parse_child_name(&name), Some(("0123456789ab", sup)));
        assert_eq!(parse_child_name("durable-probe-12"), None);
        assert_eq!(parse_child_name("other-0123-42.7.9-3"), None);
    }
}
