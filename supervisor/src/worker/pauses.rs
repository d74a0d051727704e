//! What this worker leases nothing for now, and why, for `status` to tell.
//!
//! A step whose every offering worker had paused its executor (a command
//! that cannot be started, a hello that changed) or itself (a `work_dir`
//! that takes no directory) read "due since …: waiting for a worker to
//! lease it", and nothing said why none did. The breakers say so here; one
//! writer task records the latest picture in `durable.workers.paused`
//! (executor name, or [`WHOLE_WORKER`], to `{"why", "since"}`), so a burst
//! of failures is one write, and a write that fails is tried again with
//! whatever is true by then.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{Shared, DB_CALL_TIMEOUT};
use crate::db::bounded;

/// The key of a pause of the whole worker (its `work_dir`).
pub(crate) const WHOLE_WORKER: &str = "*";

/// At most this many characters of a reason are recorded.
const WHY_CHARS: usize = 300;

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
struct Pause {
    why: String,
    since: DateTime<Utc>,
}

#[derive(Default)]
pub(crate) struct Pauses {
    now: Mutex<BTreeMap<String, Pause>>,
    changed: Notify,
}

impl Pauses {
    /// `key` pauses for `why`; a pause already on keeps its start.
    pub(crate) fn set(&self, key: &str, why: &str) {
        let why: String = why.chars().take(WHY_CHARS).collect();
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        match now.get_mut(key) {
            Some(p) if p.why == why => return,
            Some(p) => p.why = why,
            None => {
                now.insert(
                    key.to_owned(),
                    Pause {
                        why,
                        since: Utc::now(),
                    },
                );
            }
        }
        drop(now);
        self.changed.notify_one();
    }

    /// `key` leases again.
    pub(crate) fn clear(&self, key: &str) {
        let removed = self
            .now
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key)
            .is_some();
        if removed {
            self.changed.notify_one();
        }
    }

    fn snapshot(&self) -> serde_json::Value {
        let now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::to_value(&*now).unwrap_or_else(|_| serde_json::json!({}))
    }
}

/// Records each change of `shared.pauses` until `stop`.
pub(crate) async fn publish_loop(shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = shared.pauses.changed.notified() => {}
        }
        // one warning per outage (the database away: every other loop of
        // the worker says so too), tried again every second meanwhile
        let mut failed = false;
        loop {
            let picture = shared.pauses.snapshot();
            let write = bounded(
                DB_CALL_TIMEOUT,
                "recording what the worker paused",
                shared.db.set_worker_paused(shared.id, &picture),
            );
            match write.await {
                Ok(()) => break,
                Err(e) => {
                    if !std::mem::replace(&mut failed, true) {
                        warn!(error = %e, "cannot record what this worker paused; status may not say why its steps wait until it can");
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_keeps_its_start_and_only_a_change_is_written() {
        let p = Pauses::default();
        p.set("go", "cannot start: ENOENT");
        let first = p.snapshot();
        assert_eq!(first["go"]["why"], "cannot start: ENOENT");
        // the same reason again (a burst of failures): nothing to write
        p.set("go", "cannot start: ENOENT");
        assert_eq!(p.snapshot(), first);
        // another reason: the same start
        p.set("go", "cannot start: EMFILE");
        let second = p.snapshot();
        assert_eq!(second["go"]["why"], "cannot start: EMFILE");
        assert_eq!(second["go"]["since"], first["go"]["since"]);
        p.set(WHOLE_WORKER, &"x".repeat(1000));
        assert_eq!(
            p.snapshot()[WHOLE_WORKER]["why"]
                .as_str()
                .map(|w| w.chars().count()),
            Some(WHY_CHARS)
        );
        p.clear("go");
        p.clear(WHOLE_WORKER);
        assert_eq!(p.snapshot(), serde_json::json!({}));
    }
}
