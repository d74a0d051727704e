//! Which steps an executor can run (S05). Pure: used when building the lease
//! routes from a probed hello, and again when a freshly spawned executor says
//! hello, before any job is sent.

use std::collections::BTreeMap;

use crate::config::ExecutorConfig;
use crate::db::{OtherExecutor, Route, SecretFilter};
use crate::wire::{Hello, PROTOCOL_VERSION};

/// The labels an executor offers: its hello's labels plus the host labels the
/// worker config adds (the config wins on a conflict: it describes the host).
pub fn effective_labels(hello: &Hello, cfg: &ExecutorConfig) -> BTreeMap<String, String> {
    let mut labels = hello.labels.clone();
    labels.extend(cfg.labels.clone());
    labels
}

/// The lease routes of one probed executor.
pub fn routes(hello: &Hello, cfg: &ExecutorConfig) -> Vec<Route> {
    let labels = effective_labels(hello, cfg);
    let mut kinds: Vec<&String> = hello
        .kinds
        .iter()
        .filter(|k| cfg.kinds.as_ref().is_none_or(|only| only.contains(k)))
        .collect();
    kinds.sort();
    kinds.dedup();
    kinds
        .into_iter()
        .map(|k| Route {
            executor_kind: hello.executor_kind.clone(),
            kind: k.clone(),
            labels: labels.clone(),
        })
        .collect()
}

/// The [`SecretFilter`] of each of one executor's routes (by position):
/// what it may hand out and, for each other executor of the worker serving
/// the route's executor_kind and kind, the labels it offers there and what
/// it may hand out (none when it is alone; the lease statement also looks at
/// the other live workers' registered executors). `others`: the other
/// executors' routes and allowed secrets.
pub fn secret_filters(
    routes: &[Route],
    secrets: &[String],
    others: &[(Vec<Route>, Vec<String>)],
) -> Vec<Option<SecretFilter>> {
    routes
        .iter()
        .map(|r| {
            let serving: Vec<OtherExecutor> = others
                .iter()
                .flat_map(|(routes, secrets)| {
                    routes
                        .iter()
                        .filter(|o| o.executor_kind == r.executor_kind && o.kind == r.kind)
                        .map(|o| OtherExecutor {
                            labels: o.labels.clone(),
                            secrets: secrets.clone(),
                        })
                })
                .collect();
            Some(SecretFilter {
                mine: secrets.to_vec(),
                others: serving,
            })
        })
        .collect()
}

/// Whether the executor that said `hello` may run a step; the reason when not.
pub fn check(
    hello: &Hello,
    cfg: &ExecutorConfig,
    executor_kind: &str,
    kind: &str,
    step_labels: &BTreeMap<String, String>,
) -> Result<(), String> {
    if hello.protocol_version != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} is not the supervisor's {}",
            hello.protocol_version, PROTOCOL_VERSION
        ));
    }
    if hello.executor_kind != executor_kind {
        return Err(format!(
            "executor_kind {:?} cannot run a step for {:?}",
            hello.executor_kind, executor_kind
        ));
    }
    if !hello.kinds.iter().any(|k| k == kind) {
        return Err(format!(
            "kind {kind:?} is not among the executor's kinds {:?}",
            hello.kinds
        ));
    }
    if let Some(only) = &cfg.kinds {
        if !only.iter().any(|k| k == kind) {
            return Err(format!(
                "kind {kind:?} is not enabled for executor {:?} in the worker config",
                cfg.name
            ));
        }
    }
    let offered = effective_labels(hello, cfg);
    for (k, v) in step_labels {
        match offered.get(k) {
            Some(have) if have == v => {}
            Some(have) => {
                return Err(format!(
                    "label {k}={v} required, executor offers {k}={have}"
                ))
            }
            None => {
                return Err(format!(
                    "label {k}={v} required, executor does not offer {k}"
                ))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn hello(ek: &str, kinds: &[&str], labels: &[(&str, &str)]) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            executor_kind: ek.into(),
            kinds: kinds.iter().map(|s| s.to_string()).collect(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            sdk_name: "t".into(),
            sdk_version: "0".into(),
            max_jobs_per_process: 1,
            pid: 1,
            protocol_versions: Vec::new(),
            features: Vec::new(),
            max_frame_bytes: 0,
        }
    }

    fn cfg(labels: &[(&str, &str)], kinds: Option<&[&str]>) -> ExecutorConfig {
        toml::from_str::<ExecutorConfig>("name = \"x\"\ncommand = \"x\"\n")
            .map(|mut c| {
                c.labels = labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                c.kinds = kinds.map(|ks| ks.iter().map(|s| s.to_string()).collect());
                c
            })
            .expect("config")
    }

    fn l(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn matrix() {
        let h = hello("go", &["a", "b"], &[("zone", "a")]);
        let c = cfg(&[("gpu", "true")], None);
        assert!(check(&h, &c, "go", "a", &l(&[])).is_ok());
        assert!(check(&h, &c, "go", "b", &l(&[("zone", "a"), ("gpu", "true")])).is_ok());
        assert!(check(&h, &c, "python", "a", &l(&[])).is_err());
        assert!(check(&h, &c, "go", "c", &l(&[])).is_err());
        assert!(check(&h, &c, "go", "a", &l(&[("zone", "b")])).is_err());
        assert!(check(&h, &c, "go", "a", &l(&[("ssd", "yes")])).is_err());
        let restricted = cfg(&[], Some(&["b"]));
        assert!(check(&h, &restricted, "go", "a", &l(&[])).is_err());
        let mut old = h.clone();
        old.protocol_version = 2;
        assert!(check(&old, &c, "go", "a", &l(&[])).is_err());
    }

    #[test]
    fn routes_follow_kinds_and_labels() {
        let h = hello("go", &["b", "a", "a"], &[("zone", "a")]);
        let r = routes(&h, &cfg(&[("zone", "z")], Some(&["a"])));
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].kind, "a");
        assert_eq!(r[0].labels, l(&[("zone", "z")]));
    }
}
