//! Which filesystem a path is on, read from `/proc/self/mountinfo`: for the
//! worker's start-up advice on `work_dir` and the benchmarks' setup line.
//!
//! Every job makes a directory in `work_dir` and removes it after (a new
//! one per job: PROTOCOL, "Working directory"). On ext4 *without a journal*
//! the kernel, making an inode, steps one by one over every inode of the
//! group freed in the last 5 s (300 s while their inode table block is not
//! yet written back: `recently_deleted` in `fs/ext4/ialloc.c`), so at a
//! high job rate each directory costs more than the last. In a profile of
//! persistent no-op jobs at 64 concurrent on such a host, `mkdir` and
//! `rmdir` were about a third of the worker's own CPU. A journaled ext4,
//! xfs or tmpfs does not do this.

use std::path::{Path, PathBuf};

/// The filesystem a path is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filesystem {
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Its type (`ext4`, `tmpfs`, `xfs`, …).
    pub fstype: String,
    /// What is mounted (`/dev/vda`, `tmpfs`, …).
    pub source: String,
    /// For ext4: whether it has a journal, when the kernel says
    /// (`/proc/fs/jbd2` lists a journaled device's journal); `None` for
    /// other types, or when it cannot tell.
    pub journal: Option<bool>,
}

impl Filesystem {
    /// The filesystem `path` is on (`None` when `/proc` cannot tell).
    pub fn of(path: &Path) -> Option<Filesystem> {
        let path = std::fs::canonicalize(path).ok()?;
        let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let m = mount_of(&info, &path)?;
        let journal = (m.fstype == "ext4").then(|| ext4_journal(&m.dev)).flatten();
        Some(Filesystem {
            mount_point: m.mount_point,
            fstype: m.fstype,
            source: m.source,
            journal,
        })
    }

    /// Ext4 without a journal: each directory made and removed there makes
    /// the next `mkdir` slower while many were removed recently.
    pub fn slow_to_remake_directories(&self) -> bool {
        self.fstype == "ext4" && self.journal == Some(false)
    }

    /// As the benchmarks' setup line gives it: `ext4 (/dev/vda on /, no
    /// journal)`.
    pub fn describe(&self) -> String {
        let journal = match self.journal {
            Some(true) => ", journaled",
            Some(false) => ", no journal",
            None => "",
        };
        format!(
            "{} ({} on {}{journal})",
            self.fstype,
            self.source,
            self.mount_point.display()
        )
    }
}

/// One line of mountinfo, the fields this module reads.
#[derive(Debug, PartialEq, Eq)]
struct Mount {
    dev: String,
    mount_point: PathBuf,
    fstype: String,
    source: String,
}

/// The mount `path` (absolute, canonical) is on: the last listed of those
/// with the longest mount point that holds it (a later mount over the same
/// point hides the earlier).
fn mount_of(mountinfo: &str, path: &Path) -> Option<Mount> {
    let mut best: Option<Mount> = None;
    for line in mountinfo.lines() {
        let Some(m) = parse_line(line) else { continue };
        if !path.starts_with(&m.mount_point) {
            continue;
        }
        let longer = best.as_ref().is_none_or(|b| {
            m.mount_point.components().count() >= b.mount_point.components().count()
        });
        if longer {
            best = Some(m);
        }
    }
    best
}

/// `36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw`:
/// the fourth field is the device, the fifth the mount point; after the
/// optional fields' `-`, the type and the source.
fn parse_line(line: &str) -> Option<Mount> {
    let (head, tail) = line.split_once(" - ")?;
    let head: Vec<&str> = head.split(' ').collect();
    let mut tail = tail.split(' ');
    Some(Mount {
        dev: (*head.get(2)?).to_string(),
        mount_point: PathBuf::from(unescape(head.get(4)?)),
        fstype: tail.next()?.to_string(),
        source: unescape(tail.next()?),
    })
}

/// mountinfo writes a space, tab, newline and backslash in a path as
/// `\040`, `\011`, `\012` and `\134`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                u8::try_from(v).ok()
            });
        match octal {
            Some(v) => {
                out.push(v);
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether the ext4 filesystem on device `dev` (`major:minor`) has a
/// journal: jbd2 lists each journal it runs in `/proc/fs/jbd2` as
/// `<block device>-<journal inode>`. `None` when that cannot be read.
fn ext4_journal(dev: &str) -> Option<bool> {
    let link = std::fs::read_link(format!("/sys/dev/block/{dev}")).ok()?;
    let name = link.file_name()?.to_string_lossy().into_owned();
    let journals = std::fs::read_dir("/proc/fs/jbd2").ok()?;
    Some(journals.flatten().any(|e| {
        e.file_name()
            .to_string_lossy()
            .strip_prefix(name.as_str())
            .is_some_and(|rest| rest.starts_with('-'))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683784k
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
30 25 0:27 / /dev/shm rw,relatime - tmpfs shm2 rw,size=24683784k
41 27 8:1 / /srv/my\\040jobs rw,relatime shared:1 master:2 - xfs /dev/sdb1 rw
";

    #[test]
    fn a_path_is_on_the_longest_mount_point_that_holds_it() {
        let cases: &[(&str, &str, &str, &str)] = &[
            ("/tmp", "/", "ext4", "/dev/vda"),
            ("/", "/", "ext4", "/dev/vda"),
            // the later of two mounts over one point hides the earlier
            ("/dev/shm/x", "/dev/shm", "tmpfs", "shm2"),
            // a prefix of a name is not a parent
            ("/dev/shmem", "/", "ext4", "/dev/vda"),
            // escaped spaces; optional fields before the separator
            ("/srv/my jobs/w", "/srv/my jobs", "xfs", "/dev/sdb1"),
        ];
        for (path, mount_point, fstype, source) in cases {
            let m = mount_of(INFO, Path::new(path)).expect(path);
            assert_eq!(m.mount_point, PathBuf::from(mount_point), "{path}");
            assert_eq!(m.fstype, *fstype, "{path}");
            assert_eq!(m.source, *source, "{path}");
        }
        assert_eq!(
            mount_of(INFO, Path::new("/tmp")).map(|m| m.dev),
            Some("254:0".into())
        );
        assert!(mount_of("garbage\n", Path::new("/")).is_none());
    }

    #[test]
    fn only_ext4_without_a_journal_is_slow_to_remake_directories() {
        let fs = |fstype: &str, journal| Filesystem {
            mount_point: "/".into(),
            fstype: fstype.into(),
            source: "/dev/vda".into(),
            journal,
        };
        assert!(fs("ext4", Some(false)).slow_to_remake_directories());
        assert!(!fs("ext4", Some(true)).slow_to_remake_directories());
        assert!(!fs("ext4", None).slow_to_remake_directories());
        assert!(!fs("tmpfs", None).slow_to_remake_directories());
        assert_eq!(
            fs("ext4", Some(false)).describe(),
            "ext4 (/dev/vda on /, no journal)"
        );
        assert_eq!(fs("tmpfs", None).describe(), "tmpfs (/dev/vda on /)");
    }

    #[test]
    fn this_hosts_temp_dir_is_found() {
        let fs = Filesystem::of(&std::env::temp_dir()).expect("a filesystem");
        assert!(!fs.fstype.is_empty());
        assert!(std::env::temp_dir()
            .canonicalize()
            .expect("canonical")
            .starts_with(&fs.mount_point));
    }
}
