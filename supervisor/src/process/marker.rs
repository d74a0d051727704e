//! The marker every child carries in its environment, and the identity of the
//! supervisor process that started it.
//!
//! A [`Spawner`](super::Spawner) started with a [`Marker`] sets three
//! variables on every child (overriding whatever the spawn spec says for
//! those names), which its descendants inherit unless they clear their
//! environment:
//!
//! | variable | value |
//! |---|---|
//! | [`SLOT_ENV`] | the stable identity of the worker on this host (its configured name) |
//! | [`INSTANCE_ENV`] | the id of this incarnation (the worker id, a UUID) |
//! | [`SUPERVISOR_ENV`] | `<pid>.<starttime>.<pid-namespace inode>` of the supervisor process |
//!
//! The sweep ([`super::sweep_previous_incarnations`]) reads them back from
//! `/proc/<pid>/environ`: a process whose slot is ours and whose instance is
//! not is a leftover of a previous incarnation — unless its supervisor
//! process is verifiably still alive (two live workers configured with the
//! same name on one host), in which case it is spared. The supervisor
//! identity is only ever used to *spare* processes, never to pick one to
//! kill: `pid` plus start time names one process across pid reuse, and the
//! pid-namespace inode tells whether that pid is even meaningful here.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock, PoisonError};

use super::group;

/// Environment variable naming the worker's stable identity on this host.
pub const SLOT_ENV: &str = "DURABLE_SUPERVISOR_SLOT";
/// Environment variable naming the incarnation (worker id) that spawned the process.
pub const INSTANCE_ENV: &str = "DURABLE_SUPERVISOR_INSTANCE";
/// Environment variable naming the supervisor process (`pid.starttime.pidns`).
pub const SUPERVISOR_ENV: &str = "DURABLE_SUPERVISOR_PROCESS";

/// What a marked [`Spawner`](super::Spawner) stamps on every child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Marker {
    /// Stable identity of this worker on this host (the worker's `name`):
    /// the same across restarts.
    pub slot: String,
    /// This incarnation (e.g. the worker id): different on every start.
    pub instance: String,
}

impl Marker {
    /// Refuses values that cannot travel in an environment variable, and an
    /// empty slot or instance (which would match nothing, or everything).
    pub(crate) fn validate(&self) -> Result<(), String> {
        for (what, value) in [("slot", &self.slot), ("instance", &self.instance)] {
            if value.is_empty() {
                return Err(format!("the marker {what} is empty"));
            }
            if value.contains('\0') {
                return Err(format!("the marker {what} {value:?} contains a NUL byte"));
            }
        }
        Ok(())
    }

    /// The variables set on every child.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        vec![
            (SLOT_ENV.to_string(), self.slot.clone()),
            (INSTANCE_ENV.to_string(), self.instance.clone()),
            (SUPERVISOR_ENV.to_string(), self_identity().to_string()),
        ]
    }
}

/// One process, identified across pid reuse: pid, start time (clock ticks
/// after boot) and the inode of the pid namespace the pid belongs to (0 if
/// unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ProcessIdentity {
    pub(crate) pid: i32,
    pub(crate) starttime: u64,
    pub(crate) pidns: u64,
}

impl std::fmt::Display for ProcessIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.pid, self.starttime, self.pidns)
    }
}

impl std::str::FromStr for ProcessIdentity {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        let mut it = s.split('.');
        let pid = it.next().ok_or(())?.parse().map_err(|_| ())?;
        let starttime = it.next().ok_or(())?.parse().map_err(|_| ())?;
        let pidns = it.next().ok_or(())?.parse().map_err(|_| ())?;
        if it.next().is_some() || pid <= 0 {
            return Err(());
        }
        Ok(ProcessIdentity {
            pid,
            starttime,
            pidns,
        })
    }
}

/// Whether the process an identity names is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Liveness {
    Alive,
    Dead,
    /// It lives (or lived) in another pid namespace: its pid means nothing here.
    Unknown,
}

impl ProcessIdentity {
    pub(crate) fn liveness(&self) -> Liveness {
        let me = self_identity();
        if self.pidns != 0 && me.pidns != 0 && self.pidns != me.pidns {
            return Liveness::Unknown;
        }
        if *self == me {
            return Liveness::Alive;
        }
        match group::read_stat(self.pid) {
            Some(st) if !st.is_dead() && st.starttime == self.starttime => Liveness::Alive,
            _ => Liveness::Dead,
        }
    }
}

/// The identity of this process (computed once).
pub(crate) fn self_identity() -> ProcessIdentity {
    static ME: OnceLock<ProcessIdentity> = OnceLock::new();
    *ME.get_or_init(|| {
        let pid = std::process::id() as i32;
        ProcessIdentity {
            pid,
            starttime: group::read_stat(pid).map_or(0, |s| s.starttime),
            pidns: pidns_inode("self").unwrap_or(0),
        }
    })
}

/// Inode of `/proc/<who>/ns/pid` (`pid:[4026531836]`).
fn pidns_inode(who: &str) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/{who}/ns/pid")).ok()?;
    let s = link.to_str()?;
    s.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// A marker read back from a process's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FoundMarker {
    pub(crate) slot: String,
    pub(crate) instance: String,
    /// `None` when the variable is missing or malformed.
    pub(crate) supervisor: Option<ProcessIdentity>,
}

/// The marker in a NUL-separated environment block (`/proc/<pid>/environ`),
/// if it has both a slot and an instance.
pub(crate) fn parse_environ(environ: &[u8]) -> Option<FoundMarker> {
    let (mut slot, mut instance, mut supervisor) = (None, None, None);
    for var in environ.split(|&b| b == 0) {
        let Some(eq) = var.iter().position(|&b| b == b'=') else {
            continue;
        };
        let (name, value) = (&var[..eq], &var[eq + 1..]);
        let value = || String::from_utf8_lossy(value).into_owned();
        match name {
            n if n == SLOT_ENV.as_bytes() => slot = Some(value()),
            n if n == INSTANCE_ENV.as_bytes() => instance = Some(value()),
            n if n == SUPERVISOR_ENV.as_bytes() => supervisor = value().parse().ok(),
            _ => {}
        }
    }
    Some(FoundMarker {
        slot: slot?,
        instance: instance?,
        supervisor,
    })
}

/// The marker of process `pid`, from `/proc/<pid>/environ` (as it is now).
/// `None` if it has none, is gone, is a zombie (empty environ) or is not
/// readable (another user's process).
pub(crate) fn read_marker(pid: i32) -> Option<FoundMarker> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    parse_environ(&environ)
}

/// Instances of markers used by spawners of this process: never a previous
/// incarnation, whatever their slot.
static OUR_INSTANCES: Mutex<Option<HashSet<String>>> = Mutex::new(None);

pub(crate) fn register_instance(instance: &str) {
    OUR_INSTANCES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashSet::new)
        .insert(instance.to_string());
}

pub(crate) fn is_our_instance(instance: &str) -> bool {
    OUR_INSTANCES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .is_some_and(|set| set.contains(instance))
}

/// Short, filesystem-safe tag of a slot for cgroup names: 12 hex digits of
/// its SHA-256 (the slot itself may hold any character).
pub(crate) fn slot_tag(slot: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(&Sha256::digest(slot.as_bytes())[..6])
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn environ_marker_is_parsed() {
        let env = b"PATH=/bin\0DURABLE_SUPERVISOR_SLOT=w=1\0DURABLE_SUPERVISOR_INSTANCE=abc\0DURABLE_SUPERVISOR_PROCESS=12.345.678\0";
        assert_eq!(
            parse_environ(env),
            Some(FoundMarker {
                slot: "w=1".into(),
                instance: "abc".into(),
                supervisor: Some(ProcessIdentity {
                    pid: 12,
                    starttime: 345,
                    pidns: 678
                })
            })
        );
        let partial = b"DURABLE_SUPERVISOR_SLOT=w\0DURABLE_SUPERVISOR_PROCESS=garbage";
        assert_eq!(parse_environ(partial), None);
        let no_sup = b"DURABLE_SUPERVISOR_SLOT=w\0DURABLE_SUPERVISOR_INSTANCE=i\0DURABLE_SUPERVISOR_PROCESS=1.2";
        assert_eq!(parse_environ(no_sup).and_then(|m| m.supervisor), None);
        assert_eq!(parse_environ(b""), None);
    }

    #[test]
    fn identity_round_trips_and_self_is_alive() {
        let me = self_identity();
        assert_eq!(me.pid, std::process::id() as i32);
        assert!(me.starttime > 0);
        assert_eq!(me.to_string().parse::<ProcessIdentity>(), Ok(me));
        assert_eq!(me.liveness(), Liveness::Alive);
        let reused = ProcessIdentity {
            starttime: me.starttime + 1,
            ..me
        };
        assert_eq!(reused.liveness(), Liveness::Dead);
        let elsewhere = ProcessIdentity {
            pidns: me.pidns.wrapping_add(1),
            ..me
        };
        assert_eq!(elsewhere.liveness(), Liveness::Unknown);
        assert!("0.1.2".parse::<ProcessIdentity>().is_err());
        assert!("1.2.3.4".parse::<ProcessIdentity>().is_err());
    }

    #[test]
    fn markers_are_validated() {
        let ok = Marker {
            slot: "host:worker/1".into(),
            instance: "i".into(),
        };
        assert!(ok.validate().is_ok());
        let empty = Marker {
            slot: String::new(),
            instance: "i".into(),
        };
        assert!(empty.validate().is_err());
        let nul = Marker {
            slot: "a".into(),
            instance: "b\0".into(),
        };
        assert!(nul.validate().is_err());
        assert_eq!(slot_tag("x").len(), 12);
        assert_ne!(slot_tag("x"), slot_tag("y"));
    }
}
